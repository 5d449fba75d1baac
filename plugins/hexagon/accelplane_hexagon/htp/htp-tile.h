/* Repacked weight tiles and the arithmetic of the tiled matmul, shared by the host-C
 * emulation (matmul.c) and the Hexagon ISA tier (isa/q8dot-hvx.c, built freestanding with
 * clang for hexagon): everything here is integer code or plain IEEE fp32 arithmetic, so both
 * builds compute the same bits.
 *
 * Tile layout (32 output rows x one 32-wide K block; HVX's vrmpy view: lane r of a 128-byte
 * vector holds 4 consecutive K elements of row r):
 *   Q8_0 tile, 1088 bytes: quants[g*128 + 4*r + j] = q[row r][4*g + j]  (g = 0..7)
 *                          then 32 fp16 scales, one per row
 *   Q4_0 tile,  576 bytes: quants[v*128 + 4*r + j] = low nibble  q[row r][4*v + j]
 *                                                    high nibble q[row r][16 + 4*v + j]  (v = 0..3)
 *                          then 32 fp16 scales. (The nibble pairs are Q4_0's own, so a block's
 *                          16 quant bytes move as they are.)
 * Rows past the tensor's last row are padding: zero scale, quants 0 (Q8_0) or 0x88 (Q4_0).
 */
#ifndef HTP_TILE_H
#define HTP_TILE_H

#include <stdint.h>

#define HTP_TILE_Q8_QBYTES 1024
#define HTP_TILE_Q4_QBYTES 512

typedef union {
    float f;
    uint32_t u;
} htp_f32_bits;

/* fp32 -> fp16, round to nearest even; integer code, so it is the same on every target */
static inline uint16_t htp_f32_to_f16(float f) {
    htp_f32_bits b;
    b.f = f;
    const uint32_t sign = (b.u >> 16) & 0x8000u;
    const uint32_t ax = b.u & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504: inf */
    const uint32_t e = ax >> 23;
    uint32_t q, rem, half;
    if (e < 113) { /* below 2^-14: a subnormal half (or zero) */
        if (e < 102) return (uint16_t)sign;
        const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126 - e; /* 14..24 */
        q = m >> shift;
        rem = m & ((1u << shift) - 1);
        half = 1u << (shift - 1);
    } else {
        q = ((e - 112) << 10) | ((ax & 0x7fffffu) >> 13);
        rem = ax & 0x1fffu;
        half = 0x1000u;
    }
    if (rem > half || (rem == half && (q & 1u))) q++; /* a carry into the exponent is right */
    return (uint16_t)(sign | q);
}

static inline float htp_f16_to_f32(uint16_t h) {
    htp_f32_bits b;
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;
    if (e == 0x1f) {
        b.u = sign | 0x7f800000u | (m << 13);
    } else if (e != 0) {
        b.u = sign | ((e + 112) << 23) | (m << 13);
    } else if (m == 0) {
        b.u = sign;
    } else { /* subnormal: normalize */
        uint32_t ee = 113;
        while (!(m & 0x400u)) {
            m <<= 1;
            ee--;
        }
        b.u = sign | (ee << 23) | ((m & 0x3ffu) << 13);
    }
    return b.f;
}

/* One tile's int32 row sums folded into the running per-row accumulators: the scale is the
 * exact product of the two fp16 scales; each step rounds the product once in fp32 and, with
 * fp16 accumulators, rounds it to fp16 and the sum to fp16 (HVX hf vector add). */
static inline void htp_tile_accumulate(const int32_t *isum, const uint16_t *dw, uint16_t dx,
                                       uint32_t acc_f16, uint16_t *acc16, float *acc32) {
    const float sx = htp_f16_to_f32(dx);
    for (int r = 0; r < 32; r++) {
        const float v = (float)isum[r] * (htp_f16_to_f32(dw[r]) * sx);
        if (acc_f16) {
            const float a = htp_f16_to_f32(acc16[r]) + htp_f16_to_f32(htp_f32_to_f16(v));
            acc16[r] = htp_f32_to_f16(a);
        } else {
            acc32[r] += v;
        }
    }
}

/* Scalar model of the HVX tile dot: 8 vrmpy steps (Q8_0) or 4 steps of two nibble planes
 * (Q4_0), each adding 4 int8 products per 32-bit lane. x: the block's 32 activation quants. */
static inline void htp_tile_isum_q8(const int8_t *wq, const int8_t *x, int32_t *isum) {
    for (int r = 0; r < 32; r++) isum[r] = 0;
    for (int g = 0; g < 8; g++) {
        const int8_t *v = wq + g * 128;
        const int8_t *xs = x + 4 * g;
        for (int r = 0; r < 32; r++) {
            isum[r] += v[4 * r] * xs[0] + v[4 * r + 1] * xs[1] + v[4 * r + 2] * xs[2] +
                       v[4 * r + 3] * xs[3];
        }
    }
}

static inline void htp_tile_isum_q4(const uint8_t *wq, const int8_t *x, int32_t *isum) {
    for (int r = 0; r < 32; r++) isum[r] = 0;
    for (int v = 0; v < 4; v++) {
        const uint8_t *p = wq + v * 128;
        const int8_t *lo = x + 4 * v, *hi = x + 16 + 4 * v;
        for (int r = 0; r < 32; r++) {
            int32_t s = 0;
            for (int j = 0; j < 4; j++) {
                const uint8_t b = p[4 * r + j];
                s += ((int32_t)(b & 15) - 8) * lo[j] + ((int32_t)(b >> 4) - 8) * hi[j];
            }
            isum[r] += s;
        }
    }
}

#endif
