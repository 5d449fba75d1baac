// Shared by every accelplane Vulkan shader: type ids, aliased storage bindings, loads and
// stores by element type, quantized-block decoding and encoding, index helpers.
//
// Bindings: A = 0 (src0), B = 1 (src1), C = 2 (src2), D = 3 (dst). Each binding is declared
// as f32, u16 and i32 arrays over the same memory, so one pipeline layout serves all types;
// element types are specialization constants, so the unused branches fold away when the
// pipeline is created. Offsets and strides in push constants are in units of the type's
// element (f32/i32: 4 bytes, f16/bf16: 2 bytes, quantized blocks: 2-byte words).
#extension GL_EXT_shader_16bit_storage : require

#define T_F32 0u
#define T_F16 1u
#define T_Q4_0 2u
#define T_Q4_1 3u
#define T_Q5_0 6u
#define T_Q5_1 7u
#define T_Q8_0 8u
#define T_Q2_K 10u
#define T_Q3_K 11u
#define T_Q4_K 12u
#define T_Q5_K 13u
#define T_Q6_K 14u
#define T_IQ4_NL 20u
#define T_IQ4_XS 23u
#define T_I32 26u
#define T_BF16 30u

#define DECLARE_BUFFER(bind, N) \
    layout(std430, binding = bind) buffer N##_f32 { float N##f[]; }; \
    layout(std430, binding = bind) buffer N##_u16 { uint16_t N##h[]; }; \
    layout(std430, binding = bind) buffer N##_i32 { int N##i[]; };

DECLARE_BUFFER(0, A)
// 16-byte views of A for vector loads (matrix-vector products)
layout(std430, binding = 0) buffer A_v4 { vec4 Af4[]; };
layout(std430, binding = 0) buffer A_u4 { uvec4 Au4[]; };
layout(std430, binding = 1) buffer B_v4 { vec4 Bf4[]; };
DECLARE_BUFFER(1, B)
DECLARE_BUFFER(2, C)
DECLARE_BUFFER(3, D)
// the stream's error word: kernels that meet a bad index OR in a bit (see runtime.ERRORS)
layout(std430, binding = 4) buffer ERR { uint err_word[]; };
void report_error(uint bit) { atomicOr(err_word[0], bit); }

bool is_quant(uint t) { return t != T_F32 && t != T_F16 && t != T_BF16 && t != T_I32; }

// --- conversions ---------------------------------------------------------------------------
// f32 -> f16 and f32 -> bf16 with round-to-nearest-even done in integers: the rounding of
// SPIR-V float conversions is implementation-defined, these are exact on every driver.
uint f32_to_f16(float f) {
    uint x = floatBitsToUint(f);
    uint sign = (x >> 16) & 0x8000u;
    uint e = (x >> 23) & 0xFFu;
    uint m = x & 0x7FFFFFu;
    if (e == 255u) return sign | 0x7C00u | (m != 0u ? 0x200u | (m >> 13) : 0u);
    if (e > 142u) return sign | 0x7C00u;
    if (e >= 113u) {
        uint v = ((e - 112u) << 10) | (m >> 13);
        uint rem = m & 0x1FFFu;
        if (rem > 0x1000u || (rem == 0x1000u && (v & 1u) != 0u)) v += 1u;
        return sign | v;
    }
    if (e < 102u) return sign;
    uint mm = m | 0x800000u;
    uint shift = 126u - e;
    uint k = mm >> shift;
    uint rem = mm & ((1u << shift) - 1u);
    uint half_ = 1u << (shift - 1u);
    if (rem > half_ || (rem == half_ && (k & 1u) != 0u)) k += 1u;
    return sign | k;
}

uint f32_to_bf16(float f) {
    uint x = floatBitsToUint(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (x >> 16) | 64u;  // quiet NaN, as ggml
    return (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
}

float f16_to_f32(uint h) { return unpackHalf2x16(h).x; }
float bf16_to_f32(uint h) { return uintBitsToFloat(h << 16); }

// --- element loads and stores ----------------------------------------------------------------
#define DEFINE_LOAD(N) \
    float N##_load(uint t, uint i) { \
        if (t == T_F16) return f16_to_f32(uint(N##h[i])); \
        if (t == T_BF16) return bf16_to_f32(uint(N##h[i])); \
        if (t == T_I32) return float(N##i[i]); \
        return N##f[i]; \
    }

DEFINE_LOAD(A)
DEFINE_LOAD(B)
DEFINE_LOAD(C)

void D_store(uint t, uint i, float v) {
    if (t == T_F16) Dh[i] = uint16_t(f32_to_f16(v));
    else if (t == T_BF16) Dh[i] = uint16_t(f32_to_bf16(v));
    else if (t == T_I32) Di[i] = int(v);
    else Df[i] = v;
}

// --- quantized blocks of A (read as 2-byte words; every block size is even) --------------------
// words per block
uint block_words(uint t) {
    if (t == T_Q4_0 || t == T_IQ4_NL) return 9u;
    if (t == T_Q4_1) return 10u;
    if (t == T_Q5_0) return 11u;
    if (t == T_Q5_1) return 12u;
    if (t == T_Q8_0) return 17u;
    if (t == T_Q2_K) return 42u;
    if (t == T_Q3_K) return 55u;
    if (t == T_Q4_K) return 72u;
    if (t == T_Q5_K) return 88u;
    if (t == T_IQ4_XS) return 68u;
    return 105u;  // Q6_K
}
uint block_elems(uint t) {
    return (t == T_Q2_K || t == T_Q3_K || t == T_Q4_K || t == T_Q5_K || t == T_Q6_K || t == T_IQ4_XS) ? 256u : 32u;
}

// byte ``b`` of the block starting at word ``w``
uint A_byte(uint w, uint b) { return (uint(Ah[w + (b >> 1)]) >> ((b & 1u) * 8u)) & 0xFFu; }

// Q4_K: 6-bit scale and min of sub-block s (ggml's get_scale_min_k4); scales at bytes 4..15
uvec2 q4k_scale_min(uint w, uint s) {
    if (s < 4u) return uvec2(A_byte(w, 4u + s) & 63u, A_byte(w, 8u + s) & 63u);
    uint hi = A_byte(w, 8u + s);
    return uvec2((hi & 0xFu) | ((A_byte(w, s) >> 6) << 4), (hi >> 4) | ((A_byte(w, 4u + s) >> 6) << 4));
}

// ggml's kvalues_iq4nl: IQ4_NL's and IQ4_XS's 16 levels
const int IQ4NL[16] = int[16](-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);

// Q3_K: 6-bit scale k (32 subtracted) of its 12 bytes at byte 96: the low nibble of byte k
// (k < 8) or the high nibble of byte k - 8, then bits 2(k / 4) of byte 8 + k % 4
int q3k_scale(uint w, uint k) {
    uint lo = k < 8u ? A_byte(w, 96u + k) & 0xFu : A_byte(w, 88u + k) >> 4;
    return int(lo | (((A_byte(w, 104u + (k & 3u)) >> (2u * (k >> 2))) & 3u) << 4)) - 32;
}

// element j of the block at word w of the block types beyond Q4_0, Q8_0, Q4_K and Q6_K (layouts:
// accelplane.core.types). The K-quants of 16-element sub-blocks (Q2_K, Q3_K) hold element
// 128h + 32s + l in bits 2s of quant byte 32h + l, with scale j / 16.
float A_dequant_more(uint t, uint w, uint j) {
    if (t == T_Q4_1 || t == T_Q5_0 || t == T_Q5_1) {
        bool mn = t != T_Q5_0;
        uint qs = t == T_Q4_1 ? 4u : t == T_Q5_0 ? 6u : 8u;
        uint b = A_byte(w, qs + (j & 15u));
        uint q = j < 16u ? (b & 0xFu) : (b >> 4);
        if (t != T_Q4_1) q |= ((A_byte(w, qs - 4u + (j >> 3)) >> (j & 7u)) & 1u) << 4;
        float d = f16_to_f32(uint(Ah[w]));
        return mn ? d * float(q) + f16_to_f32(uint(Ah[w + 1u])) : d * float(int(q) - 16);
    }
    if (t == T_Q2_K || t == T_Q3_K) {
        uint h = j >> 7, s = (j >> 5) & 3u, l = j & 31u;
        uint q = (A_byte(w, (t == T_Q2_K ? 16u : 32u) + 32u * h + l) >> (2u * s)) & 3u;
        if (t == T_Q2_K) {
            uint sc = A_byte(w, j >> 4);
            float d = f16_to_f32(uint(Ah[w + 40u])), dmin = f16_to_f32(uint(Ah[w + 41u]));
            return d * float(sc & 0xFu) * float(q) - dmin * float(sc >> 4);
        }
        int v = int(q) - (((A_byte(w, l) >> (j >> 5)) & 1u) != 0u ? 0 : 4);
        return f16_to_f32(uint(Ah[w + 54u])) * float(q3k_scale(w, j >> 4)) * float(v);
    }
    if (t == T_Q5_K) {  // Q4_K's scales and nibbles at byte 48, fifth bit j / 32 of qh[j % 32]
        uint s = j >> 5;
        uvec2 sm = q4k_scale_min(w, s);
        uint b = A_byte(w, 48u + (s >> 1) * 32u + (j & 31u));
        uint q = ((s & 1u) == 0u ? (b & 0xFu) : (b >> 4)) | (((A_byte(w, 16u + (j & 31u)) >> s) & 1u) << 4);
        return f16_to_f32(uint(Ah[w])) * float(sm.x) * float(q) - f16_to_f32(uint(Ah[w + 1u])) * float(sm.y);
    }
    float d = f16_to_f32(uint(Ah[w]));
    if (t == T_IQ4_NL) {
        uint b = A_byte(w, 2u + (j & 15u));
        return d * float(IQ4NL[j < 16u ? (b & 0xFu) : (b >> 4)]);
    }
    // IQ4_XS: d, scales_h, scales_l[4], qs[128]: sub-block s's quants at 8 + 16s as Q4_0's
    uint s = j >> 5, l = j & 31u;
    uint ls = ((A_byte(w, 4u + (s >> 1)) >> (4u * (s & 1u))) & 0xFu) | (((uint(Ah[w + 1u]) >> (2u * s)) & 3u) << 4);
    uint b = A_byte(w, 8u + 16u * s + (l & 15u));
    return d * float(int(ls) - 32) * float(IQ4NL[l < 16u ? (b & 0xFu) : (b >> 4)]);
}

// element j of the block at word w
float A_dequant(uint t, uint w, uint j) {
    if (t != T_Q4_0 && t != T_Q8_0 && t != T_Q4_K && t != T_Q6_K) return A_dequant_more(t, w, j);
    if (t == T_Q4_0) {
        float d = f16_to_f32(uint(Ah[w]));
        uint b = A_byte(w, 2u + (j & 15u));
        uint q = j < 16u ? (b & 0xFu) : (b >> 4);
        return d * (float(q) - 8.0);
    }
    if (t == T_Q8_0) {
        float d = f16_to_f32(uint(Ah[w]));
        int q = int(A_byte(w, 2u + j) << 24) >> 24;
        return d * float(q);
    }
    if (t == T_Q4_K) {
        float d = f16_to_f32(uint(Ah[w]));
        float dmin = f16_to_f32(uint(Ah[w + 1u]));
        uint s = j >> 5;
        uvec2 sm = q4k_scale_min(w, s);
        uint b = A_byte(w, 16u + (s >> 1) * 32u + (j & 31u));
        uint q = (s & 1u) == 0u ? (b & 0xFu) : (b >> 4);
        return d * float(sm.x) * float(q) - dmin * float(sm.y);
    }
    // Q6_K: ql[128] qh[64] scales[16] d
    uint h = j >> 7, r = j & 127u, qd = r >> 5, l = r & 31u;
    uint lb = A_byte(w, 64u * h + 32u * (qd & 1u) + l);
    uint lo = qd < 2u ? (lb & 0xFu) : (lb >> 4);
    uint hi = (A_byte(w, 128u + 32u * h + l) >> (2u * qd)) & 3u;
    int q = int(lo | (hi << 4)) - 32;
    int sc = int(A_byte(w, 192u + (j >> 4)) << 24) >> 24;
    float d = f16_to_f32(uint(Ah[w + 104u]));
    return d * float(sc) * float(q);
}

// 32 values of A from element j0 (a multiple of 32) of the block at word w: one pass over the
// chunk's bytes (cheaper than 32 calls of A_dequant)
void A_dequant32(uint t, uint w, uint j0, out float v[32]) {
    if (t == T_Q4_0) {
        float d = f16_to_f32(uint(Ah[w]));
        for (uint i = 0u; i < 8u; ++i) {
            uint x = uint(Ah[w + 1u + i]);
            v[2u * i] = d * (float(x & 0xFu) - 8.0);
            v[2u * i + 1u] = d * (float((x >> 8) & 0xFu) - 8.0);
            v[2u * i + 16u] = d * (float((x >> 4) & 0xFu) - 8.0);
            v[2u * i + 17u] = d * (float(x >> 12) - 8.0);
        }
    } else if (t == T_Q8_0) {
        float d = f16_to_f32(uint(Ah[w]));
        for (uint i = 0u; i < 16u; ++i) {
            uint x = uint(Ah[w + 1u + i]);
            v[2u * i] = d * float(int(x << 24) >> 24);
            v[2u * i + 1u] = d * float(int(x << 16) >> 24);
        }
    } else if (t == T_Q4_K) {
        uint s = j0 >> 5;
        uvec2 sm = q4k_scale_min(w, s);
        float dl = f16_to_f32(uint(Ah[w])) * float(sm.x);
        float ml = f16_to_f32(uint(Ah[w + 1u])) * float(sm.y);
        uint q = w + 8u + (s >> 1) * 16u, sh = (s & 1u) * 4u;
        for (uint i = 0u; i < 16u; ++i) {
            uint x = uint(Ah[q + i]);
            v[2u * i] = dl * float((x >> sh) & 0xFu) - ml;
            v[2u * i + 1u] = dl * float((x >> (8u + sh)) & 0xFu) - ml;
        }
    } else if (t != T_Q6_K) {
        for (uint i = 0u; i < 32u; ++i) v[i] = A_dequant_more(t, w, j0 + i);
    } else {
        uint c = j0 >> 5, h = c >> 2, qd = c & 3u;
        uint ql = w + 32u * h + 16u * (qd & 1u), qh = w + 64u + 16u * h;
        uint lsh = (qd >> 1) * 4u, hsh = 2u * qd;
        uint scw = uint(Ah[w + 96u + c]);
        float d = f16_to_f32(uint(Ah[w + 104u]));
        float d0 = d * float(int(scw << 24) >> 24), d1 = d * float(int(scw << 16) >> 24);
        for (uint i = 0u; i < 16u; ++i) {
            uint lw = uint(Ah[ql + i]), hw = uint(Ah[qh + i]);
            for (uint e = 0u; e < 2u; ++e) {
                uint lo = (lw >> (8u * e + lsh)) & 0xFu;
                uint hi = (hw >> (8u * e + hsh)) & 3u;
                uint l = 2u * i + e;
                v[l] = (l < 16u ? d0 : d1) * float(int(lo | (hi << 4)) - 32);
            }
        }
    }
}

// 8 consecutive elements of a float row at element e (e and the binding 16-byte aligned)
void A_load8(uint t, uint e, out float v[8]) {
    if (t == T_F32) {
        vec4 a = Af4[e / 4u], b = Af4[e / 4u + 1u];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
        uvec4 q = Au4[e / 8u];
        for (uint i = 0u; i < 4u; ++i) {
            uint x = q[i];
            if (t == T_F16) {
                vec2 f = unpackHalf2x16(x);
                v[2u * i] = f.x; v[2u * i + 1u] = f.y;
            } else {
                v[2u * i] = uintBitsToFloat(x << 16); v[2u * i + 1u] = uintBitsToFloat(x & 0xFFFF0000u);
            }
        }
    }
}

// element i0 of a row of type t starting at word/element ``row`` of A
float A_load_row(uint t, uint row, uint i0) {
    if (is_quant(t)) {
        uint be = block_elems(t);
        return A_dequant(t, row + (i0 / be) * block_words(t), i0 % be);
    }
    return A_load(t, row + i0);
}

// --- quantizing 32 values into a block of D (ggml's quantize_row_q8_0/q4_0 reference) --------
// C roundf (half away from zero), exact: the fractional part and its double are exact
float roundf_(float v) {
    float t = trunc(v);
    return t + trunc((v - t) * 2.0);
}

void D_set_byte_pair(uint w, uint lo, uint hi) { Dh[w] = uint16_t(lo | (hi << 8)); }

void D_quantize_block(uint t, uint w, float x[32]) {
    if (t == T_Q8_0) {
        float amax = 0.0;
        for (uint j = 0u; j < 32u; ++j) amax = max(amax, abs(x[j]));
        float d = amax / 127.0;
        float id = d != 0.0 ? 1.0 / d : 0.0;
        Dh[w] = uint16_t(f32_to_f16(d));
        for (uint j = 0u; j < 32u; j += 2u) {
            uint q0 = uint(int(roundf_(x[j] * id))) & 0xFFu;
            uint q1 = uint(int(roundf_(x[j + 1u] * id))) & 0xFFu;
            D_set_byte_pair(w + 1u + j / 2u, q0, q1);
        }
    } else {  // Q4_0: scale from the first value of largest magnitude, d = max / -8
        float amax = 0.0, mx = 0.0;
        for (uint j = 0u; j < 32u; ++j) {
            if (abs(x[j]) > amax) { amax = abs(x[j]); mx = x[j]; }
        }
        float d = mx / -8.0;
        float id = d != 0.0 ? 1.0 / d : 0.0;
        Dh[w] = uint16_t(f32_to_f16(d));
        for (uint j = 0u; j < 16u; j += 2u) {
            uint b[2];
            for (uint k = 0u; k < 2u; ++k) {
                uint q0 = min(15u, uint(int(x[j + k] * id + 8.5)));
                uint q1 = min(15u, uint(int(x[j + k + 16u] * id + 8.5)));
                b[k] = q0 | (q1 << 4);
            }
            D_set_byte_pair(w + 1u + j / 2u, b[0], b[1]);
        }
    }
}

// --- indexing ---------------------------------------------------------------------------------
// linear invocation id over a (x, y) grid of workgroups (y spills past maxComputeWorkGroupCount.x)
uint global_id() {
    return gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
}
// linear workgroup id over an (x, y, z) grid (kernels.grid spreads large counts over y and z)
uint group_id() {
    return gl_WorkGroupID.x + gl_NumWorkGroups.x * (gl_WorkGroupID.y + gl_NumWorkGroups.y * gl_WorkGroupID.z);
}

uvec4 unravel(uint i, uvec4 ne) {
    uint i0 = i % ne.x; i /= ne.x;
    uint i1 = i % ne.y; i /= ne.y;
    uint i2 = i % ne.z;
    return uvec4(i0, i1, i2, i / ne.z);
}
uint offset4(uvec4 i, uvec4 nb) { return i.x * nb.x + i.y * nb.y + i.z * nb.z + i.w * nb.w; }
uint nelements(uvec4 ne) { return ne.x * ne.y * ne.z * ne.w; }

// sin/cos after reducing the argument to [-pi, pi] (two-constant Cody-Waite): drivers'
// sin/cos are only accurate near zero
float reduce_angle(float x) {
    float k = round(x * 0.15915494309189535);
    return (x - k * 6.28125) - k * 1.9353071795864769e-3;
}
float sin_(float x) { return sin(reduce_angle(x)); }
float cos_(float x) { return cos(reduce_angle(x)); }

// tanh GELU, 0.5*x*(1 + tanh(z)), written as x * sigmoid(2z): the same value without the
// cancellation of 1 + tanh(z) for negative x
float gelu(float x) {
    float z = 0.7978845608028654 * x * (1.0 + 0.044715 * x * x);
    return x / (1.0 + exp(-2.0 * z));
}
