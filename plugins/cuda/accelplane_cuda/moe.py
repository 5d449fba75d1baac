"""MUL_MAT_ID, the experts' product (kernels/moe.cu, and matvec.cu's k_mul_mat_id).

Up to ``GROUPED_MIN_TOKENS - 1`` tokens, a row at a time (matvec.mul_mat_id_rows: the register
mat-vec per (token, slot) for its layouts, else ``k_mul_mat_id``): a decode step reads each
used expert once. From
``GROUPED_MIN_TOKENS`` tokens on, the rows are grouped by expert on the device
(``k_moe_route``: counts, offsets and a tile list, with no host round trip, so the op stays
inside the plan's CUDA graph) and ``k_moe_gemm`` multiplies each tile of one expert's rows by
its weights on the tensor cores (F16 products, F32 sums, the weights dequantized on the fly):
an expert's weights are read once per 64 of its rows instead of once per row.
"""

from __future__ import annotations

import numpy as np
from accelplane.core.ops import Op

from . import compiler
from .layout import type_id
from .matvec import WEIGHT_TYPES, mul_mat_id_rows, x_f32

GROUPED_MIN_TOKENS = 9  # llama.cpp's CUDA backend also takes up to 8 tokens a row at a time (MMVQ)
TM, TN = 64, 64  # kernels/moe.cu: MOE_TM, MOE_TN
MAX_EXPERTS = 1024  # kernels/moe.cu: MOE_MAX_EXP (k_moe_route's block)

FAMILY = compiler.family("moe", {
    "k_moe_route": [()],
    "k_moe_gemm": compiler.product(WEIGHT_TYPES),
})  # fmt: skip


def grouped(n) -> bool:
    """Whether MUL_MAT_ID node ``n`` takes the grouped product."""
    a, b, ids = n.src
    return ids.ne[1] >= GROUPED_MIN_TOKENS and a.ne[2] <= MAX_EXPERTS


def mul_mat_id(plan, n) -> None:
    if n.nelements == 0:
        return
    if not grouped(n):
        mul_mat_id_rows(plan, n)
        return
    a, b, ids = n.src
    plan.uses_index = True
    n_used, n_tok = ids.ne[0], ids.ne[1]
    r = n_used * n_tok
    max_tiles = -(-r // TM) + a.ne[2]
    rows = plan.scratch(4 * r)
    tiles = plan.scratch(4 * (1 + 3 * max_tiles))
    P = plan.params([n_used, n_tok, a.ne[2], ids.nb[0], ids.nb[1]])
    plan.launch("k_moe_route", 0, (P, plan.ptr(ids), np.uint64(rows), np.uint64(tiles), plan.err),
                block=MAX_EXPERTS, grid=(1,))  # fmt: skip
    xp, xnb = x_f32(plan, b)
    P = plan.params([a.ne[1], a.ne[0], n_used, b.ne[1], a.nb[1], a.nb[2], xnb[1], xnb[2], n.nb[1], n.nb[2]])
    plan.launch(compiler.name("k_moe_gemm", type_id(a)), 0,
                (P, plan.ptr(n), plan.ptr(a), xp, np.uint64(rows), np.uint64(tiles)), block=128,
                grid=(-(-a.ne[1] // TN), max_tiles))  # fmt: skip


OPS = {Op.MUL_MAT_ID: mul_mat_id}
