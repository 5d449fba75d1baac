#version 450
// SUM_ROWS / MEAN: one workgroup per row; SUM: one workgroup over every element.
#include "common.glsl"
#define BLOCK 128u
layout(local_size_x = 128) in;
#include "reduce.glsl"
layout(constant_id = 0) const uint OP = 0u;  // 0 sum_rows, 1 mean, 2 sum
layout(constant_id = 1) const uint TA = 0u;
layout(push_constant) uniform PC { uvec4 ne; uvec4 nba; uvec4 nbd; uint offa; uint offd; } pc;

void main() {
    uint row = group_id();
    float s = 0.0;
    if (OP == 2u) {
        if (row > 0u) return;
        uint n = nelements(pc.ne);
        for (uint i = gl_LocalInvocationID.x; i < n; i += BLOCK) s += A_load(TA, pc.offa + offset4(unravel(i, pc.ne), pc.nba));
        s = block_sum(s);
        if (gl_LocalInvocationID.x == 0u) Df[pc.offd] = s;
        return;
    }
    if (row >= pc.ne.y * pc.ne.z * pc.ne.w) return;
    uvec4 r = unravel(row, uvec4(pc.ne.y, pc.ne.z, pc.ne.w, 1u));
    uint a0 = pc.offa + r.x * pc.nba.y + r.y * pc.nba.z + r.z * pc.nba.w;
    for (uint i = gl_LocalInvocationID.x; i < pc.ne.x; i += BLOCK) s += A_load(TA, a0 + i * pc.nba.x);
    s = block_sum(s);
    if (OP == 1u) s /= float(pc.ne.x);
    if (gl_LocalInvocationID.x == 0u) Df[pc.offd + r.x * pc.nbd.y + r.y * pc.nbd.z + r.z * pc.nbd.w] = s;
}
