/* The tiled matmul's integer kernel written with HVX intrinsics, as a freestanding Hexagon
 * executable for qemu-hexagon (the ISA tier; see hvx.py, which generates "inputs.h" and
 * builds this with clang-19 -mv67 -mhvx -mhvx-length=128B).
 *
 * One row tile of N_KT repacked weight tiles (htp/htp-tile.h) against N_X activation rows of
 * Q8_0 blocks: per tile one 32-lane int32 vector of row sums from vrmpy (int8 x int8, 4
 * products per lane per step), then the same scaling / accumulation code as the host-C
 * emulation (htp_tile_accumulate: IEEE fp32 and integer-coded fp16 rounding, so QEMU's
 * scalar float unit gives the same bits). Prints every int32 sum and every result, fp16 and
 * fp32 accumulation, as hex words; the test compares them with the emulation bit for bit.
 *
 * No libc: _start, the write/exit_group syscalls through trap0, and our own memset/memcpy.
 */
#include <hexagon_types.h>
#include <hvx_hexagon_protos.h>
#include <stdint.h>

#include "htp-tile.h"
#include "inputs.h" /* TILE_Q4 (0/1), N_KT, N_X, TILES[], XQ[], XD[] */

#define TILE_BYTES (TILE_Q4 ? 576 : 1088)
#define QBYTES (TILE_Q4 ? 512 : 1024)

void *memset(void *d, int c, unsigned long n) {
    unsigned char *p = d;
    while (n--) *p++ = (unsigned char)c;
    return d;
}

void *memcpy(void *d, const void *s, unsigned long n) {
    unsigned char *p = d;
    const unsigned char *q = s;
    while (n--) *p++ = *q++;
    return d;
}

static long sys3(long n, long a, long b, long c) {
    register long r0 __asm__("r0") = a;
    register long r1 __asm__("r1") = b;
    register long r2 __asm__("r2") = c;
    register long r6 __asm__("r6") = n;
    __asm__ volatile("trap0(#1)" : "+r"(r0) : "r"(r1), "r"(r2), "r"(r6) : "memory");
    return r0;
}

static char obuf[64 * 1024];
static unsigned olen;

static void put(const char *s) {
    while (*s) {
        if (olen == sizeof obuf) {
            sys3(64, 1, (long)obuf, olen);
            olen = 0;
        }
        obuf[olen++] = *s++;
    }
}

static void put_hex(uint32_t v) {
    char s[10];
    for (int i = 0; i < 8; i++) s[i] = "0123456789abcdef"[(v >> (28 - 4 * i)) & 15];
    s[8] = ' ';
    s[9] = 0;
    put(s);
}

/* 4 activation quants as one 32-bit word, splat across the vector: every lane (row) meets
 * the same 4 K elements */
static HVX_Vector splat4(const int8_t *x) {
    const uint32_t w = (uint32_t)(uint8_t)x[0] | (uint32_t)(uint8_t)x[1] << 8 |
                       (uint32_t)(uint8_t)x[2] << 16 | (uint32_t)(uint8_t)x[3] << 24;
    return Q6_V_vsplat_R((int)w);
}

static HVX_Vector tile_isum_hvx(const uint8_t *tile, const int8_t *x) {
    const HVX_Vector *w = (const HVX_Vector *)tile;
    HVX_Vector acc = Q6_V_vzero();
#if TILE_Q4
    const HVX_Vector m4 = Q6_V_vsplat_R(0x0f0f0f0f), k8 = Q6_V_vsplat_R(0x08080808);
    for (int v = 0; v < 4; v++) { /* low nibbles: K 4v..4v+3, high: 16+4v.. */
        const HVX_Vector lo = Q6_Vb_vsub_VbVb(Q6_V_vand_VV(w[v], m4), k8);
        const HVX_Vector hi = Q6_Vb_vsub_VbVb(Q6_V_vand_VV(Q6_Vuh_vlsr_VuhR(w[v], 4), m4), k8);
        acc = Q6_Vw_vrmpyacc_VwVbVb(acc, lo, splat4(x + 4 * v));
        acc = Q6_Vw_vrmpyacc_VwVbVb(acc, hi, splat4(x + 16 + 4 * v));
    }
#else
    for (int g = 0; g < 8; g++) acc = Q6_Vw_vrmpyacc_VwVbVb(acc, w[g], splat4(x + 4 * g));
#endif
    return acc;
}

static int32_t isum[N_X][N_KT][32] __attribute__((aligned(128)));
static uint8_t vtcm[TILE_BYTES] __attribute__((aligned(128))); /* where the DMA would put a tile */

static void run(uint32_t acc_f16, int print_isum) {
    for (int n = 0; n < N_X; n++) {
        uint16_t acc16[32];
        float acc32[32];
        memset(acc16, 0, sizeof acc16);
        memset(acc32, 0, sizeof acc32);
        for (int kt = 0; kt < N_KT; kt++) {
            const uint8_t *tile = vtcm; /* tiles are 64-byte aligned in memory, vectors need 128 */
            memcpy(vtcm, TILES + kt * TILE_BYTES, TILE_BYTES);
            *(HVX_Vector *)isum[n][kt] = tile_isum_hvx(tile, XQ + (n * N_KT + kt) * 32);
            htp_tile_accumulate(isum[n][kt], (const uint16_t *)(tile + QBYTES), XD[n * N_KT + kt],
                                acc_f16, acc16, acc32);
        }
        if (print_isum) {
            put("isum ");
            for (int kt = 0; kt < N_KT; kt++)
                for (int r = 0; r < 32; r++) put_hex((uint32_t)isum[n][kt][r]);
            put("\n");
        }
        put(acc_f16 ? "out16 " : "out32 ");
        for (int r = 0; r < 32; r++) {
            htp_f32_bits b;
            b.f = acc_f16 ? htp_f16_to_f32(acc16[r]) : acc32[r];
            put_hex(b.u);
        }
        put("\n");
    }
}

void _start(void) {
    run(1, 1);
    run(0, 0);
    put("done\n");
    sys3(64, 1, (long)obuf, olen);
    sys3(94, 0, 0, 0);
    for (;;) {
    }
}
