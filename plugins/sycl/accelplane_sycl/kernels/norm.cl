// accelplane SYCL plugin: row-wise kernels (norms, SOFT_MAX, ROPE)
// (built as one program per kernel after common.cl: program.py)

// P: dst, src, op (0 norm, 1 rms_norm, 2 l2_norm), eps. one work-item per row
__kernel void k_norm(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    int op = (int)p[20];
    acc_t eps = pf(p, 21);
    long ix[4];
    unravel(get_global_id(0) * s.ne[0], s.ne, ix);
    long so = row_off(&s, ix[1], ix[2], ix[3]), dro = row_off(&d, ix[1], ix[2], ix[3]);
    long n = s.ne[0];
    acc_t mean = 0;
    if (op == 0) {
        for (long i = 0; i < n; ++i) mean += ld_el(src, &s, so, i);
        mean /= n;
    }
    acc_t ss = 0;
    for (long i = 0; i < n; ++i) {
        acc_t v = ld_el(src, &s, so, i) - mean;
        ss += v * v;
    }
    acc_t scale = op == 2 ? 1 / fmax(sqrt(ss), eps) : 1 / sqrt(ss / n + eps);
    for (long i = 0; i < n; ++i) {
        st_f(dst, dro + i * d.nb[0], d.ty, (float)((ld_el(src, &s, so, i) - mean) * scale));
    }
}

// P: dst, a, mask, has_mask, scale, max_bias, n_head_log2, m0, m1. one work-item per row
__kernel void k_soft_max(params P, ulong pi, gbuf* dst, cbuf* A, cbuf* M) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS), m = td(p + 2 * TD_WORDS);
    int has_mask = (int)p[30];
    float scale = pf(p, 31), max_bias = pf(p, 32);
    long n_head_log2 = p[33];
    float m0 = pf(p, 34), m1 = pf(p, 35);
    long ix[4];
    unravel(get_global_id(0) * a.ne[0], a.ne, ix);
    long ao = row_off(&a, ix[1], ix[2], ix[3]), dro = row_off(&d, ix[1], ix[2], ix[3]);
    long mo = has_mask ? row_off(&m, ix[1], ix[2] % m.ne[2], ix[3] % m.ne[3]) : 0;
    float slope = 1.0f;
    if (max_bias > 0.0f) {
        long h = ix[2];
        slope = h < n_head_log2 ? pown(m0, (int)(h + 1)) : pown(m1, (int)(2 * (h - n_head_log2) + 1));
    }
    long n = a.ne[0];
    float mx = -INFINITY;
    for (long i = 0; i < n; ++i) {
        float v = ld_el(A, &a, ao, i) * scale + (has_mask ? slope * ld_el(M, &m, mo, i) : 0.0f);
        mx = fmax(mx, v);
    }
    acc_t sum = 0;
    for (long i = 0; i < n; ++i) {
        float v = ld_el(A, &a, ao, i) * scale + (has_mask ? slope * ld_el(M, &m, mo, i) : 0.0f);
        float e = exp(v - mx);
        sum += e;
        st_f(dst, dro + i * d.nb[0], T_F32, e);  // dst is F32; rows of a are read before written
    }
    float inv = (float)(1 / sum);
    for (long i = 0; i < n; ++i) {
        long o = dro + i * d.nb[0];
        *(__global float*)(dst + o) *= inv;
    }
}

// P: dst, a, pos, freq factors (F32; pos again when absent), n_dims, mode, freq_base,
// freq_scale, ext_factor, mscale (attn_factor with YaRN's factor), corr0, corr1, has factors.
// one work-item per pair of elements (i, i + step) of a row
__kernel void k_rope(params P, ulong pi, gbuf* dst, cbuf* A, cbuf* POS, cbuf* FF) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS), ps = td(p + 2 * TD_WORDS), f = td(p + 3 * TD_WORDS);
    long n_dims = p[40];
    int neox = p[41] == 2;
    acc_t freq_base = pf(p, 42), freq_scale = pf(p, 43), ext = pf(p, 44), mscale = pf(p, 45);
    acc_t corr0 = pf(p, 46), corr1 = pf(p, 47);
    int has_ff = p[48] != 0;
    long half_row = (a.ne[0] + 1) / 2, g = get_global_id(0);
    long k = g % half_row, r = g / half_row;
    long i1 = r % a.ne[1], i2 = (r / a.ne[1]) % a.ne[2], i3 = r / a.ne[1] / a.ne[2];
    long ao = row_off(&a, i1, i2, i3), dro = row_off(&d, i1, i2, i3);
    if (2 * k >= n_dims) {  // past the rotated dims: copy the two elements through
        for (long i = 2 * k; i < min(2 * k + 2, a.ne[0]); ++i) {
            st_f(dst, dro + i * d.nb[0], d.ty, ld_el(A, &a, ao, i));
        }
        return;
    }
    long e0 = neox ? k : 2 * k, e1 = neox ? k + n_dims / 2 : 2 * k + 1;
    acc_t pos = (acc_t)*(__global const int*)(POS + ps.off + i2 * ps.nb[0]);
    acc_t theta_extrap = pos * pow(freq_base, -2 * (acc_t)k / n_dims);
    if (has_ff) theta_extrap /= (acc_t)*(__global const float*)(FF + f.off + k * f.nb[0]);
    acc_t theta = freq_scale * theta_extrap;
    if (ext != 0) {
        acc_t y = ((acc_t)k - corr0) / fmax((acc_t)0.001, corr1 - corr0);
        acc_t ramp = (1 - fmin((acc_t)1, fmax((acc_t)0, y))) * ext;
        theta = theta * (1 - ramp) + theta_extrap * ramp;
    }
    float c = (float)(cos(theta) * mscale), s = (float)(sin(theta) * mscale);
    float x0 = ld_el(A, &a, ao, e0), x1 = ld_el(A, &a, ao, e1);
    st_f(dst, dro + e0 * d.nb[0], d.ty, x0 * c - x1 * s);
    st_f(dst, dro + e1 * d.nb[0], d.ty, x0 * s + x1 * c);
}
