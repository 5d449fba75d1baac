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

