"""Element-wise nodes (kernels/elementwise.cu): binary ops with broadcasting, unary and scalar
ops, gated linear units."""

from __future__ import annotations

import numpy as np
from accelplane.core.ops import GluOp, Op, UnaryOp
from accelplane.core.types import GGMLType as T

from . import compiler, matvec
from .args import CTYPE, f32_rows16, f64

# kernels/elementwise.cu's op codes: k_binary's, k_unary's unary ops (their ggml ids) and its
# scalar ops (past UnaryOp's)
UNARY = frozenset(map(UnaryOp, (0, *range(2, 17), 18, 19, 20, 21)))
BINARY = {Op.ADD: 0, Op.SUB: 1, Op.MUL: 2, Op.DIV: 3}
SCALAR = {Op.SQR: 100, Op.SQRT: 101, Op.LOG: 102, Op.SIN: 103, Op.COS: 104, Op.SCALE: 105,
          Op.CLAMP: 106, Op.LEAKY_RELU: 107}  # fmt: skip

_F = list(CTYPE.values())
FAMILY = compiler.family("elementwise", {
    "k_unary": compiler.product(_F),
    "k_binary": compiler.product(_F, _F),
    "k_binary_flat": compiler.product(_F, _F),
    "k_glu": compiler.product(_F),
    "k_glu_vec": [()],
})  # fmt: skip


def _repeats_whole(a, b) -> bool:
    """b's shape is a prefix of a's, then ones: a's element i meets b's element i % b.nelements."""
    j = next((d for d in range(4) if b.ne[d] != a.ne[d]), 4)
    return all(x == 1 for x in b.ne[j:])


def binary(plan, n) -> None:
    a, b = n.src
    if (n.nelements < 1 << 31 and n.is_contiguous() and a.is_contiguous() and b.is_contiguous()
            and _repeats_whole(a, b)):  # fmt: skip
        P = plan.params([n.nelements, b.nelements, BINARY[n.op]])
        plan.launch(compiler.name("k_binary_flat", CTYPE[a.type], CTYPE[b.type]), n.nelements,
                    (P, plan.ptr(n), plan.ptr(a), plan.ptr(b)))  # fmt: skip
        return
    P = plan.params([n.nelements, *n.ne, *n.nb, *a.nb, *b.ne, *b.nb, BINARY[n.op]])
    plan.launch(compiler.name("k_binary", CTYPE[a.type], CTYPE[b.type]), n.nelements,
                (P, plan.ptr(n), plan.ptr(a), plan.ptr(b)))  # fmt: skip


def unary(plan, n) -> None:
    """UNARY, or a scalar op (SCALE, CLAMP, ...) with its two float parameters."""
    a = n.src[0]
    code = SCALAR.get(n.op)
    p = list(n.op_params) + [0.0, 0.0]
    if n.op is Op.UNARY:
        code, p = int(UnaryOp(p[0])), [0.0, 0.0]
    P = plan.params([n.nelements, *n.ne, *n.nb, *a.nb, code, f64(p[0]), f64(p[1])])
    plan.launch(compiler.name("k_unary", CTYPE[n.type]), n.nelements, (P, plan.ptr(n), plan.ptr(a)))


def glu(plan, n) -> None:
    """GLU of one tensor (both halves) or two; contiguous 16-byte aligned F32 rows take the float4
    kernel, which also writes the quantized activations a register mat-vec reading it wants."""
    a, b = n.src
    op, swapped = GluOp(n.op_params[0]), bool(n.op_params[1])
    if b is None:
        h = n.ne[0] * a.nb[0]
        xp, gp = int(plan.ptr(a)), int(plan.ptr(a)) + h
        if swapped:
            xp, gp = gp, xp
        nbx = nbg = a.nb
    else:
        xp, gp, nbx, nbg = int(plan.ptr(a)), int(plan.ptr(b)), a.nb, b.nb
    vec = n.ne[0] % 32 == 0 and n.ne[2] == n.ne[3] == 1 and xp % 16 == 0 and gp % 16 == 0
    vec = vec and f32_rows16(n) and all(q[0] == 4 and q[1] % 16 == 0 for q in (nbx, nbg))
    vec = vec and a.type == T.F32 and (b is None or b.type == T.F32)
    if vec:  # float4s, and the quantized activations of a register mat-vec reading it
        xq, row_bytes = matvec.xq_for(plan, n, per_row=True)
        P = plan.params([n.nelements, *n.ne, *n.nb, *nbx, *nbg, int(op), row_bytes])
        grid = (-(-n.nelements // 1024),)
        plan.launch("k_glu_vec", 0, (P, plan.ptr(n), np.uint64(xp), np.uint64(gp), xq), block=256, grid=grid)
    else:
        P = plan.params([n.nelements, *n.ne, *n.nb, *nbx, *nbg, int(op)])
        args = (P, plan.ptr(n), np.uint64(xp), np.uint64(gp))
        plan.launch(compiler.name("k_glu", CTYPE[n.type]), n.nelements, args)


OPS = {**dict.fromkeys(BINARY, binary), **dict.fromkeys((*SCALAR, Op.UNARY), unary), Op.GLU: glu}
