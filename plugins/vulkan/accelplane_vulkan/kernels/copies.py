"""Copies: CPY, CONT, DUP (type conversion, quantizing into Q8_0/Q4_0/... blocks) and CONCAT."""

from __future__ import annotations

from accelplane.core.tensor import Tensor

from .base import QUANT, Dispatch, elementwise, enb, eoffs, pack


def cpy(t: Tensor) -> list[Dispatch]:
    a = t.src[0]
    dst = t  # CPY: t is a view of src[1] (same memory and layout); CONT/DUP: t itself
    push = pack(a.ne, enb(a), dst.ne, enb(dst), eoffs(a), eoffs(dst))
    if dst.type in QUANT:
        return elementwise("quantize", (a.type, dst.type), (a, None, None, dst), push, dst.nelements // 32)
    return elementwise("copy", (a.type, dst.type), (a, None, None, dst), push, dst.nelements)


def concat(t: Tensor) -> list[Dispatch]:
    a, b = t.src
    push = pack(t.ne, a.ne, enb(a), enb(b), enb(t), eoffs(a), eoffs(b), eoffs(t), t.op_params[0])
    return elementwise("concat", (int(t.type.type_size == 4),), (a, b, None, t), push, t.nelements)
