#version 450
// SET_ROWS: dst[.., idx[i], :] = src[.., i, :]; src F32 in A, row ids (I32) in C, dst in D.
// Float destinations: one invocation per element; Q8_0/Q4_0: one per block of 32.
#include "common.glsl"
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint TD = 0u;
layout(push_constant) uniform PC {
    uvec4 nes; uvec4 nbs; uvec4 nei; uvec4 nbi; uvec4 nbd; uint offs; uint offi; uint offd; uint nrows;
} pc;

void main() {
    bool q = is_quant(TD);
    uint per = q ? 32u : 1u;
    uint n0 = pc.nes.x / per;
    uint i = global_id();
    if (i >= n0 * pc.nes.y * pc.nes.z * pc.nes.w) return;
    uvec4 e = unravel(i, uvec4(n0, pc.nes.y, pc.nes.z, pc.nes.w));
    int r = Ci[pc.offi + e.y * pc.nbi.x + (e.z % pc.nei.y) * pc.nbi.y + (e.w % pc.nei.z) * pc.nbi.z];
    if (r < 0 || uint(r) >= pc.nrows) {  // out of range: the row is left alone, error bit 2
        if (e.x == 0u) report_error(2u);
        return;
    }
    uint s0 = pc.offs + e.y * pc.nbs.y + e.z * pc.nbs.z + e.w * pc.nbs.w;
    uint d0 = pc.offd + uint(r) * pc.nbd.y + e.z * pc.nbd.z + e.w * pc.nbd.w;
    if (q) {
        float x[32];
        for (uint j = 0u; j < 32u; ++j) x[j] = Af[s0 + (e.x * 32u + j) * pc.nbs.x];
        D_quantize_block(TD, d0 + e.x * (TD == T_Q8_0 ? 17u : 9u), x);
    } else {
        D_store(TD, d0 + e.x * pc.nbd.x, Af[s0 + e.x * pc.nbs.x]);
    }
}
