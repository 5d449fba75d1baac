// accelplane CUDA plugin: what every kernel family (kernels/*.cu, one NVRTC module each,
// compiler.py) shares: types, parameter access, programmatic dependent launch, element loads and
// stores, dequantization of 32-element chunks, warp and block reductions, the quantized
// activations' layout, rope's rotation.
//
// Every kernel takes `const i64* P`: a small device array of parameters built once per graph
// node at plan time (shapes, byte strides, op parameters; floats are stored as the bits of a
// double). Tensors are `char*` base pointers with byte strides, so views of any layout work.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long i64;
typedef unsigned char u8;
#define AP_INF __int_as_float(0x7f800000)  // NVRTC has no math.h INFINITY

// Type ids of the kernels' template parameters: GGUF's (accelplane.core.types.GGMLType), and past them
// the x8 layouts of weights buffers (layout.py: X8Type)
namespace ty {
constexpr int F32 = 0, F16 = 1, Q4_0 = 2, Q8_0 = 8, Q4_K = 12, Q6_K = 14, BF16 = 30;
constexpr int Q4_0X8 = 102, Q8_0X8 = 108, Q4_KX8 = 112;
}  // namespace ty

__device__ __forceinline__ double pf(const i64* P, int i) { return __longlong_as_double(P[i]); }

// ---- programmatic dependent launch (sm_90+) ------------------------------------------------------
// plan.py launches every kernel with the programmatic-serialization attribute (unless
// ACCELPLANE_CUDA_PDL=0), so the next kernel of a stream may start while this one still runs. The
// contract that keeps that safe: every kernel calls pdl_enter before it touches memory that another
// kernel writes or reads. pdl_enter waits until the previous kernel has finished and its writes are
// visible, then lets the next kernel launch (it will wait in its own pdl_enter); since that one
// waited for its own predecessor, the order is transitive. Letting it launch only after the wait
// keeps one kernel waiting behind the running one: triggered before the wait, a chain of waiting
// kernels fills the SMs ahead of the work (a qwen3moe decode step on an H100: 1306 us against
// 1163 us triggered after it). Only the mat-vecs and the vector norm may read before it: weights in
// a buffer no kernel of the graph writes (k_mmv_row, k_mmv_row1 and k_mmv_ring, P[15]; k_mmv_ring
// copies them into its own shared memory; k_norm_vec its MUL's, P[32]; k_moe_router the router's,
// P[12]); and a graph's first launch goes without the attribute, so nothing earlier in the stream
// overlaps. Without the attribute (or below sm_90) both instructions are no-ops.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// pdl_enter for a kernel that reads its N parameters from shared memory Ps: they are written once,
// at plan time, so their loads are issued before the wait and arrive while the previous kernel
// drains (saving a round trip after it). M > 0: M more, this block's slice of a table that follows
// the N (P[N + off ...], into Ps[N ...]). Blocks of at least N + M threads (one load each); ends
// with a block barrier, so every thread sees Ps.
template <int N, int M = 0>
__device__ __forceinline__ void pdl_enter_params(const i64* __restrict__ P, i64* Ps, int off = 0) {
    const int i = threadIdx.x;
    if (i < N + M) Ps[i] = P[i < N ? i : i + off];
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

// 16 bytes global -> shared without a register round trip (both 16-byte aligned)
__device__ __forceinline__ void cp_async16(void* s, const void* g) {
    const unsigned int sa = (unsigned int)__cvta_generic_to_shared(s);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int n> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(n) : "memory");
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


// ---- dequantize one 32-element chunk of a row ------------------------------------------------------
// chunk c covers elements [32c, 32c+32) of the row.
template <int TYPE> __device__ __forceinline__ void deq32(const u8* row, int c, float* y);
// the block types beyond these four (and q4k_scale_min, ld_u16x2, unit_dot's and qfmt's declarations)
#include "quants.cuh"

// Q4_0: 18-byte blocks: f16 d, 16 bytes; element l<16 = low nibble of qs[l], l>=16 = high nibble
template <> __device__ __forceinline__ void deq32<ty::Q4_0>(const u8* row, int c, float* y) {
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
template <> __device__ __forceinline__ void deq32<ty::Q8_0>(const u8* row, int c, float* y) {
    const u8* b = row + (i64)c * 34;
    const float d = f16at(b);
    #pragma unroll
    for (int l = 0; l < 32; ++l) y[l] = d * (float)(signed char)b[2 + l];
}
// Q4_K: 144-byte superblocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins (quants.cuh:
// q4k_scale_min), 128 bytes qs.
template <> __device__ __forceinline__ void deq32<ty::Q4_K>(const u8* row, int c, float* y) {
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
template <> __device__ __forceinline__ void deq32<ty::Q6_K>(const u8* row, int c, float* y) {
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
template <> __device__ __forceinline__ void deq32<ty::Q4_0X8>(const u8* row, int c, float* y) {
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
template <> __device__ __forceinline__ void deq32<ty::Q8_0X8>(const u8* row, int c, float* y) {
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
template <> __device__ __forceinline__ void deq32<ty::Q4_KX8>(const u8* row, int c, float* y) {
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
template <> __device__ __forceinline__ void deq32<ty::F32>(const u8* row, int c, float* y) {
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
template <> __device__ __forceinline__ void deq32<ty::F16>(const u8* row, int c, float* y) {
    const __half* p = (const __half*)row + 32 * c;
    if (((size_t)p & 15) == 0) {
        #pragma unroll
        for (int l = 0; l < 4; ++l) half8(((const uint4*)p)[l], y + 8 * l);
        return;
    }
    #pragma unroll
    for (int l = 0; l < 32; ++l) y[l] = __half2float(p[l]);
}
template <> __device__ __forceinline__ void deq32<ty::BF16>(const u8* row, int c, float* y) {
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


// ---- activations quantized for the integer mat-vecs ------------------------------------------------
// N rows of K floats, quantized per 32-element unit: xq int8 as two planes of 16 bytes per unit
// (plane 0: elements 0..15 of every unit, then plane 1: elements 16..31), so lanes on
// consecutive units read consecutive 16-byte words; then xd float [N][K/32] (the scale, rounded
// to f16 as ggml's block_q8_1 stores it; the quants use the unrounded one, as ggml's
// quantize_q8_1), then xs int [N][K/32] (sums of the quants). total = N * K, a multiple of 32.
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
        if ((lane & 7) == 0) { xd[e / 32] = __half2float(__float2half_rn(d)); xs[e / 32] = sum; }
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
        ((float*)(sx + total))[e / 32] = __half2float(__float2half_rn(d));
        ((int*)(sx + total + total / 32 * 4))[e / 32] = sum;
    }
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

// block formats: bytes per block, 32-element units per block, and the unit a segment of rows
// streamed through shared memory is a multiple of (matvec.cu, dequant.cu)
template <> struct qfmt<ty::Q4_0> { enum { BB = 18, UPB = 1, UNIT = 144 }; };   // bytes/block, 32-units/block, segment unit
template <> struct qfmt<ty::Q8_0> { enum { BB = 34, UPB = 1, UNIT = 272 }; };
template <> struct qfmt<ty::Q4_K> { enum { BB = 144, UPB = 8, UNIT = 144 }; };
template <> struct qfmt<ty::Q6_K> { enum { BB = 210, UPB = 8, UNIT = 1680 }; };
template <> struct qfmt<ty::Q4_0X8> { enum { BB = 144, UPB = 8, UNIT = 144 }; };  // a group of 8 blocks
template <> struct qfmt<ty::Q8_0X8> { enum { BB = 272, UPB = 8, UNIT = 272 }; };
template <> struct qfmt<ty::Q4_KX8> { enum { BB = 144, UPB = 8, UNIT = 144 }; };

