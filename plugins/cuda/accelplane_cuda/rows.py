"""Rows and copies (kernels/rows.cu): GET_ROWS, SET_ROWS, CPY / CONT / DUP (quantizing into Q4_0
and Q8_0, dequantizing from every quantized type), CONCAT, and the converted copies that other
launches stage their inputs in."""

from __future__ import annotations

import numpy as np
from accelplane.core.ops import Op
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType as T

from . import compiler
from .args import CTYPE, QUANT, QUANT_IDS
from .layout import X8Type, type_id

# the kernel type ids the kernels write (CPY and SET_ROWS into Q4_0 / Q8_0, and their x8 layouts)
WRITE_QUANT = (T.Q4_0, T.Q8_0, X8Type.Q4_0X8, X8Type.Q8_0X8)
CONCAT_TYPE = {4: "int", 2: "short"}  # CONCAT moves elements of these sizes (F32 as float)

_F = list(CTYPE.values())
FAMILY = compiler.family("rows", {
    "k_get_rows": compiler.product(_F), "k_get_rows_q": compiler.product(QUANT_IDS), "k_get_rows_i32": [()],
    "k_set_rows": compiler.product(_F), "k_set_rows_q": compiler.product(WRITE_QUANT),
    "k_cpy": compiler.product(_F, _F), "k_cpy_i32": [()], "k_cpy_q": compiler.product(WRITE_QUANT, _F),
    "k_cpy_dq": compiler.product(QUANT_IDS),
    "k_concat": compiler.product(("float", "short", "int")),
    "k_convert": compiler.product(_F, _F),
})  # fmt: skip


def get_rows(plan, n) -> None:
    a, idx = n.src
    plan.uses_index = True
    P = plan.params([*n.ne, *n.nb, *a.nb, *idx.nb[:3], a.ne[1]])
    args = (P, plan.ptr(n), plan.ptr(a), plan.ptr(idx), plan.err)
    if a.type in QUANT:
        plan.launch(compiler.name("k_get_rows_q", type_id(a)), n.nelements // 32, args)
    elif a.type == T.I32:
        plan.launch("k_get_rows_i32", n.nelements, args)
    else:
        plan.launch(compiler.name("k_get_rows", CTYPE[a.type]), n.nelements, args)


def set_rows(plan, n) -> None:
    dst, src, idx = n.src
    plan.uses_index = True
    P = plan.params([*src.ne, *src.nb, *dst.nb, *idx.nb[:3], idx.ne[1], idx.ne[2], dst.ne[1]])
    args = (P, plan.ptr(dst), plan.ptr(src), plan.ptr(idx), plan.err)
    if dst.type in QUANT:
        plan.launch(compiler.name("k_set_rows_q", type_id(dst)), src.nelements // 32, args)
    else:
        plan.launch(compiler.name("k_set_rows", CTYPE[dst.type]), src.nelements, args)


def cpy(plan, n) -> None:
    """CPY into its second source; CONT and DUP into their own tensor."""
    copy(plan, n.src[0], n.src[1] if n.op is Op.CPY else n)


def concat(plan, n) -> None:
    a, b = n.src
    ct = CONCAT_TYPE[a.type.type_size] if a.type != T.F32 else "float"
    P = plan.params([n.nelements, *n.ne, *n.nb, *a.ne, *a.nb, *b.nb, n.op_params[0]])
    plan.launch(compiler.name("k_concat", ct), n.nelements, (P, plan.ptr(n), plan.ptr(a), plan.ptr(b)))


def copy(plan, src, dst, sp=None, dp=None) -> None:
    """dst (any layout) ← src (any layout), element order row-major (CPY semantics); ``sp``,
    ``dp``: addresses to use instead of the tensors' (scratch copies)."""
    n = src.nelements
    P = plan.params([n, *src.ne, *src.nb, *dst.ne, *dst.nb])
    sp = plan.ptr(src) if sp is None else sp
    dp = plan.ptr(dst) if dp is None else dp
    if src.type == T.I32:
        plan.launch("k_cpy_i32", n, (P, dp, sp))
    elif dst.type in QUANT:
        plan.launch(compiler.name("k_cpy_q", type_id(dst), CTYPE[src.type]), n // 32, (P, dp, sp))
    elif src.type in QUANT:
        plan.launch(compiler.name("k_cpy_dq", type_id(src)), n // 32, (P, dp, sp))
    else:
        plan.launch(compiler.name("k_cpy", CTYPE[dst.type], CTYPE[src.type]), n, (P, dp, sp))


def convert_name(dst: T, src: T) -> str:
    """k_convert from ``src`` to ``dst`` elements: contiguous, no index arithmetic."""
    return compiler.name("k_convert", CTYPE[dst], CTYPE[src])


def contig_copy(plan, t, ty: T) -> tuple[int, list[int]]:
    """A packed copy of t converted to ``ty`` in scratch memory: (address, nb)."""
    tmp = Tensor(ty, t.ne)
    ptr = plan.scratch(tmp.nbytes)
    if t.is_contiguous() and t.type in CTYPE:
        P = plan.params([t.nelements])
        args = (P, np.uint64(ptr), plan.ptr(t))
        vec = (ptr | int(plan.ptr(t))) % 16 == 0  # k_convert's eight elements a thread
        plan.launch(convert_name(ty, t.type), -(-t.nelements // 8) if vec else t.nelements, args)
    else:
        copy(plan, t, tmp, dp=np.uint64(ptr))
    return ptr, list(tmp.nb)


def converted(plan, t, ty: T, node) -> tuple[int, list[int]]:
    """:func:`contig_copy` of ``t`` for ``node``, made once a run for every node that reads ``t``
    (the Q, K and V projections of one activation; a MoE layer's gate and up products)."""
    got = plan.derived(ty.name, t, node)
    if got is None:
        got = contig_copy(plan, t, ty)
        plan.remember(ty.name, t, got, node)
    return got


OPS = {Op.GET_ROWS: get_rows, Op.SET_ROWS: set_rows, Op.CPY: cpy, Op.CONT: cpy, Op.DUP: cpy,
       Op.CONCAT: concat}  # fmt: skip
