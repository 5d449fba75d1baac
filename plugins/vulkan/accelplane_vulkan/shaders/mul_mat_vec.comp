#version 450
// MUL_MAT for few columns (and MUL_MAT_ID): one workgroup per weight row and NCOLS columns of
// b; threads split K (float weights: element-strided for coalescing; quantized weights: 32-
// value chunks, one block or K-quant sub-block each) and reduce in shared memory.
// dst[m, n] = sum_k a[m, k] * b[n, k]; a's batch dims broadcast over b's (r2, r3).
// ID mode: column n = (u, t) of ids [n_used, T]; expert ids in C; b column (u % b.ne1, t).
#include "common.glsl"
layout(local_size_x = 64) in;
#define BLOCK 64u
layout(constant_id = 0) const uint TA = 0u;
layout(constant_id = 1) const uint TB = 0u;
layout(constant_id = 2) const uint NCOLS = 1u;
layout(constant_id = 3) const uint ID = 0u;
layout(push_constant) uniform PC {
    uvec4 ne; uvec4 nba; uvec4 nbb; uvec4 nbd; uint K; uint offa; uint offb; uint offd;
    uint r2; uint r3; uint offc; uint nbc0; uint nbc1; uint n_as;
} pc;

shared float red[NCOLS * BLOCK];

void main() {
    uint M = pc.ne.x;
    uint ncb = (pc.ne.y + NCOLS - 1u) / NCOLS;
    uint lin = group_id();
    if (lin >= M * ncb * pc.ne.z * pc.ne.w) return;
    uint m = lin % M;
    uint cb = (lin / M) % ncb;
    uint batch = lin / (M * ncb);
    uint i2 = batch % pc.ne.z, i3 = batch / pc.ne.z;
    uint t = gl_LocalInvocationID.x;

    uint abase;
    uint bb[NCOLS];
    uint db[NCOLS];
    bool ok[NCOLS];
    if (ID != 0u) {  // NCOLS == 1; (u, tok) = (cb, i2)
        int e = Ci[pc.offc + cb * pc.nbc0 + i2 * pc.nbc1];
        db[0] = pc.offd + m * pc.nbd.x + cb * pc.nbd.y + i2 * pc.nbd.z;
        if (e < 0 || uint(e) >= pc.n_as) {  // bad expert id: zeros and error bit 4, no stray read
            if (t == 0u) {
                Df[db[0]] = 0.0;
                if (m == 0u) report_error(4u);
            }
            return;
        }
        abase = pc.offa + m * pc.nba.y + uint(e) * pc.nba.z;
        bb[0] = pc.offb + (cb % pc.r2) * pc.nbb.y + i2 * pc.nbb.z;
        ok[0] = true;
    } else {
        abase = pc.offa + m * pc.nba.y + (i2 / pc.r2) * pc.nba.z + (i3 / pc.r3) * pc.nba.w;
        for (uint c = 0u; c < NCOLS; ++c) {
            uint n = cb * NCOLS + c;
            ok[c] = n < pc.ne.y;
            bb[c] = pc.offb + n * pc.nbb.y + i2 * pc.nbb.z + i3 * pc.nbb.w;
            db[c] = pc.offd + m * pc.nbd.x + n * pc.nbd.y + i2 * pc.nbd.z + i3 * pc.nbd.w;
        }
    }

    // F32 activations with unit stride and 16-byte aligned columns are read as vec4
    bool bvec = TB == T_F32 && pc.nbb.x == 1u;
    for (uint c = 0u; c < NCOLS; ++c) bvec = bvec && (bb[c] % 4u) == 0u;

    float acc[NCOLS];
    for (uint c = 0u; c < NCOLS; ++c) acc[c] = 0.0;
    if (is_quant(TA)) {
        uint be = block_elems(TA), bw = block_words(TA);
        for (uint ch = t; ch < pc.K / 32u; ch += BLOCK) {
            uint k0 = ch * 32u;
            float a[32];
            A_dequant32(TA, abase + (k0 / be) * bw, k0 % be, a);
            for (uint c = 0u; c < NCOLS; ++c) {
                if (!ok[c]) continue;
                float s = 0.0;
                if (bvec) {
                    for (uint j = 0u; j < 8u; ++j) {
                        vec4 b = Bf4[(bb[c] + k0) / 4u + j];
                        s += a[4u * j] * b.x + a[4u * j + 1u] * b.y + a[4u * j + 2u] * b.z + a[4u * j + 3u] * b.w;
                    }
                } else {
                    for (uint j = 0u; j < 32u; ++j) s += a[j] * B_load(TB, bb[c] + (k0 + j) * pc.nbb.x);
                }
                acc[c] += s;
            }
        }
    } else if (pc.K % 8u == 0u && abase % (TA == T_F32 ? 4u : 8u) == 0u) {
        // 16-byte loads of the weights (rows aligned: the usual case)
        for (uint k0 = t * 8u; k0 < pc.K; k0 += BLOCK * 8u) {
            float a[8];
            A_load8(TA, abase + k0, a);
            for (uint c = 0u; c < NCOLS; ++c) {
                if (!ok[c]) continue;
                float s = 0.0;
                if (bvec) {
                    vec4 b0 = Bf4[(bb[c] + k0) / 4u], b1 = Bf4[(bb[c] + k0) / 4u + 1u];
                    s = a[0] * b0.x + a[1] * b0.y + a[2] * b0.z + a[3] * b0.w
                      + a[4] * b1.x + a[5] * b1.y + a[6] * b1.z + a[7] * b1.w;
                } else {
                    for (uint j = 0u; j < 8u; ++j) s += a[j] * B_load(TB, bb[c] + (k0 + j) * pc.nbb.x);
                }
                acc[c] += s;
            }
        }
    } else {
        for (uint k = t; k < pc.K; k += BLOCK) {
            float a = A_load(TA, abase + k);
            for (uint c = 0u; c < NCOLS; ++c) {
                if (ok[c]) acc[c] += a * B_load(TB, bb[c] + k * pc.nbb.x);
            }
        }
    }
    for (uint c = 0u; c < NCOLS; ++c) red[c * BLOCK + t] = acc[c];
    barrier();
    for (uint s = BLOCK / 2u; s > 0u; s >>= 1) {
        if (t < s) {
            for (uint c = 0u; c < NCOLS; ++c) red[c * BLOCK + t] += red[c * BLOCK + t + s];
        }
        barrier();
    }
    if (t == 0u) {
        for (uint c = 0u; c < NCOLS; ++c) {
            if (ok[c]) Df[db[c]] = red[c * BLOCK];
        }
    }
}
