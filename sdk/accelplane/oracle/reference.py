"""A float64 numpy oracle for every op of :data:`accelplane.core.ops.RULES`, independent of backends.

:func:`evaluate` computes a whole graph; :func:`compute_node` one node from given source values.
Values are numpy arrays of shape ``tuple(reversed(t.ne))`` (always 4-D): float64, or int64 for
I32 tensors. Each result is computed in float64 and then rounded to its storage type (F32 via
float32, F16 via float16, BF16 via ml_dtypes.bfloat16); quantized results (a CPY or SET_ROWS
into a quantized tensor, CONT of a quantized tensor) keep their exact float64 values: the
caller compares those with a quantization-step tolerance.

Memory is modelled like ggml's: every tensor's data lives in its memory owner (``t.view_src``,
or ``t`` itself), kept here as a flat array with one slot per element of the owner's byte span
(block types: one slot per element of each block). A tensor reads the slots at byte
``view_offs + sum(i_k * nb_k)``; view ops (VIEW, RESHAPE, PERMUTE, TRANSPOSE) compute nothing
and read their owner's memory when their turn comes; CPY (into ``src[1]``) and SET_ROWS (into
``src[0]``) write into the owner's memory, so any later reader of the destination, or of any
view of it, sees the write.

Semantics follow ggml's CPU backend (ggml-cpu/ops.cpp), computed exactly rather than in float32:
ROPE's YaRN correction with ``theta = pos * freq_base**(-2i/n_dims) / freq_factors[i]``, the tanh GELU (the
exact erf GELU is its own op), SOFTPLUS's threshold (x itself above 20), ROUND's halves away
from zero, SOFT_MAX's ALiBi slopes, IM2COL's ``[N, OH, OW, IC*KH*KW]`` layout. Where ggml is
unspecified (ARGSORT ties: std::sort is not stable; NaN breaks its ordering) the oracle sorts
stably, ties in index order for both ASC and DESC, NaN last in both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from accelplane.core.graph import Graph
from accelplane.core.ops import (
    ROPE_TYPE_NEOX,
    VIEW_OPS,
    GluOp,
    Op,
    SortOrder,
    UnaryOp,
    rope_params,
    rope_yarn_corr_dims,
)
from accelplane.core.tensor import Tensor
from accelplane.core.types import TRAITS, GGMLType, dequantize
from accelplane.errors import DeviceError, OutOfRangeError, ShapeError, UnsupportedOpError

__all__ = [
    "Evaluator",
    "alibi_slopes",
    "compute_node",
    "evaluate",
    "rope_cos_sin",
    "round_to_type",
]

T = GGMLType
_GELU_COEF_A = 0.044715
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_QUICK_COEF = 1.702
_SOFTPLUS_LINEAR = 20.0  # ggml's softplus is x itself above this


def _name(t: Tensor) -> str:
    return t.name or f"#{t.uid}"


def _shape4(t: Tensor) -> tuple[int, int, int, int]:
    return tuple(reversed(t.ne))  # type: ignore[return-value]


def _owner(t: Tensor) -> Tensor:
    return t.view_src if t.view_src is not None else t


# --- storage types --------------------------------------------------------------------------
def round_to_type(type_: GGMLType, x: np.ndarray) -> np.ndarray:
    """``x`` rounded to what a tensor of ``type_`` stores, as float64 (int64 for I32).

    Block-quantized types keep the exact float64 values."""
    x = np.asarray(x)
    if type_ == T.I32:
        if x.dtype.kind in "iub":
            return x.astype(np.int64)
        with np.errstate(invalid="ignore"):
            return np.rint(x).astype(np.int64)
    with np.errstate(over="ignore", invalid="ignore"):
        if type_ == T.F32:
            return x.astype(np.float32).astype(np.float64)
        if type_ == T.F16:
            return x.astype(np.float16).astype(np.float64)
        if type_ == T.BF16:
            return x.astype(TRAITS[T.BF16].np_dtype).astype(np.float64)
    return x.astype(np.float64)


def _as_value(t: Tensor, v) -> np.ndarray:
    """A host value for tensor ``t`` as a 4-D float64/int64 array of ``reversed(t.ne)``.

    Accepts ``t.shape``, ``reversed(t.ne)`` or a flat array of all elements. For block-quantized
    tensors a uint8 array is taken as raw row bytes and decoded with types.dequantize; any
    other array is taken as the tensor's (already dequantized) values.
    """
    shape = _shape4(t)
    arr = np.asarray(v)
    if t.type.is_quantized and arr.dtype == np.uint8:
        rb = t.row_bytes
        if arr.size != t.nrows * rb:
            raise ShapeError(
                f"reference: {_name(t)} ({t.type.name}, ne={list(t.ne)}) needs "
                f"{t.nrows * rb} bytes of rows, got a uint8 array of shape {arr.shape}"
            )
        arr = dequantize(t.type, arr.reshape(t.nrows, rb), t.ne[0])
    if arr.shape != shape:
        if arr.shape == t.shape or (arr.ndim <= 1 and arr.size == t.nelements):
            arr = arr.reshape(shape)
        else:
            raise ShapeError(
                f"reference: value of shape {arr.shape} does not fit {_name(t)} of shape "
                f"{t.shape} (ne={list(t.ne)})"
            )
    return round_to_type(t.type, arr)


def _leaf_value(t: Tensor) -> np.ndarray:
    try:
        return _as_value(t, t.get())
    except DeviceError as e:
        raise DeviceError(
            f"reference: no value for leaf {_name(t)}: pass it in leaf_values ({e})"
        ) from e


# --- memory ---------------------------------------------------------------------------------
def _span_slots(t: Tensor) -> int:
    tr = TRAITS[t.type]
    return -(-t.nbytes // tr.type_size) * tr.blck_size


def _slots(t: Tensor) -> np.ndarray:
    """Owner-memory slot of every element of ``t``: int64 array of ``reversed(t.ne)``."""
    tr = TRAITS[t.type]
    bs, ts = tr.blck_size, tr.type_size
    ne, nb = t.ne, t.nb
    i0 = np.arange(ne[0], dtype=np.int64)
    byte = (t.view_offs if t.view_src is not None else 0) + (i0 // bs) * nb[0]
    byte = (
        byte[None, None, None, :]
        + (np.arange(ne[1], dtype=np.int64) * nb[1])[None, None, :, None]
        + (np.arange(ne[2], dtype=np.int64) * nb[2])[None, :, None, None]
        + (np.arange(ne[3], dtype=np.int64) * nb[3])[:, None, None, None]
    )
    if byte.size and np.any(byte % ts):
        raise ShapeError(
            f"reference: {_name(t)} addresses bytes that are not on {t.type.name} boundaries "
            f"(view_offs={t.view_offs}, nb={list(t.nb)})"
        )
    return (byte // ts) * bs + (i0 % bs)[None, None, None, :]


class Evaluator:
    """Memory model + op dispatch: one flat value array per memory owner.

    ``seed(t, value)`` stores a value (leaf input, or a given source for :func:`compute_node`),
    ``run(node)`` computes a node (writing its owner's memory) and returns its value,
    ``read(t)`` reads any tensor's current value from its owner's memory.
    """

    def __init__(self) -> None:
        self.memory: dict[Tensor, np.ndarray] = {}
        self._slot_cache: dict[Tensor, np.ndarray] = {}

    def slots(self, t: Tensor) -> np.ndarray:
        s = self._slot_cache.get(t)
        if s is None:
            s = self._slot_cache[t] = _slots(t)
            n = self._owner_memory(t).size
            if s.size and (s.min() < 0 or s.max() >= n):
                raise OutOfRangeError(
                    f"reference: {_name(t)} reaches outside the {n} elements of its memory "
                    f"owner {_name(_owner(t))}"
                )
        return s

    def _owner_memory(self, t: Tensor) -> np.ndarray:
        o = _owner(t)
        mem = self.memory.get(o)
        if mem is None:
            n = _span_slots(o)
            if o.type == T.I32:
                mem = np.zeros(n, np.int64)
            else:
                mem = np.full(n, np.nan)
            self.memory[o] = mem
        return mem

    def seed(self, t: Tensor, value) -> None:
        """Store ``value`` (any form :func:`evaluate` accepts) as ``t``'s current value."""
        self.write(t, _as_value(t, value))

    def write(self, t: Tensor, value: np.ndarray) -> None:
        """Write a 4-D value of ``t`` into its owner's memory (value already rounded)."""
        mem = self._owner_memory(t)
        mem[self.slots(t)] = value

    def read(self, t: Tensor) -> np.ndarray:
        o = _owner(t)
        if o not in self.memory:
            raise KeyError(
                f"reference: no value for {_name(t)}"
                + (f" (memory owner {_name(o)})" if o is not t else "")
            )
        return self.memory[o][self.slots(t)]

    def run(self, node: Tensor) -> np.ndarray:
        """Compute ``node`` from its sources' current values; returns its value."""
        op = node.op
        if op is None:
            return self.read(node)
        if op in VIEW_OPS:
            if node.view_src is None:  # an op-less alias (Op.NONE without a view): a copy
                value = self.read(node.src[0]).reshape(_shape4(node))
                self.memory[node] = np.empty(_span_slots(node), value.dtype)
                self.write(node, value)
            return self.read(node)
        srcs = [None if s is None else self.read(s) for s in node.src]
        value = round_to_type(node.type, _compute(node, srcs))
        if node.view_src is None:
            self.memory.pop(node, None)
        self.write(node, value)
        return self.read(node)


def evaluate(
    graph: Graph, leaf_values: Mapping[Tensor, np.ndarray] | None = None
) -> dict[Tensor, np.ndarray]:
    """Every leaf's and node's value (4-D, ``reversed(ne)``; float64, int64 for I32).

    Leaf values come from ``leaf_values`` (arrays of ``t.shape``, ``reversed(t.ne)`` or flat;
    raw uint8 row bytes for quantized leaves) or else from ``t.get()``; they are rounded to the
    leaf's type. Tensors in ``leaf_values`` that are not nodes of the graph are inputs too (and
    are reported), so a graph built with ``Graph.from_nodes`` can take its split inputs there.
    Nodes run in ``graph.nodes`` order; a node's value is the tensor's content right after it
    ran (for view nodes: when their turn came). Leaves report their input values.
    """
    leaf_values = leaf_values or {}
    ev = Evaluator()
    nodes = set(graph.nodes)
    # inputs: the graph's leaves, plus any other non-node tensor given a value (the inputs of a
    # graph made with Graph.from_nodes, e.g. a scheduler split); memory owners first
    inputs = list(graph.leafs) + [t for t in leaf_values if t not in nodes]
    inputs = list(dict.fromkeys(inputs))
    for t in sorted(inputs, key=lambda t: t.view_src is not None):
        if t in leaf_values:
            ev.seed(t, leaf_values[t])
        elif t.view_src is None or t.view_src not in ev.memory:
            ev.write(t, _leaf_value(t))
    out: dict[Tensor, np.ndarray] = {t: ev.read(t) for t in inputs}
    for node in graph.nodes:
        out[node] = ev.run(node)
    return out


def compute_node(node: Tensor, values: Mapping[Tensor, np.ndarray]) -> np.ndarray:
    """The value of one node given ``values`` of its sources (same forms as leaf values).

    For a view node or a CPY/SET_ROWS (whose result is a view) the memory owner's value is
    used when ``values`` holds it, then the sources' values are laid over it.
    """
    ev = Evaluator()
    if node.op in VIEW_OPS or node.view_src is not None:
        seeds = [node.view_src, *node.src]
        seeds.sort(key=lambda t: t is not None and t.view_src is not None)
        for t in seeds:
            if t is not None and t in values:
                ev.seed(t, values[t])
        return ev.run(node)
    srcs = []
    for s in node.src:
        if s is None:
            srcs.append(None)
        elif s in values:
            srcs.append(_as_value(s, values[s]))
        else:
            raise KeyError(f"reference: no value for source {_name(s)} of {_name(node)}")
    return round_to_type(node.type, _compute(node, srcs))


# --- ops ------------------------------------------------------------------------------------
def _tile(b: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    # an empty axis stays empty (the op rules let it broadcast only onto an empty one)
    reps = tuple(n // m if m else 1 for n, m in zip(shape, b.shape, strict=True))
    return np.tile(b, reps)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * x * (1.0 + _GELU_COEF_A * x * x)))


_erfc = np.vectorize(math.erfc, otypes=[np.float64])


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    # 1 + erf(z) as erfc(-z): no cancellation for negative x
    return 0.5 * x * _erfc(-x / math.sqrt(2.0))


def _hardsigmoid(x: np.ndarray) -> np.ndarray:
    # fmin/fmax as ggml's fminf/fmaxf: a NaN argument gives the other one
    return np.fmin(1.0, np.fmax(0.0, (x + 3.0) / 6.0))


_UNARY: dict[UnaryOp, Callable[[np.ndarray], np.ndarray]] = {
    UnaryOp.ABS: np.abs,
    UnaryOp.NEG: np.negative,
    UnaryOp.STEP: lambda x: np.where(x > 0, 1.0, 0.0),
    UnaryOp.TANH: np.tanh,
    UnaryOp.ELU: lambda x: np.where(x > 0, x, np.expm1(x)),
    UnaryOp.RELU: lambda x: np.where(x > 0, x, 0.0),
    UnaryOp.SIGMOID: _sigmoid,
    UnaryOp.GELU: _gelu,
    UnaryOp.GELU_QUICK: lambda x: x * _sigmoid(_GELU_QUICK_COEF * x),
    UnaryOp.SILU: lambda x: x * _sigmoid(x),
    UnaryOp.HARDSWISH: lambda x: x * _hardsigmoid(x),
    UnaryOp.HARDSIGMOID: _hardsigmoid,
    UnaryOp.EXP: np.exp,
    UnaryOp.EXPM1: np.expm1,
    UnaryOp.SOFTPLUS: lambda x: np.where(x > _SOFTPLUS_LINEAR, x, np.log1p(np.exp(x))),
    UnaryOp.GELU_ERF: _gelu_erf,
    UnaryOp.FLOOR: np.floor,
    UnaryOp.CEIL: np.ceil,
    # C's roundf (halves away from zero); exact in float64 for every float32 input
    UnaryOp.ROUND: lambda x: np.copysign(np.floor(np.abs(x) + 0.5), x),
    UnaryOp.TRUNC: np.trunc,
}

_GLU_ACT = {GluOp.SWIGLU: _UNARY[UnaryOp.SILU], GluOp.GEGLU: _gelu}


def _binary(fn):
    def run(node, s):
        a, b = s
        return fn(a, _tile(b, a.shape))

    return run


def _glu(node, s):
    a, b = s
    op, swapped = GluOp(node.op_params[0]), bool(node.op_params[1])
    if b is None:
        nc = a.shape[-1] // 2
        x, g = a[..., :nc], a[..., nc:]
        if swapped:
            x, g = g, x
    else:  # ggml ignores `swapped` when the gate comes as its own tensor
        x, g = a, b
    return _GLU_ACT[op](x) * g


def _norm(node, s):
    (x,) = s
    eps = node.op_params[0]
    mean = x.mean(axis=-1, keepdims=True)
    d = x - mean
    var = (d * d).mean(axis=-1, keepdims=True)
    return d / np.sqrt(var + eps)


def _rms_norm(node, s):
    (x,) = s
    eps = node.op_params[0]
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


def _l2_norm(node, s):
    (x,) = s
    eps = node.op_params[0]
    return x / np.maximum(np.sqrt((x * x).sum(axis=-1, keepdims=True)), eps)


def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """ggml's per-head ALiBi slopes (1.0 for every head when max_bias <= 0)."""
    if max_bias <= 0:
        return np.ones(n_head)
    n_head_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_head_log2)
    m1 = 2.0 ** (-(max_bias / 2.0) / n_head_log2)
    h = np.arange(n_head)
    return np.where(h < n_head_log2, m0 ** (h + 1), m1 ** (2 * (h - n_head_log2) + 1))


def _soft_max(node, s):
    a, mask = s
    scale, max_bias = node.op_params[0], node.op_params[1]
    x = a * scale
    if mask is not None:
        m = mask[:, :, : a.shape[2], :]
        m = _tile(m, (a.shape[0], a.shape[1], *m.shape[2:]))  # modulo broadcast over ne2/ne3
        slope = alibi_slopes(a.shape[1], max_bias)[None, :, None, None]
        x = x + slope * m
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


def _yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow):
    if n_ctx_orig <= 0:  # log(0): ggml gets start = max(0, -inf), end = min(n_dims-1, -inf)
        return 0.0, -math.inf
    return rope_yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)


def rope_cos_sin(
    pos: np.ndarray, n_dims: int, n_ctx_orig: int, freq_base: float, freq_scale: float,
    ext_factor: float, attn_factor: float, beta_fast: float, beta_slow: float,
    freq_factors: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """cos/sin (times YaRN's mscale) per position and rotated pair: arrays [len(pos), n_dims/2].
    ``freq_factors`` (ggml's ``c``): each pair's frequency is divided by its factor."""
    i = np.arange(n_dims // 2, dtype=np.float64)
    theta_extrap = np.asarray(pos, np.float64)[:, None] * freq_base ** (-2.0 * i / n_dims)
    if freq_factors is not None:
        theta_extrap = theta_extrap / np.asarray(freq_factors, np.float64).reshape(-1)[: n_dims // 2]
    theta = freq_scale * theta_extrap
    mscale = attn_factor
    if ext_factor != 0.0:
        low, high = _yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
        y = (i - low) / max(0.001, high - low)
        ramp_mix = (1.0 - np.clip(y, 0.0, 1.0)) * ext_factor
        theta = theta * (1.0 - ramp_mix) + theta_extrap * ramp_mix
        mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
    return np.cos(theta) * mscale, np.sin(theta) * mscale


def _rope(node, s):
    a, pos = s[:2]
    ff = s[2] if len(s) > 2 else None
    n_dims, mode, n_ctx_orig, base, fscale, ext, attn, bfast, bslow = rope_params(node)
    p = pos.reshape(-1)[: a.shape[1]]
    cos, sin = rope_cos_sin(p, n_dims, n_ctx_orig, base, fscale, ext, attn, bfast, bslow, ff)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # positions run along ne2
    out = a.copy()
    if mode == ROPE_TYPE_NEOX:
        i0, i1 = slice(0, n_dims // 2), slice(n_dims // 2, n_dims)
    else:
        i0, i1 = slice(0, n_dims, 2), slice(1, n_dims, 2)
    x0, x1 = a[..., i0], a[..., i1]
    out[..., i0] = x0 * cos - x1 * sin
    out[..., i1] = x0 * sin + x1 * cos
    return out


def _mul_mat(node, s):
    a, b = s  # a [a3, a2, M, K], b [b3, b2, N, K]
    a = np.repeat(a, b.shape[0] // a.shape[0], axis=0)
    a = np.repeat(a, b.shape[1] // a.shape[1], axis=1)
    return np.matmul(b, a.swapaxes(-1, -2))


def _check_index(idx: np.ndarray, n: int, what: str, node: Tensor) -> None:
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise OutOfRangeError(
            f"reference: {node.op.name} {_name(node)}: {what} index out of range "
            f"[0, {n}): min {idx.min()}, max {idx.max()}"
        )


def _mul_mat_id(node, s):
    w, b, ids = s  # w [1, E, M, K], b [1, T, B, K], ids [1, 1, T, U]
    e = ids[0, 0]
    n_tok, n_used = e.shape
    _check_index(e, w.shape[1], "expert", node)
    out = np.zeros((1, n_tok, n_used, w.shape[2]))
    for x in np.unique(e):
        t, u = np.nonzero(e == x)
        out[0, t, u] = b[0, t, u % b.shape[2]] @ w[0, x].T
    return out


def _get_rows(node, s):
    a, rows = s  # a [a3, a2, R, K], rows [1, a3, a2, n]
    r = rows[0]
    _check_index(r, a.shape[2], "row", node)
    i3 = np.arange(a.shape[0])[:, None, None]
    i2 = np.arange(a.shape[1])[None, :, None]
    return a[i3, i2, r]


def _set_rows(node, s):
    dst, src, rows = s  # dst [d3, d2, R, K], src [d3, d2, n, K], rows [1, c2, c1, n]
    _check_index(rows, dst.shape[2], "row", node)
    out = dst.copy()
    n = src.shape[2]
    for i3 in range(src.shape[0]):
        for i2 in range(src.shape[1]):
            r = rows[0, i3 % rows.shape[1], i2 % rows.shape[2]]
            # rows are written in order: for a repeated row the last write wins
            _, first_rev = np.unique(r[::-1], return_index=True)
            keep = n - 1 - first_rev
            out[i3, i2, r[keep]] = src[i3, i2, keep]
    return out


def _cpy(node, s):
    a, _ = s
    return a.reshape(_shape4(node))


def _concat(node, s):
    a, b = s
    return np.concatenate([a, b], axis=3 - node.op_params[0])


def _argmax(node, s):
    (a,) = s
    x = np.where(np.isnan(a[0, 0]), -np.inf, a[0, 0])  # ggml skips NaN (x > max is false)
    return np.argmax(x, axis=-1).reshape(1, 1, 1, -1)


def _argsort(node, s):
    (a,) = s
    key = -a if SortOrder(node.op_params[0]) == SortOrder.DESC else a
    return np.argsort(key, axis=-1, kind="stable")


def _im2col(node, s):
    k, x = s
    s0, s1, p0, p1, d0, d1, is_2d, _ = node.op_params
    if is_2d:  # x [N, IC, IH, IW], kernel ne [KW, KH, IC, OC]
        kh, kw = k.shape[2], k.shape[3]
    else:  # x ne [IW, IC, N]: as [N, IC, 1, IW]; one row, the height terms still apply
        x = x[0][:, :, None, :]
        kh, kw = 1, k.shape[3]
    n, ic, ih, iw = x.shape
    oh = node.ne[2] if is_2d else 1
    ow = node.ne[1]
    # input coordinate of every (output position, kernel tap); outside [0, I) reads zero
    yy = np.arange(oh)[:, None] * s1 + np.arange(kh)[None, :] * d1 - p1  # [OH, KH]
    xx = np.arange(ow)[:, None] * s0 + np.arange(kw)[None, :] * d0 - p0  # [OW, KW]
    ok = ((yy >= 0) & (yy < ih))[:, None, :, None] & ((xx >= 0) & (xx < iw))[None, :, None, :]
    g = x[:, :, np.clip(yy, 0, ih - 1)[:, None, :, None], np.clip(xx, 0, iw - 1)[None, :, None, :]]
    g = np.where(ok, g, 0.0)  # [N, IC, OH, OW, KH, KW]
    g = g.transpose(0, 2, 3, 1, 4, 5).reshape(n, oh, ow, ic * kh * kw)
    return g if is_2d else g.reshape(1, n, ow, ic * kw)


def _col2im_1d(node, s):
    (a,) = s  # [1, B, T_in, OC*K]
    s0, oc, p0 = node.op_params
    _, nb_, t_in, ck = a.shape
    k = ck // oc
    t_out = node.ne[0]
    a4 = a[0].reshape(nb_, t_in, oc, k)
    out = np.zeros((nb_, oc, t_out))
    ti = np.arange(t_in)
    for j in range(k):
        t = ti * s0 + j - p0
        ok = (t >= 0) & (t < t_out)
        out[:, :, t[ok]] += a4[..., j][:, ok, :].transpose(0, 2, 1)  # [B, OC, n]
    return out[None]


def _unary(node, s):
    return _UNARY[UnaryOp(node.op_params[0])](s[0])


_OPS: dict[Op, Callable] = {
    Op.ADD: _binary(np.add),
    Op.SUB: _binary(np.subtract),
    Op.MUL: _binary(np.multiply),
    Op.DIV: _binary(np.divide),
    Op.SCALE: lambda n, s: s[0] * n.op_params[0] + n.op_params[1],
    Op.SQR: lambda n, s: s[0] * s[0],
    Op.SQRT: lambda n, s: np.sqrt(s[0]),
    Op.LOG: lambda n, s: np.log(s[0]),
    Op.SIN: lambda n, s: np.sin(s[0]),
    Op.COS: lambda n, s: np.cos(s[0]),
    # ggml: MAX(MIN(x, max), min)
    Op.CLAMP: lambda n, s: np.maximum(np.minimum(s[0], n.op_params[1]), n.op_params[0]),
    # ggml: (x > 0 ? x : 0) + slope * (x < 0 ? x : 0), the slope an F32 op parameter (a
    # negative x times a zero slope adds -0 to +0: +0, as ggml gives)
    Op.LEAKY_RELU: lambda n, s: (
        np.where(s[0] > 0, s[0], 0.0) + float(np.float32(n.op_params[0])) * np.where(s[0] < 0, s[0], 0.0)
    ),
    Op.UNARY: _unary,
    Op.GLU: _glu,
    Op.NORM: _norm,
    Op.RMS_NORM: _rms_norm,
    Op.L2_NORM: _l2_norm,
    Op.SOFT_MAX: _soft_max,
    Op.ROPE: _rope,
    Op.MUL_MAT: _mul_mat,
    Op.MUL_MAT_ID: _mul_mat_id,
    Op.GET_ROWS: _get_rows,
    Op.SET_ROWS: _set_rows,
    Op.CPY: _cpy,
    Op.CONT: lambda n, s: s[0].copy(),
    Op.DUP: lambda n, s: s[0].copy(),
    Op.CONCAT: _concat,
    Op.SUM: lambda n, s: s[0].sum().reshape(1, 1, 1, 1),
    Op.SUM_ROWS: lambda n, s: s[0].sum(axis=-1, keepdims=True),
    Op.MEAN: lambda n, s: s[0].mean(axis=-1, keepdims=True),
    Op.ARGMAX: _argmax,
    Op.ARGSORT: _argsort,
    Op.IM2COL: _im2col,
    Op.COL2IM_1D: _col2im_1d,
}


def _compute(node: Tensor, srcs: list) -> np.ndarray:
    fn = _OPS.get(node.op)
    if fn is None:
        raise UnsupportedOpError(f"reference: no oracle for op {node.op}")
    shape = _shape4(node)
    if node.nelements == 0:  # an empty result: nothing to compute (its sources may be empty too)
        return np.zeros(shape, np.int64 if node.type == T.I32 else np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        out = np.asarray(fn(node, srcs))
    if out.shape != shape:  # a bug here, not in the caller's graph
        raise AssertionError(
            f"reference: {node.op.name} {_name(node)} computed shape {out.shape}, ne says {shape}"
        )
    return out
