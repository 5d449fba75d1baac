// accelplane CUDA plugin: soft_max and rope, rope optionally straight into a KV cache
// (softmax_rope.py).
#include "common.cuh"

// ---- soft_max with scale, optional mask (broadcast over ne2/ne3) and ALiBi slopes -------------------
// P: [ne0..3, nba0..3, nbd0..3, nem1..3, nbm0..3, has_mask, scale, max_bias, n_head_log2, m0, m1]
// WARP: a warp per row, blockDim.x / 32 rows per block, reductions in registers (short rows:
// attention over a few hundred keys); else a block per row.
template <typename Tm, bool WARP>
__global__ void k_soft_max(const i64* __restrict__ P, char* dst, const char* a, const char* mask) {
    pdl_enter();
    const i64 ne0 = P[0];
    const int lane = WARP ? threadIdx.x & 31 : threadIdx.x, step = WARP ? 32 : blockDim.x;
    i64 r = WARP ? (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5) : (i64)blockIdx.x;
    if (WARP && r >= P[1] * P[2] * P[3]) return;  // (no block-wide barrier follows)
    const i64 i1 = r % P[1]; r /= P[1];
    const i64 i2 = r % P[2]; const i64 i3 = r / P[2];
    const char* s = a + i1 * P[5] + i2 * P[6] + i3 * P[7];
    char* d = dst + i1 * P[9] + i2 * P[10] + i3 * P[11];
    const bool has_mask = P[19] != 0;
    const float scale = (float)pf(P, 20), max_bias = (float)pf(P, 21);
    float slope = 1.0f;
    if (max_bias > 0.0f) {
        const int h = (int)i2, nhl = (int)P[22];
        slope = h < nhl ? powf((float)pf(P, 23), (float)(h + 1)) : powf((float)pf(P, 24), (float)(2 * (h - nhl) + 1));
    }
    const char* m = has_mask ? mask + i1 * P[16] + (i2 % P[13]) * P[17] + (i3 % P[14]) * P[18] : nullptr;
    float mx = -AP_INF;
    for (i64 i = lane; i < ne0; i += step) {
        float v = *(const float*)(s + i * P[4]) * scale;
        if (has_mask) v += slope * ld<Tm>(m + i * P[15]);
        mx = fmaxf(mx, v);
    }
    mx = WARP ? warp_max(mx) : block_max(mx);
    float sum = 0.0f;
    for (i64 i = lane; i < ne0; i += step) {
        float v = *(const float*)(s + i * P[4]) * scale;
        if (has_mask) v += slope * ld<Tm>(m + i * P[15]);
        const float e = expf(v - mx);
        *(float*)(d + i * P[8]) = e;
        sum += e;
    }
    sum = WARP ? warp_sum(sum) : block_sum(sum);
    const float inv = 1.0f / sum;
    for (i64 i = lane; i < ne0; i += step) *(float*)(d + i * P[8]) *= inv;
}

// The elements pair ic rotates (or, past n_dims, copies: false): adjacent ones (normal rope)
// or n_dims / 2 apart (NeoX).
__device__ __forceinline__ bool rope_pair(int ic, int n_dims, bool neox, int& e0, int& e1) {
    if (!neox) {
        e0 = 2 * ic; e1 = e0 + 1;
        return e0 < n_dims;
    }
    if (ic < n_dims / 2) { e0 = ic; e1 = ic + n_dims / 2; return true; }
    e0 = n_dims + 2 * (ic - n_dims / 2); e1 = e0 + 1;
    return false;
}

// P: [ne0..3, nba0..3, nbd0..3, n_dims, mode, freq_scale, ext_factor, attn_factor, corr0, corr1, theta_scale,
//     n_rows, nbr0]. T: the source's element type, TD the result's. rows: when not null, ROPE →
// view → SET_ROWS as one kernel (softmax_rope.py: rope): token i2's result goes to row rows[i2 * nbr0 /
// 4] of dst (P[10] its row stride, n_rows rows; a bad index sets *err), head i1 at P[9].
template <typename T, typename TD>
__global__ void k_rope(const i64* __restrict__ P, char* dst, const char* a, const int* pos, const int* rows,
                       int* err) {
    __shared__ i64 Ps[22];
    pdl_enter_params<22>(P, Ps);
    const i64 half = Ps[0] / 2;
    const i64 n = half * Ps[1] * Ps[2] * Ps[3];
    const int n_dims = (int)Ps[12];
    const bool neox = Ps[13] == 2;
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < n; t += (i64)gridDim.x * blockDim.x) {
        i64 r = t;
        const i64 ic = r % half; r /= half;
        const i64 i1 = r % Ps[1]; r /= Ps[1];
        const i64 i2 = r % Ps[2]; const i64 i3 = r / Ps[2];
        const char* s = a + i1 * Ps[5] + i2 * Ps[6] + i3 * Ps[7];
        i64 drow = i2;
        if (rows) {
            drow = *(const int*)((const char*)rows + i2 * Ps[21]);
            if (drow < 0 || drow >= Ps[20]) { *err = 1; continue; }
        }
        char* d = dst + i1 * Ps[9] + drow * Ps[10] + i3 * Ps[11];
        int e0, e1;
        const bool rot = rope_pair((int)ic, n_dims, neox, e0, e1);
        const float x0 = ld<T>(s + e0 * Ps[4]), x1 = ld<T>(s + e1 * Ps[4]);
        if (!rot) { st<TD>(d + e0 * Ps[8], x0); st<TD>(d + e1 * Ps[8], x1); continue; }
        float cs, sn;
        rope_cs(Ps + 14, (float)pos[i2], (int)ic, cs, sn);
        st<TD>(d + e0 * Ps[8], x0 * cs - x1 * sn);
        st<TD>(d + e1 * Ps[8], x0 * sn + x1 * cs);
    }
}

// RMS_NORM → MUL → ROPE (→ view → SET_ROWS) as one kernel (fuse.py: accelplane.core.fusion's
// norm_rope, qwen3's Q/K head norms), a warp per row (one head of one token): the row's sum of
// squares, then each pair scaled as k_norm_vec scales it (x * rsqrtf(ss / ne0 + eps) * w) and
// rotated and stored as k_rope does (rows mode: into the cache row SET_ROWS names). x: the
// norm's F32 source rows, w: ne0 contiguous F32 weights. P: k_rope's 22 (ne, nb of x), then eps
// (double bits); blockDim a multiple of 32.
template <typename TD>
__global__ void k_norm_rope(const i64* __restrict__ P, char* dst, const char* x, const int* pos, const int* rows,
                            int* err, const float* w) {
    __shared__ i64 Ps[23];
    pdl_enter_params<23>(P, Ps);
    const int lane = threadIdx.x & 31;
    i64 r = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= Ps[1] * Ps[2] * Ps[3]) return;  // (no barrier follows)
    const i64 i1 = r % Ps[1]; r /= Ps[1];
    const i64 i2 = r % Ps[2], i3 = r / Ps[2];
    const char* s = x + i1 * Ps[5] + i2 * Ps[6] + i3 * Ps[7];
    const int ne0 = (int)Ps[0], half = ne0 / 2, n_dims = (int)Ps[12];
    const bool neox = Ps[13] == 2;
    float ss = 0.0f;
    for (int i = lane; i < ne0; i += 32) {
        const float v = *(const float*)(s + i * Ps[4]);
        ss += v * v;
    }
    ss = warp_sum(ss);
    const float scale = rsqrtf(ss / (float)ne0 + (float)pf(Ps, 22));
    i64 drow = i2;
    if (rows) {
        drow = *(const int*)((const char*)rows + i2 * Ps[21]);
        if (drow < 0 || drow >= Ps[20]) { if (lane == 0) *err = 1; return; }
    }
    char* d = dst + i1 * Ps[9] + drow * Ps[10] + i3 * Ps[11];
    const float p = (float)pos[i2];
    for (int ic = lane; ic < half; ic += 32) {
        int e0, e1;
        const bool rot = rope_pair(ic, n_dims, neox, e0, e1);
        const float x0 = *(const float*)(s + e0 * Ps[4]) * scale * w[e0];
        const float x1 = *(const float*)(s + e1 * Ps[4]) * scale * w[e1];
        if (!rot) { st<TD>(d + e0 * Ps[8], x0); st<TD>(d + e1 * Ps[8], x1); continue; }
        float cs, sn;
        rope_cs(Ps + 14, p, ic, cs, sn);
        st<TD>(d + e0 * Ps[8], x0 * cs - x1 * sn);
        st<TD>(d + e1 * Ps[8], x0 * sn + x1 * cs);
    }
}
