#version 450
// MUL_MAT for many columns: 64x64 output tiles, K in steps of 16 through shared memory (a's
// rows dequantized on the way in), 4x4 outputs per invocation.
#include "common.glsl"
layout(local_size_x = 256) in;
#define BM 64u
#define BN 64u
#define BK 16u
layout(constant_id = 0) const uint TA = 0u;
layout(constant_id = 1) const uint TB = 0u;
layout(push_constant) uniform PC {
    uvec4 ne; uvec4 nba; uvec4 nbb; uvec4 nbd; uint K; uint offa; uint offb; uint offd; uint r2; uint r3;
} pc;

shared float As[BK * BM];
shared float Bs[BK * BN];

void main() {
    uint M = pc.ne.x, N = pc.ne.y;
    uint tm = (M + BM - 1u) / BM, tn = (N + BN - 1u) / BN;
    uint lin = group_id();
    if (lin >= tm * tn * pc.ne.z * pc.ne.w) return;
    uint m0 = (lin % tm) * BM;
    uint n0 = ((lin / tm) % tn) * BN;
    uint batch = lin / (tm * tn);
    uint i2 = batch % pc.ne.z, i3 = batch / pc.ne.z;
    uint abase = pc.offa + (i2 / pc.r2) * pc.nba.z + (i3 / pc.r3) * pc.nba.w;
    uint bbase = pc.offb + i2 * pc.nbb.z + i3 * pc.nbb.w;
    uint t = gl_LocalInvocationID.x;
    uint tx = t % 16u, ty = t / 16u;

    float acc[4][4];
    for (uint i = 0u; i < 4u; ++i) for (uint j = 0u; j < 4u; ++j) acc[i][j] = 0.0;

    for (uint k0 = 0u; k0 < pc.K; k0 += BK) {
        for (uint l = 0u; l < 4u; ++l) {
            uint e = t + l * 256u;
            uint mm = e / BK, kk = e % BK;
            uint m = m0 + mm, k = k0 + kk;
            As[kk * BM + mm] = (m < M && k < pc.K) ? A_load_row(TA, abase + m * pc.nba.y, k) : 0.0;
            uint n = n0 + mm;
            Bs[kk * BN + mm] = (n < N && k < pc.K) ? B_load(TB, bbase + n * pc.nbb.y + k * pc.nbb.x) : 0.0;
        }
        barrier();
        for (uint kk = 0u; kk < BK; ++kk) {
            float a[4], b[4];
            for (uint i = 0u; i < 4u; ++i) a[i] = As[kk * BM + ty * 4u + i];
            for (uint j = 0u; j < 4u; ++j) b[j] = Bs[kk * BN + tx * 4u + j];
            for (uint i = 0u; i < 4u; ++i) for (uint j = 0u; j < 4u; ++j) acc[i][j] += a[i] * b[j];
        }
        barrier();
    }
    for (uint i = 0u; i < 4u; ++i) {
        uint m = m0 + ty * 4u + i;
        if (m >= M) continue;
        for (uint j = 0u; j < 4u; ++j) {
            uint n = n0 + tx * 4u + j;
            if (n < N) Df[pc.offd + m * pc.nbd.x + n * pc.nbd.y + i2 * pc.nbd.z + i3 * pc.nbd.w] = acc[i][j];
        }
    }
}
