"""MUL_MAT_ID, the experts' product (kernels/moe.cu, and matvec.cu's k_mul_mat_id).

Up to ``GROUPED_MIN_TOKENS - 1`` tokens, a row at a time (matvec.mul_mat_id_rows: the register
mat-vec per (token, slot) for its layouts, else ``k_mul_mat_id``): a decode step reads each
used expert once. From
``GROUPED_MIN_TOKENS`` tokens on, the rows are grouped by expert on the device
(``k_moe_route``: counts, offsets and a tile list, with no host round trip, so the op stays
inside the plan's CUDA graph; one route serves the layer's products of the same ids) and
``k_moe_gemm`` multiplies each tile of one expert's rows by its weights on the tensor cores
(F16 products on activations converted to F16 once, F32 sums, the weights dequantized on the
fly): an expert's weights are read once per 64 of its rows instead of once per row.

Around the products, two fused runs (accelplane.core.fusion): the gating (softmax → argsort →
top-k weights → renormalized) as ``k_moe_gating`` (a decode's with the router product before it
as ``k_moe_router``), and the weighted sum over the used experts
(MUL and its chain of ADDs) as ``k_moe_sum``; and a decode's gate and up products of the same
activations as one k_mmv_row1_id launch (``pairs``): k + 5 launches fewer per decode layer.
A decode's products read their activations quantized by the norm and the SWIGLU that wrote
them (matvec.xq_for): no k_quant_x launch either.
"""

from __future__ import annotations

import numpy as np
from accelplane.core.fusion import MoeGating, MoeSum, overlap
from accelplane.core.ops import Op, SortOrder
from accelplane.core.types import GGMLType as T

from . import compiler
from .layout import type_id
from .matvec import WEIGHT_TYPES, mul_mat_id_rows, row1_id_fits
from .rows import converted

GROUPED_MIN_TOKENS = 9  # llama.cpp's CUDA backend also takes up to 8 tokens a row at a time (MMVQ)
TM, TN, LD = 64, 64, 72  # kernels/moe.cu: MOE_TM, MOE_TN, MOE_LD
MAX_EXPERTS = 1024  # kernels/moe.cu: MOE_MAX_EXP (k_moe_route's block)

FAMILY = compiler.family("moe", {
    "k_moe_route": [()],
    "k_moe_gemm": compiler.product(WEIGHT_TYPES),
    "k_moe_gating": [()],
    "k_moe_router": [()],
    "k_moe_sum": [()],
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
    rows, tiles, max_tiles = _route(plan, n)
    # the activations as F16 rows, converted once for the products that share them (gate and up)
    xp, xnb = converted(plan, b, T.F16, n)
    P = plan.params([a.ne[1], a.ne[0], ids.ne[0], b.ne[1], a.nb[1], a.nb[2], *xnb[1:3], n.nb[1], n.nb[2]])
    plan.launch(compiler.name("k_moe_gemm", type_id(a)), 0,
                (P, plan.ptr(n), plan.ptr(a), np.uint64(xp), rows, tiles), block=2 * TN,
                grid=(-(-a.ne[1] // TN), max_tiles), smem=4 * (TM + TN) * LD)  # fmt: skip


def _route(plan, n) -> tuple[np.uint64, np.uint64, int]:
    """k_moe_route's rows and tiles for ``n``'s ids (and their tile-count bound): made once for
    the products of one MoE layer, which share them."""
    a, _, ids = n.src
    n_exp, (n_used, n_tok) = a.ne[2], ids.ne[:2]
    max_tiles = -(-n_used * n_tok // TM) + n_exp
    got = plan.derived(f"route{n_exp}", ids, n)
    if got is not None:
        return got
    plan.uses_index = True
    rows = np.uint64(plan.scratch(4 * n_used * n_tok))
    tiles = np.uint64(plan.scratch(4 * (1 + 3 * max_tiles)))
    P = plan.params([n_used, n_tok, n_exp, ids.nb[0], ids.nb[1]])
    plan.launch("k_moe_route", 0, (P, plan.ptr(ids), rows, tiles, plan.err), block=MAX_EXPERTS, grid=(1,))
    plan.remember(f"route{n_exp}", ids, (rows, tiles, max_tiles), n)
    return rows, tiles, max_tiles


def pairs(n, nxt) -> bool:
    """MUL_MAT_IDs ``n`` and ``nxt`` (consecutive nodes) run as one k_mmv_row1_id launch: a
    decode's products of the same activations and ids (a MoE layer's gate and up) by experts of
    one type, shape and strides, into results of one shape and strides."""
    if nxt.op is not Op.MUL_MAT_ID or grouped(n) or not row1_id_fits(n) or n.nelements == 0:
        return False
    a, b, ids = n.src
    a2, b2, ids2 = nxt.src
    return (b2 is b and ids2 is ids and a2.type == a.type and tuple(a2.ne) == tuple(a.ne)
            and tuple(a2.nb) == tuple(a.nb) and tuple(nxt.ne) == tuple(n.ne) and tuple(nxt.nb) == tuple(n.nb)
            and row1_id_fits(nxt))  # fmt: skip


def _f32(*ts) -> bool:
    return all(t.type == T.F32 for t in ts)


def _same(a, b, nb_a: int, nb_b: int) -> bool:
    """``a`` lies exactly over ``b`` with the same row stride: each token's row of one is that
    token's row of the other, which one block reads before it writes."""
    return a.buffer is b.buffer and a.offs == b.offs and nb_a == nb_b


def _tokens_apart(g: MoeGating) -> bool:
    """No block of k_moe_gating writes memory another block reads or writes: with several
    tokens, the allocator may have placed a later result of the run over an earlier one that
    is dead after it (the sum and the renormalized weights over the probabilities, which other
    blocks may still be writing); one token's block writes in the run's order."""
    lg, p, o, w, total, normed = g.probs.src[0], g.probs, g.order, g.weights, g.total, g.normed
    ts = [t for t in (lg, p, o, w, total, normed) if t is not None]
    exact = {(id(lg), id(p))} if _same(lg, p, lg.nb[1], p.nb[1]) else set()
    if normed is not None and _same(w, normed, w.nb[2], normed.nb[1]):
        exact.add((id(w), id(normed)))
    return not any(overlap(a, b) and (id(a), id(b)) not in exact
                   for i, a in enumerate(ts) for b in ts[i + 1 :])  # fmt: skip


def gating_fits(g: MoeGating) -> bool:
    """k_moe_gating takes the run: F32 [E, T] probabilities of unscaled logits, rows of
    contiguous elements, E <= MAX_EXPERTS, k <= 32, and with several tokens no two of the run's
    tensors sharing memory but in place (:func:`_tokens_apart`)."""
    p, o, w = g.probs, g.order, g.weights
    lg = p.src[0]
    scale, max_bias = p.op_params
    rows = (lg, p, o, *((g.normed,) if g.normed is not None else ()))
    return (_f32(lg, p, w, *((g.total, g.normed) if g.normed is not None else ())) and o.type == T.I32
            and scale == 1.0 and max_bias == 0.0 and o.op_params[0] == SortOrder.DESC
            and tuple(lg.ne) == tuple(p.ne) == tuple(o.ne) and p.ne[2] == p.ne[3] == 1
            and all(t.nb[0] == 4 for t in rows) and w.nb[1] == 4
            and p.ne[0] <= MAX_EXPERTS and 0 < g.k <= 32 and (p.ne[1] == 1 or _tokens_apart(g)))  # fmt: skip


def _gating_args(plan, g: MoeGating, extra: tuple[int, ...] = ()) -> tuple[np.uint64, tuple, int]:
    """k_moe_gating's parameters (with ``extra`` after them), its result pointers and its dynamic
    shared memory."""
    p, o, w, total, normed = g.probs, g.order, g.weights, g.total, g.normed
    E, n_tok = p.ne[0], p.ne[1]
    norm = normed is not None
    P = plan.params([E, n_tok, p.src[0].nb[1], p.nb[1], o.nb[1], g.k, w.nb[2], total.nb[1] if norm else 0,
                     normed.nb[1] if norm else 0, int(norm), *extra])  # fmt: skip
    zero = np.uint64(0)
    out = (plan.ptr(p), plan.ptr(o), plan.ptr(w), plan.ptr(total) if norm else zero,
           plan.ptr(normed) if norm else zero)  # fmt: skip
    return P, out, (2 * -(-E // 4) * 4 + E) * 4


def gating(plan, g: MoeGating) -> None:
    P, out, smem = _gating_args(plan, g)
    plan.launch("k_moe_gating", 0, (P, plan.ptr(g.probs.src[0]), *out), block=-(-g.probs.ne[0] // 32) * 32,
                grid=(g.probs.ne[1],), smem=smem)  # fmt: skip


def router_fits(n, g: MoeGating) -> bool:
    """MUL_MAT ``n`` is the router product whose logits gating run ``g`` reads, in the shape
    k_moe_router takes: one token, F32 weights [K, E] of 16-byte aligned contiguous rows (K a
    multiple of 4), F32 activations contiguous and 16-byte aligned, F32 logits."""
    a, b = n.src
    aligned = all((t.buffer.ctx.ptr + t.offs) % 16 == 0 for t in (a, b))
    return (g.probs.src[0] is n and n.type == a.type == b.type == T.F32 and n.is_contiguous()
            and a.ne[0] % 4 == 0 and a.nb[0] == 4 and a.nb[1] % 16 == 0 and a.ne[2] == a.ne[3] == 1
            and tuple(b.ne) == (a.ne[0], 1, 1, 1) and b.is_contiguous() and aligned
            and tuple(n.ne) == (a.ne[1], 1, 1, 1) and a.ne[1] <= MAX_EXPERTS)  # fmt: skip


def router_gating(plan, n, g: MoeGating) -> None:
    """The router product ``n`` and gating run ``g`` as one k_moe_router launch (router_fits
    said yes): a warp per expert, blocks of at least 128 threads and of the experts' count."""
    a, b = n.src
    early = int(id(a.buffer) not in plan.written)
    P, out, smem = _gating_args(plan, g, (a.ne[0], a.nb[1], early))
    counter = plan.zeros(1)  # each launch's last block zeroes it again
    threads = max(128, -(-a.ne[1] // 32) * 32)
    plan.launch("k_moe_router", 0, (P, plan.ptr(n), plan.ptr(a), plan.ptr(b), *out, counter), block=threads,
                grid=(-(-a.ne[1] // (threads // 32)),), smem=smem)  # fmt: skip


def sum_fits(s: MoeSum) -> bool:
    """k_moe_sum takes the run: F32 throughout, fewer than 2^31 results, and the result not over
    the experts' outputs or weights, which other threads still read, except a single token's
    result at the start of its experts' outputs (each thread reads its own element there before
    writing it)."""
    x, w = s.mul.src
    out = s.out
    apart = not overlap(out, w) and (not overlap(out, x) or (x.ne[2] == 1 and out.offs == x.offs))
    return _f32(x, w, s.mul, out) and out.nelements < 2**31 and apart


def weighted_sum(plan, s: MoeSum) -> None:
    x, w = s.mul.src
    out = s.out
    P = plan.params([x.ne[0], s.k, x.ne[2], *x.nb[:3], w.nb[1], w.nb[2], out.nb[0], out.nb[1]])
    plan.launch("k_moe_sum", out.nelements, (P, plan.ptr(out), plan.ptr(x), plan.ptr(w)))


OPS = {Op.MUL_MAT_ID: mul_mat_id}
