// accelplane CUDA plugin: the GGUF block types decoded beside Q4_0, Q8_0, Q4_K and Q6_K
// (common.cuh): Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL, IQ4_XS. For each, deq32 (a
// 32-element chunk of a row to floats: the row, dequantizing copies, the float mat-vec and the
// cuBLAS path) and unit_dot (a 32-element unit against quantize4's int8 activations: k_mmv_pipe).
//
// Byte and integer arithmetic plus __dp4a and __byte_perm only: tests/test_quant_decode.py
// compiles this header for the host, with those two intrinsics written as CUDA documents them,
// and checks it against the gguf package. It needs u8, i64, f16at and deq32's declaration
// (common.cuh includes it after them); the declarations of unit_dot and qfmt, q4k_scale_min
// and ld_u16x2 are here for common.cuh and matvec.cu too.
//
// Alignment: deq32 loads bytes (any row). unit_dot reads a row segment staged in shared memory,
// 16-byte aligned, of whole blocks: words of a block load as 32 bits where the block's size
// keeps them 4-byte aligned (Q4_1, Q5_1, Q2_K, Q5_K, IQ4_XS), as two 16-bit halves otherwise
// (Q5_0, Q3_K, IQ4_NL: blocks of 22, 110 and 18 bytes).
#pragma once

namespace ty {
constexpr int Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q2_K = 10, Q3_K = 11, Q5_K = 13, IQ4_NL = 20, IQ4_XS = 23;
}  // namespace ty

template <int WT> __device__ __forceinline__ float unit_dot(const u8* row, int u, const int* xq, float dx, int sx);
template <int WT> struct qfmt;  // block formats: bytes per block BB, 32-element units UPB, UNIT

// Q4_K and Q5_K: sub-block j's 6-bit scale and min from scale bytes b0 = s[j & 3],
// b1 = s[(j & 3) + 4], b2 = s[(j & 3) + 8] of the 12 at s
__device__ __forceinline__ void q4k_scale_min(int b0, int b1, int b2, int j, int& sc, int& m) {
    if (j < 4) { sc = b0 & 63; m = b1 & 63; }
    else { sc = (b2 & 0xF) | ((b0 >> 6) << 4); m = (b2 >> 4) | ((b1 >> 6) << 4); }
}

__device__ __forceinline__ unsigned int ld_u16x2(const u8* p) {  // 4 bytes at a 2-aligned address
    return (unsigned int)*(const unsigned short*)p | ((unsigned int)*(const unsigned short*)(p + 2) << 16);
}
__device__ __forceinline__ unsigned int ld_u32a(const u8* p) { return *(const unsigned int*)p; }  // 4-aligned
__device__ __forceinline__ unsigned int ld_u32b(const u8* p) {  // any address, byte by byte
    return (unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16) | ((unsigned int)p[3] << 24);
}
// the low 4 bits of b to bit 4 of bytes 0..3 (Q5_0/Q5_1's fifth bits of 4 consecutive elements)
__device__ __forceinline__ unsigned int spread4(unsigned int b) {
    return ((b & 1u) << 4) | ((b & 2u) << 11) | ((b & 4u) << 18) | ((b & 8u) << 25);
}
// sum of the four int8 values of each activation word xq[i0 .. i0 + 3]
__device__ __forceinline__ int xsum4(const int* xq, int i0) {
    int s = 0;
    #pragma unroll
    for (int i = 0; i < 4; ++i) s = __dp4a(0x01010101, xq[i0 + i], s);
    return s;
}

// ---- Q4_1: 20-byte blocks: f16 d, f16 m, qs[16] (Q4_0's nibble order); value d*q + m ----------
template <> __device__ __forceinline__ void deq32<ty::Q4_1>(const u8* row, int c, float* y) {
    const u8* b = row + (i64)c * 20;
    const float d = f16at(b), m = f16at(b + 2);
    #pragma unroll
    for (int l = 0; l < 16; ++l) {
        const int q = b[4 + l];
        y[l] = d * (float)(q & 0xF) + m;
        y[l + 16] = d * (float)(q >> 4) + m;
    }
}
template <> __device__ __forceinline__ float unit_dot<ty::Q4_1>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* b = row + u * 20;
    int acc = 0;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned int v = ld_u32a(b + 4 + 4 * i);
        acc = __dp4a((int)(v & 0x0F0F0F0F), xq[i], acc);
        acc = __dp4a((int)((v >> 4) & 0x0F0F0F0F), xq[4 + i], acc);
    }
    return dx * (f16at(b) * (float)acc + f16at(b + 2) * (float)sx);
}

// ---- Q5_0 / Q5_1: f16 d [, f16 m], u32 qh (bit l: element l's fifth bit), qs[16] ---------------
// Q5_0: 22 bytes, value d*(q - 16) (the subtraction in integers, as ggml); Q5_1: 24 bytes, value
// d*q + m. QH: qh's offset.
template <int QH, bool MIN>
__device__ __forceinline__ void deq_q5(const u8* b, float* y) {
    const float d = f16at(b), m = MIN ? f16at(b + 2) : 0.0f;
    const unsigned int qh = ld_u32b(b + QH);
    #pragma unroll
    for (int l = 0; l < 16; ++l) {
        const int q = b[QH + 4 + l];
        const int q0 = (q & 0xF) | (int)(((qh >> l) & 1u) << 4), q1 = (q >> 4) | (int)(((qh >> (l + 16)) & 1u) << 4);
        if (MIN) {
            y[l] = d * (float)q0 + m;
            y[l + 16] = d * (float)q1 + m;
        } else {
            y[l] = d * (float)(q0 - 16);
            y[l + 16] = d * (float)(q1 - 16);
        }
    }
}
template <> __device__ __forceinline__ void deq32<ty::Q5_0>(const u8* row, int c, float* y) {
    deq_q5<2, false>(row + (i64)c * 22, y);
}
template <> __device__ __forceinline__ void deq32<ty::Q5_1>(const u8* row, int c, float* y) {
    deq_q5<4, true>(row + (i64)c * 24, y);
}
// sum q*xq of the 5-bit quants of nibbles at qs and fifth bits qh
__device__ __forceinline__ int dot_q5(unsigned int qh, const unsigned int* v, const int* xq) {
    int acc = 0;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc = __dp4a((int)((v[i] & 0x0F0F0F0F) | spread4(qh >> (4 * i))), xq[i], acc);
        acc = __dp4a((int)(((v[i] >> 4) & 0x0F0F0F0F) | spread4(qh >> (16 + 4 * i))), xq[4 + i], acc);
    }
    return acc;
}
template <> __device__ __forceinline__ float unit_dot<ty::Q5_0>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* b = row + u * 22;
    const unsigned int v[4] = {ld_u16x2(b + 6), ld_u16x2(b + 10), ld_u16x2(b + 14), ld_u16x2(b + 18)};
    return f16at(b) * dx * (float)(dot_q5(ld_u16x2(b + 2), v, xq) - 16 * sx);
}
template <> __device__ __forceinline__ float unit_dot<ty::Q5_1>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* b = row + u * 24;
    const unsigned int v[4] = {ld_u32a(b + 8), ld_u32a(b + 12), ld_u32a(b + 16), ld_u32a(b + 20)};
    return dx * (f16at(b) * (float)dot_q5(ld_u32a(b + 4), v, xq) + f16at(b + 2) * (float)sx);
}

// ---- Q2_K / Q3_K: 256-blocks of 16 sub-blocks of 16; 2-bit quants, 32 bytes per 128 elements --
// Element 128h + 32s + l (h 0..1, s 0..3, l 0..31) is bits 2s of byte 32h + l of the quants, and
// has sub-block 8h + 2s + (l >= 16): unit (32-element chunk) j = 4h + s holds sub-blocks 2j, 2j + 1.
// Q2_K: 84 bytes: scales[16] (scale | min << 4), qs[64], f16 d, f16 dmin; value d*sc*q - dmin*mn.
template <> __device__ __forceinline__ void deq32<ty::Q2_K>(const u8* row, int c, float* y) {
    const u8* b = row + (i64)(c >> 3) * 84;
    const int j = c & 7, sh = 2 * (j & 3);
    const float d = f16at(b + 80), dmin = f16at(b + 82);
    const u8* q = b + 16 + 32 * (j >> 2);
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int sc = b[2 * j + half];
        const float dl = d * (float)(sc & 0xF), ml = dmin * (float)(sc >> 4);
        #pragma unroll
        for (int l = 16 * half; l < 16 * half + 16; ++l) y[l] = dl * (float)((q[l] >> sh) & 3) - ml;
    }
}
template <> __device__ __forceinline__ float unit_dot<ty::Q2_K>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* b = row + (u >> 3) * 84;
    const int j = u & 7, sh = 2 * (j & 3);
    const u8* q = b + 16 + 32 * (j >> 2);
    int acc0 = 0, acc1 = 0;
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int w = (int)((ld_u32a(q + 4 * i) >> sh) & 0x03030303);
        if (i < 4) acc0 = __dp4a(w, xq[i], acc0);
        else acc1 = __dp4a(w, xq[i], acc1);
    }
    const int s0 = xsum4(xq, 0), s1 = sx - s0;
    const int sc0 = b[2 * j], sc1 = b[2 * j + 1];
    const int dot = (sc0 & 0xF) * acc0 + (sc1 & 0xF) * acc1, mins = (sc0 >> 4) * s0 + (sc1 >> 4) * s1;
    return dx * (f16at(b + 80) * (float)dot - f16at(b + 82) * (float)mins);
}
// Q3_K: 110 bytes: hmask[32], qs[64], scales[12] (16 6-bit scales), f16 d; value
// d*(sc - 32)*(q + 4 hbit - 4), element 128h + 32s + l's hbit being bit 4h + s (= its unit j) of
// hmask[l]. Scale k: low nibble of byte k (k < 8) or the high nibble of byte k - 8, and bits
// 2(k / 4) of byte 8 + k % 4 on top.
__device__ __forceinline__ int q3k_scale(const u8* s, int k) {
    const int lo = k < 8 ? s[k] & 0xF : s[k - 8] >> 4;
    return (lo | (((s[8 + (k & 3)] >> (2 * (k >> 2))) & 3) << 4)) - 32;
}
template <> __device__ __forceinline__ void deq32<ty::Q3_K>(const u8* row, int c, float* y) {
    const u8* b = row + (i64)(c >> 3) * 110;
    const int j = c & 7, sh = 2 * (j & 3);
    const float d = f16at(b + 108);
    const u8* q = b + 32 + 32 * (j >> 2);
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float dl = d * (float)q3k_scale(b + 96, 2 * j + half);
        #pragma unroll
        for (int l = 16 * half; l < 16 * half + 16; ++l)
            y[l] = dl * (float)(((q[l] >> sh) & 3) - (((b[l] >> j) & 1) ? 0 : 4));
    }
}
template <> __device__ __forceinline__ float unit_dot<ty::Q3_K>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* b = row + (u >> 3) * 110;
    const int j = u & 7, sh = 2 * (j & 3);
    const u8* q = b + 32 + 32 * (j >> 2);
    int acc0 = 0, acc1 = 0;
    #pragma unroll
    for (int i = 0; i < 8; ++i) {  // q + 4 hbit in 0..7: the -4 is taken off with the sums below
        const unsigned int v = (ld_u16x2(q + 4 * i) >> sh) & 0x03030303;
        const int w = (int)(v | (((ld_u16x2(b + 4 * i) >> j) & 0x01010101) << 2));
        if (i < 4) acc0 = __dp4a(w, xq[i], acc0);
        else acc1 = __dp4a(w, xq[i], acc1);
    }
    const int s0 = xsum4(xq, 0), s1 = sx - s0;
    const int dot = q3k_scale(b + 96, 2 * j) * (acc0 - 4 * s0) + q3k_scale(b + 96, 2 * j + 1) * (acc1 - 4 * s1);
    return f16at(b + 108) * dx * (float)dot;
}

// ---- Q5_K: 176 bytes: f16 d, f16 dmin, scales[12] (Q4_K's), qh[32], qs[128] (Q4_K's) ----------
// sub-block j's element l: nibble (j & 1) of qs[32 (j / 2) + l], fifth bit bit j of qh[l]
template <> __device__ __forceinline__ void deq32<ty::Q5_K>(const u8* row, int c, float* y) {
    const u8* b = row + (i64)(c >> 3) * 176;
    const int j = c & 7, sh = 4 * (j & 1);
    const u8* s = b + 4 + (j & 3);
    int sc, m;
    q4k_scale_min(s[0], s[4], s[8], j, sc, m);
    const float dl = f16at(b) * (float)sc, ml = f16at(b + 2) * (float)m;
    const u8* q = b + 48 + 32 * (j >> 1);
    #pragma unroll
    for (int l = 0; l < 32; ++l) y[l] = dl * (float)(((q[l] >> sh) & 0xF) | (((b[16 + l] >> j) & 1) << 4)) - ml;
}
template <> __device__ __forceinline__ float unit_dot<ty::Q5_K>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* b = row + (u >> 3) * 176;
    const int j = u & 7, sh = 4 * (j & 1);
    const u8* s = b + 4 + (j & 3);
    int sc, m;
    q4k_scale_min(s[0], s[4], s[8], j, sc, m);
    const u8* q = b + 48 + 32 * (j >> 1);
    int acc = 0;
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        const unsigned int v = (ld_u32a(q + 4 * i) >> sh) & 0x0F0F0F0F;
        acc = __dp4a((int)(v | (((ld_u32a(b + 16 + 4 * i) >> j) & 0x01010101) << 4)), xq[i], acc);
    }
    return f16at(b) * (float)sc * dx * (float)acc - f16at(b + 2) * (float)m * dx * (float)sx;
}

// ---- IQ4_NL / IQ4_XS: 4-bit indices into ggml's kvalues_iq4nl --------------------------------
// The 16 int8 levels as four words (bytes little-endian: -127, -104, -83, -65 | -49, -35, -22,
// -10 | 1, 13, 25, 38 | 53, 69, 89, 113).
constexpr unsigned int IQ4_K0 = 0xBFAD9881u, IQ4_K1 = 0xF6EADDCFu, IQ4_K2 = 0x26190D01u, IQ4_K3 = 0x71594535u;
// The levels of the 8 indices in q (4 bytes of 2 nibbles): lo the low nibbles' (bytes 0..3), hi
// the high nibbles'. __byte_perm(x, y, s) takes byte (s >> 4n) & 7 of the 8 bytes {x, y} as its
// byte n, so one lookup per half of the table, and a third picks by each index's bit 3.
__device__ __forceinline__ void iq4_levels(unsigned int q, int& lo, int& hi) {
    const unsigned int pick = 0x32103210u | ((q & 0x88888888u) >> 1);  // byte n of the low or high half
    unsigned int t[2];  // the levels of the 4 nibbles of q's bytes 2i, 2i + 1, in nibble order
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
        const unsigned int s = q >> (16 * i);
        t[i] = __byte_perm(__byte_perm(IQ4_K0, IQ4_K1, s), __byte_perm(IQ4_K2, IQ4_K3, s), pick >> (16 * i));
    }
    lo = (int)__byte_perm(t[0], t[1], 0x6420);
    hi = (int)__byte_perm(t[0], t[1], 0x7531);
}
// 16 bytes of indices (element l < 16 the low nibble of byte l, l + 16 its high nibble) at p
// times dl; the words loaded byte by byte
__device__ __forceinline__ void deq_iq4(const u8* p, float dl, float* y) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        int lo, hi;
        iq4_levels(ld_u32b(p + 4 * i), lo, hi);
        #pragma unroll
        for (int k = 0; k < 4; ++k) {
            y[4 * i + k] = dl * (float)(signed char)(lo >> (8 * k));
            y[16 + 4 * i + k] = dl * (float)(signed char)(hi >> (8 * k));
        }
    }
}
__device__ __forceinline__ int dot_iq4(const unsigned int* v, const int* xq) {
    int acc = 0;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        int lo, hi;
        iq4_levels(v[i], lo, hi);
        acc = __dp4a(lo, xq[i], acc);
        acc = __dp4a(hi, xq[4 + i], acc);
    }
    return acc;
}
// IQ4_NL: 18 bytes: f16 d, qs[16]; value d * level
template <> __device__ __forceinline__ void deq32<ty::IQ4_NL>(const u8* row, int c, float* y) {
    const u8* b = row + (i64)c * 18;
    deq_iq4(b + 2, f16at(b), y);
}
template <> __device__ __forceinline__ float unit_dot<ty::IQ4_NL>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* b = row + u * 18;
    const unsigned int v[4] = {ld_u16x2(b + 2), ld_u16x2(b + 6), ld_u16x2(b + 10), ld_u16x2(b + 14)};
    return f16at(b) * dx * (float)dot_iq4(v, xq);
}
// IQ4_XS: 136 bytes: f16 d, u16 scales_h, scales_l[4], qs[128] (16 per sub-block); sub-block j's
// 6-bit scale, 32 subtracted: nibble j & 1 of scales_l[j / 2], bits 2j of scales_h on top
__device__ __forceinline__ int iq4xs_scale(const u8* b, int j) {
    const int h = (int)b[2] | ((int)b[3] << 8);
    return (((b[4 + (j >> 1)] >> (4 * (j & 1))) & 0xF) | (((h >> (2 * j)) & 3) << 4)) - 32;
}
template <> __device__ __forceinline__ void deq32<ty::IQ4_XS>(const u8* row, int c, float* y) {
    const u8* b = row + (i64)(c >> 3) * 136;
    const int j = c & 7;
    deq_iq4(b + 8 + 16 * j, f16at(b) * (float)iq4xs_scale(b, j), y);
}
template <> __device__ __forceinline__ float unit_dot<ty::IQ4_XS>(const u8* row, int u, const int* xq, float dx, int sx) {
    const u8* b = row + (u >> 3) * 136;
    const int j = u & 7;
    const u8* q = b + 8 + 16 * j;
    const unsigned int v[4] = {ld_u32a(q), ld_u32a(q + 4), ld_u32a(q + 8), ld_u32a(q + 12)};
    return f16at(b) * (float)iq4xs_scale(b, j) * dx * (float)dot_iq4(v, xq);
}

// block formats (common.cuh: qfmt): bytes per block, 32-element units per block, and the unit a
// staged row segment is a multiple of (whole blocks in whole 16-byte words: lcm(BB, 16))
template <> struct qfmt<ty::Q4_1> { enum { BB = 20, UPB = 1, UNIT = 80 }; };
template <> struct qfmt<ty::Q5_0> { enum { BB = 22, UPB = 1, UNIT = 176 }; };
template <> struct qfmt<ty::Q5_1> { enum { BB = 24, UPB = 1, UNIT = 48 }; };
template <> struct qfmt<ty::Q2_K> { enum { BB = 84, UPB = 8, UNIT = 336 }; };
template <> struct qfmt<ty::Q3_K> { enum { BB = 110, UPB = 8, UNIT = 880 }; };
template <> struct qfmt<ty::Q5_K> { enum { BB = 176, UPB = 8, UNIT = 176 }; };
template <> struct qfmt<ty::IQ4_NL> { enum { BB = 18, UPB = 1, UNIT = 144 }; };
template <> struct qfmt<ty::IQ4_XS> { enum { BB = 136, UPB = 8, UNIT = 272 }; };
