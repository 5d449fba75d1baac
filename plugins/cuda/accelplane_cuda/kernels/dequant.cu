// accelplane CUDA plugin: weights dequantized to F16 for cuBLAS (gemm.py).
#include "common.cuh"

// dequantize rows to a packed F16 matrix (for the cuBLAS path). P: [M, K, nbw1]
template <int WT>
__global__ void k_dequant_f16(const i64* __restrict__ P, __half* dst, const char* w) {
    pdl_enter();
    const i64 nch = P[1] / 32;
    const i64 n = P[0] * nch;
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < n; t += (i64)gridDim.x * blockDim.x) {
        const i64 m = t / nch, c = t % nch;
        float y[32];
        deq32<WT>((const u8*)(w + m * P[2]), (int)c, y);
        __half* d = dst + m * P[1] + 32 * c;
        #pragma unroll
        for (int l = 0; l < 32; l += 2) *(__half2*)(d + l) = __floats2half2_rn(y[l], y[l + 1]);
    }
}

// ---- x8 weights (layout.py) to F16: a thread per eight elements, one 16-byte store each ----
// Word w (elements 8w .. 8w + 7) of 32-element unit u of an x8 row as eight halves. A warp's 32
// words are 8 whole units, 512 contiguous bytes of the result: every store is coalesced. Q4_0x8
// and Q8_0x8 convert their quants to F16 without floats (an integer q below 2^10 OR'd into the
// exponent of 1024 is the half 1024 + q; subtracting the offset is exact), then one F16 product
// by the block scale rounds as F32's d * q converted to F16 does.
template <int WT> __device__ __forceinline__ uint4 word_f16(const u8* row, int u, int w);
// bytes 0, 1 (s = 0x4140) or 2, 3 (s = 0x4342) of v in the two 16-bit halves of a word
__device__ __forceinline__ unsigned int bytes2(unsigned int v, unsigned int s) { return __byte_perm(v, 0, s); }
__device__ __forceinline__ unsigned int scaled2(unsigned int h, __half2 off, __half2 d) {
    const __half2 v = __hmul2(__hsub2(*(const __half2*)&h, off), d);
    return *(const unsigned int*)&v;
}
// Q4_0x8 / Q4_Kx8 nibbles: words 0, 1 the low nibbles of bytes 0-7, 8-15; words 2, 3 the high ones
__device__ __forceinline__ uint2 nibble_bytes(const u8* g, int j, int w) {
    return __ldcs((const uint2*)(g + 16 * j + 8 * (w & 1)));
}
template <> __device__ __forceinline__ uint4 word_f16<ty::Q4_0X8>(const u8* row, int u, int w) {
    const u8* g = row + (u >> 3) * 144;
    const uint2 q = nibble_bytes(g, u & 7, w);
    const __half2 d = __half2half2(__ushort_as_half(__ldcs((const unsigned short*)(g + 128 + 2 * (u & 7)))));
    const __half2 off = __float2half2_rn(1032.0f);  // 1024 + Q4_0's offset of 8
    const int sh = w & 2 ? 4 : 0;
    unsigned int o[4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned int t = bytes2(i < 2 ? q.x : q.y, i & 1 ? 0x4342u : 0x4140u);
        o[i] = scaled2(((t >> sh) & 0x000F000Fu) | 0x64006400u, off, d);
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}
template <> __device__ __forceinline__ uint4 word_f16<ty::Q8_0X8>(const u8* row, int u, int w) {
    const u8* g = row + (u >> 3) * 272;
    const int j = u & 7;  // elements 0..15 at 16j, 16..31 at 128 + 16j
    const uint2 q = __ldcs((const uint2*)(g + (w & 2 ? 128 : 0) + 16 * j + 8 * (w & 1)));
    const __half2 d = __half2half2(__ushort_as_half(__ldcs((const unsigned short*)(g + 256 + 2 * j))));
    const __half2 off = __float2half2_rn(1152.0f);  // 1024 + 128: a signed byte with its sign bit flipped
    unsigned int o[4];
    #pragma unroll
    for (int i = 0; i < 4; ++i)
        o[i] = scaled2((bytes2(i < 2 ? q.x : q.y, i & 1 ? 0x4342u : 0x4140u) ^ 0x00800080u) | 0x64006400u, off, d);
    return make_uint4(o[0], o[1], o[2], o[3]);
}
template <> __device__ __forceinline__ uint4 word_f16<ty::Q4_KX8>(const u8* row, int u, int w) {
    const u8* g = row + (u >> 3) * 144;
    const int j = u & 7;
    const uint2 q = nibble_bytes(g, j, w);
    const uint4 h = __ldcs((const uint4*)(g + 128));
    int sc, m;
    q4kx8_scale_min(h.y, h.z, h.w, j, sc, m);
    const float2 dm = __half22float2(*(const __half2*)&h.x);  // d, dmin
    const float dl = dm.x * (float)sc, ml = dm.y * (float)m;
    const int sh = w & 2 ? 4 : 0;
    const unsigned int b[2] = {q.x >> sh, q.y >> sh};
    unsigned int o[4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned int v = b[i >> 1] >> (16 * (i & 1));
        const __half2 x = __floats2half2_rn(dl * (float)(v & 15) - ml, dl * (float)((v >> 8) & 15) - ml);
        o[i] = *(const unsigned int*)&x;
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// x8 rows to packed F16: a thread per 16-byte word of the result, DQ_U words a step (all loaded
// before any is stored), grid-stride. P: [M, K, nbw1]; M K / 8 < 2^31 (32-bit index arithmetic).
#define DQ_U 4
template <int WT>
__global__ void __launch_bounds__(256) k_dequant_x8(const i64* __restrict__ P, __half* dst, const char* w) {
    pdl_enter();
    const unsigned int words = (unsigned int)(P[1] / 8), n = (unsigned int)P[0] * words;
    const unsigned int stride = gridDim.x * blockDim.x;
    for (unsigned int t0 = blockIdx.x * blockDim.x + threadIdx.x; t0 < n; t0 += DQ_U * stride) {
        uint4 o[DQ_U];
        #pragma unroll
        for (int k = 0; k < DQ_U; ++k) {
            const unsigned int t = t0 + k * stride;
            if (t < n) {
                const unsigned int m = t / words, c = t - m * words;
                o[k] = word_f16<WT>((const u8*)w + m * P[2], (int)(c >> 2), (int)(c & 3));
            }
        }
        #pragma unroll
        for (int k = 0; k < DQ_U; ++k) {
            const unsigned int t = t0 + k * stride;
            if (t < n) ((uint4*)dst)[t] = o[k];  // packed rows: word t of the whole matrix
        }
    }
}

// MMVQ_WARPS: rows (warps) per block, MMVQ_SEG: bytes of a row staged at once (gemm.py passes
// STAGED_WARPS, STAGED_SEG)
#if !defined(MMVQ_WARPS) || !defined(MMVQ_SEG)
#error "dequant.cu is compiled with -DMMVQ_WARPS and -DMMVQ_SEG (gemm.py)"
#endif
// copy nvec 16-byte words of a row segment into shared memory, all loads issued before any
// store so that each lane has its whole share in flight at once (a load/store loop would
// serialize the DRAM round trips)
__device__ __forceinline__ void stage_segment(uint4* dst, const uint4* src, int nvec, int lane) {
    constexpr int R = MMVQ_SEG / 16 / 32;
    uint4 r[R];
    #pragma unroll
    for (int k = 0; k < R; ++k) {
        const int v = lane + 32 * k;
        if (v < nvec) r[k] = __ldcs(src + v);
    }
    #pragma unroll
    for (int k = 0; k < R; ++k) {
        const int v = lane + 32 * k;
        if (v < nvec) dst[v] = r[k];
    }
}

// dequantize rows to packed F16 (cuBLAS path): one warp per row, the row streamed through shared
// memory in segments with 16-byte loads, lanes dequantizing 32-element units from there.
// P: [M, K, nbw1, row_bytes, seg_bytes]; same row conditions as k_mmv_pipe.
template <int WT>
__global__ void __launch_bounds__(32 * MMVQ_WARPS) k_dequant_staged(const i64* __restrict__ P, __half* dst,
                                                                     const char* w) {
    pdl_enter();
    __shared__ uint4 smem[MMVQ_WARPS][MMVQ_SEG / 16];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 m = (i64)blockIdx.x * MMVQ_WARPS + warp;
    if (m >= P[0]) return;
    const i64 K = P[1], row_bytes = P[3], seg = P[4];
    const uint4* row = (const uint4*)(w + m * P[2]);
    const int upb = qfmt<WT>::UPB, bb = qfmt<WT>::BB;
    for (i64 s0 = 0; s0 < row_bytes; s0 += seg) {
        const int nbytes = (int)min((i64)seg, row_bytes - s0);
        const uint4* src = row + s0 / 16;
        stage_segment(smem[warp], src, nbytes / 16, lane);
        __syncwarp();
        const int units = nbytes / bb * upb;
        const i64 u0 = s0 / bb * upb;
        for (int u = lane; u < units; u += 32) {
            float y[32];
            deq32<WT>((const u8*)smem[warp], u, y);
            uint4* d = (uint4*)(dst + m * K + 32 * (u0 + u));
            #pragma unroll
            for (int l = 0; l < 4; ++l) {
                __half2 h[4] = {__floats2half2_rn(y[8 * l], y[8 * l + 1]), __floats2half2_rn(y[8 * l + 2], y[8 * l + 3]),
                                __floats2half2_rn(y[8 * l + 4], y[8 * l + 5]), __floats2half2_rn(y[8 * l + 6], y[8 * l + 7])};
                d[l] = *(uint4*)h;
            }
        }
        __syncwarp();
    }
}

