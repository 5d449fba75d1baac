#version 450
// GET_ROWS: out[.., i, :] = a[.., idx[i], :] dequantized to F32 (I32 copied); ids in B.
// An out-of-range id gives a row of zeros and sets error bit 1 (the stream raises).
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint TA = 0u;
layout(constant_id = 1) const uint TD = 0u;
layout(push_constant) uniform PC {
    uvec4 ned; uvec4 nba; uvec4 nbb; uvec4 nbd; uint offa; uint offb; uint offd; uint nrows;
} pc;

void main() {
    uint i = global_id();
    if (i >= nelements(pc.ned)) return;
    uvec4 e = unravel(i, pc.ned);
    int r = Bi[pc.offb + e.y * pc.nbb.x + e.z * pc.nbb.y + e.w * pc.nbb.z];
    uint d = pc.offd + offset4(e, pc.nbd);
    if (r < 0 || uint(r) >= pc.nrows) {
        if (e.x == 0u) report_error(1u);
        if (TD == T_I32) Di[d] = 0; else Df[d] = 0.0;
        return;
    }
    uint row = pc.offa + uint(r) * pc.nba.y + e.z * pc.nba.z + e.w * pc.nba.w;
    if (TD == T_I32) Di[d] = Ai[row + e.x * pc.nba.x];
    else if (is_quant(TA)) Df[d] = A_load_row(TA, row, e.x);
    else Df[d] = A_load(TA, row + e.x * pc.nba.x);
}
