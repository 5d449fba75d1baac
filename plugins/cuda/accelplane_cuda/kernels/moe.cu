// accelplane CUDA plugin: MUL_MAT_ID of many tokens as a grouped product (moe.py).
//
// The (token, slot) rows are grouped by the expert their id names, on the device (k_moe_route),
// so the whole op stays inside one CUDA graph with no host round trip; then each block of
// k_moe_gemm multiplies one tile of one expert's rows by a tile of that expert's weight rows on
// the tensor cores (mma.sync m16n8k16, F16 inputs, F32 accumulation), dequantizing the weights
// stage by stage as it goes, on activations converted to F16 once. Each expert's weights are
// read once per tile of its rows instead of once per row.
#include "common.cuh"

#define MOE_TM 64   // activation rows (one expert's) per tile
#define MOE_TN 64   // weight rows per tile
#define MOE_LD 72   // halves per shared row of a 64-element stage (+8: ldmatrix's rows on distinct banks)
#define MOE_MAX_EXP 1024     // experts k_moe_route takes (one per thread)

// Exclusive prefix sum over the block of v (one value per thread, blockDim.x a multiple of 32);
// *total gets the sum. Uses ws[32].
__device__ int block_scan_excl(int v, int* ws, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int x = v;
    #pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffff, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) ws[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int s = lane < nw ? ws[lane] : 0;
        #pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffff, s, o);
            if (lane >= o) s += y;
        }
        ws[lane] = s;  // inclusive sums of the warps
    }
    __syncthreads();
    const int before = (warp > 0 ? ws[warp - 1] : 0) + x - v;
    *total = ws[nw - 1];
    __syncthreads();  // ws may be reused
    return before;
}

// One block of MOE_MAX_EXP threads. rows: the R = n_used * n_tok rows (r = t * n_used + u) in
// expert order; tiles: (expert, first index into rows, row count <= MOE_TM) per tile, their count
// at tiles[-1] (tiles points one int3 past it). An id out of [0, n_exp) sets *err; its row is left out.
// P: [n_used, n_tok, n_exp, nbi0, nbi1]
__global__ void k_moe_route(const i64* __restrict__ P, const char* ids, int* rows, int* tiles, int* err) {
    pdl_enter();
    __shared__ int cnt[MOE_MAX_EXP], cur[MOE_MAX_EXP], ws[32];
    const int n_used = (int)P[0], n_exp = (int)P[2];
    const int R = n_used * (int)P[1];
    const int e0 = threadIdx.x;
    cnt[e0] = 0;
    __syncthreads();
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        const int e = *(const int*)(ids + (r % n_used) * P[3] + (r / n_used) * P[4]);
        if (e >= 0 && e < n_exp) atomicAdd(&cnt[e], 1);
        else *err = 1;
    }
    __syncthreads();
    const int c = e0 < n_exp ? cnt[e0] : 0;
    int n_rows, n_tiles;
    const int off = block_scan_excl(c, ws, &n_rows);
    const int nt = (c + MOE_TM - 1) / MOE_TM;
    const int toff = block_scan_excl(nt, ws, &n_tiles);
    int* tl = tiles + 3;
    for (int j = 0; j < nt; ++j) {
        tl[3 * (toff + j)] = e0;
        tl[3 * (toff + j) + 1] = off + j * MOE_TM;
        tl[3 * (toff + j) + 2] = min(MOE_TM, c - j * MOE_TM);
    }
    if (threadIdx.x == 0) tiles[0] = n_tiles;
    cur[e0] = off;
    __syncthreads();
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        const int e = *(const int*)(ids + (r % n_used) * P[3] + (r / n_used) * P[4]);
        if (e >= 0 && e < n_exp) rows[atomicAdd(&cur[e], 1)] = r;
    }
}

__device__ __forceinline__ unsigned int pack_half2(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *(const unsigned int*)&h;
}

__device__ __forceinline__ void mma_16816(float* c, const unsigned int* a, const unsigned int* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One 32-element chunk of a weight row, loaded into registers (load) and later written to shared
// memory as 16 F16 pairs in element order, d[l] holding elements 8l .. 8l + 7 (store): so a
// stage's global loads are in flight while the previous stage's products run. Any type: the
// chunk dequantized to float at load, each value rounded once to F16 at store.
template <int WT> struct WChunk {
    float y[32];
    __device__ __forceinline__ void load(const u8* row, int c) { deq32<WT>(row, c, y); }
    __device__ __forceinline__ void store(uint4* d) const {
        #pragma unroll
        for (int l = 0; l < 4; ++l)
            d[l] = make_uint4(pack_half2(y[8 * l], y[8 * l + 1]), pack_half2(y[8 * l + 2], y[8 * l + 3]),
                              pack_half2(y[8 * l + 4], y[8 * l + 5]), pack_half2(y[8 * l + 6], y[8 * l + 7]));
    }
};
// Q4_0x8 (the experts' layout in a weights buffer; layout.py) keeps its bits: one 16-byte word of
// nibbles and the scale, converted without floats at store: a nibble n under the F16 exponent of
// 1024 (0x64) is 1024 + n, so (h - 1032) * d is (n - 8) * d rounded once, as above.
template <> struct WChunk<ty::Q4_0X8> {
    uint4 q;
    __half d;
    __device__ __forceinline__ void load(const u8* row, int c) {
        const u8* g = row + (i64)(c >> 3) * 144;
        q = *(const uint4*)(g + 16 * (c & 7));
        d = *(const __half*)(g + 128 + 2 * (c & 7));
    }
    __device__ __forceinline__ void store(uint4* out) const {
        const __half2 dd = __half2half2(d), off = __float2half2_rn(1032.0f);
        const unsigned int w[4] = {q.x, q.y, q.z, q.w};
        unsigned int h[16];
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned int lo = w[i] & 0x0F0F0F0Fu, hi = (w[i] >> 4) & 0x0F0F0F0Fu;
            // elements 4i .. 4i + 3 (low nibbles), 16 + 4i .. 16 + 4i + 3 (high), two to a pair
            const unsigned int v[4] = {__byte_perm(lo, 0x64646464u, 0x4140), __byte_perm(lo, 0x64646464u, 0x4342),
                                       __byte_perm(hi, 0x64646464u, 0x4140), __byte_perm(hi, 0x64646464u, 0x4342)};
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                const __half2 x = __hmul2(__hsub2(*(const __half2*)&v[j], off), dd);
                h[2 * i + (j & 1) + 8 * (j >> 1)] = *(const unsigned int*)&x;
            }
        }
        #pragma unroll
        for (int l = 0; l < 4; ++l) out[l] = make_uint4(h[4 * l], h[4 * l + 1], h[4 * l + 2], h[4 * l + 3]);
    }
};

// four 8x8 F16 matrices from shared memory, matrix i's rows at the addresses of lanes 8i .. 8i+7
__device__ __forceinline__ void ldsm_x4(unsigned int* r, const __half* p) {
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// grid (ceil(M / MOE_TN), upper bound of the tile count), 2 * MOE_TN threads: 4 warps, 2 (rows)
// x 2 (weight rows) of 32 x 32 outputs each. K in 64-element stages, double-buffered in
// dynamic shared memory (2 * (MOE_TM + TN) * MOE_LD halves): before the warps multiply stage c,
// every thread starts the copy of part of stage c + 1's activation rows (cp.async) and loads
// one 32-element chunk of its weight rows into registers, which it writes out as F16 after the
// products; one barrier per stage.
// dst[m, u, t] = sum_k W[e(u, t), m, k] * x[k, u % B, t] for the rows of tile blockIdx.y.
// x: F16 rows, 16-byte aligned. K % 32 == 0.
// P: [M, K, n_used, B, nbw1, nbw2, nbx1, nbx2, nbd1, nbd2]
template <int WT>
__global__ void __launch_bounds__(2 * MOE_TN) k_moe_gemm(const i64* __restrict__ P, char* dst, const char* w,
                                                     const char* x, const int* rows, const int* tiles) {
    pdl_enter();
    constexpr int TN = MOE_TN, NT = 2 * TN, NX = MOE_TM * 8 / NT;  // threads; 16-byte activation pieces per thread
    extern __shared__ __align__(16) __half msm[];
    if ((int)blockIdx.y >= tiles[0]) return;
    const int* tl = tiles + 3 + 3 * blockIdx.y;
    const int e = tl[0], first = tl[1], count = tl[2];
    const i64 M = P[0];
    const int K = (int)P[1], n_used = (int)P[2], B = (int)P[3];
    const i64 m0 = (i64)blockIdx.x * TN;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = (warp / (TN / 32)) * 32, wn = (warp % (TN / 32)) * 32;
    // this thread's weight row and chunk of a stage, and its activation pieces (row p >> 3, part p & 7)
    const int wrow = tid >> 1, wch = tid & 1;
    const bool wlive = m0 + wrow < M;
    const u8* wsrc = (const u8*)(w + (i64)e * P[5] + (wlive ? m0 + wrow : 0) * P[4]);
    const char* xsrc[NX];
    #pragma unroll
    for (int j = 0; j < NX; ++j) {
        const int p = tid + j * NT, row = p >> 3;
        const int r = row < count ? rows[first + row] : -1;
        xsrc[j] = r < 0 ? nullptr : x + (i64)((r % n_used) % B) * P[6] + (i64)(r / n_used) * P[7] + (p & 7) * 16;
    }
    const int nch = K / 32, nst = (nch + 1) / 2;
    // rows past count or M are left stale: their products are never stored
    WChunk<WT> wc;
    auto fetch = [&](int s) {
        if (wlive && 2 * s + wch < nch) wc.load(wsrc, 2 * s + wch);
    };
    auto put_w = [&](int s, int buf) {
        if (!wlive) return;
        uint4* d = (uint4*)(msm + buf * (MOE_TM + TN) * MOE_LD + (MOE_TM + wrow) * MOE_LD + wch * 32);
        if (2 * s + wch < nch) {
            wc.store(d);
        } else {
            #pragma unroll
            for (int l = 0; l < 4; ++l) d[l] = make_uint4(0u, 0u, 0u, 0u);  // K's odd last chunk
        }
    };
    auto put_x = [&](int s, int buf) {
        __half* xs = msm + buf * (MOE_TM + TN) * MOE_LD;
        #pragma unroll
        for (int j = 0; j < NX; ++j) {
            const int p = tid + j * NT, part = p & 7;
            __half* d = xs + (p >> 3) * MOE_LD + part * 8;
            if (xsrc[j] == nullptr) continue;
            if (2 * s + (part >> 2) < nch) cp_async16(d, xsrc[j] + (i64)s * 128);
            else *(uint4*)d = make_uint4(0u, 0u, 0u, 0u);
        }
    };
    float acc[2][4][4];
    #pragma unroll
    for (int i = 0; i < 2; ++i)
        #pragma unroll
        for (int j = 0; j < 4; ++j)
            #pragma unroll
            for (int l = 0; l < 4; ++l) acc[i][j][l] = 0.0f;
    const bool busy = wm < count;  // a warp whose rows are all past count skips the products
    // ldmatrix lanes: A's rows (lane & 15) at column 8 * (lane >> 4); B's rows (lane & 7) + 8 * (lane >> 4)
    // at column 8 * ((lane >> 3) & 1)
    const int a_off = (wm + (lane & 15)) * MOE_LD + 8 * (lane >> 4);
    const int b_off = MOE_TM * MOE_LD + (wn + (lane & 7) + 8 * (lane >> 4)) * MOE_LD + 8 * ((lane >> 3) & 1);
    fetch(0);
    put_w(0, 0);
    put_x(0, 0);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    for (int s = 0; s < nst; ++s) {
        const int buf = s & 1;
        const bool more = s + 1 < nst;
        if (more) {  // the barrier ending stage s - 1 freed buffer buf ^ 1
            fetch(s + 1);
            put_x(s + 1, buf ^ 1);
        }
        cp_async_commit();
        if (busy) {
            const __half* sb = msm + buf * (MOE_TM + TN) * MOE_LD;
            #pragma unroll
            for (int kk = 0; kk < 64; kk += 16) {
                unsigned int af[2][4], bf[4][2];
                #pragma unroll
                for (int i = 0; i < 2; ++i) ldsm_x4(af[i], sb + a_off + 16 * i * MOE_LD + kk);
                #pragma unroll
                for (int j = 0; j < 4; j += 2) {
                    unsigned int r[4];
                    ldsm_x4(r, sb + b_off + 8 * j * MOE_LD + kk);
                    bf[j][0] = r[0]; bf[j][1] = r[1]; bf[j + 1][0] = r[2]; bf[j + 1][1] = r[3];
                }
                #pragma unroll
                for (int i = 0; i < 2; ++i)
                    #pragma unroll
                    for (int j = 0; j < 4; ++j) mma_16816(acc[i][j], af[i], bf[j]);
            }
        }
        if (more) put_w(s + 1, buf ^ 1);
        cp_async_wait<0>();
        __syncthreads();
    }
    // c0, c1: row g, columns 2q, 2q + 1; c2, c3: row g + 8
    const int g = lane >> 2, q = lane & 3;
    #pragma unroll
    for (int i = 0; i < 2; ++i)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int lr = wm + 16 * i + g + 8 * h;
            if (lr >= count) continue;
            const int r = rows[first + lr];
            char* drow = dst + (i64)(r % n_used) * P[8] + (i64)(r / n_used) * P[9];
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                const i64 m = m0 + wn + 8 * j + 2 * q;
                if (m < M) *(float*)(drow + m * 4) = acc[i][j][2 * h];
                if (m + 1 < M) *(float*)(drow + m * 4 + 4) = acc[i][j][2 * h + 1];
            }
        }
}

// A MoE layer's expert weights as one kernel (accelplane.core.fusion: moe_gating), a block per
// token: the router's softmax in the first warp, computed as k_soft_max's warp form does (so the
// same experts win); then a thread per expert ranks it (the descending stable order k_argsort
// gives), so the E x E comparisons run in parallel rather than in one warp's serial loop; then
// the first warp takes the top k probabilities and, when norm, their sum and each divided by it
// (k_sum_rows' and the DIV's arithmetic). Every result is written. A probability is >= 0 or NaN,
// so ranking the key (NaN -> -1) by (key desc, index asc) puts NaN last as k_argsort does.
// E <= MOE_MAX_EXP, k <= 32, blockDim >= E rounded up to a warp; dynamic shared memory:
// 2 E4 floats and E ints (E4 = E rounded up to 4). P: [E, T, nbl1, nbp1, nbo1, k, nbw2, nbt1,
// nbn1, norm]. The logits are read from L2 (__ldcg): k_moe_router's other blocks wrote them.
__device__ __forceinline__ void moe_gate(const i64* __restrict__ P, i64 t, const char* logits, char* probs,
                                         char* order, char* weights, char* total, char* normed) {
    extern __shared__ float gsm[];
    const int tid = threadIdx.x, lane = tid & 31;
    const int E = (int)P[0], k = (int)P[5], E4 = (E + 3) & ~3;
    float* p = gsm;
    float* key = gsm + E4;
    int* rank_of = (int*)(gsm + 2 * E4);  // rank_of[r]: the expert ranked r
    if (tid < 32) {
        const float* l = (const float*)(logits + t * P[2]);
        float mx = -AP_INF;
        for (int i = lane; i < E; i += 32) mx = fmaxf(mx, __ldcg(l + i));
        mx = warp_max(mx);
        float sum = 0.0f;
        for (int i = lane; i < E; i += 32) {
            const float e = expf(__ldcg(l + i) - mx);
            p[i] = e;
            sum += e;
        }
        sum = warp_sum(sum);
        const float inv = 1.0f / sum;
        float* pr = (float*)(probs + t * P[3]);
        for (int i = lane; i < E; i += 32) {
            const float v = p[i] * inv;
            pr[i] = p[i] = v;
            key[i] = isnan(v) ? -1.0f : v;
        }
        for (int i = E + lane; i < E4; i += 32) key[i] = -2.0f;  // below every key: never counted
    }
    __syncthreads();
    if (tid < E) {
        const float ki = key[tid];
        const float4* k4 = (const float4*)key;
        int rank = 0;
        #pragma unroll 4
        for (int q = 0; q < E4 / 4; ++q) {
            const float4 v = k4[q];
            const int j = 4 * q;
            rank += (v.x > ki) | ((v.x == ki) & (j < tid));
            rank += (v.y > ki) | ((v.y == ki) & (j + 1 < tid));
            rank += (v.z > ki) | ((v.z == ki) & (j + 2 < tid));
            rank += (v.w > ki) | ((v.w == ki) & (j + 3 < tid));
        }
        ((int*)(order + t * P[4]))[rank] = tid;
        rank_of[rank] = tid;
    }
    __syncthreads();
    if (tid < 32) {
        const float w = lane < k ? p[rank_of[lane]] : 0.0f;
        if (lane < k) ((float*)(weights + t * P[6]))[lane] = w;
        if (P[9]) {
            const float s = warp_sum(w);
            if (lane == 0) *(float*)(total + t * P[7]) = s;
            if (lane < k) ((float*)(normed + t * P[8]))[lane] = w / s;
        }
    }
}

// the gating alone: moe_gate, a block per token
__global__ void k_moe_gating(const i64* __restrict__ P, const char* logits, char* probs, char* order,
                             char* weights, char* total, char* normed) {
    pdl_enter();
    moe_gate(P, blockIdx.x, logits, probs, order, weights, total, normed);
}

// A decode's router product and its gating as one kernel (moe.py: router_gating): a warp per
// expert's row of F32 weights (its first ROUTER_PRE float4 per lane loaded before the wait when
// no kernel of the graph writes them, P[12]), dot the token's activations, the logit written;
// then the last block to finish (counted on a zeroed counter it zeroes again) runs moe_gate
// over the written logits, saving the gating's launch and its wait. One token; blockDim >= E
// rounded up to a warp, a multiple of 32; moe_gate's dynamic shared memory. P: moe_gate's 10,
// then K (a multiple of 4), the weights' row stride in bytes (16-byte aligned rows), early.
#define ROUTER_PRE 16
__global__ void k_moe_router(const i64* __restrict__ P, char* logits, const char* w, const char* x, char* probs,
                             char* order, char* weights, char* total, char* normed, unsigned int* counter) {
    const int lane = threadIdx.x & 31;
    const int E = (int)P[0], k4 = (int)(P[10] / 4);
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const bool live = row < E;
    const float4* wr = (const float4*)(w + (i64)(live ? row : 0) * P[11]);
    float4 wv[ROUTER_PRE];
    auto load = [&]() {
        #pragma unroll
        for (int i = 0; i < ROUTER_PRE; ++i)
            if (lane + 32 * i < k4) wv[i] = __ldg(wr + lane + 32 * i);
    };
    const bool early = P[12] != 0;
    if (early) load();
    pdl_enter();
    if (!early) load();
    const float4* xv = (const float4*)x;
    float s = 0.0f;
    #pragma unroll
    for (int i = 0; i < ROUTER_PRE; ++i) {
        const int c = lane + 32 * i;
        if (c < k4) {
            const float4 a = xv[c];
            s += wv[i].x * a.x + wv[i].y * a.y + wv[i].z * a.z + wv[i].w * a.w;
        }
    }
    for (int c = lane + 32 * ROUTER_PRE; c < k4; c += 32) {
        const float4 v = __ldg(wr + c), a = xv[c];
        s += v.x * a.x + v.y * a.y + v.z * a.z + v.w * a.w;
    }
    s = warp_sum(s);
    if (live && lane == 0) *(float*)(logits + row * 4) = s;
    // the last block to finish gates: every block's logits are visible to it after its count
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) *counter = 0u;  // for the next launch (the stream orders them)
    moe_gate(P, 0, logits, probs, order, weights, total, normed);
}

// The weighted sum over a MoE layer's experts (accelplane.core.fusion: moe_sum): dst[c, t] =
// sum_j x[c, j, t] * w[j, t], in slot order and rounded after each product and each sum, as
// the MUL and its chain of ADDs compute it. d * T < 2^31. P: [d, k, T, nbx0, nbx1, nbx2, nbw1,
// nbw2, nbd0, nbd1]
__global__ void k_moe_sum(const i64* __restrict__ P, char* dst, const char* x, const char* w) {
    pdl_enter();
    const unsigned int d = (unsigned int)P[0], n = d * (unsigned int)P[2];
    const int k = (int)P[1];
    for (unsigned int li = blockIdx.x * blockDim.x + threadIdx.x; li < n; li += gridDim.x * blockDim.x) {
        const unsigned int c = li % d, t = li / d;
        const char* xs = x + c * P[3] + t * P[5];
        const char* ws = w + t * P[7];
        float acc = __fmul_rn(*(const float*)xs, *(const float*)ws);
        for (int j = 1; j < k; ++j)
            acc = __fadd_rn(acc, __fmul_rn(*(const float*)(xs + j * P[4]), *(const float*)(ws + j * P[6])));
        *(float*)(dst + c * P[8] + t * P[9]) = acc;
    }
}
