#version 450
// CONCAT along dim: elements copied bit for bit (32-bit or 16-bit types).
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint WIDE = 1u;  // 1: 4-byte elements, 0: 2-byte elements
layout(push_constant) uniform PC {
    uvec4 ned; uvec4 nea; uvec4 nba; uvec4 nbb; uvec4 nbd; uint offa; uint offb; uint offd; uint dim;
} pc;

void main() {
    uint i = global_id();
    if (i >= nelements(pc.ned)) return;
    uvec4 e = unravel(i, pc.ned);
    uint d = pc.offd + offset4(e, pc.nbd);
    bool from_a = e[pc.dim] < pc.nea[pc.dim];
    if (!from_a) e[pc.dim] -= pc.nea[pc.dim];
    if (WIDE != 0u) {
        Di[d] = from_a ? Ai[pc.offa + offset4(e, pc.nba)] : Bi[pc.offb + offset4(e, pc.nbb)];
    } else {
        Dh[d] = from_a ? Ah[pc.offa + offset4(e, pc.nba)] : Bh[pc.offb + offset4(e, pc.nbb)];
    }
}
