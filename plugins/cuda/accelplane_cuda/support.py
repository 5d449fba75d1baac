"""What the CUDA plugin computes (the supports_op hook): exactly the nodes its kernels take."""

from __future__ import annotations

from accelplane.core.ops import FLOAT, VIEW_OPS, Op, UnaryOp
from accelplane.core.types import GGMLType as T
from accelplane.errors import UnsupportedOpError

from .args import QUANT, rows_contig
from .elementwise import BINARY, SCALAR, UNARY
from .layout import X8, type_id

_TYPES = FLOAT | QUANT | {T.I32}  # every type a kernel reads or writes
_ANY_TYPE = (Op.NORM, Op.RMS_NORM, Op.L2_NORM, Op.SOFT_MAX, Op.ROPE, Op.ARGMAX, Op.ARGSORT, Op.COL2IM_1D,
             Op.IM2COL, Op.CONCAT, Op.SUM, Op.SUM_ROWS, Op.MEAN)  # fmt: skip


def _addressable(t) -> bool:
    """Whole rows of a weight stored in the x8 layouts, or not such a weight (layout.py)."""
    try:
        type_id(t)
    except UnsupportedOpError:
        return False
    return True


def _copy(op) -> bool:
    a = op.src[0]
    d = op.src[1] if op.op is Op.CPY else op
    if a.type == T.I32 or d.type == T.I32:
        return a.type == d.type
    if a.type in QUANT:
        return d.type == T.F32 and a.is_contiguous()
    if d.type in QUANT:
        return d.type in (T.Q8_0, T.Q4_0) and d.is_contiguous()
    return True


def supports(op) -> bool:
    o = op.op
    if o is None or o in VIEW_OPS:
        return True
    if any(t is not None and t.type not in _TYPES for t in (op, *op.src)):
        return False  # a block type no kernel decodes
    if any(t is not None and t.nelements >= 1 << 31 for t in (op, *op.src)):
        return False  # kernels decompose indices in 32 bits
    if not all(_addressable(t) for t in (op, *op.src) if t is not None and t.type in X8):
        return False  # a view cutting the rows of regrouped weights
    s = op.src
    if o is Op.UNARY and UnaryOp(op.op_params[0]) not in UNARY:
        return False
    if o in BINARY or o in SCALAR or o is Op.UNARY or o is Op.GLU:
        return all(x is None or x.type in FLOAT for x in s) and op.type in FLOAT
    if o is Op.ROPE and len(s) > 2:
        return False  # frequency factors (ggml's c): the rope kernels rotate without them
    if o in _ANY_TYPE:
        return op.type in FLOAT | {T.I32} if o is Op.CONCAT else True
    if o in (Op.CPY, Op.CONT, Op.DUP):
        return _copy(op)
    if o is Op.GET_ROWS:
        return s[0].type in FLOAT | {T.I32} or (s[0].type in QUANT and rows_contig(s[0]))
    if o is Op.SET_ROWS:
        return s[0].type in FLOAT or (s[0].type in (T.Q8_0, T.Q4_0) and rows_contig(s[0]))
    if o is Op.MUL_MAT:
        a = s[0]
        return a.type in FLOAT | QUANT and (a.type not in QUANT or rows_contig(a))
    if o is Op.MUL_MAT_ID:
        a, b, _ = s
        return a.ne[0] % 32 == 0 and rows_contig(a) and b.type == T.F32
    return False
