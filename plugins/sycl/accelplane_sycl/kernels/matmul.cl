// accelplane SYCL plugin: matrix products (the plugin's own MUL_MAT and MUL_MAT_ID)
// (built as one program per kernel after common.cl: program.py)

// dot product of row ao of a (any type) and row bo of b (F32/F16, element stride bnb0) over k
inline acc_t dot_row(cbuf* A, const td_t* a, long ao, cbuf* B, const td_t* b, long bo) {
    long k = a->ne[0];
    int bs = blck(a->ty);
    acc_t sum = 0;
    if (bs == 1) {
        for (long i = 0; i < k; ++i) sum += ld_f(A, ao + i * a->nb[0], a->ty) * ld_f(B, bo + i * b->nb[0], b->ty);
        return sum;
    }
    for (long blk = 0; blk < k / bs; ++blk) {
        cbuf* q = A + ao + blk * a->nb[0];
        float part = 0.0f;
        for (int j = 0; j < bs; ++j) part += ld_q(q, j, a->ty) * ld_f(B, bo + (blk * bs + j) * b->nb[0], b->ty);
        sum += part;
    }
    return sum;
}

// P: dst, a, b. dst[m, n, i2, i3] = a[:, m, i2 / r2, i3 / r3] . b[:, n, i2, i3]
__kernel void k_mul_mat(params P, ulong pi, gbuf* dst, cbuf* A, cbuf* B) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS), b = td(p + 2 * TD_WORDS);
    long ix[4];
    unravel(get_global_id(0), d.ne, ix);
    long r2 = b.ne[2] / a.ne[2], r3 = b.ne[3] / a.ne[3];
    long ao = row_off(&a, ix[0], ix[2] / r2, ix[3] / r3), bo = row_off(&b, ix[1], ix[2], ix[3]);
    *(__global float*)(dst + at(&d, ix)) = (float)dot_row(A, &a, ao, B, &b, bo);
}

// P: dst, as, b, ids. dst[m, u, t] = as[:, m, ids[u, t]] . b[:, u % b.ne1, t]; an expert id out
// of range reads nothing, writes NaN and sets the error bit
__kernel void k_mul_mat_id(params P, ulong pi, gbuf* dst, cbuf* A, cbuf* B, cbuf* I, errw err) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS), b = td(p + 2 * TD_WORDS), x = td(p + 3 * TD_WORDS);
    long ix[4];
    unravel(get_global_id(0), d.ne, ix);
    long e = *(__global const int*)(I + x.off + ix[1] * x.nb[0] + ix[2] * x.nb[1]);
    long od = at(&d, ix);
    if (e < 0 || e >= a.ne[2]) {
        *(__global float*)(dst + od) = NAN;
        report_error(err, ERR_MUL_MAT_ID);
        return;
    }
    long ao = row_off(&a, ix[0], e, 0), bo = row_off(&b, ix[1] % b.ne[1], ix[2], 0);
    *(__global float*)(dst + od) = (float)dot_row(A, &a, ao, B, &b, bo);
}
