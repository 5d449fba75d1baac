#version 450
// IM2COL: 2-D dst [N, OH, OW, IC*KH*KW], 1-D dst [N, OW, IC*KW]; x (F32) in B, zero padding.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint TD = 0u;
layout(constant_id = 1) const uint IS_2D = 1u;
layout(push_constant) uniform PC {
    uvec4 ned; uvec4 nbx; uvec4 nbd; uint offx; uint offd;
    int s0; int s1; int p0; int p1; int d0; int d1; uint kh; uint kw; uint ih; uint iw;
} pc;

void main() {
    uint i = global_id();
    if (i >= nelements(pc.ned)) return;
    uvec4 e = unravel(i, pc.ned);  // (ic*kh*kw + ky*kw + kx, ow, oh | n, n | 0)
    uint kk = pc.kh * pc.kw;
    uint ic = e.x / kk, ky = (e.x % kk) / pc.kw, kx = e.x % pc.kw;
    int ix = int(e.y) * pc.s0 + int(kx) * pc.d0 - pc.p0;
    float v = 0.0;
    if (IS_2D != 0u) {
        int iy = int(e.z) * pc.s1 + int(ky) * pc.d1 - pc.p1;
        if (ix >= 0 && ix < int(pc.iw) && iy >= 0 && iy < int(pc.ih))
            v = Bf[pc.offx + uint(ix) * pc.nbx.x + uint(iy) * pc.nbx.y + ic * pc.nbx.z + e.w * pc.nbx.w];
    } else if (ix >= 0 && ix < int(pc.iw)) {
        v = Bf[pc.offx + uint(ix) * pc.nbx.x + ic * pc.nbx.y + e.z * pc.nbx.z];
    }
    D_store(TD, pc.offd + offset4(e, pc.nbd), v);
}
