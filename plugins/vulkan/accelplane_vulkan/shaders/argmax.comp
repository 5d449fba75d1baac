#version 450
// ARGMAX of each row (first index of the maximum; NaN counts as -inf, as ggml skips it).
#include "common.glsl"
#define BLOCK 128u
layout(local_size_x = 128) in;
#include "reduce.glsl"
layout(push_constant) uniform PC { uvec4 ne; uvec4 nba; uint offa; uint offd; uint nbd1; } pc;

void main() {
    uint row = group_id();
    if (row >= pc.ne.y) return;
    uint t = gl_LocalInvocationID.x;
    float best = -1.0 / 0.0;
    uint bi = 0xFFFFFFFFu;
    for (uint i = t; i < pc.ne.x; i += BLOCK) {
        float v = Af[pc.offa + row * pc.nba.y + i * pc.nba.x];
        if (isnan(v)) v = -1.0 / 0.0;
        if (v > best || (v == best && i < bi)) { best = v; bi = i; }
    }
    red_v[t] = best;
    red_i[t] = bi;
    barrier();
    for (uint s = BLOCK / 2u; s > 0u; s >>= 1) {
        if (t < s) {
            float v = red_v[t + s];
            uint j = red_i[t + s];
            if (v > red_v[t] || (v == red_v[t] && j < red_i[t])) { red_v[t] = v; red_i[t] = j; }
        }
        barrier();
    }
    if (t == 0u) Di[pc.offd + row * pc.nbd1] = int(red_i[0] == 0xFFFFFFFFu ? 0u : red_i[0]);
}
