// accelplane SYCL plugin: copies (CPY, CONT, DUP, quantizing copies) and CONCAT
// (built as one program per kernel after common.cl: program.py)

// P: dst, src. dst element i = src element i in row-major order (ne may differ, as CPY allows)
__kernel void k_cpy(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    long i = get_global_id(0), ix[4], jx[4];
    unravel(i, d.ne, ix);
    unravel(i, s.ne, jx);
    if (s.ty == d.ty) copy_el(dst, at(&d, ix), src, at(&s, jx), d.ty);  // exact, any bits
    else st_f(dst, at(&d, ix), d.ty, ld_at(src, &s, jx));
}

// P: dst (Q8_0 / Q4_0), src. one work-item per dst block of 32
__kernel void k_cpy_q(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    long e = get_global_id(0) * 32, ix[4], jx[4];
    float x[32];
    for (int j = 0; j < 32; ++j) {
        unravel(e + j, s.ne, jx);
        x[j] = ld_at(src, &s, jx);
    }
    unravel(e, d.ne, ix);
    quant_block(dst + row_off(&d, ix[1], ix[2], ix[3]) + (ix[0] / 32) * d.nb[0], x, d.ty);
}

// P: dst, src of the same block type. one work-item per block
__kernel void k_copy_blocks(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    int bs = blck(d.ty);
    long e = get_global_id(0) * bs, ix[4], jx[4];
    unravel(e, d.ne, ix);
    unravel(e, s.ne, jx);
    gbuf* o = dst + row_off(&d, ix[1], ix[2], ix[3]) + (ix[0] / bs) * d.nb[0];
    cbuf* q = src + row_off(&s, jx[1], jx[2], jx[3]) + (jx[0] / bs) * s.nb[0];
    for (long k = 0; k < d.nb[0]; ++k) o[k] = q[k];
}

// P: dst, a, b, dim. a and b have dst's type
__kernel void k_concat(params P, ulong pi, gbuf* dst, cbuf* A, cbuf* B) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS), b = td(p + 2 * TD_WORDS);
    int dim = (int)p[30];
    long ix[4];
    unravel(get_global_id(0), d.ne, ix);
    long od = at(&d, ix);
    if (ix[dim] < a.ne[dim]) {
        copy_el(dst, od, A, at(&a, ix), d.ty);
    } else {
        ix[dim] -= a.ne[dim];
        copy_el(dst, od, B, at(&b, ix), d.ty);
    }
}
