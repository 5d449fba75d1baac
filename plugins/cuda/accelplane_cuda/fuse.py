"""Runs of nodes launched as one kernel, where accelplane.core.fusion allows it and a fused kernel
takes the shapes: ROPE → view → SET_ROWS, ADD + norm (+ MUL), norm + MUL, norm + MUL + ROPE (→
view → SET_ROWS), the Q/K/V projection with its ropes and cache writes, the decode attention, a
MoE layer's gating (a decode's with its router product), its gate and up products (one launch)
and its weighted sum over the experts."""

from __future__ import annotations

from accelplane.core.fusion import NORMS, Fusion, enabled, scales_rows
from accelplane.core.ops import Op
from accelplane.core.types import GGMLType as T

from . import attention, moe, norm, qkv, softmax_rope
from .matvec import mul_mat_id_rows

_ATTENTION = (Op.MUL_MAT, Op.SOFT_MAX, Op.MUL_MAT)


def fuse(plan, fusion: Fusion, i: int, nodes) -> int:
    """Launch nodes ``i ..`` as one kernel where one applies; how many nodes that covered (0:
    none, the caller launches node ``i`` alone)."""
    n = nodes[i]
    if n.op is Op.ROPE:
        sr = fusion.rope_set_rows(i)
        if sr is not None and softmax_rope.rope_rows_fit(n, nodes[i + 1], sr):
            softmax_rope.rope(plan, n, sr)
            plan.fused.append(("ROPE", "SET_ROWS"))
            return 3
        return 0
    if n.op is Op.SOFT_MAX:
        g = fusion.moe_gating(i)
        if g is not None and moe.gating_fits(g):
            moe.gating(plan, g)
            plan.fused.append(_gating_ops(g))
            return g.covered
        return 0
    # (nothing is left unwritten: only ACCELPLANE_FUSION=0 stops it)
    if n.op is Op.MUL_MAT_ID and enabled() and i + 1 < len(nodes) and moe.pairs(n, nodes[i + 1]):
        mul_mat_id_rows(plan, n, nodes[i + 1])
        plan.fused.append(("MUL_MAT_ID", "MUL_MAT_ID"))
        return 2
    if n.op is Op.MUL:
        s = fusion.moe_sum(i)
        if s is not None and moe.sum_fits(s):
            moe.weighted_sum(plan, s)
            plan.fused.append(("MUL", *("ADD",) * (s.k - 1)))
            return s.covered
    if n.op is Op.ADD and i + 1 < len(nodes) and nodes[i + 1].op in NORMS:
        covered = _add_norm(plan, fusion, i, nodes)
        if covered:
            return covered
    nr = fusion.norm_rope(i)
    if nr is not None and softmax_rope.norm_rope_fits(nr, nodes[i + 3] if nr.set_rows else None):
        softmax_rope.norm_rope(plan, nr)
        plan.fused.append((n.op.name, "MUL", "ROPE", *(("SET_ROWS",) if nr.set_rows else ())))
        return nr.covered
    m = fusion.norm_mul(i)
    if m is not None:
        norm.norm(plan, n, m)
        plan.fused.append((n.op.name, "MUL"))
        return 2
    if n.op is Op.MUL_MAT:
        g = fusion.moe_gating(i + 1) if i + 1 < len(nodes) and nodes[i + 1].op is Op.SOFT_MAX else None
        if g is not None and moe.gating_fits(g) and moe.router_fits(n, g):
            moe.router_gating(plan, n, g)
            plan.fused.append(("MUL_MAT", *_gating_ops(g)))
            return 1 + g.covered
        f = fusion.product_rope_cache(i)
        if f is not None and qkv.fits(plan, f):
            qkv.run(plan, f)
            plan.fused.append(("MUL_MAT", "ROPE", "ROPE", "SET_ROWS", "SET_ROWS"))
            return f.covered
        run = nodes[i : i + 3]
        if fusion.match(i, _ATTENTION) and attention.fits(*run):
            attention.attention(plan, *run)
            plan.fused.append(tuple(o.name for o in _ATTENTION))
            return 3
    return 0


def _gating_ops(g) -> tuple[str, ...]:
    return ("SOFT_MAX", "ARGSORT", "GET_ROWS", *(("SUM_ROWS", "DIV") if g.normed is not None else ()))


def _add_norm(plan, fusion: Fusion, i: int, nodes) -> int:
    """A residual ADD of same-shape F32 tensors, the norm of its sum and the MUL scaling that:
    one k_norm launch that also writes the sum (3 nodes; 2 without the MUL)."""
    n, nrm = nodes[i], nodes[i + 1]
    a, b = n.src
    if not (tuple(a.ne) == tuple(b.ne) == tuple(n.ne) and T.F32 == a.type == b.type == n.type):
        return 0
    if fusion.match(i, (Op.ADD, nrm.op, Op.MUL), written=(0,)) and scales_rows(nrm, nodes[i + 2]):
        norm.norm(plan, nrm, nodes[i + 2], add=n)
        plan.fused.append(("ADD", nrm.op.name, "MUL"))
        return 3
    if fusion.match(i, (Op.ADD, nrm.op), written=(0,)):
        norm.norm(plan, nrm, add=n)
        plan.fused.append(("ADD", nrm.op.name))
        return 2
    return 0
