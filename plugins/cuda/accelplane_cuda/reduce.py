"""Reductions (kernels/reduce.cu): SUM_ROWS and MEAN, SUM, ARGMAX, ARGSORT."""

from __future__ import annotations

from accelplane.core.ops import Op, SortOrder

from . import compiler
from .args import CTYPE

_F = list(CTYPE.values())
FAMILY = compiler.family("reduce", {
    "k_sum_rows": compiler.product(_F), "k_sum": compiler.product(_F), "k_argmax": [()], "k_argsort": [()],
})  # fmt: skip


def sum_rows(plan, n) -> None:
    """SUM_ROWS, or MEAN (the sum over the row's length): one block per row."""
    a = n.src[0]
    P = plan.params([*a.ne, *a.nb, *n.nb[1:], int(n.op is Op.MEAN)])
    plan.launch(compiler.name("k_sum_rows", CTYPE[a.type]), 0, (P, plan.ptr(n), plan.ptr(a)), grid=(a.nrows,))


def sum_all(plan, n) -> None:
    a = n.src[0]
    P = plan.params([a.nelements, *a.ne, *a.nb])
    plan.launch(compiler.name("k_sum", CTYPE[a.type]), 0, (P, plan.ptr(n), plan.ptr(a)), block=1024,
                grid=(1,))  # fmt: skip


def argmax(plan, n) -> None:
    a = n.src[0]
    P = plan.params([a.ne[0], a.ne[1], a.nb[0], a.nb[1], n.nb[0]])
    plan.launch("k_argmax", 0, (P, plan.ptr(n), plan.ptr(a)), block=1024, grid=(a.ne[1],))


def argsort(plan, n) -> None:
    a = n.src[0]
    P = plan.params([*a.ne, *a.nb, *n.nb, int(n.op_params[0] == SortOrder.DESC)])
    plan.launch("k_argsort", 0, (P, plan.ptr(n), plan.ptr(a)), block=256, grid=(a.nrows,))


OPS = {Op.SUM_ROWS: sum_rows, Op.MEAN: sum_rows, Op.SUM: sum_all, Op.ARGMAX: argmax, Op.ARGSORT: argsort}
