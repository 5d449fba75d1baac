#version 450
// quantized MUL_MAT for few columns, partial sums reduced with subgroupAdd (mul_mat_vec_q.glsl)
#define MMV_SUBGROUP
#include "mul_mat_vec_q.glsl"
