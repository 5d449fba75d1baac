// accelplane SYCL plugin: test support
// (built as one program per kernel after common.cl: program.py)

// a busy loop of n steps (ACCELPLANE_TEST_DELAY_US delays and the plugin's own ordering tests)
__kernel void k_spin(gbuf* out, ulong n) {
    uint x = *(__global uint*)out;  // an LCG from memory: nothing to fold away
    for (ulong i = 0; i < n; ++i) x = x * 1664525u + 1013904223u;
    *(__global uint*)out = x;
}
