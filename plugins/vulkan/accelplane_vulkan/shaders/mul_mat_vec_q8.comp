#version 450
// quantized MUL_MAT for few columns on int8 activations and integer dot products (mul_mat_vec_q.glsl)
#define MMV_SUBGROUP
#define MMV_Q8
#include "mul_mat_vec_q.glsl"
