// accelplane SYCL plugin: reductions (SUM_ROWS, MEAN, SUM, ARGMAX, ARGSORT)
// (built as one program per kernel after common.cl: program.py)

// P: dst (F32), src, mean. one work-item per row
__kernel void k_sum_rows(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    long ix[4];
    unravel(get_global_id(0) * s.ne[0], s.ne, ix);
    long so = row_off(&s, ix[1], ix[2], ix[3]);
    acc_t sum = 0;
    for (long i = 0; i < s.ne[0]; ++i) sum += ld_el(src, &s, so, i);
    if (p[20]) sum /= s.ne[0];
    *(__global float*)(dst + row_off(&d, ix[1], ix[2], ix[3])) = (float)sum;
}

#define SUM_WG 64
// P: dst (1 element, F32), src. one work-group of SUM_WG
__kernel void k_sum(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    __local acc_t part[SUM_WG];
    int l = get_local_id(0);
    acc_t sum = 0;
    long n = nel(&s), ix[4];
    for (long i = l; i < n; i += SUM_WG) {
        unravel(i, s.ne, ix);
        sum += ld_at(src, &s, ix);
    }
    part[l] = sum;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (l == 0) {
        acc_t t = 0;
        for (int i = 0; i < SUM_WG; ++i) t += part[i];
        *(__global float*)(dst + d.off) = (float)t;
    }
}

// P: dst (I32), src (F32 matrix). first index of the row maximum
__kernel void k_argmax(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    long r = get_global_id(0), so = row_off(&s, r, 0, 0);
    float best = -INFINITY;
    int arg = 0;
    for (long i = 0; i < s.ne[0]; ++i) {
        float v = ld_el(src, &s, so, i);
        if (v > best) {
            best = v;
            arg = (int)i;
        }
    }
    *(__global int*)(dst + d.off + r * d.nb[0]) = arg;
}

// P: dst (I32), src (F32), desc. one work-item per element: its rank in the row, in a total
// order (NaN after every number in either order, ties in index order), so ranks never collide
__kernel void k_argsort(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    int desc = (int)p[20];
    long ix[4];
    unravel(get_global_id(0), s.ne, ix);
    long so = row_off(&s, ix[1], ix[2], ix[3]), i = ix[0];
    float x = ld_el(src, &s, so, i);
    long rank = 0;
    for (long j = 0; j < s.ne[0]; ++j) {
        float y = ld_el(src, &s, so, j);
        rank += isnan(x) ? (!isnan(y) || j < i)
                         : !isnan(y) && ((desc ? y > x : y < x) || (y == x && j < i));
    }
    *(__global int*)(dst + row_off(&d, ix[1], ix[2], ix[3]) + rank * d.nb[0]) = (int)i;
}
