#version 450
// quantized MUL_MAT for few columns, reduced in shared memory only (no subgroup arithmetic)
#include "mul_mat_vec_q.glsl"
