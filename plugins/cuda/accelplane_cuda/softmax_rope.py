"""SOFT_MAX and ROPE (kernels/softmax_rope.cu); ROPE → view → SET_ROWS and a head norm with its
MUL before a ROPE (and the SET_ROWS after it) as one launch (fuse.py)."""

from __future__ import annotations

import math

import numpy as np
from accelplane.core.fusion import NormRope, overlap
from accelplane.core.ops import ROPE_TYPE_NEOX, ROPE_TYPE_NORMAL, Op, rope_params, rope_yarn_corr_dims
from accelplane.core.types import GGMLType as T

from . import compiler
from .args import CTYPE, HALF_TYPES, f64

WARP_ROW_MAX = 1024  # soft_max rows up to this long get a warp each (registers only), longer a block
WARP_ROWS = 4  # rows (warps) per block of the warp form

FAMILY = compiler.family("softmax_rope", {
    "k_soft_max": compiler.product(HALF_TYPES, (False, True)),
    "k_rope": compiler.product(HALF_TYPES, HALF_TYPES),
    "k_norm_rope": compiler.product(HALF_TYPES),
})  # fmt: skip
NORM_ROPE_ROWS = 4  # rows (warps) per block of k_norm_rope


def rotation(rope) -> list[int]:
    """kernels/common.cuh rope_cs's parameters for ROPE node ``rope``: freq_scale, ext_factor,
    attn_factor, YaRN's two correction dims and theta_scale, as double bits."""
    (n_dims, _, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor,
     beta_fast, beta_slow) = rope_params(rope)  # fmt: skip
    c0, c1 = rope_yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
    c1 = c1 if math.isfinite(c1) else -1e30
    return [f64(x) for x in (freq_scale, ext_factor, attn_factor, c0, c1, freq_base ** (-2.0 / n_dims))]


def soft_max(plan, n) -> None:
    a, mask = n.src
    scale, max_bias = n.op_params
    nh = a.ne[2]
    nhl = 1 << int(math.floor(math.log2(nh))) if nh > 0 else 1
    m0 = 2.0 ** (-max_bias / nhl)
    m1 = 2.0 ** (-max_bias / 2.0 / nhl)
    mne = mask.ne if mask is not None else (1, 1, 1, 1)
    mnb = mask.nb if mask is not None else (0, 0, 0, 0)
    P = plan.params([*a.ne, *a.nb, *n.nb, mne[1], mne[2], mne[3], *mnb, int(mask is not None), f64(scale),
                     f64(max_bias), nhl, f64(m0), f64(m1)])  # fmt: skip
    mt = "__half" if mask is not None and mask.type == T.F16 else "float"
    mp = plan.ptr(mask) if mask is not None else np.uint64(0)
    warp = a.ne[0] <= WARP_ROW_MAX
    grid = ((a.nrows + WARP_ROWS - 1) // WARP_ROWS,) if warp else (a.nrows,)
    plan.launch(compiler.name("k_soft_max", mt, warp), 0, (P, plan.ptr(n), plan.ptr(a), mp),
                block=32 * WARP_ROWS if warp else 256, grid=grid)  # fmt: skip


def rope(plan, n, sr=None) -> None:
    """ROPE node ``n``; with ``sr`` (a SET_ROWS of its result, fusion.rope_set_rows and
    rope_rows_fit said yes), each token's rotated values go straight into the cache row that
    SET_ROWS names, converted to the cache's type, and the rope's memory stays unwritten."""
    a, pos = n.src
    out, P, rows = _rope_params(plan, n, a, sr)
    args = (plan.params(P), plan.ptr(out), plan.ptr(a), plan.ptr(pos), rows, plan.err)
    plan.launch(compiler.name("k_rope", CTYPE[a.type], CTYPE[out.type]), a.ne[0] // 2 * a.nrows, args)


def _rope_params(plan, n, a, sr) -> tuple:
    """(the tensor written, k_rope's P, the rows pointer) for ROPE ``n`` rotating rows of ``a``
    (the rope's source, or the norm's before it), into SET_ROWS ``sr``'s cache when given."""
    n_dims, mode = n.op_params[1:3]
    out, dnb, rows, extra = n, list(n.nb), np.uint64(0), [0, 0]
    if sr is not None:
        out, idx = sr.src[0], sr.src[2]
        es = out.nb[0]
        dnb = [es, es * n.ne[0], out.nb[1], 0]  # head i1 within the row, token i2 → row idx[i2]
        rows, extra = plan.ptr(idx), [out.ne[1], idx.nb[0]]
        plan.uses_index = True
    return out, [*a.ne, *a.nb, *dnb, n_dims, 2 if mode == ROPE_TYPE_NEOX else 0, *rotation(n), *extra], rows


def norm_rope_fits(r: NormRope, view) -> bool:
    """k_norm_rope takes the run: an RMS_NORM of F32 rows of an even number of contiguous
    elements, weights of one contiguous F32 row that long, a plain or NeoX ROPE without
    frequency factors into F32/F16, a SET_ROWS (``view``: the node before it) as
    rope_rows_fit allows, and the rows written not over the rows read (the allocator may place
    the result over the norm's source, which other warps still read) unless exactly in place."""
    x, w, rope = r.norm.src[0], r.mul.src[1], r.rope
    out = rope if r.set_rows is None else r.set_rows.src[0]
    in_place = out.offs == x.offs and tuple(out.nb) == tuple(x.nb)
    return (r.norm.op is Op.RMS_NORM and (in_place or not overlap(out, x))
            and x.type == T.F32 and x.nb[0] == 4 and x.ne[0] % 2 == 0
            and w.type == T.F32 and w.is_contiguous() and tuple(w.ne) == (x.ne[0], 1, 1, 1)
            and len(rope.src) == 2 and rope.op_params[2] in (ROPE_TYPE_NORMAL, ROPE_TYPE_NEOX)
            and rope.type in (T.F32, T.F16) and rope.nb[0] == rope.type.type_size
            and (r.set_rows is None or rope_rows_fit(rope, view, r.set_rows)))  # fmt: skip


def norm_rope(plan, r: NormRope) -> None:
    """The run as one k_norm_rope launch (norm_rope_fits said yes): the rotated rows written
    where the ROPE (or the SET_ROWS after it) writes them; the norm's and the product's memory
    stays unwritten."""
    x, pos = r.norm.src[0], r.rope.src[1]
    out, P, rows = _rope_params(plan, r.rope, x, r.set_rows)
    args = (plan.params([*P, f64(r.norm.op_params[0])]), plan.ptr(out), plan.ptr(x), plan.ptr(pos), rows,
            plan.err, plan.ptr(r.mul.src[1]))  # fmt: skip
    plan.launch(compiler.name("k_norm_rope", CTYPE[out.type]), 0, args, block=32 * NORM_ROPE_ROWS,
                grid=(-(-x.nrows // NORM_ROPE_ROWS),))  # fmt: skip


def rope_rows_fit(rope, view, sr) -> bool:
    """ROPE → view → SET_ROWS in the shape k_rope's rows mode writes: a contiguous rope
    result of one batch whose view is its tokens as rows (ne0 · ne1 values each), set into
    a 2-D F16/F32 cache of rows that long by a contiguous I32 index per token."""
    cache, src, idx = sr.src
    return (rope.type in (T.F32, T.F16) and rope.is_contiguous() and rope.ne[3] == 1
            and cache.type in (T.F32, T.F16) and cache.nb[0] == cache.type.type_size
            and cache.ne[2] == cache.ne[3] == 1 and src is view and view.view_offs == 0
            and tuple(view.ne) == (rope.ne[0] * rope.ne[1], rope.ne[2], 1, 1)
            and view.is_contiguous() and cache.ne[0] == view.ne[0]
            and idx.type == T.I32 and tuple(idx.ne) == (rope.ne[2], 1, 1, 1))  # fmt: skip


OPS = {Op.SOFT_MAX: soft_max, Op.ROPE: rope}
