/* MUL_MAT / MUL_MAT_ID on the emulated HTP.
 *
 * Quantized weights (Q4_0, Q8_0) are consumed as 32x32 tiles (htp-tile.h): repacked tensors
 * are read in place, plain ones are staged tile by tile into VTCM first (as the DMA would), so
 * both run the same tile kernel. Activations are quantized on the fly to Q8_0 blocks (fp16
 * scale, 32 int8), once per op, and shared by every weight of a fused op. Per tile: int8 x
 * int8 -> int32 row sums, scaled by the two fp16 scales and added to per-row accumulators
 * kept in fp16 (or fp32, kp.mm.acc_f16 = 0).
 *
 * F32 / F16 weights take the float path: fp32 products and sums, activations rounded to
 * fp16 first for F16 weights (hf x hf products, as HVX multiplies them).
 */
#include <math.h>

#include "htp-ops.h"

enum { KIND_Q4 = 0, KIND_Q8 = 1, KIND_F32 = 2, KIND_F16 = 3 };

static int weight_kind(uint32_t type, int *tiled) {
    *tiled = type == HTP_TYPE_Q4_0_TILED || type == HTP_TYPE_Q8_0_TILED;
    switch (type) {
    case HTP_TYPE_Q4_0:
    case HTP_TYPE_Q4_0_TILED:
        return KIND_Q4;
    case HTP_TYPE_Q8_0:
    case HTP_TYPE_Q8_0_TILED:
        return KIND_Q8;
    case HTP_TYPE_F32:
        return KIND_F32;
    case HTP_TYPE_F16:
        return KIND_F16;
    default:
        return -1;
    }
}

/* --- activations --------------------------------------------------------------------------- */
/* the activations' format for a weight kind: Q8_0 blocks for both quant kinds, else f32 rows */
static int act_format(int kind) { return kind == KIND_Q4 ? KIND_Q8 : kind; }

static int8_t q8_of(float v) {
    if (!(v == v)) return 0; /* NaN: the scale carries it */
    v = roundf(v);
    return (int8_t)(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
}

/* One row of K activations -> K int8 quants then K/32 fp16 scales (Q8_0 blocks, with the
 * scales gathered after the quants so the tile loop reads 32 quants at a time). */
static void quantize_row_q8_0(const uint8_t *src, uint32_t type, int64_t nb0, int64_t K,
                              uint8_t *row) {
    int8_t *q = (int8_t *)row;
    uint16_t *d = (uint16_t *)(row + K);
    for (int64_t b = 0; b < K / 32; b++) {
        float x[32], amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            x[j] = htp_ld(src + (b * 32 + j) * nb0, type);
            amax = fmaxf(amax, fabsf(x[j]));
        }
        const float dd = amax / 127.0f;
        const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
        for (int j = 0; j < 32; j++) q[b * 32 + j] = q8_of(x[j] * id);
        d[b] = htp_f32_to_f16(dd);
    }
}

static void convert_row(const uint8_t *src, uint32_t type, int64_t nb0, int64_t K, int kind,
                        uint8_t *row) {
    float *y = (float *)row;
    for (int64_t k = 0; k < K; k++) {
        const float v = htp_ld(src + k * nb0, type);
        y[k] = kind == KIND_F16 ? htp_f16_to_f32(htp_f32_to_f16(v)) : v;
    }
}

/* every activation row of x (ne1*ne2*ne3 rows) into VTCM, row r at q + r*row_bytes */
static void prepare_activations(const htp_tensor *x, int kind, uint8_t *q, uint64_t row_bytes) {
    int64_t r = 0;
    for (int64_t i3 = 0; i3 < x->ne[3]; i3++)
        for (int64_t i2 = 0; i2 < x->ne[2]; i2++)
            for (int64_t i1 = 0; i1 < x->ne[1]; i1++, r++) {
                const uint8_t *src = htp_row(x, i1, i2, i3);
                if (kind == KIND_Q4 || kind == KIND_Q8)
                    quantize_row_q8_0(src, x->type, x->nb[0], x->ne[0], q + r * row_bytes);
                else
                    convert_row(src, x->type, x->nb[0], x->ne[0], kind, q + r * row_bytes);
            }
}

/* --- weight tiles -------------------------------------------------------------------------- */
typedef struct {
    const htp_tensor *w;
    int kind, tiled;
    int64_t n_rt, n_kt;
    uint32_t tile_bytes, qbytes;
    uint8_t *staging; /* VTCM tile for plain weights */
} weights;

static void weights_init(weights *W, const htp_tensor *w, uint8_t *staging) {
    W->w = w;
    W->kind = weight_kind(w->type, &W->tiled);
    W->n_rt = (w->ne[1] + 31) / 32;
    W->n_kt = w->ne[0] / 32;
    W->tile_bytes = W->kind == KIND_Q4 ? HTP_Q4_0_TILE_BYTES : HTP_Q8_0_TILE_BYTES;
    W->qbytes = W->kind == KIND_Q4 ? HTP_TILE_Q4_QBYTES : HTP_TILE_Q8_QBYTES;
    W->staging = staging;
}

/* tile (rt, kt) of plane (i2, i3): in place when repacked, else gathered from 32 plain rows */
static const uint8_t *get_tile(const weights *W, int64_t i2, int64_t i3, int64_t rt, int64_t kt) {
    const htp_tensor *w = W->w;
    if (W->tiled) {
        const int64_t plane = i2 + w->ne[2] * i3;
        return w->data + ((plane * W->n_rt + rt) * W->n_kt + kt) * (int64_t)W->tile_bytes;
    }
    uint8_t *t = W->staging;
    uint16_t *sc = (uint16_t *)(t + W->qbytes);
    const int q4 = W->kind == KIND_Q4;
    const int64_t bsz = q4 ? 18 : 34, groups = q4 ? 4 : 8;
    for (int64_t r = 0; r < 32; r++) {
        const int64_t row = rt * 32 + r;
        if (row >= w->ne[1]) { /* padding row: zero scale, zero quants */
            sc[r] = 0;
            for (int64_t g = 0; g < groups; g++) memset(t + g * 128 + 4 * r, q4 ? 0x88 : 0, 4);
            continue;
        }
        const uint8_t *blk = htp_row(w, row, i2, i3) + kt * bsz;
        memcpy(&sc[r], blk, 2);
        for (int64_t g = 0; g < groups; g++) memcpy(t + g * 128 + 4 * r, blk + 2 + 4 * g, 4);
    }
    return t;
}

static void tile_isum(const weights *W, const uint8_t *tile, const int8_t *x, int32_t *isum) {
    if (W->kind == KIND_Q4)
        htp_tile_isum_q4(tile, x, isum);
    else
        htp_tile_isum_q8((const int8_t *)tile, x, isum);
}

/* --- the row-tile loop, shared by MUL_MAT and MUL_MAT_ID ------------------------------------ */
/* Rows [32*rt, 32*rt+32) of one weight plane against n_x activation rows: xrow[h] is row h's
 * quantized data, its results go to out[h] + (output row) * out_nb0. */
static void rowtile(const weights *W, int64_t i2, int64_t i3, int64_t rt, const uint8_t *const *xrow,
                    int64_t n_x, uint32_t acc_f16, uint8_t *acc, uint8_t *const *out, int64_t out_nb0) {
    const int64_t n_kt = W->n_kt;
    memset(acc, 0, (size_t)n_x * 128);
    for (int64_t kt = 0; kt < n_kt; kt++) {
        const uint8_t *tile = get_tile(W, i2, i3, rt, kt);
        const uint16_t *dw = (const uint16_t *)(tile + W->qbytes);
        for (int64_t h = 0; h < n_x; h++) {
            int32_t isum[32];
            const uint16_t *xd = (const uint16_t *)(xrow[h] + n_kt * 32);
            tile_isum(W, tile, (const int8_t *)xrow[h] + kt * 32, isum);
            htp_tile_accumulate(isum, dw, xd[kt], acc_f16, (uint16_t *)(acc + h * 128),
                                (float *)(acc + h * 128));
        }
    }
    const int64_t rows = W->w->ne[1] - rt * 32 < 32 ? W->w->ne[1] - rt * 32 : 32;
    for (int64_t h = 0; h < n_x; h++) {
        const uint16_t *a16 = (const uint16_t *)(acc + h * 128);
        const float *a32 = (const float *)(acc + h * 128);
        for (int64_t r = 0; r < rows; r++) {
            const float v = acc_f16 ? htp_f16_to_f32(a16[r]) : a32[r];
            memcpy(out[h] + (rt * 32 + r) * out_nb0, &v, 4);
        }
    }
}

/* float weights: one weight row (converted to f32 in VTCM) against n_x rows */
static void float_rows(const weights *W, int64_t i2, int64_t i3, const uint8_t *const *xrow,
                       int64_t n_x, uint8_t *const *out, int64_t out_nb0) {
    const htp_tensor *w = W->w;
    const int64_t K = w->ne[0];
    float *wr = (float *)W->staging;
    for (int64_t m = 0; m < w->ne[1]; m++) {
        const uint8_t *src = htp_row(w, m, i2, i3);
        for (int64_t k = 0; k < K; k++) wr[k] = htp_ld(src + k * w->nb[0], w->type);
        for (int64_t h = 0; h < n_x; h++) {
            const float *x = (const float *)xrow[h];
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += wr[k] * x[k];
            memcpy(out[h] + m * out_nb0, &s, 4);
        }
    }
}

static void run_plane(const weights *W, int64_t i2, int64_t i3, const uint8_t *const *xrow, int64_t n_x,
                      uint32_t acc_f16, uint8_t *acc, uint8_t *const *out, int64_t out_nb0) {
    if (W->kind == KIND_F32 || W->kind == KIND_F16) {
        float_rows(W, i2, i3, xrow, n_x, out, out_nb0);
        return;
    }
    for (int64_t rt = 0; rt < W->n_rt; rt++) rowtile(W, i2, i3, rt, xrow, n_x, acc_f16, acc, out, out_nb0);
}

int htp_op_mul_mat(const htp_op_ctx *c) {
    const htp_mm_params *p = &c->op->kp.mm;
    const htp_tensor *x = &c->src[0];
    int tiled;
    const int kind = weight_kind(c->src[1].type, &tiled);
    if (kind < 0) return HTP_EOP;
    uint8_t *q = c->vtcm + p->q_offs;
    prepare_activations(x, kind, q, p->q_row_bytes);
    const int64_t N = x->ne[1];
    for (uint32_t i = 0; i < p->n_mm; i++) {
        const htp_tensor *w = &c->src[1 + i];
        const htp_tensor *d = &c->dst[i];
        weights W;
        weights_init(&W, w, c->vtcm + p->tile_offs);
        if (act_format(W.kind) != act_format(kind)) return HTP_EOP; /* fused: one activation format */
        const int64_t r2 = x->ne[2] / w->ne[2], r3 = x->ne[3] / w->ne[3];
        for (int64_t i3 = 0; i3 < x->ne[3]; i3++)
            for (int64_t i2 = 0; i2 < x->ne[2]; i2++)
                for (int64_t n0 = 0; n0 < N; n0 += HTP_MM_XROWS) {
                    const uint8_t *xrow[HTP_MM_XROWS];
                    uint8_t *out[HTP_MM_XROWS];
                    const int64_t n_x = N - n0 < HTP_MM_XROWS ? N - n0 : HTP_MM_XROWS;
                    for (int64_t h = 0; h < n_x; h++) {
                        const int64_t r = (n0 + h) + N * (i2 + x->ne[2] * i3);
                        xrow[h] = q + r * p->q_row_bytes;
                        out[h] = htp_row(d, n0 + h, i2, i3);
                    }
                    run_plane(&W, i2 / r2, i3 / r3, xrow, n_x, p->acc_f16, c->vtcm + p->acc_offs, out,
                              d->nb[0]);
                }
    }
    return HTP_OK;
}

int htp_op_mul_mat_id(const htp_op_ctx *c) {
    const htp_mm_params *p = &c->op->kp.mm;
    const htp_tensor *x = &c->src[0], *w = &c->src[1], *ids = &c->src[2], *d = &c->dst[0];
    int tiled;
    const int kind = weight_kind(w->type, &tiled);
    if (kind < 0) return HTP_EOP;
    const int64_t n_exp = w->ne[2], n_used = ids->ne[0], n_tok = ids->ne[1], b1 = x->ne[1];
    for (int64_t t = 0; t < n_tok; t++)
        for (int64_t u = 0; u < n_used; u++) {
            const int32_t e = htp_ld_i32(ids->data + u * ids->nb[0] + t * ids->nb[1]);
            if (e < 0 || e >= n_exp) return HTP_EINDEX;
        }
    uint8_t *q = c->vtcm + p->q_offs;
    prepare_activations(x, kind, q, p->q_row_bytes);
    weights W;
    weights_init(&W, w, c->vtcm + p->tile_offs);
    int32_t *hits = (int32_t *)(c->vtcm + p->hits_offs);
    for (int32_t e = 0; e < n_exp; e++) {
        /* the (token, slot) pairs routed to expert e, then its tiles once for all of them */
        int64_t nh = 0;
        for (int64_t t = 0; t < n_tok; t++)
            for (int64_t u = 0; u < n_used; u++)
                if (htp_ld_i32(ids->data + u * ids->nb[0] + t * ids->nb[1]) == e) {
                    hits[2 * nh] = (int32_t)t;
                    hits[2 * nh + 1] = (int32_t)u;
                    nh++;
                }
        for (int64_t h0 = 0; h0 < nh; h0 += HTP_MM_XROWS) {
            const uint8_t *xrow[HTP_MM_XROWS];
            uint8_t *out[HTP_MM_XROWS];
            const int64_t n_x = nh - h0 < HTP_MM_XROWS ? nh - h0 : HTP_MM_XROWS;
            for (int64_t h = 0; h < n_x; h++) {
                const int64_t t = hits[2 * (h0 + h)], u = hits[2 * (h0 + h) + 1];
                xrow[h] = q + ((u % b1) + b1 * t) * p->q_row_bytes;
                out[h] = htp_row(d, u, t, 0);
            }
            run_plane(&W, e, 0, xrow, n_x, p->acc_f16, c->vtcm + p->acc_offs, out, d->nb[0]);
        }
    }
    return HTP_OK;
}

/* --- the tile kernel alone, for the ISA tier's comparison ---------------------------------- */
int htp_tile_rowdot(uint32_t type, const uint8_t *tiles, uint32_t n_kt, const int8_t *xq,
                    const uint16_t *xd, uint32_t n_x, uint32_t acc_f16, int32_t *isum, float *out) {
    if (type != HTP_TYPE_Q8_0_TILED && type != HTP_TYPE_Q4_0_TILED) return HTP_EOP;
    const int q4 = type == HTP_TYPE_Q4_0_TILED;
    const size_t tile_bytes = q4 ? HTP_Q4_0_TILE_BYTES : HTP_Q8_0_TILE_BYTES;
    const size_t qbytes = q4 ? HTP_TILE_Q4_QBYTES : HTP_TILE_Q8_QBYTES;
    for (uint32_t n = 0; n < n_x; n++) {
        uint16_t acc16[32];
        float acc32[32];
        memset(acc16, 0, sizeof acc16);
        memset(acc32, 0, sizeof acc32);
        for (uint32_t kt = 0; kt < n_kt; kt++) {
            const uint8_t *tile = tiles + kt * tile_bytes;
            const int8_t *x = xq + ((size_t)n * n_kt + kt) * 32;
            int32_t *s = isum + ((size_t)n * n_kt + kt) * 32;
            if (q4)
                htp_tile_isum_q4(tile, x, s);
            else
                htp_tile_isum_q8((const int8_t *)tile, x, s);
            htp_tile_accumulate(s, (const uint16_t *)(tile + qbytes), xd[n * n_kt + kt], acc_f16, acc16,
                                acc32);
        }
        for (int r = 0; r < 32; r++) out[n * 32 + r] = acc_f16 ? htp_f16_to_f32(acc16[r]) : acc32[r];
    }
    return HTP_OK;
}

uint16_t htp_fp32_to_fp16(float f) { return htp_f32_to_f16(f); }

float htp_fp16_to_fp32(uint16_t h) { return htp_f16_to_f32(h); }
