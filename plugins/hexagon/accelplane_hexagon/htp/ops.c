/* Elementwise, row-wise and data-movement ops of the emulated HTP. fp32 arithmetic, F16
 * operands widened on load and rounded on store (what the HVX kernels do with qf32/hf);
 * every tensor is addressed through its strides, so permuted and strided views work. */
#include <math.h>

#include "htp-ops.h"

#define FOR_ROWS(t) \
    for (int64_t i3 = 0; i3 < (t)->ne[3]; i3++) \
        for (int64_t i2 = 0; i2 < (t)->ne[2]; i2++) \
            for (int64_t i1 = 0; i1 < (t)->ne[1]; i1++)

static float act(uint32_t a, float x) {
    switch (a) {
    case HTP_ACT_SILU:
        return x / (1.0f + expf(-x));
    case HTP_ACT_GELU: {
        const float k = 0.7978845608028654f; /* sqrt(2/pi) */
        return 0.5f * x * (1.0f + tanhf(k * x * (1.0f + 0.044715f * x * x)));
    }
    case HTP_ACT_SIGMOID:
        return 1.0f / (1.0f + expf(-x));
    case HTP_ACT_NEG:
        return -x;
    case HTP_ACT_EXP:
        return expf(x);
    case HTP_ACT_TANH:
        return tanhf(x);
    case HTP_ACT_SOFTPLUS: /* ggml's: x itself above 20 */
        return x > 20.0f ? x : log1pf(expf(x));
    default:
        return NAN;
    }
}

int htp_op_binary(const htp_op_ctx *c) {
    const htp_tensor *a = &c->src[0], *b = &c->src[1], *d = &c->dst[0];
    const uint32_t op = c->op->opcode;
    FOR_ROWS(d) {
        const uint8_t *pa = htp_row(a, i1, i2, i3);
        const uint8_t *pb = htp_row(b, i1 % b->ne[1], i2 % b->ne[2], i3 % b->ne[3]);
        uint8_t *pd = htp_row(d, i1, i2, i3);
        for (int64_t i0 = 0; i0 < d->ne[0]; i0++) {
            const float x = htp_ld(pa + i0 * a->nb[0], a->type);
            const float y = htp_ld(pb + (i0 % b->ne[0]) * b->nb[0], b->type);
            float r;
            switch (op) {
            case HTP_OP_ADD: r = x + y; break;
            case HTP_OP_SUB: r = x - y; break;
            case HTP_OP_MUL: r = x * y; break;
            default: r = x / y; break;
            }
            htp_st(pd + i0 * d->nb[0], d->type, r);
        }
    }
    return HTP_OK;
}

int htp_op_scale(const htp_op_ctx *c) {
    const htp_tensor *a = &c->src[0], *d = &c->dst[0];
    const float s = c->op->kp.scale.scale, b = c->op->kp.scale.bias;
    FOR_ROWS(d) {
        const uint8_t *pa = htp_row(a, i1, i2, i3);
        uint8_t *pd = htp_row(d, i1, i2, i3);
        for (int64_t i0 = 0; i0 < d->ne[0]; i0++) {
            const float x = htp_ld(pa + i0 * a->nb[0], a->type) * s;
            htp_st(pd + i0 * d->nb[0], d->type, b != 0.0f ? x + b : x);
        }
    }
    return HTP_OK;
}

int htp_op_unary(const htp_op_ctx *c) {
    const htp_tensor *a = &c->src[0], *d = &c->dst[0];
    const uint32_t f = c->op->kp.act.act;
    FOR_ROWS(d) {
        const uint8_t *pa = htp_row(a, i1, i2, i3);
        uint8_t *pd = htp_row(d, i1, i2, i3);
        for (int64_t i0 = 0; i0 < d->ne[0]; i0++)
            htp_st(pd + i0 * d->nb[0], d->type, act(f, htp_ld(pa + i0 * a->nb[0], a->type)));
    }
    return HTP_OK;
}

int htp_op_glu(const htp_op_ctx *c) {
    const htp_act_params *p = &c->op->kp.act;
    const htp_tensor *a = &c->src[0], *b = p->split ? &c->src[0] : &c->src[1], *d = &c->dst[0];
    const int64_t nc = d->ne[0];
    /* element offsets of the activated and the gating operand within their rows */
    const int64_t ox = p->split && p->swapped ? nc : 0, og = p->split && !p->swapped ? nc : 0;
    FOR_ROWS(d) {
        const uint8_t *px = htp_row(a, i1, i2, i3), *pg = htp_row(b, i1, i2, i3);
        uint8_t *pd = htp_row(d, i1, i2, i3);
        for (int64_t i0 = 0; i0 < nc; i0++) {
            const float x = htp_ld(px + (ox + i0) * a->nb[0], a->type);
            const float g = htp_ld(pg + (og + i0) * b->nb[0], b->type);
            htp_st(pd + i0 * d->nb[0], d->type, act(p->act, x) * g);
        }
    }
    return HTP_OK;
}

static float rms_scale(const uint8_t *p, int64_t n, int64_t nb0, float eps) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float x = htp_ld(p + i * nb0, HTP_TYPE_F32);
        sum += x * x;
    }
    return 1.0f / sqrtf(sum / (float)n + eps);
}

int htp_op_norm(const htp_op_ctx *c) {
    const htp_tensor *a = &c->src[0], *d = &c->dst[0];
    const float eps = c->op->kp.norm.eps;
    const int rms = c->op->opcode == HTP_OP_RMS_NORM;
    const int64_t n = a->ne[0];
    FOR_ROWS(d) {
        const uint8_t *pa = htp_row(a, i1, i2, i3);
        uint8_t *pd = htp_row(d, i1, i2, i3);
        float mean = 0.0f, scale;
        if (rms) {
            scale = rms_scale(pa, n, a->nb[0], eps);
        } else {
            float sum = 0.0f, var = 0.0f;
            for (int64_t i = 0; i < n; i++) sum += htp_ld(pa + i * a->nb[0], HTP_TYPE_F32);
            mean = sum / (float)n;
            for (int64_t i = 0; i < n; i++) {
                const float v = htp_ld(pa + i * a->nb[0], HTP_TYPE_F32) - mean;
                var += v * v;
            }
            scale = 1.0f / sqrtf(var / (float)n + eps);
        }
        for (int64_t i = 0; i < n; i++)
            htp_st(pd + i * d->nb[0], HTP_TYPE_F32, (htp_ld(pa + i * a->nb[0], HTP_TYPE_F32) - mean) * scale);
    }
    return HTP_OK;
}

/* RMS_NORM then MUL by w (broadcast), one pass: (x * scale) * w, the same roundings as the two
 * ops apart, without storing the normalized row */
int htp_op_rms_norm_mul(const htp_op_ctx *c) {
    const htp_tensor *a = &c->src[0], *w = &c->src[1], *d = &c->dst[0];
    const float eps = c->op->kp.norm.eps;
    FOR_ROWS(d) {
        const uint8_t *pa = htp_row(a, i1, i2, i3);
        const uint8_t *pw = htp_row(w, i1 % w->ne[1], i2 % w->ne[2], i3 % w->ne[3]);
        uint8_t *pd = htp_row(d, i1, i2, i3);
        const float scale = rms_scale(pa, a->ne[0], a->nb[0], eps);
        for (int64_t i = 0; i < d->ne[0]; i++) {
            const float y = htp_ld(pa + i * a->nb[0], HTP_TYPE_F32) * scale;
            htp_st(pd + i * d->nb[0], d->type, y * htp_ld(pw + (i % w->ne[0]) * w->nb[0], w->type));
        }
    }
    return HTP_OK;
}

int htp_op_soft_max(const htp_op_ctx *c) {
    const htp_softmax_params *p = &c->op->kp.softmax;
    const htp_tensor *a = &c->src[0], *m = c->op->n_src > 1 ? &c->src[1] : NULL, *d = &c->dst[0];
    const int64_t n = a->ne[0];
    FOR_ROWS(d) {
        float slope = 1.0f;
        if (p->max_bias > 0.0f) {
            const uint32_t h = (uint32_t)i2;
            slope = h < p->n_head_log2 ? powf(p->m0, (float)(h + 1))
                                       : powf(p->m1, (float)(2 * (h - p->n_head_log2) + 1));
        }
        const uint8_t *pa = htp_row(a, i1, i2, i3);
        const uint8_t *pm = m ? htp_row(m, i1, i2 % m->ne[2], i3 % m->ne[3]) : NULL;
        uint8_t *pd = htp_row(d, i1, i2, i3);
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; i++) { /* the row goes through dst (safe in place) */
            float v = htp_ld(pa + i * a->nb[0], HTP_TYPE_F32) * p->scale;
            if (pm) v += slope * htp_ld(pm + i * m->nb[0], m->type);
            htp_st(pd + i * d->nb[0], HTP_TYPE_F32, v);
            mx = v > mx ? v : mx;
        }
        float sum = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            const float e = expf(htp_ld(pd + i * d->nb[0], HTP_TYPE_F32) - mx);
            htp_st(pd + i * d->nb[0], HTP_TYPE_F32, e);
            sum += e;
        }
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < n; i++)
            htp_st(pd + i * d->nb[0], HTP_TYPE_F32, htp_ld(pd + i * d->nb[0], HTP_TYPE_F32) * inv);
    }
    return HTP_OK;
}

int htp_op_rope(const htp_op_ctx *c) {
    const htp_rope_params *p = &c->op->kp.rope;
    const htp_tensor *a = &c->src[0], *pos = &c->src[1], *d = &c->dst[0];
    const int64_t half = p->n_dims / 2;
    float *cs = (float *)c->vtcm; /* cos/sin of the current token: 2*half floats */
    for (int64_t i3 = 0; i3 < d->ne[3]; i3++)
        for (int64_t i2 = 0; i2 < d->ne[2]; i2++) {
            const double t = (double)htp_ld_i32(pos->data + i2 * pos->nb[0]);
            for (int64_t i = 0; i < half; i++) {
                const double extrap = t * pow(p->theta_scale, (double)i);
                double theta = p->freq_scale * extrap;
                if (p->ext_factor != 0.0) {
                    double y = ((double)i - p->corr0) / fmax(0.001, p->corr1 - p->corr0);
                    y = y < 0.0 ? 0.0 : (y > 1.0 ? 1.0 : y);
                    const double mix = (1.0 - y) * p->ext_factor;
                    theta = theta * (1.0 - mix) + extrap * mix;
                }
                cs[2 * i] = (float)(cos(theta) * p->mscale);
                cs[2 * i + 1] = (float)(sin(theta) * p->mscale);
            }
            for (int64_t i1 = 0; i1 < d->ne[1]; i1++) {
                const uint8_t *pa = htp_row(a, i1, i2, i3);
                uint8_t *pd = htp_row(d, i1, i2, i3);
                for (int64_t i = 0; i < half; i++) {
                    const int64_t j0 = p->neox ? i : 2 * i, j1 = p->neox ? i + half : 2 * i + 1;
                    const float x0 = htp_ld(pa + j0 * a->nb[0], a->type);
                    const float x1 = htp_ld(pa + j1 * a->nb[0], a->type);
                    const float co = cs[2 * i], si = cs[2 * i + 1];
                    htp_st(pd + j0 * d->nb[0], d->type, x0 * co - x1 * si);
                    htp_st(pd + j1 * d->nb[0], d->type, x0 * si + x1 * co);
                }
                for (int64_t i = p->n_dims; i < d->ne[0]; i++)
                    htp_st(pd + i * d->nb[0], d->type, htp_ld(pa + i * a->nb[0], a->type));
            }
        }
    return HTP_OK;
}

static void dequant_row(const uint8_t *src, uint32_t type, int64_t n, uint8_t *dst, int64_t nb0) {
    const int q4 = type == HTP_TYPE_Q4_0;
    const int64_t bsz = q4 ? 18 : 34;
    for (int64_t b = 0; b < n / 32; b++) {
        const uint8_t *blk = src + b * bsz;
        uint16_t h;
        memcpy(&h, blk, 2);
        const float dd = htp_f16_to_f32(h);
        for (int64_t j = 0; j < 32; j++) {
            int32_t q;
            if (q4)
                q = (j < 16 ? (blk[2 + j] & 15) : (blk[2 + j - 16] >> 4)) - 8;
            else
                q = (int8_t)blk[2 + j];
            htp_st(dst + (b * 32 + j) * nb0, HTP_TYPE_F32, dd * (float)q);
        }
    }
}

int htp_op_get_rows(const htp_op_ctx *c) {
    const htp_tensor *a = &c->src[0], *idx = &c->src[1], *d = &c->dst[0];
    FOR_ROWS(d) {
        const int32_t r = htp_ld_i32(idx->data + i1 * idx->nb[0] + i2 * idx->nb[1] + i3 * idx->nb[2]);
        if (r < 0 || r >= a->ne[1]) return HTP_EINDEX;
        const uint8_t *pa = htp_row(a, r, i2, i3);
        uint8_t *pd = htp_row(d, i1, i2, i3);
        if (a->type == HTP_TYPE_Q4_0 || a->type == HTP_TYPE_Q8_0) {
            dequant_row(pa, a->type, a->ne[0], pd, d->nb[0]);
        } else if (a->type == HTP_TYPE_I32) {
            for (int64_t i0 = 0; i0 < d->ne[0]; i0++) memcpy(pd + i0 * d->nb[0], pa + i0 * a->nb[0], 4);
        } else {
            for (int64_t i0 = 0; i0 < d->ne[0]; i0++)
                htp_st(pd + i0 * d->nb[0], HTP_TYPE_F32, htp_ld(pa + i0 * a->nb[0], a->type));
        }
    }
    return HTP_OK;
}

int htp_op_set_rows(const htp_op_ctx *c) {
    /* src[0] the rows to write (F32), src[1] the row indices; dst[0] the destination */
    const htp_tensor *s = &c->src[0], *idx = &c->src[1], *d = &c->dst[0];
    for (int pass = 0; pass < 2; pass++) /* check every index before writing anything */
        FOR_ROWS(s) {
            const int32_t r = htp_ld_i32(idx->data + i1 * idx->nb[0] + (i2 % idx->ne[1]) * idx->nb[1] +
                                         (i3 % idx->ne[2]) * idx->nb[2]);
            if (r < 0 || r >= d->ne[1]) return HTP_EINDEX;
            if (pass == 0) continue;
            const uint8_t *ps = htp_row(s, i1, i2, i3);
            uint8_t *pd = htp_row(d, r, i2, i3);
            for (int64_t i0 = 0; i0 < d->ne[0]; i0++)
                htp_st(pd + i0 * d->nb[0], d->type, htp_ld(ps + i0 * s->nb[0], s->type));
        }
    return HTP_OK;
}

/* CPY / CONT / DUP: elements in row-major order; shapes may differ when the counts agree */
int htp_op_cpy(const htp_op_ctx *c) {
    const htp_tensor *a = &c->src[0], *d = &c->dst[0];
    const int same = a->type == d->type;
    const size_t esz = a->type == HTP_TYPE_F16 ? 2 : 4;
    int64_t j0 = 0, j1 = 0, j2 = 0, j3 = 0;
    FOR_ROWS(a) {
        const uint8_t *pa = htp_row(a, i1, i2, i3);
        for (int64_t i0 = 0; i0 < a->ne[0]; i0++) {
            uint8_t *pd = d->data + j0 * d->nb[0] + j1 * d->nb[1] + j2 * d->nb[2] + j3 * d->nb[3];
            if (same)
                memcpy(pd, pa + i0 * a->nb[0], esz);
            else
                htp_st(pd, d->type, htp_ld(pa + i0 * a->nb[0], a->type));
            if (++j0 == d->ne[0]) {
                j0 = 0;
                if (++j1 == d->ne[1]) {
                    j1 = 0;
                    if (++j2 == d->ne[2]) {
                        j2 = 0;
                        j3++;
                    }
                }
            }
        }
    }
    return HTP_OK;
}
