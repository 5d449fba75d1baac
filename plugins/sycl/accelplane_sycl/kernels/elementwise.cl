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

inline float sigmoid_f(float x) { return 1.0f / (1.0f + exp(-x)); }

inline float gelu_f(float x) {
    const float c = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanh(c * x * (1.0f + 0.044715f * x * x)));
}

inline float unary_f(int op, float x, float f0, float f1) {
    switch (op) {
    case U_SQR: return x * x;
    case U_SQRT: return sqrt(x);
    case U_LOG: return log(x);
    case U_SIN: return sin(x);
    case U_COS: return cos(x);
    case U_SCALE: return x * f0 + f1;
    case U_CLAMP: return fmin(fmax(x, f0), f1);
    case U_LEAKY: return x > 0.0f ? x : x * f0;
    case U_ABS: return fabs(x);
    case U_NEG: return -x;
    case U_TANH: return tanh(x);
    case U_RELU: return x > 0.0f ? x : 0.0f;
    case U_SIGMOID: return sigmoid_f(x);
    case U_GELU: return gelu_f(x);
    case U_GELU_QUICK: return x * sigmoid_f(1.702f * x);
    case U_SILU: return x * sigmoid_f(x);
    default: return exp(x);
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
