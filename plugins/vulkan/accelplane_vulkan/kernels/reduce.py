"""Reductions: SUM, SUM_ROWS, MEAN, ARGMAX, ARGSORT."""

from __future__ import annotations

from accelplane.core.ops import Op, SortOrder
from accelplane.core.tensor import Tensor

from .base import Dispatch, elementwise, enb, eoffs, pack


def reduce(t: Tensor) -> list[Dispatch]:
    (a,) = t.src
    code = {Op.SUM_ROWS: 0, Op.MEAN: 1, Op.SUM: 2}[t.op]
    push = pack(a.ne, enb(a), enb(t), eoffs(a), eoffs(t))
    groups = 1 if t.op is Op.SUM else a.nrows
    return [Dispatch("reduce", (code, int(a.type)), (a, None, None, t), push, groups)]


def argmax(t: Tensor) -> list[Dispatch]:
    (a,) = t.src
    push = pack(a.ne, enb(a), eoffs(a), eoffs(t), enb(t)[0])
    return [Dispatch("argmax", (), (a, None, None, t), push, a.ne[1])]


def argsort(t: Tensor) -> list[Dispatch]:
    (a,) = t.src
    push = pack(a.ne, enb(a), enb(t), eoffs(a), eoffs(t), int(t.op_params[0] == SortOrder.DESC))
    return elementwise("argsort", (), (a, None, None, t), push, a.nelements)
