// accelplane CUDA plugin: element-wise kernels: unary and scalar ops, binary ops with
// broadcasting, gated linear units (elementwise.py).
#include "common.cuh"

// ---- unary / scalar ops ---------------------------------------------------------------------------
// P: [n, ne0..3, nbd0..3, nbs0..3, op, p0, p1]
__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float gelu_(float x) {
    const float c = 0.7978845608028654f;
    return 0.5f * x * (1.0f + tanhf(c * x * (1.0f + 0.044715f * x * x)));
}
// fminf/fmaxf as ggml: a NaN input gives 0
__device__ __forceinline__ float hardsigmoid_(float x) { return fminf(1.0f, fmaxf(0.0f, (x + 3.0f) / 6.0f)); }
// codes 0..21 are ggml_unary_op's (elementwise.py's UNARY lists those present here)
__device__ __forceinline__ float unary_op(int op, float x, float p0, float p1) {
    switch (op) {
        case 0: return fabsf(x);
        case 2: return -x;
        case 3: return x > 0.0f ? 1.0f : 0.0f;
        case 4: return tanhf(x);
        case 5: return x > 0.0f ? x : expm1f(x);
        case 6: return fmaxf(x, 0.0f);
        case 7: return sigmoidf_(x);
        case 8: return gelu_(x);
        case 9: return x * sigmoidf_(1.702f * x);
        case 10: return x * sigmoidf_(x);
        case 11: return x * hardsigmoid_(x);
        case 12: return hardsigmoid_(x);
        case 13: return expf(x);
        case 14: return expm1f(x);
        case 15: return x > 20.0f ? x : log1pf(expf(x));  // ggml's softplus: x itself above 20
        case 16: return 0.5f * x * erfcf(-x * 0.70710678118654752f);  // exact GELU, no cancellation
        case 18: return floorf(x);
        case 19: return ceilf(x);
        case 20: return roundf(x);  // halves away from zero
        case 21: return truncf(x);
        case 100: return x * x;
        case 101: return sqrtf(x);
        case 102: return logf(x);
        case 103: return sinf(x);
        case 104: return cosf(x);
        case 105: return x * p0 + p1;
        case 106: return fmaxf(fminf(x, p1), p0);
        case 107: return (x > 0.0f ? x : 0.0f) + p0 * (x < 0.0f ? x : 0.0f);  // ggml's LEAKY_RELU
    }
    return x;
}
template <typename T>
__global__ void k_unary(const i64* __restrict__ P, char* dst, const char* src) {
    pdl_enter();
    const i64 n = P[0];
    const int op = (int)P[13];
    const float p0 = (float)pf(P, 14), p1 = (float)pf(P, 15);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float x = ld<T>(src + offs4(i, P + 1, P + 9));
        st<T>(dst + offs4(i, P + 1, P + 5), unary_op(op, x, p0, p1));
    }
}

// ---- binary ops with b repeated to a's shape ---------------------------------------------------------
// P: [n, ne0..3, nbd0..3, nba0..3, neb0..3, nbb0..3, op]
template <typename Ta, typename Tb>
__global__ void k_binary(const i64* __restrict__ P, char* dst, const char* a, const char* b) {
    pdl_enter();
    const i64 n = P[0];
    const int op = (int)P[21];
    const i64* ne = P + 1;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        unsigned int r = (unsigned int)i;
        const unsigned int i0 = r % (unsigned int)ne[0]; r /= (unsigned int)ne[0];
        const unsigned int i1 = r % (unsigned int)ne[1]; r /= (unsigned int)ne[1];
        const unsigned int i2 = r % (unsigned int)ne[2]; const unsigned int i3 = r / (unsigned int)ne[2];
        const float x = ld<Ta>(a + i0 * P[9] + i1 * P[10] + i2 * P[11] + i3 * P[12]);
        const float y = ld<Tb>(b + (i0 % (unsigned int)P[13]) * P[17] + (i1 % (unsigned int)P[14]) * P[18] +
                               (i2 % (unsigned int)P[15]) * P[19] + (i3 % (unsigned int)P[16]) * P[20]);
        float z;
        switch (op) { case 0: z = x + y; break; case 1: z = x - y; break; case 2: z = x * y; break;
                      default: z = x / y; }
        st<Ta>(dst + i0 * P[5] + i1 * P[6] + i2 * P[7] + i3 * P[8], z);
    }
}

// k_binary for contiguous a, b and dst where b repeats whole over a (b's shape a prefix of a's,
// ones after it): b's element i % nb. P: [n, nb, op]
template <typename Ta, typename Tb>
__global__ void k_binary_flat(const i64* __restrict__ P, char* dst, const char* a, const char* b) {
    pdl_enter();
    const unsigned int n = (unsigned int)P[0], nb = (unsigned int)P[1];
    const int op = (int)P[2];
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float x = ld<Ta>(a + (i64)i * sizeof(Ta)), y = ld<Tb>(b + (i64)(i % nb) * sizeof(Tb));
        float z;
        switch (op) { case 0: z = x + y; break; case 1: z = x - y; break; case 2: z = x * y; break;
                      default: z = x / y; }
        st<Ta>(dst + (i64)i * sizeof(Ta), z);
    }
}

// ---- gated linear units: dst = act(x) * g --------------------------------------------------------------
// P: [n, ne0..3, nbd0..3, nbx0..3, nbg0..3, op(1 geglu, 2 swiglu)]
__device__ __forceinline__ float glu1(float x, float g, int op) {
    return (op == 2 ? x * sigmoidf_(x) : gelu_(x)) * g;
}
template <typename T>
__global__ void k_glu(const i64* __restrict__ P, char* dst, const char* x, const char* g) {
    pdl_enter();
    const i64 n = P[0];
    const int op = (int)P[17];
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float xv = ld<T>(x + offs4(i, P + 1, P + 9));
        const float gv = ld<T>(g + offs4(i, P + 1, P + 13));
        st<T>(dst + offs4(i, P + 1, P + 5), glu1(xv, gv, op));
    }
}

// k_glu for contiguous F32 rows of ne0 % 32 == 0 elements, 16-byte aligned, ne2 = ne3 = 1 (elementwise.py
// picks it): a warp per 128 elements, float4 accesses. P: k_glu's, then the bytes per row of xq
// (0: flat). xq: when not null the result is also written quantized as k_quant_x writes it, for
// the register mat-vec that reads it (the FFN's down projection, a MoE's down products: each
// row on its own, row_bytes apart), saving that launch. Grid: warps of 128 elements / 8.
__global__ void k_glu_vec(const i64* __restrict__ P, char* dst, const char* x, const char* g, char* xq) {
    __shared__ i64 Ps[19];
    pdl_enter_params<19>(P, Ps);
    const int total = (int)Ps[0], K = (int)Ps[1], op = (int)Ps[17];
    const i64 row_bytes = Ps[18];
    const int w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (w * 128 >= total) return;  // whole warps: the shuffles in quantize4 need all 32 lanes
    const int e = w * 128 + 4 * (threadIdx.x & 31), j = e / K, c = e - j * K;
    float4 y = make_float4(0.f, 0.f, 0.f, 0.f);
    if (e < total) {
        const float4 a = *(const float4*)(x + j * Ps[10] + 4 * (i64)c);
        const float4 b = *(const float4*)(g + j * Ps[14] + 4 * (i64)c);
        y = make_float4(glu1(a.x, b.x, op), glu1(a.y, b.y, op), glu1(a.z, b.z, op), glu1(a.w, b.w, op));
        *(float4*)(dst + j * Ps[6] + 4 * (i64)c) = y;
    }
    if (xq && row_bytes)  // (a lane past the total gets c = K: quantize4 leaves it out)
        quantize4(xq + (e < total ? j * row_bytes : 0), y, e < total ? c : K, K);
    else if (xq)
        quantize4(xq, y, e, total);
}
