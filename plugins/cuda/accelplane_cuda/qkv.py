"""The decode's Q/K/V projection with what reads its result (accelplane.core.fusion.product_rope_cache:
the Q rope, the K rope into the K cache, the V cache write) as one k_mmv_row1 launch with its
epilogue (kernels/matvec.cu: qkv_put), which ropes each pair of adjacent rows, stores Q and puts
K and V into their caches."""

from __future__ import annotations

from accelplane.core.fusion import RopeCache
from accelplane.core.ops import ROPE_TYPE_NORMAL
from accelplane.core.types import GGMLType as T

from . import matvec, softmax_rope


def fits(plan, f: RopeCache) -> bool:
    """The run in the shape k_mmv_row1's epilogue writes: an F32 product [Q | K | V] of one row
    taking k_mmv_row1 with whole rope pairs in a block; normal rope over heads of an even size, Q
    and K contiguous slices at its start, the K rope into its cache as k_rope's rows mode takes
    it, V (as many rows as K) a contiguous slice at its end set into an F16/F32 cache by I32
    indices; positions I32, one token."""
    n, q, k, k_set, v_set, _ = f
    if not (matvec.takes_row(n) and n.type == T.F32 and n.is_contiguous() and n.nrows == 1):
        return False
    _, rt, lpr = matvec.row1_shape(n, plan.fns.sm_count)
    if not lpr or (rt * 128 // lpr) % 2:
        return False
    m = n.ne[0]
    qs, ks, vs = q.src[0], k.src[0], v_set.src[1]
    nq, nk = qs.nelements, ks.nelements
    hd, pos = q.ne[0], q.src[1]
    cache, idx = v_set.src[0], v_set.src[2]
    return (q.op_params[2] == ROPE_TYPE_NORMAL and hd % 2 == 0 and nq % hd == 0 and k.ne[0] == hd
            and m == nq + 2 * nk and nk % 2 == 0 and q.type == T.F32 and q.is_contiguous()
            and all(t.is_contiguous() for t in (qs, ks, vs))
            and (qs.view_offs, ks.view_offs, vs.view_offs) == (0, 4 * nq, 4 * (nq + nk))
            and vs.nelements == nk and vs.ne[3] == 1 and pos.type == T.I32 and pos.nelements == 1
            and softmax_rope.rope_rows_fit(k, plan.nodes[plan.index[id(k)] + 1], k_set)
            and cache.type in (T.F32, T.F16) and cache.nb[0] == cache.type.type_size
            and idx.type == T.I32 and idx.ne[0] == vs.ne[1] and vs.ne[2] % idx.ne[1] == 0)  # fmt: skip


def params(plan, f: RopeCache) -> list[int]:
    """The epilogue's parameters (kernels/matvec.cu: qkv_put) for a run :func:`fits` took."""
    n, q, k, k_set, v_set, _ = f
    plan.uses_index = True

    def put(sr, ne: tuple[int, int]) -> list[int]:  # kernels/matvec.cu: cache_put
        d, idx = sr.src[0], sr.src[2]
        return [int(plan.ptr(d)), int(plan.ptr(idx)), *ne, *d.nb[:3], *idx.nb[:2], idx.ne[1], d.ne[1],
                int(d.type == T.F16)]  # fmt: skip

    nk, vs = k.src[0].nelements, v_set.src[1]
    return [q.src[0].nelements, nk, q.ne[0], q.op_params[1], *softmax_rope.rotation(q), int(plan.ptr(q)),
            int(plan.ptr(q.src[1])), int(plan.err), *put(k_set, (nk, 1)),
            *put(v_set, (vs.ne[0], vs.ne[1]))]  # fmt: skip


def run(plan, f: RopeCache) -> None:
    """Launch the fused projection."""
    matvec.mmv_row(plan, f[0], params(plan, f))
