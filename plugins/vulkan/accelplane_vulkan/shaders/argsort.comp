#version 450
// ARGSORT, stable: element i of a row goes to position rank(i) = number of elements that
// sort before it (smaller, or equal with a smaller index; larger for DESC; NaN after every
// number in either order, so that ranks never collide and every position is written). No shared memory
// and no barriers, any row length; O(n^2) per row, fine for sampling-sized rows.
#include "common.glsl"
layout(local_size_x = 128) in;
layout(push_constant) uniform PC { uvec4 ne; uvec4 nba; uvec4 nbd; uint offa; uint offd; uint desc; } pc;

void main() {
    uint i = global_id();
    if (i >= nelements(pc.ne)) return;
    uvec4 e = unravel(i, pc.ne);
    uint a0 = pc.offa + e.y * pc.nba.y + e.z * pc.nba.z + e.w * pc.nba.w;
    float x = Af[a0 + e.x * pc.nba.x];
    uint rank = 0u;
    for (uint j = 0u; j < pc.ne.x; ++j) {
        float y = Af[a0 + j * pc.nba.x];
        bool before = isnan(x) ? (!isnan(y) || j < e.x)
                               : !isnan(y) && ((pc.desc != 0u ? y > x : y < x) || (y == x && j < e.x));
        if (before) rank++;
    }
    Di[pc.offd + e.y * pc.nbd.y + e.z * pc.nbd.z + e.w * pc.nbd.w + rank * pc.nbd.x] = int(e.x);
}
