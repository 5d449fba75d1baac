"""The CPU plugin's graph plans: a graph becomes, once, a list of closures bound to numpy
views of the tensors' memory; computing the graph again replays the list.

Arithmetic is float32 (float64 accumulators for row reductions, like ggml's ggml_float);
F16/BF16 operands are widened to float32 and results rounded back on store. Quantized
matrix products go to the C kernels (accelplane.cpu.kernels).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from accelplane.core.fusion import Fusion
from accelplane.core.ops import (
    ROPE_TYPE_NEOX,
    GluOp,
    Op,
    SortOrder,
    UnaryOp,
    rope_params,
    rope_yarn_corr_dims,
)
from accelplane.core.tensor import Tensor, strided_view
from accelplane.core.types import GGMLType, quantize
from accelplane.cpu import repack
from accelplane.errors import ComputeError, OutOfRangeError

F32 = np.float32
Step = Callable[[], None]
View = Callable[[Tensor], np.ndarray]


def host_view(t: Tensor, memory: Callable[[object], np.ndarray] | None = None) -> np.ndarray:
    """numpy view of a tensor whose buffer's bytes ``memory(buffer)`` returns (default: the
    host buffer's array): reversed(ne) elements, or rows of raw bytes [ne3, ne2, ne1,
    row_bytes] for block types."""
    base = t.buffer.host_array if memory is None else memory(t.buffer)
    return strided_view(t, base[t.offs : t.offs + t.nbytes])


def _f32(x: np.ndarray) -> np.ndarray:
    return x if x.dtype == F32 else x.astype(F32)


def _bcast_pair(a: Tensor, b: Tensor, av: np.ndarray, bv: np.ndarray):
    """Views of a and b where b is repeated (tiled) to a's shape: each ggml dim i becomes two
    numpy axes (a.ne[i] // b.ne[i], b.ne[i]), b's outer one with stride 0."""
    shp, sa, sb = [], [], []
    for i in (3, 2, 1, 0):
        r, n = a.ne[i] // b.ne[i], b.ne[i]
        ai, bi = 3 - i, 3 - i
        shp += [r, n]
        sa += [av.strides[ai] * n, av.strides[ai]]
        sb += [0, bv.strides[bi]]
    as_ = np.lib.stride_tricks.as_strided
    return as_(av, shp, sa), as_(bv, shp, sb)


# --- op builders: (node, views...) -> step -----------------------------------------------------
_BINARY = {Op.ADD: np.add, Op.SUB: np.subtract, Op.MUL: np.multiply, Op.DIV: np.divide}


def _binary(t: Tensor, view: View) -> Step:
    a, b = t.src
    ufunc = _BINARY[t.op]
    av, bv, dv = view(a), view(b), view(t)
    if a.ne == b.ne and a.type == b.type == t.type == GGMLType.F32:
        if a.is_contiguous() and b.is_contiguous() and t.is_contiguous():
            av, bv, dv = av.reshape(-1), bv.reshape(-1), dv.reshape(-1)
        return lambda: ufunc(av, bv, out=dv)
    if a.ne != b.ne and any(b.ne[i] not in (1, a.ne[i]) for i in range(4)):
        av, bv = _bcast_pair(a, b, av, bv)
        dv = _bcast_pair(t, b, dv, view(b))[0]
    if t.type == GGMLType.F32 and a.type == GGMLType.F32 and b.type == GGMLType.F32:
        return lambda: ufunc(av, bv, out=dv)
    return lambda: dv.__setitem__(Ellipsis, ufunc(_f32(av), _f32(bv)))


def _unary_fn(t: Tensor) -> Callable[[np.ndarray], np.ndarray]:
    p = t.op_params
    op = t.op
    if op is Op.SCALE:
        s, b = F32(p[0]), F32(p[1])
        return (lambda x: x * s) if p[1] == 0 else (lambda x: x * s + b)
    if op is Op.SQR:
        return np.square
    if op is Op.SQRT:
        return np.sqrt
    if op is Op.LOG:
        return np.log
    if op is Op.SIN:
        return np.sin
    if op is Op.COS:
        return np.cos
    if op is Op.CLAMP:
        lo, hi = F32(p[0]), F32(p[1])
        return lambda x: np.minimum(np.maximum(x, lo), hi)
    if op is Op.LEAKY_RELU:  # ggml's (x > 0 ? x : 0) + k (x < 0 ? x : 0): +0 for a negative x and k 0
        k = F32(p[0])
        return lambda x: _leaky_relu(x, k)
    u = UnaryOp(p[0])
    return _UNARY[u]


def _leaky_relu(x, k):
    with np.errstate(invalid="ignore"):  # k 0 times -inf: NaN, as ggml gives
        return np.where(x > 0, x, F32(0)) + k * np.where(x < 0, x, F32(0))


def _sigmoid(x):
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x << 0: the result is 0
        return 1.0 / (1.0 + np.exp(-x))


def _gelu(x):
    c = F32(math.sqrt(2.0 / math.pi))
    return F32(0.5) * x * (F32(1.0) + np.tanh(c * x * (F32(1.0) + F32(0.044715) * x * x)))


def _gelu_erf(x):
    from accelplane.cpu import kernels

    return kernels.gelu_erf(x)


def _hardsigmoid(x):
    # fmin/fmax are C's fminf/fmaxf (ggml's): a NaN gives the other operand, unlike minimum/maximum
    return np.fmin(F32(1), np.fmax(F32(0), (x + F32(3)) / F32(6)))


def _softplus(x):
    with np.errstate(over="ignore"):  # exp(x) = inf where x > 88: those take the x branch
        return np.where(x > F32(20), x, np.log1p(np.exp(x)))


def _round(x):
    # C's roundf, halves away from zero; x - trunc(x) is exact in float32 (np.round: half to even)
    t = np.trunc(x)
    with np.errstate(invalid="ignore"):  # inf - inf: the infinity is kept by the t branch
        return np.where(np.abs(x - t) >= F32(0.5), t + np.sign(x), t)


_UNARY = {
    UnaryOp.ABS: np.abs,
    UnaryOp.NEG: np.negative,
    UnaryOp.STEP: lambda x: (x > 0).astype(F32),
    UnaryOp.TANH: np.tanh,
    UnaryOp.ELU: lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, F32(0)))),  # no overflow unused
    UnaryOp.RELU: lambda x: np.maximum(x, F32(0)),
    UnaryOp.SIGMOID: _sigmoid,
    UnaryOp.GELU: _gelu,
    UnaryOp.GELU_QUICK: lambda x: x * _sigmoid(F32(1.702) * x),
    UnaryOp.SILU: lambda x: x * _sigmoid(x),
    UnaryOp.HARDSWISH: lambda x: x * _hardsigmoid(x),
    UnaryOp.HARDSIGMOID: _hardsigmoid,
    UnaryOp.EXP: np.exp,
    UnaryOp.EXPM1: np.expm1,
    UnaryOp.SOFTPLUS: _softplus,
    UnaryOp.GELU_ERF: _gelu_erf,
    UnaryOp.FLOOR: np.floor,
    UnaryOp.CEIL: np.ceil,
    UnaryOp.ROUND: _round,
    UnaryOp.TRUNC: np.trunc,
}


def _unary(t: Tensor, view: View) -> Step:
    (a,) = t.src
    f = _unary_fn(t)
    av, dv = view(a), view(t)
    if a.is_contiguous() and t.is_contiguous():
        av, dv = av.reshape(-1), dv.reshape(-1)
    if a.type == t.type == GGMLType.F32:
        return lambda: dv.__setitem__(Ellipsis, f(av))

    def widened() -> None:
        with np.errstate(over="ignore"):  # a result past F16's range is stored as inf, as ggml's
            dv[...] = f(_f32(av))

    return widened


def _glu(t: Tensor, view: View) -> Step:
    a, b = t.src
    op, swapped = GluOp(t.op_params[0]), bool(t.op_params[1])
    f = _UNARY[UnaryOp.SILU] if op is GluOp.SWIGLU else _gelu
    av, dv = view(a), view(t)
    if b is None:
        h = t.ne[0]
        x, g = av[..., :h], av[..., h : 2 * h]
        if swapped:
            x, g = g, x
    else:
        x, g = av, view(b)
    if op is GluOp.SWIGLU and t.type == GGMLType.F32:
        from accelplane.cpu import kernels

        fast = kernels.prepare_swiglu(x, g, dv)
        if fast is not None:
            return fast

        def swiglu() -> None:  # x / (1 + exp(-x)) * g with one temporary
            xf = _f32(x)
            tmp = np.negative(xf)
            with np.errstate(over="ignore"):  # exp(-x) = inf for x << 0: the result is 0
                np.exp(tmp, out=tmp)
            tmp += 1.0
            np.divide(xf, tmp, out=tmp)
            np.multiply(tmp, g, out=dv, casting="unsafe")

        return swiglu
    return lambda: dv.__setitem__(Ellipsis, f(_f32(x)) * _f32(g))


def _norm(t: Tensor, view: View, mul: Tensor | None = None) -> Step:
    """A row norm (sums in float64); with ``mul`` (the MUL reading it, fused) times the MUL's
    other operand, written to the MUL's tensor."""
    (a,) = t.src
    eps = t.op_params[0]
    op = t.op
    av = view(a)
    dv, wv = (view(t), None) if mul is None else (view(mul), view(mul.src[1]))
    if a.type == GGMLType.F32:
        from accelplane.cpu import kernels

        fast = kernels.prepare_norm({Op.NORM: 0, Op.RMS_NORM: 1, Op.L2_NORM: 2}[op], av, dv, eps, wv)
        if fast is not None:
            return fast

    def step() -> None:
        x = av.astype(np.float64)  # one cast: float64 ops after it take numpy's fast loops
        if op is Op.NORM:
            x = x - x.mean(axis=-1, keepdims=True)
            y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
        elif op is Op.RMS_NORM:
            y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
        else:
            y = x / np.maximum(np.sqrt((x * x).sum(axis=-1, keepdims=True)), eps)
        if wv is None:
            dv[...] = y
        else:
            np.multiply(y, wv, out=dv, casting="unsafe")

    return step


def fused_step(nodes: list[Tensor], i: int, fusion, view: View) -> tuple[int, Step | None]:
    """Nodes ``i ..`` as one step where accelplane.core.fusion allows it: (nodes covered, step);
    (0, None) where nothing applies. A norm and the MUL scaling it: one pass over the rows
    (numpy's broadcasting, so each of w's dims is 1 or the norm's); a MoE layer's gating and
    its weighted sum over the experts; attention (KQ, SOFT_MAX, KQV) as one C kernel."""
    m = fusion.norm_mul(i)
    if m is not None and all(m.src[1].ne[k] in (1, m.ne[k]) for k in range(4)):
        return 2, _norm(nodes[i], view, m)
    mg = fusion.moe_gating(i)
    if mg is not None:
        step = _moe_gating(mg, view)
        if step is not None:
            return mg.covered, step
    ms = fusion.moe_sum(i)
    if ms is not None:
        step = _moe_sum(ms.mul, ms.out, view)
        if step is not None:
            return ms.covered, step
    att = fusion.attention(i)
    if att is not None:
        step = _attention(*att, view)
        if step is not None:
            return 3, step
    return 0, None


def _moe_gating(g, view: View) -> Step | None:
    """A MoE router's SOFT_MAX (its own step) then the ARGSORT, top-k GET_ROWS and optional
    SUM_ROWS and DIV of :class:`accelplane.core.fusion.MoeGating` in one C call, every node
    written; None unless F32 probabilities sorted descending."""
    from accelplane.cpu import kernels

    if g.probs.type != GGMLType.F32 or g.order.op_params[0] != SortOrder.DESC or g.probs.ne[2:] != (1, 1):
        return None
    softmax = _soft_max(g.probs, view)
    t = g.probs.ne[1]

    def flat(x: Tensor, *shape: int) -> np.ndarray:
        v = view(x)
        r = v.reshape(shape)
        return r if np.may_share_memory(r, v) else v  # a reshape that copied: refused below

    topk = kernels.prepare_moe_topk(
        flat(g.probs, t, g.probs.ne[0]), flat(g.order, t, g.order.ne[0]), flat(g.weights, t, g.k),
        None if g.total is None else flat(g.total, t), None if g.normed is None else flat(g.normed, t, g.k),
    )
    if topk is None:
        return None

    def step() -> None:
        softmax()
        topk()

    return step


def _moe_sum(mul: Tensor, out: Tensor, view: View) -> Step | None:
    """A MoE layer's weighted sum over its k experts (MUL then k - 1 ADDs of its slices) as one
    batched [1, k] x [k, d] product per token; None unless all of it is F32."""
    e, w = mul.src
    if not e.type == w.type == mul.type == out.type == GGMLType.F32:
        return None
    ev, wv, ov = view(e)[0], view(w)[0], view(out)[0, 0]  # [T, k, d], [T, k, 1], [T, d]
    wt, o3 = wv.transpose(0, 2, 1), ov[:, None, :]

    def step() -> None:
        np.matmul(wt, ev, out=o3)

    return step


def _attention(kq: Tensor, sm: Tensor, kqv: Tensor, view: View) -> Step | None:
    """KQ → SOFT_MAX → KQV as one kernel per ne3 index (kernels.prepare_attention), or None
    where the types or layouts are not its: float K and V, F32 queries, an F32 mask (or
    none), no ALiBi, the products' batches over ne2 only."""
    from accelplane.cpu import kernels

    (k, q), (v, _), mask = kq.src, kqv.src, sm.src[1]
    scale, max_bias = F32(sm.op_params[0]), sm.op_params[1]
    float_types = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
    if k.type not in float_types or v.type not in float_types or q.type != GGMLType.F32 or max_bias != 0:
        return None
    if kq.type != GGMLType.F32 or sm.type != GGMLType.F32 or (mask is not None and mask.type != GGMLType.F32):
        return None
    if k.ne[3] != v.ne[3] or k.ne[2] != v.ne[2] or q.ne[3] % k.ne[3] or q.ne[2] % k.ne[2]:
        return None
    if mask is not None and (q.ne[3] % mask.ne[3] or mask.ne[1] < q.ne[1]):
        return None
    kv_, vv, qv, ov = view(k), view(v), view(q), view(kqv)
    mv = view(mask) if mask is not None else None
    r3 = q.ne[3] // k.ne[3]
    calls = []
    for i3 in range(q.ne[3]):
        q2, o2 = _rows_2d(qv[i3 : i3 + 1]), _rows_2d(ov[i3 : i3 + 1])
        if q2 is None or o2 is None:
            return None
        m3 = mv[i3 % mask.ne[3]] if mv is not None else None
        c = kernels.prepare_attention(k.type, kv_[i3 // r3], v.type, vv[i3 // r3], q2, o2, q.ne[2],
                                      float(scale), m3)  # fmt: skip
        if c is None:
            return None
        calls.append(c)
    return calls[0] if len(calls) == 1 else lambda: [c() for c in calls] and None


def _alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    if max_bias <= 0:
        return np.ones(n_head, F32)
    n_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_log2)
    m1 = 2.0 ** (-max_bias / 2.0 / n_log2)
    h = np.arange(n_head)
    return np.where(h < n_log2, m0 ** (h + 1), m1 ** (2 * (h - n_log2) + 1)).astype(F32)


def _soft_max(t: Tensor, view: View) -> Step:
    a, mask = t.src
    scale, max_bias = F32(t.op_params[0]), t.op_params[1]
    av, dv = view(a), view(t)
    mv = None
    if mask is not None:
        m = view(mask)[:, :, : a.ne[1], :]
        # broadcast over ne2/ne3 by repetition
        r3, r2 = a.ne[3] // mask.ne[3], a.ne[2] // mask.ne[2]
        mv = np.tile(m, (r3, r2, 1, 1)) if (r3 > 1 or r2 > 1) and m.shape[:2] != (1, 1) else m
        slopes = _alibi_slopes(a.ne[2], max_bias)[None, :, None, None]
    else:
        slopes = None
    if a.type == t.type == GGMLType.F32 and max_bias == 0 and (mask is None or mask.type == GGMLType.F32):
        from accelplane.cpu import kernels

        fast = kernels.prepare_soft_max(av, dv, float(scale), view(mask) if mask is not None else None)
        if fast is not None:
            return fast

    def step() -> None:
        x = _f32(av) * scale
        if mv is not None:
            mm = _f32(mv)
            x = x + (mm * slopes if max_bias > 0 else mm)
        x = x - x.max(axis=-1, keepdims=True)
        e = np.exp(x)
        dv[...] = e / e.sum(axis=-1, keepdims=True, dtype=np.float64)

    return step


_ROPE_CACHE: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # (params, positions) → cos, sin


def _rope(t: Tensor, view: View) -> Step:
    a, pos = t.src[:2]
    ffv = view(t.src[2]) if len(t.src) > 2 else None  # freq factors: read at compute time
    (n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor,
     beta_fast, beta_slow) = rope_params(t)  # fmt: skip
    av, pv, dv = view(a), view(pos), view(t)
    half = n_dims // 2
    i = np.arange(half, dtype=np.float64)
    theta_scale = freq_base ** (-2.0 / n_dims)
    inv_freq = theta_scale**i
    corr = rope_yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
    mscale = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale) if ext_factor != 0 else 1.0)
    if ext_factor != 0:
        y = (2 * i / 2.0 - corr[0]) / max(0.001, corr[1] - corr[0])
        ramp = (1.0 - np.clip(y, 0.0, 1.0)) * ext_factor
    else:
        ramp = np.zeros(half)
    neox = mode == ROPE_TYPE_NEOX

    params = (n_dims, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow, n_ctx_orig)

    def angles() -> tuple[np.ndarray, np.ndarray]:
        """cos and sin [tokens, half], packed float32, times mscale."""
        ff = None if ffv is None else ffv.reshape(-1)[:half].astype(np.float64)
        # a step's Q and K ropes, every layer: the same angles
        key = (params, pv.tobytes(), None if ff is None else ff.tobytes())
        cs = _ROPE_CACHE.get(key)
        if cs is None:
            p = pv.reshape(-1).astype(np.float64)  # one per token (ne2)
            te = p[:, None] * (inv_freq if ff is None else inv_freq / ff)[None, :]
            ti = freq_scale * te
            th = ti * (1 - ramp) + te * ramp
            cs = ((np.cos(th) * mscale).astype(F32), (np.sin(th) * mscale).astype(F32))
            if len(_ROPE_CACHE) >= 64:
                _ROPE_CACHE.clear()
            _ROPE_CACHE[key] = cs
        return cs

    if a.type == t.type == GGMLType.F32 and a.ne[3] == 1:
        from accelplane.cpu import kernels

        fast = kernels.prepare_rope(av[0], dv[0], n_dims, neox)
        if fast is not None:
            return lambda: fast(*angles())

    def step() -> None:
        c, s = (v[None, :, None, :] for v in angles())  # [1, ne2, 1, half]
        x = _f32(av)
        if neox:
            x0, x1 = x[..., :half], x[..., half:n_dims]
        else:
            x0, x1 = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
        out = x.copy() if n_dims < a.ne[0] else np.empty_like(x)
        if neox:
            out[..., :half] = x0 * c - x1 * s
            out[..., half:n_dims] = x0 * s + x1 * c
        else:
            out[..., 0:n_dims:2] = x0 * c - x1 * s
            out[..., 1:n_dims:2] = x0 * s + x1 * c
        dv[...] = out

    return step


def _rows_2d(v: np.ndarray) -> np.ndarray | None:
    """A [ne3, ne2, ne1, ne0] view as one [ne3*ne2*ne1, ne0] view of the same memory, when its
    rows are evenly spaced (axes of one element have no stride that matters), else None."""
    outer = [(n, s) for n, s in zip(v.shape[:3], v.strides[:3], strict=True) if n > 1]
    for (_, s0), (n1, s1) in zip(outer, outer[1:], strict=False):
        if s0 != s1 * n1:
            return None
    n_rows = math.prod(n for n, _ in outer)
    row_stride = outer[-1][1] if outer else v.strides[2]
    return np.lib.stride_tricks.as_strided(v, (n_rows, v.shape[3]), (row_stride, v.strides[3]))


def _few_rows(wt: GGMLType, n: int, layout: str) -> bool:
    """Whether n activation rows against one matrix take the direct kernel (else dequantize + BLAS)."""
    from accelplane.cpu import kernels

    return not kernels.blas_wins(wt, n, layout)


def _rows_all(bv: np.ndarray, dv: np.ndarray) -> bool:
    """Whether every ne3 slice of x and of out is one run of evenly spaced rows of unit stride
    (one grouped product per slice)."""
    for i3 in range(bv.shape[0]):
        x, o = _rows_2d(bv[i3 : i3 + 1]), _rows_2d(dv[i3 : i3 + 1])
        if x is None or o is None or (x.shape[1] > 1 and x.strides[1] != 4):
            return False
    return True


def _weights(t: Tensor, view: View) -> tuple[np.ndarray, str]:
    """A product's weight operand: its stored bytes and their layout for the kernels ("x8"
    where the repack buffer keeps whole x8 matrices of it), else view(t) and ggml's layout."""
    raw = getattr(view, "raw", None)
    if raw is not None and repack.x8_rows(t):
        return raw(t), "x8"
    return view(t), "ggml"


def _mul_mat(t: Tensor, view: View) -> Step:
    a, b = t.src
    (av, layout), bv, dv = _weights(a, view), view(b), view(t)
    r2, r3 = b.ne[2] // a.ne[2], b.ne[3] // a.ne[3]
    wt = a.type
    jobs = [(av[i3 // r3, i2 // r2], bv[i3, i2], dv[i3, i2])
            for i3 in range(b.ne[3]) for i2 in range(b.ne[2])]  # fmt: skip
    if a.ne[2] == a.ne[3] == 1 and len(jobs) > 1:
        # one weight matrix for every batch: its rows against all activation rows in one product
        x2, o2 = _rows_2d(bv), _rows_2d(dv)
        if x2 is not None and o2 is not None:
            jobs = [(av[0, 0], x2, o2)]
    elif len(jobs) > 1 and wt != GGMLType.F32 and b.type == GGMLType.F32 and _few_rows(wt, b.ne[1], layout) \
            and _rows_all(bv, dv):  # fmt: skip
        # batches over ne2 (a decode's attention heads; r2 of them share a matrix under
        # grouped-query attention): one grouped product per ne3 index, group i2 the matrix
        # i2 // r2 against batch i2's rows, every group in one kernel call (one parallel region)
        from accelplane.cpu import kernels

        n1 = b.ne[1]
        groups = np.arange(b.ne[2], dtype=np.int32) // r2
        starts = np.arange(b.ne[2] + 1, dtype=np.int64) * n1
        calls = [kernels.prepare_mul_mat_id(wt, av[i3 // r3], _rows_2d(bv[i3 : i3 + 1]),
                                            _rows_2d(dv[i3 : i3 + 1]), groups, starts, layout=layout)
                 for i3 in range(b.ne[3])]  # fmt: skip
        return calls[0] if len(calls) == 1 else lambda: [c() for c in calls] and None
    elif r2 > 1:
        # broadcast over ne2 where the batches' rows are not evenly spaced: the r2 batches that
        # share a matrix as one product where their own rows are
        grouped = [(av[i3 // r3, g], _rows_2d(bv[i3 : i3 + 1, g * r2 : (g + 1) * r2]),
                    _rows_2d(dv[i3 : i3 + 1, g * r2 : (g + 1) * r2]))
                   for i3 in range(b.ne[3]) for g in range(a.ne[2])]  # fmt: skip
        if all(x is not None and o is not None for _, x, o in grouped):
            jobs = grouped
    if wt == GGMLType.F32 and b.type == GGMLType.F32:
        if len(jobs) > 1 and r2 == r3 == 1:  # same batch dims: numpy loops over them in C
            at = av.swapaxes(-1, -2)

            def batched() -> None:
                np.matmul(bv, at, out=dv)

            return batched
        return lambda: [np.matmul(x, w.T, out=o) for w, x, o in jobs] and None
    from accelplane.cpu import kernels

    calls = [kernels.prepare_mul_mat(wt, w, x, o, layout=layout) for w, x, o in jobs]
    if len(calls) == 1:
        return calls[0]
    return lambda: [c() for c in calls] and None


def _mul_mat_id(t: Tensor, view: View) -> Step:
    from accelplane.cpu import kernels

    as_, b, ids = t.src
    (av, layout), bv, iv, dv = _weights(as_, view), view(b), view(ids), view(t)
    wt = as_.type
    n_exp, n_b1, n_used = as_.ne[2], b.ne[1], ids.ne[0]
    n_rows = ids.ne[0] * ids.ne[1]
    if n_rows == 0:
        return lambda: None
    bad_id = f"MUL_MAT_ID {t.name}: expert id out of range 0..{n_exp - 1}"
    if b.type == GGMLType.F32 and not kernels.blas_wins(wt, n_rows, layout):
        # no expert can get enough rows for dequantize + BLAS (a decode): one C call that
        # groups the rows itself
        call = kernels.prepare_mul_mat_id_ids(wt, av[0], bv[0], iv[0, 0], dv[0], layout=layout)

        def grouped() -> None:
            try:
                call()
            except OutOfRangeError as e:  # the operands were validated: an id
                raise ComputeError(bad_id) from e

        return grouped

    def step() -> None:
        idx = iv[0, 0]  # [tokens, n_used]
        if idx.min(initial=0) < 0 or idx.max(initial=0) >= n_exp:
            raise ComputeError(bad_id)
        # the (token, slot) pairs grouped by expert: the rows of each expert's product. Experts
        # with enough rows that dequantize + BLAS multiplies them faster come last, each apart;
        # the others, a prefix of the rows, in one grouped call that shares the threads
        flat = idx.reshape(-1)
        per = np.bincount(flat, minlength=n_exp)
        big = np.array([c > 0 and kernels.blas_wins(wt, int(c), layout) for c in per], bool)
        key = flat + big[flat] * n_exp
        order = np.argsort(key, kind="stable")
        keys, starts = np.unique(key[order], return_index=True)
        experts, bounds = keys % n_exp, np.append(starts, len(order))
        n_small = int(np.count_nonzero(keys < n_exp))
        tok, used = np.divmod(order, n_used)
        x = np.ascontiguousarray(bv[0, tok, used % n_b1], dtype=F32)
        out = np.empty((len(order), as_.ne[1]), F32)
        if n_small:
            r = bounds[n_small]
            kernels.mul_mat_id(wt, av[0], x[:r], out[:r], experts[:n_small], bounds[: n_small + 1],
                               layout=layout)
        for g in range(n_small, len(experts)):
            e, rows = experts[g], slice(bounds[g], bounds[g + 1])
            if wt == GGMLType.F32:
                np.matmul(x[rows], av[0, e].T, out=out[rows])
            else:
                kernels.mul_mat(wt, av[0, e], x[rows], out[rows], layout=layout)
        dv[0, tok, used] = out

    return step


def _dequant_rows(ty: GGMLType, rows: np.ndarray, ne0: int) -> np.ndarray:
    from accelplane.cpu import kernels

    out = np.empty((rows.shape[0], ne0), F32)
    return kernels.dequantize(ty, rows, out)


def _get_rows(t: Tensor, view: View) -> Step:
    from accelplane.cpu import kernels

    a, idx = t.src
    av, iv, dv = view(a), view(idx), view(t)
    n_rows = a.ne[1]

    def step() -> None:
        ix = iv[0]  # [ne2(b), ne1(b), n] -> rows of a[i3=b.ne2 idx, i2=b.ne1 idx]
        if ix.size and (ix.min() < 0 or ix.max() >= n_rows):
            raise ComputeError(f"GET_ROWS {t.name}: row index out of range 0..{n_rows - 1}")
        for i3 in range(ix.shape[0]):
            for i2 in range(ix.shape[1]):
                if a.type.is_quantized:
                    kernels.dequantize(a.type, av[i3, i2], dv[i3, i2], rows=ix[i3, i2])
                else:
                    dv[i3, i2] = av[i3, i2][ix[i3, i2]]

    return step


def _store(dst_type: GGMLType, values: np.ndarray) -> np.ndarray:
    """Values (float) → what the destination stores: quantized row bytes, or cast elements."""
    if dst_type.is_quantized:
        return quantize(dst_type, _f32(values))
    return values


def _set_rows(t: Tensor, view: View) -> Step:
    dst, src, idx = t.src
    dv, sv, iv = view(dst), view(src), view(idx)
    n_rows = dst.ne[1]
    if src.ne[2:] == (1, 1) and src.type == GGMLType.F32 and dst.type in (GGMLType.F32, GGMLType.F16):
        # one slice (a decode's K row, its V column as one-element rows): in C
        from accelplane.cpu import kernels

        d2, s2, i1 = _rows_2d(dv[:1, :1]), _rows_2d(sv), iv[0, 0, 0]
        fast = kernels.prepare_set_rows(d2, s2, i1, t.name) if d2 is not None and s2 is not None else None
        if fast is not None:
            return fast
    if src.ne[1:] == (1, 1, 1) and not dst.type.is_quantized:
        # one row (a decode's KV cache write): scalar indexing, a few times cheaper than fancy
        d2, s1, i1 = dv[0, 0], sv[0, 0, 0], iv[0, 0, 0]

        def one_row() -> None:
            r = int(i1[0])
            if not 0 <= r < n_rows:
                raise ComputeError(f"SET_ROWS {t.name}: row index out of range")
            d2[r] = s1

        return one_row

    def step() -> None:
        for i3 in range(src.ne[3]):
            for i2 in range(src.ne[2]):
                rows = iv[0, i3 % idx.ne[2], i2 % idx.ne[1]]
                if rows.size and (rows.min() < 0 or rows.max() >= n_rows):
                    raise ComputeError(f"SET_ROWS {t.name}: row index out of range")
                dv[i3, i2][rows] = _store(dst.type, sv[i3, i2])

    return step


def _values(t: Tensor, v: np.ndarray) -> np.ndarray:
    """Element values of a tensor view as float32 (dequantized) or as stored."""
    if t.type.is_quantized:
        rows = np.ascontiguousarray(v).reshape(-1, t.row_bytes)
        return _dequant_rows(t.type, rows, t.ne[0]).reshape(tuple(reversed(t.ne)))
    return v


def _cpy(t: Tensor, view: View) -> Step:
    a = t.src[0]
    dst = t.src[1] if t.op is Op.CPY else t
    av, dv = view(a), view(dst)
    shape = tuple(reversed(dst.ne))
    same = a.ne == dst.ne

    def step() -> None:
        x = _values(a, av)
        if not same:
            x = x.reshape(shape) if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(shape)
        dv[...] = _store(dst.type, x)

    return step


def _concat(t: Tensor, view: View) -> Step:
    a, b = t.src
    ax = 3 - t.op_params[0]
    av, bv, dv = view(a), view(b), view(t)
    n = av.shape[ax]
    sl_a = tuple(slice(0, n) if i == ax else slice(None) for i in range(4))
    sl_b = tuple(slice(n, None) if i == ax else slice(None) for i in range(4))

    def step() -> None:
        dv[sl_a] = av
        dv[sl_b] = bv

    return step


def _reduce(t: Tensor, view: View) -> Step:
    (a,) = t.src
    av, dv = view(a), view(t)
    op = t.op
    if op is Op.SUM:
        return lambda: dv.reshape(-1).__setitem__(0, av.sum(dtype=np.float64))
    if op is Op.SUM_ROWS:
        return lambda: dv.__setitem__(Ellipsis, av.sum(axis=-1, keepdims=True, dtype=np.float64))
    if op is Op.MEAN:
        return lambda: dv.__setitem__(Ellipsis, av.mean(axis=-1, keepdims=True, dtype=np.float64))
    if op is Op.ARGMAX:
        return lambda: dv.reshape(-1).__setitem__(Ellipsis, av[0, 0].argmax(axis=-1))
    desc = t.op_params[0] == SortOrder.DESC

    def argsort() -> None:
        x = _f32(av)
        dv[...] = np.argsort(-x if desc else x, axis=-1, kind="stable")

    return argsort


def _im2col(t: Tensor, view: View) -> Step:
    k, x = t.src
    s0, s1, p0, p1, d0, d1, is_2d, _ = t.op_params
    xv, dv = view(x), view(t)
    if is_2d:
        kh, kw, ic = k.ne[1], k.ne[0], k.ne[2]
        oh, ow = t.ne[2], t.ne[1]
        h, w = x.ne[1], x.ne[0]
    else:
        kh, kw, ic = 1, k.ne[0], k.ne[1]
        oh, ow = 1, t.ne[1]
        h, w = 1, x.ne[0]
        p1, s1, d1 = 0, 1, 1

    def step() -> None:
        xx = _f32(xv)
        # ggml order: x [N, IC, H, W] (2-D) or [1, N, IC, W] (1-D)
        src = xx if is_2d else xx[0][:, :, None, :]
        n = src.shape[0]
        pad = np.zeros((n, ic, h + 2 * p1, w + 2 * p0), F32)
        pad[:, :, p1 : p1 + h, p0 : p0 + w] = src
        cols = np.empty((n, oh, ow, ic, kh, kw), F32)
        for ikh in range(kh):
            for ikw in range(kw):
                ys, xs = ikh * d1, ikw * d0
                patch = pad[:, :, ys : ys + s1 * (oh - 1) + 1 : s1, xs : xs + s0 * (ow - 1) + 1 : s0]
                cols[:, :, :, :, ikh, ikw] = patch.transpose(0, 2, 3, 1)
        res = cols.reshape(n, oh, ow, ic * kh * kw)
        dv[...] = res if is_2d else res.reshape(1, n, ow, ic * kw)

    return step


def _col2im_1d(t: Tensor, view: View) -> Step:
    (a,) = t.src
    s0, oc, p0 = t.op_params
    av, dv = view(a), view(t)
    k = a.ne[0] // oc
    t_in, t_out = a.ne[1], t.ne[0]

    def step() -> None:
        x = _f32(av)[0]  # [B, T_in, OC*K]
        b = x.shape[0]
        full = np.zeros((b, oc, (t_in - 1) * s0 + k), F32)
        cols = x.reshape(b, t_in, oc, k)
        for kk in range(k):
            full[:, :, kk : kk + s0 * (t_in - 1) + 1 : s0] += cols[:, :, :, kk].transpose(0, 2, 1)
        dv[0] = full[:, :, p0 : p0 + t_out]

    return step


BUILDERS: dict[Op, Callable[[Tensor, View], Step]] = {
    Op.ADD: _binary, Op.SUB: _binary, Op.MUL: _binary, Op.DIV: _binary,
    Op.SCALE: _unary, Op.SQR: _unary, Op.SQRT: _unary, Op.LOG: _unary, Op.SIN: _unary,
    Op.COS: _unary, Op.CLAMP: _unary, Op.LEAKY_RELU: _unary, Op.UNARY: _unary,
    Op.GLU: _glu, Op.NORM: _norm, Op.RMS_NORM: _norm, Op.L2_NORM: _norm,
    Op.SOFT_MAX: _soft_max, Op.ROPE: _rope, Op.MUL_MAT: _mul_mat, Op.MUL_MAT_ID: _mul_mat_id,
    Op.GET_ROWS: _get_rows, Op.SET_ROWS: _set_rows, Op.CPY: _cpy, Op.CONT: _cpy,
    Op.DUP: _cpy, Op.CONCAT: _concat, Op.SUM: _reduce, Op.SUM_ROWS: _reduce, Op.MEAN: _reduce,
    Op.ARGMAX: _reduce, Op.ARGSORT: _reduce, Op.IM2COL: _im2col, Op.COL2IM_1D: _col2im_1d,
}  # fmt: skip


class _Views:
    """The plan's View: numpy views of tensors' memory. A tensor the repack buffer keeps in the
    x8 layout reads, through a view, a copy in ggml's layout that every run refreshes first
    (``unpack``); ``raw`` gives its stored bytes to the builders that take x8 (_weights)."""

    def __init__(self, memory: Callable[[object], np.ndarray] | None) -> None:
        self.memory = memory
        self.plain: dict[int, np.ndarray] = {}  # x8 owner uid -> its bytes in ggml's layout
        self.unpack: list[Step] = []

    def raw(self, t: Tensor) -> np.ndarray:
        return host_view(t, self.memory)

    def __call__(self, t: Tensor) -> np.ndarray:
        o = repack.x8_owner(t)
        if o is None:
            return host_view(t, self.memory)
        plain = self.plain.get(o.uid)
        if plain is None:
            plain = self.plain[o.uid] = np.empty(o.nbytes, np.uint8)
            mem = o.buffer.ctx
            self.unpack.append(lambda: repack.unpacked(o, mem, plain))
        return strided_view(t, plain[t.offs - o.offs : t.offs - o.offs + t.nbytes])


class Plan:
    """A graph bound to memory: ``steps`` replay it. Valid while the graph's layout version
    is unchanged (accelplane.runtime.plancache.PlanCache rebuilds it otherwise)."""

    __slots__ = ("steps", "buffers", "nodes", "fused", "unpack")

    def __init__(self, graph, memory: Callable[[object], np.ndarray] | None = None) -> None:
        """``memory(buffer)``: the uint8 array of a buffer's bytes (default: host_array)."""
        view = _Views(memory)
        self.unpack = view.unpack  # runs first, every run
        self.steps: list[Step] = []
        self.nodes: list[Tensor] = []  # the last node each step computes
        self.fused: list[tuple[str, ...]] = []  # the ops of each fused step (tests, debugging)
        fusion = Fusion(graph)

        def build(i: int) -> int:  # (the SDK checked that every tensor is allocated)
            n = graph.nodes[i]
            if repack.x8_owner(n) is not None:
                raise ComputeError(
                    f"{n.op.name} {n.name!r} writes into {repack.NAME} memory: that buffer holds weights"
                )
            k, step = fused_step(graph.nodes, i, fusion, view)
            if step is not None:
                self.steps.append(step)
                self.nodes.append(graph.nodes[i + k - 1])
                self.fused.append(tuple(x.op.name for x in graph.nodes[i : i + k]))
                return k
            self.steps.append(BUILDERS[n.op](n, view))
            self.nodes.append(n)
            return 1

        fusion.walk(build)

    def run(self, callback=None) -> None:
        for u in self.unpack:
            u()
        if callback is None:
            for s in self.steps:
                s()
        else:
            for s, n in zip(self.steps, self.nodes, strict=True):
                s()
                if callback(n) is False:
                    break
