/* The message format between the host side and the (emulated) NPU side of the Hexagon plugin:
 * one op batch = a table of buffers, a table of tensor descriptors and a list of op
 * descriptors whose kernel parameters the host has already computed. It plays the part of
 * ggml's htp_opbatch_req / htp_op_desc shared-memory block; here the "NPU" is host C code
 * (compiled with cffi), so buffers are plain host pointers.
 *
 * The region between the cdef markers is read by _build.py as the cffi declarations, so the
 * host (Python) and the NPU side (C) share one definition. Keep it to what cffi's cdef
 * parses: integer #defines, enums, structs, unions, prototypes.
 */
#ifndef HTP_MSG_H
#define HTP_MSG_H

#include <stdint.h>

/* cdef-begin */
#define HTP_MAX_SRC 4
#define HTP_MAX_DST 3
#define HTP_TILE_ROWS 32
#define HTP_TILE_K 32
#define HTP_Q4_0_TILE_BYTES 576
#define HTP_Q8_0_TILE_BYTES 1088
#define HTP_MM_XROWS 64 /* activation rows a matmul pass accumulates at once (VTCM: 128 B each) */
#define HTP_OK 0
#define HTP_EBOUNDS -1 /* a tensor reaches outside its buffer */
#define HTP_EINDEX -2  /* a row or expert index read from a tensor is out of range */
#define HTP_EOP -3     /* unknown opcode, or a type combination the kernel does not handle */
#define HTP_EVTCM -4   /* the op needs more scratch (VTCM) than the batch has */

/* tensor types: GGUF ids, plus the repacked (tiled) weight layouts */
enum htp_type {
    HTP_TYPE_F32 = 0,
    HTP_TYPE_F16 = 1,
    HTP_TYPE_Q4_0 = 2,
    HTP_TYPE_Q8_0 = 8,
    HTP_TYPE_I32 = 26,
    HTP_TYPE_Q4_0_TILED = 202,
    HTP_TYPE_Q8_0_TILED = 208
};

enum htp_opcode {
    HTP_OP_ADD = 0,
    HTP_OP_SUB = 1,
    HTP_OP_MUL = 2,
    HTP_OP_DIV = 3,
    HTP_OP_SCALE = 4,
    HTP_OP_UNARY = 5,
    HTP_OP_GLU = 6,
    HTP_OP_NORM = 7,
    HTP_OP_RMS_NORM = 8,
    HTP_OP_RMS_NORM_MUL = 9, /* fused RMS_NORM + MUL: src[0] x, src[1] weight */
    HTP_OP_SOFT_MAX = 10,
    HTP_OP_ROPE = 11,
    HTP_OP_GET_ROWS = 12,
    HTP_OP_SET_ROWS = 13,
    HTP_OP_CPY = 14,
    HTP_OP_MUL_MAT = 15,    /* src[0] activations, src[1..n] weights sharing them, dst[0..n-1] */
    HTP_OP_MUL_MAT_ID = 16, /* src[0] activations, src[1] experts, src[2] ids */
    HTP_OP_COUNT = 17
};

enum htp_act {
    HTP_ACT_SILU = 0,
    HTP_ACT_GELU = 1,
    HTP_ACT_SIGMOID = 2,
    HTP_ACT_NEG = 3,
    HTP_ACT_EXP = 4,
    HTP_ACT_TANH = 5,
    HTP_ACT_SOFTPLUS = 6
};

typedef struct {
    uint8_t *base;
    uint64_t size;
} htp_buf_desc;

typedef struct {
    uint32_t buf;  /* index into the batch's buffers */
    uint32_t type; /* enum htp_type */
    uint64_t offs; /* byte offset of element 0 in the buffer */
    uint64_t span; /* bytes from element 0 to the end of the last element */
    int64_t ne[4];
    int64_t nb[4];
} htp_tensor_desc;

/* kernel parameters, computed once on the host when the batch is prepared */
typedef struct {
    uint32_t n_mm;        /* weights sharing the activations: 1, or 2..3 when fused */
    uint32_t acc_f16;     /* 1: per-tile accumulators in fp16 (as the HVX kernels), 0: fp32 */
    uint32_t n_kt;        /* K tiles (K / 32) */
    uint32_t q_row_bytes; /* bytes of one dynamically quantized activation row */
    uint64_t q_offs;      /* VTCM offset of the quantized (or fp16/f32-converted) activations */
    uint64_t acc_offs;    /* VTCM offset of the per-row accumulators */
    uint64_t tile_offs;   /* VTCM offset of the staging tile for non-repacked weights */
    uint64_t hits_offs;   /* VTCM offset of MUL_MAT_ID's (token, slot) list */
} htp_mm_params;

typedef struct {
    double theta_scale; /* freq_base ** (-2 / n_dims) */
    double freq_scale;
    double ext_factor;
    double mscale; /* attn_factor with YaRN's magnitude correction folded in */
    double corr0;
    double corr1;
    int32_t n_dims;
    int32_t neox;
} htp_rope_params;

typedef struct {
    float scale;
    float max_bias;
    float m0;
    float m1;
    uint32_t n_head_log2;
} htp_softmax_params;

typedef struct {
    float eps;
} htp_norm_params;

typedef struct {
    float scale;
    float bias;
} htp_scale_params;

typedef struct {
    uint32_t act;     /* enum htp_act */
    uint32_t swapped; /* GLU: gate and value halves swapped */
    uint32_t split;   /* GLU: one source split in halves */
} htp_act_params;

typedef union {
    htp_mm_params mm;
    htp_rope_params rope;
    htp_softmax_params softmax;
    htp_norm_params norm;
    htp_scale_params scale;
    htp_act_params act;
    uint8_t raw[64];
} htp_kparams;

typedef struct {
    uint32_t opcode; /* enum htp_opcode */
    uint32_t n_src;
    uint32_t n_dst;
    int32_t src[HTP_MAX_SRC]; /* tensor indices, -1 when absent */
    int32_t dst[HTP_MAX_DST];
    uint64_t vtcm_need; /* scratch bytes the kernel uses (checked against the batch's VTCM) */
    htp_kparams kp;
} htp_op_desc;

typedef struct {
    uint32_t n_bufs;
    uint32_t n_tensors;
    uint32_t n_ops;
    const htp_buf_desc *bufs;
    const htp_tensor_desc *tensors;
    const htp_op_desc *ops;
    uint8_t *vtcm; /* the NPU's scratch (VTCM stand-in), vtcm_size bytes */
    uint64_t vtcm_size;
} htp_batch_req;

typedef struct {
    int32_t status; /* HTP_OK or an HTP_E* code */
    int32_t op;     /* index of the failing op, -1 when a tensor failed validation */
    int32_t tensor; /* index of the failing tensor, or -1 */
    uint32_t n_done;
} htp_batch_rsp;

/* Execute one batch on the emulated NPU: validate every tensor against its buffer, then run
 * the ops in order. Returns rsp->status. */
int htp_batch_execute(const htp_batch_req *req, htp_batch_rsp *rsp);

/* The tile kernel alone (what the ISA tier reproduces with HVX intrinsics): one row tile of
 * n_kt repacked tiles (type HTP_TYPE_Q8_0_TILED or HTP_TYPE_Q4_0_TILED) against n_x
 * activation rows of n_kt Q8_0 blocks (xq: n_kt*32 int8 per row; xd: n_kt fp16 scales per
 * row). isum receives the int32 sums [n_x][n_kt][32], out the accumulated results [n_x][32].
 * Returns HTP_EOP for another type. */
int htp_tile_rowdot(uint32_t type, const uint8_t *tiles, uint32_t n_kt, const int8_t *xq,
                    const uint16_t *xd, uint32_t n_x, uint32_t acc_f16, int32_t *isum, float *out);

uint16_t htp_fp32_to_fp16(float f);
float htp_fp16_to_fp32(uint16_t h);
/* cdef-end */

#endif
