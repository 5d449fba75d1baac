/* accelplane CPU kernels (see _kernels.h).
 *
 * Four code paths, chosen at run time (no -march flags at build time, so one wheel runs anywhere):
 *  - AVX-512 F, BW, VL, VNNI and VBMI: the VNNI path, with zmm kernels where they beat it (the
 *    Q4_0 mat-vec in ggml's layout: rows_q4_0_z).
 *  - AVX2+FMA+F16C with AVX-VNNI or AVX512-VNNI+VL: the AVX2 path, its 32-element block types'
 *    dot products (_kernels_q32.h) compiled again with vpdpbusd in place of vpmaddubsw +
 *    vpmaddwd (the same integer sums, one instruction instead of two).
 *  - AVX2+FMA+F16C, compiled per function with __attribute__((target)). Quantized weights are
 *    dotted against activations quantized to int8 (like ggml: Q8 blocks of 32 for the 32-element
 *    block types, 256-blocks with per-16 sums for the K-quants and IQ4_XS) with vpmaddubsw. Measured on Zen 3, one
 *    thread, W in L2, per 32 weights and activation row: Q4_0 1.14 ns (1 row) / 0.94 ns (4
 *    rows) against 3.8 / 1.63 ns for dequantize-to-float + FMA; Q8_0 1.40 / 1.10 against
 *    2.39 / 1.38 ns. The int8 activation error (NMSE ~1e-5..1e-4 on Gaussian x) is below
 *    ggml's MUL_MAT threshold of 5e-4, and ggml makes the same trade.
 *    Float weights (F32/F16/BF16) are converted in registers and FMA'd against float x.
 *  - portable C: dequantize a chunk of a row to float and dot it with float x.
 * Work is split over M (weight rows) in contiguous chunks handed out dynamically to OpenMP
 * threads; each chunk streams its part of W once and reuses x from cache.
 */
#include "_kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#define AP_X86 1
#include <cpuid.h>
#include <immintrin.h>
#define AP_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define AP_X86 0
#endif

/* The VNNI level needs a compiler that knows the avxvnni target (GCC 11, clang 13); with an
 * older one the level is simply never available. Its vpdpbusd on ymm registers is AVX-VNNI's
 * (VEX) or AVX512-VNNI's with AVX512VL (EVEX: Zen 4, Xeons since Cascade Lake), one compilation
 * each: the EVEX one may use any AVX-512VL encoding, which a CPU without AVX-512 lacks. */
#if AP_X86 && (defined(__clang__) ? __clang_major__ >= 13 : __GNUC__ >= 11)
#define AP_HAVE_VNNI 1
#define AP_AVX2_VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define AP_AVX512_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
#define AP_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")))
#else
#define AP_HAVE_VNNI 0
#endif

#define AP_INLINE static inline __attribute__((always_inline))
#define NR_MAX 4 /* activation rows handled per pass over a weight row */
#define QK 32
#define QKK 256

static int g_isa = AP_ISA_PORTABLE;
static int g_vnni_evex; /* AP_ISA_AVX2_VNNI runs the AVX512-VNNI (EVEX) compilation */
static float g_f16[65536]; /* f16 bits -> f32: the portable path's converter */

/* ---------------------------------------------------------------------------------------------
 * helpers shared by both paths
 */

static float f16_to_f32_sw(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        float f = (float)man * (1.0f / 16777216.0f); /* subnormal: man * 2^-24 */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

/* Unaligned-safe loads: block fields sit at odd offsets (18-byte Q4_0 blocks, any row stride). */
static inline uint16_t ld_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline uint32_t ld_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline float ld_f16(const uint8_t *p) { return g_f16[ld_u16(p)]; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K 6-bit scales/mins of the 8 sub-blocks (ggml's get_scale_min_k4). */
static inline void q4k_scales(const uint8_t *q, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            sc[j] = q[j] & 63;
            mn[j] = q[j + 4] & 63;
        } else {
            sc[j] = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
            mn[j] = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
        }
    }
}

/* Q3_K's 16 6-bit scales, 32 subtracted, from its 12 bytes (ggml's kmask unpacking): low nibbles
 * of bytes 0..7 (scales 0..7) and their high nibbles (8..15); the top two bits of scale j are
 * bits 2(j/4) of byte 8 + j%4. */
static inline void q3k_scales(const uint8_t *p, int8_t sc[16]) {
    uint32_t aux[4];
    memcpy(aux, p, 12);
    const uint32_t tmp = aux[2], m2 = 0x0f0f0f0fu, m1 = 0x03030303u;
    aux[2] = ((aux[0] >> 4) & m2) | (((tmp >> 4) & m1) << 4);
    aux[3] = ((aux[1] >> 4) & m2) | (((tmp >> 6) & m1) << 4);
    aux[0] = (aux[0] & m2) | (((tmp >> 0) & m1) << 4);
    aux[1] = (aux[1] & m2) | (((tmp >> 2) & m1) << 4);
    memcpy(sc, aux, 16);
    for (int j = 0; j < 16; j++) sc[j] = (int8_t)(sc[j] - 32);
}

static int type_info(int type, int64_t *blk, int64_t *bsz) {
    switch (type) {
    case AP_T_F32: *blk = 1; *bsz = 4; return 1;
    case AP_T_F16: *blk = 1; *bsz = 2; return 1;
    case AP_T_BF16: *blk = 1; *bsz = 2; return 1;
    case AP_T_Q4_0: *blk = 32; *bsz = 18; return 1;
    case AP_T_Q4_1: *blk = 32; *bsz = 20; return 1;
    case AP_T_Q5_0: *blk = 32; *bsz = 22; return 1;
    case AP_T_Q5_1: *blk = 32; *bsz = 24; return 1;
    case AP_T_Q8_0: *blk = 32; *bsz = 34; return 1;
    case AP_T_Q2_K: *blk = 256; *bsz = 84; return 1;
    case AP_T_Q3_K: *blk = 256; *bsz = 110; return 1;
    case AP_T_Q4_K: *blk = 256; *bsz = 144; return 1;
    case AP_T_Q5_K: *blk = 256; *bsz = 176; return 1;
    case AP_T_Q6_K: *blk = 256; *bsz = 210; return 1;
    case AP_T_IQ4_NL: *blk = 32; *bsz = 18; return 1;
    case AP_T_IQ4_XS: *blk = 256; *bsz = 136; return 1;
    default: return 0;
    }
}

/* --- the x8 weight layout ---------------------------------------------------------------------
 * Q4_0 and Q8_0 matrices may be stored with 8 rows interleaved per block: group g (rows 8g..8g+7)
 * fills the bytes rows 8g..8g+7 fill in ggml's layout; block b of the group is the 8 rows' f16
 * scales, then their quant bytes in 4-byte words, word c of row r at word c * 8 + r (Q4_0: 4
 * vectors of 32 bytes; low nibbles are elements 4v..4v+3, high ones 16+4v..; Q8_0: 8 vectors).
 * The M % 8 rows after the last group stay as they are. So a group-aligned row range is itself
 * an x8 matrix, and the conversion is a byte permutation (exact for any bytes). */
#define X8_Q4_0 (8 * 18)
#define X8_Q8_0 (8 * 34)

int ap_x8_supported(int type) { return type == AP_T_Q4_0 || type == AP_T_Q8_0; }

/* ggml-layout bytes of row r (< M / 8 * 8) of an x8 matrix (rows rb bytes apart) into out */
static void x8_row(int64_t bsz, const uint8_t *w, int64_t rb, int64_t r, uint8_t *out) {
    const int64_t nb = rb / bsz, nw = (bsz - 2) / 4, lane = r % 8;
    const uint8_t *g = w + (r - lane) * rb;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = g + b * 8 * bsz;
        uint8_t *o = out + b * bsz;
        memcpy(o, p + 2 * lane, 2);
        for (int64_t c = 0; c < nw; c++) memcpy(o + 2 + 4 * c, p + 16 + 4 * (c * 8 + lane), 4);
    }
}

int ap_x8_convert(int type, int to_x8, const void *src_, void *dst_, int64_t M, int64_t K, int64_t size) {
    int64_t blk, bsz;
    if (!ap_x8_supported(type) || !type_info(type, &blk, &bsz)) return AP_ETYPE;
    if (M < 0 || K < 0 || K % blk) return AP_EINVAL;
    const int64_t rb = K / blk * bsz, nb = K / blk, nw = (bsz - 2) / 4;
    int64_t need;
    if (__builtin_mul_overflow(M, rb, &need) || need > size) return AP_ERANGE;
    if (!src_ || !dst_ || src_ == dst_) return AP_EINVAL;
    const uint8_t *src = (const uint8_t *)src_;
    uint8_t *dst = (uint8_t *)dst_;
    const int64_t full = M / 8 * 8;
#pragma omp parallel for schedule(static) if (full * rb > (1 << 22))
    for (int64_t g = 0; g < full / 8; g++) {
        const int64_t base = g * 8 * rb;
        for (int64_t lane = 0; lane < 8; lane++) {
            for (int64_t b = 0; b < nb; b++) {
                const int64_t po = base + b * 8 * bsz, lo = base + lane * rb + b * bsz;
                uint8_t *d = to_x8 ? dst + po + 2 * lane : dst + lo;
                const uint8_t *sp = to_x8 ? src + lo : src + po + 2 * lane;
                memcpy(d, sp, 2);
                for (int64_t c = 0; c < nw; c++) {
                    const int64_t pw = po + 16 + 4 * (c * 8 + lane), lw = lo + 2 + 4 * c;
                    memcpy(dst + (to_x8 ? pw : lw), src + (to_x8 ? lw : pw), 4);
                }
            }
        }
    }
    memcpy(dst + full * rb, src + full * rb, (size_t)((M - full) * rb));
    return AP_OK;
}

/* How the AVX2 path quantizes the activations a weight type is dotted with: not at all (float
 * weights), int8 blocks of 32 with per-block sums (ggml's Q8_0/Q8_1), or one scale per 256 with
 * sums of each 16 (ggml's Q8_K). */
enum { ACT_FLOAT, ACT_Q32, ACT_QK };

static int act_kind(int type) {
    switch (type) {
    case AP_T_Q4_0:
    case AP_T_Q4_1:
    case AP_T_Q5_0:
    case AP_T_Q5_1:
    case AP_T_Q8_0:
    case AP_T_IQ4_NL: return ACT_Q32;
    case AP_T_Q2_K:
    case AP_T_Q3_K:
    case AP_T_Q4_K:
    case AP_T_Q5_K:
    case AP_T_Q6_K:
    case AP_T_IQ4_XS: return ACT_QK;
    default: return ACT_FLOAT;
    }
}

/* Dequantize `n` blocks (elements, for float types) starting at src into y. */
typedef void (*deq_fn)(const uint8_t *src, int64_t n, float *y);

/* ---------------------------------------------------------------------------------------------
 * portable dequantizers
 */

static void deq_f32_pt(const uint8_t *s, int64_t n, float *y) { memcpy(y, s, (size_t)n * 4); }

static void deq_f16_pt(const uint8_t *s, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = ld_f16(s + 2 * i);
}

static void deq_bf16_pt(const uint8_t *s, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = bf16_to_f32(ld_u16(s + 2 * i));
}

static void deq_q4_0_pt(const uint8_t *s, int64_t nb, float *y) {
    for (int64_t i = 0; i < nb; i++, s += 18, y += QK) {
        const float d = ld_f16(s);
        const uint8_t *q = s + 2;
        for (int j = 0; j < 16; j++) {
            y[j] = (float)((q[j] & 0xF) - 8) * d;
            y[j + 16] = (float)((q[j] >> 4) - 8) * d;
        }
    }
}

static void deq_q4_1_pt(const uint8_t *s, int64_t nb, float *y) {
    for (int64_t i = 0; i < nb; i++, s += 20, y += QK) {
        const float d = ld_f16(s), m = ld_f16(s + 2);
        const uint8_t *q = s + 4;
        for (int j = 0; j < 16; j++) {
            y[j] = (float)(q[j] & 0xF) * d + m;
            y[j + 16] = (float)(q[j] >> 4) * d + m;
        }
    }
}

/* Q5_0 / Q5_1: element j's fifth bit is bit j of the little-endian qh word */
static void deq_q5_pt(const uint8_t *s, int64_t nb, float *y, int64_t bsz) {
    const int has_min = bsz == 24;
    for (int64_t i = 0; i < nb; i++, s += bsz, y += QK) {
        const float d = ld_f16(s), m = has_min ? ld_f16(s + 2) : 0.0f;
        const uint32_t qh = ld_u32(s + 2 + 2 * has_min);
        const uint8_t *q = s + 6 + 2 * has_min;
        for (int j = 0; j < 16; j++) {
            const int x0 = (q[j] & 0xF) | (int)(((qh >> j) & 1) << 4);
            const int x1 = (q[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            if (has_min) {
                y[j] = (float)x0 * d + m;
                y[j + 16] = (float)x1 * d + m;
            } else {
                y[j] = (float)(x0 - 16) * d;
                y[j + 16] = (float)(x1 - 16) * d;
            }
        }
    }
}

static void deq_q5_0_pt(const uint8_t *s, int64_t nb, float *y) { deq_q5_pt(s, nb, y, 22); }
static void deq_q5_1_pt(const uint8_t *s, int64_t nb, float *y) { deq_q5_pt(s, nb, y, 24); }

static void deq_q8_0_pt(const uint8_t *s, int64_t nb, float *y) {
    for (int64_t i = 0; i < nb; i++, s += 34, y += QK) {
        const float d = ld_f16(s);
        const int8_t *q = (const int8_t *)(s + 2);
        for (int j = 0; j < QK; j++) y[j] = (float)q[j] * d;
    }
}

static void deq_q4_K_pt(const uint8_t *s, int64_t nb, float *y) {
    for (int64_t i = 0; i < nb; i++, s += 144) {
        const float d = ld_f16(s), dmin = ld_f16(s + 2);
        uint8_t sc[8], mn[8];
        q4k_scales(s + 4, sc, mn);
        const uint8_t *q = s + 16;
        for (int j = 0; j < 4; j++, q += 32) {
            const float d1 = d * sc[2 * j], m1 = dmin * mn[2 * j];
            const float d2 = d * sc[2 * j + 1], m2 = dmin * mn[2 * j + 1];
            for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
        }
    }
}

static void deq_q2_K_pt(const uint8_t *s, int64_t nb, float *y) {
    for (int64_t i = 0; i < nb; i++, s += 84) {
        const float d = ld_f16(s + 80), dmin = ld_f16(s + 82);
        const uint8_t *q = s + 16;
        int is = 0;
        /* 128 elements per 32 bytes of q: shift 2k takes elements 32k.., 16 per scale byte */
        for (int h = 0; h < 2; h++, q += 32)
            for (int shift = 0; shift < 8; shift += 2)
                for (int half = 0; half < 2; half++, is++) {
                    const float dl = d * (float)(s[is] & 0xF), ml = dmin * (float)(s[is] >> 4);
                    for (int l = 0; l < 16; l++)
                        *y++ = dl * (float)((q[16 * half + l] >> shift) & 3) - ml;
                }
    }
}

static void deq_q3_K_pt(const uint8_t *s, int64_t nb, float *y) {
    for (int64_t i = 0; i < nb; i++, s += 110) {
        const float d = ld_f16(s + 108);
        int8_t sc[16];
        q3k_scales(s + 96, sc);
        const uint8_t *hm = s, *q = s + 32;
        int is = 0, bit = 0;
        /* as Q2_K, the third bit of element 32b + l (b = 0..7) in bit b of hmask[l] (set: no -4) */
        for (int h = 0; h < 2; h++, q += 32)
            for (int shift = 0; shift < 8; shift += 2, bit++)
                for (int half = 0; half < 2; half++, is++) {
                    const float dl = d * (float)sc[is];
                    for (int l = 16 * half; l < 16 * half + 16; l++) {
                        const int v = ((q[l] >> shift) & 3) - (((hm[l] >> bit) & 1) ? 0 : 4);
                        *y++ = dl * (float)v;
                    }
                }
    }
}

static void deq_q5_K_pt(const uint8_t *s, int64_t nb, float *y) {
    for (int64_t i = 0; i < nb; i++, s += 176) {
        const float d = ld_f16(s), dmin = ld_f16(s + 2);
        uint8_t sc[8], mn[8];
        q4k_scales(s + 4, sc, mn);
        const uint8_t *qh = s + 16, *ql = s + 48;
        /* as Q4_K, the fifth bit of sub-block j's element l in bit j of qh[l] */
        for (int j = 0; j < 4; j++, ql += 32) {
            const float d1 = d * sc[2 * j], m1 = dmin * mn[2 * j];
            const float d2 = d * sc[2 * j + 1], m2 = dmin * mn[2 * j + 1];
            for (int l = 0; l < 32; l++)
                *y++ = d1 * (float)((ql[l] & 0xF) | (((qh[l] >> (2 * j)) & 1) << 4)) - m1;
            for (int l = 0; l < 32; l++)
                *y++ = d2 * (float)((ql[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4)) - m2;
        }
    }
}

static void deq_q6_K_pt(const uint8_t *s, int64_t nb, float *y) {
    for (int64_t i = 0; i < nb; i++, s += 210) {
        const float d = ld_f16(s + 208);
        const int8_t *sc = (const int8_t *)(s + 192);
        for (int h = 0; h < 2; h++, y += 128) {
            const uint8_t *ql = s + 64 * h, *qh = s + 128 + 32 * h;
            /* 4 groups of 32 outputs: group g takes nibble g/2 of ql[l + 32 (g%2)] and bits
             * 2g..2g+1 of qh[l]; 16 outputs share a scale. Loops over l vectorize. */
            for (int g = 0; g < 4; g++) {
                const uint8_t *qlg = ql + 32 * (g & 1);
                const int nshift = 4 * (g >> 1), hshift = 2 * g;
                for (int half = 0; half < 2; half++) {
                    const float dd = d * (float)sc[8 * h + 2 * g + half];
                    for (int l = 16 * half; l < 16 * half + 16; l++) {
                        const int q = ((qlg[l] >> nshift) & 0xF) | (((qh[l] >> hshift) & 3) << 4);
                        y[32 * g + l] = dd * (float)(q - 32);
                    }
                }
            }
        }
    }
}

/* IQ4_NL / IQ4_XS: 4-bit indices into ggml's kvalues_iq4nl */
static const int8_t k_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

static void deq_iq4_nl_pt(const uint8_t *s, int64_t nb, float *y) {
    for (int64_t i = 0; i < nb; i++, s += 18, y += 32) {
        const float d = ld_f16(s);
        for (int l = 0; l < 16; l++) {
            y[l] = d * (float)k_iq4nl[s[2 + l] & 0xF];
            y[l + 16] = d * (float)k_iq4nl[s[2 + l] >> 4];
        }
    }
}

/* IQ4_XS's 6-bit scale of sub-block j, 32 subtracted: low nibble from scales_l[j / 2], top two
 * bits at 2j of scales_h */
static inline int iq4xs_scale(const uint8_t *blk, int j) {
    return (((blk[4 + j / 2] >> 4 * (j % 2)) & 0xF) | (((ld_u16(blk + 2) >> 2 * j) & 3) << 4)) - 32;
}

static void deq_iq4_xs_pt(const uint8_t *s, int64_t nb, float *y) {
    for (int64_t i = 0; i < nb; i++, s += 136) {
        const float d = ld_f16(s);
        for (int j = 0; j < 8; j++, y += 32) {
            const float dl = d * (float)iq4xs_scale(s, j);
            const uint8_t *q = s + 8 + 16 * j;
            for (int l = 0; l < 16; l++) {
                y[l] = dl * (float)k_iq4nl[q[l] & 0xF];
                y[l + 16] = dl * (float)k_iq4nl[q[l] >> 4];
            }
        }
    }
}

static deq_fn deq_portable(int type) {
    switch (type) {
    case AP_T_F32: return deq_f32_pt;
    case AP_T_F16: return deq_f16_pt;
    case AP_T_BF16: return deq_bf16_pt;
    case AP_T_Q4_0: return deq_q4_0_pt;
    case AP_T_Q4_1: return deq_q4_1_pt;
    case AP_T_Q5_0: return deq_q5_0_pt;
    case AP_T_Q5_1: return deq_q5_1_pt;
    case AP_T_Q8_0: return deq_q8_0_pt;
    case AP_T_Q2_K: return deq_q2_K_pt;
    case AP_T_Q3_K: return deq_q3_K_pt;
    case AP_T_Q4_K: return deq_q4_K_pt;
    case AP_T_Q5_K: return deq_q5_K_pt;
    case AP_T_Q6_K: return deq_q6_K_pt;
    case AP_T_IQ4_NL: return deq_iq4_nl_pt;
    case AP_T_IQ4_XS: return deq_iq4_xs_pt;
    default: return NULL;
    }
}

/* Portable mat-mul over weight rows [m0, m1): dequantize 256 elements of a row to float, then dot
 * them with up to NR_MAX activation rows; chunk sums are accumulated in double. */
static void mm_rows_portable(int type, const uint8_t *w, int64_t ws, int64_t m0, int64_t m1,
                             int64_t K, const float *x, int64_t xs, int64_t N, float *y,
                             int64_t ys) {
    int64_t blk = 1, bsz = 4;
    type_info(type, &blk, &bsz);
    const deq_fn deq = deq_portable(type);
    float tmp[QKK];
    for (int64_t m = m0; m < m1; m++) {
        const uint8_t *row = w + m * ws;
        for (int64_t r0 = 0; r0 < N; r0 += NR_MAX) {
            const int nr = (int)(N - r0 < NR_MAX ? N - r0 : NR_MAX);
            double acc[NR_MAX] = {0};
            for (int64_t k0 = 0; k0 < K; k0 += QKK) {
                const int64_t n = K - k0 < QKK ? K - k0 : QKK;
                deq(row + k0 / blk * bsz, n / blk, tmp);
                for (int r = 0; r < nr; r++) {
                    const float *xr = x + (r0 + r) * xs + k0;
                    float part[8] = {0};
                    int64_t i = 0;
                    for (; i + 8 <= n; i += 8)
                        for (int j = 0; j < 8; j++) part[j] += tmp[i + j] * xr[i + j];
                    float s = 0;
                    for (; i < n; i++) s += tmp[i] * xr[i];
                    for (int j = 0; j < 8; j++) s += part[j];
                    acc[r] += s;
                }
            }
            for (int r = 0; r < nr; r++) y[(r0 + r) * ys + m] = (float)acc[r];
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * AVX2 + FMA + F16C path
 */
#if AP_X86

AP_INLINE AP_AVX2 float hsum_ps(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

AP_INLINE AP_AVX2 int hsum_epi32(__m256i v) {
    __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    a = _mm_add_epi32(a, _mm_unpackhi_epi64(a, a));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 1));
    return _mm_cvtsi128_si32(a);
}

AP_INLINE AP_AVX2 float ld_f16_x(const uint8_t *p) { return _cvtsh_ss(ld_u16(p)); }

/* --- activation quantization -------------------------------------------------------------- */

/* x row -> int8 blocks of 32 with scale d[b] and c[b] = d[b] * sum(q) (for Q4_0's -8 offset). */
static AP_AVX2 void quant_a32(const float *x, int64_t K, int8_t *q, float *d, float *c) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absmask),
                                                _mm256_and_ps(v1, absmask)),
                                  _mm256_max_ps(_mm256_and_ps(v2, absmask),
                                                _mm256_and_ps(v3, absmask)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        /* the scale rounded to f16 as ggml's quantize_row_q8_0 stores it (block_q8_0.d); the
         * elements are scaled by the exact 127 / amax, as ggml does */
        const float dd = _cvtsh_ss(_cvtss_sh(amax / 127.0f, 0)), id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m256 mul = _mm256_set1_ps(id);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, mul));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, mul));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, mul));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, mul));
        const int sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(i0, i1),
                                                    _mm256_add_epi32(i2, i3)));
        i0 = _mm256_packs_epi32(i0, i1);
        i2 = _mm256_packs_epi32(i2, i3);
        i0 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i0, i2), perm);
        _mm256_storeu_si256((__m256i *)(q + b * QK), i0);
        d[b] = dd;
        c[b] = dd * (float)sum;
    }
}

/* x row -> int8 with one scale per 256 elements (ggml's Q8_K) and sums of each 16 elements. */
static AP_AVX2 void quant_ak(const float *x, int64_t K, int8_t *q, float *d, int16_t *bs) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < K / QKK; b++) {
        const float *xb = x + b * QKK;
        __m256 mx = _mm256_setzero_ps();
        for (int j = 0; j < QKK; j += 8)
            mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xb + j), absmask));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const __m256 mul = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        d[b] = amax / 127.0f;
        for (int j = 0; j < QKK; j += 32) {
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j), mul));
            __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8), mul));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 16), mul));
            __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 24), mul));
            bs[(b * QKK + j) / 16] = (int16_t)hsum_epi32(_mm256_add_epi32(i0, i1));
            bs[(b * QKK + j) / 16 + 1] = (int16_t)hsum_epi32(_mm256_add_epi32(i2, i3));
            i0 = _mm256_packs_epi32(i0, i1);
            i2 = _mm256_packs_epi32(i2, i3);
            i0 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i0, i2), perm);
            _mm256_storeu_si256((__m256i *)(q + b * QKK + j), i0);
        }
    }
}

/* Quantized activations of N rows: q [N][K], d [N][nd], c [N][K/32] (A32) or bs [N][K/16]. */
typedef struct {
    int8_t *q;
    float *d;
    float *c;
    int16_t *bs;
    uint8_t *z; /* AP_ISA_AVX512, Q4_0: each row's activations as rows_q4_0_z reads them, or NULL */
    int64_t K, nd;
} act_t;

/* Bytes of a row's z (rows_q4_0_z): 256 per four blocks, 64 more for alignment. Made for rows
 * of up to Z_K_MAX elements: beyond that z crowds the L1 cache the weight rows stream through
 * (Zen 4, K = 14336: slower than the VNNI kernel). */
#define Z_ROW_BYTES(K) ((K) / (4 * QK) * 256 + 64)
#define Z_K_MAX 8192
#define Z_ROW(a, n) ((a)->z + (n) * Z_ROW_BYTES((a)->K))

#if AP_HAVE_VNNI
/* Q4_0 mat-vec with AVX-512 in ggml's layout, four blocks of a row per zmm register: one
 * vpermt2b gathers the four blocks' 16 quant bytes (18-byte blocks, at any alignment) and one
 * vpermw their f16 scales, so the int32 sums are converted and scaled once per four blocks
 * rather than once per block. One row at a time: a second row read alongside (the AVX2 kernels'
 * pairs) halved the rate from memory on Zen 4. The activations are rearranged once per call to
 * match (arrange_z): for every four blocks, 64 bytes pairing the low nibbles' elements (0..15 of
 * each block), 64 the high ones' (16..31), the -8 offset as each int32 lane's starting sum (-8
 * times the sum of the eight activations the lane multiplies), and the blocks' scales, each
 * repeated for its four lanes. */
/* The byte and word indices of the two kernels' permutes, filled once by ap_init (z_tables):
 * the activations of four blocks' low and high nibbles (arrange_z), the quant bytes of four
 * 18-byte blocks from loads at a row's offset and 8 on (blocks 0..2 from the first, 3 from the
 * second), and each block's scale (word 9 j), repeated for its four lanes (rows_q4_0_z). */
static uint8_t g_z_lo[64], g_z_hi[64], g_z_quants[64];
static uint16_t g_z_scales[32];

static void z_tables(void) {
    for (int i = 0; i < 64; i++) {
        g_z_lo[i] = (uint8_t)(32 * (i / 16) + i % 16);
        g_z_hi[i] = (uint8_t)(g_z_lo[i] + 16);
        g_z_quants[i] = (uint8_t)(i < 48 ? 2 + 18 * (i / 16) + i % 16 : 64 + 48 + i % 16);
    }
    for (int i = 0; i < 32; i++) g_z_scales[i] = (uint16_t)(9 * (i / 4 % 4));
}

static AP_AVX512 void arrange_z(const int8_t *q, const float *d, int64_t nb, uint8_t *zraw) {
    uint8_t *z = (uint8_t *)(((uintptr_t)zraw + 63) & ~(uintptr_t)63);
    const __m512i losel = _mm512_loadu_si512(g_z_lo), hisel = _mm512_loadu_si512(g_z_hi);
    const __m512i dsel = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i eight = _mm512_set1_epi8(8);
    for (int64_t b = 0; b + 4 <= nb; b += 4, z += 256) {
        const __m512i x0 = _mm512_loadu_si512(q + b * QK), x1 = _mm512_loadu_si512(q + b * QK + 64);
        const __m512i xl = _mm512_permutex2var_epi8(x0, losel, x1);
        const __m512i xh = _mm512_permutex2var_epi8(x0, hisel, x1);
        const __m512i s8 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), eight, xl), eight, xh);
        _mm512_store_si512(z, xl);
        _mm512_store_si512(z + 64, xh);
        _mm512_store_si512(z + 128, _mm512_sub_epi32(_mm512_setzero_si512(), s8));
        _mm512_store_ps(z + 192, _mm512_permutexvar_ps(dsel, _mm512_castps128_ps512(_mm_loadu_ps(d + b))));
    }
}
#endif

/* Quantize activation rows [n0, n1) for weight type `type` into a. */
static AP_AVX2 void quant_rows(const act_t *a, int type, const float *x, int64_t xs, int64_t N,
                               int64_t n0, int64_t n1) {
    (void)N;
    const int64_t K = a->K;
    for (int64_t n = n0; n < n1; n++) {
        if (act_kind(type) == ACT_QK)
            quant_ak(x + n * xs, K, a->q + n * K, a->d + n * a->nd, a->bs + n * (K / 16));
        else
            quant_a32(x + n * xs, K, a->q + n * K, a->d + n * a->nd, a->c + n * a->nd);
#if AP_HAVE_VNNI
        if (a->z) arrange_z(a->q + n * K, a->d + n * a->nd, K / QK, Z_ROW(a, n));
#endif
    }
}

/* --- int8 dot kernels: one weight row against nr (<= NR_MAX) activation rows ---------------- */

/* The f16 scales of 4 consecutive blocks (bsz bytes apart) as 4 floats: assembled in a
 * general register (integer ALUs are idle here) and converted with one vcvtph2ps, instead of
 * a convert + multiply + broadcast per block on the busy vector pipes. */
AP_INLINE AP_AVX2 __m128 ld_f16x4(const uint8_t *p, int64_t bsz) {
    const uint64_t h = (uint64_t)ld_u16(p) | (uint64_t)ld_u16(p + bsz) << 16 |
                       (uint64_t)ld_u16(p + 2 * bsz) << 32 | (uint64_t)ld_u16(p + 3 * bsz) << 48;
    return _mm_cvtph_ps(_mm_cvtsi64_si128((long long)h));
}

/* 16 bytes of nibbles -> 32 bytes: low nibbles (elements 0..15), then high (16..31) */
AP_INLINE AP_AVX2 __m256i q4_unpack(const uint8_t *qs) {
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_setr_epi64x(0, 0, 4, 4)),
                            _mm256_set1_epi8(0x0F));
}

/* 32 x 5-bit quants: the nibbles of qs (as q4_unpack) with bit j of the little-endian qh word
 * as element j's fifth bit (ggml's bytes_from_bits_32) */
AP_INLINE AP_AVX2 __m256i q5_unpack(const uint8_t *qs, const uint8_t *qh) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i bits = _mm256_shuffle_epi8(_mm256_set1_epi32((int)ld_u32(qh)), shuf);
    bits = _mm256_or_si256(bits, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    bits = _mm256_cmpeq_epi8(bits, _mm256_set1_epi64x(-1));
    return _mm256_or_si256(q4_unpack(qs), _mm256_and_si256(bits, _mm256_set1_epi8(0x10)));
}

/* The 32-element block types with unsigned quants q (0..15 or 0..31), value d * q + c per block:
 * Q4_0 c = -8 d, Q4_1 c = m, Q5_0 c = -16 d, Q5_1 c = m. Against an activation block (scale dx,
 * quants qx): sum (d q + c) dx qx = d dx (sum q qx) + c (dx sum qx), the last factor being the
 * precomputed a->c; c = cmul * (the f16 at coff). Called with a constant type, these fold. */
AP_INLINE int u32_bsz(int type) {
    return type == AP_T_Q4_0 ? 18 : type == AP_T_Q4_1 ? 20 : type == AP_T_Q5_0 ? 22 : 24;
}
AP_INLINE int u32_coff(int type) { return type == AP_T_Q4_0 || type == AP_T_Q5_0 ? 0 : 2; }
AP_INLINE float u32_cmul(int type) {
    return type == AP_T_Q4_0 ? -8.0f : type == AP_T_Q5_0 ? -16.0f : 1.0f;
}
AP_INLINE AP_AVX2 __m256i u32_quants(int type, const uint8_t *blk) {
    switch (type) {
    case AP_T_Q4_0: return q4_unpack(blk + 2);
    case AP_T_Q4_1: return q4_unpack(blk + 4);
    case AP_T_Q5_0: return q5_unpack(blk + 6, blk + 2);
    default: return q5_unpack(blk + 8, blk + 4);
    }
}

/* The 32-element block types with signed quants, value d * q: Q8_0 (int8 quants after d) and
 * IQ4_NL (the nibbles of Q4_0's layout indexing kvalues_iq4nl, looked up with vpshufb). Called
 * with a constant type, these fold. */
AP_INLINE int s32_bsz(int type) { return type == AP_T_Q8_0 ? 34 : 18; }
AP_INLINE AP_AVX2 __m256i s32_quants(int type, const uint8_t *blk) {
    if (type == AP_T_Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)k_iq4nl));
    return _mm256_shuffle_epi8(table, q4_unpack(blk + 2));
}

/* With more activation rows than one pass takes (N > NR_MAX), walk W in blocks of rows that
 * stay in L2 (~96 KiB) and run every group of NR_MAX activation rows over a block, so neither
 * W nor x is streamed from memory more than once. */
static inline int64_t row_block(int64_t N, int64_t rows, int64_t row_bytes) {
    if (N <= NR_MAX) return rows > 0 ? rows : 1;
    const int64_t mb = (96 * 1024) / (row_bytes > 0 ? row_bytes : 1);
    return mb < 1 ? 1 : mb;
}

/* Ask for a whole row ahead of its use (to L2): rows of a few KiB end before the hardware
 * prefetcher has ramped up on them. A prefetch never faults; callers stay inside the matrix. */
#define PREFETCH_ROW_MAX 4096 /* longer rows: the hardware prefetcher does better alone */
AP_INLINE AP_AVX2 void prefetch_row(const uint8_t *p, int64_t nbytes) {
    for (int64_t o = 0; o < nbytes; o += 64) _mm_prefetch((const char *)(p + o), _MM_HINT_T1);
}

/* One function per type so each nr (1..NR_MAX) gets its own unrolled, register-resident copy. */
#define DEF_ROWS_Q(TGT, NAME, DOT, BSZ, BLK)                                                   \
    static TGT void NAME(const uint8_t *w, int64_t ws, int64_t m0, int64_t m1,                 \
                         const act_t *a, int64_t N, float *y, int64_t ys) {                    \
        const int64_t nb = a->K / (BLK), mb = row_block(N, m1 - m0, nb * (BSZ));               \
        const int short_rows = nb * (BSZ) <= PREFETCH_ROW_MAX;                                 \
        float res[NR_MAX];                                                                     \
        for (int64_t mc = m0; mc < m1; mc += mb) {                                             \
            const int64_t me = mc + mb < m1 ? mc + mb : m1;                                    \
            for (int64_t r0 = 0; r0 < N; r0 += NR_MAX) {                                       \
                const int64_t left = N - r0;                                                   \
                const int nr = left < NR_MAX ? (int)left : NR_MAX;                             \
                for (int64_t m = mc; m < me; m++) {                                            \
                    const uint8_t *row = w + m * ws;                                           \
                    if (short_rows && m + 2 < me) prefetch_row(w + (m + 2) * ws, nb * (BSZ));  \
                    switch (nr) {                                                              \
                    case 1: DOT(1, nb, row, a, r0, res); break;                                \
                    case 2: DOT(2, nb, row, a, r0, res); break;                                \
                    case 3: DOT(3, nb, row, a, r0, res); break;                                \
                    default: DOT(4, nb, row, a, r0, res); break;                               \
                    }                                                                          \
                    for (int r = 0; r < nr; r++) y[(r0 + r) * ys + m] = res[r];                \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }


/* N == 1: rows in pairs (dot2_*), a lone row paired with itself, so every row sums in the same
 * order whatever the thread split; DOT2 prefetches the next pair at the same offset */
#define DEF_ROWS_Q_PAIRS(TGT, NAME, ROWS_N, DOT2)                                              \
    static TGT void NAME(const uint8_t *w, int64_t ws, int64_t m0, int64_t m1,                 \
                         const act_t *a, int64_t N, float *y, int64_t ys) {                    \
        if (N != 1) {                                                                          \
            ROWS_N(w, ws, m0, m1, a, N, y, ys);                                                \
            return;                                                                            \
        }                                                                                      \
        float res[2];                                                                          \
        for (int64_t m = m0; m < m1; m += 2) {                                                 \
            const int64_t n0 = m + 2 < m1 ? m + 2 : m, n1 = m + 3 < m1 ? m + 3 : n0;           \
            DOT2(a->K / QK, w + m * ws, w + (m + 1 < m1 ? m + 1 : m) * ws, w + n0 * ws,        \
                 w + n1 * ws, a, res);                                                         \
            y[m] = res[0];                                                                     \
            if (m + 1 < m1) y[m + 1] = res[1];                                                 \
        }                                                                                      \
    }

/* The kernels of the 32-element block types, once per integer-dot level: vpmaddubsw + vpmaddwd
 * (AVX2), and vpdpbusd (AVX-VNNI), which sums the four u8 x s8 products of each int32 lane in one
 * instruction. The operands stay in ranges where vpmaddubsw's int16 pair sums cannot saturate
 * (see _kernels_q32.h), so both levels give the same integer sums. */
typedef void (*rows_q_fn)(const uint8_t *w, int64_t ws, int64_t m0, int64_t m1, const act_t *a,
                          int64_t N, float *y, int64_t ys);

#define Q_TARGET AP_AVX2
#define Q_NAME(n) n
#define Q_DOT4(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
#define Q_DPADD(acc, u, s) _mm256_add_epi32(acc, Q_DOT4(u, s))
#define Q_DOT4_WIDE 0
#include "_kernels_q32.h"
#undef Q_TARGET
#undef Q_NAME
#undef Q_DOT4
#undef Q_DPADD
#undef Q_DOT4_WIDE

#if AP_HAVE_VNNI
#define Q_TARGET AP_AVX2_VNNI
#define Q_NAME(n) n##_vnni
#define Q_DOT4(u, s) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s)
#define Q_DPADD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define Q_DOT4_WIDE 1
#include "_kernels_q32.h"
#undef Q_TARGET
#undef Q_NAME
#undef Q_DOT4
#undef Q_DPADD
#define Q_TARGET AP_AVX512_VNNI
#define Q_NAME(n) n##_vnni512
#define Q_DOT4(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
#define Q_DPADD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#include "_kernels_q32.h"
#undef Q_TARGET
#undef Q_NAME
#undef Q_DOT4
#undef Q_DPADD
#undef Q_DOT4_WIDE
#endif

#if AP_HAVE_VNNI
/* Rows [m0, m1) of a Q4_0 matrix in ggml's layout (see arrange_z); N > 1, and activations
 * without z (K > Z_K_MAX), through the VNNI kernels, which read them as quantized. */
static AP_AVX512 void rows_q4_0_z(const uint8_t *w, int64_t ws, int64_t m0, int64_t m1, const act_t *a,
                                  int64_t N, float *y, int64_t ys) {
    if (N != 1 || !a->z) {
        rows_q32_vnni512(AP_T_Q4_0)(w, ws, m0, m1, a, N, y, ys);
        return;
    }
    const int64_t nb = a->K / QK, nb4 = nb / 4 * 4;
    const __m512i qsel = _mm512_loadu_si512(g_z_quants), dsel = _mm512_loadu_si512(g_z_scales);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const uint8_t *z = (const uint8_t *)(((uintptr_t)a->z + 63) & ~(uintptr_t)63);
    const int8_t *xq = a->q;
    const float *xd = a->d;
    /* rows of up to PREFETCH_ROW_MAX bytes: two rows ahead at the same offset asked for, as they
     * end before the hardware prefetcher has ramped up on them; longer ones: left to it */
    const int short_rows = nb * 18 <= PREFETCH_ROW_MAX;
    for (int64_t m = m0; m < m1; m++) {
        const uint8_t *row = w + m * ws, *next = w + (m + 2 < m1 ? m + 2 : m) * ws;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb4; b += 4) {
            const uint8_t *p = row + b * 18, *za = z + b * 64;
            if (short_rows) {
                _mm_prefetch((const char *)(next + b * 18), _MM_HINT_T0);
                _mm_prefetch((const char *)(next + b * 18 + 64), _MM_HINT_T0);
            }
            const __m512i at0 = _mm512_loadu_si512(p), at8 = _mm512_loadu_si512(p + 8);
            const __m512i qv = _mm512_permutex2var_epi8(at0, qsel, at8);
            __m512i s = _mm512_dpbusd_epi32(_mm512_load_si512(za + 128), _mm512_and_si512(qv, m4),
                                            _mm512_load_si512(za));
            s = _mm512_dpbusd_epi32(s, _mm512_and_si512(_mm512_srli_epi16(qv, 4), m4), _mm512_load_si512(za + 64));
            const __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(dsel, at0)));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_load_ps(za + 192)), acc);
        }
        float r = _mm512_reduce_add_ps(acc);
        for (int64_t b = nb4; b < nb; b++) { /* the last nb % 4 blocks one at a time */
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
            const __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q4_unpack(row + b * 18 + 2), xv);
            const __m256i s8 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(8), xv);
            r += ld_f16_x(row + b * 18) * xd[b] * (float)hsum_epi32(_mm256_sub_epi32(s, s8));
        }
        y[m] = r;
    }
}
#endif

/* Q4_K and Q5_K (the same but for a fifth bit, of sub-block j's element l in bit j of qh[l]):
 * 8 sub-blocks of 32 with 6-bit scales and mins, value d*sc*q - dmin*mn. Against Q8_K
 * activations: d dx sum_j sc_j (sum q qx) - dmin dx sum_j mn_j (sum qx), the sums of qx from
 * the per-16 sums. Called with a constant type, these fold. */
AP_INLINE AP_AVX2 void dot_k_min(const int type, const int nr, int64_t nb, const uint8_t *w,
                                 const act_t *a, int64_t r0, float *out) {
    const int q5 = type == AP_T_Q5_K;
    const int64_t bsz = q5 ? 176 : 144;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m16 = _mm256_set1_epi8(0x10);
    const int8_t *xq[NR_MAX];
    const float *xd[NR_MAX];
    const int16_t *bs[NR_MAX];
    __m256 acc[NR_MAX];
    __m128 macc[NR_MAX];
    for (int r = 0; r < nr; r++) {
        xq[r] = a->q + (r0 + r) * a->K;
        xd[r] = a->d + (r0 + r) * a->nd;
        bs[r] = a->bs + (r0 + r) * (a->K / 16);
        acc[r] = _mm256_setzero_ps();
        macc[r] = _mm_setzero_ps();
    }
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *blk = w + i * bsz;
        const float d = ld_f16_x(blk), dmin = ld_f16_x(blk + 2);
        /* unpack the 12 bytes of 6-bit scales/mins into 8 + 8 bytes (as ggml does) */
        uint32_t u[4];
        memcpy(u, blk + 4, 12);
        u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
        const uint32_t uaux = u[1] & 0x3f3f3f3fu;
        u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
        u[2] = uaux;
        u[0] &= 0x3f3f3f3fu;
        const __m256i scv = _mm256_broadcastsi128_si256(
            _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)u[1], (int)u[0])));
        const __m128i mins = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)u[3], (int)u[2]));
        const uint8_t *qs = blk + (q5 ? 48 : 16);
        const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        __m256i sumi[NR_MAX];
        for (int r = 0; r < nr; r++) sumi[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i qb = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(qb, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4);
            if (q5) { /* bit 2j (2j + 1) of each qh byte to bit 4 */
                lo = _mm256_or_si256(lo, _mm256_and_si256(
                                             _mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * j), 4), m16));
                hi = _mm256_or_si256(hi, _mm256_and_si256(
                                             _mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * j + 1), 4), m16));
            }
            /* broadcast the int16 scales of sub-blocks 2j and 2j+1 (bytes 4j.. of scv) */
            const short pick_lo = (short)(((4 * j + 1) << 8) | (4 * j));
            const short pick_hi = (short)(((4 * j + 3) << 8) | (4 * j + 2));
            const __m256i sl = _mm256_shuffle_epi8(scv, _mm256_set1_epi16(pick_lo));
            const __m256i sh = _mm256_shuffle_epi8(scv, _mm256_set1_epi16(pick_hi));
            for (int r = 0; r < nr; r++) {
                const int8_t *xb = xq[r] + i * QKK + 64 * j;
                const __m256i p0 = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xb)), sl);
                const __m256i p1 = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xb + 32))), sh);
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p0, p1));
            }
        }
        for (int r = 0; r < nr; r++) {
            const float dx = xd[r][i];
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            const __m256i b16 = _mm256_loadu_si256((const __m256i *)(bs[r] + i * 16));
            const __m128i b32 = _mm_hadd_epi16(_mm256_castsi256_si128(b16),
                                               _mm256_extracti128_si256(b16, 1));
            macc[r] = _mm_fmadd_ps(_mm_set1_ps(dmin * dx),
                                   _mm_cvtepi32_ps(_mm_madd_epi16(mins, b32)), macc[r]);
        }
    }
    for (int r = 0; r < nr; r++) {
        __m128 m = _mm_add_ps(macc[r], _mm_movehl_ps(macc[r], macc[r]));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        out[r] = hsum_ps(acc[r]) - _mm_cvtss_f32(m);
    }
}

#define dot_q4_K(...) dot_k_min(AP_T_Q4_K, __VA_ARGS__)
#define dot_q5_K(...) dot_k_min(AP_T_Q5_K, __VA_ARGS__)

/* The int16 scale pair of 32 quants whose first 16 have scale 2g and the rest 2g + 1 of the 8
 * int16 scales in each lane of sch (as in the Q6_K and Q2_K/Q3_K kernels) */
#define SC16_PAIR(sch, g)                                                                      \
    _mm256_shuffle_epi8(sch, _mm256_set_m128i(                                                 \
                                 _mm_set1_epi16((short)(((4 * (g) + 3) << 8) | (4 * (g) + 2))), \
                                 _mm_set1_epi16((short)(((4 * (g) + 1) << 8) | (4 * (g))))))

/* Q2_K (Q3_K): 16 sub-blocks of 16 with 2-bit quants (plus a third bit), 32 bytes of quants per
 * 128 elements, shift 2s taking elements 32s..32s+31. Q2_K: value d*sc*q - dmin*mn, 4-bit scales
 * and mins; against Q8_K activations d dx sum_j sc_j (sum q qx) - dmin dx sum_j mn_j (sum qx).
 * Q3_K: value d*sc*(q + 4 hbit - 4), signed 6-bit scales; the -4 is taken as 4 sc_j sum(qx) up
 * front (the quants stay unsigned for vpmaddubsw). Called with a constant type, these fold. */
AP_INLINE AP_AVX2 void dot_k_low(const int type, const int nr, int64_t nb, const uint8_t *w,
                                 const act_t *a, int64_t r0, float *out) {
    const int q3 = type == AP_T_Q3_K;
    const int64_t bsz = q3 ? 110 : 84;
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const int8_t *xq[NR_MAX];
    const float *xd[NR_MAX];
    const int16_t *bs[NR_MAX];
    __m256 acc[NR_MAX], macc[NR_MAX];
    for (int r = 0; r < nr; r++) {
        xq[r] = a->q + (r0 + r) * a->K;
        xd[r] = a->d + (r0 + r) * a->nd;
        bs[r] = a->bs + (r0 + r) * (a->K / 16);
        acc[r] = macc[r] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *blk = w + i * bsz;
        const uint8_t *qs = blk + (q3 ? 32 : 16);
        const float d = ld_f16_x(blk + (q3 ? 108 : 80));
        __m256i sc16, hm = _mm256_setzero_si256();
        __m256i sumi[NR_MAX];
        if (q3) {
            int8_t sc[16];
            q3k_scales(blk + 96, sc);
            sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
            hm = _mm256_loadu_si256((const __m256i *)blk);
            for (int r = 0; r < nr; r++) { /* -4 sum_j sc_j (sum of x over sub-block j) */
                const __m256i b16 = _mm256_loadu_si256((const __m256i *)(bs[r] + i * 16));
                sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                           _mm256_slli_epi32(_mm256_madd_epi16(sc16, b16), 2));
            }
        } else {
            const __m128i scb = _mm_loadu_si128((const __m128i *)blk);
            const __m128i m4 = _mm_set1_epi8(0x0F);
            sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(scb, m4));
            const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(scb, 4), m4));
            const float dmin = ld_f16_x(blk + 82);
            for (int r = 0; r < nr; r++) {
                const __m256i b16 = _mm256_loadu_si256((const __m256i *)(bs[r] + i * 16));
                macc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * xd[r][i]),
                                          _mm256_cvtepi32_ps(_mm256_madd_epi16(mn16, b16)), macc[r]);
                sumi[r] = _mm256_setzero_si256();
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
            const __m256i sch = _mm256_broadcastsi128_si256(
                h ? _mm256_extracti128_si256(sc16, 1) : _mm256_castsi256_si128(sc16));
            for (int s = 0; s < 4; s++) {
                __m256i q = _mm256_and_si256(_mm256_srli_epi16(qv, 2 * s), m3);
                if (q3) /* bit 4h + s of each hmask byte to bit 2 */
                    q = _mm256_or_si256(q, _mm256_slli_epi16(
                                               _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + s), one), 2));
                const __m256i sp = SC16_PAIR(sch, s);
                for (int r = 0; r < nr; r++) {
                    const __m256i xv =
                        _mm256_loadu_si256((const __m256i *)(xq[r] + i * QKK + 128 * h + 32 * s));
                    sumi[r] = _mm256_add_epi32(
                        sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), sp));
                }
            }
        }
        for (int r = 0; r < nr; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[r][i]), _mm256_cvtepi32_ps(sumi[r]),
                                     acc[r]);
    }
    for (int r = 0; r < nr; r++) out[r] = hsum_ps(acc[r]) - (q3 ? 0.0f : hsum_ps(macc[r]));
}

#define dot_q2_K(...) dot_k_low(AP_T_Q2_K, __VA_ARGS__)
#define dot_q3_K(...) dot_k_low(AP_T_Q3_K, __VA_ARGS__)

AP_INLINE AP_AVX2 void dot_q6_K(const int nr, int64_t nb, const uint8_t *w, const act_t *a,
                                int64_t r0, float *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const int8_t *xq[NR_MAX];
    const float *xd[NR_MAX];
    const int16_t *bs[NR_MAX];
    __m256 acc[NR_MAX];
    for (int r = 0; r < nr; r++) {
        xq[r] = a->q + (r0 + r) * a->K;
        xd[r] = a->d + (r0 + r) * a->nd;
        bs[r] = a->bs + (r0 + r) * (a->K / 16);
        acc[r] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *blk = w + i * 210;
        const float d = ld_f16_x(blk + 208);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        __m256i sumi[NR_MAX];
        /* q is stored +32 (unsigned for maddubs): subtract 32 * sum(scale * x-sums) up front */
        for (int r = 0; r < nr; r++) {
            const __m256i b16 = _mm256_loadu_si256((const __m256i *)(bs[r] + i * 16));
            sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                       _mm256_slli_epi32(_mm256_madd_epi16(sc16, b16), 5));
        }
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
            const __m256i qhv = _mm256_loadu_si256((const __m256i *)qh);
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i q1 = _mm256_or_si256(_mm256_and_si256(ql0, m4),
                                               _mm256_and_si256(_mm256_slli_epi16(qhv, 4), m30));
            const __m256i q2 = _mm256_or_si256(_mm256_and_si256(ql1, m4),
                                               _mm256_and_si256(_mm256_slli_epi16(qhv, 2), m30));
            const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                               _mm256_and_si256(qhv, m30));
            const __m256i q4 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                               _mm256_and_si256(_mm256_srli_epi16(qhv, 2), m30));
            /* scales of this half as int16 in both 128-bit lanes; group g of 32 elements uses
             * scale 2g for its first 16 elements (low lane) and 2g+1 for the rest (high lane) */
            const __m256i sch = _mm256_broadcastsi128_si256(
                _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(blk + 192 + 8 * h))));
            const __m256i s0 = SC16_PAIR(sch, 0), s1 = SC16_PAIR(sch, 1);
            const __m256i s2 = SC16_PAIR(sch, 2), s3 = SC16_PAIR(sch, 3);
            for (int r = 0; r < nr; r++) {
                const int8_t *xb = xq[r] + i * QKK + 128 * h;
#define P6(Q, OFF, S) _mm256_madd_epi16(                                                      \
                   _mm256_maddubs_epi16(Q, _mm256_loadu_si256((const __m256i *)(xb + (OFF)))), S)
                const __m256i p01 = _mm256_add_epi32(P6(q1, 0, s0), P6(q2, 32, s1));
                const __m256i p23 = _mm256_add_epi32(P6(q3, 64, s2), P6(q4, 96, s3));
                const __m256i p = _mm256_add_epi32(p01, p23);
#undef P6
                sumi[r] = _mm256_add_epi32(sumi[r], p);
            }
        }
        for (int r = 0; r < nr; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[r][i]), _mm256_cvtepi32_ps(sumi[r]),
                                     acc[r]);
    }
    for (int r = 0; r < nr; r++) out[r] = hsum_ps(acc[r]);
}

/* IQ4_XS: 8 sub-blocks of 32 with signed 6-bit scales, value d*(ls - 32)*kvalues_iq4nl[q];
 * against Q8_K activations d dx sum_j (ls_j - 32) (sum kv qx): the looked-up quants signed, as
 * dot_s32 multiplies them, each sub-block's int16 pair sums weighted by its scale in vpmaddwd
 * (|pair| <= 2 * 127 * 127, times 32: within int32). */
AP_INLINE AP_AVX2 void dot_iq4_xs(const int nr, int64_t nb, const uint8_t *w, const act_t *a,
                                  int64_t r0, float *out) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)k_iq4nl));
    const int8_t *xq[NR_MAX];
    const float *xd[NR_MAX];
    __m256 acc[NR_MAX];
    for (int r = 0; r < nr; r++) {
        xq[r] = a->q + (r0 + r) * a->K;
        xd[r] = a->d + (r0 + r) * a->nd;
        acc[r] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *blk = w + i * 136;
        const float d = ld_f16_x(blk);
        __m256i sumi[NR_MAX];
        for (int r = 0; r < nr; r++) sumi[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const __m256i qv = _mm256_shuffle_epi8(table, q4_unpack(blk + 8 + 16 * j));
            const __m256i aw = _mm256_sign_epi8(qv, qv);
            const __m256i sc = _mm256_set1_epi16((short)iq4xs_scale(blk, j));
            for (int r = 0; r < nr; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq[r] + i * QKK + 32 * j));
                const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, qv));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p, sc));
            }
        }
        for (int r = 0; r < nr; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[r][i]), _mm256_cvtepi32_ps(sumi[r]),
                                     acc[r]);
    }
    for (int r = 0; r < nr; r++) out[r] = hsum_ps(acc[r]);
}

/* --- float-weight dot kernels (x stays float) ------------------------------------------------ */

AP_INLINE AP_AVX2 __m256 ld8_f32(const uint8_t *p) { return _mm256_loadu_ps((const float *)p); }
AP_INLINE AP_AVX2 __m256 ld8_f16(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
AP_INLINE AP_AVX2 __m256 ld8_bf16(const uint8_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
AP_INLINE AP_AVX2 float ld1_f32(const uint8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}
AP_INLINE AP_AVX2 float ld1_f16(const uint8_t *p) { return _cvtsh_ss(ld_u16(p)); }
AP_INLINE AP_AVX2 float ld1_bf16(const uint8_t *p) { return bf16_to_f32(ld_u16(p)); }

/* U independent accumulators per activation row so the FMA latency (4 cycles) is hidden:
 * 4 for one row, 2 each for more rows (registers run out beyond that). */
#define DEF_DOT_FLOAT(NAME, LD8, LD1, ESZ)                                                     \
    AP_INLINE AP_AVX2 void NAME(const int nr, int64_t K, const uint8_t *w, const float *x,      \
                                int64_t xs, float *out) {                                      \
        const int U = nr == 1 ? 4 : 2;                                                         \
        __m256 acc[NR_MAX][4];                                                                 \
        for (int r = 0; r < nr; r++)                                                           \
            for (int u = 0; u < U; u++) acc[r][u] = _mm256_setzero_ps();                       \
        int64_t k = 0;                                                                         \
        for (; k + 8 * U <= K; k += 8 * U) {                                                   \
            for (int u = 0; u < U; u++) {                                                      \
                const __m256 wv = LD8(w + (k + 8 * u) * (ESZ));                                \
                for (int r = 0; r < nr; r++)                                                   \
                    acc[r][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * xs + k + 8 * u),   \
                                                acc[r][u]);                                    \
            }                                                                                  \
        }                                                                                      \
        for (; k + 8 <= K; k += 8) {                                                           \
            const __m256 wv = LD8(w + k * (ESZ));                                              \
            for (int r = 0; r < nr; r++)                                                       \
                acc[r][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * xs + k), acc[r][0]);   \
        }                                                                                      \
        for (int r = 0; r < nr; r++) {                                                         \
            __m256 t = acc[r][0];                                                              \
            for (int u = 1; u < U; u++) t = _mm256_add_ps(t, acc[r][u]);                       \
            out[r] = hsum_ps(t);                                                               \
        }                                                                                      \
        for (; k < K; k++) {                                                                   \
            const float wv = LD1(w + k * (ESZ));                                               \
            for (int r = 0; r < nr; r++) out[r] += wv * x[r * xs + k];                         \
        }                                                                                      \
    }

/* One activation row against two weight rows at once: two memory streams per thread keep
 * more DRAM reads in flight than one (F32 4096x14336 mat-vec: 19.6 -> 24.0 GB/s on one
 * thread, ~32 -> ~38 GB/s on two; numpy sgemv: 42). */
#define DEF_DOT_FLOAT_2W(NAME, LD8, LD1, ESZ)                                                  \
    AP_INLINE AP_AVX2 void NAME(int64_t K, const uint8_t *w0, const uint8_t *w1,               \
                                const float *x, float *out) {                                  \
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00;                     \
        int64_t k = 0;                                                                         \
        for (; k + 16 <= K; k += 16) {                                                         \
            const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);         \
            a00 = _mm256_fmadd_ps(LD8(w0 + k * (ESZ)), x0, a00);                               \
            a01 = _mm256_fmadd_ps(LD8(w0 + (k + 8) * (ESZ)), x1, a01);                         \
            a10 = _mm256_fmadd_ps(LD8(w1 + k * (ESZ)), x0, a10);                               \
            a11 = _mm256_fmadd_ps(LD8(w1 + (k + 8) * (ESZ)), x1, a11);                         \
        }                                                                                      \
        out[0] = hsum_ps(_mm256_add_ps(a00, a01));                                             \
        out[1] = hsum_ps(_mm256_add_ps(a10, a11));                                             \
        for (; k < K; k++) {                                                                   \
            out[0] += LD1(w0 + k * (ESZ)) * x[k];                                              \
            out[1] += LD1(w1 + k * (ESZ)) * x[k];                                              \
        }                                                                                      \
    }

DEF_DOT_FLOAT_2W(dot2_f32, ld8_f32, ld1_f32, 4)
DEF_DOT_FLOAT_2W(dot2_f16, ld8_f16, ld1_f16, 2)
DEF_DOT_FLOAT_2W(dot2_bf16, ld8_bf16, ld1_bf16, 2)

/* A 4 x 2 tile: weight rows w, w + ws, .. (4) against activation rows x, x + xs (K % 8 == 0).
 * Each converted weight vector and each activation vector serves several products, and the
 * 4 sums of a row reduce together (two rounds of hadd), so short rows (attention's head dim
 * and KV window) are not dominated by a horizontal sum per product. y[r * ys + i]: row i's
 * product with x row r. */
#define DEF_TILE_FLOAT(NAME, LD8, ESZ)                                                         \
    AP_INLINE AP_AVX2 void NAME(int64_t K, const uint8_t *w, int64_t ws, const float *x,       \
                                int64_t xs, float *y, int64_t ys) {                            \
        __m256 acc[2][4];                                                                      \
        for (int r = 0; r < 2; r++)                                                            \
            for (int i = 0; i < 4; i++) acc[r][i] = _mm256_setzero_ps();                       \
        for (int64_t k = 0; k < K; k += 8) {                                                   \
            const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + xs + k);        \
            for (int i = 0; i < 4; i++) {                                                      \
                const __m256 wv = LD8(w + i * ws + k * (ESZ));                                 \
                acc[0][i] = _mm256_fmadd_ps(wv, x0, acc[0][i]);                                \
                acc[1][i] = _mm256_fmadd_ps(wv, x1, acc[1][i]);                                \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < 2; r++) {                                                          \
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]),              \
                                            _mm256_hadd_ps(acc[r][2], acc[r][3]));             \
            _mm_storeu_ps(y + r * ys, _mm_add_ps(_mm256_castps256_ps128(h),                    \
                                                 _mm256_extractf128_ps(h, 1)));                \
        }                                                                                      \
    }

DEF_TILE_FLOAT(tile_f32, ld8_f32, 4)
DEF_TILE_FLOAT(tile_f16, ld8_f16, 2)
DEF_TILE_FLOAT(tile_bf16, ld8_bf16, 2)

DEF_DOT_FLOAT(dot_f32, ld8_f32, ld1_f32, 4)
DEF_DOT_FLOAT(dot_f16, ld8_f16, ld1_f16, 2)
DEF_DOT_FLOAT(dot_bf16, ld8_bf16, ld1_bf16, 2)


DEF_ROWS_Q(AP_AVX2, rows_q2_K, dot_q2_K, 84, QKK)
DEF_ROWS_Q(AP_AVX2, rows_q3_K, dot_q3_K, 110, QKK)
DEF_ROWS_Q(AP_AVX2, rows_q4_K, dot_q4_K, 144, QKK)
DEF_ROWS_Q(AP_AVX2, rows_q5_K, dot_q5_K, 176, QKK)
DEF_ROWS_Q(AP_AVX2, rows_q6_K, dot_q6_K, 210, QKK)
DEF_ROWS_Q(AP_AVX2, rows_iq4_xs, dot_iq4_xs, 136, QKK)

#define DEF_ROWS_F(NAME, DOT, DOT2, TILE, ESZ)                                                 \
    static AP_AVX2 void NAME(const uint8_t *w, int64_t ws, int64_t m0, int64_t m1, int64_t K,  \
                             const float *x, int64_t xs, int64_t N, float *y, int64_t ys) {    \
        const int64_t mb = row_block(N, m1 - m0, K * (ESZ));                                   \
        const int short_rows = K * (ESZ) <= PREFETCH_ROW_MAX; /* e.g. a KV cache's head rows */ \
        float res[NR_MAX];                                                                     \
        if (N == 1) { /* mat-vec: weight rows in pairs; a lone row is paired with itself so  \
                         every row sums in the same order whatever the thread split */         \
            for (int64_t m = m0; m < m1; m += 2) {                                             \
                const uint8_t *r1 = w + (m + 1 < m1 ? m + 1 : m) * ws;                         \
                DOT2(K, w + m * ws, r1, x, res);                                               \
                y[m] = res[0];                                                                 \
                if (m + 1 < m1) y[m + 1] = res[1];                                             \
            }                                                                                  \
            return;                                                                            \
        }                                                                                      \
        for (int64_t mc = m0; mc < m1; mc += mb) {                                             \
            const int64_t me = mc + mb < m1 ? mc + mb : m1;                                    \
            int64_t r0 = 0;                                                                    \
            if (K % 8 == 0 && K <= 1024 && me - mc >= 4) { /* short rows: 4 x 2 tiles */       \
                const int64_t m4 = mc + (me - mc) / 4 * 4;                                     \
                for (int64_t mm = mc; mm < m4; mm += 4) {                                      \
                    if (short_rows && mm + 8 <= m4)                                            \
                        for (int i = 4; i < 8; i++) prefetch_row(w + (mm + i) * ws, K * (ESZ));  \
                    for (int64_t r = 0; r + 2 <= N; r += 2)                                    \
                        TILE(K, w + mm * ws, ws, x + r * xs, xs, y + r * ys + mm, ys);         \
                }                                                                              \
                for (int64_t mm = m4; mm < me; mm++) /* the rows past the last tile */         \
                    for (int64_t r = 0; r + 2 <= N; r += 2) {                                  \
                        DOT(2, K, w + mm * ws, x + r * xs, xs, res);                           \
                        y[r * ys + mm] = res[0];                                               \
                        y[(r + 1) * ys + mm] = res[1];                                         \
                    }                                                                          \
                r0 = N / 2 * 2; /* an odd last row: below */                                   \
            }                                                                                  \
            for (; r0 < N; r0 += NR_MAX) {                                                     \
                const int64_t left = N - r0;                                                   \
                const int nr = left < NR_MAX ? (int)left : NR_MAX;                             \
                const float *xr = x + r0 * xs;                                                 \
                for (int64_t mm = mc; mm < me; mm++) {                                         \
                    const uint8_t *row = w + mm * ws;                                          \
                    if (short_rows && mm + 2 < me) prefetch_row(w + (mm + 2) * ws, K * (ESZ)); \
                    switch (nr) {                                                              \
                    case 1: DOT(1, K, row, xr, xs, res); break;                                \
                    case 2: DOT(2, K, row, xr, xs, res); break;                                \
                    case 3: DOT(3, K, row, xr, xs, res); break;                                \
                    default: DOT(4, K, row, xr, xs, res); break;                               \
                    }                                                                          \
                    for (int r = 0; r < nr; r++) y[(r0 + r) * ys + mm] = res[r];               \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

DEF_ROWS_F(rows_f32, dot_f32, dot2_f32, tile_f32, 4)
DEF_ROWS_F(rows_f16, dot_f16, dot2_f16, tile_f16, 2)
DEF_ROWS_F(rows_bf16, dot_bf16, dot2_bf16, tile_bf16, 2)

/* --- AVX2 dequantizers ---------------------------------------------------------------------- */

static AP_AVX2 void deq_f16_x(const uint8_t *s, int64_t n, float *y) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, ld8_f16(s + 2 * i));
    for (; i < n; i++) y[i] = ld1_f16(s + 2 * i);
}

static AP_AVX2 void deq_bf16_x(const uint8_t *s, int64_t n, float *y) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, ld8_bf16(s + 2 * i));
    for (; i < n; i++) y[i] = ld1_bf16(s + 2 * i);
}

/* 16 bytes of small unsigned ints -> 16 floats (v - off) * d at y */
AP_INLINE AP_AVX2 void st16_u8(__m128i v, __m256 d, __m256 off, float *y) {
    const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(v, v)));
    _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_sub_ps(a, off), d));
    _mm256_storeu_ps(y + 8, _mm256_mul_ps(_mm256_sub_ps(b, off), d));
}

static AP_AVX2 void deq_q4_0_x(const uint8_t *s, int64_t nb, float *y) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m256 eight = _mm256_set1_ps(8.0f);
    for (int64_t i = 0; i < nb; i++, s += 18, y += QK) {
        const __m256 d = _mm256_set1_ps(ld_f16_x(s));
        const __m128i raw = _mm_loadu_si128((const __m128i *)(s + 2));
        st16_u8(_mm_and_si128(raw, m4), d, eight, y);
        st16_u8(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), d, eight, y + 16);
    }
}

static AP_AVX2 void deq_q8_0_x(const uint8_t *s, int64_t nb, float *y) {
    for (int64_t i = 0; i < nb; i++, s += 34, y += QK) {
        const __m256 d = _mm256_set1_ps(ld_f16_x(s));
        for (int j = 0; j < QK; j += 8) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(s + 2 + j));
            _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
        }
    }
}

static AP_AVX2 void deq_q4_K_x(const uint8_t *s, int64_t nb, float *y) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t i = 0; i < nb; i++, s += 144) {
        const float d = ld_f16_x(s), dmin = ld_f16_x(s + 2);
        uint8_t sc[8], mn[8];
        q4k_scales(s + 4, sc, mn);
        for (int j = 0; j < 4; j++) {
            const __m256i qb = _mm256_loadu_si256((const __m256i *)(s + 16 + 32 * j));
            const __m256i lo = _mm256_and_si256(qb, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4);
            for (int h = 0; h < 2; h++) {
                const __m256i q = h ? hi : lo;
                const __m256 dd = _mm256_set1_ps(d * sc[2 * j + h]);
                const __m256 mm = _mm256_set1_ps(-dmin * mn[2 * j + h]);
                const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
                const __m128i parts[4] = {q0, _mm_unpackhi_epi64(q0, q0), q1,
                                          _mm_unpackhi_epi64(q1, q1)};
                for (int p = 0; p < 4; p++)
                    _mm256_storeu_ps(y + 8 * p, _mm256_fmadd_ps(_mm256_cvtepi32_ps(
                                                    _mm256_cvtepu8_epi32(parts[p])), dd, mm));
                y += 32;
            }
        }
    }
}

static AP_AVX2 void deq_q6_K_x(const uint8_t *s, int64_t nb, float *y) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    for (int64_t i = 0; i < nb; i++, s += 210) {
        const float d = ld_f16_x(s + 208);
        const int8_t *sc = (const int8_t *)(s + 192);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = s + 64 * h, *qh = s + 128 + 32 * h;
            const __m256i qhv = _mm256_loadu_si256((const __m256i *)qh);
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4),
                                   _mm256_and_si256(_mm256_slli_epi16(qhv, 4), m30));
            q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4),
                                   _mm256_and_si256(_mm256_slli_epi16(qhv, 2), m30));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                   _mm256_and_si256(qhv, m30));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(qhv, 2), m30));
            const __m256 off = _mm256_set1_ps(32.0f);
            for (int g = 0; g < 4; g++) {
                const __m128i q0 = _mm256_castsi256_si128(q[g]);
                const __m128i q1 = _mm256_extracti128_si256(q[g], 1);
                float *yg = y + 128 * h + 32 * g;
                st16_u8(q0, _mm256_set1_ps(d * sc[8 * h + 2 * g]), off, yg);
                st16_u8(q1, _mm256_set1_ps(d * sc[8 * h + 2 * g + 1]), off, yg + 16);
            }
        }
        y += QKK;
    }
}

static deq_fn deq_avx2(int type) {
    switch (type) {
    case AP_T_F32: return deq_f32_pt; /* memcpy */
    case AP_T_F16: return deq_f16_x;
    case AP_T_BF16: return deq_bf16_x;
    case AP_T_Q4_0: return deq_q4_0_x;
    case AP_T_Q8_0: return deq_q8_0_x;
    case AP_T_Q4_K: return deq_q4_K_x;
    case AP_T_Q6_K: return deq_q6_K_x;
    default: return deq_portable(type); /* the compiler's vectorization of the portable loops */
    }
}

static int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}

/* AVX-VNNI: CPUID leaf 7 subleaf 1, EAX bit 4 (the VEX-encoded vpdpbusd on ymm registers). Its
 * register state is AVX's, which cpu_has_avx2 has checked the OS saves (XCR0). */
static int cpu_has_vex_vnni(void) {
#if AP_HAVE_VNNI
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!cpu_has_avx2() || !__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return 0;
    return (eax >> 4) & 1u;
#else
    return 0;
#endif
}

/* AVX512-VNNI with AVX512VL (libgcc's and compiler-rt's checks include the OS's AVX-512 state) */
static int cpu_has_evex_vnni(void) {
#if AP_HAVE_VNNI
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

static int cpu_has_avx2_vnni(void) { return cpu_has_vex_vnni() || cpu_has_evex_vnni(); }

static int cpu_has_avx512(void) {
    return cpu_has_evex_vnni() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi");
}

#else /* not x86 */

static int cpu_has_avx2(void) { return 0; }
static int cpu_has_avx2_vnni(void) { return 0; }
static int cpu_has_vex_vnni(void) { return 0; }
static int cpu_has_avx512(void) { return 0; }

#endif

/* ---------------------------------------------------------------------------------------------
 * public entry points
 */

__attribute__((constructor)) static void ap_init(void) {
    for (uint32_t h = 0; h < 65536; h++) g_f16[h] = f16_to_f32_sw((uint16_t)h);
#if AP_HAVE_VNNI
    z_tables();
#endif
    /* the best level this CPU has; the Python boundary (kernels.py) applies ACCELPLANE_CPU_ISA
     * right after loading */
    ap_set_isa(AP_ISA_AVX512);
}

int ap_cpu_has_avx2(void) { return cpu_has_avx2(); }

int ap_cpu_has_avx2_vnni(void) { return cpu_has_avx2_vnni(); }

int ap_cpu_has_avx512(void) { return cpu_has_avx512(); }

int ap_set_isa(int isa) {
    g_vnni_evex = !cpu_has_vex_vnni(); /* VEX where both: no AVX-512 frequency licence */
    if (isa == AP_ISA_AVX512 && cpu_has_avx512())
        g_isa = AP_ISA_AVX512;
    else if (isa >= AP_ISA_AVX2_VNNI && cpu_has_avx2_vnni())
        g_isa = AP_ISA_AVX2_VNNI;
    else if (isa >= AP_ISA_AVX2 && cpu_has_avx2())
        g_isa = AP_ISA_AVX2;
    else
        g_isa = AP_ISA_PORTABLE;
    return g_isa;
}

int ap_get_isa(void) { return g_isa; }

int ap_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* extent (elements/bytes past the base) of `n` rows of `len` at `stride`, or -1 on overflow */
static int64_t extent(int64_t n, int64_t stride, int64_t len) {
    if (n <= 0) return 0;
    int64_t e;
    if (__builtin_mul_overflow(n - 1, stride, &e) || __builtin_add_overflow(e, len, &e)) return -1;
    return e;
}

static int pick_threads(int nthreads, int64_t rows, double work) {
    int nt = nthreads > 0 ? nthreads : ap_max_threads();
    if (work < 65536.0) nt = 1; /* a fork/join costs more than this much work */
    if (nt > rows) nt = (int)(rows > 0 ? rows : 1);
    return nt < 1 ? 1 : nt;
}

/* Rows per work chunk: ~8 chunks per thread, handed out dynamically, so a thread that shares
 * its core with another process does not hold up the others (static halves would). */
static int64_t pick_chunk(int64_t rows, int nt) {
    if (nt <= 1) return rows > 0 ? rows : 1;
    int64_t c = (rows + 8 * nt - 1) / (8 * nt);
    return c < 4 ? 4 : c;
}

typedef struct {
    int type;
    int x8; /* w is in the x8 layout (of M rows) */
    const uint8_t *w;
    int64_t ws, M, K, N, xs, ys;
    const float *x;
    float *y;
#if AP_X86
    const act_t *a; /* quantized activations (AVX2 path, quantized types) */
#endif
} mm_ctx;

/* rows [m0, m1) of an x8 matrix on the portable path: each group row's blocks put back in
 * ggml's layout one at a time, dequantized and dotted in double; the tail rows as plain ones */
static void mm_range_x8_portable(const mm_ctx *c, int64_t m0, int64_t m1) {
    int64_t blk, bsz;
    type_info(c->type, &blk, &bsz);
    const deq_fn deq = deq_portable(c->type);
    const int64_t full = c->M / 8 * 8, mg = m1 < full ? m1 : full, nb = c->K / blk, nw = (bsz - 2) / 4;
    uint8_t one[34];
    float v[32];
    for (int64_t m = m0; m < mg; m++) {
        const uint8_t *g = c->w + (m - m % 8) * c->ws;
        for (int64_t n = 0; n < c->N; n++) {
            double acc = 0;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *p = g + b * 8 * bsz;
                memcpy(one, p + 2 * (m % 8), 2);
                for (int64_t w = 0; w < nw; w++) memcpy(one + 2 + 4 * w, p + 16 + 4 * (w * 8 + m % 8), 4);
                deq(one, 1, v);
                const float *xr = c->x + n * c->xs + b * 32;
                for (int j = 0; j < 32; j++) acc += (double)v[j] * xr[j];
            }
            c->y[n * c->ys + m] = (float)acc;
        }
    }
    if (m1 > full)
        mm_rows_portable(c->type, c->w, c->ws, m0 > full ? m0 : full, m1, c->K, c->x, c->xs, c->N, c->y, c->ys);
}

static void mm_range(const mm_ctx *c, int isa, int64_t m0, int64_t m1) {
#if AP_X86
    if (isa >= AP_ISA_AVX2 && c->x8) {
#if AP_HAVE_VNNI
        if (isa >= AP_ISA_AVX2_VNNI) {
            (g_vnni_evex ? rows_x8_vnni512 : rows_x8_vnni)(c->type, c->w, c->ws, c->M, m0, m1, c->a, c->N,
                                                            c->y, c->ys);
            return;
        }
#endif
        rows_x8(c->type, c->w, c->ws, c->M, m0, m1, c->a, c->N, c->y, c->ys);
        return;
    }
    if (isa >= AP_ISA_AVX2) { /* the VNNI level: its own 32-block kernels, AVX2's for the rest */
#if AP_HAVE_VNNI
        const rows_q_fn q32 = isa == AP_ISA_AVX512 && c->type == AP_T_Q4_0 ? rows_q4_0_z
                              : isa < AP_ISA_AVX2_VNNI                    ? rows_q32(c->type)
                              : g_vnni_evex                               ? rows_q32_vnni512(c->type)
                                                                          : rows_q32_vnni(c->type);
#else
        const rows_q_fn q32 = rows_q32(c->type);
#endif
        if (q32) {
            q32(c->w, c->ws, m0, m1, c->a, c->N, c->y, c->ys);
            return;
        }
        switch (c->type) {
        case AP_T_F32: rows_f32(c->w, c->ws, m0, m1, c->K, c->x, c->xs, c->N, c->y, c->ys); return;
        case AP_T_F16: rows_f16(c->w, c->ws, m0, m1, c->K, c->x, c->xs, c->N, c->y, c->ys); return;
        case AP_T_BF16:
            rows_bf16(c->w, c->ws, m0, m1, c->K, c->x, c->xs, c->N, c->y, c->ys);
            return;
        case AP_T_Q2_K: rows_q2_K(c->w, c->ws, m0, m1, c->a, c->N, c->y, c->ys); return;
        case AP_T_Q3_K: rows_q3_K(c->w, c->ws, m0, m1, c->a, c->N, c->y, c->ys); return;
        case AP_T_Q4_K: rows_q4_K(c->w, c->ws, m0, m1, c->a, c->N, c->y, c->ys); return;
        case AP_T_Q5_K: rows_q5_K(c->w, c->ws, m0, m1, c->a, c->N, c->y, c->ys); return;
        case AP_T_Q6_K: rows_q6_K(c->w, c->ws, m0, m1, c->a, c->N, c->y, c->ys); return;
        case AP_T_IQ4_XS: rows_iq4_xs(c->w, c->ws, m0, m1, c->a, c->N, c->y, c->ys); return;
        default: break;
        }
    }
#endif
    (void)isa;
    if (c->x8) {
        mm_range_x8_portable(c, m0, m1);
        return;
    }
    mm_rows_portable(c->type, c->w, c->ws, m0, m1, c->K, c->x, c->xs, c->N, c->y, c->ys);
}

/* Work item `it` of mm_groups: row chunk it % nch of group it / nch, on a copy of the context
 * that points at the group's weights and its x, y and quantized activation rows. */
static void mm_item(const mm_ctx *base, int isa, const int64_t *gw, const int64_t *gs, const int64_t *gx,
                    int64_t nch, int64_t chunk, int64_t M, int64_t it) {
    const int64_t g = it / nch, m0 = (it % nch) * chunk, m1 = m0 + chunk < M ? m0 + chunk : M;
    const int64_t r0 = gs[g], n = gs[g + 1] - r0, rx = gx ? gx[g] : r0;
    if (n == 0) return;
    mm_ctx c = *base;
    c.w = base->w + gw[g];
    c.N = n;
    c.x = base->x + rx * base->xs;
    c.y = base->y + r0 * base->ys;
#if AP_X86
    act_t a;
    if (base->a != NULL) {
        a = *base->a;
        a.q += rx * a.K;
        a.d += rx * a.nd;
        a.c += rx * a.nd;
        a.bs += rx * (a.K / 16);
        if (a.z) a.z = Z_ROW(&a, rx);
        c.a = &a;
    }
#endif
    mm_range(&c, isa, m0, m1);
}

/* The products of G groups: group g multiplies the M x K matrix at w + gw[g] (rows ws bytes
 * apart) by n_g = gs[g + 1] - gs[g] rows of x into y rows [gs[g], gs[g + 1]) (MUL_MAT: one
 * group; MUL_MAT_ID: one per used expert). x rows: [gx[g], gx[g] + n_g) of its NX rows, or with
 * gx NULL the y rows' own (NX = N). The caller has checked every size and offset. The NX
 * activation rows are quantized once for all groups (a decode's experts share one row); the
 * (group, row chunk) items are shared among the threads. */
static int mm_groups(int type, int x8, const uint8_t *w, int64_t ws, int64_t M, int64_t K, const float *x,
                     int64_t xs, int64_t NX, int64_t N, float *y, int64_t ys, const int64_t *gw, const int64_t *gs,
                     const int64_t *gx, int64_t G, int nthreads) {
    if (K == 0) {
        for (int64_t n = 0; n < N; n++) memset(y + n * ys, 0, (size_t)M * sizeof(float));
        return AP_OK;
    }
    const int nt = pick_threads(nthreads, M * G, (double)M * (double)K * (double)N);
    /* chunks of the M rows, ~8 per thread over all groups */
    int64_t chunk = pick_chunk(M * G, nt);
    if (x8) chunk = (chunk + 7) / 8 * 8; /* chunks start on a group */
    const int64_t nch = (M + chunk - 1) / chunk, items = nch * G;
    const int isa = g_isa;
    mm_ctx c;
    memset(&c, 0, sizeof c);
    c.type = type;
    c.x8 = x8;
    c.w = w;
    c.ws = ws;
    c.M = M;
    c.K = K;
    c.N = N;
    c.xs = xs;
    c.ys = ys;
    c.x = x;
    c.y = y;
    char *ws_mem = NULL;
#if AP_X86
    act_t a;
    const int k_quant = act_kind(type) == ACT_QK;
    const int quant_x = isa >= AP_ISA_AVX2 && act_kind(type) != ACT_FLOAT;
    c.a = quant_x ? &a : NULL;
    if (quant_x) {
        a.K = K;
        a.nd = k_quant ? K / QKK : K / QK;
        const size_t nq = (size_t)(NX * K), nd = (size_t)(NX * a.nd);
        const size_t nbs = k_quant ? (size_t)(NX * K / 16) : 0, nc = k_quant ? 0 : nd;
        const size_t nz = isa == AP_ISA_AVX512 && type == AP_T_Q4_0 && !x8 && K <= Z_K_MAX ? (size_t)(NX * Z_ROW_BYTES(K)) : 0;
        /* one allocation: floats first (alignment), then int16 sums, then int8 quants */
        ws_mem = malloc((nd + nc) * sizeof(float) + nbs * sizeof(int16_t) + nq + nz + 64);
        if (!ws_mem) return AP_ENOMEM;
        a.d = (float *)ws_mem;
        a.c = a.d + nd;
        a.bs = (int16_t *)(a.c + nc);
        a.q = (int8_t *)(a.bs + nbs);
        a.z = nz ? (uint8_t *)a.q + nq : NULL;
    }
    /* Few activation rows are quantized before the parallel region (microseconds of work):
     * that saves a barrier, and a barrier is a futex sleep/wake when threads wait passively. */
    const int quant_inside = quant_x && nt > 1 && NX * K > (1 << 16);
    if (quant_x && !quant_inside) quant_rows(&a, type, x, xs, NX, 0, NX);
#endif
    if (nt == 1) { /* no OpenMP region at all: even a serialized one costs microseconds */
        for (int64_t it = 0; it < items; it++) mm_item(&c, isa, gw, gs, gx, nch, chunk, M, it);
    } else {
#pragma omp parallel num_threads(nt)
        {
#if AP_X86
            if (quant_inside) {
                /* rows split over threads; the barrier at the end of the loop makes them
                 * visible before W rows are dotted against them */
#pragma omp for schedule(static)
                for (int64_t n = 0; n < NX; n++) quant_rows(&a, type, x, xs, NX, n, n + 1);
            }
#endif
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t it = 0; it < items; it++) mm_item(&c, isa, gw, gs, gx, nch, chunk, M, it);
        }
    }
    free(ws_mem);
    return AP_OK;
}

/* Splits AP_LAYOUT_X8 off a type argument: the x8 flag, or -1 when the type has no x8 layout. */
static int take_layout(int *type) {
    const int x8 = (*type & AP_LAYOUT_X8) != 0;
    *type &= ~AP_LAYOUT_X8;
    return x8 && !ap_x8_supported(*type) ? -1 : x8;
}

int ap_mul_mat(int type, const void *w_, int64_t ws, int64_t w_size, int64_t M, int64_t K,
               const float *x, int64_t xs, int64_t x_size, int64_t N, float *y, int64_t ys,
               int64_t y_size, int nthreads) {
    int64_t blk, bsz;
    const int x8 = take_layout(&type);
    if (x8 < 0 || !type_info(type, &blk, &bsz)) return AP_ETYPE;
    if (M < 0 || N < 0 || K < 0 || K % blk) return AP_EINVAL;
    if (M == 0 || N == 0) return AP_OK;
    if (ws < 0 || xs < 0 || (N > 1 && ys < M)) return AP_EINVAL; /* ys < M: rows of y overlap */
    const int64_t row_bytes = K / blk * bsz;
    if (x8 && ws != row_bytes && M > 1) return AP_EINVAL; /* x8 groups are whole rows apart */
    const int64_t ew = extent(M, ws, row_bytes), ex = extent(N, xs, K), ey = extent(N, ys, M);
    if (ew < 0 || ex < 0 || ey < 0 || ew > w_size || ex > x_size || ey > y_size)
        return AP_ERANGE;
    if (!w_ || !x || !y) return AP_EINVAL;
    const int64_t gw = 0, gs[2] = {0, N};
    return mm_groups(type, x8, (const uint8_t *)w_, x8 ? row_bytes : ws, M, K, x, xs, N, N, y, ys, &gw, gs,
                     NULL, 1, nthreads);
}

/* ap_mul_mat_id with mm_groups' gx: group g reads x rows [gx[g], gx[g] + its rows) of NX */
static int mul_mat_id_x(int type, const void *w_, int64_t es, int64_t ws, int64_t w_size, int64_t E, int64_t M,
                        int64_t K, const float *x, int64_t xs, int64_t x_size, int64_t NX, int64_t N, float *y,
                        int64_t ys, int64_t y_size, const int32_t *experts, const int64_t *starts, const int64_t *gx,
                        int64_t G, int nthreads) {
    int64_t blk, bsz;
    const int x8 = take_layout(&type);
    if (x8 < 0 || !type_info(type, &blk, &bsz)) return AP_ETYPE;
    if (M < 0 || N < 0 || K < 0 || E < 0 || G < 0 || K % blk) return AP_EINVAL;
    if (es < 0 || ws < 0 || xs < 0 || (N > 1 && ys < M)) return AP_EINVAL;
    if (!starts || (G > 0 && !experts) || starts[0] != 0 || starts[G] != N) return AP_EINVAL;
    for (int64_t g = 0; g < G; g++)
        if (starts[g + 1] < starts[g]) return AP_EINVAL;
    if (M == 0 || N == 0) return AP_OK;
    const int64_t row_bytes = K / blk * bsz;
    if (x8 && ws != row_bytes && M > 1) return AP_EINVAL;
    if (x8) ws = row_bytes;
    const int64_t ew = extent(M, ws, row_bytes), ex = extent(NX, xs, K), ey = extent(N, ys, M);
    if (ew < 0 || ex < 0 || ey < 0 || ex > x_size || ey > y_size) return AP_ERANGE;
    for (int64_t g = 0; gx && g < G; g++)
        if (gx[g] < 0 || gx[g] > NX - (starts[g + 1] - starts[g])) return AP_ERANGE;
    int64_t *gw = malloc((size_t)(G > 0 ? G : 1) * sizeof(int64_t));
    if (!gw) return AP_ENOMEM;
    for (int64_t g = 0; g < G; g++) {
        int64_t off;
        if (experts[g] < 0 || experts[g] >= E || __builtin_mul_overflow((int64_t)experts[g], es, &off) ||
            off > w_size - ew) {
            free(gw);
            return AP_ERANGE;
        }
        gw[g] = off;
    }
    if (!w_ || !x || !y) {
        free(gw);
        return AP_EINVAL;
    }
    const int rc = mm_groups(type, x8, (const uint8_t *)w_, ws, M, K, x, xs, NX, N, y, ys, gw, starts, gx, G,
                             nthreads);
    free(gw);
    return rc;
}

int ap_mul_mat_id(int type, const void *w_, int64_t es, int64_t ws, int64_t w_size, int64_t E, int64_t M,
                  int64_t K, const float *x, int64_t xs, int64_t x_size, int64_t N, float *y, int64_t ys,
                  int64_t y_size, const int32_t *experts, const int64_t *starts, int64_t G, int nthreads) {
    return mul_mat_id_x(type, w_, es, ws, w_size, E, M, K, x, xs, x_size, N, N, y, ys, y_size, experts, starts,
                        NULL, G, nthreads);
}

int ap_mul_mat_id_ids(int type, const void *w_, int64_t es, int64_t ws, int64_t w_size, int64_t E, int64_t M,
                      int64_t K, const float *x, int64_t x_tok, int64_t x_slot, int64_t x_slots, int64_t x_size,
                      const int32_t *ids, int64_t ids_stride, int64_t ids_size, int64_t T, int64_t U, float *y,
                      int64_t y_tok, int64_t y_slot, int64_t y_size, int nthreads) {
    int64_t blk, bsz, N;
    int plain = type;
    if (take_layout(&plain) < 0 || !type_info(plain, &blk, &bsz)) return AP_ETYPE;
    if (M < 0 || K < 0 || E < 1 || T < 0 || U < 0 || x_slots < 1 || K % blk) return AP_EINVAL;
    if (es < 0 || ws < 0 || x_tok < 0 || x_slot < 0 || ids_stride < 0 || y_tok < 0 || y_slot < 0)
        return AP_EINVAL;
    if (__builtin_mul_overflow(T, U, &N)) return AP_EINVAL;
    if (N == 0 || M == 0) return AP_OK;
    /* the last element x's, ids' and y's strides reach, against their sizes (W's: ap_mul_mat_id) */
    const int64_t xl = (T - 1) * x_tok + (x_slots - 1) * x_slot + K, il = (T - 1) * ids_stride + U;
    const int64_t yl = (T - 1) * y_tok + (U - 1) * y_slot + M;
    if (xl > x_size || il > ids_size || yl > y_size) return AP_ERANGE;
    if (!w_ || !x || !ids || !y) return AP_EINVAL;
    /* one workspace: per expert its row count and next place, the groups (expert, start), the
     * rows' order, each group's x row (shared: 0); then the gathered x and y rows */
    int64_t *cnt = calloc((size_t)(2 * E + 1 + 3 * N), sizeof(int64_t));
    int32_t *gex = malloc((size_t)(N > 0 ? N : 1) * sizeof(int32_t));
    float *xg = malloc((size_t)(N * (K + M)) * sizeof(float));
    if (!cnt || !gex || !xg) {
        free(cnt);
        free(gex);
        free(xg);
        return AP_ENOMEM;
    }
    int64_t *next = cnt + E, *gs = next + E, *order = gs + N + 1, *gx = order + N, G = 0;
    int rc = AP_OK;
    for (int64_t n = 0; n < N && rc == AP_OK; n++) {
        const int32_t e = ids[(n / U) * ids_stride + n % U];
        if (e < 0 || e >= E)
            rc = AP_ERANGE;
        else
            cnt[e]++;
    }
    if (rc == AP_OK) {
        /* counting sort by expert (stable: token and slot order within one) */
        for (int64_t e = 0, at = 0; e < E; e++) {
            next[e] = at;
            if (cnt[e]) {
                gex[G] = (int32_t)e;
                gs[G++] = at;
            }
            at += cnt[e];
        }
        gs[G] = N;
        for (int64_t n = 0; n < N; n++) order[next[ids[(n / U) * ids_stride + n % U]]++] = n;
        float *yg = xg + N * K;
        /* One token whose slots all read its one row, each slot another expert (a decode's gate
         * and up): every group reads that row where it is, quantized once, rather than a
         * gathered copy per slot. gx stays 0 (calloc). */
        if (T == 1 && x_slots == 1 && G == N) {
            rc = mul_mat_id_x(type, w_, es, ws, w_size, E, M, K, x, K, K, 1, N, yg, M, N * M, gex, gs, gx, G,
                              nthreads);
        } else {
            for (int64_t i = 0; i < N; i++) {
                const int64_t t = order[i] / U, u = order[i] % U;
                memcpy(xg + i * K, x + t * x_tok + (u % x_slots) * x_slot, (size_t)K * sizeof(float));
            }
            rc = ap_mul_mat_id(type, w_, es, ws, w_size, E, M, K, xg, K, N * K, N, yg, M, N * M, gex, gs, G,
                               nthreads);
        }
        for (int64_t i = 0; i < N && rc == AP_OK; i++) {
            const int64_t t = order[i] / U, u = order[i] % U;
            memcpy(y + t * y_tok + u * y_slot, yg + i * M, (size_t)M * sizeof(float));
        }
    }
    free(cnt);
    free(gex);
    free(xg);
    return rc;
}

int ap_dequantize(int type, const void *w_, int64_t ws, int64_t w_size, int64_t M, int64_t K,
                  const int64_t *rows, int64_t R, float *y, int64_t ys, int64_t y_size,
                  int nthreads) {
    int64_t blk, bsz;
    const int x8 = take_layout(&type);
    if (x8 < 0 || !type_info(type, &blk, &bsz)) return AP_ETYPE;
    if (M < 0 || R < 0 || K < 0 || K % blk) return AP_EINVAL;
    if (R == 0 || K == 0) return AP_OK;
    if (ws < 0 || (R > 1 && ys < K)) return AP_EINVAL;
    const int64_t row_bytes = K / blk * bsz;
    if (x8 && ws != row_bytes && M > 1) return AP_EINVAL;
    if (x8) ws = row_bytes;
    const int64_t ew = extent(M, ws, row_bytes), ey = extent(R, ys, K);
    if (ew < 0 || ey < 0 || ew > w_size || ey > y_size) return AP_ERANGE;
    if (!rows && R > M) return AP_ERANGE;
    if (rows)
        for (int64_t i = 0; i < R; i++)
            if (rows[i] < 0 || rows[i] >= M) return AP_ERANGE;
    if (!w_ || !y) return AP_EINVAL;
    const uint8_t *w = (const uint8_t *)w_;
    deq_fn deq = deq_portable(type);
#if AP_X86
    if (g_isa >= AP_ISA_AVX2) deq = deq_avx2(type);
#endif
    const int nt = pick_threads(nthreads, R, (double)R * (double)K);
    const int64_t chunk = pick_chunk(R, nt);
    if (x8) { /* rows of the groups put back in ggml's layout first (the tail is plain already) */
        const int64_t full = M / 8 * 8;
        int rc = AP_OK;
#pragma omp parallel num_threads(nt)
        {
            uint8_t *row = malloc((size_t)row_bytes);
            if (!row) {
#pragma omp atomic write
                rc = AP_ENOMEM;
            }
#pragma omp for schedule(dynamic, chunk)
            for (int64_t i = 0; i < R; i++) {
                const int64_t r = rows ? rows[i] : i;
                if (!row) continue;
                if (r < full) {
                    x8_row(bsz, w, ws, r, row);
                    deq(row, K / blk, y + i * ys);
                } else {
                    deq(w + r * ws, K / blk, y + i * ys);
                }
            }
            free(row);
        }
        return rc;
    }
    if (nt == 1) {
        for (int64_t i = 0; i < R; i++) deq(w + (rows ? rows[i] : i) * ws, K / blk, y + i * ys);
        return AP_OK;
    }
#pragma omp parallel for num_threads(nt) schedule(dynamic, chunk)
    for (int64_t i = 0; i < R; i++) {
        const int64_t r = rows ? rows[i] : i;
        deq(w + r * ws, K / blk, y + i * ys);
    }
    return AP_OK;
}

/* --- attention: KQ, its masked soft_max and the product with V as one pass ---------------------
 * Per work item (a batch and a block of up to ATT_RB query rows): S = Q K^T over the window's
 * first E slots (E: past the last slot any row of the block leaves unmasked, rounded up to 8
 * within the window), softmax(S * scale + mask) in place, out = S V^T; S stays in a
 * per-thread buffer, so the [rows, window] scores never reach memory and a causal mask's
 * future is never computed. As ggml's CPU flash attention, slots masked -inf for every row of
 * a block are skipped, even where their K or V holds inf or NaN. */
#define ATT_RB 8

static int64_t att_end(const float *mask, int64_t ms, int64_t nr, int64_t W) {
    if (!mask) return W;
    int64_t E = 0;
    for (int64_t r = 0; r < nr && E < W; r++) {
        const float *m = mask + r * ms;
        int64_t e = W;
        while (e > E && m[e - 1] == -INFINITY) e--;
        E = e > E ? e : E;
    }
    if (E == 0) return W; /* rows masked whole: the unfused result (NaN) */
    E = (E + 7) / 8 * 8;
    return E < W ? E : W;
}

int ap_attention(int ktype, const void *k, int64_t kgs, int64_t krs, int64_t k_size, int vtype,
                 const void *v, int64_t vgs, int64_t vrs, int64_t v_size, const float *q, int64_t qs,
                 int64_t q_size, const float *mask, int64_t ms, int64_t ms2, int64_t m2, int64_t m_size,
                 float *out, int64_t os, int64_t o_size, int64_t NB, int64_t r2, int64_t R, int64_t W,
                 int64_t D, int64_t DV, float scale, int nthreads) {
    int64_t blk, kes, ves;
    const int float_k = ktype == AP_T_F32 || ktype == AP_T_F16 || ktype == AP_T_BF16;
    const int float_v = vtype == AP_T_F32 || vtype == AP_T_F16 || vtype == AP_T_BF16;
    if (!float_k || !float_v || !type_info(ktype, &blk, &kes) || !type_info(vtype, &blk, &ves)) return AP_ETYPE;
    if (NB < 0 || r2 < 1 || R < 0 || W < 1 || D < 0 || DV < 0 || NB % r2 || (mask && m2 < 1)) return AP_EINVAL;
    if (kgs < 0 || krs < 0 || vgs < 0 || vrs < 0 || qs < 0 || os < 0 || ms < 0 || ms2 < 0) return AP_EINVAL;
    if (NB == 0 || R == 0 || DV == 0) return AP_OK;
    const int64_t G = NB / r2;
    /* extents: the last group's last row ends inside each buffer */
    int64_t ek = extent(W, krs, D * kes), ev = extent(DV, vrs, W * ves), eq = extent(NB * R, qs, D),
            eo = extent(NB * R, os, DV), em = mask ? extent(R, ms, W) : 0, t;
    if (ek < 0 || ev < 0 || eq < 0 || eo < 0 || em < 0) return AP_ERANGE;
    if (__builtin_mul_overflow(G - 1, kgs, &t) || __builtin_add_overflow(t, ek, &ek) ||
        __builtin_mul_overflow(G - 1, vgs, &t) || __builtin_add_overflow(t, ev, &ev) ||
        (mask && (__builtin_mul_overflow(m2 - 1, ms2, &t) || __builtin_add_overflow(t, em, &em))))
        return AP_ERANGE;
    if (ek > k_size || ev > v_size || eq > q_size || eo > o_size || (mask && em > m_size)) return AP_ERANGE;
    if (!k || !v || !q || !out || (NB * R > 1 && os < DV)) return AP_EINVAL;
    const int64_t nblk = (R + ATT_RB - 1) / ATT_RB, items = NB * nblk;
    const int nt = pick_threads(nthreads, items, (double)NB * R * W * (D + DV));
    float *scores = malloc((size_t)nt * ATT_RB * (size_t)W * sizeof(float));
    if (!scores) return AP_ENOMEM;
    const int isa = g_isa;
    int rc = AP_OK;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#ifdef _OPENMP
        float *S = scores + (size_t)omp_get_thread_num() * ATT_RB * (size_t)W;
#else
        float *S = scores;
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t b = it / nblk, r0 = it % nblk * ATT_RB, nr = R - r0 < ATT_RB ? R - r0 : ATT_RB;
            const int64_t g = b / r2, row = b * R + r0;
            const float *mrow = mask ? mask + (b % m2) * ms2 + r0 * ms : NULL;
            const int64_t E = att_end(mrow, ms, nr, W);
            mm_ctx c;
            memset(&c, 0, sizeof c);
            c.type = ktype, c.w = (const uint8_t *)k + g * kgs, c.ws = krs, c.M = E, c.K = D, c.N = nr;
            c.x = q + row * qs, c.xs = qs, c.y = S, c.ys = W;
            mm_range(&c, isa, 0, E);
            const int e = ap_soft_max_rows(nr, E, S, W, (nr - 1) * W + E, S, W, (nr - 1) * W + E, mrow, ms,
                                           mrow ? (nr - 1) * ms + E : 0, nr, 1, 1, 1, 0, 0, scale);
            if (e) {
#pragma omp atomic write
                rc = e;
            }
            c.type = vtype, c.w = (const uint8_t *)v + g * vgs, c.ws = vrs, c.M = DV, c.K = E;
            c.x = S, c.xs = W, c.y = out + row * os, c.ys = os;
            mm_range(&c, isa, 0, DV);
        }
    }
    free(scores);
    return rc;
}
