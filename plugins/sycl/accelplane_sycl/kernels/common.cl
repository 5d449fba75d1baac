// accelplane SYCL plugin: what every OpenCL C kernel shares. Each kernel is built as its own
// program: this file, the helpers of its family's file (kernels/*.cl), the kernel (program.py).
//
// Every kernel takes its parameters from a plan's parameter block (P + pi, int64 words, written
// by plan.py): tensor descriptors of 10 words (byte offset, ne[4], nb[4], type; ggml's layout,
// ne[0] innermost) followed by op parameters (float parameters as float32 bits). Tensors come as
// byte pointers to their buffer's base, so views and offsets need no pointer objects on the host.
//
// All ranges are 1-D and decomposed here: dpctl/SYCL list range dimensions in the reverse order
// of OpenCL's get_global_id (see the SYCL notes), so a flattened index avoids that trap.

#if defined(cl_khr_fp64) || defined(__opencl_c_fp64)
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
typedef double acc_t;  // reductions and rope angles in double where the device has it
#else
typedef float acc_t;
#endif

#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q2_K 10
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ4_NL 20
#define T_IQ4_XS 23
#define T_I32 26
#define T_BF16 30

#define TD_WORDS 10

// bits of a backend's error word (stream.INDEX_ERRORS): kernels that meet a bad index OR one in
// and still never read or write out of bounds; the host raises at the backend's next synchronize
#define ERR_GET_ROWS 1u
#define ERR_SET_ROWS 2u
#define ERR_MUL_MAT_ID 4u

typedef __global uchar gbuf;
typedef __global const uchar cbuf;
typedef __global const long* params;
typedef volatile __global uint* errw;

inline void report_error(errw err, uint bit) {
    if (!(*err & bit)) atomic_or(err, bit);
}

typedef struct {
    long off;
    long ne[4];
    long nb[4];
    int ty;
} td_t;

inline td_t td(params p) {
    td_t t;
    t.off = p[0];
    for (int i = 0; i < 4; ++i) {
        t.ne[i] = p[1 + i];
        t.nb[i] = p[5 + i];
    }
    t.ty = (int)p[9];
    return t;
}

inline float pf(params p, int i) { return as_float((uint)p[i]); }

inline long nel(const td_t* t) { return t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3]; }

// flat row-major index (ne[0] fastest) -> 4-D index
inline void unravel(long i, const long* ne, long* ix) {
    ix[0] = i % ne[0]; i /= ne[0];
    ix[1] = i % ne[1]; i /= ne[1];
    ix[2] = i % ne[2];
    ix[3] = i / ne[2];
}

inline long row_off(const td_t* t, long i1, long i2, long i3) {
    return t->off + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
}

inline int blck(int ty) {
    switch (ty) {
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: case T_IQ4_NL: return 32;
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: return 256;
    default: return 1;
    }
}

inline int esize(int ty) { return (ty == T_F16 || ty == T_BF16) ? 2 : 4; }

// --- scalar loads and stores -----------------------------------------------------------------
inline float ld_f(cbuf* b, long o, int ty) {
    switch (ty) {
    case T_F16: return vload_half(0, (__global const half*)(b + o));
    case T_BF16: return as_float(((uint)*(__global const ushort*)(b + o)) << 16);
    case T_I32: return (float)*(__global const int*)(b + o);
    default: return *(__global const float*)(b + o);
    }
}

inline ushort f32_to_bf16(float v) {
    uint u = as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (ushort)((u >> 16) | 64);  // quiet NaN
    return (ushort)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);           // round to nearest even
}

inline void st_f(gbuf* b, long o, int ty, float v) {
    switch (ty) {
    case T_F16: vstore_half_rte(v, 0, (__global half*)(b + o)); break;
    case T_BF16: *(__global ushort*)(b + o) = f32_to_bf16(v); break;
    case T_I32: *(__global int*)(b + o) = (int)rint(v); break;
    default: *(__global float*)(b + o) = v;
    }
}

inline void copy_el(gbuf* d, long od, cbuf* s, long os, int ty) {
    if (esize(ty) == 2) *(__global ushort*)(d + od) = *(__global const ushort*)(s + os);
    else *(__global uint*)(d + od) = *(__global const uint*)(s + os);
}

// --- quantized blocks (byte layouts of ggml-common.h) ----------------------------------------
inline float q4k_scale(cbuf* sc, int j, int want_min) {
    uchar d, m;
    if (j < 4) {
        d = sc[j] & 63;
        m = sc[j + 4] & 63;
    } else {
        d = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
        m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
    return (float)(want_min ? m : d);
}

inline float f16_at(cbuf* blk, int o) { return vload_half(0, (__global const half*)(blk + o)); }

// ggml's kvalues_iq4nl: IQ4_NL's and IQ4_XS's 16 levels
__constant char IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// element j of the block at blk of the block types beyond Q4_0, Q8_0, Q4_K and Q6_K (layouts:
// accelplane.core.types). Q2_K and Q3_K (16-element sub-blocks) hold element 128h + 32s + l in
// bits 2s of quant byte 32h + l, with scale j / 16.
inline float ld_q_more(cbuf* blk, int j, int ty) {
    if (ty == T_Q4_1 || ty == T_Q5_0 || ty == T_Q5_1) {
        int qs = ty == T_Q4_1 ? 4 : ty == T_Q5_0 ? 6 : 8;
        uchar b = blk[qs + (j & 15)];
        int q = j < 16 ? (b & 0xF) : (b >> 4);
        if (ty != T_Q4_1) q |= ((blk[qs - 4 + (j >> 3)] >> (j & 7)) & 1) << 4;
        float d = f16_at(blk, 0);
        return ty == T_Q5_0 ? d * (float)(q - 16) : d * (float)q + f16_at(blk, 2);
    }
    if (ty == T_Q2_K || ty == T_Q3_K) {
        int h = j >> 7, s = (j >> 5) & 3, l = j & 31;
        int q = (blk[(ty == T_Q2_K ? 16 : 32) + 32 * h + l] >> (2 * s)) & 3;
        if (ty == T_Q2_K) {
            uchar sc = blk[j >> 4];
            return f16_at(blk, 80) * (float)(sc & 0xF) * (float)q - f16_at(blk, 82) * (float)(sc >> 4);
        }
        int k = j >> 4;  // Q3_K's 6-bit scale k, 32 subtracted, of its 12 bytes at 96
        int lo = k < 8 ? blk[96 + k] & 0xF : blk[88 + k] >> 4;
        int sc = (lo | (((blk[104 + (k & 3)] >> (2 * (k >> 2))) & 3) << 4)) - 32;
        int v = q - (((blk[l] >> (j >> 5)) & 1) ? 0 : 4);
        return f16_at(blk, 108) * (float)sc * (float)v;
    }
    if (ty == T_Q5_K) {  // Q4_K's scales and nibbles at 48, fifth bit j / 32 of qh[j % 32]
        int s = j >> 5, l = j & 31;
        uchar b = blk[48 + 32 * (s >> 1) + l];
        int q = ((s & 1) ? (b >> 4) : (b & 0xF)) | (((blk[16 + l] >> s) & 1) << 4);
        return f16_at(blk, 0) * q4k_scale(blk + 4, s, 0) * (float)q - f16_at(blk, 2) * q4k_scale(blk + 4, s, 1);
    }
    if (ty == T_IQ4_NL) {
        uchar b = blk[2 + (j & 15)];
        return f16_at(blk, 0) * (float)IQ4NL[j < 16 ? (b & 0xF) : (b >> 4)];
    }
    // IQ4_XS: d, scales_h (u16), scales_l[4], qs[128]: sub-block s's quants at 8 + 16s as Q4_0's
    int s = j >> 5, l = j & 31;
    int ls = ((blk[4 + (s >> 1)] >> (4 * (s & 1))) & 0xF) | ((((blk[2] | (blk[3] << 8)) >> (2 * s)) & 3) << 4);
    uchar b = blk[8 + 16 * s + (l & 15)];
    return f16_at(blk, 0) * (float)(ls - 32) * (float)IQ4NL[l < 16 ? (b & 0xF) : (b >> 4)];
}

// element j of the block at blk
inline float ld_q(cbuf* blk, int j, int ty) {
    if (ty != T_Q4_0 && ty != T_Q8_0 && ty != T_Q4_K && ty != T_Q6_K) return ld_q_more(blk, j, ty);
    if (ty == T_Q8_0) {
        return vload_half(0, (__global const half*)blk) * (float)((__global const char*)blk)[2 + j];
    }
    if (ty == T_Q4_0) {
        float d = vload_half(0, (__global const half*)blk);
        uchar q = blk[2 + (j & 15)];
        int v = (j < 16 ? (q & 0xF) : (q >> 4)) - 8;
        return d * (float)v;
    }
    if (ty == T_Q4_K) {
        float d = vload_half(0, (__global const half*)blk);
        float dmin = vload_half(1, (__global const half*)blk);
        cbuf* sc = blk + 4;
        int c = j >> 6, w = j & 63, hi = w >> 5, l = w & 31;
        int is = 2 * c + hi;
        uchar q = blk[16 + 32 * c + l];
        float dl = d * q4k_scale(sc, is, 0);
        float ml = dmin * q4k_scale(sc, is, 1);
        return dl * (float)(hi ? (q >> 4) : (q & 0xF)) - ml;
    }
    // Q6_K: ql[128], qh[64], scales[16] (int8), d
    int n = j >> 7, r = j & 127, g = r >> 5, l = r & 31;
    cbuf* ql = blk + 64 * n;
    cbuf* qh = blk + 128 + 32 * n;
    __global const char* sc = (__global const char*)(blk + 192 + 8 * n);
    float d = vload_half(0, (__global const half*)(blk + 208));
    uchar lo = (g & 1) ? ql[l + 32] : ql[l];
    int q = (int)(((g & 2) ? (lo >> 4) : (lo & 0xF)) | (((qh[l] >> (2 * g)) & 3) << 4)) - 32;
    return d * (float)sc[(l >> 4) + 2 * g] * (float)q;
}

// element (i0, row at byte offset ro) of a tensor of any type
inline float ld_el(cbuf* b, const td_t* t, long ro, long i0) {
    int bs = blck(t->ty);
    if (bs == 1) return ld_f(b, ro + i0 * t->nb[0], t->ty);
    return ld_q(b + ro + (i0 / bs) * t->nb[0], (int)(i0 % bs), t->ty);
}

inline float ld_at(cbuf* b, const td_t* t, const long* ix) {
    return ld_el(b, t, row_off(t, ix[1], ix[2], ix[3]), ix[0]);
}

inline long at(const td_t* t, const long* ix) {
    return row_off(t, ix[1], ix[2], ix[3]) + ix[0] * t->nb[0];
}

// quantize 32 values into one Q8_0 / Q4_0 block (ggml's reference quantizers)
inline void quant_block(gbuf* blk, const float* x, int ty) {
    if (ty == T_Q8_0) {
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) amax = fmax(amax, fabs(x[j]));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        vstore_half_rte(d, 0, (__global half*)blk);
        for (int j = 0; j < 32; ++j) ((__global char*)blk)[2 + j] = (char)round(x[j] * id);
        return;
    }
    float amax = 0.0f, mx = 0.0f;
    for (int j = 0; j < 32; ++j) {
        if (amax < fabs(x[j])) {
            amax = fabs(x[j]);
            mx = x[j];
        }
    }
    float d = mx / -8.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    vstore_half_rte(d, 0, (__global half*)blk);
    for (int j = 0; j < 16; ++j) {
        int a = min(15, (int)(char)(x[j] * id + 8.5f));
        int c = min(15, (int)(char)(x[16 + j] * id + 8.5f));
        blk[2 + j] = (uchar)(a | (c << 4));
    }
}
