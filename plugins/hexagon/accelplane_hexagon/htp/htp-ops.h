/* NPU-side internals: tensor access helpers and the op entry points of the emulated HTP. */
#ifndef HTP_OPS_H
#define HTP_OPS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "htp-msg.h"
#include "htp-tile.h"

/* a tensor of the batch, its pointer fixed up from (buffer, offset) */
typedef struct {
    uint8_t *data;
    uint32_t type;
    int64_t ne[4];
    int64_t nb[4];
} htp_tensor;

/* what one op sees: its sources, destinations, kernel params and the batch's VTCM */
typedef struct {
    const htp_op_desc *op;
    htp_tensor src[HTP_MAX_SRC];
    htp_tensor dst[HTP_MAX_DST];
    uint8_t *vtcm;
    uint64_t vtcm_size;
} htp_op_ctx;

static inline float htp_ld(const uint8_t *p, uint32_t type) {
    if (type == HTP_TYPE_F32) {
        float v;
        memcpy(&v, p, 4);
        return v;
    }
    uint16_t h;
    memcpy(&h, p, 2);
    return htp_f16_to_f32(h);
}

static inline void htp_st(uint8_t *p, uint32_t type, float v) {
    if (type == HTP_TYPE_F32) {
        memcpy(p, &v, 4);
    } else {
        const uint16_t h = htp_f32_to_f16(v);
        memcpy(p, &h, 2);
    }
}

static inline uint8_t *htp_row(const htp_tensor *t, int64_t i1, int64_t i2, int64_t i3) {
    return t->data + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
}

static inline int32_t htp_ld_i32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

int htp_op_binary(const htp_op_ctx *c);
int htp_op_scale(const htp_op_ctx *c);
int htp_op_unary(const htp_op_ctx *c);
int htp_op_glu(const htp_op_ctx *c);
int htp_op_norm(const htp_op_ctx *c);
int htp_op_rms_norm_mul(const htp_op_ctx *c);
int htp_op_soft_max(const htp_op_ctx *c);
int htp_op_rope(const htp_op_ctx *c);
int htp_op_get_rows(const htp_op_ctx *c);
int htp_op_set_rows(const htp_op_ctx *c);
int htp_op_cpy(const htp_op_ctx *c);
int htp_op_mul_mat(const htp_op_ctx *c);
int htp_op_mul_mat_id(const htp_op_ctx *c);

#endif
