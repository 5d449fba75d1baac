"""Node fusion: which runs of consecutive nodes a plugin may compute as one kernel.

ggml's backends fuse inside graph_compute (``ggml_can_fuse``: RMS_NORM then MUL, ROPE then
SET_ROWS, …), each with its own idea of when that is safe. Here the rule is written once, and
every plugin asks it:

A run of nodes ``i .. i+k`` with the given ops may be computed as one kernel when every node
but the last owns its memory (is not a view of another tensor, or is the scheduler's clone of
a node, which writes that node's memory), is read by exactly one node
of the graph, the next one in the run, directly (not through a view) and through one of its
sources only (a fused kernel reads the other sources from memory), and is in no ``keep``
set: not a tensor the caller asked for or flagged OUTPUT, not read by another scheduler split
(the scheduler passes those as the split graph's ``keep``). The skipped nodes' memory is then
left unwritten. A run may also name nodes whose results the kernel still writes (``written``
in :meth:`Fusion.match`); those may have other readers. A graph whose ``keep`` is None
(unknown, e.g. ``Graph.from_nodes`` without it) fuses nothing.

``ACCELPLANE_FUSION=0`` turns fusion off everywhere (for bisecting a wrong result).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from accelplane import env
from accelplane.core.graph import Graph
from accelplane.core.ops import VIEW_OPS, Op
from accelplane.core.tensor import Tensor, TensorFlag
from accelplane.core.types import GGMLType

NORMS = frozenset({Op.NORM, Op.RMS_NORM, Op.L2_NORM})


def enabled() -> bool:
    return env.FUSION.get()


def _owner(t: Tensor) -> Tensor:
    return t.view_src or t


def _own_memory(t: Tensor) -> bool:
    """``t`` writes memory of its own: not a view, or a scheduler clone (TensorFlag.CLONE)
    writing the memory of the node it stands for."""
    return t.view_src is None or bool(t.flags & TensorFlag.CLONE)


class RopeCache(NamedTuple):
    """:meth:`Fusion.product_rope_cache`'s run: the product, the queries' ROPE, the keys'
    ROPE and the SET_ROWS that writes them, the values' SET_ROWS, and how many nodes from the
    product through the last of them the run covers (views included)."""

    product: Tensor
    q_rope: Tensor
    k_rope: Tensor
    k_set: Tensor
    v_set: Tensor
    covered: int


class NormRope(NamedTuple):
    """:meth:`Fusion.norm_rope`'s run: a norm, the MUL scaling its rows, the ROPE of that,
    and, when the rotated rows go on into a cache, the SET_ROWS that writes them (the rope's
    own memory then left unwritten); ``covered``: 3, or 5 with the view and the SET_ROWS."""

    norm: Tensor
    mul: Tensor
    rope: Tensor
    set_rows: Tensor | None
    covered: int


class MoeGating(NamedTuple):
    """:meth:`Fusion.moe_gating`'s run, every node of which the kernel writes: the router's
    SOFT_MAX (``probs``, [E, T]), its descending ARGSORT (``order``), the GET_ROWS of the top
    ``k`` probabilities (``weights``, [1, k, T]), and, when they are renormalized, the
    SUM_ROWS of those (``total``) and the DIV by it (``normed``, [k, T]); ``covered``: nodes
    from the SOFT_MAX through the last of them, views included."""

    probs: Tensor
    order: Tensor
    weights: Tensor
    total: Tensor | None
    normed: Tensor | None
    k: int
    covered: int


class MoeSum(NamedTuple):
    """:meth:`Fusion.moe_sum`'s run: ``mul`` = MUL(experts [d, k, T], weights [1, k, T]) and
    the ADDs that sum its k [d, T] slices in order; only the last ADD (``out``) is written."""

    mul: Tensor
    out: Tensor
    k: int
    covered: int


class Fusion:
    """Use counts of one graph's nodes, for :meth:`match`; build once per plan."""

    def __init__(self, graph: Graph) -> None:
        self.nodes = graph.nodes
        self.keep = graph.keep if enabled() else None
        self.uses: dict[int, int] = {}  # id(memory owner) → reading nodes, views included
        if self.keep is None:
            return
        for n in graph.nodes:
            srcs = {id(_owner(s)) for s in n.src if s is not None}
            if not _own_memory(n):  # a view reads (or writes into) the tensor it views
                srcs.add(id(n.view_src))
            for k in srcs:
                self.uses[k] = self.uses.get(k, 0) + 1

    def walk(self, step: Callable[[int], int]) -> None:
        """Call ``step(i)`` at each node where a plan's next step starts, in graph order: every
        node that is not a view, after the nodes the last step computed. ``step`` builds that
        step and returns how many nodes from ``i`` on it computes (a fused kernel's run, views
        among them; at least 1)."""
        i, end = 0, len(self.nodes)
        while i < end:
            if self.nodes[i].op in VIEW_OPS:
                i += 1
            else:
                i += max(1, step(i))

    def match(self, i: int, ops: Sequence[Op], written: Sequence[int] = ()) -> bool:
        """Nodes ``i .. i+len(ops)-1`` have these ops and may run as one kernel (module
        docstring); the caller still checks the types and shapes its kernel handles.
        ``written``: positions in the run whose results the kernel still writes to memory;
        those may have other readers (each node still feeds the next one directly)."""
        if self.keep is None or i + len(ops) > len(self.nodes):
            return False
        run = self.nodes[i : i + len(ops)]
        if any(n.op is not o for n, o in zip(run, ops, strict=True)):
            return False
        for j, (n, nxt) in enumerate(zip(run, run[1:], strict=False)):
            reads = sum(s is n for s in nxt.src)
            if reads == 0:
                return False
            if j in written:
                continue
            if reads > 1:  # e.g. MUL(norm, norm): the kernel takes one operand from memory
                return False
            own = _owner(n)
            if not _own_memory(n) or id(own) in self.keep or own.flags & TensorFlag.OUTPUT:
                return False
            if self.uses.get(id(own), 0) != 1:
                return False
        return True

    def rope_set_rows(self, i: int) -> Tensor | None:
        """The SET_ROWS after ROPE node ``i`` when the three nodes ROPE → a reshape or view of
        its result → SET_ROWS of that into a cache may run as one kernel (ggml's CUDA backend
        fuses the same run): the rope's result and the view are read only by the next node
        of the run and are not kept; the kernel writes the rotated rows straight into the
        cache and leaves the rope's own memory unwritten. Else None; the caller still checks
        the shapes its kernel handles."""
        if self.keep is None or i + 3 > len(self.nodes):
            return None
        rope, view, sr = self.nodes[i : i + 3]
        if rope.op is not Op.ROPE or view.op not in (Op.RESHAPE, Op.VIEW) or sr.op is not Op.SET_ROWS:
            return None
        if len(rope.src) > 2:  # frequency factors: the fused kernels rotate without them
            return None
        # the rope's memory: its own, or for a scheduler clone the original's (the view then
        # views the original too, and the readers are counted there)
        own = _owner(rope)
        if view.view_src is not own or sr.src[1] is not view or not _own_memory(rope):
            return None
        if id(own) in self.keep or any(t.flags & TensorFlag.OUTPUT for t in (rope, view, own)):
            return None
        # readers of the rope's memory: the view itself and the SET_ROWS through it
        return sr if self.uses.get(id(own), 0) == 2 else None

    def product_rope_cache(self, i: int) -> RopeCache | None:
        """The attention block's Q/K/V projection as one kernel (:class:`RopeCache`): node ``i``
        is a MUL_MAT whose memory is read only through views by, in any order, a ROPE (the
        queries, still written: the attention reads them), a ROPE → view → SET_ROWS run
        (:meth:`rope_set_rows`: the keys into their cache) and a SET_ROWS of a view (the
        values into theirs), with nothing but views between them; the two ropes read the same
        positions with the same parameters. The product's and the keys' rope memory is then
        left unwritten. Else None; the caller still checks the slices, shapes and types its
        kernel handles."""
        if self.keep is None or self.nodes[i].op is not Op.MUL_MAT:
            return None
        n = self.nodes[i]
        own = _owner(n)
        if not _own_memory(n) or id(own) in self.keep or own.flags & TensorFlag.OUTPUT:
            return None

        def reads(t: Tensor) -> bool:
            return any(s is not None and _owner(s) is own for s in t.src)

        q = k = v = None
        k_set = None
        readers = 0  # nodes of the window that read the product's memory, views included
        j = i + 1
        while j < len(self.nodes) and (q is None or k is None or v is None):
            t = self.nodes[j]
            if t.op in VIEW_OPS:
                readers += _owner(t) is own
                j += 1
                continue
            if t.op is Op.ROPE and reads(t):
                sr = self.rope_set_rows(j)
                if sr is None and q is None:
                    q, j = t, j + 1
                elif sr is not None and k is None:
                    k, k_set, j = t, sr, j + 3
                else:
                    return None
                readers += 1
            elif t.op is Op.SET_ROWS and t.src[1] is not None and _owner(t.src[1]) is own and v is None:
                v, j, readers = t, j + 1, readers + 1
            else:
                return None
        if q is None or k is None or v is None or k_set is None or self.uses.get(id(own), 0) != readers:
            return None
        if q.src[1] is not k.src[1] or tuple(q.op_params) != tuple(k.op_params) or len(q.src) > 2:
            return None
        return RopeCache(n, q, k, k_set, v, j - i)

    def moe_gating(self, i: int) -> MoeGating | None:
        """A MoE layer's expert weights as one kernel (:class:`MoeGating`, the order
        DecoderModel builds them in, as llama.cpp's build_moe_ffn): node ``i`` is SOFT_MAX(logits)
        without mask; then, views aside, ARGSORT of it, GET_ROWS of the probabilities viewed as
        [1, E, T] at the first k columns of the ARGSORT, and optionally SUM_ROWS of those
        weights viewed as [k, T] and DIV of that view by the sum. Every node of the run is
        written (each is small: E or k values per token), so any of them may have other
        readers; the caller checks the types and shapes its kernel handles."""
        if self.keep is None or self.nodes[i].op is not Op.SOFT_MAX:
            return None
        probs = self.nodes[i]
        if len(probs.src) > 1 and probs.src[1] is not None:  # masked
            return None
        j, order, ids, weights = i + 1, None, None, None
        while j < len(self.nodes) and weights is None:  # views, the ARGSORT, the GET_ROWS
            t = self.nodes[j]
            if t.op is Op.ARGSORT and order is None and t.src[0] is probs:
                order = t
            elif t.op is Op.VIEW and order is not None and ids is None and t.src[0] is order:
                ids = t
            elif t.op is Op.GET_ROWS and ids is not None and t.src[1] is ids:
                weights = t
            elif t.op not in (Op.RESHAPE, Op.VIEW):
                return None
            j += 1
        if weights is None:
            return None
        # (a node's sources are the split's clones; a view's view_src is the original's memory)
        pv = weights.src[0]
        if pv.op not in (Op.RESHAPE, Op.VIEW) or pv.src[0] is not probs or pv.ne[0] != 1:
            return None
        k, n_tok = ids.ne[0], ids.ne[1]
        if (ids.view_offs != order.view_offs or tuple(ids.ne) != (k, probs.ne[1], 1, 1)
                or tuple(weights.ne) != (1, k, n_tok, 1)):  # fmt: skip
            return None
        total = normed = None
        rest = self.nodes[j : j + 3]
        if [t.op for t in rest] == [Op.RESHAPE, Op.SUM_ROWS, Op.DIV]:
            view, s, d = rest
            if view.src[0] is weights and s.src[0] is view and d.src[0] is view and d.src[1] is s:
                total, normed, j = s, d, j + 3
        return MoeGating(probs, order, weights, total, normed, int(k), j - i)

    def moe_sum(self, i: int) -> MoeSum | None:
        """The weighted sum over a MoE layer's experts as one kernel (:class:`MoeSum`): node
        ``i`` is MUL(experts [d, k, T], weights [1, k, T]) read only by k views, slice j being
        [d, T] at offset j * nb1, and the ADDs chain ((s0 + s1) + s2) + …, each partial sum
        read only by the next ADD; the MUL and the partial sums are neither kept nor outputs
        (their memory is left unwritten)."""
        if self.keep is None or self.nodes[i].op is not Op.MUL:
            return None
        mul = self.nodes[i]
        d, k, n_tok = mul.ne[0], mul.ne[1], mul.ne[2]
        w = mul.src[1]
        if k < 2 or tuple(w.ne) != (1, k, n_tok, 1) or tuple(mul.src[0].ne) != (d, k, n_tok, 1):
            return None

        def dropped(t: Tensor, readers: int) -> bool:  # may be left unwritten
            own = _owner(t)
            return (_own_memory(t) and id(own) not in self.keep and not own.flags & TensorFlag.OUTPUT
                    and self.uses.get(id(own), 0) == readers)  # fmt: skip

        if not dropped(mul, 2 * k - 1):  # readers: the k views and the k - 1 ADDs through them
            return None
        slices: dict[int, int] = {}  # id(view) → its slice
        acc, seen, j = None, 0, i + 1
        while j < len(self.nodes) and seen < k:
            t = self.nodes[j]
            if t.op is Op.VIEW and t.src[0] is mul:
                off, r = divmod(t.view_offs - mul.view_offs, mul.nb[1])
                if r or tuple(t.ne) != (d, n_tok, 1, 1) or tuple(t.nb[:2]) != (mul.nb[0], mul.nb[2]):
                    return None
                slices[id(t)] = off
            elif t.op is Op.ADD:
                a, b = t.src
                first = acc is None and slices.get(id(a)) == 0 and slices.get(id(b)) == 1
                if not (first or (acc is not None and a is acc and slices.get(id(b)) == seen)):
                    return None
                if acc is not None and not dropped(acc, 1):
                    return None
                acc, seen = t, 2 if first else seen + 1
            else:
                return None
            j += 1
        if acc is None or seen != k:
            return None
        return MoeSum(mul, acc, int(k), j - i)

    def attention(self, i: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """(KQ, SOFT_MAX, KQV) when nodes ``i .. i+2`` are attention's MUL_MAT(K, Q), the
        SOFT_MAX of it (scale and mask) and MUL_MAT(V^T, the probabilities), may run as one
        kernel, and each product reads its predecessor as the activations; else None."""
        if not self.match(i, (Op.MUL_MAT, Op.SOFT_MAX, Op.MUL_MAT)):
            return None
        kq, sm, kqv = self.nodes[i : i + 3]
        return (kq, sm, kqv) if sm.src[0] is kq and kqv.src[1] is sm else None

    def norm_rope(self, i: int) -> NormRope | None:
        """A head norm, its weights and the ROPE after them as one kernel (:class:`NormRope`;
        qwen3's and gemma3's Q/K norms): nodes ``i .. i+2`` are a norm, a MUL scaling its rows
        (:func:`scales_rows`) and a ROPE of the product, as :meth:`match` allows; when the
        rope's result is then written into a cache (:meth:`rope_set_rows` at ``i + 2``), that
        run too. Else None; the caller still checks the types and shapes its kernel handles."""
        n = self.nodes[i]
        if n.op not in NORMS or not self.match(i, (n.op, Op.MUL, Op.ROPE)):
            return None
        mul, rope = self.nodes[i + 1 : i + 3]
        if not scales_rows(n, mul) or rope.src[0] is not mul:
            return None
        sr = self.rope_set_rows(i + 2)
        return NormRope(n, mul, rope, sr, 3 if sr is None else 5)

    def norm_mul(self, i: int) -> Tensor | None:
        """The MUL after norm node ``i`` when the pair may run as one kernel and the MUL scales
        the norm's rows (:func:`scales_rows`); else None."""
        n = self.nodes[i]
        if n.op not in NORMS or not self.match(i, (n.op, Op.MUL)):
            return None
        m = self.nodes[i + 1]
        return m if scales_rows(n, m) else None


def overlap(a: Tensor, b: Tensor) -> bool:
    """``a``'s and ``b``'s bytes intersect (allocated tensors in one buffer): where the allocator
    placed a run's later result over an input whose last reader is earlier in the run, a kernel
    whose threads or blocks write one and read the other at once must decline the run."""
    return (a.buffer is not None and a.buffer is b.buffer and a.nbytes > 0 and b.nbytes > 0
            and a.offs < b.offs + b.nbytes and b.offs < a.offs + a.nbytes)  # fmt: skip


def scales_rows(norm: Tensor, mul: Tensor) -> bool:
    """``mul`` is MUL(norm, w) with w F32 broadcast over the norm's rows (ggml repeat rules),
    the shape a fused norm kernel handles: y = norm(x) * w[row broadcast]."""
    w = mul.src[1]
    return (mul.src[0] is norm and mul.type == w.type == GGMLType.F32
            and tuple(mul.ne) == tuple(norm.ne))  # fmt: skip
