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
    default: return exp(x);                                 // EXP
    }
}

void main() {
    uint i = global_id();
    if (i >= nelements(pc.ne)) return;
    uvec4 idx = unravel(i, pc.ne);
    float x = A_load(TA, pc.offa + offset4(idx, pc.nba));
    D_store(TD, pc.offd + offset4(idx, pc.nbd), apply(x));
}
