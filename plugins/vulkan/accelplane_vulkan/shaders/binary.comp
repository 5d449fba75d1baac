#version 450
// ADD/SUB/MUL/DIV with b repeated over a (ggml_can_repeat): b's index is a's modulo b.ne.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint OP = 0u;  // 0 add, 1 sub, 2 mul, 3 div
layout(constant_id = 1) const uint TA = 0u;
layout(constant_id = 2) const uint TB = 0u;
layout(constant_id = 3) const uint TD = 0u;
layout(push_constant) uniform PC {
    uvec4 ne; uvec4 nba; uvec4 neb; uvec4 nbb; uvec4 nbd; uint offa; uint offb; uint offd;
} pc;

void main() {
    uint i = global_id();
    if (i >= nelements(pc.ne)) return;
    uvec4 idx = unravel(i, pc.ne);
    float a = A_load(TA, pc.offa + offset4(idx, pc.nba));
    float b = B_load(TB, pc.offb + offset4(idx % pc.neb, pc.nbb));
    float r = OP == 0u ? a + b : OP == 1u ? a - b : OP == 2u ? a * b : a / b;
    D_store(TD, pc.offd + offset4(idx, pc.nbd), r);
}
