// MUL_MAT of quantized weights by 1..8 columns (and MUL_MAT_ID), included by
// mul_mat_vec_q.comp (partial sums reduced with subgroupAdd, MMV_SUBGROUP defined),
// mul_mat_vec_q_sm.comp (shared memory only, for devices without subgroup arithmetic) and
// mul_mat_vec_q8.comp (MMV_Q8 too: b arrives as int8 blocks from quantize_b8.comp, and a
// slice is two packed 4x8-bit integer dot products per row and column instead of 8 FMAs
// plus the conversions of the quants; GPUs are arithmetic-bound on the float form).
//
// A workgroup computes NUM_ROWS consecutive weight rows times NCOLS columns of b. Threads
// split K into slices of 8 values (two runs of 4, so activations load as two vec4; with
// MMV_Q8, K-quant slices have runs of 8: one scale decoding and one activation block per
// run of 8); every activation load is used for all NUM_ROWS rows, which divides the
// activation traffic (an F32 per 4-bit weight would otherwise dominate) by NUM_ROWS. Small
// integers become floats by the exponent trick (bits | 0x4B000000 is 2^23 + bits, then one
// exact subtraction) rather than int-to-float conversions, a fraction of the FMA rate on GPUs.
// dst[m, n] = sum_k a[m, k] * b[n, k]; a's batch dims broadcast over b's (r2, r3).
// ID mode (NCOLS == 1): column n = (u, t) of ids [n_used, T]; expert ids in C; b column
// (u % b.ne1, t).
#ifdef MMV_SUBGROUP
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
#ifdef MMV_Q8
#extension GL_EXT_spirv_intrinsics : require
#endif
#include "common.glsl"
layout(local_size_x_id = 6) in;
layout(constant_id = 0) const uint TA = 2u;
layout(constant_id = 1) const uint TB = 0u;
layout(constant_id = 2) const uint NCOLS = 1u;
layout(constant_id = 3) const uint ID = 0u;
layout(constant_id = 4) const uint NUM_ROWS = 1u;
layout(constant_id = 5) const uint SG = 32u;  // the device's subgroup size (MMV_SUBGROUP only)
layout(constant_id = 6) const uint WG = 128u;  // threads per workgroup (a power of two)
layout(constant_id = 7) const uint A4 = 0u;  // every row of A starts 4-byte aligned (Q4_K: 32-bit loads)
layout(push_constant) uniform PC {
    uvec4 ne; uvec4 nba; uvec4 nbb; uvec4 nbd; uint K; uint offa; uint offb; uint offd;
    uint r2; uint r3; uint offc; uint nbc0; uint nbc1; uint n_as;
} pc;

// 32-bit view of A: Q4_K blocks (144 bytes) are 4-byte aligned when their row is
layout(std430, binding = 0) buffer A_w32 { uint Aw[]; };
layout(std430, binding = 1) buffer B_w32 { uint Bw[]; };  // int8 activations (MMV_Q8)

const uint NOUT = NCOLS * NUM_ROWS;
#ifdef MMV_SUBGROUP
const uint NPART = (WG + SG - 1u) / SG;  // partial sums per output: one per subgroup
#else
const uint NPART = WG;  // one per thread
#endif
shared float red[NOUT * NPART];

uint arow[NUM_ROWS];  // first 16-bit word of each row of A (rows past M clamp to M - 1)
uint bcol[NCOLS];  // first element of each column of b
bool cok[NCOLS];  // column exists
bool bvec;  // F32 b, unit stride, 16-byte aligned columns: vec4 loads
float acc[NOUT];  // acc[c * NUM_ROWS + r]

const float MAGIC = 8388608.0;  // 2^23: uintBitsToFloat(0x4B000000 | v) == MAGIC + v, v < 2^23

// the 4 bytes of v as floats (MAGIC + byte)
vec4 bytes_f(uint v) {
    return vec4(uintBitsToFloat(0x4B000000u | (v & 0xFFu)), uintBitsToFloat(0x4B000000u | ((v >> 8) & 0xFFu)),
                uintBitsToFloat(0x4B000000u | ((v >> 16) & 0xFFu)), uintBitsToFloat(0x4B000000u | (v >> 24)));
}
float small_f(uint v) { return uintBitsToFloat(0x4B000000u | v) - MAGIC; }  // exact for v < 2^23

// 32 bits at 16-bit word w of A (2-byte aligned: two 16-bit loads)
uint A16x2(uint w) { return uint(Ah[w]) | (uint(Ah[w + 1u]) << 16); }
// 32 bits at 16-bit word w of A, w even when A4
uint A32(uint w) { return A4 != 0u ? Aw[w >> 1] : A16x2(w); }

#ifdef MMV_Q8
const uint RW = (TA == T_Q4_K || TA == T_Q6_K) ? 2u : 1u;  // words (of 4 quants) per run
#else
const uint RW = 1u;
#endif

// slice positions: slices per block, and the first k of the slice's two runs of 4 * RW values
uint slices_per_block() { return (TA == T_Q4_K || TA == T_Q6_K) ? 32u / RW : 4u; }
uvec2 slice_k(uint sl) {
    uint spb = slices_per_block();
    uint blk = sl / spb, s = sl % spb;
    if (TA == T_Q4_0) return uvec2(32u * blk + 4u * s, 32u * blk + 4u * s + 16u);  // low, high nibbles
    if (TA == T_Q8_0) return uvec2(32u * blk + 8u * s, 32u * blk + 8u * s + 4u);
    uint per = 8u / RW;  // slices per 32 bytes of quants
    if (TA == T_Q4_K) {  // qs bytes 32p + 4 RW i: low nibbles in sub-block 2p, high in 2p + 1
        uint k = 256u * blk + 64u * (s / per) + 4u * RW * (s % per);
        return uvec2(k, k + 32u);
    }
    // Q6_K: half h, quarters q and q + 2 (low and high nibble of the same ql bytes)
    uint k = 256u * blk + 128u * (s / (2u * per)) + 32u * ((s / per) & 1u) + 4u * RW * (s % per);
    return uvec2(k, k + 64u);
}

// quant bias of each type: a weight is sc * (u - BIAS) (- mn for Q4_K), u an unsigned byte
uint bias() { return TA == T_Q4_0 ? 8u : TA == T_Q8_0 ? 128u : TA == T_Q6_K ? 32u : 0u; }

// slice sl of the row at word w: its quants as unsigned bytes (ua, ub: the two runs, RW
// words each; .y unused when RW is 1) and per-run scale and min: run a of the slice is
// sum_j (sc.x * (ua_j - bias) - mn.x) * b_j
void weight_slice(uint w, uint sl, out uvec2 ua, out uvec2 ub, out vec2 sc, out vec2 mn) {
    uint spb = slices_per_block();
    uint s = sl % spb;
    w += (sl / spb) * block_words(TA);
    mn = vec2(0.0);
    ua = uvec2(0u);
    ub = uvec2(0u);
    if (TA == T_Q4_0) {
        uint x = A16x2(w + 1u + 2u * s);
        ua.x = x & 0x0F0F0F0Fu;
        ub.x = (x >> 4) & 0x0F0F0F0Fu;
        sc = vec2(f16_to_f32(uint(Ah[w])));
    } else if (TA == T_Q8_0) {  // signed bytes biased by 128 (xor) so that they read as unsigned
        ua.x = A16x2(w + 1u + 4u * s) ^ 0x80808080u;
        ub.x = A16x2(w + 3u + 4u * s) ^ 0x80808080u;
        sc = vec2(f16_to_f32(uint(Ah[w])));
    } else if (TA == T_Q4_K) {
        uint per = 8u / RW, p = s / per, i = s % per;
        vec2 dm = unpackHalf2x16(A32(w));
        uint s0 = A32(w + 2u), s1 = A32(w + 4u), s2 = A32(w + 6u);  // scales[0..11]
        uint q = w + 8u + 16u * p + 2u * RW * i;
        uvec2 x = uvec2(A32(q), RW == 2u ? A32(q + 2u) : 0u);
        // 6-bit scale and min of sub-blocks 2p and 2p + 1 (bytes 2(p & 1), +1: a 16-bit pair)
        uint sh = 16u * (p & 1u), scp, mnp;
        if (p < 2u) {
            scp = (s0 >> sh) & 0x3F3Fu;
            mnp = (s1 >> sh) & 0x3F3Fu;
        } else {
            scp = ((s2 >> sh) & 0x0F0Fu) | ((s0 >> (sh + 2u)) & 0x3030u);
            mnp = ((s2 >> (sh + 4u)) & 0x0F0Fu) | ((s1 >> (sh + 2u)) & 0x3030u);
        }
        sc = dm.x * vec2(small_f(scp & 0xFFu), small_f(scp >> 8));
        mn = dm.y * vec2(small_f(mnp & 0xFFu), small_f(mnp >> 8));
        ua = x & 0x0F0F0F0Fu;
        ub = (x >> 4) & 0x0F0F0F0Fu;
    } else {  // Q6_K: ql[128] qh[64] scales[16] d
        uint per = 8u / RW;
        uint h = s / (2u * per), q = (s / per) & 1u, l0 = 4u * RW * (s % per);
        uint lw = w + 32u * h + 16u * q + l0 / 2u, hw = w + 64u + 16u * h + l0 / 2u;
        uvec2 x = uvec2(A16x2(lw), RW == 2u ? A16x2(lw + 2u) : 0u);
        uvec2 hh = uvec2(A16x2(hw), RW == 2u ? A16x2(hw + 2u) : 0u);
        uint si = 8u * h + 2u * q + (l0 >> 4);  // scale index of run a (one per 16 values); run b: si + 4
        uint bsh = 8u * (si & 1u);
        uint sa = (uint(Ah[w + 96u + (si >> 1)]) >> bsh) & 0xFFu;
        uint sb = (uint(Ah[w + 98u + (si >> 1)]) >> bsh) & 0xFFu;
        float d = f16_to_f32(uint(Ah[w + 104u]));
        sc = d * vec2(small_f(sa ^ 0x80u) - 128.0, small_f(sb ^ 0x80u) - 128.0);
        ua = (x & 0x0F0F0F0Fu) | (((hh >> (2u * q)) & 0x03030303u) << 4);
        ub = ((x >> 4) & 0x0F0F0F0Fu) | (((hh >> (2u * q + 4u)) & 0x03030303u) << 4);
    }
}

#ifdef MMV_Q8
// OpSDotKHR / OpSUDotKHR on packed 4x8-bit operands (PackedVectorFormat4x8Bit = 0):
// glslang before GL_EXT_integer_dot_product emits them through spirv_intrinsics
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4450)
int sdot4(uint a, uint b, spirv_literal int fmt);
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4452)
int sudot4(uint a, uint b, spirv_literal int fmt);
// exact for |v| < 2^22: 1.5 * 2^23 + v has v in its low mantissa bits (no int-to-float op)
float int_f(int v) { return uintBitsToFloat(0x4B400000u + uint(v)) - 12582912.0; }
// int8 activations x (RW words) . unsigned quants u
int dot_run(uvec2 x, uvec2 u) { return sudot4(x.x, u.x, 0) + (RW == 2u ? sudot4(x.y, u.y, 0) : 0); }
int sum_run(uvec2 x) { return sdot4(x.x, 0x01010101u, 0) + (RW == 2u ? sdot4(x.y, 0x01010101u, 0) : 0); }

uint qcol[NCOLS];  // first word of each column's int8 values in B (the scratch region)
uint dcol[NCOLS];  // first word of each column's block scales

uvec2 load_x(uint c, uint k) {
    if (!cok[c]) return uvec2(0u);
    uint i = qcol[c] + (k >> 2);
    return uvec2(Bw[i], RW == 2u ? Bw[i + 1u] : 0u);
}

void do_slice(uint sl) {
    uvec2 k = slice_k(sl);
    uvec2 xa[NCOLS], xb[NCOLS];
    int sa[NCOLS], sb[NCOLS];  // sums of the int8 activations: for biases and mins
    float da[NCOLS], db[NCOLS];  // activation block scales
    for (uint c = 0u; c < NCOLS; ++c) {
        xa[c] = load_x(c, k.x);
        xb[c] = load_x(c, k.y);
        da[c] = cok[c] ? Bf[dcol[c] + (k.x >> 5)] : 0.0;
        db[c] = TA == T_Q4_0 || TA == T_Q8_0 ? da[c] : cok[c] ? Bf[dcol[c] + (k.y >> 5)] : 0.0;
        sa[c] = sum_run(xa[c]);
        sb[c] = sum_run(xb[c]);
    }
    for (uint r = 0u; r < NUM_ROWS; ++r) {
        uvec2 ua, ub;
        vec2 sc, mn;
        weight_slice(arow[r], sl, ua, ub, sc, mn);
        int bi = int(bias());
        for (uint c = 0u; c < NCOLS; ++c) {
            int ia = dot_run(xa[c], ua), ib = dot_run(xb[c], ub);
            float v;
            if (TA == T_Q4_0 || TA == T_Q8_0) {
                v = sc.x * da[c] * int_f(ia + ib - bi * (sa[c] + sb[c]));
            } else if (TA == T_Q4_K) {
                v = da[c] * (sc.x * int_f(ia) - mn.x * int_f(sa[c])) + db[c] * (sc.y * int_f(ib) - mn.y * int_f(sb[c]));
            } else {
                v = sc.x * da[c] * int_f(ia - bi * sa[c]) + sc.y * db[c] * int_f(ib - bi * sb[c]);
            }
            acc[c * NUM_ROWS + r] += v;
        }
    }
}
#else
vec4 load_b4(uint c, uint k) {
    if (bvec) return Bf4[(bcol[c] + k) >> 2];
    uint i = bcol[c] + k * pc.nbb.x;
    return vec4(B_load(TB, i), B_load(TB, i + pc.nbb.x), B_load(TB, i + 2u * pc.nbb.x), B_load(TB, i + 3u * pc.nbb.x));
}

void do_slice(uint sl) {
    uvec2 k = slice_k(sl);
    vec4 ba[NCOLS], bb[NCOLS];
    for (uint c = 0u; c < NCOLS; ++c) {
        ba[c] = cok[c] ? load_b4(c, k.x) : vec4(0.0);
        bb[c] = cok[c] ? load_b4(c, k.y) : vec4(0.0);
    }
    for (uint r = 0u; r < NUM_ROWS; ++r) {
        uvec2 ua, ub;
        vec2 sc, mn;
        weight_slice(arow[r], sl, ua, ub, sc, mn);
        float off = MAGIC + float(bias());
        vec4 qa = bytes_f(ua.x) - off, qb = bytes_f(ub.x) - off;
        for (uint c = 0u; c < NCOLS; ++c) {
            float v;
            if (TA == T_Q4_0 || TA == T_Q8_0) {
                v = sc.x * (dot(qa, ba[c]) + dot(qb, bb[c]));
            } else {
                v = sc.x * dot(qa, ba[c]) + sc.y * dot(qb, bb[c]);
                if (TA == T_Q4_K) v -= mn.x * dot(ba[c], vec4(1.0)) + mn.y * dot(bb[c], vec4(1.0));
            }
            acc[c * NUM_ROWS + r] += v;
        }
    }
}
#endif

void main() {
    uint M = pc.ne.x;
    uint nrb = (M + NUM_ROWS - 1u) / NUM_ROWS;
    uint ncb = (pc.ne.y + NCOLS - 1u) / NCOLS;
    uint lin = group_id();
    if (lin >= nrb * ncb * pc.ne.z * pc.ne.w) return;
    uint m0 = (lin % nrb) * NUM_ROWS;
    uint cb = (lin / nrb) % ncb;
    uint batch = lin / (nrb * ncb);
    uint i2 = batch % pc.ne.z, i3 = batch / pc.ne.z;
    uint t = gl_LocalInvocationID.x;

    uint abase, dbase;
    if (ID != 0u) {  // NCOLS == 1; (u, tok) = (cb, i2)
        int e = Ci[pc.offc + cb * pc.nbc0 + i2 * pc.nbc1];
        dbase = pc.offd + m0 * pc.nbd.x + cb * pc.nbd.y + i2 * pc.nbd.z;
        if (e < 0 || uint(e) >= pc.n_as) {  // bad expert id: zeros and error bit 4, no stray read
            if (t < NUM_ROWS && m0 + t < M) Df[dbase + t * pc.nbd.x] = 0.0;
            if (t == 0u && m0 == 0u) report_error(4u);
            return;
        }
        abase = pc.offa + uint(e) * pc.nba.z;
        bcol[0] = pc.offb + (cb % pc.r2) * pc.nbb.y + i2 * pc.nbb.z;
        cok[0] = true;
    } else {
        abase = pc.offa + (i2 / pc.r2) * pc.nba.z + (i3 / pc.r3) * pc.nba.w;
        dbase = pc.offd + m0 * pc.nbd.x + cb * NCOLS * pc.nbd.y + i2 * pc.nbd.z + i3 * pc.nbd.w;
        for (uint c = 0u; c < NCOLS; ++c) {
            uint n = cb * NCOLS + c;
            cok[c] = n < pc.ne.y;
            bcol[c] = pc.offb + n * pc.nbb.y + i2 * pc.nbb.z + i3 * pc.nbb.w;
        }
    }
    for (uint r = 0u; r < NUM_ROWS; ++r) arow[r] = abase + min(m0 + r, M - 1u) * pc.nba.y;
#ifdef MMV_Q8  // b quantized by quantize_b8 into a region at word offb: bytes, then scales
    uint cols = ID != 0u ? pc.r2 * pc.ne.z : pc.ne.y * pc.ne.z * pc.ne.w;
    for (uint c = 0u; c < NCOLS; ++c) {
        uint col = ID != 0u ? cb % pc.r2 + pc.r2 * i2 : cb * NCOLS + c + pc.ne.y * (i2 + pc.ne.z * i3);
        qcol[c] = pc.offb + col * (pc.K / 4u);
        dcol[c] = pc.offb + cols * (pc.K / 4u) + col * (pc.K / 32u);
    }
#endif
    bvec = TB == T_F32 && pc.nbb.x == 1u;
    for (uint c = 0u; c < NCOLS; ++c) bvec = bvec && (bcol[c] & 3u) == 0u;
    for (uint o = 0u; o < NOUT; ++o) acc[o] = 0.0;

    // two slices per iteration: more independent loads in flight
    uint nsl = pc.K / (8u * RW);
    uint sl = t;
    for (; sl + WG < nsl; sl += 2u * WG) {
        do_slice(sl);
        do_slice(sl + WG);
    }
    if (sl < nsl) do_slice(sl);

#ifdef MMV_SUBGROUP
    for (uint o = 0u; o < NOUT; ++o) acc[o] = subgroupAdd(acc[o]);
    // SPIR-V 1.5 pipelines run at the device's subgroup size SG; the bound only guards red[]
    if (gl_SubgroupInvocationID == 0u && gl_SubgroupID < NPART) {
        for (uint o = 0u; o < NOUT; ++o) red[o * NPART + gl_SubgroupID] = acc[o];
    }
#else
    for (uint o = 0u; o < NOUT; ++o) red[o * NPART + t] = acc[o];
#endif
    barrier();
    if (NPART > 8u) {  // tree over the partial sums of all outputs at once
        for (uint s = NPART / 2u; s > 0u; s >>= 1) {
            for (uint j = t; j < NOUT * s; j += WG) {
                uint o = j / s, i = j % s;
                red[o * NPART + i] += red[o * NPART + i + s];
            }
            barrier();
        }
    }
    for (uint o = t; o < NOUT; o += WG) {
        uint c = o / NUM_ROWS, r = o % NUM_ROWS;
        float v = red[o * NPART];
        if (NPART <= 8u) {
            for (uint i = 1u; i < NPART; ++i) v += red[o * NPART + i];
        }
        if (cok[c] && m0 + r < M) Df[dbase + r * pc.nbd.x + c * pc.nbd.y] = v;
    }
}
