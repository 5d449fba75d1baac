#version 450
// SOFT_MAX: one workgroup per row of softmax(a*scale + slope*mask), mask rows broadcast over
// ne2/ne3 by modulo, ALiBi slope per head (ne2) when max_bias > 0.
#include "common.glsl"
#define BLOCK 128u
layout(local_size_x = 128) in;
#include "reduce.glsl"
layout(constant_id = 0) const uint TM = 0xFFFFFFFFu;  // mask type, or none
layout(push_constant) uniform PC {
    uvec4 ne; uvec4 nba; uvec4 nem; uvec4 nbm; uvec4 nbd; uint offa; uint offm; uint offd;
    float scale; float max_bias; float m0; float m1; uint n_head_log2;
} pc;

void main() {
    uint row = group_id();
    if (row >= pc.ne.y * pc.ne.z * pc.ne.w) return;
    uvec4 r = unravel(row, uvec4(pc.ne.y, pc.ne.z, pc.ne.w, 1u));
    uint a0 = pc.offa + r.x * pc.nba.y + r.y * pc.nba.z + r.z * pc.nba.w;
    uint d0 = pc.offd + r.x * pc.nbd.y + r.y * pc.nbd.z + r.z * pc.nbd.w;
    uint m0 = pc.offm + r.x * pc.nbm.y + (r.y % pc.nem.z) * pc.nbm.z + (r.z % pc.nem.w) * pc.nbm.w;
    float slope = 1.0;
    if (pc.max_bias > 0.0) {
        uint h = r.y;
        slope = h < pc.n_head_log2 ? pow(pc.m0, float(h + 1u)) : pow(pc.m1, float(2u * (h - pc.n_head_log2) + 1u));
    }
    uint n = pc.ne.x;
    float mx = -1.0 / 0.0;
    for (uint i = gl_LocalInvocationID.x; i < n; i += BLOCK) {
        float v = Af[a0 + i * pc.nba.x] * pc.scale;
        if (TM != 0xFFFFFFFFu) v += slope * B_load(TM, m0 + i * pc.nbm.x);
        mx = max(mx, v);
    }
    mx = block_max(mx);
    float s = 0.0;
    for (uint i = gl_LocalInvocationID.x; i < n; i += BLOCK) {
        float v = Af[a0 + i * pc.nba.x] * pc.scale;
        if (TM != 0xFFFFFFFFu) v += slope * B_load(TM, m0 + i * pc.nbm.x);
        float e = exp(v - mx);
        Df[d0 + i * pc.nbd.x] = e;
        s += e;
    }
    s = block_sum(s);
    float inv = 1.0 / s;
    // each thread rescales exactly the elements it wrote: no barrier needed
    for (uint i = gl_LocalInvocationID.x; i < n; i += BLOCK) Df[d0 + i * pc.nbd.x] *= inv;
}
