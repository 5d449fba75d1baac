// accelplane SYCL plugin: row gathers and scatters (GET_ROWS, SET_ROWS)
// (built as one program per kernel after common.cl: program.py)

// P: dst, a, idx. dst[i0, i1, i2, i3] = a[i0, idx[i1, i2, i3], i2, i3]
__kernel void k_get_rows(params P, ulong pi, gbuf* dst, cbuf* A, cbuf* I, errw err) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS), x = td(p + 2 * TD_WORDS);
    long ix[4];
    unravel(get_global_id(0), d.ne, ix);
    long r = *(__global const int*)(I + row_off(&x, ix[2], ix[3], 0) + ix[1] * x.nb[0]);
    long od = at(&d, ix);
    if (r < 0 || r >= a.ne[1]) {  // out of range: no stray read; NaN (0 for I32) and the error bit
        st_f(dst, od, d.ty, d.ty == T_I32 ? 0.0f : NAN);
        report_error(err, ERR_GET_ROWS);
        return;
    }
    long ro = row_off(&a, r, ix[2], ix[3]);
    if (a.ty == d.ty) copy_el(dst, od, A, ro + ix[0] * a.nb[0], d.ty);
    else st_f(dst, od, d.ty, ld_el(A, &a, ro, ix[0]));
}

// P: dst, src, idx. dst[:, idx[i1, i2 % c1, i3 % c2], i2, i3] = src[:, i1, i2, i3]; one work-item
// per (element or block of a row, i2, i3) walks the rows in order, so a repeated row's last
// write wins, as in ggml. An index out of range writes nothing and sets the error bit
__kernel void k_set_rows(params P, ulong pi, gbuf* dst, cbuf* S, cbuf* I, errw err) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS), x = td(p + 2 * TD_WORDS);
    int bs = blck(d.ty);
    long g = get_global_id(0), per_row = s.ne[0] / bs;
    long c = g % per_row, i2 = (g / per_row) % s.ne[2], i3 = g / per_row / s.ne[2];
    for (long i1 = 0; i1 < s.ne[1]; ++i1) {
        long r = *(__global const int*)(I + row_off(&x, i2 % x.ne[1], i3 % x.ne[2], 0) + i1 * x.nb[0]);
        if (r < 0 || r >= d.ne[1]) {
            report_error(err, ERR_SET_ROWS);
            continue;
        }
        long so = row_off(&s, i1, i2, i3), dro = row_off(&d, r, i2, i3);
        if (bs == 1) {
            st_f(dst, dro + c * d.nb[0], d.ty, ld_el(S, &s, so, c));
        } else {
            float v[32];
            for (int j = 0; j < 32; ++j) v[j] = ld_el(S, &s, so, c * 32 + j);
            quant_block(dst + dro + c * d.nb[0], v, d.ty);
        }
    }
}
