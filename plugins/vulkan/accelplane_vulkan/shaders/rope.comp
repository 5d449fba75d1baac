#version 450
// ROPE (normal and NEOX) with YaRN, one invocation per pair of elements; positions (I32,
// one per token along ne2) in binding B; with FF, frequency factors (F32, one per rotated
// pair: ggml's c) in binding C. Dimensions past n_dims are copied.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint TA = 0u;  // source and destination type (F32 or F16)
layout(constant_id = 1) const uint NEOX = 0u;
layout(constant_id = 2) const uint FF = 0u;
layout(push_constant) uniform PC {
    uvec4 ne; uvec4 nba; uvec4 nbd; uint offa; uint offb; uint offd; uint nbb0; uint n_dims; uint offc;
    float log2_theta_scale; float freq_scale; float ext_factor; float mscale; float corr_low; float corr_high;
} pc;

void main() {
    uint half_row = (pc.ne.x + 1u) / 2u;
    uint i = global_id();
    if (i >= half_row * pc.ne.y * pc.ne.z * pc.ne.w) return;
    uvec4 idx = unravel(i, uvec4(half_row, pc.ne.y, pc.ne.z, pc.ne.w));
    uint p = idx.x;
    uint a0 = pc.offa + idx.y * pc.nba.y + idx.z * pc.nba.z + idx.w * pc.nba.w;
    uint d0 = pc.offd + idx.y * pc.nbd.y + idx.z * pc.nbd.z + idx.w * pc.nbd.w;
    uint hd = pc.n_dims / 2u;
    if (p >= hd) {  // past the rotated dimensions: copy elements 2p, 2p+1
        for (uint j = 2u * p; j < min(2u * p + 2u, pc.ne.x); ++j) {
            D_store(TA, d0 + j * pc.nbd.x, A_load(TA, a0 + j * pc.nba.x));
        }
        return;
    }
    float pos = float(Bi[pc.offb + idx.z * pc.nbb0]);
    float theta_extrap = pos * exp2(float(p) * pc.log2_theta_scale);
    if (FF != 0u) theta_extrap /= Cf[pc.offc + p];
    float theta = pc.freq_scale * theta_extrap;
    if (pc.ext_factor != 0.0) {
        float y = (float(p) - pc.corr_low) / max(0.001, pc.corr_high - pc.corr_low);
        float ramp = (1.0 - clamp(y, 0.0, 1.0)) * pc.ext_factor;
        theta = theta * (1.0 - ramp) + theta_extrap * ramp;
    }
    float c = cos_(theta) * pc.mscale, s = sin_(theta) * pc.mscale;
    uint j0 = NEOX != 0u ? p : 2u * p;
    uint j1 = NEOX != 0u ? p + hd : 2u * p + 1u;
    float x0 = A_load(TA, a0 + j0 * pc.nba.x), x1 = A_load(TA, a0 + j1 * pc.nba.x);
    D_store(TA, d0 + j0 * pc.nbd.x, x0 * c - x1 * s);
    D_store(TA, d0 + j1 * pc.nbd.x, x0 * s + x1 * c);
}
