"""All-reduce over the backends of a tensor-parallel group: the plugin's communicator where it
has one, else the SDK's fallbacks (ggml-backend-meta.cpp's ``allreduce_fallback``, extended).

``allreduce(backends, tensors)`` sums ``tensors[i]`` (one per backend, same type and shape) in
place on every backend. :class:`AllReduce` is the same operation as an object that keeps what
it needs per (backends, tensor layout) — scratch buffers, events, the small ADD/CPY graphs —
until :meth:`AllReduce.free`.

Algorithms
----------
``plugin``     the plugin's ``comm_init`` / ``comm_allreduce_tensor`` (:class:`backend.Comm`).
``butterfly``  ggml's recursive doubling: ``log2(P)`` exchanges of the whole tensor.
``ring``       reduce-scatter + all-gather over ``n`` chunks: each device sends and receives
               ``2(n-1)/n`` of the tensor (a ring's traffic), in two exchange phases.
``auto``       ``plugin``; where there is none (``comm_init`` returned None) or the plugin
               declines the call (``comm_allreduce_tensor`` returned False), ``butterfly``.

The fallbacks use nothing but :func:`backend.tensor_copy_async` (the plugins'
``cpy_tensor_async``, or the SDK's blocking fallback) and graphs of ADD (and CPY, for
compression) computed on the backends, so they work across any mix of plugins.

The canonical order (why ring and butterfly agree to the bit)
-------------------------------------------------------------
Float addition is commutative but not associative, so every algorithm here evaluates the same
tree; only the placement of its additions differs. With ``n`` ranks ``x_0 … x_{n-1}`` (the
order of ``backends``) and ``P`` the largest power of two ``<= n``:

1. fold:   ``y_i = x_i + x_{i+P}`` for ``i < n - P``; ``y_i = x_i`` otherwise (``i < P``);
2. levels: for ``d = 1, 2, 4, … , P/2``, every block of ``2d`` consecutive groups merges its
   lower half with its upper half: ``Y[a] = Y[a] + Y[a+d]`` for ``a = 0, 2d, 4d, …``.

That is the pairwise tree over ``y_0 … y_{P-1}`` in index order; e.g. for n = 5:
``((x0 + x4) + x1) + (x2 + x3)``. :func:`merge_order` lists the merges, :func:`canonical_sum`
evaluates them in numpy. Each merge is one rounded addition of the tensor's type
(``fl(a + b)``; for F16/BF16 the add is done in F32 and rounded on store, as the backends do).

- butterfly: the fold is a copy ``x_{i+P} → rank i`` + ADD; level ``d`` is an exchange
  between ranks ``r`` and ``r ^ d`` followed by ``x_r += x_{r^d}`` on both (the same sum,
  by commutativity); the folded ranks get the result copied back at the end.
- ring: chunk ``c`` is owned by rank ``c``. The owner receives the ``n-1`` other partials of
  its chunk (the ring's per-device traffic) and adds them along the same merges, then sends
  the reduced chunk to every other rank.

So in F32 (no compression) butterfly and ring give byte-identical results for the same device
order (NaN payloads aside), on every rank.

Compression (``compress="f16"|"bf16"``, F32 tensors of at least ``compress_threshold`` bytes)
------------------------------------------------------------------------------------------
Partials are converted on the sender (a CPY graph into a scratch tensor of the wire type),
sent, and added into an F32 accumulator on the receiver (ADD takes a F16/BF16 second operand).
So that every rank ends with the same bits: in the butterfly each rank also rounds its own
operand before the add; in the ring the owner rounds its reduced chunk to the wire type,
sends that, and every rank (owner included) converts it back. The compressed results are
within the wire type's rounding of the exact sum, but not equal across algorithms. The
default threshold is ``ACCELPLANE_COMM_COMPRESS_MIN`` bytes (131072 when unset). ``plugin``
and ``auto`` leave compression to the plugin when it serves the call.

Ordering (docs/ordering.md)
---------------------------
The operation is queued on the backends' streams and returns without blocking the host
unless a device lacks events (then :class:`backend.Event` falls back to synchronizing) or a
plugin cannot copy asynchronously (then :func:`backend.tensor_copy_async` copies blocking).
A copy ``A → B`` is ordered only after earlier work on A and before later work on B, so:

- read-after-write is given by that rule (copies read what earlier work on A wrote; work
  on B reads what the copy wrote);
- a tensor that a peer copies from is written by its owner only after a barrier: the
  destination records an event after the copy, the source waits for it (device-side);
- the last step of every call is an exit barrier over every edge ``A → B`` used: A waits for
  B's event recorded after all of B's work. It keeps the caller's later work on A from
  overwriting data a peer has not copied yet, and the next call's copies into B's scratch
  from overtaking B's reads of it.

Later work on every backend sees the sum (rule 9).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from accelplane.core.graph import Context, Graph
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType, np_dtype
from accelplane.errors import DeviceError, ShapeError, TypeMismatchError, UnsupportedOpError
from accelplane.runtime.alloc import alloc_ctx_tensors
from accelplane.runtime.backend import Backend, Buffer, BufferUsage, Comm, Event, tensor_copy_async
from accelplane.runtime.collective import (
    canonical_sum,
    compress_threshold_default,
    merge_order,
    pow2_floor,
)
from accelplane.runtime.data import check_range

T = GGMLType
ALGORITHMS = ("auto", "plugin", "butterfly", "ring")
REDUCIBLE = frozenset({T.F32, T.F16, T.BF16})
WIRE_TYPES = {"f16": T.F16, "bf16": T.BF16}
CHUNK_ALIGN = 32  # ring chunk boundaries in elements (keeps chunk views 64/128-byte aligned)
MAX_BINDINGS = 16  # tensor tuples remembered per plan (graphs over the caller's memory)

__all__ = [
    "ALGORITHMS", "AllReduce", "AllReduceBench", "allreduce", "bench_allreduce",
    "canonical_sum", "compress_threshold_default", "free_shared", "merge_order",
]  # fmt: skip


# A ring owner's tree over storages: ("x",) its own chunk of the caller's tensor, ("s", i) the
# receive slot of rank i's partial, ("a", k) an accumulator. Steps: ("add", dst, src) means
# dst = dst + src; ("load", dst, src) means dst = convert(src) (only when compressing).
_Storage = tuple


def _owner_program(n: int, own: int, slots_writable: bool) -> tuple[list[tuple], int]:
    """The merges of :func:`merge_order` placed on the owner's storages, and how many
    accumulators they need. A merge writes into an operand's storage (the own chunk whenever
    it is an operand, so the result ends there); compressed slots hold the wire type and
    cannot take an F32 sum, so two of them meet in a fresh accumulator."""
    store: dict[int, _Storage] = {i: ("x",) if i == own else ("s", i) for i in range(n)}

    def writable(s: _Storage) -> bool:
        return s[0] != "s" or slots_writable

    prog: list[tuple] = []
    n_acc = 0
    for a, b in merge_order(n):
        sa, sb = store[a], store[b]
        if sb == ("x",) or (not writable(sa) and writable(sb)):
            prog.append(("add", sb, sa))  # fl(b + a) == fl(a + b)
            store[a] = sb
        elif writable(sa):
            prog.append(("add", sa, sb))
        else:
            acc = ("a", n_acc)
            n_acc += 1
            prog += [("load", acc, sa), ("add", acc, sb)]
            store[a] = acc
    assert store[0] == ("x",)
    return prog, n_acc


# --- schedules ---------------------------------------------------------------------------------
@dataclass(slots=True)
class _Copy:
    src: int
    dst: int
    s: Tensor
    d: Tensor


@dataclass(slots=True)
class _Compute:
    rank: int
    graph: Graph


@dataclass(slots=True)
class _Barrier:
    edges: tuple[tuple[int, int], ...]  # (waiter, signaler)


_Op = _Copy | _Compute | _Barrier


@dataclass
class _Binding:
    """The issue list for one tuple of caller tensors (graphs bound to their memory)."""

    ops: list[_Op]
    sent: list[int]  # bytes each rank sends per call


def _exit_edges(ops: list[_Op]) -> _Barrier:
    return _Barrier(tuple(sorted({(o.src, o.dst) for o in ops if isinstance(o, _Copy)})))


def _place_like(node: Tensor, where: Tensor) -> Tensor:
    """Compute ``node`` in place over ``where``'s memory (ggml's *_inplace)."""
    assert where.buffer is not None
    where.buffer.place(node, where.offs)
    return node


def _bind_view(node: Tensor) -> Tensor:
    src = node.view_src
    if src is not None and src.buffer is not None:
        src.buffer.init_view(node)
    return node


def _alias(t: Tensor, type_: GGMLType, start: int, n: int, name: str) -> Tensor:
    """A 1-D leaf over elements [start, start+n) of contiguous tensor ``t``'s memory. A leaf,
    not a VIEW node: a graph built on it must not pull in the graph that produced ``t``."""
    assert t.buffer is not None
    a = Tensor(type_, (n,), name=name)
    t.buffer.place(a, t.offs + start * t.nb[0])
    return a


class _Plan:
    """Scratch of one (algorithm, type, elements, wire type) on the group's devices."""

    def __init__(self, backends: list[Backend], algorithm: str, type_: GGMLType, nel: int,
                 wire: GGMLType | None) -> None:  # fmt: skip
        self.algorithm = algorithm
        self.type = type_
        self.nel = nel
        self.wire = wire
        self.buffers: list[Buffer] = []
        self.bindings: OrderedDict[tuple, _Binding] = OrderedDict()
        n = len(backends)
        self.n = n
        xfer = wire or type_  # what travels
        ctxs = [Context(f"allreduce-scratch{r}") for r in range(n)]
        # compressed partials, one wire image of the whole tensor per rank
        self.comp = [ctxs[r].new_tensor_ne(wire, nel, name=f"ar.c{r}") for r in range(n)] if wire else []
        if algorithm == "butterfly":
            p = pow2_floor(n)
            self.fold = {i: ctxs[i].new_tensor_ne(xfer, nel, name=f"ar.fold{i}") for i in range(n - p)}
            # one receive tensor per level, so a level's copy never overwrites what the
            # previous level's ADD may still be reading (ggml keeps n_reduce_steps buffers)
            self.level: list[list[Tensor]] = []
            d = 1
            while d < p:
                self.level.append([ctxs[r].new_tensor_ne(xfer, nel, name=f"ar.l{d}.{r}") for r in range(p)])
                d *= 2
        else:
            self.chunks = _chunks(nel, n)
            # slots[c][i]: owner c's receive slot for rank i's partial of chunk c
            self.slots: list[dict[int, Tensor]] = []
            self.accs: list[list[Tensor]] = []
            self.programs: list[list[tuple]] = []
            for c, (_, ln) in enumerate(self.chunks):
                if ln == 0:
                    self.slots.append({})
                    self.accs.append([])
                    self.programs.append([])
                    continue
                sl = {i: ctxs[c].new_tensor_ne(xfer, ln, name=f"ar.s{c}.{i}") for i in range(n) if i != c}
                prog, n_acc = _owner_program(n, c, slots_writable=wire is None)
                self.slots.append(sl)
                self.accs.append([ctxs[c].new_tensor_ne(type_, ln, name=f"ar.a{c}.{k}")
                                  for k in range(n_acc)])  # fmt: skip
                self.programs.append(prog)
        try:
            for b, ctx in zip(backends, ctxs, strict=True):
                buf = alloc_ctx_tensors(ctx, b.device.buffer_type, BufferUsage.COMPUTE)
                if buf is not None:
                    self.buffers.append(buf)
        except BaseException:
            self.free()
            raise

    def free(self) -> None:
        for b in self.buffers:
            b.free()
        self.buffers = []
        self.bindings.clear()

    # --- binding: the issue list over one tuple of tensors -------------------------------------
    def bind(self, tensors: Sequence[Tensor]) -> _Binding:
        key = tuple((t.uid, t.buffer.uid, t.offs) for t in tensors)  # type: ignore[union-attr]
        bd = self.bindings.get(key)
        if bd is not None:
            self.bindings.move_to_end(key)
            return bd
        build = self._bind_butterfly if self.algorithm == "butterfly" else self._bind_ring
        ops = build(list(tensors))
        ops.append(_exit_edges(ops))
        sent = [0] * self.n
        for o in ops:
            if isinstance(o, _Copy):
                sent[o.src] += o.s.nbytes
        bd = _Binding(ops, sent)
        self.bindings[key] = bd
        if len(self.bindings) > MAX_BINDINGS:
            self.bindings.popitem(last=False)
        return bd

    def _bind_butterfly(self, tensors: list[Tensor]) -> list[_Op]:
        n, nel, ty, wire = self.n, self.nel, self.type, self.wire
        p = pow2_floor(n)
        ctx = Context("allreduce-butterfly")
        x = [_alias(t, ty, 0, nel, f"ar.x{r}") for r, t in enumerate(tensors)]
        ops: list[_Op] = []

        def add(r: int, acc: Tensor) -> _Compute:
            return _Compute(r, Graph([_place_like(ctx.add(x[r], acc), x[r])]))

        def compress(r: int, round_own: bool) -> _Compute:
            c = _bind_view(ctx.cpy(x[r], self.comp[r]))
            # rounding the own operand too makes both ends of an exchange add the same values
            out = _bind_view(ctx.cpy(c, x[r])) if round_own else c
            return _Compute(r, Graph([out]))

        send = self.comp if wire else x
        # 1. fold the ranks above P into the first n - P
        if wire:
            ops += [compress(j, round_own=False) for j in range(p, n)]
        ops += [_Copy(j, j - p, send[j], self.fold[j - p]) for j in range(p, n)]
        ops += [add(i, self.fold[i]) for i in range(n - p)]
        # 2. recursive doubling among the first P
        for lvl, recv in enumerate(self.level):
            d = 1 << lvl
            if wire:
                ops += [compress(r, round_own=True) for r in range(p)]
            ops += [_Copy(r ^ d, r, send[r ^ d], recv[r]) for r in range(p)]
            # r's ADD overwrites x[r] (compressed: r's next conversion overwrites comp[r]),
            # which r ^ d's copy reads: wait until that copy is done
            ops.append(_Barrier(tuple((r, r ^ d) for r in range(p))))
            ops += [add(r, recv[r]) for r in range(p)]
        # 3. the folded ranks get the result back
        ops += [_Copy(j - p, j, x[j - p], x[j]) for j in range(p, n)]
        return ops

    def _bind_ring(self, tensors: list[Tensor]) -> list[_Op]:
        n, ty, wire, chunks = self.n, self.type, self.wire, self.chunks
        ctx = Context("allreduce-ring")
        live = [c for c, (_, ln) in enumerate(chunks) if ln]
        # xc[r][c]: chunk c of rank r's tensor; wc[r][c]: chunk c of rank r's wire image
        xc = [{c: _alias(t, ty, chunks[c][0], chunks[c][1], f"ar.x{r}.{c}") for c in live}
              for r, t in enumerate(tensors)]  # fmt: skip
        ops: list[_Op] = []
        if wire:
            xs = [_alias(t, ty, 0, self.nel, f"ar.x{r}") for r, t in enumerate(tensors)]
            wc = [{c: _alias(self.comp[r], wire, chunks[c][0], chunks[c][1], f"ar.w{r}.{c}") for c in live}
                  for r in range(n)]  # fmt: skip
            ops += [_Compute(r, Graph([_bind_view(ctx.cpy(xs[r], self.comp[r]))])) for r in range(n)]
        send = wc if wire else xc
        # reduce-scatter: the owner of chunk c receives the n-1 other partials of it. Nothing
        # here overwrites a tensor a copy reads (owners write only their own chunk), so the
        # phase needs no barrier.
        ops += [_Copy(r, c, send[r][c], self.slots[c][r]) for c in live for r in range(n) if r != c]
        for c in live:
            stores: dict[_Storage, Tensor] = {("x",): xc[c][c]}
            stores.update({("s", i): s for i, s in self.slots[c].items()})
            stores.update({("a", k): a for k, a in enumerate(self.accs[c])})
            cur = dict(stores)  # storage -> the node whose value it holds now
            for kind, dst, src in self.programs[c]:
                if kind == "load":
                    cur[dst] = _bind_view(ctx.cpy(cur[src], stores[dst]))
                else:
                    cur[dst] = _place_like(ctx.add(cur[dst], cur[src]), stores[dst])
            root = cur[("x",)]
            if wire:  # the owner sends its result rounded to the wire type, and keeps the same
                root = _bind_view(ctx.cpy(root, wc[c][c]))
            ops.append(_Compute(c, Graph([root])))
        # all-gather: the owner's reduced chunk to everybody else
        ops += [_Copy(c, r, send[c][c], send[r][c]) for c in live for r in range(n) if r != c]
        if wire:
            ops += [_Compute(r, Graph([_bind_view(ctx.cpy(self.comp[r], xs[r]))])) for r in range(n)]
        return ops


def _chunks(nel: int, n: int) -> list[tuple[int, int]]:
    """(start, length) of chunk c for c < n: near-equal, CHUNK_ALIGN-aligned, the last ones
    possibly empty when there are few elements."""
    step = -(-nel // n)
    step = -(-step // CHUNK_ALIGN) * CHUNK_ALIGN
    return [(min(c * step, nel), max(0, min(step, nel - c * step))) for c in range(n)]


# --- the public object -----------------------------------------------------------------------------
class AllReduce:
    """In-place sum over ``backends`` (rank i = ``backends[i]``), reusable across calls.

    ``algorithm``: "auto" | "plugin" | "butterfly" | "ring" (module docstring).
    ``compress``: None | "f16" | "bf16": the wire type of the SDK fallbacks for F32 tensors of
    at least ``compress_threshold`` bytes (default :func:`compress_threshold_default`).

    Scratch buffers and graphs are cached per tensor layout (and graphs per tuple of tensors,
    the last :data:`MAX_BINDINGS`), until :meth:`free`. An instance is not thread-safe; the
    plugin communicator, if any, is opened on first use.
    """

    def __init__(self, backends: Sequence[Backend], algorithm: str = "auto", compress: str | None = None,
                 compress_threshold: int | None = None) -> None:  # fmt: skip
        backends = list(backends)
        if len(backends) < 2:
            raise DeviceError(f"all-reduce needs at least 2 backends, got {len(backends)}")
        for b in backends:
            if not isinstance(b, Backend):
                raise DeviceError(f"all-reduce: {b!r} is not a Backend")
            b._check()
        if algorithm not in ALGORITHMS:
            raise UnsupportedOpError(f"all-reduce algorithm {algorithm!r} is unknown (one of {ALGORITHMS})")
        if compress is not None and compress not in WIRE_TYPES:
            raise TypeMismatchError(f"all-reduce compress={compress!r}: one of None, 'f16', 'bf16'")
        self.backends = backends
        self.algorithm = algorithm
        self.compress = compress
        self.compress_threshold = (
            compress_threshold_default() if compress_threshold is None else int(compress_threshold)
        )
        self.freed = False
        self.last_algorithm: str | None = None  # what served the last call
        self.last_sent: list[int] = [0] * len(backends)  # bytes each rank sent in the last fallback
        self._plans: dict[tuple, _Plan] = {}
        self._events: list[Event] | None = None
        self._comm: Comm | None = None
        self._comm_tried = False
        # what _validate accepted: the check depends only on these, so a decode step that
        # all-reduces the same tensors every token validates them once
        self._valid: set[tuple] = set()

    def __repr__(self) -> str:
        names = ",".join(b.name for b in self.backends)
        return f"AllReduce({names}; {self.algorithm}, compress={self.compress})"

    def __enter__(self) -> AllReduce:
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    @property
    def comm(self) -> Comm | None:
        """The plugin's communicator over these backends, or None (opened on first use)."""
        if not self._comm_tried:
            self._comm_tried = True
            self._comm = Comm.init(self.backends)
        return self._comm

    def __call__(self, tensors: Sequence[Tensor]) -> str:
        """Queue the sum of ``tensors`` into every one of them; returns the algorithm that
        served the call ("plugin", "butterfly" or "ring"). Raises before queuing anything
        on bad input (typed accelplane.errors)."""
        if self.freed:
            raise DeviceError(f"{self!r} used after free")
        tensors = list(tensors)
        key = tuple((getattr(t.buffer, "uid", None), t.offs, t.type, t.ne, t.nb) for t in tensors)
        stale = any(t.buffer is None or t.buffer.freed for t in tensors)
        stale = stale or any(b.freed for b in self.backends)
        if stale or key not in self._valid:
            self._validate(tensors)
            if len(self._valid) > 4096:  # a bound, for callers that never repeat
                self._valid.clear()
            self._valid.add(key)
        used = self._run(tensors)
        self.last_algorithm = used
        return used

    def _run(self, tensors: list[Tensor]) -> str:
        algo = self.algorithm
        if algo in ("auto", "plugin"):
            comm = self.comm
            if comm is not None and comm.allreduce(tensors):
                return "plugin"
            if algo == "plugin":
                why = "has no communicator" if comm is None else "declined the call"
                raise UnsupportedOpError(
                    f"all-reduce algorithm 'plugin': the plugin of {self.backends[0].device.name} {why}"
                )
            algo = "butterfly"
        ref = tensors[0]
        if ref.nelements == 0:
            return algo
        wire = None
        if self.compress and ref.type == T.F32 and ref.nbytes >= self.compress_threshold:
            wire = WIRE_TYPES[self.compress]
        key = (algo, ref.type, ref.nelements, wire)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(self.backends, algo, ref.type, ref.nelements, wire)
        bd = plan.bind(tensors)
        self._issue(bd.ops)
        self.last_sent = list(bd.sent)
        return algo

    def _issue(self, ops: list[_Op]) -> None:
        bks = self.backends
        if self._events is None:
            self._events = [Event(b.device) for b in bks]
        ev = self._events
        for o in ops:
            if isinstance(o, _Copy):
                tensor_copy_async(bks[o.src], bks[o.dst], o.s, o.d)
            elif isinstance(o, _Compute):
                bks[o.rank].graph_compute(o.graph)
            else:
                # record everything first, then wait: a wait refers to the generation recorded
                # most recently before it (rule 6), so one event per rank serves every barrier
                for s in sorted({s for _, s in o.edges}):
                    ev[s].record(bks[s])
                for w, s in o.edges:
                    if bks[w] is not bks[s]:
                        ev[s].wait(bks[w])

    def _validate(self, tensors: list[Tensor]) -> None:
        n = len(self.backends)
        if len(tensors) != n:
            raise ShapeError(f"all-reduce over {n} backends got {len(tensors)} tensors")
        ref = tensors[0]
        spans: dict[int, list[tuple[int, int, Tensor]]] = {}
        for i, (b, t) in enumerate(zip(self.backends, tensors, strict=True)):
            label = f"tensor {t.name or t.uid!r} (rank {i})"
            if t.type not in REDUCIBLE:
                raise TypeMismatchError(f"all-reduce: {label} is {t.type.name}; allowed: F32, F16, BF16")
            if t.type != ref.type:
                raise TypeMismatchError(f"all-reduce: {label} is {t.type.name}, rank 0's is {ref.type.name}")
            if t.ne != ref.ne:
                raise ShapeError(f"all-reduce: {label} has ne={list(t.ne)}, rank 0's ne={list(ref.ne)}")
            if not t.is_contiguous():
                raise ShapeError(f"all-reduce: {label} is not contiguous (nb={list(t.nb)})")
            b._check()
            buf = check_range(t, 0, t.nbytes)  # allocated, not freed
            if buf.device is not b.device:
                raise DeviceError(
                    f"all-reduce: {label} is in buffer {buf.name!r} of {buf.device.name}, "
                    f"not of its backend's device {b.device.name}"
                )
            for s0, s1, u in spans.get(buf.uid, []):
                if t.offs < s1 and s0 < t.offs + t.nbytes or t is u:
                    raise DeviceError(f"all-reduce: {label} overlaps tensor {u.name or u.uid!r}")
            spans.setdefault(buf.uid, []).append((t.offs, t.offs + t.nbytes, t))

    def free(self) -> None:
        """Wait for queued work that uses the scratch (host-blocking), then release the
        scratch buffers, events and the plugin communicator. Idempotent."""
        if self.freed:
            return
        self.freed = True
        if self._plans:
            for b in {id(b): b for b in self.backends}.values():
                if not b.freed:
                    b.synchronize()
        for p in self._plans.values():
            p.free()
        self._plans.clear()
        for e in self._events or []:
            e.free()
        self._events = None
        if self._comm is not None:
            self._comm.free()
            self._comm = None


# --- function form ---------------------------------------------------------------------------------
_shared: dict[tuple, AllReduce] = {}


def allreduce(backends: Sequence[Backend], tensors: Sequence[Tensor], algorithm: str = "auto",
              compress: str | None = None, compress_threshold: int | None = None) -> str:  # fmt: skip
    """Sum ``tensors`` (``tensors[i]`` on ``backends[i]``: F32/F16/BF16, same type and shape,
    contiguous, in a buffer of that backend's device) in place on every backend; queued on the
    backends' streams (docs/ordering.md rule 9). Returns the algorithm that served the call.

    Uses a process-wide :class:`AllReduce` per (backends, algorithm, compress, threshold);
    :func:`free_shared` releases them. See the module docstring for the algorithms."""
    threshold = compress_threshold_default() if compress_threshold is None else int(compress_threshold)
    key = (tuple(b.uid for b in backends), algorithm, compress, threshold)
    ar = _shared.get(key)
    if ar is not None and any(b.freed for b in ar.backends):
        _shared.pop(key).free()
        ar = None
    if ar is None:
        ar = AllReduce(backends, algorithm, compress, threshold)
        _shared[key] = ar
    return ar(tensors)


def free_shared(backends: Sequence[Backend] | None = None) -> None:
    """Free the cached objects of :func:`allreduce` (those over any of ``backends``, or all)."""
    uids = None if backends is None else {b.uid for b in backends}
    for key in list(_shared):
        if uids is None or uids & set(key[0]):
            _shared.pop(key).free()


# --- benchmark ---------------------------------------------------------------------------------------
@dataclass
class AllReduceBench:
    """One row of :func:`bench_allreduce`. ``busbw_gbps`` follows nccl-tests / ggml:
    2(n-1)/n × bytes / time; ``memcpy_gbps`` is a host numpy copy of the same bytes in the
    same run (the ratio is what compares across machines)."""

    algorithm: str  # requested
    used: str  # what served it ("" when it could not run)
    n: int
    type: str
    bytes: int
    runs: int
    us_per_call: float
    busbw_gbps: float
    memcpy_gbps: float
    note: str = field(default="")


def _timed(fn, min_time_s: float, max_runs: int) -> tuple[int, float]:
    """(runs, seconds per run) of fn(k) running k iterations, doubling k up to min_time_s."""
    k = 1
    while True:
        t0 = time.perf_counter()
        fn(k)
        dt = time.perf_counter() - t0
        if dt >= min_time_s or k >= max_runs:
            return k, dt / k
        k = min(max_runs, k * 2)


def bench_allreduce(backends: Sequence[Backend], sizes: Sequence[int],
                    algorithms: Sequence[str] = ("butterfly", "ring"), type_: GGMLType | str = T.F32,
                    compress: str | None = None, min_time_s: float = 0.05,
                    max_runs: int = 1000) -> list[AllReduceBench]:  # fmt: skip
    """All-reduce bus bandwidth per (size in bytes, algorithm) over ``backends``, beside a
    host memcpy of the same bytes. Each measurement queues k calls and synchronizes once.
    An algorithm the backends cannot run gives a row with ``used == ""`` and a note."""
    from accelplane.core.types import parse_type

    ty = parse_type(type_)
    es = np.dtype(np_dtype(ty)).itemsize
    rows: list[AllReduceBench] = []
    for size in sizes:
        nel = max(1, int(size) // es)
        ctxs = [Context(f"bench-ar{r}") for r in range(len(backends))]
        ts = [ctx.new_tensor_ne(ty, nel, name=f"bench.ar{r}") for r, ctx in enumerate(ctxs)]
        bufs = [alloc_ctx_tensors(c, b.device.buffer_type, BufferUsage.COMPUTE)
                for c, b in zip(ctxs, backends, strict=True)]  # fmt: skip
        try:
            for t in ts:  # zeros: repeated in-place sums of anything else grow to inf
                t.set(np.zeros(nel, np.float32))
            rows += _bench_size(list(backends), ts, algorithms, compress, min_time_s, max_runs)
        finally:
            for b in backends:
                b.synchronize()
            for buf in bufs:
                if buf is not None:
                    buf.free()
    return rows


def _bench_size(backends: list[Backend], ts: list[Tensor], algorithms: Sequence[str],
                compress: str | None, min_time_s: float, max_runs: int) -> list[AllReduceBench]:  # fmt: skip
    n, nbytes, ty = len(backends), ts[0].nbytes, ts[0].type
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)

    def memcpy(k: int) -> None:
        for _ in range(k):
            np.copyto(dst, src)

    _, sec = _timed(memcpy, min_time_s, max_runs)
    memcpy_gbps = nbytes / sec / 1e9
    rows = []
    for algo in algorithms:
        ar = AllReduce(backends, algo, compress, compress_threshold=0 if compress else None)

        def run(k: int, ar: AllReduce = ar) -> None:
            for _ in range(k):
                ar(ts)
            for b in backends:
                b.synchronize()

        try:
            try:
                used = ar(ts)  # warm-up: scratch, graphs, the plugins' plans
                run(0)
            except UnsupportedOpError as e:
                nan = float("nan")
                rows.append(AllReduceBench(algo, "", n, ty.name, nbytes, 0, nan, nan, memcpy_gbps, str(e)))
                continue
            runs, sec = _timed(run, min_time_s, max_runs)
            busbw = 2 * (n - 1) / n * nbytes / sec / 1e9
            rows.append(AllReduceBench(algo, used, n, ty.name, nbytes, runs, sec * 1e6, busbw, memcpy_gbps))
        finally:
            ar.free()
    return rows
