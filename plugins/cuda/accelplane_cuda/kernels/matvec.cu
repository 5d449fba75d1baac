// accelplane CUDA plugin: matrix products of up to MMV_MAXN activation rows, and of experts (matvec.py, qkv.py).
#include "common.cuh"

// ---- mat-vec: W lanes per weight row (a power of two <= 32: short rows, like attention over a
// KV cache, get several rows per warp instead of idle lanes), lanes over 32-element chunks, all N
// activation rows. out[.., n, m] = sum_k W[.., m, k] * x[.., n, k]
// P: [M, K, N, ne2, ne3, r2, r3, nbw1, nbw2, nbw3, nbx1, nbx2, nbx3, nbd1, nbd2, nbd3, W, staged]
#ifndef MMV_MAXN  // activation rows at most (matvec.py passes its MAXN)
#error "matvec.cu is compiled with -DMMV_MAXN (matvec.py)"
#endif
// P[17] set: the block first copies its N activation rows into dynamic shared memory (N * K
// floats, matvec.py sizes it), all loads in flight at once, instead of each lane reading them from
// L2 in the product loop, one round trip per activation row.
template <int WT>
__global__ void k_mul_mat_vec(const i64* __restrict__ P, char* dst, const char* w, const char* x) {
    pdl_enter();
    extern __shared__ float4 xsh[];
    const int W = (int)P[16], lane = threadIdx.x & 31, sub = lane & (W - 1);
    const i64 m = ((i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * (32 / W) + lane / W;
    const bool live = m < P[0];  // dead lanes still take part in the shuffles
    const i64 i2 = blockIdx.y % P[3], i3 = blockIdx.y / P[3];
    const int nch = (int)(P[1] / 32), N = (int)P[2];
    const u8* row = (const u8*)(w + (live ? m : 0) * P[7] + (i2 / P[5]) * P[8] + (i3 / P[6]) * P[9]);
    const char* xb = x + i2 * P[11] + i3 * P[12];
    const bool staged = P[17] != 0;
    const int k4 = (int)(P[1] / 4);
    if (staged) {
        for (int t = threadIdx.x; t < N * k4; t += blockDim.x) {
            const int j = t / k4;
            xsh[t] = ((const float4*)(xb + j * P[10]))[t - j * k4];
        }
        __syncthreads();
    }
    float acc[MMV_MAXN];
    #pragma unroll
    for (int j = 0; j < MMV_MAXN; ++j) acc[j] = 0.0f;
    float y[32];
    for (int c = sub; live && c < nch; c += W) {
        deq32<WT>(row, c, y);
        #pragma unroll
        for (int j = 0; j < MMV_MAXN; ++j) {
            if (j >= N) break;
            const float4* xv = (staged ? xsh + j * k4 : (const float4*)(xb + j * P[10])) + 8 * c;
            float s = 0.0f;
            #pragma unroll
            for (int l = 0; l < 8; ++l) {
                const float4 v = xv[l];
                s += y[4 * l] * v.x + y[4 * l + 1] * v.y + y[4 * l + 2] * v.z + y[4 * l + 3] * v.w;
            }
            acc[j] += s;
        }
    }
    #pragma unroll
    for (int j = 0; j < MMV_MAXN; ++j) {
        if (j >= N) break;
        float s = acc[j];
        for (int o = W >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        if (live && sub == 0) *(float*)(dst + m * 4 + j * P[13] + i2 * P[14] + i3 * P[15]) = s;
    }
}

// mul_mat_id: grid.y over (token, slot); one activation row each.
// P: [M, K, n_used, n_tok, n_exp, nb_b1 (B), nbw1, nbw2, nbx1, nbx2, nbd1, nbd2, nbi0, nbi1]
template <int WT>
__global__ void k_mul_mat_id(const i64* __restrict__ P, char* dst, const char* w, const char* x,
                             const char* ids, int* err) {
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const i64 m = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (m >= P[0]) return;
    const i64 u = blockIdx.y % P[2], t = blockIdx.y / P[2];
    const int e = *(const int*)(ids + u * P[12] + t * P[13]);
    if (e < 0 || e >= P[4]) { if (lane == 0) *err = 1; return; }
    const u8* row = (const u8*)(w + m * P[6] + (i64)e * P[7]);
    const float4* xv = (const float4*)(x + (u % P[5]) * P[8] + t * P[9]);
    const int nch = (int)(P[1] / 32);
    float acc = 0.0f, y[32];
    for (int c = lane; c < nch; c += 32) {
        deq32<WT>(row, c, y);
        #pragma unroll
        for (int l = 0; l < 8; ++l) {
            const float4 v = xv[8 * c + l];
            acc += y[4 * l] * v.x + y[4 * l + 1] * v.y + y[4 * l + 2] * v.z + y[4 * l + 3] * v.w;
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) *(float*)(dst + m * 4 + u * P[10] + t * P[11]) = acc;
}

// ==== mat-vec (n <= MMV_MAXN) of large weight matrices: rows streamed through shared memory ====
// Each warp owns whole weight rows (a persistent grid: a warp takes several rows) and streams them
// in MMVP_SEG-byte stages with cp.async, MMVP_NS stages in flight, so DRAM latency is hidden
// without spending registers on it; lanes then compute from the stage. The activations sit in
// shared memory for the whole block: quantized per 32 elements (int8 q, float d, int sum of q)
// for quantized weights, so the dot of a 32-element weight unit is integer dp4a work, and F32
// for float weights. The block quantizes them itself while its first stages are in flight, which
// saves a kernel launch and a round trip through global memory per product.
// Rows must be 16-byte aligned with a size a multiple of 16 bytes; K a multiple of 32.

// dot of 32-element unit u of a row (in shared memory) with activation unit (xq words, d, sum);
// the declaration, ld_u16x2 and the other block types' are in quants.cuh
template <> __device__ __forceinline__ float unit_dot<ty::Q4_0>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* b = row + u * 18;
    int acc = 0;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned int v = ld_u16x2(b + 2 + 4 * i);
        acc = __dp4a((int)(v & 0x0F0F0F0F), xq[i], acc);
        acc = __dp4a((int)((v >> 4) & 0x0F0F0F0F), xq[4 + i], acc);
    }
    return f16at(b) * dx * (float)(acc - 8 * sx);
}
template <> __device__ __forceinline__ float unit_dot<ty::Q8_0>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* b = row + u * 34;
    int acc = 0;
    #pragma unroll
    for (int i = 0; i < 8; ++i) acc = __dp4a((int)ld_u16x2(b + 2 + 4 * i), xq[i], acc);
    return f16at(b) * dx * (float)acc;
}
// integer dot cores of one 32-element unit against its activation quants xq[8], shared by the
// shared-memory (unit_dot) and register (unit_regs) mat-vecs
// Q4_K: nibbles at bit sh of the 32 bytes q0, q1
__device__ __forceinline__ int dot_q4k(uint4 q0, uint4 q1, int sh, const int* xq) {
    const unsigned int q[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
    int acc = 0;
    #pragma unroll
    for (int i = 0; i < 8; ++i) acc = __dp4a((int)((q[i] >> sh) & 0x0F0F0F0F), xq[i], acc);
    return acc;
}
// Q4_0x8: 16 bytes, element l < 16 the low nibble of byte l, element l + 16 its high nibble
__device__ __forceinline__ int dot_q4x8(uint4 q, const int* xq) {
    const unsigned int w[4] = {q.x, q.y, q.z, q.w};
    int acc = 0;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc = __dp4a((int)(w[i] & 0x0F0F0F0F), xq[i], acc);
        acc = __dp4a((int)((w[i] >> 4) & 0x0F0F0F0F), xq[4 + i], acc);
    }
    return acc;
}
// Q8_0x8: elements 0..15 in lo, 16..31 in hi
__device__ __forceinline__ int dot_q8x8(uint4 lo, uint4 hi, const int* xq) {
    int acc = __dp4a((int)lo.x, xq[0], 0);
    acc = __dp4a((int)lo.y, xq[1], acc);
    acc = __dp4a((int)lo.z, xq[2], acc);
    acc = __dp4a((int)lo.w, xq[3], acc);
    acc = __dp4a((int)hi.x, xq[4], acc);
    acc = __dp4a((int)hi.y, xq[5], acc);
    acc = __dp4a((int)hi.z, xq[6], acc);
    return __dp4a((int)hi.w, xq[7], acc);
}
template <> __device__ __forceinline__ float unit_dot<ty::Q4_K>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* b = row + (u >> 3) * 144;
    const int j = u & 7;
    const u8* s = b + 4 + (j & 3);
    int sc, m;
    q4k_scale_min(s[0], s[4], s[8], j, sc, m);
    const uint4* qv = (const uint4*)(b + 16 + 32 * (j >> 1));  // 16-byte aligned: 144-byte blocks
    const int acc = dot_q4k(qv[0], qv[1], (j & 1) * 4, xq);
    return f16at(b) * (float)sc * dx * (float)acc - f16at(b + 2) * (float)m * dx * (float)sx;
}
// x8 layouts: the unit's quants are whole aligned 16-byte words, and lanes on consecutive units
// read consecutive words (no bank conflicts)
template <> __device__ __forceinline__ float unit_dot<ty::Q4_0X8>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* g = row + (u >> 3) * 144;
    const int j = u & 7;
    return f16at(g + 128 + 2 * j) * dx * (float)(dot_q4x8(*(const uint4*)(g + 16 * j), xq) - 8 * sx);
}
template <> __device__ __forceinline__ float unit_dot<ty::Q8_0X8>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* g = row + (u >> 3) * 272;
    const int j = u & 7;
    const int acc = dot_q8x8(*(const uint4*)(g + 16 * j), *(const uint4*)(g + 128 + 16 * j), xq);
    return f16at(g + 256 + 2 * j) * dx * (float)acc;
}
// Q4_Kx8: sub-block j of the super-block whose header is h (see deq32<ty::Q4_KX8>)
__device__ __forceinline__ float q4kx8_dot(uint4 q, uint4 h, int j, const int* xq, float dx, int sx) {
    int sc, m;
    q4kx8_scale_min(h.y, h.z, h.w, j, sc, m);
    const float2 dm = __half22float2(*(const __half2*)&h.x);  // d, dmin
    return dx * (dm.x * (float)(sc * dot_q4x8(q, xq)) - dm.y * (float)(m * sx));
}
template <> __device__ __forceinline__ float unit_dot<ty::Q4_KX8>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* g = row + (u >> 3) * 144;
    return q4kx8_dot(*(const uint4*)(g + 16 * (u & 7)), *(const uint4*)(g + 128), u & 7, xq, dx, sx);
}
template <> __device__ __forceinline__ float unit_dot<ty::Q6_K>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* b = row + (u >> 3) * 210;
    const int j = u & 7, n = j >> 2, quarter = j & 3;
    const u8* ql = b + 64 * n + ((quarter & 1) ? 32 : 0);
    const u8* qh = b + 128 + 32 * n;
    const signed char* sc = (const signed char*)(b + 192) + 8 * n + 2 * quarter;
    const int shl = (quarter >> 1) * 4, shh = 2 * quarter;
    int acc0 = 0, acc1 = 0, s0 = 0, s1 = 0;
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        const unsigned int lo = (ld_u16x2(ql + 4 * i) >> shl) & 0x0F0F0F0F;
        const unsigned int hi = ((ld_u16x2(qh + 4 * i) >> shh) & 0x03030303) << 4;
        const int q = (int)(lo | hi);
        if (i < 4) { acc0 = __dp4a(q, xq[i], acc0); s0 = __dp4a(0x01010101, xq[i], s0); }
        else { acc1 = __dp4a(q, xq[i], acc1); s1 = __dp4a(0x01010101, xq[i], s1); }
    }
    return f16at(b + 208) * dx * ((float)sc[0] * (float)(acc0 - 32 * s0) + (float)sc[1] * (float)(acc1 - 32 * s1));
}

// MMVP_SEG: bytes of a stage, MMVP_NS: stages per warp (matvec.py passes its PIPE_SEG, PIPE_STAGES)
#if !defined(MMVP_SEG) || !defined(MMVP_NS)
#error "matvec.cu is compiled with -DMMVP_SEG and -DMMVP_NS (matvec.py)"
#endif
template <int WT> struct is_quant {
    enum { v = WT != ty::F32 && WT != ty::F16 && WT != ty::BF16 };
};

// N activation rows of K floats (row stride nbx1, 16-byte aligned) → shared memory in the
// quantized layout above quantize4, eight lanes per 32-element block, four float4 loads in
// flight per lane (the loads come from L2: latency, not bandwidth).
__device__ void mmvp_quantize_x(char* sx, const char* x, i64 nbx1, int K, int N) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int total = N * K;
    constexpr int U = 4;
    for (int base = warp * 128 * U; base < total; base += nw * 128 * U) {
        float4 v[U];
        #pragma unroll
        for (int g = 0; g < U; ++g) {
            const int e = base + 128 * g + 4 * lane, j = e / K;
            v[g] = e < total ? *(const float4*)(x + j * nbx1 + (i64)(e - j * K) * 4) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        #pragma unroll
        for (int g = 0; g < U; ++g) quantize4(sx, v[g], base + 128 * g + 4 * lane, total);
    }
}
// N activation rows of K floats → shared memory as F32 [N][K]. With PLANES (weights of 8
// elements per 16-byte word), each row is stored as two planes of float4: plane h holds
// elements 8v + 4h .. 8v + 4h + 3 at index v, so lanes reading their word's 8 activations hit
// consecutive 16-byte slots (a plain layout puts them 32 bytes apart: two-way bank conflicts).
template <bool PLANES>
__device__ void mmvp_copy_x(char* sx, const char* x, i64 nbx1, int K, int N) {
    const int n4 = N * K / 4, k4 = K / 4;
    float4* d = (float4*)sx;
    constexpr int U = 4;
    for (int base = threadIdx.x; base < n4; base += blockDim.x * U) {
        float4 v[U];
        #pragma unroll
        for (int g = 0; g < U; ++g) {
            const int i = base + g * blockDim.x, j = i / k4;
            if (i < n4) v[g] = ((const float4*)(x + j * nbx1))[i - j * k4];
        }
        #pragma unroll
        for (int g = 0; g < U; ++g) {
            const int i = base + g * blockDim.x, j = i / k4, c = i - j * k4;
            if (i < n4) d[PLANES ? j * k4 + (c & 1) * (k4 / 2) + (c >> 1) : i] = v[g];
        }
    }
}

// one stage (bytes [s0, s0 + nbytes) of a row) against the activations in shared memory
template <int WT>
__device__ __forceinline__ void mmvp_consume(const u8* stage, int s0, int nbytes, const char* sx, int K, int N,
                                             int lane, float* acc) {
    if constexpr (is_quant<WT>::v) {
        // a 32-element unit per lane; two at a time (independent chains for the scheduler)
        const int bb = qfmt<WT>::BB, upb = qfmt<WT>::UPB, nbk = K / 32;
        const signed char* xq = (const signed char*)sx;
        const float* xd = (const float*)(sx + N * K);
        const int* xs = (const int*)(xd + N * nbk);
        const int units = nbytes / bb * upb, u0 = s0 / bb * upb;
        auto one = [&](int u, int j) -> float {
            const int xr = j * nbk + u0 + u;
            const int4 a0 = *(const int4*)(xq + 16 * xr), a1 = *(const int4*)(xq + N * K / 2 + 16 * xr);
            const int xw[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            return unit_dot<WT>(stage, u, xw, xd[xr], xs[xr]);
        };
        for (int u = lane; u < units; u += 64) {
            const bool two = u + 32 < units;
            #pragma unroll
            for (int j = 0; j < MMV_MAXN; ++j) {
                if (j >= N) break;
                const float r0 = one(u, j);
                const float r1 = two ? one(u + 32, j) : 0.0f;
                acc[j] += r0 + r1;
            }
        }
    } else {
        constexpr int EPV = WT == ty::F32 ? 4 : 8;  // elements per 16-byte word
        const float4* xf = (const float4*)sx;  // see mmvp_copy_x: two planes when EPV == 8
        const int k4 = K / 4;
        const int nvec = nbytes / 16, e0 = s0 / 16 * EPV;
        for (int v = lane; v < nvec; v += 32) {
            const uint4 wv = ((const uint4*)stage)[v];
            float wf[8];
            if constexpr (WT == ty::F32) {
                wf[0] = __uint_as_float(wv.x); wf[1] = __uint_as_float(wv.y);
                wf[2] = __uint_as_float(wv.z); wf[3] = __uint_as_float(wv.w);
            } else if constexpr (WT == ty::F16) {
                half8(wv, wf);
            } else {  // BF16: the high half of an F32
                const unsigned int u4[4] = {wv.x, wv.y, wv.z, wv.w};
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    wf[2 * i] = __uint_as_float(u4[i] << 16); wf[2 * i + 1] = __uint_as_float(u4[i] & 0xFFFF0000u);
                }
            }
            #pragma unroll
            for (int j = 0; j < MMV_MAXN; ++j) {
                if (j >= N) break;
                const int wi = (e0 + v * EPV) / EPV;  // the word's index in the row
                float s = 0.0f;
                #pragma unroll
                for (int l = 0; l < EPV / 4; ++l) {
                    const float4 b = xf[j * k4 + (EPV == 8 ? l * (k4 / 2) + wi : wi)];
                    s += wf[4 * l] * b.x + wf[4 * l + 1] * b.y + wf[4 * l + 2] * b.z + wf[4 * l + 3] * b.w;
                }
                acc[j] += s;
            }
        }
    }
}

// P: [M, K, N, ne2, ne3, r2, r3, nbw1, nbw2, nbw3, nbd1, nbd2, nbd3, row_bytes, seg_bytes, nbx1, nbx2, nbx3]
// grid: (persistent blocks over rows, ne2 * ne3); dynamic shared memory: warps * MMVP_NS *
// MMVP_SEG bytes of stages, then the activations (matvec.py: _pipe_shape)
template <int WT>
__global__ void __launch_bounds__(512) k_mmv_pipe(const i64* __restrict__ P, char* dst, const char* w, const char* x) {
    pdl_enter();
    extern __shared__ uint4 smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int M = (int)P[0], K = (int)P[1], N = (int)P[2];
    const i64 i2 = blockIdx.y % P[3], i3 = blockIdx.y / P[3];
    const int row_bytes = (int)P[13], seg = (int)P[14];
    const char* wb = w + (i2 / P[5]) * P[8] + (i3 / P[6]) * P[9];
    uint4* stages = smem + warp * (MMVP_NS * MMVP_SEG / 16);
    char* sx = (char*)(smem + nw * (MMVP_NS * MMVP_SEG / 16));
    const int nseg = (row_bytes + seg - 1) / seg;
    const int m0 = blockIdx.x * nw + warp, mstep = gridDim.x * nw;
    const int nsteps = (m0 < M ? (M - 1 - m0) / mstep + 1 : 0) * nseg;  // this warp's rows × segments
    auto issue = [&](int t) {  // stage t into slot t % MMVP_NS; an empty group past the end
        if (t < nsteps) {
            const int r = t / nseg, s0 = (t - r * nseg) * seg;
            const int nvec = min(seg, row_bytes - s0) >> 4;
            const uint4* src = (const uint4*)(wb + (i64)(m0 + r * mstep) * P[7] + s0);
            uint4* d = stages + (t % MMVP_NS) * (MMVP_SEG / 16);
            for (int v = lane; v < nvec; v += 32) cp_async16(d + v, src + v);
        }
        cp_async_commit();
    };
    #pragma unroll
    for (int t = 0; t < MMVP_NS - 1; ++t) issue(t);
    const char* xb = x + i2 * P[16] + i3 * P[17];
    if constexpr (is_quant<WT>::v) mmvp_quantize_x(sx, xb, P[15], K, N);
    else mmvp_copy_x<WT != ty::F32>(sx, xb, P[15], K, N);
    __syncthreads();
    float acc[MMV_MAXN];
    #pragma unroll
    for (int j = 0; j < MMV_MAXN; ++j) acc[j] = 0.0f;
    for (int t = 0; t < nsteps; ++t) {
        cp_async_wait<MMVP_NS - 2>();  // stage t has landed (for this lane's copies) ...
        __syncwarp();                   // ... and for every lane's
        issue(t + MMVP_NS - 1);         // into the slot consumed in step t - 1
        const int r = t / nseg, s0 = (t - r * nseg) * seg;
        mmvp_consume<WT>((const u8*)(stages + (t % MMVP_NS) * (MMVP_SEG / 16)), s0, min(seg, row_bytes - s0), sx, K,
                         N, lane, acc);
        __syncwarp();
        if (s0 + seg >= row_bytes) {
            const i64 m = m0 + (i64)r * mstep;
            #pragma unroll
            for (int j = 0; j < MMV_MAXN; ++j) {
                if (j >= N) break;
                const float s = warp_sum(acc[j]);
                if (lane == 0) *(float*)(dst + m * 4 + j * P[10] + i2 * P[11] + i3 * P[12]) = s;
                acc[j] = 0.0f;
            }
        }
    }
    cp_async_wait<0>();
}

// ==== mat-vec (n <= MMV_MAXN) of Q4_0x8, Q8_0x8, Q4_Kx8 and Q4_K weights from registers ====
// The activations are quantized once, by k_quant_x or by the k_norm_vec that produced them, into
// global memory (quantize4's layout); then each thread loads U units of its row straight into
// registers, all U loads in flight before any is used, and blocks of 128 threads (1 to 16 rows)
// leave the hardware to balance them over the SMs. No shared-memory staging and no per-block
// set-up: the pipelined kernel's per-block quantization of the activations (3-5 us on a
// 4096 x 14336 product, its loads queued behind the weights') is what this one avoids.
template <int WT> struct unit_regs;
// A unit_regs holds W 32-element units of a row (one load's worth: W = 1, or 2 where two units
// share a header); load(row, u) takes load-unit u (units W·u .. W·u + W - 1), dot(s, ..) unit W·u + s.
template <> struct unit_regs<ty::Q4_0X8> {
    static constexpr int W = 1;
    uint4 q;
    unsigned short d;
    __device__ __forceinline__ void load(const u8* row, int u) {
        const u8* g = row + (u >> 3) * 144;
        q = __ldcs((const uint4*)(g + 16 * (u & 7)));
        d = __ldcs((const unsigned short*)(g + 128 + 2 * (u & 7)));
    }
    __device__ __forceinline__ float dot(int, const int* xq, float dx, int sx) const {
        return __half2float(__ushort_as_half(d)) * dx * (float)(dot_q4x8(q, xq) - 8 * sx);
    }
};
template <> struct unit_regs<ty::Q8_0X8> {
    static constexpr int W = 1;
    uint4 lo, hi;
    unsigned short d;
    __device__ __forceinline__ void load(const u8* row, int u) {
        const u8* g = row + (u >> 3) * 272;
        lo = __ldcs((const uint4*)(g + 16 * (u & 7)));
        hi = __ldcs((const uint4*)(g + 128 + 16 * (u & 7)));
        d = __ldcs((const unsigned short*)(g + 256 + 2 * (u & 7)));
    }
    __device__ __forceinline__ float dot(int, const int* xq, float dx, int sx) const {
        return __half2float(__ushort_as_half(d)) * dx * (float)dot_q8x8(lo, hi, xq);
    }
};
template <> struct unit_regs<ty::Q4_K> {
    static constexpr int W = 1;
    uint4 q0, q1;
    unsigned int dm;  // d, dmin
    unsigned char b0, b1, b2;
    int j;
    __device__ __forceinline__ void load(const u8* row, int u) {
        const u8* b = row + (u >> 3) * 144;
        j = u & 7;
        q0 = __ldcs((const uint4*)(b + 16 + 32 * (j >> 1)));
        q1 = __ldcs((const uint4*)(b + 32 + 32 * (j >> 1)));
        dm = __ldcs((const unsigned int*)b);
        b0 = __ldcs(b + 4 + (j & 3)), b1 = __ldcs(b + 8 + (j & 3)), b2 = __ldcs(b + 12 + (j & 3));
    }
    __device__ __forceinline__ float dot(int, const int* xq, float dx, int sx) const {
        int sc, m;
        q4k_scale_min(b0, b1, b2, j, sc, m);
        const float d = __half2float(__ushort_as_half((unsigned short)(dm & 0xFFFF)));
        const float dmin = __half2float(__ushort_as_half((unsigned short)(dm >> 16)));
        return d * (float)sc * dx * (float)dot_q4k(q0, q1, (j & 1) * 4, xq) - dmin * (float)m * dx * (float)sx;
    }
};
// Q4_Kx8: two sub-blocks (32 contiguous bytes) and their super-block's header per load, so a
// thread holds 36 bytes of weights in 13 registers (one sub-block per load would spend 9)
template <> struct unit_regs<ty::Q4_KX8> {
    static constexpr int W = 2;
    uint4 q0, q1, h;
    int j0;  // the first sub-block
    __device__ __forceinline__ void load(const u8* row, int u) {
        const u8* g = row + (u >> 2) * 144;
        j0 = 2 * (u & 3);
        q0 = __ldcs((const uint4*)(g + 16 * j0));
        q1 = __ldcs((const uint4*)(g + 16 * j0 + 16));
        h = __ldcs((const uint4*)(g + 128));
    }
    __device__ __forceinline__ float dot(int s, const int* xq, float dx, int sx) const {
        return q4kx8_dot(s ? q1 : q0, h, j0 + s, xq, dx, sx);
    }
};

// One pass of the register mat-vecs: the U loads of each of RT rows in r (row k's at r[k U ..];
// load-units u0, u0 + step, ...; those past `loads` absent) against activation row xr0 / units of
// the quantized activations (quantize4's planes x0, x1, scales xd, sums xs; xr0 the row's first
// unit), added to acc[k]. The RT rows share each activation load.
template <int WT, int U, int RT>
__device__ __forceinline__ void pass_dot(const unit_regs<WT>* r, float* acc, int u0, int step, int loads, int xr0,
                                         const int4* x0, const int4* x1, const float* xd, const int* xs) {
    constexpr int W = unit_regs<WT>::W;
    float p[RT];
    #pragma unroll
    for (int k = 0; k < RT; ++k) p[k] = 0.0f;
    #pragma unroll
    for (int i = 0; i < U; ++i) {
        const int u = u0 + step * i;
        if (u < loads) {
            #pragma unroll
            for (int s = 0; s < W; ++s) {
                const int xr = xr0 + W * u + s;
                const int4 a = __ldg(x0 + xr), b = __ldg(x1 + xr);
                const int xw[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
                const float dx = __ldg(xd + xr);
                const int sx = __ldg(xs + xr);
                #pragma unroll
                for (int k = 0; k < RT; ++k) p[k] += r[k * U + i].dot(s, xw, dx, sx);
            }
        }
    }
    #pragma unroll
    for (int k = 0; k < RT; ++k) acc[k] += p[k];
}

// P: [K, N, ne2, nbx1, nbx2, nbx3, xq_bytes]; grid (warps of 128 elements / 8, ne2 * ne3), 256 threads.
// Batch b's N x K activations → xq + b * xq_bytes, in quantize4's layout.
__global__ void k_quant_x(const i64* __restrict__ P, char* xq, const char* x) {
    pdl_enter();
    const int K = (int)P[0], total = (int)P[1] * K;
    const int w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (w * 128 >= total) return;  // whole warps: the shuffles in quantize4 need all 32 lanes
    const i64 i2 = blockIdx.y % P[2], i3 = blockIdx.y / P[2];
    const int e = w * 128 + 4 * (threadIdx.x & 31), j = e / K;
    const char* xb = x + i2 * P[4] + i3 * P[5];
    const float4 v = e < total ? *(const float4*)(xb + j * P[3] + (i64)(e - j * K) * 4) : make_float4(0.f, 0.f, 0.f, 0.f);
    quantize4(xq + blockIdx.y * P[6], v, e, total);
}

// P: [M, K, N, ne2, ne3, r2, r3, nbw1, nbw2, nbw3, nbd1, nbd2, nbd3, lpr, xq_bytes, early]; lpr: lanes
// per row (8 .. 128, a power of two: 128 / lpr rows per 128-thread block); grid (rows / (128 /
// lpr), ne2 * ne3). NMAX: 1, or MMV_MAXN for 1..8 activation rows (one accumulator each: the
// single-row kernel keeps to 64 registers, so 8 blocks fit an SM). Rows 16-byte aligned; K a
// multiple of 256.
template <int WT, int U, int NMAX>
__global__ void __launch_bounds__(128, NMAX == 1 ? 8 : 1)
k_mmv_row(const i64* __restrict__ P, char* dst, const char* w, const char* xq) {
    const int M = (int)P[0], K = (int)P[1], N = NMAX == 1 ? 1 : (int)P[2], lpr = (int)P[13];
    const int rr = threadIdx.x / lpr, lid = threadIdx.x % lpr;  // row within the block, lane within the row
    const int m = blockIdx.x * (128 / lpr) + rr;
    const int units = K / 32, total = N * K;
    const u8* row = (const u8*)w + (i64)min(m, M - 1) * P[7];
    const char* xb = xq;
    int i2 = 0, i3 = 0;
    if (gridDim.y > 1) {  // batches: 32-bit divisions, and none at all for a plain product
        i2 = blockIdx.y % (int)P[3], i3 = blockIdx.y / (int)P[3];
        row += (i2 / (int)P[5]) * P[8] + (i3 / (int)P[6]) * P[9];
        xb += blockIdx.y * P[14];
    }
    const int4* x0 = (const int4*)xb;  // the two 16-byte planes of quants, then scales and sums
    const int4* x1 = (const int4*)(xb + total / 2);
    const float* xd = (const float*)(xb + total);
    const int* xs = (const int*)(xd + total / 32);
    float acc[NMAX];
    #pragma unroll
    for (int j = 0; j < NMAX; ++j) acc[j] = 0.0f;
    unit_regs<WT> r[U];
    constexpr int W = unit_regs<WT>::W;
    const int loads = units / W;
    auto load = [&](int u0) {
        #pragma unroll
        for (int i = 0; i < U; ++i)
            if (u0 + lpr * i < loads) r[i].load(row, u0 + lpr * i);
    };
    // P[15] set (matvec.py: no kernel of the graph writes the weights' buffer): the first pass's
    // weights are in flight before waiting for the kernel that wrote the activations
    const bool early = P[15] != 0;
    if (early) load(lid);
    pdl_enter();
    if (!early) load(lid);
    for (int u0 = lid; u0 < loads; u0 += lpr * U) {
        if (u0 != lid) load(u0);
        #pragma unroll
        for (int j = 0; j < NMAX; ++j)
            if (j < N) pass_dot<WT, U, 1>(r, acc + j, u0, lpr, loads, j * units, x0, x1, xd, xs);
    }
    // sum over the row's lanes: within the warp (xor offsets below lpr), then across its warps
    __shared__ float part[4][NMAX];
    #pragma unroll
    for (int j = 0; j < NMAX; ++j) {
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            if (o < lpr) acc[j] += __shfl_xor_sync(0xffffffff, acc[j], o);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lpr <= 32) {
        if (lid == 0 && m < M) {
            #pragma unroll
            for (int j = 0; j < NMAX; ++j)
                if (j < N) *(float*)(dst + m * 4 + j * P[10] + i2 * P[11] + i3 * P[12]) = acc[j];
        }
        return;
    }
    if (lane == 0) {
        #pragma unroll
        for (int j = 0; j < NMAX; ++j) part[warp][j] = acc[j];
    }
    __syncthreads();
    const int wpr = lpr / 32, t = threadIdx.x, ro = t / NMAX, j = t % NMAX;  // one thread per (row, j)
    const int mo = blockIdx.x * (128 / lpr) + ro;
    if (ro < 128 / lpr && j < N && mo < M) {
        float s = 0.0f;
        for (int k = 0; k < wpr; ++k) s += part[ro * wpr + k][j];
        *(float*)(dst + mo * 4 + j * P[10] + i2 * P[11] + i3 * P[12]) = s;
    }
}

// ---- the Q/K/V projection's epilogue (fusion.product_rope_cache) ----------------------------------
// One SET_ROWS of a contiguous source, element j of which is (i0, i1, i2) over its ne0 x ne1 x ..
// shape: dst + i0 nbd0 + idx[i1 nbi0 + (i2 % nei1) nbi1] nbd1 + i2 nbd2. C: [dst, idx, ne0, ne1,
// nbd0, nbd1, nbd2, nbi0, nbi1, nei1, n_rows, f16]; a row index outside n_rows sets *err.
__device__ __forceinline__ void cache_put(const i64* __restrict__ C, int j, float v, int* err) {
    const int ne0 = (int)C[2], ne1 = (int)C[3], i0 = j % ne0, i1 = (j / ne0) % ne1, i2 = j / (ne0 * ne1);
    const int row = *(const int*)((const char*)C[1] + i1 * C[7] + (i2 % (int)C[9]) * C[8]);
    if (row < 0 || row >= C[10]) { *err = 1; return; }
    char* d = (char*)C[0] + i0 * C[4] + (i64)row * C[5] + i2 * C[6];
    if (C[11]) st<__half>(d, v); else st<float>(d, v);
}
// rows m, m + 1 (m even) of the product [Q | K | V] (nq, nk, nk rows): Q and K pairs rotated by
// rope (normal mode, heads of hd), Q stored as F32 at qdst, K and V put into their caches. Q:
// P[16..28] = nq, nk, hd, n_dims, rope_cs's six, qdst, pos, err; K's cache_put at P + 29, V's at
// P + 41.
__device__ __forceinline__ void qkv_put(const i64* __restrict__ P, int m, float x0, float x1) {
    const int nq = (int)P[16], nk = (int)P[17];
    int* err = (int*)P[28];
    if (m >= nq + nk) {
        cache_put(P + 41, m - nq - nk, x0, err);
        cache_put(P + 41, m + 1 - nq - nk, x1, err);
        return;
    }
    const int j = m < nq ? m : m - nq, ic = (j % (int)P[18]) / 2;
    if (2 * ic < (int)P[19]) {
        float cs, sn;
        rope_cs(P + 20, (float)*(const int*)P[27], ic, cs, sn);
        const float y0 = x0 * cs - x1 * sn;
        x1 = x0 * sn + x1 * cs;
        x0 = y0;
    }
    if (m < nq) {
        *(float2*)((char*)P[26] + 4 * (i64)j) = make_float2(x0, x1);
    } else {
        cache_put(P + 29, j, x0, err);
        cache_put(P + 29, j + 1, x1, err);
    }
}

// k_mmv_row for the common decode case, one activation row and one batch, with the lanes per row
// (LPR: 32, 64 or 128) and the occupancy bound (MINB blocks of 128 threads per SM) fixed at
// compile time: the reduction and the lane split are then constants, no batch or row-count
// logic is left, and the weights of a pass sit in one register array; 7-13 % faster than the
// general kernel on an H200 (Q4_0x8, Q4_Kx8, Q8_0x8 at 4096 x 14336, measured side by side).
// RT rows per lane group (1 or 2: rows RT g .. RT g + RT - 1 of group g), sharing each load of
// the activations; grid (rows / (RT 128 / LPR)). LPR 8 or 16 (k_mmv_row1_id's short rows, a MoE's
// down products): several rows per warp, so a block's lanes are not idle where a row has fewer
// loads than 32 lanes. Same P; QKV: the rows go through qkv_put
// instead of to dst (an even number of rows per block: a rope pair is in one block).
template <int WT, int U, int LPR, int MINB, int RT, bool QKV>
__device__ __forceinline__ void mmv_row1(const i64* __restrict__ P, char* dst, const char* w, const char* xq,
                                         bool early) {
    constexpr int W = unit_regs<WT>::W, RPB = 128 / LPR;
    const int M = (int)P[0], K = (int)P[1], units = K / 32, loads = units / W;
    const int lid = threadIdx.x % LPR, m = RT * (blockIdx.x * RPB + threadIdx.x / LPR);
    const u8* row[RT];
    #pragma unroll
    for (int k = 0; k < RT; ++k) row[k] = (const u8*)w + (i64)min(m + k, M - 1) * P[7];
    const int4* x0 = (const int4*)xq;  // quantize4's layout for total = K
    const int4* x1 = (const int4*)(xq + K / 2);
    const float* xd = (const float*)(xq + K);
    const int* xs = (const int*)(xd + units);
    unit_regs<WT> r[RT * U];
    auto load = [&](int u0) {
        #pragma unroll
        for (int i = 0; i < U; ++i) {
            #pragma unroll
            for (int k = 0; k < RT; ++k)
                if (u0 + LPR * i < loads) r[k * U + i].load(row[k], u0 + LPR * i);
        }
    };
    if (!early) pdl_enter();  // as k_mmv_row (one load site: fewer registers)
    load(lid);
    if (early) pdl_enter();
    float acc[RT];
    #pragma unroll
    for (int k = 0; k < RT; ++k) acc[k] = 0.0f;
    for (int u0 = lid; u0 < loads; u0 += LPR * U) {
        if (u0 != lid) load(u0);
        pass_dot<WT, U, RT>(r, acc, u0, LPR, loads, 0, x0, x1, xd, xs);
    }
    #pragma unroll
    for (int k = 0; k < RT; ++k) {  // a row's lanes: whole warps, or (LPR < 32) an aligned part of one
        if constexpr (LPR >= 32) {
            acc[k] = warp_sum(acc[k]);
        } else {
            #pragma unroll
            for (int o = LPR / 2; o > 0; o >>= 1) acc[k] += __shfl_xor_sync(0xffffffff, acc[k], o);
        }
    }
    if constexpr (LPR > 32) {  // then across the row's warps
        __shared__ float part[RT][4];
        if ((threadIdx.x & 31) == 0) {
            #pragma unroll
            for (int k = 0; k < RT; ++k) part[k][threadIdx.x >> 5] = acc[k];
        }
        __syncthreads();
        #pragma unroll
        for (int k = 0; k < RT; ++k) {
            float t = 0.0f;
            #pragma unroll
            for (int c = 0; c < LPR / 32; ++c) t += part[k][threadIdx.x / LPR * (LPR / 32) + c];
            acc[k] = t;
        }
    }
    if constexpr (QKV) {
        __shared__ float res[RT * RPB];
        if (lid == 0) {
            #pragma unroll
            for (int k = 0; k < RT; ++k) res[m + k - RT * RPB * blockIdx.x] = acc[k];
        }
        __syncthreads();
        const int p = 2 * threadIdx.x, mp = RT * RPB * blockIdx.x + p;
        if (p < RT * RPB && mp < M) qkv_put(P, mp, res[p], res[p + 1]);
    } else {
        #pragma unroll
        for (int k = 0; k < RT; ++k)
            if (lid == 0 && m + k < M) *(float*)(dst + (m + k) * 4) = acc[k];
    }
}

template <int WT, int U, int LPR, int MINB, int RT, bool QKV = false>
__global__ void __launch_bounds__(128, MINB)
k_mmv_row1(const i64* __restrict__ P, char* dst, const char* w, const char* xq) {
    mmv_row1<WT, U, LPR, MINB, RT, QKV>(P, dst, w, xq, P[15] != 0);
}

// MUL_MAT_ID of a few tokens through k_mmv_row1's body: grid.y over (token t, slot u); the
// expert ids[u, t] names, the activation row u % B of token t (quantized per row: xq_bytes
// apart, row u % B + B t) and the output row (u, t). The ids come from an earlier kernel, so the
// weights are loaded only after pdl_enter. An id out of range sets the error flag. pair > 0: two
// products of the same activations and ids in one launch (a MoE layer's gate and up): grid.y
// rows from pair on use the second experts w2 and result dst2 (same shapes and strides).
// P: k_mmv_row1's [0..15], then [ids, nbi0, nbi1, n_used, B, n_exp, err, pair, w2, dst2]
template <int WT, int U, int LPR, int MINB, int RT>
__global__ void __launch_bounds__(128, MINB)
k_mmv_row1_id(const i64* __restrict__ P, char* dst, const char* w, const char* xq) {
    pdl_enter();
    int y = blockIdx.y;
    if (P[23] && y >= P[23]) {
        y -= (int)P[23];
        w = (const char*)P[24];
        dst = (char*)P[25];
    }
    const int n_used = (int)P[19], B = (int)P[20], u = y % n_used, t = y / n_used;
    const int e = *(const int*)((const char*)P[16] + u * P[17] + t * P[18]);
    if (e < 0 || e >= (int)P[21]) {
        if (threadIdx.x == 0) *(int*)P[22] = 1;
        return;
    }
    mmv_row1<WT, U, LPR, MINB, RT, false>(P, dst + u * P[10] + t * P[11], w + (i64)e * P[8],
                                          xq + (i64)(u % B + B * t) * P[14], true);
}

// ---- mat-vec through per-warp shared-memory rings (k_mmv_ring) ---------------------------------
// One activation row, one batch, x8 weights (Q4_0x8, Q8_0x8, Q4_Kx8), K a multiple of 1024 UPL.
// Each warp owns one weight row and streams it in steps of 4 UPL x8 groups (32 UPL units: 576
// UPL bytes, 1088 UPL for Q8_0x8) through S slots of shared memory with cp.async, S - 1 steps in
// flight, each lane taking UPL units of the step that has landed. The register kernel
// (k_mmv_row1) keeps in flight only the loads its registers hold, all issued at once, and its
// SM's blocks then wait together; here every warp keeps a steady S - 1 steps queued. The
// activations (quantize4's layout, written by k_quant_x or the norm before) come from L1.
// UNR: the step loop's unrolling. Measured on an H200 at 4096 x 14336 (a PDL chain of products,
// 8 blocks per SM): Q4_0 10.1 -> 8.7 us, Q4_K 10.9 -> 9.2, Q8_0 17.9 -> 15.7; at K = 4096 the
// register kernel stays ahead for Q4_0 (matvec.py: REGISTER, _ring_fits).
// P: k_mmv_row's; grid (rows / 4), 128 threads, dynamic shared memory 4 S steps of the type.
template <int WT, int S, int MINB, int UPL, int UNR>
__global__ void __launch_bounds__(128, MINB) k_mmv_ring(const i64* __restrict__ P, char* dst, const char* w,
                                                        const char* xq) {
    extern __shared__ uint4 ring[];
    constexpr int G = qfmt<WT>::UNIT, CH = 4 * UPL * G / 16;  // an x8 group's bytes, 16-byte chunks of a step
    const int M = (int)P[0], K = (int)P[1], units = K / 32, steps = units / (32 * UPL);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, m = blockIdx.x * 4 + warp;
    uint4* slots = ring + warp * (S * CH);
    const uint4* row = (const uint4*)(w + (i64)min(m, M - 1) * P[7]);
    auto issue = [&](int st) {  // step st into its slot; an empty group past the end
        if (st < steps) {
            #pragma unroll
            for (int c = lane; c < CH; c += 32) cp_async16(slots + (st % S) * CH + c, row + st * CH + c);
        }
        cp_async_commit();
    };
    const bool early = P[15] != 0;  // as k_mmv_row: the first steps stream while the previous kernel drains
    if (!early) pdl_enter();
    #pragma unroll
    for (int st = 0; st < S - 1; ++st) issue(st);
    if (early) pdl_enter();
    const int4* x0 = (const int4*)xq;
    const int4* x1 = (const int4*)(xq + K / 2);
    const float* xd = (const float*)(xq + K);
    const int* xs = (const int*)(xd + units);
    float acc = 0.0f;
    #pragma unroll UNR
    for (int st = 0; st < steps; ++st) {
        int4 a[UPL], b[UPL];
        float dx[UPL];
        int sx[UPL];
        #pragma unroll
        for (int i = 0; i < UPL; ++i) {  // issued before the wait: L1 latency hidden behind it
            const int xr = (st * UPL + i) * 32 + lane;
            a[i] = __ldg(x0 + xr), b[i] = __ldg(x1 + xr), dx[i] = __ldg(xd + xr), sx[i] = __ldg(xs + xr);
        }
        issue(st + S - 1);  // into the slot read in step st - 1 (the barrier below ended it)
        cp_async_wait<S - 1>();  // step st has landed (this lane's copies) ...
        __syncwarp();            // ... and every lane's
        #pragma unroll
        for (int i = 0; i < UPL; ++i) {
            const int xw[8] = {a[i].x, a[i].y, a[i].z, a[i].w, b[i].x, b[i].y, b[i].z, b[i].w};
            acc += unit_dot<WT>((const u8*)(slots + (st % S) * CH) + i * 4 * G, lane, xw, dx[i], sx[i]);
        }
        __syncwarp();
    }
    acc = warp_sum(acc);
    if (lane == 0 && m < M) *(float*)(dst + (i64)m * 4) = acc;
}

