// accelplane CUDA plugin: the one-shot all-reduce over peer memory (p2p.py).
#include "common.cuh"

// ---- one-shot all-reduce over peer memory (p2p.py) ------------------------------------------------
// Small F32 sums across NR GPUs with peer access (NVLink): every rank pushes its x into a receive
// slot in every peer's region, raises a flag there, waits for the peers' flags in its own region,
// then sums the NR terms in rank order (the same bits on every rank). Each rank's region (P[3 + r],
// mapped into every peer) holds recv[2 slots][NR sources][cap floats], flags[AR_MAXB][NR] and
// counters[AR_MAXB]. Block b's epoch is its counter + 1; the slot alternates with the epoch. Slot
// reuse is safe with two: a rank writes a peer's slot for epoch e only after it saw that peer's
// flag for e - 1, raised after the peer had finished reading the slot's epoch e - 2 terms.
// Every rank runs the same sequence of launches with the same grid, so block b's chunks and
// counters agree across ranks. A peer that never arrives (a failed GPU) sets *err = 2 after about
// 2^34 cycles instead of hanging the stream. P: n4 (float4s), rank, cap, then NR region bases.
#ifndef AR_MAXB
#error "allreduce.cu is compiled with -DAR_MAXB (p2p.py)"
#endif
__device__ __forceinline__ void st_release_sys(unsigned* p, unsigned v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
template <int NR>
__global__ void __launch_bounds__(256) k_allreduce_p2p(const i64* __restrict__ P, float* x, int* err) {
    pdl_enter();
    const i64 n4 = P[0], cap = P[2];
    const int rank = (int)P[1], b = blockIdx.x;
    char* base[NR];
#pragma unroll
    for (int p = 0; p < NR; ++p) base[p] = (char*)P[3 + p];
    char* const mine = (char*)P[3 + rank];  // not base[rank]: a run-time index would spill base
    const i64 recv_bytes = 2 * NR * cap * 4;
    unsigned* flags = (unsigned*)(mine + recv_bytes);
    unsigned* counter = flags + AR_MAXB * NR;
    __shared__ unsigned s_epoch;
    if (threadIdx.x == 0) s_epoch = counter[b] + 1;
    __syncthreads();
    const unsigned e = s_epoch;
    const i64 slot = e & 1;
    float4* x4 = (float4*)x;
    const i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)b * blockDim.x + threadIdx.x; i < n4; i += step) {
        const float4 v = x4[i];
#pragma unroll
        for (int p = 0; p < NR; ++p)
            if (p != rank) ((float4*)(base[p] + (slot * NR + rank) * cap * 4))[i] = v;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();  // the pushed terms before the flags that announce them
#pragma unroll
        for (int p = 0; p < NR; ++p)
            if (p != rank) st_release_sys((unsigned*)(base[p] + recv_bytes) + b * NR + rank, e);
        const long long t0 = clock64();
        for (int p = 0; p < NR; ++p) {
            if (p == rank) continue;
            while ((int)(ld_acquire_sys(flags + b * NR + p) - e) < 0)
                if (clock64() - t0 > (1LL << 34)) { *err = 2; break; }
        }
        counter[b] = e;
    }
    __syncthreads();
    const float4* recv = (const float4*)(mine + slot * NR * cap * 4);
    for (i64 i = (i64)b * blockDim.x + threadIdx.x; i < n4; i += step) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int p = 0; p < NR; ++p) {
            const float4 v = p == rank ? x4[i] : __ldcg(recv + p * (cap / 4) + i);  // L2: peers wrote it
            if (p == 0) acc = v;
            else { acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w; }
        }
        x4[i] = acc;
    }
}
