"""Elementwise ops: unary functions (SCALE, CLAMP, LEAKY_RELU, UNARY's), binary arithmetic
(ADD, SUB, MUL, DIV; b broadcast over a) and GLU."""

from __future__ import annotations

from accelplane.core.ops import GluOp, Op, UnaryOp
from accelplane.core.tensor import Tensor

from .base import Dispatch, elementwise, enb, eoffs, pack

UNARY_CODES = {
    Op.SCALE: 0,
    Op.SQR: 1,
    Op.SQRT: 2,
    Op.LOG: 3,
    Op.SIN: 4,
    Op.COS: 5,
    Op.CLAMP: 6,
    Op.LEAKY_RELU: 7,
    UnaryOp.ABS: 8,
    UnaryOp.NEG: 9,
    UnaryOp.TANH: 10,
    UnaryOp.RELU: 11,
    UnaryOp.SIGMOID: 12,
    UnaryOp.GELU: 13,
    UnaryOp.GELU_QUICK: 14,
    UnaryOp.SILU: 15,
    UnaryOp.EXP: 16,
    UnaryOp.STEP: 17,
    UnaryOp.ELU: 18,
    UnaryOp.HARDSWISH: 19,
    UnaryOp.HARDSIGMOID: 20,
    UnaryOp.EXPM1: 21,
    UnaryOp.SOFTPLUS: 22,
    UnaryOp.GELU_ERF: 23,
    UnaryOp.FLOOR: 24,
    UnaryOp.CEIL: 25,
    UnaryOp.ROUND: 26,
    UnaryOp.TRUNC: 27,
}
BINARY_CODES = {Op.ADD: 0, Op.SUB: 1, Op.MUL: 2, Op.DIV: 3}


def unary(t: Tensor) -> list[Dispatch]:
    (a,) = t.src
    code = UNARY_CODES[UnaryOp(t.op_params[0])] if t.op is Op.UNARY else UNARY_CODES[t.op]
    p = [float(x) for x in t.op_params[:2]] if t.op in (Op.SCALE, Op.CLAMP, Op.LEAKY_RELU) else []
    p += [0.0] * (2 - len(p))
    push = pack(t.ne, enb(a), enb(t), eoffs(a), eoffs(t), *p)
    return elementwise("unary", (code, a.type, t.type), (a, None, None, t), push, t.nelements)


def binary(t: Tensor) -> list[Dispatch]:
    a, b = t.src
    push = pack(t.ne, enb(a), b.ne, enb(b), enb(t), eoffs(a), eoffs(b), eoffs(t))
    spec = (BINARY_CODES[t.op], a.type, b.type, t.type)
    return elementwise("binary", spec, (a, b, None, t), push, t.nelements)


def glu(t: Tensor) -> list[Dispatch]:
    a, b = t.src
    op, swapped = GluOp(t.op_params[0]), bool(t.op_params[1])
    split = b is None
    xo, go = (0, t.ne[0]) if not swapped else (t.ne[0], 0)
    push = pack(
        t.ne,
        enb(a),
        enb(b if b is not None else a),
        enb(t),
        eoffs(a),
        eoffs(b) if b is not None else 0,
        eoffs(t),
        xo if split else 0,
        go if split else 0,
    )
    spec = (0 if op is GluOp.SWIGLU else 1, a.type, (b if b is not None else a).type, int(split))
    return elementwise("glu", spec, (a, b, None, t), push, t.nelements)
