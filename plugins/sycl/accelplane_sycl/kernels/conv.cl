// accelplane SYCL plugin: convolution helpers (IM2COL, COL2IM_1D)
// (built as one program per kernel after common.cl: program.py)

// P: dst, x, s0, s1, p0, p1, d0, d1, is_2d, kh, kw. dst[(c, kh, kw), ow, oh, n] (2-D) or
// [(c, kw), ow, n] (1-D), zero outside the input
__kernel void k_im2col(params P, ulong pi, gbuf* dst, cbuf* X) {
    params p = P + pi;
    td_t d = td(p), x = td(p + TD_WORDS);
    long s0 = p[20], s1 = p[21], p0 = p[22], p1 = p[23], d0 = p[24], d1 = p[25];
    int is_2d = (int)p[26];
    long kh_n = p[27], kw_n = p[28];
    long ix[4];
    unravel(get_global_id(0), d.ne, ix);
    long c = ix[0] / (kh_n * kw_n), kh = (ix[0] / kw_n) % kh_n, kw = ix[0] % kw_n;
    long ow = ix[1], oh = is_2d ? ix[2] : 0, n = is_2d ? ix[3] : ix[2];
    long iy = oh * s1 + kh * d1 - p1, ixx = ow * s0 + kw * d0 - p0;
    float v = 0.0f;
    long h = is_2d ? x.ne[1] : 1;
    if (iy >= 0 && iy < h && ixx >= 0 && ixx < x.ne[0]) {
        long jx[4] = {ixx, is_2d ? iy : c, is_2d ? c : n, is_2d ? n : 0};
        v = ld_at(X, &x, jx);
    }
    st_f(dst, at(&d, ix), d.ty, v);
}

// P: dst, a, s0, oc, p0. dst[t, c, b] = sum over i, k with t + p0 == i*s0 + k of a[c*K + k, i, b]
__kernel void k_col2im_1d(params P, ulong pi, gbuf* dst, cbuf* A) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS);
    long s0 = p[20], oc = p[21], p0 = p[22], kk = a.ne[0] / oc;
    long ix[4];
    unravel(get_global_id(0), d.ne, ix);
    long t = ix[0] + p0, c = ix[1], b = ix[2];
    acc_t sum = 0;
    for (long i = 0; i < a.ne[1]; ++i) {
        long k = t - i * s0;
        if (k >= 0 && k < kk) sum += ld_el(A, &a, row_off(&a, i, b, 0), c * kk + k);
    }
    st_f(dst, at(&d, ix), d.ty, (float)sum);
}
