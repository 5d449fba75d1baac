// Workgroup reductions through shared memory (portable: no subgroup features needed).
// The including shader defines BLOCK (its local_size_x, a power of two).
shared float red_v[BLOCK];
shared uint red_i[BLOCK];

float block_sum(float v) {
    uint t = gl_LocalInvocationID.x;
    red_v[t] = v;
    barrier();
    for (uint s = BLOCK / 2u; s > 0u; s >>= 1) {
        if (t < s) red_v[t] += red_v[t + s];
        barrier();
    }
    float r = red_v[0];
    barrier();  // red_v may be reused right after
    return r;
}

float block_max(float v) {
    uint t = gl_LocalInvocationID.x;
    red_v[t] = v;
    barrier();
    for (uint s = BLOCK / 2u; s > 0u; s >>= 1) {
        if (t < s) red_v[t] = max(red_v[t], red_v[t + s]);
        barrier();
    }
    float r = red_v[0];
    barrier();
    return r;
}
