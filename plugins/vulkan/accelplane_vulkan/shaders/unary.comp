#version 450
// Elementwise unary ops, one shader for all: the op is a specialization constant (as ggml's
// unary.comp), op parameters are push constants. Codes: see kernels.UNARY_CODES.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint OP = 0u;
layout(constant_id = 1) const uint TA = 0u;
layout(constant_id = 2) const uint TD = 0u;
layout(push_constant) uniform PC { uvec4 ne; uvec4 nba; uvec4 nbd; uint offa; uint offd; float p0; float p1; } pc;

float sigmoid(float x) { return 1.0 / (1.0 + exp(-x)); }
// tanh through exp(-2|x|): no overflow, no reliance on a driver's tanh approximation
float tanh_(float x) {
    float t = exp(-2.0 * abs(x));
    return sign(x) * (1.0 - t) / (1.0 + t);
}

// expm1 without the cancellation of exp(x) - 1 near 0: Taylor to x^8/8! where |x| < 0.35
// (truncation < 1e-9 relative), exp(x) - 1 beyond (cancellation costs under 2 ulp there)
float expm1_(float x) {
    if (abs(x) < 0.35) {
        return x * (1.0 + x * (1.0 / 2.0 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0
            + x * (1.0 / 720.0 + x * (1.0 / 5040.0 + x * (1.0 / 40320.0))))))));
    }
    return exp(x) - 1.0;
}
// log(1 + y) for y in [0, 1] as 2 atanh(s), s = y / (2 + y) <= 1/3, by its odd series to s^17
// (truncation < 2e-10 relative): GLSL bounds log's error near 1 only in absolute terms
float log1p01(float y) {
    float s = y / (2.0 + y), s2 = s * s;
    return 2.0 * s * (1.0 + s2 * (1.0 / 3.0 + s2 * (1.0 / 5.0 + s2 * (1.0 / 7.0 + s2 * (1.0 / 9.0
        + s2 * (1.0 / 11.0 + s2 * (1.0 / 13.0 + s2 * (1.0 / 15.0 + s2 * (1.0 / 17.0)))))))));
}
// ggml's softplus, log(1 + exp(x)) and x itself above 20, as relu(x) + log(1 + exp(-|x|)):
// the same function without exp's overflow or log's cancellation
float softplus(float x) { return x > 20.0 ? x : max(x, 0.0) + log1p01(exp(-abs(x))); }
// erfc(z) for z >= 0, relative error < 1.2e-7: the Chebyshev fit of Numerical Recipes' erfcc
float erfc_pos(float z) {
    float t = 1.0 / (1.0 + 0.5 * z);
    float p = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806
        + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))));
    return t * exp(p - z * z);
}
// exact GELU 0.5*x*(1 + erf(x/sqrt 2)), through erfc: 1 + erf(-z) = erfc(z) keeps the
// negative side's small values accurate
float gelu_erf(float x) {
    float c = erfc_pos(abs(x) * 0.7071067811865476);
    return 0.5 * x * (x >= 0.0 ? 2.0 - c : c);
}
// fminf(1, fmaxf(0, (x + 3) / 6)) as ggml: a NaN gives 0 (GLSL's min/max leave NaN undefined)
float hardsigmoid(float x) {
    float h = (x + 3.0) / 6.0;
    return isnan(h) ? 0.0 : clamp(h, 0.0, 1.0);
}
// C's roundf: halves away from zero (GLSL's round leaves them to the driver); x - trunc(x) is exact
float round_away(float x) {
    float t = trunc(x);
    return abs(x - t) >= 0.5 ? t + sign(x) : t;
}

float apply(float x) {
    switch (OP) {
    case 0u: return x * pc.p0 + pc.p1;                      // SCALE
    case 1u: return x * x;                                  // SQR
    case 2u: return sqrt(x);                                // SQRT
    case 3u: return log(x);                                 // LOG
    case 4u: return sin_(x);                                // SIN
    case 5u: return cos_(x);                                // COS
    case 6u: return max(min(x, pc.p1), pc.p0);              // CLAMP (ggml: MAX(MIN(x, max), min))
    case 7u: return max(x, 0.0) + pc.p0 * min(x, 0.0);      // LEAKY_RELU
    case 8u: return abs(x);                                 // ABS
    case 9u: return -x;                                     // NEG
    case 10u: return tanh_(x);                              // TANH
    case 11u: return x > 0.0 ? x : 0.0;                     // RELU
    case 12u: return sigmoid(x);                            // SIGMOID
    case 13u: return gelu(x);                               // GELU
    case 14u: return x * sigmoid(1.702 * x);                // GELU_QUICK
    case 15u: return x * sigmoid(x);                        // SILU
    case 16u: return exp(x);                                // EXP
    case 17u: return x > 0.0 ? 1.0 : 0.0;                   // STEP
    case 18u: return x > 0.0 ? x : expm1_(x);               // ELU
    case 19u: return x * hardsigmoid(x);                    // HARDSWISH
    case 20u: return hardsigmoid(x);                        // HARDSIGMOID
    case 21u: return expm1_(x);                             // EXPM1
    case 22u: return softplus(x);                           // SOFTPLUS
    case 23u: return gelu_erf(x);                           // GELU_ERF
    case 24u: return floor(x);                              // FLOOR
    case 25u: return ceil(x);                               // CEIL
    case 26u: return round_away(x);                         // ROUND
    default: return trunc(x);                               // TRUNC
    }
}

void main() {
    uint i = global_id();
    if (i >= nelements(pc.ne)) return;
    uvec4 idx = unravel(i, pc.ne);
    float x = A_load(TA, pc.offa + offset4(idx, pc.nba));
    D_store(TD, pc.offd + offset4(idx, pc.nbd), apply(x));
}
