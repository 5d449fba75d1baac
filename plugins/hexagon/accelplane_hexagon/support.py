"""What the emulated HTP runs: the op table of ggml's Hexagon backend, restricted to the ops of
the accelplane catalog and to what this plugin's kernels implement. Everything not listed is
refused (the scheduler then runs it elsewhere)."""

from __future__ import annotations

from collections.abc import Callable

from accelplane.core.ops import VIEW_OPS, GluOp, Op, UnaryOp
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType

from .runtime import HtpBuffer

T = GGMLType
F = frozenset({T.F32, T.F16})
MM_WEIGHTS = frozenset({T.Q4_0, T.Q8_0, T.F32, T.F16})
TILED_TYPES = frozenset({T.Q4_0, T.Q8_0})
GET_ROWS_TYPES = frozenset({T.F32, T.F16, T.I32, T.Q4_0, T.Q8_0})
MAX_MM_ROWS = 32768  # ggml's gate: larger weights are the LM head, left to the CPU
# fp16 per-tile accumulation error grows with K (tools/hexagon_accuracy.py; README): at K = 131072, the
# largest K measured, NMSE is 1.2e-4 against the suite's 5e-4. Longer rows are not claimed.
MAX_MM_K_QUANT = 131072
# ggml's HTP activations (htp_op_code's UNARY_*); the other unary ops run elsewhere
UNARY = frozenset({UnaryOp.SILU, UnaryOp.GELU, UnaryOp.SIGMOID, UnaryOp.NEG, UnaryOp.EXP, UnaryOp.TANH,
                   UnaryOp.SOFTPLUS})  # fmt: skip
GLU = frozenset({GluOp.SWIGLU, GluOp.GEGLU})


def is_repacked(t: Tensor) -> bool:
    """``t`` (or the tensor it views) lives tiled in a repack buffer of this plugin."""
    o = t.data_owner
    b = o.buffer
    return b is not None and isinstance(b.ctx, HtpBuffer) and b.ctx.repack and o.type in TILED_TYPES


def _same_float(op: Tensor, *srcs: Tensor) -> bool:
    return op.type in F and all(s.type == op.type for s in srcs)


def _mm_weights(a: Tensor) -> bool:
    if a.type not in MM_WEIGHTS or a.ne[0] % 32 or a.ne[1] > MAX_MM_ROWS:
        return False
    if a.type in TILED_TYPES and a.ne[0] > MAX_MM_K_QUANT:
        return False
    if is_repacked(a):  # the tiles cover whole tensors: no sub-views of them
        o = a.data_owner
        return a is o or (a.view_offs == 0 and a.ne == o.ne and a.nb == o.nb)
    return True


_CHECKS: dict[Op, Callable[[Tensor], bool]] = {
    Op.ADD: lambda t: _same_float(t, t.src[0], t.src[1]),
    Op.SUB: lambda t: _same_float(t, t.src[0], t.src[1]),
    Op.MUL: lambda t: _same_float(t, t.src[0], t.src[1]),
    Op.DIV: lambda t: _same_float(t, t.src[0], t.src[1]),
    Op.SCALE: lambda t: _same_float(t, t.src[0]),
    Op.UNARY: lambda t: t.op_params[0] in UNARY and _same_float(t, t.src[0]),
    Op.GLU: lambda t: t.op_params[0] in GLU and _same_float(t, t.src[0]),
    Op.NORM: lambda t: True,  # F32 by the catalog's rule
    Op.RMS_NORM: lambda t: True,
    Op.SOFT_MAX: lambda t: True,  # F32, mask F32/F16
    Op.ROPE: lambda t: len(t.src) == 2,  # F32/F16, modes normal and NEOX; no frequency factors
    Op.GET_ROWS: lambda t: t.src[0].type in GET_ROWS_TYPES,
    Op.SET_ROWS: lambda t: t.src[0].type in F,
    Op.CPY: lambda t: (t.src[0].type in F and t.type in F) or t.src[0].type == t.type == T.I32,
    Op.CONT: lambda t: t.type in F | {T.I32},
    Op.DUP: lambda t: t.type in F | {T.I32},
    Op.MUL_MAT: lambda t: _mm_weights(t.src[0]) and t.src[1].type in F,  # activations F32/F16
    Op.MUL_MAT_ID: lambda t: _mm_weights(t.src[0]),
}


def supports_op(op: Tensor) -> bool:
    if op.op in VIEW_OPS:
        return True
    check = _CHECKS.get(op.op)
    if check is None:
        return False
    # repacked weights are readable by the matmul kernels only, as their src[0]
    for i, s in enumerate(op.src):
        if s is not None and is_repacked(s) and not (i == 0 and op.op in (Op.MUL_MAT, Op.MUL_MAT_ID)):
            return False
    return check(op)
