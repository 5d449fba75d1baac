#version 450
// GLU (SWIGLU, GEGLU): act(x) * g, with x and g from two tensors or from the two halves of
// a's rows (offsets xo/go within the row, in elements).
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint OP = 0u;  // 0 swiglu, 1 geglu
layout(constant_id = 1) const uint TA = 0u;
layout(constant_id = 2) const uint TB = 0u;  // type of the gate tensor (if separate)
layout(constant_id = 3) const uint SPLIT = 1u;  // 1: x and g are halves of a's rows
layout(push_constant) uniform PC {
    uvec4 ne; uvec4 nba; uvec4 nbb; uvec4 nbd; uint offa; uint offb; uint offd; uint xo; uint go;
} pc;

void main() {
    uint i = global_id();
    if (i >= nelements(pc.ne)) return;
    uvec4 idx = unravel(i, pc.ne);
    float x, g;
    if (SPLIT != 0u) {
        uint a = pc.offa + offset4(idx, pc.nba);
        x = A_load(TA, a + pc.xo * pc.nba.x);
        g = A_load(TA, a + pc.go * pc.nba.x);
    } else {
        x = A_load(TA, pc.offa + offset4(idx, pc.nba));
        g = B_load(TB, pc.offb + offset4(idx, pc.nbb));
    }
    float act = OP == 0u ? x / (1.0 + exp(-x)) : gelu(x);
    D_store(TA, pc.offd + offset4(idx, pc.nbd), act * g);
}
