/* Row kernels of the CPU plugin's decode path (see _kernels.h): norms (optionally times a
 * weight row), soft_max with a mask, SWIGLU and ROPE over float32 rows. Each is a handful of
 * numpy calls per row in Python; a decode step runs ~180 of them on rows of a few thousand
 * floats, where numpy's per-call cost (microseconds) outweighs the arithmetic. Scalar C: the
 * compiler vectorizes the inner loops, and sums are kept in double as numpy's were.
 * Also the exact GELU, whose erf numpy lacks.
 */
#include "_kernels.h"

#include <math.h>

/* last element touched + 1 of `rows` rows of `n` at `stride`, or -1 on overflow */
static int64_t rows_extent(int64_t rows, int64_t stride, int64_t n) {
    if (rows <= 0 || n <= 0) return 0;
    int64_t e;
    if (__builtin_mul_overflow(rows - 1, stride, &e) || __builtin_add_overflow(e, n, &e)) return -1;
    return e;
}

static int rows_fit(int64_t rows, int64_t stride, int64_t n, int64_t size) {
    const int64_t e = rows_extent(rows, stride, n);
    return stride >= 0 && e >= 0 && e <= size;
}

int ap_norm_rows(int op, int64_t nrows, int64_t n, const float *x, int64_t xs, int64_t x_size,
                 float *y, int64_t ys, int64_t y_size, const float *w, int64_t ws, int64_t w_size,
                 int64_t wrows, float eps) {
    if (op < 0 || op > 2 || nrows < 0 || n < 0 || (w && wrows < 1)) return AP_EINVAL;
    if (!rows_fit(nrows, xs, n, x_size) || !rows_fit(nrows, ys, n, y_size)) return AP_ERANGE;
    if (w && !rows_fit(wrows, ws, n, w_size)) return AP_ERANGE;
    for (int64_t r = 0; r < nrows; r++) {
        const float *xr = x + r * xs;
        float *yr = y + r * ys;
        double mean = 0.0, ss = 0.0;
        if (op == 0) {
            for (int64_t i = 0; i < n; i++) mean += xr[i];
            mean /= (double)n;
        }
        for (int64_t i = 0; i < n; i++) {
            const double v = xr[i] - mean;
            ss += v * v;
        }
        double scale;
        if (op == 2) scale = 1.0 / fmax(sqrt(ss), (double)eps);
        else scale = 1.0 / sqrt(ss / (double)n + (double)eps);
        const float m = (float)mean, s = (float)scale;
        if (w) {
            const float *wr = w + (r % wrows) * ws;
            for (int64_t i = 0; i < n; i++) yr[i] = (xr[i] - m) * s * wr[i];
        } else {
            for (int64_t i = 0; i < n; i++) yr[i] = (xr[i] - m) * s;
        }
    }
    return AP_OK;
}

int ap_soft_max_rows(int64_t nrows, int64_t n, const float *x, int64_t xs, int64_t x_size, float *y,
                     int64_t ys, int64_t y_size, const float *mask, int64_t ms, int64_t m_size,
                     int64_t mrows, float scale) {
    if (nrows < 0 || n < 0 || (mask && mrows < 1)) return AP_EINVAL;
    if (!rows_fit(nrows, xs, n, x_size) || !rows_fit(nrows, ys, n, y_size)) return AP_ERANGE;
    if (mask && !rows_fit(mrows, ms, n, m_size)) return AP_ERANGE;
    for (int64_t r = 0; r < nrows; r++) {
        const float *xr = x + r * xs;
        const float *mr = mask ? mask + (r % mrows) * ms : 0;
        float *yr = y + r * ys;
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            const float v = xr[i] * scale + (mr ? mr[i] : 0.0f);
            yr[i] = v;
            mx = v > mx ? v : mx;
        }
        double sum = 0.0;
        for (int64_t i = 0; i < n; i++) {
            const float e = expf(yr[i] - mx);
            yr[i] = e;
            sum += e;
        }
        const float inv = (float)(1.0 / sum);
        for (int64_t i = 0; i < n; i++) yr[i] *= inv;
    }
    return AP_OK;
}

int ap_swiglu_rows(int64_t nrows, int64_t n, const float *x, int64_t xs, int64_t x_size,
                   const float *g, int64_t gs, int64_t g_size, float *y, int64_t ys, int64_t y_size) {
    if (nrows < 0 || n < 0) return AP_EINVAL;
    if (!rows_fit(nrows, xs, n, x_size) || !rows_fit(nrows, gs, n, g_size) ||
        !rows_fit(nrows, ys, n, y_size))
        return AP_ERANGE;
    for (int64_t r = 0; r < nrows; r++) {
        const float *xr = x + r * xs, *gr = g + r * gs;
        float *yr = y + r * ys;
        for (int64_t i = 0; i < n; i++) yr[i] = xr[i] / (1.0f + expf(-xr[i])) * gr[i];
    }
    return AP_OK;
}

int ap_rope_rows(int64_t ntok, int64_t nhead, int64_t hd, int64_t n_dims, int neox, const float *x,
                 int64_t xs_tok, int64_t xs_head, int64_t x_size, float *y, int64_t ys_tok,
                 int64_t ys_head, int64_t y_size, const float *cs, const float *sn, int64_t cs_size) {
    const int64_t half = n_dims / 2;
    if (ntok < 0 || nhead < 0 || hd < 0 || n_dims < 0 || n_dims > hd || n_dims % 2) return AP_EINVAL;
    if (xs_tok < 0 || xs_head < 0 || ys_tok < 0 || ys_head < 0) return AP_EINVAL;
    if (ntok == 0 || nhead == 0 || hd == 0) return AP_OK;
    const int64_t ex = rows_extent(ntok, xs_tok, rows_extent(nhead, xs_head, hd));
    const int64_t ey = rows_extent(ntok, ys_tok, rows_extent(nhead, ys_head, hd));
    const int64_t ec = rows_extent(ntok, half, half);
    if (ex < 0 || ex > x_size || ey < 0 || ey > y_size || ec < 0 || ec > cs_size) return AP_ERANGE;
    for (int64_t t = 0; t < ntok; t++) {
        const float *c = cs + t * half, *s = sn + t * half;
        for (int64_t h = 0; h < nhead; h++) {
            const float *xr = x + t * xs_tok + h * xs_head;
            float *yr = y + t * ys_tok + h * ys_head;
            if (neox) {
                for (int64_t i = 0; i < half; i++) {
                    const float a = xr[i], b = xr[i + half];
                    yr[i] = a * c[i] - b * s[i];
                    yr[i + half] = a * s[i] + b * c[i];
                }
            } else {
                for (int64_t i = 0; i < half; i++) {
                    const float a = xr[2 * i], b = xr[2 * i + 1];
                    yr[2 * i] = a * c[i] - b * s[i];
                    yr[2 * i + 1] = a * s[i] + b * c[i];
                }
            }
            for (int64_t i = n_dims; i < hd; i++) yr[i] = xr[i];
        }
    }
    return AP_OK;
}

int ap_gelu_erf(int64_t n, const float *x, int64_t x_size, float *y, int64_t y_size) {
    if (n < 0) return AP_EINVAL;
    if (x_size < n || y_size < n) return AP_ERANGE;
#pragma omp parallel for schedule(static) if (n >= 65536)
    for (int64_t i = 0; i < n; i++) y[i] = 0.5f * x[i] * erfcf(-x[i] * 0.70710678118654752f);
    return AP_OK;
}
