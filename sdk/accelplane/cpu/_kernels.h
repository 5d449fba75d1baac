/* accelplane CPU kernels: mat-vec / small-batch mat-mul and row dequantization for ggml types.
 *
 * All sizes and strides are int64_t. Every function is given the extent (in bytes or elements)
 * of each buffer it touches and returns AP_ERANGE instead of reading or writing past it.
 * The Python boundary (accelplane/cpu/kernels.py) validates first; these checks are a backstop.
 */
#ifndef ACCELPLANE_KERNELS_H
#define ACCELPLANE_KERNELS_H

#include <stdint.h>

/* type ids: GGUF's (same as accelplane.types.GGMLType) */
#define AP_T_F32 0
#define AP_T_F16 1
#define AP_T_Q4_0 2
#define AP_T_Q4_1 3
#define AP_T_Q5_0 6
#define AP_T_Q5_1 7
#define AP_T_Q8_0 8
#define AP_T_Q2_K 10
#define AP_T_Q3_K 11
#define AP_T_Q4_K 12
#define AP_T_Q5_K 13
#define AP_T_Q6_K 14
#define AP_T_IQ4_NL 20
#define AP_T_IQ4_XS 23
#define AP_T_BF16 30

/* A flag on the type argument of the products and ap_dequantize: W (Q4_0 or Q8_0 only; rows
 * exactly a row apart) is in the x8 layout (_kernels.c: 8 rows interleaved per block, the M % 8
 * last rows as in ggml's), made by ap_x8_convert. */
#define AP_LAYOUT_X8 0x100

#define AP_ISA_PORTABLE 0
#define AP_ISA_AVX2 1 /* AVX2 + FMA + F16C */
#define AP_ISA_AVX2_VNNI 2 /* AP_ISA_AVX2's code, int8 dot products with vpdpbusd (AVX-VNNI or AVX512-VNNI+VL) */
#define AP_ISA_AVX512 3 /* AP_ISA_AVX2_VNNI's code, and zmm kernels where they are faster (AVX-512 F, BW, VL, VNNI, VBMI) */

#define AP_OK 0
#define AP_EINVAL -1 /* a size/stride that cannot be right (negative, K not a block multiple) */
#define AP_ETYPE -2  /* type id not handled */
#define AP_ENOMEM -3 /* workspace allocation failed */
#define AP_ERANGE -4 /* a buffer is smaller than the sizes/strides need, or a row index is out */

/* 1 when the CPU (and OS) support the AVX2+FMA+F16C path. */
int ap_cpu_has_avx2(void);
/* 1 when the CPU (and OS) support the AVX2 path and AVX-VNNI, and the build has that path. */
int ap_cpu_has_avx2_vnni(void);
/* 1 when the CPU (and OS) support the AVX2-VNNI path and AVX-512 F, BW, VL, VNNI and VBMI. */
int ap_cpu_has_avx512(void);
/* Select the code path (AP_ISA_*): the levels are ordered, each a superset of the one below;
 * an unsupported request falls back to the best supported level below it. Returns the one in
 * use. */
int ap_set_isa(int isa);
int ap_get_isa(void);
/* OpenMP's default thread count (omp_get_max_threads). */
int ap_max_threads(void);

/* y[n * y_stride + m] = sum_k dequant(W[m, k]) * x[n * x_stride + k] for m < M, n < N.
 * Row m of W starts at (const uint8_t *)w + m * w_stride (bytes). w_size, x_size, y_size are the
 * extents of the three buffers from the given pointers (bytes for w, float elements for x, y).
 * nthreads <= 0 means ap_max_threads(). */
int ap_mul_mat(int type, const void *w, int64_t w_stride, int64_t w_size, int64_t M, int64_t K,
               const float *x, int64_t x_stride, int64_t x_size, int64_t N, float *y,
               int64_t y_stride, int64_t y_size, int nthreads);

/* MUL_MAT_ID of grouped rows: y[n * y_stride + m] = sum_k dequant(W_e[m, k]) * x[n * x_stride + k]
 * for n in [starts[g], starts[g + 1]) with e = experts[g], g < G (starts[0] = 0, starts[G] = N,
 * non-decreasing). W_e starts at (const uint8_t *)w + e * expert_stride, its rows w_stride bytes
 * apart; e must be in [0, E) and W_e inside w_size. Sizes as ap_mul_mat. */
int ap_mul_mat_id(int type, const void *w, int64_t expert_stride, int64_t w_stride, int64_t w_size, int64_t E,
                  int64_t M, int64_t K, const float *x, int64_t x_stride, int64_t x_size, int64_t N, float *y,
                  int64_t y_stride, int64_t y_size, const int32_t *experts, const int64_t *starts, int64_t G,
                  int nthreads);

/* MUL_MAT_ID from the expert ids themselves (ggml's form, the grouping done here): for token
 * t < T and slot u < U, e = ids[t * ids_stride + u] in [0, E) and
 * y[t * y_tok + u * y_slot + m] = sum_k dequant(W_e[m, k]) * x[t * x_tok + (u % x_slots) * x_slot + k].
 * The T * U rows are grouped by expert (in slot order within one) and multiplied as ap_mul_mat_id
 * does. Strides and sizes in elements (x, y floats; ids int32 values). An id out of range gives
 * AP_ERANGE before anything is written. */
int ap_mul_mat_id_ids(int type, const void *w, int64_t expert_stride, int64_t w_stride, int64_t w_size,
                      int64_t E, int64_t M, int64_t K, const float *x, int64_t x_tok, int64_t x_slot,
                      int64_t x_slots, int64_t x_size, const int32_t *ids, int64_t ids_stride, int64_t ids_size,
                      int64_t T, int64_t U, float *y, int64_t y_tok, int64_t y_slot, int64_t y_size,
                      int nthreads);

/* 1 when the type has an x8 layout. */
int ap_x8_supported(int type);
/* Rows [0, M) of one K-wide matrix of type (row bytes K / 32 * bsz, both buffers at least
 * M * row bytes = size bytes, not overlapping) between ggml's layout and x8: to_x8 1 packs
 * src into dst, 0 unpacks. A byte permutation, exact for any bytes. */
int ap_x8_convert(int type, int to_x8, const void *src, void *dst, int64_t M, int64_t K, int64_t size);

/* Dequantize rows of W to float32: y[i * y_stride + k] = dequant(W[r_i, k]) for i < R where
 * r_i = rows ? rows[i] : i. Rows index W's M rows (bounds-checked). */
int ap_dequantize(int type, const void *w, int64_t w_stride, int64_t w_size, int64_t M, int64_t K,
                  const int64_t *rows, int64_t R, float *y, int64_t y_stride, int64_t y_size,
                  int nthreads);

/* Row kernels of the decode path (_rowops.c): float32 rows of n elements, row r at base +
 * r * stride (strides and sizes in elements). Norm: op 0 NORM, 1 RMS_NORM, 2 L2_NORM; with w,
 * times w's row r % wrows. Soft_max: softmax(x * scale + mask row) per row, row r being (i1, i2, i3)
 * of x's [ne3][ne2][ne1] rows and its mask row mask + (i3 % m3) * ms3 + (i2 % m2) * ms2 + i1 * ms
 * (ggml's broadcast of a mask over ne2, ne3). SWIGLU:
 * silu(x) * g. ROPE: rows [ntok][nhead] of hd, the first n_dims rotated by cs/sn [ntok][n_dims/2]
 * (pairs adjacent, or halves apart with neox), the rest copied. AP_ERANGE past any extent. */
int ap_norm_rows(int op, int64_t nrows, int64_t n, const float *x, int64_t xs, int64_t x_size,
                 float *y, int64_t ys, int64_t y_size, const float *w, int64_t ws, int64_t w_size,
                 int64_t wrows, float eps);
int ap_soft_max_rows(int64_t nrows, int64_t n, const float *x, int64_t xs, int64_t x_size, float *y,
                     int64_t ys, int64_t y_size, const float *mask, int64_t ms, int64_t m_size,
                     int64_t ne1, int64_t ne2, int64_t m2, int64_t m3, int64_t ms2, int64_t ms3,
                     float scale);
int ap_swiglu_rows(int64_t nrows, int64_t n, const float *x, int64_t xs, int64_t x_size,
                   const float *g, int64_t gs, int64_t g_size, float *y, int64_t ys, int64_t y_size);
int ap_rope_rows(int64_t ntok, int64_t nhead, int64_t hd, int64_t n_dims, int neox, const float *x,
                 int64_t xs_tok, int64_t xs_head, int64_t x_size, float *y, int64_t ys_tok,
                 int64_t ys_head, int64_t y_size, const float *cs, const float *sn, int64_t cs_size);

/* Attention of NB batches of R query rows (float32, row (b, i) at q + (b * R + i) * qs, D
 * elements): out row (b, i) [DV] = softmax(scale * q K_g^T + mask row) V_g^T with g = b / r2,
 * K_g the W rows of D elements at k + g * kgs (krs bytes apart), V_g the DV rows of W elements
 * at v + g * vgs (vrs bytes apart), both F32, F16 or BF16; mask (may be NULL) row i of batch b
 * at mask + (b % m2) * ms2 + i * ms (W floats). Sizes in bytes for k and v, in elements
 * otherwise; AP_ERANGE when a buffer is smaller than its rows need. Slots masked -inf for a
 * whole block of query rows are skipped (see _kernels.c). */
int ap_attention(int ktype, const void *k, int64_t kgs, int64_t krs, int64_t k_size, int vtype,
                 const void *v, int64_t vgs, int64_t vrs, int64_t v_size, const float *q, int64_t qs,
                 int64_t q_size, const float *mask, int64_t ms, int64_t ms2, int64_t m2, int64_t m_size,
                 float *out, int64_t os, int64_t o_size, int64_t NB, int64_t r2, int64_t R, int64_t W,
                 int64_t D, int64_t DV, float scale, int nthreads);

/* A MoE router's expert choice per token t < T from its probabilities p (row t at p + t * ps, E
 * floats): order[t] (E int32, contiguous rows) = the experts by descending probability (stable;
 * NaN last), w[t] (k floats) = the top k probabilities; with total (T floats) and normed (T x k),
 * also their double sum as float and w / total, computed after all of w (total and normed may lie
 * in p's or order's memory, normed in w's). o_size, w_size: elements of order and w; total and normed (or
 * neither) hold T and T * k. */
int ap_moe_topk(int64_t T, int64_t E, const float *p, int64_t ps, int64_t p_size, int32_t *order,
                int64_t o_size, int64_t k, float *w, int64_t w_size, float *total, float *normed);

/* SET_ROWS of one 2-D slice: float row r of src (ss elements apart, s_size elements in all)
 * into row idx[r] of dst (rows of n f32, or f16 with dst_f16, ds elements apart, n_dst rows,
 * d_size elements in all); idx int64 with idx64, else int32, idx_size entries. AP_ERANGE
 * before anything is written when an index is outside [0, n_dst) or a buffer is too small. */
int ap_set_rows(int dst_f16, void *dst, int64_t ds, int64_t d_size, int64_t n_dst, int64_t n,
                const float *src, int64_t ss, int64_t s_size, int64_t nrows, const void *idx, int idx64,
                int64_t idx_size);

/* Exact GELU of n contiguous floats: y[i] = 0.5 * x[i] * erfc(-x[i] / sqrt(2)), which is ggml's
 * 0.5*x*(1 + erf(x/sqrt(2))) without the cancellation of 1 + erf for negative x. x_size, y_size:
 * the buffers' extents in elements (AP_ERANGE when smaller than n). */
int ap_gelu_erf(int64_t n, const float *x, int64_t x_size, float *y, int64_t y_size);

#endif
