#version 450
// NORM / RMS_NORM / L2_NORM: one workgroup per row; rows may be anywhere (any strides).
// HAS_W: the norm fused with the MUL that reads it (accelplane.fusion): each result is
// multiplied by B (the MUL's other operand, broadcast over the rows) and D is the MUL's tensor.
#include "common.glsl"
#define BLOCK 128u
layout(local_size_x = 128) in;
#include "reduce.glsl"
layout(constant_id = 0) const uint OP = 0u;  // 0 norm, 1 rms_norm, 2 l2_norm
layout(constant_id = 1) const uint HAS_W = 0u;
layout(push_constant) uniform PC {
    uvec4 ne; uvec4 nba; uvec4 nbd; uvec4 wne; uvec4 nbw; uint offa; uint offd; uint offw; float eps;
} pc;

void main() {
    uint row = group_id();
    if (row >= pc.ne.y * pc.ne.z * pc.ne.w) return;
    uvec4 r = unravel(row, uvec4(pc.ne.y, pc.ne.z, pc.ne.w, 1u));
    uint a0 = pc.offa + r.x * pc.nba.y + r.y * pc.nba.z + r.z * pc.nba.w;
    uint d0 = pc.offd + r.x * pc.nbd.y + r.y * pc.nbd.z + r.z * pc.nbd.w;
    uint w0 = pc.offw + (r.x % pc.wne.y) * pc.nbw.y + (r.y % pc.wne.z) * pc.nbw.z + (r.z % pc.wne.w) * pc.nbw.w;
    uint n = pc.ne.x;
    float mean = 0.0;
    if (OP == 0u) {
        float s = 0.0;
        for (uint i = gl_LocalInvocationID.x; i < n; i += BLOCK) s += Af[a0 + i * pc.nba.x];
        mean = block_sum(s) / float(n);
    }
    float s2 = 0.0;
    for (uint i = gl_LocalInvocationID.x; i < n; i += BLOCK) {
        float x = Af[a0 + i * pc.nba.x] - mean;
        s2 += x * x;
    }
    s2 = block_sum(s2);
    float scale = OP == 2u ? 1.0 / max(sqrt(s2), pc.eps) : 1.0 / sqrt(s2 / float(n) + pc.eps);
    for (uint i = gl_LocalInvocationID.x; i < n; i += BLOCK) {
        float y = (Af[a0 + i * pc.nba.x] - mean) * scale;
        if (HAS_W != 0u) y *= Bf[w0 + (i % pc.wne.x) * pc.nbw.x];
        Df[d0 + i * pc.nbd.x] = y;
    }
}
