"""Row gathers and scatters: GET_ROWS, SET_ROWS (a bad index sets the stream's error word)."""

from __future__ import annotations

from accelplane.core.tensor import Tensor

from .base import QUANT, Dispatch, elementwise, enb, eoffs, pack


def get_rows(t: Tensor) -> list[Dispatch]:
    a, idx = t.src
    push = pack(t.ne, enb(a), enb(idx), enb(t), eoffs(a), eoffs(idx), eoffs(t), a.ne[1])
    return elementwise("get_rows", (a.type, t.type), (a, idx, None, t), push, t.nelements)


def set_rows(t: Tensor) -> list[Dispatch]:
    dst, src, idx = t.src
    push = pack(src.ne, enb(src), idx.ne, enb(idx), enb(t), eoffs(src), eoffs(idx), eoffs(t), dst.ne[1])
    per = 32 if dst.type in QUANT else 1
    return elementwise("set_rows", (dst.type,), (src, None, idx, t), push, src.nelements // per)
