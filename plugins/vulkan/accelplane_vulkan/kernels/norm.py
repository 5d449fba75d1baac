"""Row-wise ops: norms (NORM, RMS_NORM, L2_NORM; fused with the MUL that follows), SOFT_MAX and
ROPE."""

from __future__ import annotations

import math

from accelplane.core.ops import ROPE_TYPE_NEOX, Op, rope_params, rope_yarn_corr_dims
from accelplane.core.tensor import Tensor

from .base import NO_MASK, Dispatch, elementwise, enb, eoffs, pack, rows


def norm(t: Tensor, mul: Tensor | None = None) -> list[Dispatch]:
    """A row norm; with ``mul`` (the MUL that reads it, fused) times the MUL's other operand,
    written to the MUL's tensor."""
    (a,) = t.src
    code = {Op.NORM: 0, Op.RMS_NORM: 1, Op.L2_NORM: 2}[t.op]
    out, w = (t, None) if mul is None else (mul, mul.src[1])
    wq = (w.ne, enb(w), eoffs(w)) if w is not None else ((1, 1, 1, 1), (0, 0, 0, 0), 0)
    push = pack(a.ne, enb(a), enb(out), wq[0], wq[1], eoffs(a), eoffs(out), wq[2], float(t.op_params[0]))
    return rows(t, "norm", (code, int(w is not None)), push, (a, w, None, out))


def fused_dispatches(nodes, i: int, fusion) -> tuple[int, list[Dispatch]]:
    """Nodes ``i ..`` as one dispatch where a fused shader exists and accelplane.fusion allows
    it: (how many nodes it covers, its dispatches); (0, []) where none applies."""
    m = fusion.norm_mul(i)
    if m is not None:
        return 2, norm(nodes[i], m)
    return 0, []


def soft_max(t: Tensor) -> list[Dispatch]:
    a, mask = t.src
    scale, max_bias = float(t.op_params[0]), float(t.op_params[1])
    n_head = a.ne[2]
    nhl2 = 1 << int(math.floor(math.log2(n_head))) if n_head > 0 else 1
    m0 = 2.0 ** (-max_bias / nhl2)
    m1 = 2.0 ** (-(max_bias / 2.0) / nhl2)
    m = mask if mask is not None else a
    push = pack(
        a.ne, enb(a), m.ne, enb(m), enb(t), eoffs(a), eoffs(m), eoffs(t), scale, max_bias, m0, m1, nhl2
    )
    spec = (mask.type if mask is not None else NO_MASK,)
    return rows(t, "softmax", spec, push, (a, mask, None, t))


def rope(t: Tensor) -> list[Dispatch]:
    a, pos = t.src[:2]
    ff = t.src[2] if len(t.src) > 2 else None  # frequency factors: a contiguous F32 vector
    n_dims, mode, n_ctx_orig, base, fscale, ext, attn, bfast, bslow = rope_params(t)
    low, high = rope_yarn_corr_dims(n_dims, n_ctx_orig, base, bfast, bslow)
    if not math.isfinite(high):
        high = -1e30  # n_ctx_orig <= 0: an empty ramp, as ggml (the ramp is then 0 or 1)
    mscale = attn * (1.0 + 0.1 * math.log(1.0 / fscale)) if ext != 0.0 else attn
    push = pack(
        a.ne,
        enb(a),
        enb(t),
        eoffs(a),
        eoffs(pos),
        eoffs(t),
        enb(pos)[0],
        int(n_dims),
        eoffs(ff) if ff is not None else 0,
        -2.0 * math.log2(base) / n_dims,
        float(fscale),
        float(ext),
        float(mscale),
        float(low),
        float(high),
    )
    n = (a.ne[0] + 1) // 2 * a.ne[1] * a.ne[2] * a.ne[3]
    spec = (a.type, int(mode == ROPE_TYPE_NEOX), int(ff is not None))
    return elementwise("rope", spec, (a, pos, ff, t), push, n)
