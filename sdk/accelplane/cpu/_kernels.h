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
#define AP_T_Q8_0 8
#define AP_T_Q4_K 12
#define AP_T_Q6_K 14
#define AP_T_BF16 30

#define AP_ISA_PORTABLE 0
#define AP_ISA_AVX2 1 /* AVX2 + FMA + F16C */

#define AP_OK 0
#define AP_EINVAL -1 /* a size/stride that cannot be right (negative, K not a block multiple) */
#define AP_ETYPE -2  /* type id not handled */
#define AP_ENOMEM -3 /* workspace allocation failed */
#define AP_ERANGE -4 /* a buffer is smaller than the sizes/strides need, or a row index is out */

/* 1 when the CPU (and OS) support the AVX2+FMA+F16C path. */
int ap_cpu_has_avx2(void);
/* Select the code path (AP_ISA_*); an unsupported request falls back. Returns the one in use. */
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

/* Dequantize rows of W to float32: y[i * y_stride + k] = dequant(W[r_i, k]) for i < R where
 * r_i = rows ? rows[i] : i. Rows index W's M rows (bounds-checked). */
int ap_dequantize(int type, const void *w, int64_t w_stride, int64_t w_size, int64_t M, int64_t K,
                  const int64_t *rows, int64_t R, float *y, int64_t y_stride, int64_t y_size,
                  int nthreads);

#endif
