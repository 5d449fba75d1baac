#version 450
// COL2IM_1D: out[b, c, t] = sum of a[b, i, c*K + k] over t + p0 == i*s0 + k.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform PC {
    uvec4 ned; uvec4 nba; uvec4 nbd; uint offa; uint offd; uint s0; uint p0; uint K; uint t_in;
} pc;

void main() {
    uint i = global_id();
    if (i >= nelements(pc.ned)) return;
    uvec4 e = unravel(i, pc.ned);  // (t, c, b)
    float s = 0.0;
    for (uint k = 0u; k < pc.K; ++k) {
        int num = int(e.x + pc.p0) - int(k);
        if (num < 0 || uint(num) % pc.s0 != 0u) continue;
        uint ti = uint(num) / pc.s0;
        if (ti >= pc.t_in) continue;
        s += Af[pc.offa + (e.y * pc.K + k) * pc.nba.x + ti * pc.nba.y + e.z * pc.nba.z];
    }
    Df[pc.offd + offset4(e, pc.nbd)] = s;
}
