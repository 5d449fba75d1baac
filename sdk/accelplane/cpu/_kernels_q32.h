/* The int8 dot kernels of the 32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) and
 * their row loops, included by _kernels.c once per integer-dot code path; deliberately without an
 * include guard. The includer defines
 *   Q_TARGET      the function attribute of the path (AP_AVX2, AP_AVX2_VNNI, AP_AVX512_VNNI),
 *   Q_NAME(n)     the path's name for the function n (distinct per inclusion),
 *   Q_DOT4(u, s)  the eight int32 sums of four u8 x s8 byte products of two __m256i,
 *   Q_DPADD(acc, u, s)  acc + Q_DOT4(u, s) (one vpdpbusd on the VNNI paths),
 *   Q_DOT4_WIDE   1 when Q_DOT4 takes any u8 without saturating (vpdpbusd), else 0.
 * Otherwise the operands keep every pair of products within int16 (u <= 31 against |s| <= 127,
 * or |u| <= 128 against |s| <= 127 for the signed types), so vpmaddubsw never saturates. Every
 * path gives the same bits. Defines Q_NAME(rows_q32)(type): the row loop of a type, or NULL.
 */

/* A block's quants as Q_DOT4's unsigned operand. With Q_DOT4_WIDE (a Q_DOT4 that takes any u8
 * without saturating) the 4-bit types skip the shift of their high nibbles: the high half keeps
 * them in place, 16 times their value, so its lanes sum 16 times the products, and u32_unscale
 * scales the accumulated floats back. A power of two: the same bits as the shifted nibbles give
 * (the scales are products of two f16 values, so nothing comes near float underflow). */
AP_INLINE Q_TARGET __m256i Q_NAME(u32_dot_quants)(int type, const uint8_t *blk) {
    if (Q_DOT4_WIDE && (type == AP_T_Q4_0 || type == AP_T_Q4_1)) {
        const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + (type == AP_T_Q4_0 ? 2 : 4)));
        return _mm256_and_si256(_mm256_broadcastsi128_si256(qs),
                                _mm256_setr_m128i(_mm_set1_epi8(0x0F), _mm_set1_epi8((char)0xF0)));
    }
    return u32_quants(type, blk);
}

AP_INLINE Q_TARGET __m256 Q_NAME(u32_unscale)(int type, __m256 acc) {
    if (Q_DOT4_WIDE && (type == AP_T_Q4_0 || type == AP_T_Q4_1))
        return _mm256_mul_ps(acc, _mm256_setr_ps(1, 1, 1, 1, 0.0625f, 0.0625f, 0.0625f, 0.0625f));
    return acc;
}

/* q (unsigned, the u8 operand of Q_DOT4) against nr activation rows; d dx of 4 blocks at a time from
 * one vcvtph2ps, the correction accumulated apart and applied once */
AP_INLINE Q_TARGET void Q_NAME(dot_u32)(const int type, const int nr, int64_t nb,
                                       const uint8_t *w, const act_t *a, int64_t r0, float *out) {
    const int64_t bsz = u32_bsz(type);
    const int coff = u32_coff(type);
    const int8_t *xq[NR_MAX];
    const float *xd[NR_MAX], *xc[NR_MAX];
    __m256 acc[NR_MAX][2];
    __m128 corr[NR_MAX];
    for (int r = 0; r < nr; r++) {
        xq[r] = a->q + (r0 + r) * a->K;
        xd[r] = a->d + (r0 + r) * a->nd;
        xc[r] = a->c + (r0 + r) * a->nd;
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        corr[r] = _mm_setzero_ps();
    }
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        const uint8_t *blk = w + b * bsz;
        const __m128 dw = ld_f16x4(blk, bsz);
        const __m128 cw = coff ? ld_f16x4(blk + coff, bsz) : dw;
        __m256 sc[NR_MAX];
        for (int r = 0; r < nr; r++) {
            sc[r] = _mm256_castps128_ps256(_mm_mul_ps(dw, _mm_loadu_ps(xd[r] + b)));
            corr[r] = _mm_fmadd_ps(cw, _mm_loadu_ps(xc[r] + b), corr[r]);
        }
        for (int j = 0; j < 4; j++) {
            const __m256i qv = Q_NAME(u32_dot_quants)(type, blk + bsz * j);
            const __m256i idx = _mm256_set1_epi32(j);
            for (int r = 0; r < nr; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq[r] + (b + j) * QK));
                const __m256i s = Q_DOT4(qv, xv);
                acc[r][j & 1] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc[r], idx),
                                                _mm256_cvtepi32_ps(s), acc[r][j & 1]);
            }
        }
    }
    float tail[NR_MAX] = {0};
    for (; b < nb; b++) {
        const uint8_t *blk = w + b * bsz;
        const float dw = ld_f16_x(blk), cw = coff ? ld_f16_x(blk + coff) : dw;
        const __m256i qv = Q_NAME(u32_dot_quants)(type, blk);
        for (int r = 0; r < nr; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq[r] + b * QK));
            const __m256i s = Q_DOT4(qv, xv);
            acc[r][0] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[r][b]), _mm256_cvtepi32_ps(s),
                                        acc[r][0]);
            tail[r] += cw * xc[r][b];
        }
    }
    for (int r = 0; r < nr; r++) {
        __m128 c = _mm_add_ps(corr[r], _mm_movehl_ps(corr[r], corr[r]));
        c = _mm_add_ss(c, _mm_movehdup_ps(c));
        out[r] = hsum_ps(Q_NAME(u32_unscale)(type, _mm256_add_ps(acc[r][0], acc[r][1]))) +
                 u32_cmul(type) * (_mm_cvtss_f32(c) + tail[r]);
    }
}

#define dot_q4_0(...) Q_NAME(dot_u32)(AP_T_Q4_0, __VA_ARGS__)
#define dot_q4_1(...) Q_NAME(dot_u32)(AP_T_Q4_1, __VA_ARGS__)
#define dot_q5_0(...) Q_NAME(dot_u32)(AP_T_Q5_0, __VA_ARGS__)
#define dot_q5_1(...) Q_NAME(dot_u32)(AP_T_Q5_1, __VA_ARGS__)

/* The mat-vec of these types, two weight rows against one activation row (as dot2_q8_0: two
 * memory streams per thread, the activation block loaded once for both). Each block's scale
 * comes from a broadcast load of a small stack array (a load-port op) instead of a lane
 * permute. */
AP_INLINE Q_TARGET void Q_NAME(dot2_u32)(const int type, int64_t nb, const uint8_t *w0,
                                        const uint8_t *w1, const uint8_t *p0, const uint8_t *p1,
                                        const act_t *a, float *out) {
    const int64_t bsz = u32_bsz(type);
    const int coff = u32_coff(type);
    const int8_t *xq = a->q;
    const float *xd = a->d, *xc = a->c;
    __m256 acc0[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 acc1[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m128 corr0 = _mm_setzero_ps(), corr1 = _mm_setzero_ps();
    float s0[4], s1[4];
#define U32_DOT(BLK, XV) _mm256_cvtepi32_ps(Q_DOT4(Q_NAME(u32_dot_quants)(type, BLK), XV))
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        _mm_prefetch((const char *)(p0 + b * bsz), _MM_HINT_T0);
        _mm_prefetch((const char *)(p0 + b * bsz + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(p1 + b * bsz), _MM_HINT_T0);
        _mm_prefetch((const char *)(p1 + b * bsz + 64), _MM_HINT_T0);
        if (bsz > 18) { /* 4 blocks of 80..96 bytes may touch a third line */
            _mm_prefetch((const char *)(p0 + b * bsz + 4 * bsz - 1), _MM_HINT_T0);
            _mm_prefetch((const char *)(p1 + b * bsz + 4 * bsz - 1), _MM_HINT_T0);
        }
        const __m128 xd4 = _mm_loadu_ps(xd + b), xc4 = _mm_loadu_ps(xc + b);
        const __m128 dw0 = ld_f16x4(w0 + b * bsz, bsz), dw1 = ld_f16x4(w1 + b * bsz, bsz);
        const __m128 cw0 = coff ? ld_f16x4(w0 + b * bsz + coff, bsz) : dw0;
        const __m128 cw1 = coff ? ld_f16x4(w1 + b * bsz + coff, bsz) : dw1;
        _mm_storeu_ps(s0, _mm_mul_ps(dw0, xd4));
        _mm_storeu_ps(s1, _mm_mul_ps(dw1, xd4));
        corr0 = _mm_fmadd_ps(cw0, xc4, corr0);
        corr1 = _mm_fmadd_ps(cw1, xc4, corr1);
        for (int j = 0; j < 4; j++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (b + j) * QK));
            const __m256 p0v = U32_DOT(w0 + (b + j) * bsz, xv);
            const __m256 p1v = U32_DOT(w1 + (b + j) * bsz, xv);
            acc0[j & 1] = _mm256_fmadd_ps(_mm256_broadcast_ss(s0 + j), p0v, acc0[j & 1]);
            acc1[j & 1] = _mm256_fmadd_ps(_mm256_broadcast_ss(s1 + j), p1v, acc1[j & 1]);
        }
    }
    float t0 = 0.0f, t1 = 0.0f;
    for (; b < nb; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        const float d0 = ld_f16_x(w0 + b * bsz), d1 = ld_f16_x(w1 + b * bsz);
        const float c0 = coff ? ld_f16_x(w0 + b * bsz + coff) : d0;
        const float c1 = coff ? ld_f16_x(w1 + b * bsz + coff) : d1;
        const __m256 p0v = U32_DOT(w0 + b * bsz, xv), p1v = U32_DOT(w1 + b * bsz, xv);
        acc0[0] = _mm256_fmadd_ps(_mm256_set1_ps(d0 * xd[b]), p0v, acc0[0]);
        acc1[0] = _mm256_fmadd_ps(_mm256_set1_ps(d1 * xd[b]), p1v, acc1[0]);
        t0 += c0 * xc[b];
        t1 += c1 * xc[b];
    }
#undef U32_DOT
    corr0 = _mm_add_ps(corr0, _mm_movehl_ps(corr0, corr0));
    corr1 = _mm_add_ps(corr1, _mm_movehl_ps(corr1, corr1));
    const float c0 = _mm_cvtss_f32(_mm_add_ss(corr0, _mm_movehdup_ps(corr0))) + t0;
    const float c1 = _mm_cvtss_f32(_mm_add_ss(corr1, _mm_movehdup_ps(corr1))) + t1;
    out[0] = hsum_ps(Q_NAME(u32_unscale)(type, _mm256_add_ps(acc0[0], acc0[1]))) + u32_cmul(type) * c0;
    out[1] = hsum_ps(Q_NAME(u32_unscale)(type, _mm256_add_ps(acc1[0], acc1[1]))) + u32_cmul(type) * c1;
}

#define dot2_q4_0(...) Q_NAME(dot2_u32)(AP_T_Q4_0, __VA_ARGS__)
#define dot2_q4_1(...) Q_NAME(dot2_u32)(AP_T_Q4_1, __VA_ARGS__)
#define dot2_q5_0(...) Q_NAME(dot2_u32)(AP_T_Q5_0, __VA_ARGS__)
#define dot2_q5_1(...) Q_NAME(dot2_u32)(AP_T_Q5_1, __VA_ARGS__)

/* signed x signed via the u8 x s8 product as |w| (unsigned) times x carrying w's sign (|w| <= 128:
 * vpsignb leaves -128 as is, 128 when read unsigned) */
AP_INLINE Q_TARGET void Q_NAME(dot_s32)(const int type, const int nr, int64_t nb,
                                       const uint8_t *w, const act_t *a, int64_t r0, float *out) {
    const int64_t bsz = s32_bsz(type);
    const int8_t *xq[NR_MAX];
    const float *xd[NR_MAX];
    __m256 acc[NR_MAX][2];
    for (int r = 0; r < nr; r++) {
        xq[r] = a->q + (r0 + r) * a->K;
        xd[r] = a->d + (r0 + r) * a->nd;
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        const uint8_t *blk = w + b * bsz;
        const __m128 dw = ld_f16x4(blk, bsz);
        __m256 sc[NR_MAX];
        for (int r = 0; r < nr; r++)
            sc[r] = _mm256_castps128_ps256(_mm_mul_ps(dw, _mm_loadu_ps(xd[r] + b)));
        for (int j = 0; j < 4; j++) {
            const __m256i qv = s32_quants(type, blk + bsz * j);
            const __m256i aw = _mm256_sign_epi8(qv, qv);
            const __m256i idx = _mm256_set1_epi32(j);
            for (int r = 0; r < nr; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq[r] + (b + j) * QK));
                const __m256i s = Q_DOT4(aw, _mm256_sign_epi8(xv, qv));
                acc[r][j & 1] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc[r], idx),
                                                _mm256_cvtepi32_ps(s), acc[r][j & 1]);
            }
        }
    }
    for (; b < nb; b++) {
        const uint8_t *blk = w + b * bsz;
        const float dw = ld_f16_x(blk);
        const __m256i qv = s32_quants(type, blk);
        const __m256i aw = _mm256_sign_epi8(qv, qv);
        for (int r = 0; r < nr; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq[r] + b * QK));
            const __m256i s = Q_DOT4(aw, _mm256_sign_epi8(xv, qv));
            acc[r][0] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[r][b]), _mm256_cvtepi32_ps(s),
                                        acc[r][0]);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = hsum_ps(_mm256_add_ps(acc[r][0], acc[r][1]));
}

#define dot_q8_0(...) Q_NAME(dot_s32)(AP_T_Q8_0, __VA_ARGS__)
#define dot_iq4_nl(...) Q_NAME(dot_s32)(AP_T_IQ4_NL, __VA_ARGS__)

/* Q8_0 (IQ4_NL) mat-vec, two weight rows against one activation row: two memory streams per
 * thread keep more DRAM reads in flight (see DEF_DOT_FLOAT_2W); 4096x14336 measured ~+10% (2 threads,
 * noisy machine). The K-quants are bound by int8 arithmetic at n=1, not memory; Q4_0 was too
 * until dot2_q4_0 (4096x14336, 2 threads, alternating builds: 1.09-1.20 ms against 1.35-1.47). */
AP_INLINE Q_TARGET void Q_NAME(dot2_s32)(const int type, int64_t nb, const uint8_t *w0,
                                        const uint8_t *w1, const uint8_t *p0, const uint8_t *p1,
                                        const act_t *a, float *out) {
    const int64_t bsz = s32_bsz(type);
    const int8_t *xq = a->q;
    const float *xd = a->d;
    __m256 acc0[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 acc1[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
#define Q8_DOT(QV, XV) \
    _mm256_cvtepi32_ps(Q_DOT4(_mm256_sign_epi8(QV, QV), _mm256_sign_epi8(XV, QV)))
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        /* the next pair's bytes at the same offset: short rows (K = 2048: 2 KiB) end before the
         * hardware prefetcher has ramped up on them; 4 blocks per row per step: 136 bytes
         * (Q8_0), 3 lines, or 72 (IQ4_NL), 2 */
        _mm_prefetch((const char *)(p0 + b * bsz), _MM_HINT_T0);
        _mm_prefetch((const char *)(p0 + b * bsz + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(p1 + b * bsz), _MM_HINT_T0);
        _mm_prefetch((const char *)(p1 + b * bsz + 64), _MM_HINT_T0);
        if (bsz > 32) {
            _mm_prefetch((const char *)(p0 + b * bsz + 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(p1 + b * bsz + 128), _MM_HINT_T0);
        }
        const __m128 xd4 = _mm_loadu_ps(xd + b);
        const __m256 sc0 = _mm256_castps128_ps256(_mm_mul_ps(ld_f16x4(w0 + b * bsz, bsz), xd4));
        const __m256 sc1 = _mm256_castps128_ps256(_mm_mul_ps(ld_f16x4(w1 + b * bsz, bsz), xd4));
        for (int j = 0; j < 4; j++) {
            const __m256i idx = _mm256_set1_epi32(j);
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (b + j) * QK));
            const __m256i q0 = s32_quants(type, w0 + (b + j) * bsz);
            const __m256i q1 = s32_quants(type, w1 + (b + j) * bsz);
            acc0[j & 1] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc0, idx), Q8_DOT(q0, xv),
                                          acc0[j & 1]);
            acc1[j & 1] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc1, idx), Q8_DOT(q1, xv),
                                          acc1[j & 1]);
        }
    }
    for (; b < nb; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        const __m256i q0 = s32_quants(type, w0 + b * bsz);
        const __m256i q1 = s32_quants(type, w1 + b * bsz);
        acc0[0] = _mm256_fmadd_ps(_mm256_set1_ps(ld_f16_x(w0 + b * bsz) * xd[b]), Q8_DOT(q0, xv),
                                  acc0[0]);
        acc1[0] = _mm256_fmadd_ps(_mm256_set1_ps(ld_f16_x(w1 + b * bsz) * xd[b]), Q8_DOT(q1, xv),
                                  acc1[0]);
    }
#undef Q8_DOT
    out[0] = hsum_ps(_mm256_add_ps(acc0[0], acc0[1]));
    out[1] = hsum_ps(_mm256_add_ps(acc1[0], acc1[1]));
}

#define dot2_q8_0(...) Q_NAME(dot2_s32)(AP_T_Q8_0, __VA_ARGS__)
#define dot2_iq4_nl(...) Q_NAME(dot2_s32)(AP_T_IQ4_NL, __VA_ARGS__)

static rows_q_fn Q_NAME(rows_q32)(int type);

/* The x8 layout (x8_pack): 8 weight rows interleaved per block, so one vector holds 4
 * consecutive K elements of each of the 8 rows and one broadcast of 4 activation bytes dots
 * all 8 rows at once; a block's 8 scales convert with one vcvtph2ps and scale all 8 sums with
 * one FMA. Per activation row and block, out[r] (8 rows) += d (dx isum - cmul c): the work of
 * a block for 8 rows is what the plain layout spends on 2-3. */
AP_INLINE Q_TARGET void Q_NAME(dot_x8)(const int type, const int nr, int64_t nb, const uint8_t *g,
                                      const act_t *a, int64_t r0, __m256 *out) {
    const int q8 = type == AP_T_Q8_0;
    const int64_t gbsz = q8 ? X8_Q8_0 : X8_Q4_0;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int8_t *xq[NR_MAX];
    const float *xd[NR_MAX], *xc[NR_MAX];
    for (int r = 0; r < nr; r++) {
        xq[r] = a->q + (r0 + r) * a->K;
        xd[r] = a->d + (r0 + r) * a->nd;
        xc[r] = a->c + (r0 + r) * a->nd;
        out[r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = g + b * gbsz; /* one sequential stream: the hardware prefetcher's */
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        /* two sums per row, so that two chains of vpdpbusd (latency 4-5) run side by side */
        __m256i isum[NR_MAX], isum2[NR_MAX];
        for (int r = 0; r < nr; r++) isum[r] = isum2[r] = _mm256_setzero_si256();
        if (q8) {
            for (int s = 0; s < 8; s += 2) {
                const __m256i qv = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * s));
                const __m256i qv2 = _mm256_loadu_si256((const __m256i *)(p + 48 + 32 * s));
                const __m256i aw = _mm256_sign_epi8(qv, qv), aw2 = _mm256_sign_epi8(qv2, qv2);
                for (int r = 0; r < nr; r++) {
                    const uint8_t *xb = (const uint8_t *)(xq[r] + b * QK + 4 * s);
                    const __m256i xv = _mm256_set1_epi32((int)ld_u32(xb));
                    const __m256i xv2 = _mm256_set1_epi32((int)ld_u32(xb + 4));
                    isum[r] = Q_DPADD(isum[r], aw, _mm256_sign_epi8(xv, qv));
                    isum2[r] = Q_DPADD(isum2[r], aw2, _mm256_sign_epi8(xv2, qv2));
                }
            }
        } else {
            for (int v = 0; v < 4; v++) {
                const __m256i qb = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * v));
                const __m256i lo = _mm256_and_si256(qb, m4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4);
                for (int r = 0; r < nr; r++) {
                    const uint8_t *xb = (const uint8_t *)(xq[r] + b * QK + 4 * v);
                    const __m256i xl = _mm256_set1_epi32((int)ld_u32(xb));
                    const __m256i xh = _mm256_set1_epi32((int)ld_u32(xb + 16));
                    isum[r] = Q_DPADD(isum[r], lo, xl);
                    isum2[r] = Q_DPADD(isum2[r], hi, xh);
                }
            }
        }
        for (int r = 0; r < nr; r++) {
            const __m256 f = _mm256_cvtepi32_ps(_mm256_add_epi32(isum[r], isum2[r]));
            const __m256 t = q8 ? _mm256_mul_ps(f, _mm256_set1_ps(xd[r][b]))
                                : _mm256_fmadd_ps(f, _mm256_set1_ps(xd[r][b]), _mm256_set1_ps(-8.0f * xc[r][b]));
            out[r] = _mm256_fmadd_ps(dw, t, out[r]);
        }
    }
}

/* Rows [m0, m1) of an x8 matrix of M rows (m0 a multiple of 8): whole groups through dot_x8,
 * the plain tail rows (M % 8, after the last group) through the plain kernel. */
static Q_TARGET void Q_NAME(rows_x8)(int type, const uint8_t *w, int64_t ws, int64_t M, int64_t m0,
                                     int64_t m1, const act_t *a, int64_t N, float *y, int64_t ys) {
    const int64_t nb = a->K / QK, full = M / 8 * 8, mg = m1 < full ? m1 : full;
    for (int64_t m = m0; m < mg; m += 8) {
        const uint8_t *g = w + m * ws;
        for (int64_t r0 = 0; r0 < N; r0 += NR_MAX) {
            const int nr = N - r0 < NR_MAX ? (int)(N - r0) : NR_MAX;
            __m256 res[NR_MAX];
            switch (nr) {
            case 1: Q_NAME(dot_x8)(type, 1, nb, g, a, r0, res); break;
            case 2: Q_NAME(dot_x8)(type, 2, nb, g, a, r0, res); break;
            case 3: Q_NAME(dot_x8)(type, 3, nb, g, a, r0, res); break;
            default: Q_NAME(dot_x8)(type, 4, nb, g, a, r0, res); break;
            }
            for (int r = 0; r < nr; r++) _mm256_storeu_ps(y + (r0 + r) * ys + m, res[r]);
        }
    }
    const int64_t t0 = m0 > full ? m0 : full;
    if (t0 < m1) Q_NAME(rows_q32)(type)(w, ws, t0, m1, a, N, y, ys);
}

DEF_ROWS_Q(Q_TARGET, Q_NAME(rows_q4_0_n), dot_q4_0, 18, QK)
DEF_ROWS_Q_PAIRS(Q_TARGET, Q_NAME(rows_q4_0), Q_NAME(rows_q4_0_n), dot2_q4_0)
DEF_ROWS_Q(Q_TARGET, Q_NAME(rows_q4_1_n), dot_q4_1, 20, QK)
DEF_ROWS_Q_PAIRS(Q_TARGET, Q_NAME(rows_q4_1), Q_NAME(rows_q4_1_n), dot2_q4_1)
DEF_ROWS_Q(Q_TARGET, Q_NAME(rows_q5_0_n), dot_q5_0, 22, QK)
DEF_ROWS_Q_PAIRS(Q_TARGET, Q_NAME(rows_q5_0), Q_NAME(rows_q5_0_n), dot2_q5_0)
DEF_ROWS_Q(Q_TARGET, Q_NAME(rows_q5_1_n), dot_q5_1, 24, QK)
DEF_ROWS_Q_PAIRS(Q_TARGET, Q_NAME(rows_q5_1), Q_NAME(rows_q5_1_n), dot2_q5_1)
DEF_ROWS_Q(Q_TARGET, Q_NAME(rows_q8_0_n), dot_q8_0, 34, QK)
DEF_ROWS_Q_PAIRS(Q_TARGET, Q_NAME(rows_q8_0), Q_NAME(rows_q8_0_n), dot2_q8_0)
DEF_ROWS_Q(Q_TARGET, Q_NAME(rows_iq4_nl_n), dot_iq4_nl, 18, QK)
DEF_ROWS_Q_PAIRS(Q_TARGET, Q_NAME(rows_iq4_nl), Q_NAME(rows_iq4_nl_n), dot2_iq4_nl)

static rows_q_fn Q_NAME(rows_q32)(int type) {
    switch (type) {
    case AP_T_Q4_0: return Q_NAME(rows_q4_0);
    case AP_T_Q4_1: return Q_NAME(rows_q4_1);
    case AP_T_Q5_0: return Q_NAME(rows_q5_0);
    case AP_T_Q5_1: return Q_NAME(rows_q5_1);
    case AP_T_Q8_0: return Q_NAME(rows_q8_0);
    case AP_T_IQ4_NL: return Q_NAME(rows_iq4_nl);
    default: return NULL;
    }
}

#undef dot_q4_0
#undef dot_q4_1
#undef dot_q5_0
#undef dot_q5_1
#undef dot_q8_0
#undef dot_iq4_nl
#undef dot2_q4_0
#undef dot2_q4_1
#undef dot2_q5_0
#undef dot2_q5_1
#undef dot2_q8_0
#undef dot2_iq4_nl
