#version 450
// CPY into Q8_0 / Q4_0: one invocation per destination block of 32 values, which are taken
// from the source in row-major flat order (any source strides).
#include "common.glsl"
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint TA = 0u;
layout(constant_id = 1) const uint TD = 8u;
layout(push_constant) uniform PC { uvec4 nea; uvec4 nba; uvec4 ned; uvec4 nbd; uint offa; uint offd; } pc;

void main() {
    uint nblk = pc.ned.x / 32u;
    uint i = global_id();
    if (i >= nblk * pc.ned.y * pc.ned.z * pc.ned.w) return;
    uvec4 b = unravel(i, uvec4(nblk, pc.ned.y, pc.ned.z, pc.ned.w));
    uint flat0 = ((b.w * pc.ned.z + b.z) * pc.ned.y + b.y) * pc.ned.x + b.x * 32u;
    float x[32];
    for (uint j = 0u; j < 32u; ++j) x[j] = A_load(TA, pc.offa + offset4(unravel(flat0 + j, pc.nea), pc.nba));
    uint w = pc.offd + b.y * pc.nbd.y + b.z * pc.nbd.z + b.w * pc.nbd.w + b.x * (TD == T_Q8_0 ? 17u : 9u);
    D_quantize_block(TD, w, x);
}
