// accelplane CUDA plugin: row norms, fused with the MUL that scales them and the residual ADD before them (norm.py).
#include "common.cuh"

// ---- row norms (F32): one block per row -------------------------------------------------------------
// P: [ne0..3, nbs0..3, nbd0..3, op(0 norm,1 rms,2 l2), eps, has_w, wne0..3, wnb0..3, has_add, nbb0..3,
//     nbsum0..3]
// Fused runs (accelplane.core.fusion): with has_w the result is multiplied by w broadcast over the
// rows (NORM/RMS_NORM/L2_NORM + MUL; dst is the MUL's tensor); with has_add the rows normed are
// src + b, also written to sum (ADD + norm [+ MUL], the ADD's result kept for its other readers).
__global__ void k_norm(const i64* __restrict__ P, char* dst, const char* src, const char* w,
                       const char* b, char* sum) {
    pdl_enter();
    const i64 ne0 = P[0];
    i64 r = blockIdx.x;
    const i64 i1 = r % P[1]; r /= P[1];
    const i64 i2 = r % P[2]; const i64 i3 = r / P[2];
    const char* s = src + i1 * P[5] + i2 * P[6] + i3 * P[7];
    char* d = dst + i1 * P[9] + i2 * P[10] + i3 * P[11];
    const int op = (int)P[12];
    const float eps = (float)pf(P, 13);
    const bool has_w = P[14] != 0;
    const char* wr = has_w ? w + (i1 % P[16]) * P[20] + (i2 % P[17]) * P[21] + (i3 % P[18]) * P[22] : nullptr;
    i64 sn0 = P[4];
    if (P[23] != 0) {
        // every loop below visits the same indices per thread, so each reads back its own sums
        const char* br = b + i1 * P[25] + i2 * P[26] + i3 * P[27];
        char* sr = sum + i1 * P[29] + i2 * P[30] + i3 * P[31];
        for (i64 i = threadIdx.x; i < ne0; i += blockDim.x)
            *(float*)(sr + i * P[28]) = *(const float*)(s + i * sn0) + *(const float*)(br + i * P[24]);
        s = sr;
        sn0 = P[28];
    }
    float mean = 0.0f;
    if (op == 0) {
        float acc = 0.0f;
        for (i64 i = threadIdx.x; i < ne0; i += blockDim.x) acc += *(const float*)(s + i * sn0);
        mean = block_sum(acc) / (float)ne0;
    }
    float acc = 0.0f;
    for (i64 i = threadIdx.x; i < ne0; i += blockDim.x) {
        const float v = *(const float*)(s + i * sn0) - mean;
        acc += v * v;
    }
    const float ss = block_sum(acc);
    float scale;
    if (op == 2) scale = 1.0f / fmaxf(sqrtf(ss), eps);
    else scale = rsqrtf(ss / (float)ne0 + eps);
    for (i64 i = threadIdx.x; i < ne0; i += blockDim.x) {
        float y = (*(const float*)(s + i * sn0) - mean) * scale;
        if (has_w) y *= *(const float*)(wr + (i % P[15]) * P[19]);
        *(float*)(d + i * P[8]) = y;
    }
}

// k_norm for contiguous F32 rows of ne0 % 4 == 0 elements, at most 4 NV per thread (norm.py
// picks it and the block size): the row is read once into registers as float4s, the sums
// come from there, and every access is a 16-byte one. k_norm's P and arguments (P[32] below), plus xq:
// when not null (rows of a multiple of 32 elements, ne2 = ne3 = 1), the result is also written
// quantized as k_quant_x writes it, for the register mat-vecs that read it (saving that launch).
// NV = 1 (rows up to 4096 elements) keeps the body a quarter of NV = 4's: a decode runs it twice
// a layer from a cold instruction cache, where fetching the code costs more than the arithmetic.
// P[32] set (norm.py: no kernel of the graph writes the MUL's weights' buffer): the weights are
// loaded before waiting for the kernel that wrote the row, so their round trip (usually from
// DRAM: a decode streams its weights through L2 between two norms) overlaps that kernel's end.
template <int NV>
__global__ void __launch_bounds__(1024) k_norm_vec(const i64* __restrict__ P, char* dst, const char* src,
                                                   const char* w, const char* b, char* sum, char* xq) {
    __shared__ i64 Ps[33];
    for (int i = threadIdx.x; i < 33; i += blockDim.x) Ps[i] = P[i];  // written at plan time
    __syncthreads();
    const int n4 = (int)(Ps[0] / 4);
    int r = blockIdx.x;
    const int i1 = r % (int)Ps[1]; r /= (int)Ps[1];
    const int i2 = r % (int)Ps[2], i3 = r / (int)Ps[2];
    // the MUL's weights (or ones), loaded before the row where allowed, else with it: no round
    // trip after the reductions
    float4 g[NV];
    const float4* wr = Ps[14] != 0 ? (const float4*)(w + (i1 % (int)Ps[16]) * Ps[20] + (i2 % (int)Ps[17]) * Ps[21] +
                                                    (i3 % (int)Ps[18]) * Ps[22]) : nullptr;
    auto load_g = [&]() {
        #pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int c = threadIdx.x + k * blockDim.x;
            g[k] = wr && c < n4 ? wr[c] : make_float4(1.f, 1.f, 1.f, 1.f);
        }
    };
    const bool early = Ps[32] != 0;
    if (early) load_g();
    pdl_enter();
    if (!early) load_g();
    const float4* s = (const float4*)(src + i1 * Ps[5] + i2 * Ps[6] + i3 * Ps[7]);
    float4* d = (float4*)(dst + i1 * Ps[9] + i2 * Ps[10] + i3 * Ps[11]);
    const int op = (int)Ps[12];
    float4 v[NV];
    #pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        v[k] = c < n4 ? s[c] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (Ps[23] != 0) {  // fused ADD: rows of src + b, the sum written too
        const float4* br = (const float4*)(b + i1 * Ps[25] + i2 * Ps[26] + i3 * Ps[27]);
        float4* sr = (float4*)(sum + i1 * Ps[29] + i2 * Ps[30] + i3 * Ps[31]);
        #pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int c = threadIdx.x + k * blockDim.x;
            if (c < n4) {
                const float4 o = br[c];
                v[k].x += o.x; v[k].y += o.y; v[k].z += o.z; v[k].w += o.w;
                sr[c] = v[k];
            }
        }
    }
    const float ne0 = (float)Ps[0];
    float mean = 0.0f;
    if (op == 0) {
        float acc = 0.0f;
        #pragma unroll
        for (int k = 0; k < NV; ++k) acc += v[k].x + v[k].y + v[k].z + v[k].w;
        mean = block_sum(acc) / ne0;
    }
    float acc = 0.0f;
    #pragma unroll
    for (int k = 0; k < NV; ++k) {
        if (threadIdx.x + k * blockDim.x < n4) {
            const float x = v[k].x - mean, y = v[k].y - mean, z = v[k].z - mean, t = v[k].w - mean;
            acc += x * x + y * y + z * z + t * t;
        }
    }
    const float ss = block_sum(acc);
    const float scale = op == 2 ? 1.0f / fmaxf(sqrtf(ss), (float)pf(Ps, 13)) : rsqrtf(ss / ne0 + (float)pf(Ps, 13));
    const int total = (int)(Ps[0] * Ps[1]);
    #pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        float4 y = make_float4(0.f, 0.f, 0.f, 0.f);
        if (c < n4) {
            y = make_float4((v[k].x - mean) * scale, (v[k].y - mean) * scale, (v[k].z - mean) * scale,
                            (v[k].w - mean) * scale);
            y.x *= g[k].x; y.y *= g[k].y; y.z *= g[k].z; y.w *= g[k].w;
            d[c] = y;
        }
        // every lane takes part (the shuffles); those past the row write nothing (e = total)
        if (xq) quantize4(xq, y, c < n4 ? blockIdx.x * (int)Ps[0] + 4 * c : total, total);
    }
}

