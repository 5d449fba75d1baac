// accelplane CUDA plugin kernels (compiled at run time by NVRTC through CuPy).
//
// Every kernel takes `const i64* P`: a small device array of parameters built once per graph
// node at plan time (shapes, byte strides, op parameters; floats are stored as the bits of a
// double). Tensors are `char*` base pointers with byte strides, so views of any layout work.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long i64;
typedef unsigned char u8;
#define AP_INF __int_as_float(0x7f800000)  // NVRTC has no math.h INFINITY

__device__ __forceinline__ double pf(const i64* P, int i) { return __longlong_as_double(P[i]); }

// ---- programmatic dependent launch (sm_90+) ------------------------------------------------------
// plan.py launches every kernel of this file with the programmatic-serialization attribute (unless
// ACCELPLANE_CUDA_PDL=0), so the next kernel of a stream may start while this one still runs. The
// contract that keeps that safe: every kernel calls pdl_enter before it touches memory that another
// kernel writes or reads. pdl_enter first lets the next kernel launch (it will wait in its own
// pdl_enter), then waits until the previous kernel has finished and its writes are visible; since
// that one waited for its own predecessor, the order is transitive. Only the mat-vecs may read
// before it: weights in a buffer no kernel of the graph writes (k_mmv_row, k_mmv_row1 and
// k_mmv_ring, P[15]; k_mmv_ring copies them into its own shared memory); and
// a graph's first launch goes without the attribute, so nothing earlier in the stream overlaps.
// Without the attribute (or below sm_90) both instructions are no-ops.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;" ::: "memory");
#endif
}
// pdl_enter for a kernel that reads its N parameters from shared memory Ps: they are written once,
// at plan time, so their loads are issued before the wait and arrive while the previous kernel
// drains (saving a round trip after it). Blocks of at least N threads (one load each); ends with
// a block barrier, so every thread sees Ps.
template <int N> __device__ __forceinline__ void pdl_enter_params(const i64* __restrict__ P, i64* Ps) {
    if (threadIdx.x < N) Ps[threadIdx.x] = P[threadIdx.x];
    pdl_enter();
    __syncthreads();
}

// ---- element load/store -------------------------------------------------------------------------
template <typename T> __device__ __forceinline__ float ld(const char* p);
template <> __device__ __forceinline__ float ld<float>(const char* p) { return *(const float*)p; }
template <> __device__ __forceinline__ float ld<__half>(const char* p) { return __half2float(*(const __half*)p); }
template <> __device__ __forceinline__ float ld<__nv_bfloat16>(const char* p) {
    return __bfloat162float(*(const __nv_bfloat16*)p);
}
template <typename T> __device__ __forceinline__ void st(char* p, float v);
template <> __device__ __forceinline__ void st<float>(char* p, float v) { *(float*)p = v; }
template <> __device__ __forceinline__ void st<__half>(char* p, float v) { *(__half*)p = __float2half_rn(v); }
template <> __device__ __forceinline__ void st<__nv_bfloat16>(char* p, float v) {
    *(__nv_bfloat16*)p = __float2bfloat16_rn(v);
}

__device__ __forceinline__ float f16at(const u8* p) { return __half2float(*(const __half*)p); }
// eight F16 values of a 16-byte word as floats
__device__ __forceinline__ void half8(uint4 v, float* f) {
    const unsigned int u[4] = {v.x, v.y, v.z, v.w};
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 t = __half22float2(*(const __half2*)&u[i]);
        f[2 * i] = t.x; f[2 * i + 1] = t.y;
    }
}

// ---- fast division by a run-time constant (magic number, shift) ------------------------------------
struct fastdiv_t { unsigned int mul, shift, d; };
__device__ __forceinline__ unsigned int fdiv(unsigned int n, fastdiv_t f) {
    return (__umulhi(n, f.mul) + n) >> f.shift;
}
__device__ __forceinline__ fastdiv_t fdv(const i64* P, int i) {
    fastdiv_t f; f.mul = (unsigned int)P[i]; f.shift = (unsigned int)P[i + 1]; f.d = (unsigned int)P[i + 2];
    return f;
}

// ---- dequantize one 32-element chunk of a row ------------------------------------------------------
// chunk c covers elements [32c, 32c+32) of the row.
template <int TYPE> __device__ __forceinline__ void deq32(const u8* row, int c, float* y);

// Q4_0: 18-byte blocks: f16 d, 16 bytes; element l<16 = low nibble of qs[l], l>=16 = high nibble
template <> __device__ __forceinline__ void deq32<2>(const u8* row, int c, float* y) {
    const u8* b = row + (i64)c * 18;
    const float d = f16at(b);
    #pragma unroll
    for (int l = 0; l < 16; ++l) {
        const int q = b[2 + l];
        y[l] = d * (float)((q & 0xF) - 8);
        y[l + 16] = d * (float)((q >> 4) - 8);
    }
}
// Q8_0: 34-byte blocks: f16 d, 32 int8
template <> __device__ __forceinline__ void deq32<8>(const u8* row, int c, float* y) {
    const u8* b = row + (i64)c * 34;
    const float d = f16at(b);
    #pragma unroll
    for (int l = 0; l < 32; ++l) y[l] = d * (float)(signed char)b[2 + l];
}
// Q4_K: 144-byte superblocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes qs.
// Sub-block j's scale and min from scale bytes b0 = s[j & 3], b1 = s[(j & 3) + 4], b2 = s[(j & 3) + 8].
__device__ __forceinline__ void q4k_scale_min(int b0, int b1, int b2, int j, int& sc, int& m) {
    if (j < 4) { sc = b0 & 63; m = b1 & 63; }
    else { sc = (b2 & 0xF) | ((b0 >> 6) << 4); m = (b2 >> 4) | ((b1 >> 6) << 4); }
}
template <> __device__ __forceinline__ void deq32<12>(const u8* row, int c, float* y) {
    const u8* b = row + (i64)(c >> 3) * 144;
    const int j = c & 7;
    const float d = f16at(b), dmin = f16at(b + 2);
    const u8* s = b + 4 + (j & 3);
    int sc, m;
    q4k_scale_min(s[0], s[4], s[8], j, sc, m);
    const u8* q = b + 16 + 32 * (j >> 1);
    const float dl = d * (float)sc, ml = dmin * (float)m;
    if (j & 1) {
        #pragma unroll
        for (int l = 0; l < 32; ++l) y[l] = dl * (float)(q[l] >> 4) - ml;
    } else {
        #pragma unroll
        for (int l = 0; l < 32; ++l) y[l] = dl * (float)(q[l] & 0xF) - ml;
    }
}
// Q6_K: 210-byte superblocks of 256: ql[128], qh[64], int8 scales[16], f16 d
template <> __device__ __forceinline__ void deq32<14>(const u8* row, int c, float* y) {
    const u8* b = row + (i64)(c >> 3) * 210;
    const int j = c & 7, n = j >> 2, quarter = j & 3;
    const float d = f16at(b + 208);
    const u8* ql = b + 64 * n;
    const u8* qh = b + 128 + 32 * n;
    const signed char* sc = (const signed char*)(b + 192) + 8 * n;
    #pragma unroll
    for (int l = 0; l < 32; ++l) {
        int q;
        const int h = qh[l];
        if (quarter == 0) q = (ql[l] & 0xF) | (((h >> 0) & 3) << 4);
        else if (quarter == 1) q = (ql[l + 32] & 0xF) | (((h >> 2) & 3) << 4);
        else if (quarter == 2) q = (ql[l] >> 4) | (((h >> 4) & 3) << 4);
        else q = (ql[l + 32] >> 4) | (((h >> 6) & 3) << 4);
        y[l] = d * (float)sc[(l >> 4) + 2 * quarter] * (float)(q - 32);
    }
}
// Q4_0x8 / Q8_0x8 (layout.py): groups of 8 blocks with the quants first, 16-byte aligned, then
// the 8 scales. Q4_0x8 group: 144 bytes, block j's quants at 16j, scale at 128 + 2j.
template <> __device__ __forceinline__ void deq32<102>(const u8* row, int c, float* y) {
    const u8* g = row + (i64)(c >> 3) * 144;
    const int j = c & 7;
    const float d = f16at(g + 128 + 2 * j);
    #pragma unroll
    for (int l = 0; l < 16; ++l) {
        const int q = g[16 * j + l];
        y[l] = d * (float)((q & 0xF) - 8);
        y[l + 16] = d * (float)((q >> 4) - 8);
    }
}
// Q8_0x8 group: 272 bytes, block j's elements 0..15 at 16j, 16..31 at 128 + 16j, scale at 256 + 2j
template <> __device__ __forceinline__ void deq32<108>(const u8* row, int c, float* y) {
    const u8* g = row + (i64)(c >> 3) * 272;
    const int j = c & 7;
    const float d = f16at(g + 256 + 2 * j);
    #pragma unroll
    for (int l = 0; l < 16; ++l) {
        y[l] = d * (float)(signed char)g[16 * j + l];
        y[l + 16] = d * (float)(signed char)g[128 + 16 * j + l];
    }
}
// Q4_Kx8 super-block: 144 bytes, sub-block j's nibbles at 16j (Q4_0x8's order), then a 16-byte
// header at 128 (layout.py): F16 d, F16 dmin, then three words holding the 6-bit scales and mins
// so that sub-block j's scale and min decode without branches: word 1 the scales' low nibbles
// (nibble j), word 2 the mins' low nibbles, word 3 the scales' high two bits at bit 2j and the
// mins' at 16 + 2j
__device__ __forceinline__ void q4kx8_scale_min(unsigned int lo_sc, unsigned int lo_m, unsigned int hi, int j,
                                                int& sc, int& m) {
    sc = (int)(((lo_sc >> (4 * j)) & 15) | (((hi >> (2 * j)) & 3) << 4));
    m = (int)(((lo_m >> (4 * j)) & 15) | (((hi >> (16 + 2 * j)) & 3) << 4));
}
template <> __device__ __forceinline__ void deq32<112>(const u8* row, int c, float* y) {
    const u8* g = row + (i64)(c >> 3) * 144;
    const int j = c & 7;
    const unsigned int* h = (const unsigned int*)(g + 128);  // 16-byte aligned: rows of whole groups
    int sc, m;
    q4kx8_scale_min(h[1], h[2], h[3], j, sc, m);
    const float dl = f16at(g + 128) * (float)sc, ml = f16at(g + 130) * (float)m;
    #pragma unroll
    for (int l = 0; l < 16; ++l) {
        const int q = g[16 * j + l];
        y[l] = dl * (float)(q & 0xF) - ml;
        y[l + 16] = dl * (float)(q >> 4) - ml;
    }
}
// float rows through the same interface
// (16-byte loads where the chunk is aligned: a KV cache's rows usually are)
template <> __device__ __forceinline__ void deq32<0>(const u8* row, int c, float* y) {
    const float* p = (const float*)row + 32 * c;
    if (((size_t)p & 15) == 0) {
        #pragma unroll
        for (int l = 0; l < 8; ++l) {
            const float4 v = ((const float4*)p)[l];
            y[4 * l] = v.x; y[4 * l + 1] = v.y; y[4 * l + 2] = v.z; y[4 * l + 3] = v.w;
        }
        return;
    }
    #pragma unroll
    for (int l = 0; l < 32; ++l) y[l] = p[l];
}
template <> __device__ __forceinline__ void deq32<1>(const u8* row, int c, float* y) {
    const __half* p = (const __half*)row + 32 * c;
    if (((size_t)p & 15) == 0) {
        #pragma unroll
        for (int l = 0; l < 4; ++l) half8(((const uint4*)p)[l], y + 8 * l);
        return;
    }
    #pragma unroll
    for (int l = 0; l < 32; ++l) y[l] = __half2float(p[l]);
}
template <> __device__ __forceinline__ void deq32<30>(const u8* row, int c, float* y) {
    #pragma unroll
    for (int l = 0; l < 32; ++l) y[l] = __bfloat162float(((const __nv_bfloat16*)row)[32 * c + l]);
}

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}
// block-wide sum for blockDim.x a multiple of 32 (<= 1024); all threads get the result
__device__ float block_sum(float v) {
    __shared__ float sh[32];
    v = warp_sum(v);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    v = (threadIdx.x < (blockDim.x >> 5)) ? sh[threadIdx.x] : 0.0f;
    if (w == 0) v = warp_sum(v);
    if (threadIdx.x == 0) sh[0] = v;
    __syncthreads();
    return sh[0];
}
__device__ float block_max(float v) {
    __shared__ float sh[32];
    v = warp_max(v);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    v = (threadIdx.x < (blockDim.x >> 5)) ? sh[threadIdx.x] : -AP_INF;
    if (w == 0) v = warp_max(v);
    if (threadIdx.x == 0) sh[0] = v;
    __syncthreads();
    return sh[0];
}

// linear index -> byte offset for a tensor of ne[4] (P+ne) and nb[4] (P+nb). Indices are
// decomposed in 32 bits (64-bit division costs ~10x more); the plan keeps element counts
// below 2^31.
__device__ __forceinline__ i64 offs4(i64 li, const i64* ne, const i64* nb) {
    unsigned int i = (unsigned int)li;
    const unsigned int n0 = (unsigned int)ne[0], n1 = (unsigned int)ne[1], n2 = (unsigned int)ne[2];
    const unsigned int i0 = i % n0; i /= n0;
    const unsigned int i1 = i % n1; i /= n1;
    const unsigned int i2 = i % n2; const unsigned int i3 = i / n2;
    return (i64)i0 * nb[0] + (i64)i1 * nb[1] + (i64)i2 * nb[2] + (i64)i3 * nb[3];
}

// ---- unary / scalar ops ---------------------------------------------------------------------------
// P: [n, ne0..3, nbd0..3, nbs0..3, op, p0, p1]
__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float gelu_(float x) {
    const float c = 0.7978845608028654f;
    return 0.5f * x * (1.0f + tanhf(c * x * (1.0f + 0.044715f * x * x)));
}
__device__ __forceinline__ float unary_op(int op, float x, float p0, float p1) {
    switch (op) {
        case 0: return fabsf(x);
        case 2: return -x;
        case 4: return tanhf(x);
        case 6: return fmaxf(x, 0.0f);
        case 7: return sigmoidf_(x);
        case 8: return gelu_(x);
        case 9: return x * sigmoidf_(1.702f * x);
        case 10: return x * sigmoidf_(x);
        case 13: return expf(x);
        case 100: return x * x;
        case 101: return sqrtf(x);
        case 102: return logf(x);
        case 103: return sinf(x);
        case 104: return cosf(x);
        case 105: return x * p0 + p1;
        case 106: return fmaxf(fminf(x, p1), p0);
        case 107: return x > 0.0f ? x : x * p0;
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

// ---- row norms (F32): one block per row -------------------------------------------------------------
// P: [ne0..3, nbs0..3, nbd0..3, op(0 norm,1 rms,2 l2), eps, has_w, wne0..3, wnb0..3, has_add, nbb0..3,
//     nbsum0..3]
// Fused runs (accelplane.fusion): with has_w the result is multiplied by w broadcast over the
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

// ---- activations quantized for the integer mat-vecs ------------------------------------------------
// N rows of K floats, quantized per 32-element unit: xq int8 as two planes of 16 bytes per unit
// (plane 0: elements 0..15 of every unit, then plane 1: elements 16..31), so lanes on
// consecutive units read consecutive 16-byte words; then xd float [N][K/32], then xs int
// [N][K/32] (sums of the quants). total = N * K, a multiple of 32.
// Elements e..e+3 (v) of the total into that layout at sx. Called by all 32 lanes of a warp
// together, lanes 8i..8i+7 holding one 32-element unit (the shuffles reduce over them).
__device__ __forceinline__ void quantize4(char* sx, float4 v, int e, int total) {
    const int lane = threadIdx.x & 31;
    float a = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
    #pragma unroll
    for (int o = 1; o < 8; o <<= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffff, a, o));
    const float d = a / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const int q0 = __float2int_rn(v.x * id), q1 = __float2int_rn(v.y * id);
    const int q2 = __float2int_rn(v.z * id), q3 = __float2int_rn(v.w * id);
    int sum = q0 + q1 + q2 + q3;
    #pragma unroll
    for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (e < total) {  // whole 8-lane groups are in or out: total is a multiple of 32
        signed char* xq = (signed char*)sx;
        float* xd = (float*)(sx + total);
        int* xs = (int*)(xd + total / 32);
        const int l = e & 31;  // 4 | 16: a lane's 4 elements stay in one plane
        *(int*)(xq + (l >> 4) * (total / 2) + 16 * (e >> 5) + (l & 15)) =
            (q0 & 0xFF) | ((q1 & 0xFF) << 8) | ((q2 & 0xFF) << 16) | (q3 << 24);
        if ((lane & 7) == 0) { xd[e / 32] = d; xs[e / 32] = sum; }
    }
}

// Element e of the total into quantize4's layout, one element per lane: called by all 32 lanes
// of a warp together, holding one whole 32-element unit (lane == e & 31). Same rounding.
__device__ __forceinline__ void quantize1(char* sx, float v, int e, int total) {
    const float d = warp_max(fabsf(v)) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const int q = __float2int_rn(v * id);
    int sum = q;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
    const int l = e & 31;
    ((signed char*)sx)[(l >> 4) * (total / 2) + 16 * (e >> 5) + (l & 15)] = (signed char)q;
    if (l == 0) {
        ((float*)(sx + total))[e / 32] = d;
        ((int*)(sx + total + total / 32 * 4))[e / 32] = sum;
    }
}

// k_glu for contiguous F32 rows of ne0 % 32 == 0 elements, 16-byte aligned, ne2 = ne3 = 1 (plan.py
// picks it): a warp per 128 elements, float4 accesses. Same P as k_glu, plus xq: when not null
// the result is also written quantized as k_quant_x writes it, for the register mat-vec that
// reads it (the FFN's down projection), saving that launch. Grid: warps of 128 elements / 8.
__global__ void k_glu_vec(const i64* __restrict__ P, char* dst, const char* x, const char* g, char* xq) {
    __shared__ i64 Ps[18];
    pdl_enter_params<18>(P, Ps);
    const int total = (int)Ps[0], K = (int)Ps[1], op = (int)Ps[17];
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
    if (xq) quantize4(xq, y, e, total);
}

// k_norm for contiguous F32 rows of ne0 % 4 == 0 elements, at most 4 NV per thread (plan.py:
// _norm picks it and the block size): the row is read once into registers as float4s, the sums
// come from there, and every access is a 16-byte one. Same P and arguments as k_norm, plus xq:
// when not null (rows of a multiple of 32 elements, ne2 = ne3 = 1), the result is also written
// quantized as k_quant_x writes it, for the register mat-vecs that read it (saving that launch).
// NV = 1 (rows up to 4096 elements) keeps the body a quarter of NV = 4's: a decode runs it twice
// a layer from a cold instruction cache, where fetching the code costs more than the arithmetic.
template <int NV>
__global__ void __launch_bounds__(1024) k_norm_vec(const i64* __restrict__ P, char* dst, const char* src,
                                                   const char* w, const char* b, char* sum, char* xq) {
    __shared__ i64 Ps[32];
    pdl_enter_params<32>(P, Ps);
    const int n4 = (int)(Ps[0] / 4);
    int r = blockIdx.x;
    const int i1 = r % (int)Ps[1]; r /= (int)Ps[1];
    const int i2 = r % (int)Ps[2], i3 = r / (int)Ps[2];
    const float4* s = (const float4*)(src + i1 * Ps[5] + i2 * Ps[6] + i3 * Ps[7]);
    float4* d = (float4*)(dst + i1 * Ps[9] + i2 * Ps[10] + i3 * Ps[11]);
    const int op = (int)Ps[12];
    float4 v[NV];
    #pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        v[k] = c < n4 ? s[c] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    // the MUL's weights (or ones) load with the row, not after the reductions: one round trip
    float4 g[NV];
    const float4* wr = Ps[14] != 0 ? (const float4*)(w + (i1 % (int)Ps[16]) * Ps[20] + (i2 % (int)Ps[17]) * Ps[21] +
                                                    (i3 % (int)Ps[18]) * Ps[22]) : nullptr;
    #pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        g[k] = wr && c < n4 ? wr[c] : make_float4(1.f, 1.f, 1.f, 1.f);
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

// ---- soft_max with scale, optional mask (broadcast over ne2/ne3) and ALiBi slopes -------------------
// P: [ne0..3, nba0..3, nbd0..3, nem1..3, nbm0..3, has_mask, scale, max_bias, n_head_log2, m0, m1]
template <typename Tm>
__global__ void k_soft_max(const i64* __restrict__ P, char* dst, const char* a, const char* mask) {
    pdl_enter();
    const i64 ne0 = P[0];
    i64 r = blockIdx.x;
    const i64 i1 = r % P[1]; r /= P[1];
    const i64 i2 = r % P[2]; const i64 i3 = r / P[2];
    const char* s = a + i1 * P[5] + i2 * P[6] + i3 * P[7];
    char* d = dst + i1 * P[9] + i2 * P[10] + i3 * P[11];
    const bool has_mask = P[19] != 0;
    const float scale = (float)pf(P, 20), max_bias = (float)pf(P, 21);
    float slope = 1.0f;
    if (max_bias > 0.0f) {
        const int h = (int)i2, nhl = (int)P[22];
        slope = h < nhl ? powf((float)pf(P, 23), (float)(h + 1)) : powf((float)pf(P, 24), (float)(2 * (h - nhl) + 1));
    }
    const char* m = has_mask ? mask + i1 * P[16] + (i2 % P[13]) * P[17] + (i3 % P[14]) * P[18] : nullptr;
    float mx = -AP_INF;
    for (i64 i = threadIdx.x; i < ne0; i += blockDim.x) {
        float v = *(const float*)(s + i * P[4]) * scale;
        if (has_mask) v += slope * ld<Tm>(m + i * P[15]);
        mx = fmaxf(mx, v);
    }
    mx = block_max(mx);
    float sum = 0.0f;
    for (i64 i = threadIdx.x; i < ne0; i += blockDim.x) {
        float v = *(const float*)(s + i * P[4]) * scale;
        if (has_mask) v += slope * ld<Tm>(m + i * P[15]);
        const float e = expf(v - mx);
        *(float*)(d + i * P[8]) = e;
        sum += e;
    }
    sum = block_sum(sum);
    const float inv = 1.0f / sum;
    for (i64 i = threadIdx.x; i < ne0; i += blockDim.x) *(float*)(d + i * P[8]) *= inv;
}

// ---- rope (normal and NEOX) with YaRN --------------------------------------------------------------
// the rotation of pair ic at position p: R = [freq_scale, ext_factor, attn_factor, corr0, corr1,
// theta_scale] (double bits); cos and sin come scaled by YaRN's magnitude factor
__device__ __forceinline__ void rope_cs(const i64* R, float p, int ic, float& cs, float& sn) {
    const float freq_scale = (float)pf(R, 0), ext = (float)pf(R, 1);
    const float te = p * powf((float)pf(R, 5), (float)ic);
    const float ti = freq_scale * te;
    float theta = ti, mscale = (float)pf(R, 2);
    if (ext != 0.0f) {
        const float c0 = (float)pf(R, 3), c1 = (float)pf(R, 4);
        const float y = ((float)ic - c0) / fmaxf(0.001f, c1 - c0);
        const float ramp = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * ext;
        theta = ti * (1.0f - ramp) + te * ramp;
        mscale *= 1.0f + 0.1f * logf(1.0f / freq_scale);
    }
    cs = cosf(theta) * mscale;
    sn = sinf(theta) * mscale;
}

// P: [ne0..3, nba0..3, nbd0..3, n_dims, mode, freq_scale, ext_factor, attn_factor, corr0, corr1, theta_scale,
//     n_rows, nbr0]. T: the source's element type, TD the result's. rows: when not null, ROPE →
// view → SET_ROWS as one kernel (plan.py: _rope): token i2's result goes to row rows[i2 * nbr0 /
// 4] of dst (P[10] its row stride, n_rows rows; a bad index sets *err), head i1 at P[9].
template <typename T, typename TD>
__global__ void k_rope(const i64* __restrict__ P, char* dst, const char* a, const int* pos, const int* rows,
                       int* err) {
    __shared__ i64 Ps[22];
    pdl_enter_params<22>(P, Ps);
    const i64 half = Ps[0] / 2;
    const i64 n = half * Ps[1] * Ps[2] * Ps[3];
    const int n_dims = (int)Ps[12];
    const bool neox = Ps[13] == 2;
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < n; t += (i64)gridDim.x * blockDim.x) {
        i64 r = t;
        const i64 ic = r % half; r /= half;
        const i64 i1 = r % Ps[1]; r /= Ps[1];
        const i64 i2 = r % Ps[2]; const i64 i3 = r / Ps[2];
        const char* s = a + i1 * Ps[5] + i2 * Ps[6] + i3 * Ps[7];
        i64 drow = i2;
        if (rows) {
            drow = *(const int*)((const char*)rows + i2 * Ps[21]);
            if (drow < 0 || drow >= Ps[20]) { *err = 1; continue; }
        }
        char* d = dst + i1 * Ps[9] + drow * Ps[10] + i3 * Ps[11];
        i64 e0, e1;
        bool rot;
        if (neox) {
            rot = ic < n_dims / 2;
            if (rot) { e0 = ic; e1 = ic + n_dims / 2; }
            else { e0 = n_dims + 2 * (ic - n_dims / 2); e1 = e0 + 1; }
        } else {
            e0 = 2 * ic; e1 = e0 + 1; rot = e0 < n_dims;
        }
        const float x0 = ld<T>(s + e0 * Ps[4]), x1 = ld<T>(s + e1 * Ps[4]);
        if (!rot) { st<TD>(d + e0 * Ps[8], x0); st<TD>(d + e1 * Ps[8], x1); continue; }
        float cs, sn;
        rope_cs(Ps + 14, (float)pos[i2], (int)ic, cs, sn);
        st<TD>(d + e0 * Ps[8], x0 * cs - x1 * sn);
        st<TD>(d + e1 * Ps[8], x0 * sn + x1 * cs);
    }
}

// ---- get_rows: dst[.., r, :] = a[.., idx[r], :] ------------------------------------------------------
// P: [ne0..3(dst), nbd0..3, nba0..3, nbi0..2, n_rows_a]; err: flag set on a bad index
template <typename T>
__global__ void k_get_rows(const i64* __restrict__ P, char* dst, const char* a, const int* idx, int* err) {
    pdl_enter();
    const i64 n = P[0] * P[1] * P[2] * P[3];
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < n; t += (i64)gridDim.x * blockDim.x) {
        i64 r = t;
        const i64 i0 = r % P[0]; r /= P[0];
        const i64 i1 = r % P[1]; r /= P[1];
        const i64 i2 = r % P[2]; const i64 i3 = r / P[2];
        const int row = *(const int*)((const char*)idx + i1 * P[12] + i2 * P[13] + i3 * P[14]);
        if (row < 0 || row >= P[15]) { *err = 1; continue; }
        const char* s = a + i0 * P[8] + (i64)row * P[9] + i2 * P[10] + i3 * P[11];
        char* d = dst + i0 * P[4] + i1 * P[5] + i2 * P[6] + i3 * P[7];
        st<float>(d, ld<T>(s));
    }
}
__global__ void k_get_rows_i32(const i64* __restrict__ P, char* dst, const char* a, const int* idx, int* err) {
    pdl_enter();
    const i64 n = P[0] * P[1] * P[2] * P[3];
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < n; t += (i64)gridDim.x * blockDim.x) {
        i64 r = t;
        const i64 i0 = r % P[0]; r /= P[0];
        const i64 i1 = r % P[1]; r /= P[1];
        const i64 i2 = r % P[2]; const i64 i3 = r / P[2];
        const int row = *(const int*)((const char*)idx + i1 * P[12] + i2 * P[13] + i3 * P[14]);
        if (row < 0 || row >= P[15]) { *err = 1; continue; }
        *(int*)(dst + i0 * P[4] + i1 * P[5] + i2 * P[6] + i3 * P[7]) =
            *(const int*)(a + i0 * P[8] + (i64)row * P[9] + i2 * P[10] + i3 * P[11]);
    }
}
// quantized rows: one thread per 32-element chunk. Same P (ne0 in elements).
template <int QT>
__global__ void k_get_rows_q(const i64* __restrict__ P, char* dst, const char* a, const int* idx, int* err) {
    pdl_enter();
    const i64 nch = P[0] / 32;
    const i64 n = nch * P[1] * P[2] * P[3];
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < n; t += (i64)gridDim.x * blockDim.x) {
        i64 r = t;
        const int c = (int)(r % nch); r /= nch;
        const i64 i1 = r % P[1]; r /= P[1];
        const i64 i2 = r % P[2]; const i64 i3 = r / P[2];
        const int row = *(const int*)((const char*)idx + i1 * P[12] + i2 * P[13] + i3 * P[14]);
        if (row < 0 || row >= P[15]) { *err = 1; continue; }
        float y[32];
        deq32<QT>((const u8*)(a + (i64)row * P[9] + i2 * P[10] + i3 * P[11]), c, y);
        char* d = dst + i1 * P[5] + i2 * P[6] + i3 * P[7];
        #pragma unroll
        for (int l = 0; l < 32; ++l) *(float*)(d + (32 * (i64)c + l) * P[4]) = y[l];
    }
}

// ---- quantize 32 floats to one Q8_0 / Q4_0 block (ggml's reference rounding) ------------------------
// chunk c of a row (GGUF Q8_0/Q4_0 blocks, or the x8 layouts) from 32 floats, with ggml's
// reference rounding
template <int QT>
__device__ void store32(u8* row, i64 c, const float* x) {
    constexpr bool q8 = QT == 8 || QT == 108;
    u8 *pd, *lo, *hi;  // scale, quants of elements 0..15 (Q4: all 16 bytes), of 16..31 (Q8)
    if constexpr (QT == 2 || QT == 8) {
        u8* b = row + c * (q8 ? 34 : 18);
        pd = b; lo = b + 2; hi = b + 18;
    } else {
        u8* g = row + (c >> 3) * (q8 ? 272 : 144);
        const int j = (int)(c & 7);
        pd = g + (q8 ? 256 : 128) + 2 * j; lo = g + 16 * j; hi = g + 128 + 16 * j;
    }
    if constexpr (q8) {
        float amax = 0.0f;
        for (int l = 0; l < 32; ++l) amax = fmaxf(amax, fabsf(x[l]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        *(__half*)pd = __float2half_rn(d);
        for (int l = 0; l < 16; ++l) {
            ((signed char*)lo)[l] = (signed char)roundf(x[l] * id);
            ((signed char*)hi)[l] = (signed char)roundf(x[l + 16] * id);
        }
    } else {
        float amax = 0.0f, mx = 0.0f;
        for (int l = 0; l < 32; ++l) if (fabsf(x[l]) > amax) { amax = fabsf(x[l]); mx = x[l]; }
        const float d = mx / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        *(__half*)pd = __float2half_rn(d);
        for (int l = 0; l < 16; ++l) {
            const int q0 = min(15, (int)(signed char)(x[l] * id + 8.5f));
            const int q1 = min(15, (int)(signed char)(x[l + 16] * id + 8.5f));
            lo[l] = (u8)(q0 | (q1 << 4));
        }
    }
}

// ---- set_rows: dst[.., idx[r], :] = src[.., r, :] -------------------------------------------------------
// P: [ne0..3(src), nbs0..3, nbd0..3, nbi0..2, nei1, nei2, n_rows_dst]
template <typename Td>
__global__ void k_set_rows(const i64* __restrict__ P, char* dst, const char* src, const int* idx, int* err) {
    __shared__ i64 Ps[18];
    pdl_enter_params<18>(P, Ps);
    const i64 n = Ps[0] * Ps[1] * Ps[2] * Ps[3];
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < n; t += (i64)gridDim.x * blockDim.x) {
        i64 r = t;
        const i64 i0 = r % Ps[0]; r /= Ps[0];
        const i64 i1 = r % Ps[1]; r /= Ps[1];
        const i64 i2 = r % Ps[2]; const i64 i3 = r / Ps[2];
        const int row = *(const int*)((const char*)idx + i1 * Ps[12] + (i2 % Ps[15]) * Ps[13] + (i3 % Ps[16]) * Ps[14]);
        if (row < 0 || row >= Ps[17]) { *err = 1; continue; }
        st<Td>(dst + i0 * Ps[8] + (i64)row * Ps[9] + i2 * Ps[10] + i3 * Ps[11],
               *(const float*)(src + i0 * Ps[4] + i1 * Ps[5] + i2 * Ps[6] + i3 * Ps[7]));
    }
}
template <int QT>
__global__ void k_set_rows_q(const i64* __restrict__ P, char* dst, const char* src, const int* idx, int* err) {
    pdl_enter();
    const i64 nch = P[0] / 32;
    const i64 n = nch * P[1] * P[2] * P[3];
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < n; t += (i64)gridDim.x * blockDim.x) {
        i64 r = t;
        const i64 c = r % nch; r /= nch;
        const i64 i1 = r % P[1]; r /= P[1];
        const i64 i2 = r % P[2]; const i64 i3 = r / P[2];
        const int row = *(const int*)((const char*)idx + i1 * P[12] + (i2 % P[15]) * P[13] + (i3 % P[16]) * P[14]);
        if (row < 0 || row >= P[17]) { *err = 1; continue; }
        float x[32];
        const char* s = src + i1 * P[5] + i2 * P[6] + i3 * P[7];
        for (int l = 0; l < 32; ++l) x[l] = *(const float*)(s + (32 * c + l) * P[4]);
        store32<QT>((u8*)(dst + (i64)row * P[9] + i2 * P[10] + i3 * P[11]), c, x);
    }
}

// ---- cpy: elements in row-major order of src written in row-major order of dst --------------------
// P: [n, nes0..3, nbs0..3, ned0..3, nbd0..3]
template <typename Td, typename Ts>
__global__ void k_cpy(const i64* __restrict__ P, char* dst, const char* src) {
    pdl_enter();
    const i64 n = P[0];
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        st<Td>(dst + offs4(i, P + 9, P + 13), ld<Ts>(src + offs4(i, P + 1, P + 5)));
}
__global__ void k_cpy_i32(const i64* __restrict__ P, char* dst, const char* src) {
    pdl_enter();
    const i64 n = P[0];
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        *(int*)(dst + offs4(i, P + 9, P + 13)) = *(const int*)(src + offs4(i, P + 1, P + 5));
}
// float -> Q8_0/Q4_0 (dst packed rows, one thread per 32-element block of dst)
template <int QT, typename Ts>
__global__ void k_cpy_q(const i64* __restrict__ P, char* dst, const char* src) {
    pdl_enter();
    const i64 nblk = P[0] / 32;
    const i64 ned0 = P[9];
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < nblk; t += (i64)gridDim.x * blockDim.x) {
        float x[32];
        for (int l = 0; l < 32; ++l) x[l] = ld<Ts>(src + offs4(32 * t + l, P + 1, P + 5));
        const i64 e = 32 * t;
        const i64 i0 = e % ned0;
        const i64 rowoff = offs4(e - i0, P + 9, P + 13);
        store32<QT>((u8*)(dst + rowoff), i0 / 32, x);
    }
}
// Q* -> F32 (src packed rows)
template <int QT>
__global__ void k_cpy_dq(const i64* __restrict__ P, char* dst, const char* src) {
    pdl_enter();
    const i64 nblk = P[0] / 32;
    const i64 nes0 = P[1];
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < nblk; t += (i64)gridDim.x * blockDim.x) {
        const i64 e = 32 * t;
        const i64 i0 = e % nes0;
        const i64 rowoff = offs4(e - i0, P + 1, P + 5);
        float y[32];
        deq32<QT>((const u8*)(src + rowoff), (int)(i0 / 32), y);
        for (int l = 0; l < 32; ++l) *(float*)(dst + offs4(e + l, P + 9, P + 13)) = y[l];
    }
}

// ---- concat along dim -----------------------------------------------------------------------------
// P: [n, ned0..3, nbd0..3, nea0..3, nba0..3, nbb0..3, dim]
template <typename T>
__global__ void k_concat(const i64* __restrict__ P, char* dst, const char* a, const char* b) {
    pdl_enter();
    const i64 n = P[0];
    const int dim = (int)P[21];
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < n; t += (i64)gridDim.x * blockDim.x) {
        i64 r = t, i[4];
        i[0] = r % P[1]; r /= P[1];
        i[1] = r % P[2]; r /= P[2];
        i[2] = r % P[3]; i[3] = r / P[3];
        char* d = dst + i[0] * P[5] + i[1] * P[6] + i[2] * P[7] + i[3] * P[8];
        if (i[dim] < P[9 + dim]) {
            *(T*)d = *(const T*)(a + i[0] * P[13] + i[1] * P[14] + i[2] * P[15] + i[3] * P[16]);
        } else {
            i[dim] -= P[9 + dim];
            *(T*)d = *(const T*)(b + i[0] * P[17] + i[1] * P[18] + i[2] * P[19] + i[3] * P[20]);
        }
    }
}

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
    // four loads in flight per thread: a load-compare loop waits out a memory round trip per
    // element (a 32000-entry vocabulary took 54 us on an H200 that way)
    const int n = (int)P[0], nb0 = (int)P[2], bd = blockDim.x;
    for (int i = threadIdx.x; i < n; i += 4 * bd) {
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
// argsort per row, stable: the rank of element i is the number of elements ordered before it.
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
            const bool before = desc ? (xj > xi) : (xj < xi);
            rank += before || (xj == xi && j < i);
        }
        *(int*)(d + rank * P[8]) = (int)i;
    }
}

// ---- im2col: dst[n, oh, ow, (c, kh, kw)] ----------------------------------------------------------------
// P: [n_dst, ne_dst0..3, nbd0..3, nbx0..3, W, H, KW, KH, s0, s1, p0, p1, d0, d1,
//     fastdiv(ne0) x3, fastdiv(ne1) x3, fastdiv(ne2) x3, fastdiv(KW) x3, fastdiv(KH) x3] (from 23)
template <typename Td>
__global__ void k_im2col(const i64* __restrict__ P, char* dst, const char* x) {
    pdl_enter();
    const i64 n = P[0];
    const fastdiv_t f0 = fdv(P, 23), f1 = fdv(P, 26), f2 = fdv(P, 29), fkw = fdv(P, 32), fkh = fdv(P, 35);
    const int W = (int)P[13], H = (int)P[14];
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < n; t += (i64)gridDim.x * blockDim.x) {
        unsigned int r = (unsigned int)t;
        unsigned int q = fdiv(r, f0); const unsigned int i0 = r - q * f0.d; r = q;
        q = fdiv(r, f1); const unsigned int ow = r - q * f1.d; r = q;
        q = fdiv(r, f2); const unsigned int oh = r - q * f2.d; const unsigned int nn = q;
        unsigned int qq = fdiv(i0, fkw); const int ikw = (int)(i0 - qq * fkw.d);
        const unsigned int rest = qq; qq = fdiv(rest, fkh);
        const int ikh = (int)(rest - qq * fkh.d); const int ic = (int)qq;
        const int iw = (int)ow * (int)P[17] + ikw * (int)P[21] - (int)P[19];
        const int ih = (int)oh * (int)P[18] + ikh * (int)P[22] - (int)P[20];
        float v = 0.0f;
        if (iw >= 0 && iw < W && ih >= 0 && ih < H)
            v = *(const float*)(x + iw * P[9] + ih * P[10] + ic * P[11] + (i64)nn * P[12]);
        st<Td>(dst + i0 * P[5] + ow * P[6] + oh * P[7] + nn * P[8], v);
    }
}

// ---- col2im_1d: out[b, c, t] = sum over (t_in, k) with t + p0 == t_in*s0 + k of a[b, t_in, c*K + k] ----
// P: [n, T_out, OC, B, nbd0..2, nba0..2, K, T_in, s0, p0, fastdiv(T_out) x3, fastdiv(OC) x3]
__global__ void k_col2im_1d(const i64* __restrict__ P, char* dst, const char* a) {
    pdl_enter();
    const i64 n = P[0];
    const fastdiv_t ft = fdv(P, 14), fc = fdv(P, 17);
    const int K = (int)P[10], T_in = (int)P[11], s0 = (int)P[12], p0 = (int)P[13];
    for (i64 id = blockIdx.x * (i64)blockDim.x + threadIdx.x; id < n; id += (i64)gridDim.x * blockDim.x) {
        unsigned int r = (unsigned int)id;
        unsigned int q = fdiv(r, ft); const int t = (int)(r - q * ft.d); r = q;
        q = fdiv(r, fc); const int c = (int)(r - q * fc.d); const int b = (int)q;
        const int ta = t + p0;
        int lo = ta - K + 1; lo = lo <= 0 ? 0 : (lo + s0 - 1) / s0;
        int hi = ta / s0; if (hi > T_in - 1) hi = T_in - 1;
        float acc = 0.0f;
        for (int ti = lo; ti <= hi; ++ti)
            acc += *(const float*)(a + (i64)(c * K + ta - ti * s0) * P[7] + (i64)ti * P[8] + (i64)b * P[9]);
        *(float*)(dst + t * P[4] + c * P[5] + (i64)b * P[6]) = acc;
    }
}

// ---- mat-vec: W lanes per weight row (a power of two <= 32: short rows, like attention over a
// KV cache, get several rows per warp instead of idle lanes), lanes over 32-element chunks, all N
// activation rows. out[.., n, m] = sum_k W[.., m, k] * x[.., n, k]
// P: [M, K, N, ne2, ne3, r2, r3, nbw1, nbw2, nbw3, nbx1, nbx2, nbx3, nbd1, nbd2, nbd3, W, staged]
#define MMV_MAXN 8
// P[17] set: the block first copies its N activation rows into dynamic shared memory (N * K
// floats, plan.py sizes it), all loads in flight at once, instead of each lane reading them from
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
// ==== decode attention: MUL_MAT(K, Q) → SOFT_MAX(scale, mask) → MUL_MAT(V, ·) as one kernel ====
// (an accelplane.fusion run; plan.py: _attention). A group of 128 threads takes ATT_C cache
// positions of one head batch for all R query rows (the rows of a GQA group share the K and V
// loads): four lanes per position for the scores, one thread per V row (V is stored transposed:
// a row per output feature, positions contiguous) for the weighted sum. A block holds G <= ATT_G
// such groups on consecutive chunks and merges their partial softmaxes in shared memory, so a
// short cache (n_kv <= ATT_G ATT_C, every decode step of a short context) is one block per head
// and the launch is the whole result. Longer caches take several blocks per head: each leaves
// its partial softmax (row max, sum, weighted V) in scratch and the last block of a batch to
// finish (an atomic count, which it resets) combines them. Every global load of a block (V, K,
// Q, mask) is issued before any is used, so the block waits for memory once. The code is kept
// small (R ≤ RM rows compiled per instantiation, loops over rows and groups not unrolled where
// registers do not need it): the kernel runs once per layer from a cold instruction cache, and
// fetching a large body cost more than its arithmetic (154 KB of code took 8 µs at 32 positions).
// P: [D, n_kv, R, ne2, ne3, r2k, r3k, nbk1, nbk2, nbk3, nbq1, nbq2, nbq3, has_mask, nbm1, nbm2, nbm3,
//     nem2, nem3, scale, Dv, r2v, r3v, nbv1, nbv2, nbv3, nbd1, nbd2, nbd3, vwhole, total]
// D a multiple of 8 up to ATT_MAXD with 16-byte aligned K rows; Dv <= 128; R <= RM <= 8;
// blocks per batch <= ATT_MAXB; vwhole: V rows 16-byte aligned and readable to the end of the
// last chunk (vector loads of whole chunks; positions past n_kv are zeroed after the load).
// grid (blocks, ne2 * ne3), 128 G threads; part: grid.y * grid.x * 8 * (Dv + 2) floats; count:
// grid.y ints, zero. xq: when not null (Dv a multiple of 32, dst contiguous: output element
// (b, r, o) is number (b R + r) Dv + o of total), the result is also written quantized as
// k_quant_x writes it, for the output projection.
#define ATT_C 32
#define ATT_G 4     // groups per block at most (plan.py: _ATT_G)
#define ATT_MAXR 8  // the partials' row stride in scratch (plan.py sizes it)
#define ATT_MAXD 256
#define ATT_MAXB 64  // blocks per batch: n_kv <= 8192
#define ATT_NP 31    // k_attention's parameters
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
    __shared__ i64 Ps[ATT_NP];
    pdl_enter_params<ATT_NP>(P, Ps);
    __shared__ float qs[RM * ATT_MAXD];
    __shared__ float ps[ATT_G][RM][ATT_C];
    __shared__ float ms[ATT_G][RM], ls[ATT_G][RM], wg[ATT_G][RM], bm[RM], bl[RM];
    __shared__ float pacc[ATT_G][RM][128];
    __shared__ float wm[RM][ATT_MAXB], wl[RM][ATT_MAXB];
    __shared__ bool last;
    const int D = (int)Ps[0], nkv = (int)Ps[1], R = (int)Ps[2], Dv = (int)Ps[20];
    const int b = blockIdx.y, i2 = b % (int)Ps[3], i3 = b / (int)Ps[3];
    const int tid = threadIdx.x, t = tid & 127, grp = tid >> 7, G = blockDim.x >> 7, lane = tid & 31;
    const int j0 = (blockIdx.x * G + grp) * ATT_C;
    const char* kb = kc + (i2 / (int)Ps[5]) * Ps[8] + (i3 / (int)Ps[6]) * Ps[9];
    const char* vr = vc + (i2 / (int)Ps[21]) * Ps[24] + (i3 / (int)Ps[22]) * Ps[25] + t * Ps[23] + j0 * (i64)sizeof(TV);
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
            if (r < R && e < D) qv[r][c] = *(const float*)(q + r * Ps[10] + i2 * Ps[11] + i3 * Ps[12] + e * 4);
        }
    }
    float mk[RM];  // the mask at this lane's position (the lane that writes its scores)
    #pragma unroll
    for (int r = 0; r < RM; ++r) {
        mk[r] = 0.0f;
        if (Ps[13] != 0 && sub == 0 && r < R && j < nkv)
            mk[r] = ld<TM>(mask + r * Ps[14] + (i2 % (int)Ps[17]) * Ps[15] + (i3 % (int)Ps[18]) * Ps[16] +
                           j * (i64)sizeof(TM));
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
                if (r < R) {
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) sc[r] += kf[i] * qs[r * D + d0 + i];
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
        *(float*)(dst + i2 * Ps[27] + i3 * Ps[28] + r * Ps[26] + o * 4) = y;
        if (xq) quantize1(xq, y, b * R * Dv + i, total);  // whole warps: R Dv % 32 == 0
    }
    if (nc > 1 && tid == 0) count[b] = 0;  // ready for the next launch
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

// ==== mat-vec (n <= MMV_MAXN) of large weight matrices: rows streamed through shared memory ====
// Each warp owns whole weight rows (a persistent grid: a warp takes several rows) and streams them
// in MMVP_SEG-byte stages with cp.async, MMVP_NS stages in flight, so DRAM latency is hidden
// without spending registers on it; lanes then compute from the stage. The activations sit in
// shared memory for the whole block: quantized per 32 elements (int8 q, float d, int sum of q)
// for quantized weights, so the dot of a 32-element weight unit is integer dp4a work, and F32
// for float weights. The block quantizes them itself while its first stages are in flight, which
// saves a kernel launch and a round trip through global memory per product.
// Rows must be 16-byte aligned with a size a multiple of 16 bytes; K a multiple of 32.

__device__ __forceinline__ unsigned int ld_u16x2(const u8* p) {  // 4 bytes at a 2-aligned address
    return (unsigned int)*(const unsigned short*)p | ((unsigned int)*(const unsigned short*)(p + 2) << 16);
}

template <int WT> struct qfmt;
template <> struct qfmt<2> { enum { BB = 18, UPB = 1, UNIT = 144 }; };   // bytes/block, 32-units/block, segment unit
template <> struct qfmt<8> { enum { BB = 34, UPB = 1, UNIT = 272 }; };
template <> struct qfmt<12> { enum { BB = 144, UPB = 8, UNIT = 144 }; };
template <> struct qfmt<14> { enum { BB = 210, UPB = 8, UNIT = 1680 }; };
template <> struct qfmt<102> { enum { BB = 144, UPB = 8, UNIT = 144 }; };  // a group of 8 blocks
template <> struct qfmt<108> { enum { BB = 272, UPB = 8, UNIT = 272 }; };
template <> struct qfmt<112> { enum { BB = 144, UPB = 8, UNIT = 144 }; };

// dot of 32-element unit u of a row (in shared memory) with activation unit (xq words, d, sum)
template <int WT> __device__ __forceinline__ float unit_dot(const u8* row, int u, const int* xq, float dx, int sx);
template <> __device__ __forceinline__ float unit_dot<2>(const u8* row, int u, const int* xq, float dx, int sx) {
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
template <> __device__ __forceinline__ float unit_dot<8>(const u8* row, int u, const int* xq, float dx, int sx) {
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
template <> __device__ __forceinline__ float unit_dot<12>(const u8* row, int u, const int* xq, float dx, int sx) {
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
template <> __device__ __forceinline__ float unit_dot<102>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* g = row + (u >> 3) * 144;
    const int j = u & 7;
    return f16at(g + 128 + 2 * j) * dx * (float)(dot_q4x8(*(const uint4*)(g + 16 * j), xq) - 8 * sx);
}
template <> __device__ __forceinline__ float unit_dot<108>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* g = row + (u >> 3) * 272;
    const int j = u & 7;
    const int acc = dot_q8x8(*(const uint4*)(g + 16 * j), *(const uint4*)(g + 128 + 16 * j), xq);
    return f16at(g + 256 + 2 * j) * dx * (float)acc;
}
// Q4_Kx8: sub-block j of the super-block whose header is h (see deq32<112>)
__device__ __forceinline__ float q4kx8_dot(uint4 q, uint4 h, int j, const int* xq, float dx, int sx) {
    int sc, m;
    q4kx8_scale_min(h.y, h.z, h.w, j, sc, m);
    const float2 dm = __half22float2(*(const __half2*)&h.x);  // d, dmin
    return dx * (dm.x * (float)(sc * dot_q4x8(q, xq)) - dm.y * (float)(m * sx));
}
template <> __device__ __forceinline__ float unit_dot<112>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* g = row + (u >> 3) * 144;
    return q4kx8_dot(*(const uint4*)(g + 16 * (u & 7)), *(const uint4*)(g + 128), u & 7, xq, dx, sx);
}
template <> __device__ __forceinline__ float unit_dot<14>(const u8* row, int u, const int* xq, float dx, int sx) {
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

#ifndef MMVP_SEG
#define MMVP_SEG 4096  // bytes of a stage (plan.py passes its MMVP_SEG)
#endif
#ifndef MMVP_NS
#define MMVP_NS 2      // stages per warp (plan.py passes its MMVP_NS)
#endif
template <int WT> struct is_quant { enum { v = WT == 2 || WT == 8 || WT == 12 || WT == 14 || WT == 102 || WT == 108 || WT == 112 }; };

__device__ __forceinline__ void cp_async16(void* s, const void* g) {
    const unsigned int sa = (unsigned int)__cvta_generic_to_shared(s);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int n> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(n) : "memory");
}

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
        constexpr int EPV = WT == 0 ? 4 : 8;  // elements per 16-byte word
        const float4* xf = (const float4*)sx;  // see mmvp_copy_x: two planes when EPV == 8
        const int k4 = K / 4;
        const int nvec = nbytes / 16, e0 = s0 / 16 * EPV;
        for (int v = lane; v < nvec; v += 32) {
            const uint4 wv = ((const uint4*)stage)[v];
            float wf[8];
            if constexpr (WT == 0) {
                wf[0] = __uint_as_float(wv.x); wf[1] = __uint_as_float(wv.y);
                wf[2] = __uint_as_float(wv.z); wf[3] = __uint_as_float(wv.w);
            } else if constexpr (WT == 1) {
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
// MMVP_SEG bytes of stages, then the activations (plan.py: _mmvp_smem)
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
    else mmvp_copy_x<WT != 0>(sx, xb, P[15], K, N);
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
template <> struct unit_regs<102> {
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
template <> struct unit_regs<108> {
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
template <> struct unit_regs<12> {
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
template <> struct unit_regs<112> {
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
    // P[15] set (plan.py: no kernel of the graph writes the weights' buffer): the first pass's
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
// the activations; grid (rows / (RT 128 / LPR)). Same P; QKV: the rows go through qkv_put
// instead of to dst (an even number of rows per block: a rope pair is in one block).
template <int WT, int U, int LPR, int MINB, int RT, bool QKV = false>
__global__ void __launch_bounds__(128, MINB)
k_mmv_row1(const i64* __restrict__ P, char* dst, const char* w, const char* xq) {
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
    const bool early = P[15] != 0;  // as k_mmv_row (one load site: fewer registers)
    if (!early) pdl_enter();
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
    for (int k = 0; k < RT; ++k) acc[k] = warp_sum(acc[k]);  // LPR >= 32: a row's lanes are whole warps
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
// register kernel stays ahead for Q4_0 (plan.py: _ring_fits, _RING).
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

#define MMVQ_WARPS 4
#define MMVQ_SEG 4096
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

// contiguous conversion (activations to the GEMM's type): no index arithmetic
template <typename Td, typename Ts>
__global__ void k_convert(const i64* __restrict__ P, char* dst, const char* src) {
    pdl_enter();
    const i64 n = P[0];
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        st<Td>(dst + i * sizeof(Td), ld<Ts>(src + i * sizeof(Ts)));
}

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
#define AR_MAXB 64
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
