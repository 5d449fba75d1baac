// accelplane CUDA plugin: reductions: sum_rows / mean, sum, argmax, argsort (reduce.py).
#include "common.cuh"

// ---- reductions -------------------------------------------------------------------------------------------
// sum_rows / mean: one block per row. P: [ne0..3, nbs0..3, nbd1..3, mean]
template <typename T>
__global__ void k_sum_rows(const i64* __restrict__ P, char* dst, const char* src) {
    pdl_enter();
    i64 r = blockIdx.x;
    const i64 i1 = r % P[1]; r /= P[1];
    const i64 i2 = r % P[2]; const i64 i3 = r / P[2];
    const char* s = src + i1 * P[5] + i2 * P[6] + i3 * P[7];
    float acc = 0.0f;
    for (i64 i = threadIdx.x; i < P[0]; i += blockDim.x) acc += ld<T>(s + i * P[4]);
    acc = block_sum(acc);
    if (threadIdx.x == 0) *(float*)(dst + i1 * P[8] + i2 * P[9] + i3 * P[10]) = P[11] ? acc / (float)P[0] : acc;
}
// sum of everything: one block. P: [n, ne0..3, nbs0..3]
template <typename T>
__global__ void k_sum(const i64* __restrict__ P, char* dst, const char* src) {
    pdl_enter();
    float acc = 0.0f;
    for (i64 i = threadIdx.x; i < P[0]; i += blockDim.x) acc += ld<T>(src + offs4(i, P + 1, P + 5));
    acc = block_sum(acc);
    if (threadIdx.x == 0) *(float*)dst = acc;
}
// argmax per row (first maximum). P: [ne0, ne1, nbs0, nbs1, nbd0]
__global__ void k_argmax(const i64* __restrict__ P, char* dst, const char* src) {
    pdl_enter();
    const char* s = src + blockIdx.x * P[3];
    __shared__ float bv[1024];
    __shared__ int bi[1024];
    float best = -AP_INF; int besti = -1;
    // several loads in flight per thread: a load-compare loop waits out a memory round trip per
    // element (a 32000-entry vocabulary took 54 us on an H200 that way); a contiguous aligned
    // row eight float4 loads (a 128256-entry vocabulary: four round trips)
    const int n = (int)P[0], nb0 = (int)P[2], bd = blockDim.x;
    int i0 = threadIdx.x;
    if (nb0 == 4 && ((size_t)s & 15) == 0) {
        const int n4 = n / 4;
        const float4* s4 = (const float4*)s;
        for (int i = threadIdx.x; i < n4; i += 8 * bd) {
            float4 v[8];
            #pragma unroll
            for (int u = 0; u < 8; ++u) v[u] = i + u * bd < n4 ? s4[i + u * bd] : make_float4(0.f, 0.f, 0.f, 0.f);
            #pragma unroll
            for (int u = 0; u < 8; ++u) {
                const float e[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
                #pragma unroll
                for (int c = 0; c < 4; ++c) {  // indices rising: the first maximum stays
                    if (i + u * bd < n4 && (e[c] > best || besti < 0)) { best = e[c]; besti = 4 * (i + u * bd) + c; }
                }
            }
        }
        i0 = 4 * n4 + threadIdx.x;  // the last n % 4 elements, past every index above
    }
    for (int i = i0; i < n; i += 4 * bd) {
        float v[4];
        #pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = i + u * bd < n ? *(const float*)(s + (i64)(i + u * bd) * nb0) : -AP_INF;
        #pragma unroll
        for (int u = 0; u < 4; ++u) {
            if (i + u * bd < n && (v[u] > best || besti < 0)) { best = v[u]; besti = i + u * bd; }
        }
    }
    bv[threadIdx.x] = best; bi[threadIdx.x] = besti;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) {
            const float v = bv[threadIdx.x + o]; const int j = bi[threadIdx.x + o];
            if (j >= 0 && (bi[threadIdx.x] < 0 || v > bv[threadIdx.x] || (v == bv[threadIdx.x] && j < bi[threadIdx.x]))) {
                bv[threadIdx.x] = v; bi[threadIdx.x] = j;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) *(int*)(dst + blockIdx.x * P[4]) = bi[0];
}
// argsort per row, stable: the rank of element i is the number of elements ordered before it
// (NaN after every number in either order: a total order, so every position is written once).
// P: [ne0..3, nbs0..3, nbd0..3, desc]
__global__ void k_argsort(const i64* __restrict__ P, char* dst, const char* src) {
    pdl_enter();
    i64 r = blockIdx.x;
    const i64 i1 = r % P[1]; r /= P[1];
    const i64 i2 = r % P[2]; const i64 i3 = r / P[2];
    const char* s = src + i1 * P[5] + i2 * P[6] + i3 * P[7];
    char* d = dst + i1 * P[9] + i2 * P[10] + i3 * P[11];
    const bool desc = P[12] != 0;
    const i64 n = P[0];
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        const float xi = *(const float*)(s + i * P[4]);
        i64 rank = 0;
        for (i64 j = 0; j < n; ++j) {
            const float xj = *(const float*)(s + j * P[4]);
            rank += isnan(xi) ? (!isnan(xj) || j < i)
                              : !isnan(xj) && ((desc ? (xj > xi) : (xj < xi)) || (xj == xi && j < i));
        }
        *(int*)(d + rank * P[8]) = (int)i;
    }
}

