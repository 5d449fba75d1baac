/* The emulated NPU's entry point: one call executes one op batch (ggml's HTP main loop takes
 * one dspqueue request the same way: map the buffers, fix up the tensor pointers, run the
 * ops in order, answer with a status). */
#include "htp-ops.h"

typedef int (*htp_op_fn)(const htp_op_ctx *);

static const htp_op_fn OPS[HTP_OP_COUNT] = {
    [HTP_OP_ADD] = htp_op_binary,
    [HTP_OP_SUB] = htp_op_binary,
    [HTP_OP_MUL] = htp_op_binary,
    [HTP_OP_DIV] = htp_op_binary,
    [HTP_OP_SCALE] = htp_op_scale,
    [HTP_OP_UNARY] = htp_op_unary,
    [HTP_OP_GLU] = htp_op_glu,
    [HTP_OP_NORM] = htp_op_norm,
    [HTP_OP_RMS_NORM] = htp_op_norm,
    [HTP_OP_RMS_NORM_MUL] = htp_op_rms_norm_mul,
    [HTP_OP_SOFT_MAX] = htp_op_soft_max,
    [HTP_OP_ROPE] = htp_op_rope,
    [HTP_OP_GET_ROWS] = htp_op_get_rows,
    [HTP_OP_SET_ROWS] = htp_op_set_rows,
    [HTP_OP_CPY] = htp_op_cpy,
    [HTP_OP_MUL_MAT] = htp_op_mul_mat,
    [HTP_OP_MUL_MAT_ID] = htp_op_mul_mat_id,
};

/* the tensor lies inside its buffer: a host-side bug becomes an error code, not a crash */
static int tensor_ok(const htp_batch_req *req, const htp_tensor_desc *t) {
    if (t->buf >= req->n_bufs) return 0;
    const htp_buf_desc *b = &req->bufs[t->buf];
    if (t->offs > b->size || t->span > b->size - t->offs) return 0;
    for (int i = 0; i < 4; i++)
        if (t->ne[i] < 0 || t->nb[i] < 0) return 0;
    return 1;
}

static void bind(const htp_batch_req *req, int32_t idx, htp_tensor *t) {
    if (idx < 0) {
        memset(t, 0, sizeof *t);
        return;
    }
    const htp_tensor_desc *td = &req->tensors[idx];
    t->data = req->bufs[td->buf].base + td->offs;
    t->type = td->type;
    memcpy(t->ne, td->ne, sizeof t->ne);
    memcpy(t->nb, td->nb, sizeof t->nb);
}

int htp_batch_execute(const htp_batch_req *req, htp_batch_rsp *rsp) {
    rsp->status = HTP_OK;
    rsp->op = -1;
    rsp->tensor = -1;
    rsp->n_done = 0;
    for (uint32_t i = 0; i < req->n_tensors; i++)
        if (!tensor_ok(req, &req->tensors[i])) {
            rsp->status = HTP_EBOUNDS;
            rsp->tensor = (int32_t)i;
            return rsp->status;
        }
    for (uint32_t i = 0; i < req->n_ops; i++) {
        const htp_op_desc *op = &req->ops[i];
        htp_op_ctx c;
        int st = HTP_EOP;
        if (op->vtcm_need > req->vtcm_size) {
            st = HTP_EVTCM;
        } else if (op->opcode < HTP_OP_COUNT && op->n_src <= HTP_MAX_SRC && op->n_dst <= HTP_MAX_DST) {
            for (uint32_t k = 0; k < HTP_MAX_SRC; k++) {
                const int32_t s = k < op->n_src ? op->src[k] : -1;
                if (s >= (int32_t)req->n_tensors) goto fail;
                bind(req, s, &c.src[k]);
            }
            for (uint32_t k = 0; k < HTP_MAX_DST; k++) {
                const int32_t d = k < op->n_dst ? op->dst[k] : -1;
                if (d >= (int32_t)req->n_tensors) goto fail;
                bind(req, d, &c.dst[k]);
            }
            c.op = op;
            c.vtcm = req->vtcm;
            c.vtcm_size = req->vtcm_size;
            st = OPS[op->opcode](&c);
        }
    fail:
        if (st != HTP_OK) {
            rsp->status = st;
            rsp->op = (int32_t)i;
            return st;
        }
        rsp->n_done++;
    }
    return HTP_OK;
}
