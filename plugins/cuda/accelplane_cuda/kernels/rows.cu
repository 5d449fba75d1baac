// accelplane CUDA plugin: rows and copies: get_rows, set_rows, cpy (quantizing and dequantizing
// too), concat, contiguous conversions (rows.py; nccl.py's BF16 wire copies).
#include "common.cuh"

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
    constexpr bool q8 = QT == ty::Q8_0 || QT == ty::Q8_0X8;
    u8 *pd, *lo, *hi;  // scale, quants of elements 0..15 (Q4: all 16 bytes), of 16..31 (Q8)
    if constexpr (QT == ty::Q4_0 || QT == ty::Q8_0) {
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

// eight elements of T as floats, loaded and stored in 16-byte words (16-byte aligned)
template <typename T> struct vec8;
template <> struct vec8<float> {
    __device__ __forceinline__ static void load(const char* p, float* f) {
        const float4 a = ((const float4*)p)[0], b = ((const float4*)p)[1];
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    }
    __device__ __forceinline__ static void store(char* p, const float* f) {
        ((float4*)p)[0] = make_float4(f[0], f[1], f[2], f[3]);
        ((float4*)p)[1] = make_float4(f[4], f[5], f[6], f[7]);
    }
};
template <> struct vec8<__half> {
    __device__ __forceinline__ static void load(const char* p, float* f) { half8(*(const uint4*)p, f); }
    __device__ __forceinline__ static void store(char* p, const float* f) {
        __half2 h[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
        *(uint4*)p = *(const uint4*)h;
    }
};
template <> struct vec8<__nv_bfloat16> {
    __device__ __forceinline__ static void load(const char* p, float* f) {
        const uint4 w = *(const uint4*)p;
        const unsigned int u[4] = {w.x, w.y, w.z, w.w};
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 t = __bfloat1622float2(*(const __nv_bfloat162*)&u[i]);
            f[2 * i] = t.x; f[2 * i + 1] = t.y;
        }
    }
    __device__ __forceinline__ static void store(char* p, const float* f) {
        __nv_bfloat162 h[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
        *(uint4*)p = *(const uint4*)h;
    }
};

// contiguous conversion (activations to the GEMM's type): no index arithmetic; eight elements a
// thread step in 16-byte words where both ends are 16-byte aligned. P: [n]
template <typename Td, typename Ts>
__global__ void k_convert(const i64* __restrict__ P, char* dst, const char* src) {
    pdl_enter();
    const i64 n = P[0], t0 = blockIdx.x * (i64)blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    i64 done = 0;
    if ((((size_t)dst | (size_t)src) & 15) == 0) {
        done = n / 8 * 8;
        for (i64 i = t0; i < n / 8; i += stride) {
            float f[8];
            vec8<Ts>::load(src + i * 8 * (i64)sizeof(Ts), f);
            vec8<Td>::store(dst + i * 8 * (i64)sizeof(Td), f);
        }
    }
    for (i64 i = done + t0; i < n; i += stride) st<Td>(dst + i * sizeof(Td), ld<Ts>(src + i * sizeof(Ts)));
}
