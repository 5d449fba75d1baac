// accelplane SYCL plugin: OpenCL C kernels, built once per device with dpctl.program.
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
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q6_K 14
#define T_I32 26
#define T_BF16 30

#define TD_WORDS 10

// bits of a backend's error word (plugin.INDEX_ERRORS): kernels that meet a bad index OR one in
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
    return (ty == T_Q4_0 || ty == T_Q8_0) ? 32 : (ty == T_Q4_K || ty == T_Q6_K) ? 256 : 1;
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

// element j of the block at blk
inline float ld_q(cbuf* blk, int j, int ty) {
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

// --- elementwise ---------------------------------------------------------------------------------
#define U_SQR 0
#define U_SQRT 1
#define U_LOG 2
#define U_SIN 3
#define U_COS 4
#define U_SCALE 5
#define U_CLAMP 6
#define U_LEAKY 7
#define U_ABS 8
#define U_NEG 9
#define U_TANH 10
#define U_RELU 11
#define U_SIGMOID 12
#define U_GELU 13
#define U_GELU_QUICK 14
#define U_SILU 15
#define U_EXP 16

inline float sigmoid_f(float x) { return 1.0f / (1.0f + exp(-x)); }

inline float gelu_f(float x) {
    const float c = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanh(c * x * (1.0f + 0.044715f * x * x)));
}

inline float unary_f(int op, float x, float f0, float f1) {
    switch (op) {
    case U_SQR: return x * x;
    case U_SQRT: return sqrt(x);
    case U_LOG: return log(x);
    case U_SIN: return sin(x);
    case U_COS: return cos(x);
    case U_SCALE: return x * f0 + f1;
    case U_CLAMP: return fmin(fmax(x, f0), f1);
    case U_LEAKY: return x > 0.0f ? x : x * f0;
    case U_ABS: return fabs(x);
    case U_NEG: return -x;
    case U_TANH: return tanh(x);
    case U_RELU: return x > 0.0f ? x : 0.0f;
    case U_SIGMOID: return sigmoid_f(x);
    case U_GELU: return gelu_f(x);
    case U_GELU_QUICK: return x * sigmoid_f(1.702f * x);
    case U_SILU: return x * sigmoid_f(x);
    default: return exp(x);
    }
}

// P: dst, src, op, f0, f1
__kernel void k_unary(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    long ix[4];
    unravel(get_global_id(0), d.ne, ix);
    float x = ld_at(src, &s, ix);
    st_f(dst, at(&d, ix), d.ty, unary_f((int)p[20], x, pf(p, 21), pf(p, 22)));
}

// P: dst, a, b, op (0 add, 1 sub, 2 mul, 3 div); b repeats over a
__kernel void k_binary(params P, ulong pi, gbuf* dst, cbuf* A, cbuf* B) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS), b = td(p + 2 * TD_WORDS);
    long ix[4], jx[4];
    unravel(get_global_id(0), d.ne, ix);
    for (int k = 0; k < 4; ++k) jx[k] = ix[k] % b.ne[k];
    float x = ld_at(A, &a, ix), y = ld_at(B, &b, jx), r;
    switch ((int)p[30]) {
    case 0: r = x + y; break;
    case 1: r = x - y; break;
    case 2: r = x * y; break;
    default: r = x / y;
    }
    st_f(dst, at(&d, ix), d.ty, r);
}

// P: dst, a, b (or a again), op (1 geglu, 2 swiglu), swapped, has_b
__kernel void k_glu(params P, ulong pi, gbuf* dst, cbuf* A, cbuf* B) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS), b = td(p + 2 * TD_WORDS);
    int op = (int)p[30], swapped = (int)p[31], has_b = (int)p[32];
    long ix[4];
    unravel(get_global_id(0), d.ne, ix);
    float x, g;
    if (has_b) {
        x = ld_at(A, &a, ix);
        g = ld_at(B, &b, ix);
    } else {
        long ro = row_off(&a, ix[1], ix[2], ix[3]), nc = d.ne[0];
        x = ld_el(A, &a, ro, ix[0] + (swapped ? nc : 0));
        g = ld_el(A, &a, ro, ix[0] + (swapped ? 0 : nc));
    }
    float act = op == 1 ? gelu_f(x) : x * sigmoid_f(x);
    st_f(dst, at(&d, ix), d.ty, act * g);
}

// --- copies ----------------------------------------------------------------------------------------
// P: dst, src. dst element i = src element i in row-major order (ne may differ, as CPY allows)
__kernel void k_cpy(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    long i = get_global_id(0), ix[4], jx[4];
    unravel(i, d.ne, ix);
    unravel(i, s.ne, jx);
    if (s.ty == d.ty) copy_el(dst, at(&d, ix), src, at(&s, jx), d.ty);  // exact, any bits
    else st_f(dst, at(&d, ix), d.ty, ld_at(src, &s, jx));
}

// P: dst (Q8_0 / Q4_0), src. one work-item per dst block of 32
__kernel void k_cpy_q(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    long e = get_global_id(0) * 32, ix[4], jx[4];
    float x[32];
    for (int j = 0; j < 32; ++j) {
        unravel(e + j, s.ne, jx);
        x[j] = ld_at(src, &s, jx);
    }
    unravel(e, d.ne, ix);
    quant_block(dst + row_off(&d, ix[1], ix[2], ix[3]) + (ix[0] / 32) * d.nb[0], x, d.ty);
}

// P: dst, src of the same block type. one work-item per block
__kernel void k_copy_blocks(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    int bs = blck(d.ty);
    long e = get_global_id(0) * bs, ix[4], jx[4];
    unravel(e, d.ne, ix);
    unravel(e, s.ne, jx);
    gbuf* o = dst + row_off(&d, ix[1], ix[2], ix[3]) + (ix[0] / bs) * d.nb[0];
    cbuf* q = src + row_off(&s, jx[1], jx[2], jx[3]) + (jx[0] / bs) * s.nb[0];
    for (long k = 0; k < d.nb[0]; ++k) o[k] = q[k];
}

// P: dst, a, b, dim. a and b have dst's type
__kernel void k_concat(params P, ulong pi, gbuf* dst, cbuf* A, cbuf* B) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS), b = td(p + 2 * TD_WORDS);
    int dim = (int)p[30];
    long ix[4];
    unravel(get_global_id(0), d.ne, ix);
    long od = at(&d, ix);
    if (ix[dim] < a.ne[dim]) {
        copy_el(dst, od, A, at(&a, ix), d.ty);
    } else {
        ix[dim] -= a.ne[dim];
        copy_el(dst, od, B, at(&b, ix), d.ty);
    }
}

// --- rows ----------------------------------------------------------------------------------------
// P: dst, a, idx. dst[i0, i1, i2, i3] = a[i0, idx[i1, i2, i3], i2, i3]
__kernel void k_get_rows(params P, ulong pi, gbuf* dst, cbuf* A, cbuf* I, errw err) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS), x = td(p + 2 * TD_WORDS);
    long ix[4];
    unravel(get_global_id(0), d.ne, ix);
    long r = *(__global const int*)(I + row_off(&x, ix[2], ix[3], 0) + ix[1] * x.nb[0]);
    long od = at(&d, ix);
    if (r < 0 || r >= a.ne[1]) {  // out of range: no stray read; NaN (0 for I32) and the error bit
        st_f(dst, od, d.ty, d.ty == T_I32 ? 0.0f : NAN);
        report_error(err, ERR_GET_ROWS);
        return;
    }
    long ro = row_off(&a, r, ix[2], ix[3]);
    if (a.ty == d.ty) copy_el(dst, od, A, ro + ix[0] * a.nb[0], d.ty);
    else st_f(dst, od, d.ty, ld_el(A, &a, ro, ix[0]));
}

// P: dst, src, idx. dst[:, idx[i1, i2 % c1, i3 % c2], i2, i3] = src[:, i1, i2, i3]; one work-item
// per (element or block of a row, i2, i3) walks the rows in order, so a repeated row's last
// write wins, as in ggml. An index out of range writes nothing and sets the error bit
__kernel void k_set_rows(params P, ulong pi, gbuf* dst, cbuf* S, cbuf* I, errw err) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS), x = td(p + 2 * TD_WORDS);
    int bs = blck(d.ty);
    long g = get_global_id(0), per_row = s.ne[0] / bs;
    long c = g % per_row, i2 = (g / per_row) % s.ne[2], i3 = g / per_row / s.ne[2];
    for (long i1 = 0; i1 < s.ne[1]; ++i1) {
        long r = *(__global const int*)(I + row_off(&x, i2 % x.ne[1], i3 % x.ne[2], 0) + i1 * x.nb[0]);
        if (r < 0 || r >= d.ne[1]) {
            report_error(err, ERR_SET_ROWS);
            continue;
        }
        long so = row_off(&s, i1, i2, i3), dro = row_off(&d, r, i2, i3);
        if (bs == 1) {
            st_f(dst, dro + c * d.nb[0], d.ty, ld_el(S, &s, so, c));
        } else {
            float v[32];
            for (int j = 0; j < 32; ++j) v[j] = ld_el(S, &s, so, c * 32 + j);
            quant_block(dst + dro + c * d.nb[0], v, d.ty);
        }
    }
}

// --- row-wise ------------------------------------------------------------------------------------
// P: dst, src, op (0 norm, 1 rms_norm, 2 l2_norm), eps. one work-item per row
__kernel void k_norm(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    int op = (int)p[20];
    acc_t eps = pf(p, 21);
    long ix[4];
    unravel(get_global_id(0) * s.ne[0], s.ne, ix);
    long so = row_off(&s, ix[1], ix[2], ix[3]), dro = row_off(&d, ix[1], ix[2], ix[3]);
    long n = s.ne[0];
    acc_t mean = 0;
    if (op == 0) {
        for (long i = 0; i < n; ++i) mean += ld_el(src, &s, so, i);
        mean /= n;
    }
    acc_t ss = 0;
    for (long i = 0; i < n; ++i) {
        acc_t v = ld_el(src, &s, so, i) - mean;
        ss += v * v;
    }
    acc_t scale = op == 2 ? 1 / fmax(sqrt(ss), eps) : 1 / sqrt(ss / n + eps);
    for (long i = 0; i < n; ++i) {
        st_f(dst, dro + i * d.nb[0], d.ty, (float)((ld_el(src, &s, so, i) - mean) * scale));
    }
}

// P: dst, a, mask, has_mask, scale, max_bias, n_head_log2, m0, m1. one work-item per row
__kernel void k_soft_max(params P, ulong pi, gbuf* dst, cbuf* A, cbuf* M) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS), m = td(p + 2 * TD_WORDS);
    int has_mask = (int)p[30];
    float scale = pf(p, 31), max_bias = pf(p, 32);
    long n_head_log2 = p[33];
    float m0 = pf(p, 34), m1 = pf(p, 35);
    long ix[4];
    unravel(get_global_id(0) * a.ne[0], a.ne, ix);
    long ao = row_off(&a, ix[1], ix[2], ix[3]), dro = row_off(&d, ix[1], ix[2], ix[3]);
    long mo = has_mask ? row_off(&m, ix[1], ix[2] % m.ne[2], ix[3] % m.ne[3]) : 0;
    float slope = 1.0f;
    if (max_bias > 0.0f) {
        long h = ix[2];
        slope = h < n_head_log2 ? pown(m0, (int)(h + 1)) : pown(m1, (int)(2 * (h - n_head_log2) + 1));
    }
    long n = a.ne[0];
    float mx = -INFINITY;
    for (long i = 0; i < n; ++i) {
        float v = ld_el(A, &a, ao, i) * scale + (has_mask ? slope * ld_el(M, &m, mo, i) : 0.0f);
        mx = fmax(mx, v);
    }
    acc_t sum = 0;
    for (long i = 0; i < n; ++i) {
        float v = ld_el(A, &a, ao, i) * scale + (has_mask ? slope * ld_el(M, &m, mo, i) : 0.0f);
        float e = exp(v - mx);
        sum += e;
        st_f(dst, dro + i * d.nb[0], T_F32, e);  // dst is F32; rows of a are read before written
    }
    float inv = (float)(1 / sum);
    for (long i = 0; i < n; ++i) {
        long o = dro + i * d.nb[0];
        *(__global float*)(dst + o) *= inv;
    }
}

// P: dst, a, pos, n_dims, mode, freq_base, freq_scale, ext_factor, mscale (attn_factor with
// YaRN's factor), corr0, corr1. one work-item per pair of elements (i, i + step) of a row
__kernel void k_rope(params P, ulong pi, gbuf* dst, cbuf* A, cbuf* POS) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS), ps = td(p + 2 * TD_WORDS);
    long n_dims = p[30];
    int neox = p[31] == 2;
    acc_t freq_base = pf(p, 32), freq_scale = pf(p, 33), ext = pf(p, 34), mscale = pf(p, 35);
    acc_t corr0 = pf(p, 36), corr1 = pf(p, 37);
    long half_row = (a.ne[0] + 1) / 2, g = get_global_id(0);
    long k = g % half_row, r = g / half_row;
    long i1 = r % a.ne[1], i2 = (r / a.ne[1]) % a.ne[2], i3 = r / a.ne[1] / a.ne[2];
    long ao = row_off(&a, i1, i2, i3), dro = row_off(&d, i1, i2, i3);
    if (2 * k >= n_dims) {  // past the rotated dims: copy the two elements through
        for (long i = 2 * k; i < min(2 * k + 2, a.ne[0]); ++i) {
            st_f(dst, dro + i * d.nb[0], d.ty, ld_el(A, &a, ao, i));
        }
        return;
    }
    long e0 = neox ? k : 2 * k, e1 = neox ? k + n_dims / 2 : 2 * k + 1;
    acc_t pos = (acc_t)*(__global const int*)(POS + ps.off + i2 * ps.nb[0]);
    acc_t theta_extrap = pos * pow(freq_base, -2 * (acc_t)k / n_dims);
    acc_t theta = freq_scale * theta_extrap;
    if (ext != 0) {
        acc_t y = ((acc_t)k - corr0) / fmax((acc_t)0.001, corr1 - corr0);
        acc_t ramp = (1 - fmin((acc_t)1, fmax((acc_t)0, y))) * ext;
        theta = theta * (1 - ramp) + theta_extrap * ramp;
    }
    float c = (float)(cos(theta) * mscale), s = (float)(sin(theta) * mscale);
    float x0 = ld_el(A, &a, ao, e0), x1 = ld_el(A, &a, ao, e1);
    st_f(dst, dro + e0 * d.nb[0], d.ty, x0 * c - x1 * s);
    st_f(dst, dro + e1 * d.nb[0], d.ty, x0 * s + x1 * c);
}

// --- matrix products -------------------------------------------------------------------------------
// dot product of row ao of a (any type) and row bo of b (F32/F16, element stride bnb0) over k
inline acc_t dot_row(cbuf* A, const td_t* a, long ao, cbuf* B, const td_t* b, long bo) {
    long k = a->ne[0];
    int bs = blck(a->ty);
    acc_t sum = 0;
    if (bs == 1) {
        for (long i = 0; i < k; ++i) sum += ld_f(A, ao + i * a->nb[0], a->ty) * ld_f(B, bo + i * b->nb[0], b->ty);
        return sum;
    }
    for (long blk = 0; blk < k / bs; ++blk) {
        cbuf* q = A + ao + blk * a->nb[0];
        float part = 0.0f;
        for (int j = 0; j < bs; ++j) part += ld_q(q, j, a->ty) * ld_f(B, bo + (blk * bs + j) * b->nb[0], b->ty);
        sum += part;
    }
    return sum;
}

// P: dst, a, b. dst[m, n, i2, i3] = a[:, m, i2 / r2, i3 / r3] . b[:, n, i2, i3]
__kernel void k_mul_mat(params P, ulong pi, gbuf* dst, cbuf* A, cbuf* B) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS), b = td(p + 2 * TD_WORDS);
    long ix[4];
    unravel(get_global_id(0), d.ne, ix);
    long r2 = b.ne[2] / a.ne[2], r3 = b.ne[3] / a.ne[3];
    long ao = row_off(&a, ix[0], ix[2] / r2, ix[3] / r3), bo = row_off(&b, ix[1], ix[2], ix[3]);
    *(__global float*)(dst + at(&d, ix)) = (float)dot_row(A, &a, ao, B, &b, bo);
}

// P: dst, as, b, ids. dst[m, u, t] = as[:, m, ids[u, t]] . b[:, u % b.ne1, t]; an expert id out
// of range reads nothing, writes NaN and sets the error bit
__kernel void k_mul_mat_id(params P, ulong pi, gbuf* dst, cbuf* A, cbuf* B, cbuf* I, errw err) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS), b = td(p + 2 * TD_WORDS), x = td(p + 3 * TD_WORDS);
    long ix[4];
    unravel(get_global_id(0), d.ne, ix);
    long e = *(__global const int*)(I + x.off + ix[1] * x.nb[0] + ix[2] * x.nb[1]);
    long od = at(&d, ix);
    if (e < 0 || e >= a.ne[2]) {
        *(__global float*)(dst + od) = NAN;
        report_error(err, ERR_MUL_MAT_ID);
        return;
    }
    long ao = row_off(&a, ix[0], e, 0), bo = row_off(&b, ix[1] % b.ne[1], ix[2], 0);
    *(__global float*)(dst + od) = (float)dot_row(A, &a, ao, B, &b, bo);
}

// --- reductions ------------------------------------------------------------------------------------
// P: dst (F32), src, mean. one work-item per row
__kernel void k_sum_rows(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    long ix[4];
    unravel(get_global_id(0) * s.ne[0], s.ne, ix);
    long so = row_off(&s, ix[1], ix[2], ix[3]);
    acc_t sum = 0;
    for (long i = 0; i < s.ne[0]; ++i) sum += ld_el(src, &s, so, i);
    if (p[20]) sum /= s.ne[0];
    *(__global float*)(dst + row_off(&d, ix[1], ix[2], ix[3])) = (float)sum;
}

#define SUM_WG 64
// P: dst (1 element, F32), src. one work-group of SUM_WG
__kernel void k_sum(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    __local acc_t part[SUM_WG];
    int l = get_local_id(0);
    acc_t sum = 0;
    long n = nel(&s), ix[4];
    for (long i = l; i < n; i += SUM_WG) {
        unravel(i, s.ne, ix);
        sum += ld_at(src, &s, ix);
    }
    part[l] = sum;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (l == 0) {
        acc_t t = 0;
        for (int i = 0; i < SUM_WG; ++i) t += part[i];
        *(__global float*)(dst + d.off) = (float)t;
    }
}

// P: dst (I32), src (F32 matrix). first index of the row maximum
__kernel void k_argmax(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    long r = get_global_id(0), so = row_off(&s, r, 0, 0);
    float best = -INFINITY;
    int arg = 0;
    for (long i = 0; i < s.ne[0]; ++i) {
        float v = ld_el(src, &s, so, i);
        if (v > best) {
            best = v;
            arg = (int)i;
        }
    }
    *(__global int*)(dst + d.off + r * d.nb[0]) = arg;
}

// P: dst (I32), src (F32), desc. one work-item per element: its stable rank in the row
__kernel void k_argsort(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    int desc = (int)p[20];
    long ix[4];
    unravel(get_global_id(0), s.ne, ix);
    long so = row_off(&s, ix[1], ix[2], ix[3]), i = ix[0];
    float x = ld_el(src, &s, so, i);
    long rank = 0;
    for (long j = 0; j < s.ne[0]; ++j) {
        float y = ld_el(src, &s, so, j);
        rank += (desc ? y > x : y < x) || (y == x && j < i);
    }
    *(__global int*)(dst + row_off(&d, ix[1], ix[2], ix[3]) + rank * d.nb[0]) = (int)i;
}

// --- convolution helpers -----------------------------------------------------------------------------
// P: dst, x, s0, s1, p0, p1, d0, d1, is_2d, kh, kw. dst[(c, kh, kw), ow, oh, n] (2-D) or
// [(c, kw), ow, n] (1-D), zero outside the input
__kernel void k_im2col(params P, ulong pi, gbuf* dst, cbuf* X) {
    params p = P + pi;
    td_t d = td(p), x = td(p + TD_WORDS);
    long s0 = p[20], s1 = p[21], p0 = p[22], p1 = p[23], d0 = p[24], d1 = p[25];
    int is_2d = (int)p[26];
    long kh_n = p[27], kw_n = p[28];
    long ix[4];
    unravel(get_global_id(0), d.ne, ix);
    long c = ix[0] / (kh_n * kw_n), kh = (ix[0] / kw_n) % kh_n, kw = ix[0] % kw_n;
    long ow = ix[1], oh = is_2d ? ix[2] : 0, n = is_2d ? ix[3] : ix[2];
    long iy = oh * s1 + kh * d1 - p1, ixx = ow * s0 + kw * d0 - p0;
    float v = 0.0f;
    long h = is_2d ? x.ne[1] : 1;
    if (iy >= 0 && iy < h && ixx >= 0 && ixx < x.ne[0]) {
        long jx[4] = {ixx, is_2d ? iy : c, is_2d ? c : n, is_2d ? n : 0};
        v = ld_at(X, &x, jx);
    }
    st_f(dst, at(&d, ix), d.ty, v);
}

// P: dst, a, s0, oc, p0. dst[t, c, b] = sum over i, k with t + p0 == i*s0 + k of a[c*K + k, i, b]
__kernel void k_col2im_1d(params P, ulong pi, gbuf* dst, cbuf* A) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS);
    long s0 = p[20], oc = p[21], p0 = p[22], kk = a.ne[0] / oc;
    long ix[4];
    unravel(get_global_id(0), d.ne, ix);
    long t = ix[0] + p0, c = ix[1], b = ix[2];
    acc_t sum = 0;
    for (long i = 0; i < a.ne[1]; ++i) {
        long k = t - i * s0;
        if (k >= 0 && k < kk) sum += ld_el(A, &a, row_off(&a, i, b, 0), c * kk + k);
    }
    st_f(dst, at(&d, ix), d.ty, (float)sum);
}

// --- all-reduce pieces (comm.py) --------------------------------------------------------------------
// x[i] += y[i] (F32, n elements at byte offsets)
__kernel void k_add_f32(gbuf* X, ulong xo, cbuf* Y, ulong yo) {
    size_t i = get_global_id(0);
    ((__global float*)(X + xo))[i] += ((__global const float*)(Y + yo))[i];
}

// x[i] += bf16 y[i]
__kernel void k_add_bf16(gbuf* X, ulong xo, cbuf* Y, ulong yo) {
    size_t i = get_global_id(0);
    ((__global float*)(X + xo))[i] += as_float(((uint)((__global const ushort*)(Y + yo))[i]) << 16);
}

// y[i] = bf16(x[i]); with round_own, x[i] = float(y[i]) too (both peers add the same operands)
__kernel void k_to_bf16(gbuf* Y, ulong yo, gbuf* X, ulong xo, int round_own) {
    size_t i = get_global_id(0);
    __global float* x = (__global float*)(X + xo);
    ushort h = f32_to_bf16(x[i]);
    ((__global ushort*)(Y + yo))[i] = h;
    if (round_own) x[i] = as_float(((uint)h) << 16);
}

// --- test support ------------------------------------------------------------------------------------
// a busy loop of n steps (ACCELPLANE_TEST_DELAY_US delays and the plugin's own ordering tests)
__kernel void k_spin(gbuf* out, ulong n) {
    uint x = *(__global uint*)out;  // an LCG from memory: nothing to fold away
    for (ulong i = 0; i < n; ++i) x = x * 1664525u + 1013904223u;
    *(__global uint*)out = x;
}
