// accelplane CUDA plugin: the decode attention as one kernel (attention.py).
#include "common.cuh"

// ==== decode attention: MUL_MAT(K, Q) → SOFT_MAX(scale, mask) → MUL_MAT(V, ·) as one kernel ====
// (an accelplane.core.fusion run; attention.py). A group of 128 threads takes ATT_C cache
// positions of one head batch for all R query rows (the rows of a GQA group share the K and V
// loads): four lanes per position for the scores, one thread per V row (V is stored transposed:
// a row per output feature, positions contiguous) for the weighted sum. A block holds G <= ATT_G
// such groups on consecutive chunks and merges their partial softmaxes in shared memory, so a
// short cache (n_kv <= ATT_G ATT_C, every decode step of a short context) is one block per head
// and the launch is the whole result. Longer caches take several blocks per head: each leaves
// its partial softmax (row max, sum, weighted V) in scratch and the last block of a batch to
// finish (an atomic count, which it resets) combines them. Every global load of a block (V, K,
// Q, mask) is issued before any is used, so the block waits for memory once. The launch is
// latency-bound and all of a block's warps run its setup, so the setup is short: the host
// resolves each head batch's offsets (below), and R <= RM rows are compiled per instantiation.
// P: [D, n_kv, R, ne2, ne3, r2k, r3k, nbk1, nbk2, nbk3, nbq1, nbq2, nbq3, has_mask, nbm1, nbm2, nbm3,
//     nem2, nem3, scale, Dv, r2v, r3v, nbv1, nbv2, nbv3, nbd1, nbd2, nbd3, vwhole, total], then per
// head batch b its byte offsets into K, V, Q, the mask and the result (ATT_NB of them: the host
// resolves the broadcasts, so a block does no division to find its rows).
// D a multiple of 8 up to ATT_MAXD with 16-byte aligned K rows; Dv <= 128; R <= RM <= 8;
// blocks per batch <= ATT_MAXB; vwhole: V rows 16-byte aligned and readable to the end of the
// last chunk (vector loads of whole chunks; positions past n_kv are zeroed after the load).
// grid (blocks, ne2 * ne3), 128 G threads; part: grid.y * grid.x * 8 * (Dv + 2) floats; count:
// grid.y ints, zero. xq: when not null (Dv a multiple of 32, dst contiguous: output element
// (b, r, o) is number (b R + r) Dv + o of total), the result is also written quantized as
// k_quant_x writes it, for the output projection.
#define ATT_C 32
#ifndef ATT_G  // groups per block at most (attention.py passes its GROUPS)
#error "attention.cu is compiled with -DATT_G (attention.py)"
#endif
#define ATT_MAXR 8  // the partials' row stride in scratch (attention.py sizes it)
#define ATT_MAXD 256
#ifndef ATT_MAXKV  // cache positions at most (attention.py passes its MAX_KV)
#error "attention.cu is compiled with -DATT_MAXKV (attention.py)"
#endif
#define ATT_MAXB (ATT_MAXKV / (ATT_C * ATT_G))  // blocks per batch at most
#define ATT_NP 31    // k_attention's parameters
#define ATT_NB 5     // and offsets per head batch
#define ATT_KPRE 4   // K slices of 8 elements a lane loads up front (all of them for D <= 128)
template <typename T> __device__ __forceinline__ void ld8f(const char* p, float* f);
template <> __device__ __forceinline__ void ld8f<__half>(const char* p, float* f) {
    half8(__ldg((const uint4*)p), f);
}
template <> __device__ __forceinline__ void ld8f<float>(const char* p, float* f) {
    const float4 a = __ldg((const float4*)p), b = __ldg((const float4*)p + 1);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
template <typename T> struct raw8;  // 8 elements of a row, as loaded (converted when used)
template <> struct raw8<__half> {
    uint4 a;
    __device__ __forceinline__ void load(const char* p) { a = __ldg((const uint4*)p); }
    __device__ __forceinline__ void get(float* f) const { half8(a, f); }
};
template <> struct raw8<float> {
    float4 a, b;
    __device__ __forceinline__ void load(const char* p) { a = __ldg((const float4*)p); b = __ldg((const float4*)p + 1); }
    __device__ __forceinline__ void get(float* f) const {
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    }
};
template <typename TK, typename TV, typename TM, int RM>
__global__ void __launch_bounds__(128 * ATT_G) k_attention(const i64* __restrict__ P, char* dst, const char* kc,
                                                           const char* q, const char* mask, const char* vc,
                                                           float* part, int* count, char* xq) {
    __shared__ i64 Ps[ATT_NP + ATT_NB];
    pdl_enter_params<ATT_NP, ATT_NB>(P, Ps, ATT_NB * blockIdx.y);  // with this batch's offsets
    __shared__ __align__(16) float qs[RM * ATT_MAXD];
    __shared__ __align__(16) float ps[ATT_G][RM][ATT_C];
    __shared__ float ms[ATT_G][RM], ls[ATT_G][RM], wg[ATT_G][RM], bm[RM], bl[RM];
    __shared__ __align__(16) float pacc[ATT_G][RM][128];
    __shared__ float wm[RM][ATT_MAXB], wl[RM][ATT_MAXB];
    __shared__ bool last;
    const int D = (int)Ps[0], nkv = (int)Ps[1], R = (int)Ps[2], Dv = (int)Ps[20];
    const int b = blockIdx.y;
    const i64* off = Ps + ATT_NP;  // into K, V, Q, the mask, the result
    const int tid = threadIdx.x, t = tid & 127, grp = tid >> 7, G = blockDim.x >> 7, lane = tid & 31;
    const int j0 = (blockIdx.x * G + grp) * ATT_C;
    const char* kb = kc + off[0];
    const char* vr = vc + off[1] + t * Ps[23] + j0 * (i64)sizeof(TV);
    const bool vwhole = Ps[29] != 0;
    // the loads: this thread's V row over the chunk, this lane's K slices, the queries, the mask
    raw8<TV> vw[ATT_C / 8];
    if (vwhole && t < Dv && j0 < nkv) {
        #pragma unroll
        for (int i = 0; i < ATT_C / 8; ++i) vw[i].load(vr + 8 * i * sizeof(TV));
    }
    const int jj = t >> 2, sub = t & 3, j = j0 + jj;
    const char* kp = kb + (i64)j * Ps[7];
    raw8<TK> kw[ATT_KPRE];
    if (j < nkv) {
        #pragma unroll
        for (int s = 0; s < ATT_KPRE; ++s)
            if (sub * 8 + 32 * s < D) kw[s].load(kp + (sub * 8 + 32 * s) * sizeof(TK));
    }
    float qv[RM][ATT_MAXD / 128];  // blocks of >= 128 threads: at most two elements of a row each
    #pragma unroll
    for (int r = 0; r < RM; ++r) {
        #pragma unroll
        for (int c = 0; c < ATT_MAXD / 128; ++c) {
            const int e = tid + c * blockDim.x;
            if (r < R && e < D) qv[r][c] = *(const float*)(q + off[2] + r * Ps[10] + e * 4);
        }
    }
    float mk[RM];  // the mask at this lane's position (the lane that writes its scores)
    #pragma unroll
    for (int r = 0; r < RM; ++r) {
        mk[r] = 0.0f;
        if (Ps[13] != 0 && sub == 0 && r < R && j < nkv)
            mk[r] = ld<TM>(mask + off[3] + r * Ps[14] + j * (i64)sizeof(TM));
    }
    #pragma unroll
    for (int r = 0; r < RM; ++r) {
        #pragma unroll
        for (int c = 0; c < ATT_MAXD / 128; ++c) {
            const int e = tid + c * blockDim.x;
            if (r < R && e < D) qs[r * D + e] = qv[r][c];
        }
    }
    float vf[ATT_C];
    if (t < Dv) {
        if (vwhole) {
            #pragma unroll
            for (int i = 0; i < ATT_C / 8; ++i) vw[i].get(vf + 8 * i);
            #pragma unroll
            for (int i = 0; i < ATT_C; ++i)  // past the cache's end: zero, whatever was read
                if (j0 + i >= nkv) vf[i] = 0.0f;
        } else {
            #pragma unroll
            for (int i = 0; i < ATT_C; ++i) vf[i] = j0 + i < nkv ? ld<TV>(vr + i * sizeof(TV)) : 0.0f;
        }
    }
    __syncthreads();
    // scores: four lanes per position, eight K elements at a time
    float sc[RM];
    #pragma unroll
    for (int r = 0; r < RM; ++r) sc[r] = 0.0f;
    if (j < nkv) {
        auto add = [&](const float* kf, int d0) {
            #pragma unroll
            for (int r = 0; r < RM; ++r) {
                if (r < R) {  // 16-byte loads: D and d0 are multiples of 8
                    const float4 x = *(const float4*)&qs[r * D + d0], y = *(const float4*)&qs[r * D + d0 + 4];
                    sc[r] += kf[0] * x.x + kf[1] * x.y + kf[2] * x.z + kf[3] * x.w + kf[4] * y.x + kf[5] * y.y +
                             kf[6] * y.z + kf[7] * y.w;
                }
            }
        };
        #pragma unroll
        for (int s = 0; s < ATT_KPRE; ++s) {
            if (sub * 8 + 32 * s < D) {
                float kf[8];
                kw[s].get(kf);
                add(kf, sub * 8 + 32 * s);
            }
        }
        #pragma unroll 1
        for (int d0 = sub * 8 + 32 * ATT_KPRE; d0 < D; d0 += 32) {
            float kf[8];
            ld8f<TK>(kp + d0 * sizeof(TK), kf);
            add(kf, d0);
        }
    }
    const float scale = (float)__longlong_as_double(Ps[19]);
    #pragma unroll
    for (int r = 0; r < RM; ++r) {
        sc[r] += __shfl_xor_sync(0xffffffff, sc[r], 1);
        sc[r] += __shfl_xor_sync(0xffffffff, sc[r], 2);
        if (sub == 0 && r < R) ps[grp][r][jj] = j < nkv ? sc[r] * scale + mk[r] : -AP_INF;
    }
    __syncthreads();
    // each chunk's softmax numerators, row max and sum: a warp per query row
    #pragma unroll 1
    for (int r = t >> 5; r < R; r += 4) {
        const float v = ps[grp][r][lane], mx = warp_max(v);
        const float e = mx == -AP_INF ? 0.0f : expf(v - mx);
        ps[grp][r][lane] = e;
        const float l = warp_sum(e);
        if (lane == 0) { ms[grp][r] = mx; ls[grp][r] = l; }
    }
    __syncthreads();
    #pragma unroll
    for (int r = 0; r < RM; ++r) {
        if (r < R && t < Dv) {
            float a = 0.0f;
            #pragma unroll
            for (int i = 0; i < ATT_C; ++i) a += ps[grp][r][i] * vf[i];
            pacc[grp][r][t] = a;
        }
    }
    // the block's row max and sum over its groups, and each group's weight: a warp per row
    #pragma unroll 1
    for (int r = tid >> 5; r < R; r += blockDim.x >> 5) {
        const float m = lane < G ? ms[lane][r] : -AP_INF, mx = warp_max(m);
        const float w = m == -AP_INF ? 0.0f : expf(m - mx);
        const float l = warp_sum(lane < G ? w * ls[lane][r] : 0.0f);
        if (lane < G) wg[lane][r] = w;
        if (lane == 0) { bm[r] = mx; bl[r] = l; }
    }
    __syncthreads();
    const int stride = Dv + 2, nc = gridDim.x;
    if (nc > 1) {  // several blocks: this block's partial, and the last one to finish combines
        float* pb = part + ((i64)b * nc + blockIdx.x) * ATT_MAXR * stride;
        #pragma unroll 1
        for (int i = tid; i < R * Dv; i += blockDim.x) {
            const int r = i / Dv, o = i - r * Dv;
            float a = 0.0f;
            #pragma unroll 1
            for (int k = 0; k < G; ++k) a += wg[k][r] * pacc[k][r][o];
            pb[r * stride + o] = a;
        }
        if (tid < R) { pb[tid * stride + Dv] = bm[tid]; pb[tid * stride + Dv + 1] = bl[tid]; }
        __threadfence();
        __syncthreads();
        if (tid == 0) last = atomicAdd(count + b, 1) == nc - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
        // each block's weight per row (its max against the overall max, over the overall sum),
        // a warp per row
        const float* pa = part + (i64)b * nc * ATT_MAXR * stride;
        #pragma unroll 1
        for (int r = tid >> 5; r < R; r += blockDim.x >> 5) {
            float mx = -AP_INF;
            #pragma unroll 1
            for (int c = lane; c < nc; c += 32) {
                const float* e = pa + (c * ATT_MAXR + r) * stride + Dv;
                const float m = __ldcg(e), l = __ldcg(e + 1);
                wm[r][c] = m, wl[r][c] = l;
                mx = fmaxf(mx, m);
            }
            mx = warp_max(mx);
            float l = 0.0f;
            #pragma unroll 1
            for (int c = lane; c < nc; c += 32) {
                const float m = wm[r][c], e = m == -AP_INF ? 0.0f : expf(m - mx);
                wm[r][c] = e;
                l += e * wl[r][c];
            }
            l = warp_sum(l);
            #pragma unroll 1
            for (int c = lane; c < nc; c += 32) wm[r][c] /= l;  // all masked: 0 / 0, as the softmax
        }
        __syncthreads();
    }
    // the outputs: one block's merged groups, or the blocks' partials weighted
    const int total = (int)Ps[30];
    const float* pa = part + (i64)b * nc * ATT_MAXR * stride;
    #pragma unroll 1
    for (int i = tid; i < R * Dv; i += blockDim.x) {
        const int r = i / Dv, o = i - r * Dv;
        float y = 0.0f;
        if (nc == 1) {
            #pragma unroll 1
            for (int k = 0; k < G; ++k) y += wg[k][r] * pacc[k][r][o];
            y /= bl[r];
        } else {
            #pragma unroll 4
            for (int c = 0; c < nc; ++c) y += wm[r][c] * __ldcg(pa + (c * ATT_MAXR + r) * stride + o);
        }
        *(float*)(dst + off[4] + r * Ps[26] + o * 4) = y;
        if (xq) quantize1(xq, y, b * R * Dv + i, total);  // whole warps: R Dv % 32 == 0
    }
    if (nc > 1 && tid == 0) count[b] = 0;  // ready for the next launch
}

