// accelplane CUDA plugin: the decode attention as one kernel (attention.py).
#include "common.cuh"

// ==== decode attention: MUL_MAT(K, Q) → SOFT_MAX(scale, mask) → MUL_MAT(V, ·) as one kernel ====
// (an accelplane.core.fusion run; attention.py). A block takes one query row r of one head batch b
// over a range of cache positions, a tile of blockDim.x positions at a time: a thread per
// position for the scores (its K row in registers, the query in shared memory), the tile's
// softmax numerators in shared memory, then threads over (output feature f, quarter qd of the
// tile) for the weighted sum (V is stored transposed: a row per output feature, positions
// contiguous, so a thread's positions are one run of 16-byte loads); tiles after the first
// rescale what came before (online softmax). Each block loads its K and V itself (the query
// rows of a GQA group re-read them from L2): the decode attention is latency-bound, and a block
// per row needs no merging across blocks, so a short cache is one block per row and the launch
// is the result. Longer caches split over S <= 8 blocks per row in one thread-block cluster
// (sm_90 and newer; attention.py asks for S > 1 only there): each block leaves its row max, sum
// and weighted sum in its shared memory and the cluster's first block combines them through
// distributed shared memory.
// P: [D, n_kv, R, Dv, nbk1, nbq1, has_mask, nbm1, scale, nbv1, nbd1, vwhole, total, PC], then
// per head batch b its byte offsets into K, V, Q, the mask and the result (ATT_NB of them: the
// host resolves the broadcasts, so a block does no division to find its rows). PC: positions per
// block, a multiple of 8. D a multiple of 8 up to ATT_MAXD with 16-byte aligned K rows; Dv <=
// blockDim.x <= ATT_MAXT, a multiple of 32; vwhole: V rows 16-byte aligned and readable to the
// first multiple of 8 positions at or after n_kv (16-byte loads; what lies past n_kv is zeroed).
// grid (S, R, ne2 * ne3), cluster (S, 1, 1) when S > 1. xq: when not
// null (Dv a multiple of 32, dst contiguous: output element (b, r, f) is number (b R + r) Dv + f
// of total), the result is also written quantized as k_quant_x writes it, for the output
// projection.
#define ATT_MAXD 256
#define ATT_MAXT 256  // threads per block at most
#define ATT_NP 14     // k_attention's parameters
#define ATT_NB 5      // and offsets per head batch
#define ATT_L 16      // 16-byte loads of K (and of V) a thread holds at once

// 16 bytes of a row (8 halves or 4 floats) against floats in shared memory
template <typename T> struct row16;
template <> struct row16<__half> {
    static constexpr int N = 8;
    __device__ __forceinline__ static float dot(uint4 w, const float* s, float acc) {
        float f[8];
        half8(w, f);
        const float4 a = *(const float4*)s, b = *(const float4*)(s + 4);
        return acc + f[0] * a.x + f[1] * a.y + f[2] * a.z + f[3] * a.w + f[4] * b.x + f[5] * b.y + f[6] * b.z +
               f[7] * b.w;
    }
    __device__ __forceinline__ static void zero_past(uint4& w, int n) {  // elements n.. of w zeroed
        unsigned int* u = (unsigned int*)&w;
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (2 * i >= n) u[i] = 0u;
            else if (2 * i + 1 >= n) u[i] &= 0xFFFFu;
        }
    }
};
template <> struct row16<float> {
    static constexpr int N = 4;
    __device__ __forceinline__ static float dot(uint4 w, const float* s, float acc) {
        const float4 a = *(const float4*)s;
        return acc + __uint_as_float(w.x) * a.x + __uint_as_float(w.y) * a.y + __uint_as_float(w.z) * a.z +
               __uint_as_float(w.w) * a.w;
    }
    __device__ __forceinline__ static void zero_past(uint4& w, int n) {
        if (n <= 0) w.x = 0u;
        if (n <= 1) w.y = 0u;
        if (n <= 2) w.z = 0u;
        if (n <= 3) w.w = 0u;
    }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// a float in the shared memory of block `rank` of the cluster, at the address p has in this block's
__device__ __forceinline__ float ld_cluster(const float* p, unsigned int rank) {
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(p);
    unsigned int r;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(r) : "memory");
    return v;
}
#endif

template <typename TK, typename TV, typename TM>
__global__ void __launch_bounds__(ATT_MAXT, 1) k_attention(const i64* __restrict__ P, char* dst, const char* kc,
                                                           const char* q, const char* mask, const char* vc,
                                                           char* xq) {
    __shared__ i64 Ps[ATT_NP + ATT_NB];
    pdl_enter_params<ATT_NP, ATT_NB>(P, Ps, ATT_NB * blockIdx.z);  // with this batch's offsets
    __shared__ __align__(16) float qs[ATT_MAXD];
    __shared__ __align__(16) float ps[ATT_MAXT];   // the tile's softmax numerators
    __shared__ __align__(16) float red[ATT_MAXT];  // the weighted sums' parts, (quarter, feature)
    __shared__ float wmx[ATT_MAXT / 32], wsm[ATT_MAXT / 32], cm, cl;
    const int D = (int)Ps[0], nkv = (int)Ps[1], R = (int)Ps[2], Dv = (int)Ps[3];
    const int r = blockIdx.y, b = blockIdx.z, S = gridDim.x, PC = (int)Ps[13];
    const int tid = threadIdx.x, NT = blockDim.x, lane = tid & 31, warp = tid >> 5, nw = NT >> 5;
    const i64* off = Ps + ATT_NP;  // into K, V, Q, the mask, the result
    const int p0 = blockIdx.x * PC, p1 = min(nkv, p0 + PC);
    const bool vwhole = Ps[11] != 0, has_mask = Ps[6] != 0;
    const float scale = (float)pf(Ps, 8);
    // the weighted sum's threads: feature f of quarter qd, PQ positions of the tile each
    constexpr int KN = row16<TK>::N, VN = row16<TV>::N;
    const int nq = NT / Dv, PQ = ((NT + nq - 1) / nq + 7) / 8 * 8;
    const int f = tid % Dv, qd = tid / Dv;
    const bool pv = qd < nq;
    const char* qrow = q + off[2] + r * Ps[5];
    const char* vrow = vc + off[1] + f * Ps[9];
    const char* mrow = mask + off[3] + r * Ps[7];
    // the query into shared memory (its loads issued with the first tile's)
    float qv[ATT_MAXD / 128];
    #pragma unroll
    for (int c = 0; c < ATT_MAXD / 128; ++c) {
        const int e = tid + c * 128;
        if (tid < 128 && e < D) qv[c] = *(const float*)(qrow + e * 4);
    }
    const int nk = D * (int)sizeof(TK) / 16;  // 16-byte words of a K row
    float M = -AP_INF, L = 0.0f, acc = 0.0f;
    for (int tp0 = p0; tp0 < p1; tp0 += NT) {
        const int j = tp0 + tid;
        const bool valid = j < p1;
        const char* krow = kc + off[0] + (i64)j * Ps[4];
        uint4 kw[ATT_L];
        #pragma unroll
        for (int i = 0; i < ATT_L; ++i)
            if (valid && i < nk) kw[i] = __ldg((const uint4*)krow + i);
        const float mk = has_mask && valid ? ld<TM>(mrow + (i64)j * sizeof(TM)) : 0.0f;
        // this thread's V words: positions tp0 + qd PQ + VN i .. (the first ATT_L of them)
        // (a quarter's last words may lie past the tile: PQ is rounded up to whole words)
        const int jv = tp0 + qd * PQ, nv = min(PQ, max(0, NT - qd * PQ)) / VN;
        uint4 vw[ATT_L];
        if (pv && vwhole) {
            #pragma unroll
            for (int i = 0; i < ATT_L; ++i)
                if (i < nv && jv + VN * i < nkv) vw[i] = __ldg((const uint4*)(vrow + (i64)jv * sizeof(TV)) + i);
        }
        if (tp0 == p0) {
            #pragma unroll
            for (int c = 0; c < ATT_MAXD / 128; ++c) {
                const int e = tid + c * 128;
                if (tid < 128 && e < D) qs[e] = qv[c];
            }
            __syncthreads();
        }
        // the score of position j
        float s = 0.0f;
        if (valid) {
            #pragma unroll
            for (int i = 0; i < ATT_L; ++i)
                if (i < nk) s = row16<TK>::dot(kw[i], qs + KN * i, s);
            #pragma unroll 1
            for (int i0 = ATT_L; i0 < nk; i0 += ATT_L) {  // rows of more than ATT_L words (D > 128 F16)
                #pragma unroll
                for (int i = 0; i < ATT_L; ++i)
                    if (i0 + i < nk) kw[i] = __ldg((const uint4*)krow + i0 + i);
                #pragma unroll
                for (int i = 0; i < ATT_L; ++i)
                    if (i0 + i < nk) s = row16<TK>::dot(kw[i], qs + KN * (i0 + i), s);
            }
            s = s * scale + mk;
        } else {
            s = -AP_INF;
        }
        // the tile's max and sum of numerators (block-wide), folded into the running ones
        const float wm = warp_max(s);
        if (lane == 0) wmx[warp] = wm;
        __syncthreads();
        float mt = -AP_INF;
        for (int w = 0; w < nw; ++w) mt = fmaxf(mt, wmx[w]);
        const float mn = fmaxf(M, mt);
        const float alpha = mn == -AP_INF ? 0.0f : expf(M - mn);
        const float e = s == -AP_INF ? 0.0f : expf(s - mn);
        const float ws = warp_sum(e);
        ps[tid] = e;
        if (lane == 0) wsm[warp] = ws;
        __syncthreads();
        float lt = 0.0f;
        for (int w = 0; w < nw; ++w) lt += wsm[w];
        L = L * alpha + lt;
        M = mn;
        // the weighted sum over the tile's positions
        if (pv) {
            float a = 0.0f;
            const float* pq = ps + qd * PQ;
            if (vwhole) {
                #pragma unroll
                for (int i = 0; i < ATT_L; ++i) {
                    if (i < nv && jv + VN * i < nkv) {
                        if (jv + VN * i + VN > nkv) row16<TV>::zero_past(vw[i], nkv - jv - VN * i);
                        a = row16<TV>::dot(vw[i], pq + VN * i, a);
                    }
                }
                #pragma unroll 1
                for (int i0 = ATT_L; i0 < nv; i0 += ATT_L) {  // quarters of more than ATT_L words (F32 V)
                    #pragma unroll
                    for (int i = 0; i < ATT_L; ++i)
                        if (i0 + i < nv && jv + VN * (i0 + i) < nkv)
                            vw[i] = __ldg((const uint4*)(vrow + (i64)jv * sizeof(TV)) + i0 + i);
                    #pragma unroll
                    for (int i = 0; i < ATT_L; ++i) {
                        const int jw = jv + VN * (i0 + i);
                        if (i0 + i < nv && jw < nkv) {
                            if (jw + VN > nkv) row16<TV>::zero_past(vw[i], nkv - jw);
                            a = row16<TV>::dot(vw[i], pq + VN * (i0 + i), a);
                        }
                    }
                }
            } else {
                #pragma unroll 4
                for (int i = 0; i < VN * nv; ++i)
                    if (jv + i < p1) a += pq[i] * ld<TV>(vrow + (i64)(jv + i) * sizeof(TV));
            }
            acc = acc * alpha + a;
        }
        if (tp0 + NT < p1) __syncthreads();  // the next tile rewrites ps, wmx, wsm
    }
    // the quarters' parts of each feature
    if (pv) red[qd * Dv + f] = acc;
    __syncthreads();
    float y = 0.0f;
    if (tid < Dv) {
        for (int k = 0; k < nq; ++k) y += red[k * Dv + tid];
    }
    const int total = (int)Ps[12];
    const int e0 = (b * R + r) * Dv;
    if (S == 1) {
        if (tid < Dv) {
            y /= L;  // every position masked: 0 / 0, as the softmax
            *(float*)(dst + off[4] + r * Ps[10] + tid * 4) = y;
        }
        if (xq && tid < Dv) quantize1(xq, y, e0 + tid, total);  // whole warps: Dv % 32 == 0
        return;
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // S blocks of one cluster: the first combines the others' partials from their shared memory
    if (tid < Dv) red[tid] = y;  // (thread tid alone read red[tid] above)
    if (tid == 0) { cm = M; cl = L; }
    cluster_sync();
    if (blockIdx.x == 0 && tid < Dv) {
        float mx = -AP_INF;
        for (int c = 0; c < S; ++c) mx = fmaxf(mx, ld_cluster(&cm, c));
        float l = 0.0f, o = 0.0f;
        for (int c = 0; c < S; ++c) {
            const float m = ld_cluster(&cm, c);
            const float w = m == -AP_INF ? 0.0f : expf(m - mx);
            l += w * ld_cluster(&cl, c);
            o += w * ld_cluster(&red[tid], c);
        }
        y = o / l;
        *(float*)(dst + off[4] + r * Ps[10] + tid * 4) = y;
    }
    if (xq && blockIdx.x == 0 && tid < Dv) quantize1(xq, y, e0 + tid, total);
    cluster_sync();  // the others' shared memory stays until the first block has read it
#endif
}
