// accelplane SYCL plugin: elementwise kernels (unary, binary, GLU)
// (built as one program per kernel after common.cl: program.py)

#define U_SQR 0
#define U_SQRT 1
#define U_LOG 2
#define U_SIN 3
#define U_COS 4
#define U_SCALE 5
#define U_CLAMP 6
#define U_LEAKY 7
#define U_ABS 8
#define U_NEG 9
#define U_TANH 10
#define U_RELU 11
#define U_SIGMOID 12
#define U_GELU 13
#define U_GELU_QUICK 14
#define U_SILU 15
#define U_EXP 16
#define U_STEP 17
#define U_ELU 18
#define U_HARDSWISH 19
#define U_HARDSIGMOID 20
#define U_EXPM1 21
#define U_SOFTPLUS 22
#define U_GELU_ERF 23
#define U_FLOOR 24
#define U_CEIL 25
#define U_ROUND 26
#define U_TRUNC 27

inline float sigmoid_f(float x) { return 1.0f / (1.0f + exp(-x)); }

inline float gelu_f(float x) {
    const float c = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanh(c * x * (1.0f + 0.044715f * x * x)));
}

// exact GELU 0.5*x*(1 + erf(x/sqrt 2)) as 0.5*x*erfc(-x/sqrt 2): no cancellation for x < 0
inline float gelu_erf_f(float x) { return 0.5f * x * erfc(-x * 0.70710678118654752f); }

// ggml's: fminf(1, fmaxf(0, (x + 3) / 6)); OpenCL's fmin/fmax are C's (a NaN gives the other)
inline float hardsigmoid_f(float x) { return fmin(1.0f, fmax(0.0f, (x + 3.0f) / 6.0f)); }

inline float unary_f(int op, float x, float f0, float f1) {
    switch (op) {
    case U_SQR: return x * x;
    case U_SQRT: return sqrt(x);
    case U_LOG: return log(x);
    case U_SIN: return sin(x);
    case U_COS: return cos(x);
    case U_SCALE: return x * f0 + f1;
    case U_CLAMP: return fmin(fmax(x, f0), f1);
    case U_LEAKY: return (x > 0.0f ? x : 0.0f) + f0 * (x < 0.0f ? x : 0.0f);  /* ggml's */
    case U_ABS: return fabs(x);
    case U_NEG: return -x;
    case U_TANH: return tanh(x);
    case U_RELU: return x > 0.0f ? x : 0.0f;
    case U_SIGMOID: return sigmoid_f(x);
    case U_GELU: return gelu_f(x);
    case U_GELU_QUICK: return x * sigmoid_f(1.702f * x);
    case U_SILU: return x * sigmoid_f(x);
    case U_EXP: return exp(x);
    case U_STEP: return x > 0.0f ? 1.0f : 0.0f;
    case U_ELU: return x > 0.0f ? x : expm1(x);
    case U_HARDSWISH: return x * hardsigmoid_f(x);
    case U_HARDSIGMOID: return hardsigmoid_f(x);
    case U_EXPM1: return expm1(x);
    case U_SOFTPLUS: return x > 20.0f ? x : log1p(exp(x));  // ggml's: x itself above 20
    case U_GELU_ERF: return gelu_erf_f(x);
    case U_FLOOR: return floor(x);
    case U_CEIL: return ceil(x);
    case U_ROUND: return round(x);  // OpenCL's round is C's: halves away from zero
    default: return trunc(x);       // U_TRUNC
    }
}

// P: dst, src, op, f0, f1
__kernel void k_unary(params P, ulong pi, gbuf* dst, cbuf* src) {
    params p = P + pi;
    td_t d = td(p), s = td(p + TD_WORDS);
    long ix[4];
    unravel(get_global_id(0), d.ne, ix);
    float x = ld_at(src, &s, ix);
    st_f(dst, at(&d, ix), d.ty, unary_f((int)p[20], x, pf(p, 21), pf(p, 22)));
}

// P: dst, a, b, op (0 add, 1 sub, 2 mul, 3 div); b repeats over a
__kernel void k_binary(params P, ulong pi, gbuf* dst, cbuf* A, cbuf* B) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS), b = td(p + 2 * TD_WORDS);
    long ix[4], jx[4];
    unravel(get_global_id(0), d.ne, ix);
    for (int k = 0; k < 4; ++k) jx[k] = ix[k] % b.ne[k];
    float x = ld_at(A, &a, ix), y = ld_at(B, &b, jx), r;
    switch ((int)p[30]) {
    case 0: r = x + y; break;
    case 1: r = x - y; break;
    case 2: r = x * y; break;
    default: r = x / y;
    }
    st_f(dst, at(&d, ix), d.ty, r);
}

// P: dst, a, b (or a again), op (1 geglu, 2 swiglu), swapped, has_b
__kernel void k_glu(params P, ulong pi, gbuf* dst, cbuf* A, cbuf* B) {
    params p = P + pi;
    td_t d = td(p), a = td(p + TD_WORDS), b = td(p + 2 * TD_WORDS);
    int op = (int)p[30], swapped = (int)p[31], has_b = (int)p[32];
    long ix[4];
    unravel(get_global_id(0), d.ne, ix);
    float x, g;
    if (has_b) {
        x = ld_at(A, &a, ix);
        g = ld_at(B, &b, ix);
    } else {
        long ro = row_off(&a, ix[1], ix[2], ix[3]), nc = d.ne[0];
        x = ld_el(A, &a, ro, ix[0] + (swapped ? nc : 0));
        g = ld_el(A, &a, ro, ix[0] + (swapped ? 0 : nc));
    }
    float act = op == 1 ? gelu_f(x) : x * sigmoid_f(x);
    st_f(dst, at(&d, ix), d.ty, act * g);
}
