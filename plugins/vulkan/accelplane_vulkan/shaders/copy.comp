#version 450
// CPY / CONT / DUP into an element type: dst element f (row-major flat order) takes src
// element f, converted; quantized sources are dequantized; I32 is copied bit for bit.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint TA = 0u;
layout(constant_id = 1) const uint TD = 0u;
layout(push_constant) uniform PC { uvec4 nea; uvec4 nba; uvec4 ned; uvec4 nbd; uint offa; uint offd; } pc;

void main() {
    uint i = global_id();
    if (i >= nelements(pc.ned)) return;
    uvec4 s = unravel(i, pc.nea);
    uint d = pc.offd + offset4(unravel(i, pc.ned), pc.nbd);
    if (TA == T_I32 && TD == T_I32) {
        Di[d] = Ai[pc.offa + offset4(s, pc.nba)];
    } else if (is_quant(TA)) {
        uint row = pc.offa + s.y * pc.nba.y + s.z * pc.nba.z + s.w * pc.nba.w;
        D_store(TD, d, A_load_row(TA, row, s.x));
    } else {
        D_store(TD, d, A_load(TA, pc.offa + offset4(s, pc.nba)));
    }
}
