#version 450
// The activations of a few-column quantized MUL_MAT (b: F32/F16, any strides) as int8 blocks
// for mul_mat_vec_q8: per 32 values of a column, d = max|x| / 127 and q = round(x / d); with
// F16D (Q4_0 and Q8_0 weights) d is stored rounded to f16, as ggml's block_q8_0 holds it.
// Region in D at word offq: the columns' bytes (column c at word c * K/4, packed 4 a word),
// then their scales (column c's at word cols * K/4 + c * K/32). Columns c = n + ne1 * (i2 + ne2 * i3).
// A thread quantizes 8 values; the 4 threads of a block share its maximum in shared memory.
#include "common.glsl"
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint TB = 0u;
layout(constant_id = 1) const uint F16D = 0u;
layout(push_constant) uniform PC { uvec4 ne; uvec4 nb; uint offb; uint offq; } pc;

shared float amax[64];

void main() {
    uint K = pc.ne.x;  // a multiple of 32 (the weights' block size divides it)
    uint cols = pc.ne.y * pc.ne.z * pc.ne.w;
    uint gid = global_id();
    uint t = gl_LocalInvocationID.x;
    bool live = gid < cols * (K / 8u);  // no early return: the barrier below
    uint g = live ? gid : 0u;
    uint c = g / (K / 8u), j0 = (g % (K / 8u)) * 8u;
    uint n = c % pc.ne.y, i2 = (c / pc.ne.y) % pc.ne.z, i3 = c / (pc.ne.y * pc.ne.z);
    uint src = pc.offb + n * pc.nb.y + i2 * pc.nb.z + i3 * pc.nb.w + j0 * pc.nb.x;
    float x[8];
    float m = 0.0;
    for (uint j = 0u; j < 8u; ++j) {
        x[j] = A_load(TB, src + j * pc.nb.x);
        m = max(m, abs(x[j]));
    }
    amax[t] = m;
    barrier();
    uint b0 = t & ~3u;
    m = max(max(amax[b0], amax[b0 + 1u]), max(amax[b0 + 2u], amax[b0 + 3u]));
    float d = m / 127.0;
    float id = d != 0.0 ? 1.0 / d : 0.0;
    uint w[2] = uint[2](0u, 0u);
    for (uint j = 0u; j < 8u; ++j) {
        int q = clamp(int(round(x[j] * id)), -127, 127);
        w[j >> 2] |= (uint(q) & 0xFFu) << (8u * (j & 3u));
    }
    if (live) {
        uint o = pc.offq + c * (K / 4u) + j0 / 4u;
        Di[o] = int(w[0]);
        Di[o + 1u] = int(w[1]);
        if ((j0 & 31u) == 0u) {
            Df[pc.offq + cols * (K / 4u) + c * (K / 32u) + j0 / 32u] = F16D != 0u ? f16_to_f32(f32_to_f16(d)) : d;
        }
    }
}
