/* Row kernels of the CPU plugin's decode path (see _kernels.h): norms (optionally times a
 * weight row), soft_max with a mask, SWIGLU and ROPE over float32 rows. Each is a handful of
 * numpy calls per row in Python; a decode step runs ~180 of them on rows of a few thousand
 * floats, where numpy's per-call cost (microseconds) outweighs the arithmetic. Scalar C: the
 * compiler vectorizes the inner loops (each row's work compiled for AVX2+FMA and for the
 * baseline, picked at run time), sums are kept in double as numpy's were, and rows are shared among OpenMP threads once
 * a call has enough elements to pay for them. exp is evaluated inline (ap_exp) so that loops
 * calling it vectorize. Also the exact GELU, whose erf numpy lacks.
 */
#include "_kernels.h"

#include <math.h>
#include <string.h>

#define AP_PAR_MIN 32768 /* elements of a call from which its rows are shared among threads */
#define AP_BODY static inline __attribute__((always_inline))

/* A worker NAME (an AP_BODY function) compiled twice, for AVX2+FMA and for the baseline;
 * NAME##_pick() gives the one of the code path in use (ap_set_isa, ACCELPLANE_CPU_ISA). The OpenMP loops stay in the callers, which call the
 * picked worker per row: an outlined parallel region would not inherit a target attribute. */
#if defined(__x86_64__) && defined(__GNUC__)
#define AP_WORKER(name, params, args)                                                              \
    static __attribute__((target("avx2,fma,f16c"))) void name##_avx2 params { name args; }         \
    static void name##_base params { name args; }                                                  \
    static void (*name##_pick(void)) params { return ap_get_isa() >= AP_ISA_AVX2 ? name##_avx2 : name##_base; }
#else
#define AP_WORKER(name, params, args)                                                              \
    static void name##_base params { name args; }                                                  \
    static void (*name##_pick(void)) params { return name##_base; }
#endif

/* exp(hi + lo) in float32 for hi + lo in [-86.6, 88.72] (lo: a small correction to hi, 0 for a
 * plain exp), in a form the compiler vectorizes: hi + lo = n ln2 + r with |r| <= ln2/2 (hi - n ln2
 * taken before lo is added, so lo's digits are kept), e^r by its Taylor polynomial of degree 7
 * (truncation error under 1e-8 relative), 2^n through the exponent bits (as 2^(n-1) * 2, so
 * n = 128 just under the overflow threshold works). Outside that range the result is garbage:
 * for callers that know their argument's range (the exact GELU). */
AP_BODY float ap_exp2_in_range(float hi, float lo) {
    const float fn = ((hi + lo) * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float r = ((hi - fn * 0.693145751953125f) + lo) - fn * 1.428606765330187e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)fn + 126) << 23;
    float two_n1;
    memcpy(&two_n1, &bits, sizeof two_n1);
    return p * two_n1 * 2.0f;
}

/* exp(hi + lo) for any float32 hi + lo: ap_exp2_in_range on the clamped argument; results below
 * 2^-125 flush to 0, above FLT_MAX give inf, NaN stays NaN. */
AP_BODY float ap_exp2(float hi, float lo) {
    /* clamps by comparison (fminf/fmaxf are calls where NaN rules apply, and stop vectorization);
     * NaN is handled last */
    const float x = hi + lo;
    const float xc = x < -86.6f ? -86.6f : x > 88.72283f ? 88.72283f : x;
    const float hc = hi < -86.6f ? -86.6f : hi > 88.72283f ? 88.72283f : hi;
    float y = ap_exp2_in_range(hc, x == xc ? lo : 0.0f);
    y = x < -86.6f ? 0.0f : y;
    y = x > 88.72283f ? INFINITY : y;
    return x != x ? x : y;
}

AP_BODY float ap_exp(float x) { return ap_exp2(x, 0.0f); }

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

AP_BODY void norm_row(int op, int64_t n, const float *xr, float *yr, const float *wr, float eps) {
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
    if (wr) {
        for (int64_t i = 0; i < n; i++) yr[i] = (xr[i] - m) * s * wr[i];
    } else {
        for (int64_t i = 0; i < n; i++) yr[i] = (xr[i] - m) * s;
    }
}
AP_WORKER(norm_row, (int op, int64_t n, const float *xr, float *yr, const float *wr, float eps),
          (op, n, xr, yr, wr, eps))

int ap_norm_rows(int op, int64_t nrows, int64_t n, const float *x, int64_t xs, int64_t x_size,
                 float *y, int64_t ys, int64_t y_size, const float *w, int64_t ws, int64_t w_size,
                 int64_t wrows, float eps) {
    if (op < 0 || op > 2 || nrows < 0 || n < 0 || (w && wrows < 1)) return AP_EINVAL;
    if (!rows_fit(nrows, xs, n, x_size) || !rows_fit(nrows, ys, n, y_size)) return AP_ERANGE;
    if (w && !rows_fit(wrows, ws, n, w_size)) return AP_ERANGE;
    void (*f)(int, int64_t, const float *, float *, const float *, float) = norm_row_pick();
#pragma omp parallel for schedule(static) if (nrows > 1 && nrows * n >= AP_PAR_MIN)
    for (int64_t r = 0; r < nrows; r++) f(op, n, x + r * xs, y + r * ys, w ? w + (r % wrows) * ws : 0, eps);
    return AP_OK;
}

/* Reductions in 8 float lanes, so that the loops vectorize (an in-order sum does not); the lanes'
 * sums go into a double every 256 elements, which keeps long rows' totals accurate. */
#define AP_LANES 8
AP_BODY void soft_max_row(int64_t n, const float *xr, const float *mr, float *yr, float scale) {
    float m8[AP_LANES];
    for (int j = 0; j < AP_LANES; j++) m8[j] = -INFINITY;
    const int64_t nv = n - n % AP_LANES;
    for (int64_t i = 0; i < nv; i += AP_LANES)
        for (int j = 0; j < AP_LANES; j++) {
            const float v = xr[i + j] * scale + (mr ? mr[i + j] : 0.0f);
            yr[i + j] = v;
            m8[j] = v > m8[j] ? v : m8[j];
        }
    float mx = -INFINITY;
    for (int j = 0; j < AP_LANES; j++) mx = m8[j] > mx ? m8[j] : mx;
    for (int64_t i = nv; i < n; i++) {
        const float v = xr[i] * scale + (mr ? mr[i] : 0.0f);
        yr[i] = v;
        mx = v > mx ? v : mx;
    }
    double sum = 0.0;
    for (int64_t i0 = 0; i0 < nv; i0 += 256) {
        const int64_t end = i0 + 256 < nv ? i0 + 256 : nv;
        float s8[AP_LANES] = {0};
        for (int64_t i = i0; i < end; i += AP_LANES)
            for (int j = 0; j < AP_LANES; j++) {
                const float e = ap_exp(yr[i + j] - mx);
                yr[i + j] = e;
                s8[j] += e;
            }
        for (int j = 0; j < AP_LANES; j++) sum += s8[j];
    }
    for (int64_t i = nv; i < n; i++) {
        const float e = ap_exp(yr[i] - mx);
        yr[i] = e;
        sum += e;
    }
    const float inv = (float)(1.0 / sum);
    for (int64_t i = 0; i < n; i++) yr[i] *= inv;
}
AP_WORKER(soft_max_row, (int64_t n, const float *xr, const float *mr, float *yr, float scale),
          (n, xr, mr, yr, scale))

int ap_soft_max_rows(int64_t nrows, int64_t n, const float *x, int64_t xs, int64_t x_size, float *y,
                     int64_t ys, int64_t y_size, const float *mask, int64_t ms, int64_t m_size,
                     int64_t ne1, int64_t ne2, int64_t m2, int64_t m3, int64_t ms2, int64_t ms3,
                     float scale) {
    if (nrows < 0 || n < 0) return AP_EINVAL;
    if (!rows_fit(nrows, xs, n, x_size) || !rows_fit(nrows, ys, n, y_size)) return AP_ERANGE;
    if (mask) {
        if (ne1 < 1 || ne2 < 1 || m2 < 1 || m3 < 1 || ms < 0 || ms2 < 0 || ms3 < 0) return AP_EINVAL;
        int64_t e = rows_extent(ne1, ms, n), e2, e3;
        if (e < 0 || __builtin_mul_overflow(m2 - 1, ms2, &e2) || __builtin_mul_overflow(m3 - 1, ms3, &e3) ||
            __builtin_add_overflow(e, e2, &e) || __builtin_add_overflow(e, e3, &e) || e > m_size)
            return AP_ERANGE;
    }
    void (*f)(int64_t, const float *, const float *, float *, float) = soft_max_row_pick();
#pragma omp parallel for schedule(static) if (nrows > 1 && nrows * n >= AP_PAR_MIN)
    for (int64_t r = 0; r < nrows; r++) {
        const float *mr = 0;
        if (mask) {
            const int64_t i1 = r % ne1, i2 = r / ne1 % ne2, i3 = r / ne1 / ne2;
            mr = mask + (i3 % m3) * ms3 + (i2 % m2) * ms2 + i1 * ms;
        }
        f(n, x + r * xs, mr, y + r * ys, scale);
    }
    return AP_OK;
}

AP_BODY void swiglu_row(int64_t n, const float *xr, const float *gr, float *yr) {
    for (int64_t i = 0; i < n; i++) yr[i] = xr[i] / (1.0f + ap_exp(-xr[i])) * gr[i];
}
AP_WORKER(swiglu_row, (int64_t n, const float *xr, const float *gr, float *yr), (n, xr, gr, yr))

int ap_swiglu_rows(int64_t nrows, int64_t n, const float *x, int64_t xs, int64_t x_size,
                   const float *g, int64_t gs, int64_t g_size, float *y, int64_t ys, int64_t y_size) {
    if (nrows < 0 || n < 0) return AP_EINVAL;
    if (!rows_fit(nrows, xs, n, x_size) || !rows_fit(nrows, gs, n, g_size) ||
        !rows_fit(nrows, ys, n, y_size))
        return AP_ERANGE;
    void (*f)(int64_t, const float *, const float *, float *) = swiglu_row_pick();
#pragma omp parallel for schedule(static) if (nrows > 1 && nrows * n >= AP_PAR_MIN)
    for (int64_t r = 0; r < nrows; r++) f(n, x + r * xs, g + r * gs, y + r * ys);
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

/* erfc(z) for z >= 0 as t * exp(-z^2 + R(t)), t = 1 / (1 + z/2), R a polynomial fitted by least
 * squares on Chebyshev nodes of t in [1/6, 1] (z in [0, 10]), in powers of u = t - 7/12: relative
 * error under 3e-8 before float32 rounding. */
static const float ERFC_R[11] = {
    -0.55859536f, 1.3687371f,  0.09069253f, -0.40740246f, -0.0347335f, 0.29531696f,
    -0.051974688f, -0.24594554f, 0.13767299f, 0.14737679f, -0.13218641f};

/* erfc(ax / sqrt2) for ax >= 0; z^2 = ax^2 / 2 is carried as hi + lo (lo, the rounding error of
 * the product, exact by an FMA), as z * z rounded would cost the tail (ax ~ 9, z^2 ~ 40) several
 * ulps. From ax = 13 on (erfc there is below 2e-38, so x * Phi(x) is too) it is 0, which keeps the
 * exponential in range; NaN gives 0. */
AP_BODY float erfc_half(float ax) {
    const float a = ax < 13.0f ? ax : 13.0f; /* NaN: 13 */
    const float z = a * 0.70710678118654752f;
    const float t = 1.0f / (1.0f + 0.5f * z), u = t - 0.58333333f;
    float r = ERFC_R[10];
#pragma GCC unroll 10
    for (int k = 9; k >= 0; k--) r = r * u + ERFC_R[k];
    const float h = 0.5f * a, hi = h * a, lo = fmaf(h, a, -hi);
    const float e = t * ap_exp2_in_range(-hi, r - lo);
    return ax < 13.0f ? e : 0.0f;
}

AP_BODY void gelu_erf_span(int64_t n, const float *x, float *y) {
    for (int64_t i = 0; i < n; i++) {
        /* x * Phi(x), Phi(x) = erfc(-x/sqrt2)/2: from erfc(|x|/sqrt2) on either side, so the tail
         * for x << 0 keeps its relative precision */
        const float e = 0.5f * erfc_half(fabsf(x[i]));
        y[i] = x[i] * (x[i] >= 0.0f ? 1.0f - e : e);
    }
}
AP_WORKER(gelu_erf_span, (int64_t n, const float *x, float *y), (n, x, y))

int ap_gelu_erf(int64_t n, const float *x, int64_t x_size, float *y, int64_t y_size) {
    if (n < 0) return AP_EINVAL;
    if (x_size < n || y_size < n) return AP_ERANGE;
    void (*f)(int64_t, const float *, float *) = gelu_erf_span_pick();
    const int64_t span = 4096, nspan = (n + span - 1) / span;
#pragma omp parallel for schedule(static) if (n >= AP_PAR_MIN)
    for (int64_t c = 0; c < nspan; c++) f(c < nspan - 1 ? span : n - c * span, x + c * span, y + c * span);
    return AP_OK;
}

/* One row of n floats as f16 (round to nearest even: F16C's vcvtps2ph on the AVX2 path, the
 * same rounding in software on the baseline). */
AP_BODY void f16_row(int64_t n, const float *x, _Float16 *y) {
    for (int64_t i = 0; i < n; i++) y[i] = (_Float16)x[i];
}
AP_WORKER(f16_row, (int64_t n, const float *x, _Float16 *y), (n, x, y))

int ap_set_rows(int dst_f16, void *dst, int64_t ds, int64_t d_size, int64_t n_dst, int64_t n,
                const float *src, int64_t ss, int64_t s_size, int64_t nrows, const void *idx, int idx64,
                int64_t idx_size) {
    if (nrows < 0 || n < 0 || n_dst < 0 || ds < 0 || (nrows > 0 && !idx)) return AP_EINVAL;
    if (nrows > idx_size || !rows_fit(nrows, ss, n, s_size) || !rows_fit(n_dst, ds, n, d_size)) return AP_ERANGE;
    for (int64_t r = 0; r < nrows; r++) { /* every index checked before anything is written */
        const int64_t i = idx64 ? ((const int64_t *)idx)[r] : ((const int32_t *)idx)[r];
        if (i < 0 || i >= n_dst) return AP_ERANGE;
    }
    void (*f)(int64_t, const float *, _Float16 *) = f16_row_pick();
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t i = idx64 ? ((const int64_t *)idx)[r] : ((const int32_t *)idx)[r];
        if (dst_f16) f(n, src + r * ss, (_Float16 *)dst + i * ds);
        else memcpy((float *)dst + i * ds, src + r * ss, (size_t)n * sizeof(float));
    }
    return AP_OK;
}

/* a ranks before b in a descending sort that puts NaN last (numpy's argsort of -x) */
static inline int desc_before(float a, float b) { return a > b || (b != b && a == a); }

int ap_moe_topk(int64_t T, int64_t E, const float *p, int64_t ps, int64_t p_size, int32_t *order,
                int64_t o_size, int64_t k, float *w, int64_t w_size, float *total, float *normed) {
    if (T < 0 || E < 1 || k < 1 || k > E || E > INT32_MAX) return AP_EINVAL;
    if (!rows_fit(T, ps, E, p_size) || T * E > o_size || T * k > w_size) return AP_ERANGE;
    for (int64_t t = 0; t < T; t++) {
        const float *pr = p + t * ps;
        int32_t *o = order + t * E;
        for (int64_t e = 0; e < E; e++) { /* stable insertion sort: a router has tens of experts */
            int64_t j = e;
            while (j > 0 && desc_before(pr[e], pr[o[j - 1]])) {
                o[j] = o[j - 1];
                j--;
            }
            o[j] = (int32_t)e;
        }
        for (int64_t j = 0; j < k; j++) w[t * k + j] = pr[o[j]];
    }
    /* a second pass: the allocator may place total and normed in p's or order's memory (both
     * dead once the weights are gathered) and normed in w's (an in-place DIV) */
    for (int64_t t = 0; total && t < T; t++) {
        double sum = 0.0;
        for (int64_t j = 0; j < k; j++) sum += w[t * k + j];
        float s = (float)sum;
        total[t] = s;
        for (int64_t j = 0; j < k; j++) normed[t * k + j] = w[t * k + j] / s;
    }
    return AP_OK;
}
