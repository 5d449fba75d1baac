// accelplane SYCL plugin: the pieces of the two-device all-reduce (comm.py)
// (built as one program per kernel after common.cl: program.py)

// x[i] += y[i] (F32, n elements at byte offsets)
__kernel void k_add_f32(gbuf* X, ulong xo, cbuf* Y, ulong yo) {
    size_t i = get_global_id(0);
    ((__global float*)(X + xo))[i] += ((__global const float*)(Y + yo))[i];
}

// x[i] += bf16 y[i]
__kernel void k_add_bf16(gbuf* X, ulong xo, cbuf* Y, ulong yo) {
    size_t i = get_global_id(0);
    ((__global float*)(X + xo))[i] += as_float(((uint)((__global const ushort*)(Y + yo))[i]) << 16);
}

// y[i] = bf16(x[i]); with round_own, x[i] = float(y[i]) too (both peers add the same operands)
__kernel void k_to_bf16(gbuf* Y, ulong yo, gbuf* X, ulong xo, int round_own) {
    size_t i = get_global_id(0);
    __global float* x = (__global float*)(X + xo);
    ushort h = f32_to_bf16(x[i]);
    ((__global ushort*)(Y + yo))[i] = h;
    if (round_own) x[i] = as_float(((uint)h) << 16);
}
