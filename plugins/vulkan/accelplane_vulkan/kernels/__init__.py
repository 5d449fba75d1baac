"""Ops → shader dispatches: which shader, its specialization constants, its bindings and push
constants, and how many workgroups. Pure Python (no Vulkan): ``supports`` is the plugin's
exact answer to supports_op, and ``dispatches`` what a plan records for a node.

One module per op family (elementwise, norm, matmul, rows, copies, reduce, conv) builds the
dispatches of its ops; base holds what they share (Caps, Dispatch, Scratch, addressing units,
push constants; the conventions of shaders/common.glsl).
"""

from __future__ import annotations

from collections.abc import Callable

from accelplane.core.ops import VIEW_OPS, Op
from accelplane.core.tensor import Tensor

from . import conv, copies, elementwise, matmul, norm, reduce, rows
from .base import LOCAL_SIZE, NEEDS_16BIT, QUANT, TYPES, Caps, Dispatch, Scratch, addressable
from .matmul import MUL_MAT_SHADERS
from .norm import fused_dispatches

__all__ = ["BUILDERS", "SHADERS", "Caps", "Dispatch", "Scratch", "dispatches", "fused_dispatches", "supports"]

BUILDERS: dict[Op, Callable[..., list[Dispatch]]] = {
    Op.ADD: elementwise.binary,
    Op.SUB: elementwise.binary,
    Op.MUL: elementwise.binary,
    Op.DIV: elementwise.binary,
    Op.SCALE: elementwise.unary,
    Op.SQR: elementwise.unary,
    Op.SQRT: elementwise.unary,
    Op.LOG: elementwise.unary,
    Op.SIN: elementwise.unary,
    Op.COS: elementwise.unary,
    Op.CLAMP: elementwise.unary,
    Op.LEAKY_RELU: elementwise.unary,
    Op.UNARY: elementwise.unary,
    Op.GLU: elementwise.glu,
    Op.NORM: norm.norm,
    Op.RMS_NORM: norm.norm,
    Op.L2_NORM: norm.norm,
    Op.SOFT_MAX: norm.soft_max,
    Op.ROPE: norm.rope,
    Op.MUL_MAT: matmul.mul_mat,
    Op.MUL_MAT_ID: matmul.mul_mat_id,
    Op.GET_ROWS: rows.get_rows,
    Op.SET_ROWS: rows.set_rows,
    Op.CPY: copies.cpy,
    Op.CONT: copies.cpy,
    Op.DUP: copies.cpy,
    Op.CONCAT: copies.concat,
    Op.SUM: reduce.reduce,
    Op.SUM_ROWS: reduce.reduce,
    Op.MEAN: reduce.reduce,
    Op.ARGMAX: reduce.argmax,
    Op.ARGSORT: reduce.argsort,
    Op.IM2COL: conv.im2col,
    Op.COL2IM_1D: conv.col2im,
}
NEEDS_CAPS = frozenset({Op.MUL_MAT, Op.MUL_MAT_ID})  # builders that take the device's Caps too
SHADERS = tuple(sorted({*LOCAL_SIZE, "norm", "softmax", "reduce", "argmax"} | MUL_MAT_SHADERS))


def supports(t: Tensor, caps: Caps) -> bool:
    """Exact supports_op: every node these builders accept computes what the oracle does."""
    if t.op in VIEW_OPS:
        return True
    if t.op not in BUILDERS:
        return False
    tensors = [t, *(s for s in t.src if s is not None)]
    if any(x.type not in TYPES for x in tensors):
        return False  # a block type the shaders do not decode (the catalog has more)
    if not caps.storage16 and any(x.type in NEEDS_16BIT for x in tensors):
        return False
    if not all(addressable(x) for x in tensors):
        return False
    if t.op is Op.UNARY and t.op_params[0] not in elementwise.UNARY_CODES:
        return False  # a ggml unary op unary.comp does not implement
    if t.op in (Op.CONT, Op.DUP) and t.type in QUANT:
        return False  # copy.comp writes element types only
    if t.op in (Op.MUL_MAT, Op.MUL_MAT_ID):
        a = t.src[0]
        if a.nb[0] != a.type.type_size:  # the kernels read a's rows as packed
            return False
    return t.nelements < 2**31


def dispatches(t: Tensor, caps: Caps | None = None) -> list[Dispatch]:
    """What to record for node ``t`` on a device with ``caps`` (nothing for empty tensors)."""
    if t.nelements == 0:
        return []
    build = BUILDERS[t.op]
    ds = build(t, caps or Caps()) if t.op in NEEDS_CAPS else build(t)  # type: ignore[call-arg]
    return [d for d in ds if d.groups > 0]
