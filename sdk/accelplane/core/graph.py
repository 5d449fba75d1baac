"""Context (graph builder: one method per op) and Graph (nodes in topological order).

Each builder method's docstring gives the numpy expression it equals, in host (numpy) axis
order; ``reference.py`` computes exactly that in float64. Shapes and types are checked when
the node is built (:mod:`accelplane.core.ops`), so a bad graph fails before any backend sees it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence

from accelplane.core.ops import (
    ROPE_TYPE_NEOX,
    ROPE_TYPE_NORMAL,
    RULES,
    GluOp,
    Op,
    SortOrder,
    UnaryOp,
)
from accelplane.core.tensor import Tensor, contiguous_strides, owners_to_keep
from accelplane.core.types import GGMLType, parse_type
from accelplane.errors import AccelplaneError, ShapeError

_graph_ids = itertools.count(1)


def _tensor(op: Op, t, optional: bool = False) -> None:
    """ShapeError unless ``t`` is a Tensor (or None where the source is optional)."""
    if not isinstance(t, Tensor) and not (optional and t is None):
        raise ShapeError(f"{op.name}: source {t!r} is not a Tensor")


def _enum(op: Op, cls, value):
    """``cls(value)``, with a bad value reported as a typed error naming the op."""
    try:
        return cls(value)
    except ValueError:
        known = ", ".join(f"{m.name}={m.value}" for m in cls)
        raise ShapeError(f"{op.name}: {value!r} is not a {cls.__name__} ({known})") from None


class Context:
    """Builds tensors and op nodes. Leaf tensors created here are listed in ``tensors``
    (allocate them with ``Buffer``/``alloc.alloc_ctx_tensors``)."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.tensors: list[Tensor] = []
        self.views: list[Tensor] = []  # view nodes, bound by alloc_ctx_tensors like ggml
    # --- leaves -----------------------------------------------------------------------------
    def new_tensor(
        self, type_: GGMLType | str | int, shape: Sequence[int], name: str = ""
    ) -> Tensor:
        """A new leaf tensor of numpy-ordered ``shape`` (outermost first, at most 4 axes)."""
        shape = tuple(int(x) for x in shape)
        if len(shape) > 4:
            raise ShapeError(f"tensor {name!r}: at most 4 axes, got shape {shape}")
        t = Tensor(type_, tuple(reversed(shape)) or (1,), name=name, ndim=len(shape))
        self.tensors.append(t)
        return t

    def new_tensor_ne(self, type_: GGMLType | str | int, *ne: int, name: str = "") -> Tensor:
        """A new leaf tensor in ggml order (``ne[0]`` innermost), like ggml_new_tensor_Nd."""
        t = Tensor(type_, tuple(ne), name=name)
        self.tensors.append(t)
        return t

    # --- node construction (one place) ----------------------------------------------------
    def _op(self, op: Op, src: tuple, params: tuple = (), name: str = "") -> Tensor:
        for s in src:
            _tensor(op, s, optional=True)
        r = RULES[op](op, src, params)
        ndim = r.ndim or max((s.ndim for s in src if s is not None), default=1)
        # at least as many host axes as the result has non-trivial dimensions (CONCAT along
        # a new axis, a broadcasting product)
        ndim = max(ndim, max((i + 1 for i in range(4) if r.ne[i] != 1), default=1))
        t = Tensor(
            r.type, r.ne, r.nb, op=op, op_params=params, src=src,
            view_src=r.view_of, view_offs=r.view_offs, name=name, ndim=ndim,
        )  # fmt: skip
        if t.view_src is not None:
            self.views.append(t)
        return t

    # binary (b broadcasts to a by repetition, ggml_can_repeat)
    def add(self, a: Tensor, b: Tensor) -> Tensor:
        """``a + np.tile(b, reps)`` where b repeats to a's shape."""
        return self._op(Op.ADD, (a, b))

    def sub(self, a: Tensor, b: Tensor) -> Tensor:
        """``a - tile(b)``."""
        return self._op(Op.SUB, (a, b))

    def mul(self, a: Tensor, b: Tensor) -> Tensor:
        """``a * tile(b)``."""
        return self._op(Op.MUL, (a, b))

    def div(self, a: Tensor, b: Tensor) -> Tensor:
        """``a / tile(b)``."""
        return self._op(Op.DIV, (a, b))

    # elementwise unary
    def scale(self, a: Tensor, s: float, b: float = 0.0) -> Tensor:
        """``a * s + b``. op_params = (s, b)."""
        return self._op(Op.SCALE, (a,), (float(s), float(b)))

    def sqr(self, a: Tensor) -> Tensor:
        """``a * a``."""
        return self._op(Op.SQR, (a,))

    def sqrt(self, a: Tensor) -> Tensor:
        """``np.sqrt(a)``."""
        return self._op(Op.SQRT, (a,))

    def log(self, a: Tensor) -> Tensor:
        """``np.log(a)``."""
        return self._op(Op.LOG, (a,))

    def sin(self, a: Tensor) -> Tensor:
        """``np.sin(a)``."""
        return self._op(Op.SIN, (a,))

    def cos(self, a: Tensor) -> Tensor:
        """``np.cos(a)``."""
        return self._op(Op.COS, (a,))

    def clamp(self, a: Tensor, min: float, max: float) -> Tensor:  # noqa: A002
        """``np.clip(a, min, max)``, min <= max (else ShapeError). op_params = (min, max)."""
        return self._op(Op.CLAMP, (a,), (float(min), float(max)))

    def leaky_relu(self, a: Tensor, negative_slope: float = 0.01) -> Tensor:
        """``np.where(a > 0, a, a * negative_slope)``. op_params = (negative_slope,)."""
        return self._op(Op.LEAKY_RELU, (a,), (float(negative_slope),))

    def unary(self, a: Tensor, op: UnaryOp) -> Tensor:
        """The unary op ``op`` (see the named helpers). op_params = (op,)."""
        return self._op(Op.UNARY, (a,), (_enum(Op.UNARY, UnaryOp, op),))

    def abs(self, a: Tensor) -> Tensor:
        """``np.abs(a)``."""
        return self.unary(a, UnaryOp.ABS)

    def neg(self, a: Tensor) -> Tensor:
        """``-a``."""
        return self.unary(a, UnaryOp.NEG)

    def tanh(self, a: Tensor) -> Tensor:
        """``np.tanh(a)``."""
        return self.unary(a, UnaryOp.TANH)

    def relu(self, a: Tensor) -> Tensor:
        """``np.maximum(a, 0)``."""
        return self.unary(a, UnaryOp.RELU)

    def sigmoid(self, a: Tensor) -> Tensor:
        """``1 / (1 + np.exp(-a))``."""
        return self.unary(a, UnaryOp.SIGMOID)

    def gelu(self, a: Tensor) -> Tensor:
        """tanh GELU: ``0.5*a*(1 + tanh(sqrt(2/pi)*(a + 0.044715*a**3)))``."""
        return self.unary(a, UnaryOp.GELU)

    def gelu_quick(self, a: Tensor) -> Tensor:
        """``a * sigmoid(1.702 * a)``."""
        return self.unary(a, UnaryOp.GELU_QUICK)

    def silu(self, a: Tensor) -> Tensor:
        """``a * sigmoid(a)``."""
        return self.unary(a, UnaryOp.SILU)

    def exp(self, a: Tensor) -> Tensor:
        """``np.exp(a)``."""
        return self.unary(a, UnaryOp.EXP)

    def gelu_erf(self, a: Tensor) -> Tensor:
        """Exact GELU (BERT's): ``0.5*a*(1 + erf(a/sqrt(2)))``."""
        return self.unary(a, UnaryOp.GELU_ERF)

    def elu(self, a: Tensor) -> Tensor:
        """``np.where(a > 0, a, np.expm1(a))``."""
        return self.unary(a, UnaryOp.ELU)

    def hardswish(self, a: Tensor) -> Tensor:
        """``a * np.fmin(1, np.fmax(0, (a + 3) / 6))``."""
        return self.unary(a, UnaryOp.HARDSWISH)

    def hardsigmoid(self, a: Tensor) -> Tensor:
        """``np.fmin(1, np.fmax(0, (a + 3) / 6))``."""
        return self.unary(a, UnaryOp.HARDSIGMOID)

    def expm1(self, a: Tensor) -> Tensor:
        """``np.expm1(a)``."""
        return self.unary(a, UnaryOp.EXPM1)

    def softplus(self, a: Tensor) -> Tensor:
        """``np.where(a > 20, a, np.log1p(np.exp(a)))`` (ggml's threshold: a itself above 20)."""
        return self.unary(a, UnaryOp.SOFTPLUS)

    def step(self, a: Tensor) -> Tensor:
        """``np.where(a > 0, 1, 0)`` (0 at 0 and for NaN)."""
        return self.unary(a, UnaryOp.STEP)

    def floor(self, a: Tensor) -> Tensor:
        """``np.floor(a)``."""
        return self.unary(a, UnaryOp.FLOOR)

    def ceil(self, a: Tensor) -> Tensor:
        """``np.ceil(a)``."""
        return self.unary(a, UnaryOp.CEIL)

    def round(self, a: Tensor) -> Tensor:
        """Halves away from zero, as C's roundf: ``np.copysign(np.floor(np.abs(a) + 0.5), a)``
        (not numpy's ``np.round``, which rounds halves to even)."""
        return self.unary(a, UnaryOp.ROUND)

    def trunc(self, a: Tensor) -> Tensor:
        """``np.trunc(a)``."""
        return self.unary(a, UnaryOp.TRUNC)

    # gated linear units
    def glu(self, a: Tensor, b: Tensor | None, op: GluOp, swapped: bool = False) -> Tensor:
        """With b: ``act(a) * b``. Without b, a's rows are split in halves x|g of ne0/2:
        ``act(x) * g`` (``act(g) * x`` when swapped). op_params = (op, swapped)."""
        return self._op(Op.GLU, (a, b), (_enum(Op.GLU, GluOp, op), int(bool(swapped))))

    def swiglu(self, a: Tensor, b: Tensor | None = None, swapped: bool = False) -> Tensor:
        """``silu(a) * b`` (or the split form, see :meth:`glu`)."""
        return self.glu(a, b, GluOp.SWIGLU, swapped)

    def geglu(self, a: Tensor, b: Tensor | None = None, swapped: bool = False) -> Tensor:
        """``gelu(a) * b`` (or the split form, see :meth:`glu`)."""
        return self.glu(a, b, GluOp.GEGLU, swapped)

    # row-wise
    def norm(self, a: Tensor, eps: float = 1e-5) -> Tensor:
        """Per row: ``(x - x.mean()) / np.sqrt(x.var() + eps)``. op_params = (eps,)."""
        return self._op(Op.NORM, (a,), (float(eps),))

    def rms_norm(self, a: Tensor, eps: float = 1e-6) -> Tensor:
        """Per row: ``x / np.sqrt(np.mean(x*x) + eps)``. op_params = (eps,)."""
        return self._op(Op.RMS_NORM, (a,), (float(eps),))

    def l2_norm(self, a: Tensor, eps: float = 1e-12) -> Tensor:
        """Per row: ``x / max(np.linalg.norm(x), eps)``. op_params = (eps,)."""
        return self._op(Op.L2_NORM, (a,), (float(eps),))

    def soft_max(
        self, a: Tensor, mask: Tensor | None = None, scale: float = 1.0, max_bias: float = 0.0
    ) -> Tensor:
        """Per row: ``softmax(a*scale + slope*mask[:a.rows])`` with ALiBi slope per head
        (axis ne2) when max_bias > 0, else slope 1. mask broadcasts over ne2/ne3.
        op_params = (scale, max_bias)."""
        return self._op(Op.SOFT_MAX, (a, mask), (float(scale), float(max_bias)))

    def rope(
        self,
        a: Tensor,
        pos: Tensor,
        n_dims: int,
        mode: int = ROPE_TYPE_NORMAL,
        n_ctx_orig: int = 0,
        freq_base: float = 10000.0,
        freq_scale: float = 1.0,
        ext_factor: float = 0.0,
        attn_factor: float = 1.0,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        freq_factors: Tensor | None = None,
    ) -> Tensor:
        """Rotary embedding of a [tokens, heads, head_dim] (ne = [head_dim, heads, tokens]) at
        positions ``pos`` (I32, one per token). Mode 0 rotates pairs (x[2i], x[2i+1]); mode 2
        (NEOX) rotates (x[i], x[i+n_dims/2]); theta_i = pos * freq_base**(-2i/n_dims) / ff[i],
        with YaRN scaling (freq_scale, ext_factor, attn_factor, beta_fast/slow) as ggml.
        ``freq_factors``: ggml_rope_ext's ``c``, an F32 vector ff of at least n_dims/2 values
        (Llama 3's ``rope_freqs``); without it ff = 1. It is the node's third source (src[2]),
        present only when given. op_params = ggml's: (0, n_dims, mode, 0, n_ctx_orig, freq_base,
        freq_scale, ext_factor, attn_factor, beta_fast, beta_slow); ``accelplane.core.ops.rope_params``
        reads them by name."""
        params = (0, int(n_dims), int(mode), 0, int(n_ctx_orig), float(freq_base),
                  float(freq_scale), float(ext_factor), float(attn_factor),
                  float(beta_fast), float(beta_slow))  # fmt: skip
        src = (a, pos) if freq_factors is None else (a, pos, freq_factors)
        return self._op(Op.ROPE, src, params)

    def rope_neox(self, a: Tensor, pos: Tensor, n_dims: int, **kw) -> Tensor:
        """:meth:`rope` in NEOX mode."""
        return self.rope(a, pos, n_dims, ROPE_TYPE_NEOX, **kw)

    # matrix products
    def mul_mat(self, a: Tensor, b: Tensor) -> Tensor:
        """ggml_mul_mat: ``b @ a.swapaxes(-1, -2)``: a holds weight rows [.., M, K] (a float or
        quantized type), b activations [.., N, K] (F32, F16 or BF16), result [.., N, M] in F32;
        a's outer axes broadcast over b's."""
        return self._op(Op.MUL_MAT, (a, b))

    def mul_mat_id(self, as_: Tensor, b: Tensor, ids: Tensor) -> Tensor:
        """Experts as_ [E, M, K]; b [T, B, K] (B = 1 or n_used); ids I32 [T, n_used]:
        ``out[t, u] = as_[ids[t, u]] @ b[t, u % B]`` → [T, n_used, M]."""
        return self._op(Op.MUL_MAT_ID, (as_, b, ids))

    # rows
    def get_rows(self, a: Tensor, rows: Tensor) -> Tensor:
        """``a[..., rows, :]`` per outer batch (rows I32 [.., n]); dequantized to F32."""
        return self._op(Op.GET_ROWS, (a, rows))

    def set_rows(self, dst: Tensor, src: Tensor, rows: Tensor) -> Tensor:
        """``dst[..., rows[i], :] = src[..., i, :]`` (converted/quantized to dst's type);
        the result is a view of dst (the write happens when the graph computes)."""
        return self._op(Op.SET_ROWS, (dst, src, rows))

    # copies
    def cpy(self, a: Tensor, b: Tensor) -> Tensor:
        """``b.flat[:] = a.flat`` in row-major element order, converted or quantized to b's
        type; the result is a view of b."""
        return self._op(Op.CPY, (a, b))

    def cont(self, a: Tensor) -> Tensor:
        """``np.ascontiguousarray(a)``."""
        return self._op(Op.CONT, (a,))

    def dup(self, a: Tensor) -> Tensor:
        """``a.copy()`` (contiguous)."""
        return self._op(Op.DUP, (a,))

    def concat(self, a: Tensor, b: Tensor, dim: int) -> Tensor:
        """``np.concatenate([a, b], axis)`` along ggml dim ``dim`` (0 = innermost)."""
        return self._op(Op.CONCAT, (a, b), (int(dim),))

    # reductions
    def sum(self, a: Tensor) -> Tensor:
        """``a.sum()`` as a 1-element tensor."""
        return self._op(Op.SUM, (a,))

    def sum_rows(self, a: Tensor) -> Tensor:
        """``a.sum(axis=-1, keepdims=True)``."""
        return self._op(Op.SUM_ROWS, (a,))

    def mean(self, a: Tensor) -> Tensor:
        """``a.mean(axis=-1, keepdims=True)``."""
        return self._op(Op.MEAN, (a,))

    def argmax(self, a: Tensor) -> Tensor:
        """``a.argmax(axis=-1)`` of a matrix (I32)."""
        return self._op(Op.ARGMAX, (a,))

    def argsort(self, a: Tensor, order: SortOrder = SortOrder.ASC) -> Tensor:
        """ASC: ``np.argsort(a, axis=-1, kind='stable')``; DESC: ``np.argsort(-a, axis=-1,
        kind='stable')``: ties (-0.0 and 0.0 among them) keep index order and NaN comes after
        every number in either order, a total order where ggml's std::sort leaves NaN undefined. I32."""
        return self._op(Op.ARGSORT, (a,), (_enum(Op.ARGSORT, SortOrder, order),))

    # convolution helpers
    def im2col(
        self, kernel: Tensor, x: Tensor, s0: int, s1: int, p0: int, p1: int, d0: int, d1: int,
        is_2d: bool = True, dst_type: GGMLType | str = GGMLType.F16,
    ) -> Tensor:  # fmt: skip
        """Unfold patches of x for a convolution with ``kernel``'s shape: 2-D x [N, C, H, W] →
        [N, OH, OW, C*KH*KW]; 1-D x [N, C, W] → [N, OW, C*KW] (zero padding).
        op_params = (s0, s1, p0, p1, d0, d1, is_2d, dst_type)."""
        params = (int(s0), int(s1), int(p0), int(p1), int(d0), int(d1), int(bool(is_2d)),
                  int(parse_type(dst_type)))  # fmt: skip
        return self._op(Op.IM2COL, (kernel, x), params)

    def col2im_1d(self, a: Tensor, s0: int, oc: int, p0: int = 0) -> Tensor:
        """Scatter-add GEMM columns back to a 1-D signal: a [B, T_in, OC*K] →
        [B, OC, T_out], T_out = (T_in-1)*s0 + K - 2*p0,
        ``out[b, c, t] = sum a[b, i, c*K + k] over t + p0 == i*s0 + k``.
        op_params = (s0, oc, p0)."""
        return self._op(Op.COL2IM_1D, (a,), (int(s0), int(oc), int(p0)))

    # views (no computation; the result shares a's memory)
    def view(self, a: Tensor, ne: Sequence[int], nb: Sequence[int] | None = None,
             offset: int = 0) -> Tensor:  # fmt: skip
        """ggml_view_Nd: a view of ``ne`` (ggml order) with byte strides ``nb`` (default:
        a's row strides) at byte ``offset`` of a's data."""
        _tensor(Op.VIEW, a)
        ne = tuple(int(x) for x in ne) + (1,) * (4 - len(ne))
        if nb is None:
            nb = (a.nb[0], a.nb[1], a.nb[1] * ne[1], a.nb[1] * ne[1] * ne[2])
        nb = [int(x) for x in nb]
        while len(nb) < 4:  # like ggml_view_Nd: missing strides pack the dims given
            nb.append(nb[-1] * ne[len(nb) - 1])
        nb = tuple(nb)
        probe = Tensor(a.type, ne, nb, name=f"view of {a.name or a.uid}")  # strides checked here
        if offset < 0 or offset + probe.nbytes > a.nbytes:  # inside a (the owner: on creation)
            raise ShapeError(
                f"VIEW: bytes [{offset}, {offset + probe.nbytes}) outside the {a.nbytes} bytes of "
                f"{a.name or a.uid}"
            )
        t = self._op(Op.VIEW, (a,), (ne, nb, int(offset)))
        t.ndim = max(1, max((i + 1 for i in range(4) if ne[i] != 1), default=1))
        return t

    def reshape(self, a: Tensor, shape: Sequence[int]) -> Tensor:
        """``a.reshape(shape)`` (numpy order); a must be contiguous."""
        shape = tuple(int(x) for x in shape)
        ne = tuple(reversed(shape)) + (1,) * (4 - len(shape))
        return self._reshape(a, ne, len(shape))

    def reshape_ne(self, a: Tensor, *ne: int) -> Tensor:
        """ggml_reshape_Nd (ggml order)."""
        return self._reshape(a, tuple(ne) + (1,) * (4 - len(ne)), len(ne))

    def _reshape(self, a: Tensor, ne: tuple, ndim: int) -> Tensor:
        _tensor(Op.RESHAPE, a)
        if not a.is_contiguous():
            raise ShapeError(f"RESHAPE: {a.name or a.uid} is not contiguous; use cont() first")
        n = ne[0] * ne[1] * ne[2] * ne[3]
        if n != a.nelements:
            raise ShapeError(f"RESHAPE: {a.nelements} elements cannot take ne={list(ne)}")
        t = self._op(Op.RESHAPE, (a,), (ne, contiguous_strides(a.type, ne), 0))
        t.ndim = ndim
        return t

    def permute(self, a: Tensor, ax0: int, ax1: int, ax2: int, ax3: int) -> Tensor:
        """ggml_permute: ggml axis i of a moves to position ax_i (ggml order)."""
        _tensor(Op.PERMUTE, a)
        axes = (ax0, ax1, ax2, ax3)
        if sorted(axes) != [0, 1, 2, 3]:
            raise ShapeError(f"PERMUTE: axes {axes} are not a permutation of 0..3")
        ne = [0] * 4
        nb = [0] * 4
        for i, ax in enumerate(axes):
            ne[ax] = a.ne[i]
            nb[ax] = a.nb[i]
        t = self._op(Op.PERMUTE, (a,), (tuple(ne), tuple(nb), 0))
        t.op_params = (tuple(ne), tuple(nb), 0, axes)
        # a one-element tensor has no axis above 1 to move
        t.ndim = max(a.ndim, max((axes[i] + 1 for i in range(4) if a.ne[i] != 1), default=1))
        return t

    def transpose(self, a: Tensor) -> Tensor:
        """``a.swapaxes(-1, -2)`` (ggml dims 0 and 1)."""
        t = self.permute(a, 1, 0, 2, 3)
        t.op = Op.TRANSPOSE
        t.ndim = max(2, a.ndim)
        return t

    def graph(self, *outputs: Tensor, expand: Sequence[Tensor] = ()) -> Graph:
        """The graph that computes ``outputs`` (marked as graph outputs). ``expand``: tensors
        whose chains come first, in this order (ggml_build_forward_expand before the final
        one): they only order independent chains, e.g. a MoE layer's gating weights before its
        experts so a plugin may fuse the gating run; they are not outputs (but are computed
        even when no output needs them)."""
        bad = [t for t in (*outputs, *expand) if not isinstance(t, Tensor)]
        if bad:
            raise ShapeError(f"Context.graph: outputs and expand take tensors, not {type(bad[0]).__name__}")
        for o in outputs:
            o.set_output()
        return Graph(outputs, expand=expand)


def _typed_errors(name: str, fn):
    """``fn`` with a parameter that is not a number where one is due (``int("x")``, ``float(None)``)
    reported as ShapeError naming the builder method, never a raw ValueError/TypeError."""

    @functools.wraps(fn)
    def checked(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except AccelplaneError:
            raise
        except (TypeError, ValueError, OverflowError) as e:
            raise ShapeError(f"Context.{name}: bad argument: {e}") from None

    return checked


for _name, _fn in list(vars(Context).items()):
    if not _name.startswith("_") and callable(_fn):
        setattr(Context, _name, _typed_errors(_name, _fn))


class Graph:
    """Nodes (tensors with an op, view ops included) in topological order and leafs (no op).

    A graph is immutable once built; ``uid`` identifies it for plan caches, and
    ``layout_version`` changes whenever the allocator (re)places its tensors.
    """

    __slots__ = ("nodes", "leafs", "uid", "layout_version", "keep", "__weakref__")

    def __init__(self, outputs: Iterable[Tensor], expand: Iterable[Tensor] = ()) -> None:
        """``outputs``' nodes in topological order; the chains of ``expand`` first (see
        :meth:`Context.graph`)."""
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []
        outputs = list(outputs)
        seen: set[int] = set()
        for out in [*expand, *outputs]:
            self._visit(out, seen)
        self.uid = next(_graph_ids)
        self.layout_version = 0
        # memory a plugin's fused kernels must still write although a node of this graph
        # reads it (accelplane.core.fusion): the memory owners of the outputs asked for and of every
        # tensor flagged OUTPUT (or INPUT, PARAM), however deep its chain of views; None =
        # unknown, fuse nothing
        self.keep: frozenset[int] | None = owners_to_keep(itertools.chain(self.leafs, self.nodes),
                                                          outputs)

    def _visit(self, root: Tensor, seen: set[int]) -> None:
        # iterative post-order DFS over src (deep graphs must not hit the recursion limit)
        stack: list[tuple[Tensor, int]] = [(root, 0)]
        while stack:
            t, i = stack.pop()
            if i == 0 and id(t) in seen:
                continue
            srcs = [s for s in t.src if s is not None]
            if t.view_src is not None and t.view_src not in srcs:
                srcs.append(t.view_src)
            if i < len(srcs):
                stack.append((t, i + 1))
                if id(srcs[i]) not in seen:
                    stack.append((srcs[i], 0))
                continue
            if id(t) in seen:
                continue
            seen.add(id(t))
            (self.leafs if t.op is None else self.nodes).append(t)

    @classmethod
    def from_nodes(cls, nodes: Sequence[Tensor], leafs: Sequence[Tensor] = (),
                   keep: frozenset[int] | None = None) -> Graph:  # fmt: skip
        """A graph of given nodes (already in a valid order), e.g. a scheduler split. ``keep``:
        ids of the tensors (memory owners) read outside these nodes or wanted by the caller;
        None (unknown) lets no plugin fuse a node away."""
        g = cls.__new__(cls)
        g.nodes = list(nodes)
        g.leafs = list(leafs)
        g.uid = next(_graph_ids)
        g.layout_version = 0
        g.keep = keep
        return g

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self):
        return iter(self.nodes)

    def __repr__(self) -> str:
        return f"Graph(#{self.uid}, {len(self.nodes)} nodes, {len(self.leafs)} leafs)"
