"""Tensor parallelism: the meta device (ggml-backend-meta.cpp, llama.cpp's ``-sm tensor``).

A :class:`MetaDevice` runs one graph over N devices (any plugins, mixed, the same device
several times, or devices of several processes through :mod:`accelplane.parallel.mpi`). Every tensor
has a :class:`SplitState`: sliced along one ggml axis (``AXIS_0..3``, possibly segmented),
``MIRRORED`` (a full copy on every device) or ``PARTIAL`` (every device holds a term of a sum).

Host API
--------
::

    meta = MetaDevice([dev0, dev1], split_state=fn)    # fn(tensor) -> SplitState | None
    wbuf = meta.alloc_weights(weight_ctx)              # one shard per device (fn decides)
    w.set(array)                                       # scatter; w.get() gathers
    meta.alloc_graph(graph); x.set(inputs)             # inputs: mirrored unless fn says
    meta.compute(graph); out.get()                     # gather (or device 0's copy)

``fn`` is the model's callback for statically allocated tensors (weights, KV cache) and graph
inputs, like ``ggml_backend_meta_get_split_state_t``; ``None`` means MIRRORED. :meth:`MetaDevice.split`
builds states (even or ``tensor_split``-weighted, with a granularity such as a whole head, and
segments for fused tensors: QKV = ``segments=[(n_q, 1), (n_kv, 2)]``). The states of computed
tensors are derived per op (:meth:`MetaDevice.describe` lists them):

=========================================  =============================================
elementwise / broadcast (ADD, MUL, SCALE…)  operands agree; a mirrored operand is sliced
per row (RMS_NORM, SOFT_MAX, ARGMAX, …)      any state but AXIS_0 (a split GLU pairs halves)
ROPE                                         heads or tokens split; positions, freq factors mirrored
VIEW, RESHAPE, PERMUTE, TRANSPOSE            the split follows the axis (heads, fused parts)
GET_ROWS                                     a table split on AXIS_0 (embedding columns)
SET_ROWS, CPY                                destination split on AXIS_0, 2 or 3, not its rows
MUL_MAT, MUL_MAT_ID                          weight AXIS_1 × mirrored → AXIS_0 (column
                                             parallel); AXIS_0 × AXIS_0 → PARTIAL (row
                                             parallel); heads × heads (batched) → heads
linear ops of PARTIAL (ADD of two, MUL by    stay PARTIAL: the all-reduce is delayed to the
a mirrored value, SCALE, views, SUM…)        first consumer that needs the sum
=========================================  =============================================

Anything else gets its split operands gathered (an all-reduce of zero-padded copies, so it
runs through the same comm) and runs mirrored: correct, only slower. Writes (CPY/SET_ROWS)
into a destination whose split the op cannot follow raise :class:`UnsupportedOpError`.

Host data: ``set`` and ``get`` of a logical tensor always address the shards the graph reads
it from. A split tensor scatters into and gathers from its slices; a MIRRORED one writes every
copy and reads device 0's. ``set`` of a PARTIAL tensor takes the full value and stores it on
device 0 with zeros on the others, so the shards sum to it exactly; ``get`` returns the sum of
the shards, and ``meta.shards(t)[j].set(...)`` gives device j its own term. Where a consumer of
a PARTIAL input needs its sum, the plan all-reduces a copy of the shards at every compute: the
copy is the plan's, derived from the shards, never what the host reads or writes, and an op
that writes into the input (CPY, SET_ROWS) raises :class:`UnsupportedOpError`, as any write
into a PARTIAL tensor does. Outputs that end PARTIAL are summed before they leave.

Execution: each device computes its shard of every node; the per-device graphs are cut at
every point where a PARTIAL value must become whole, and there :mod:`accelplane.parallel.comm` sums
the devices' tensors in place (the plugin's comm, else butterfly or ring); with an MPI group
the local sum is then summed across processes through host memory. Because the cut waits for
the first consumer that needs the sum, ggml's MoE delay (the all-reduce after the weighted sum
of the experts, not per expert) falls out of the rules.

Recording: a decode step is the same sequence of subgraphs and all-reduces every token. From a
plan's second compute on, when every backend can record (``hookspecs.record_begin``) and every
all-reduce went through the plugins' communicator, the sequence is recorded once per backend and
each later compute is one ``record_replay`` per backend (the CUDA plugin: one CUDA graph per GPU,
all-reduces included). A backend that cannot record, a recording that fails, an SDK fallback
all-reduce, a process group, or ``ACCELPLANE_META_RECORD=0`` leave the steps submitted one by one;
``stats.record_error`` says which.

Why an executor and not a plugin
--------------------------------
ggml makes the meta device a backend with meta buffers whose tensors hold per-device "simple
tensors" that graph_compute maps node by node. Here the meta device clones the graph per device
with sharded shapes instead: a shard of a weight is a real tensor in a real buffer of its
device, each device's subgraph is an ordinary graph that its plugin computes (and caches)
unchanged, the graph allocator reuses memory per device as usual, and plugins never see a meta
tensor. The logical tensors the host built are bound to a :class:`MetaBuffer` whose set/get
scatter and gather. The cost: a meta device is not one backend among others in a
:class:`~accelplane.sched.Scheduler` (no CPU + meta hybrid): every op of the graph runs on the
meta device's devices, and every input lives on all of them (in its split state).

Zero-sized slices (more devices than heads) work: the device's attention shards are empty, its
contribution to a row-parallel product is zeros. ``ACCELPLANE_META_DEBUG=1`` prints each
graph's nodes with their split states when it is planned.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np

from accelplane import env
from accelplane.core.graph import Context, Graph
from accelplane.core.ops import VIEW_OPS, Op, op_desc
from accelplane.core.tensor import Tensor, TensorFlag, owners_to_keep, strided_view
from accelplane.core.types import TRAITS, GGMLType, np_dtype
from accelplane.errors import DeviceError, ShapeError, UnsupportedOpError
from accelplane.parallel.comm import REDUCIBLE, AllReduce
from accelplane.runtime.alloc import GraphAllocator, alloc_tensors
from accelplane.runtime.backend import Backend, Buffer, BufferUsage, CompositeBuffer, Device
from accelplane.sched import GraphRunner

if TYPE_CHECKING:
    from accelplane.parallel.mpi import ProcessGroup

MAX_DEVICES = 64

__all__ = [
    "MetaBuffer", "MetaDevice", "MetaStats", "Segment", "SplitAxis", "SplitFn", "SplitState",
    "split_sizes",
]  # fmt: skip


# --- split states ------------------------------------------------------------------------------------
class SplitAxis(IntEnum):
    """ggml_backend_meta_split_axis."""

    AXIS_0 = 0
    AXIS_1 = 1
    AXIS_2 = 2
    AXIS_3 = 3
    MIRRORED = 10
    PARTIAL = 11


M_ = SplitAxis.MIRRORED
P_ = SplitAxis.PARTIAL


@dataclass(frozen=True)
class Segment:
    """``sizes[j]``: elements device j holds of one round; the round repeats ``repeat`` times."""

    sizes: tuple[int, ...]
    repeat: int = 1


Block = tuple[int, int]  # (device, length) along the split axis, in order


def _norm(blocks: Iterable[Block]) -> list[Block]:
    """Drop empty blocks and merge neighbours of one device (same ownership, same order)."""
    out: list[Block] = []
    for d, n in blocks:
        if n <= 0:
            continue
        if out and out[-1][0] == d:
            out[-1] = (d, out[-1][1] + n)
        else:
            out.append((d, n))
    return out


def _parse(blocks: list[Block], n: int) -> tuple[Segment, ...]:
    """Segments of a block sequence: a round is a run of blocks of increasing device index;
    equal consecutive rounds merge into one segment."""
    rounds: list[tuple[int, ...]] = []
    cur = [0] * n
    last = -1
    for d, ln in blocks:
        if d <= last:
            rounds.append(tuple(cur))
            cur = [0] * n
        cur[d] = ln
        last = d
    if last >= 0:
        rounds.append(tuple(cur))
    if not rounds:
        return (Segment((0,) * n, 1),)
    segs: list[Segment] = []
    for r in rounds:
        if segs and segs[-1].sizes == r:
            segs[-1] = Segment(r, segs[-1].repeat + 1)
        else:
            segs.append(Segment(r, 1))
    return tuple(segs)


def _cut(blocks: list[Block], period: int) -> list[list[Block]] | None:
    """The block sequence cut into pieces of ``period`` elements each (None if it does not
    divide the total)."""
    total = sum(n for _, n in blocks)
    if period <= 0 or total % period:
        return None
    pieces: list[list[Block]] = [[]]
    room = period
    for d, n in blocks:
        while n > 0:
            if room == 0:
                pieces.append([])
                room = period
            take = min(n, room)
            pieces[-1].append((d, take))
            n -= take
            room -= take
    return [_norm(p) for p in pieces]


@dataclass(frozen=True)
class SplitState:
    """How a tensor is spread over the devices (ggml_backend_meta_split_state).

    ``axis``: a ggml axis (0 = innermost) for a split, else MIRRORED or PARTIAL. Along a split
    axis the data order is ggml's: for each segment, ``repeat`` rounds, each round device 0's
    ``sizes[0]`` elements, then device 1's, …; a device's shard is its pieces in that order.
    States are canonical (equal rounds merged), so two states with the same layout compare
    equal.
    """

    axis: SplitAxis
    segments: tuple[Segment, ...] = ()

    def __post_init__(self) -> None:
        axis = SplitAxis(self.axis)
        object.__setattr__(self, "axis", axis)
        if axis in (M_, P_):
            if self.segments:
                raise ShapeError(f"split state {axis.name} takes no segments")
            return
        segs = tuple(s if isinstance(s, Segment) else Segment(*s) for s in self.segments)
        if not segs:
            raise ShapeError(f"split state {axis.name}: needs at least one segment")
        n = len(segs[0].sizes)
        for s in segs:
            if len(s.sizes) != n or not 1 <= n <= MAX_DEVICES:
                raise ShapeError(f"split state {axis.name}: segments give sizes for different "
                                 f"device counts ({[len(x.sizes) for x in segs]})")  # fmt: skip
            if s.repeat < 1 or any(int(x) != x or x < 0 for x in s.sizes):
                raise ShapeError(f"split state {axis.name}: bad segment {s} (sizes >= 0, repeat >= 1)")
        blocks = [(d, int(x)) for s in segs for _ in range(s.repeat) for d, x in enumerate(s.sizes)]
        object.__setattr__(self, "segments", _parse(_norm(blocks), n))

    # --- constructors
    @classmethod
    def mirrored(cls) -> SplitState:
        return cls(M_)

    @classmethod
    def partial(cls) -> SplitState:
        return cls(P_)

    @classmethod
    def split(cls, axis: int, sizes: Sequence[int]) -> SplitState:
        """``sizes[j]`` elements of ggml axis ``axis`` on device j, in device order."""
        return cls(SplitAxis(axis), (Segment(tuple(int(x) for x in sizes)),))

    @classmethod
    def segmented(cls, axis: int, segments: Sequence[tuple[Sequence[int], int]]) -> SplitState:
        """Fused tensors: ``[(sizes, repeat), …]``, e.g. QKV = ``[(q_sizes, 1), (kv_sizes, 2)]``."""
        return cls(SplitAxis(axis), tuple(Segment(tuple(int(x) for x in s), int(r)) for s, r in segments))

    # --- facts
    @property
    def is_split(self) -> bool:
        return self.axis < 4

    @property
    def n(self) -> int | None:
        """Devices the sizes are given for (None for MIRRORED/PARTIAL)."""
        return len(self.segments[0].sizes) if self.segments else None

    @property
    def length(self) -> int:
        """Elements along the split axis (0 for MIRRORED/PARTIAL)."""
        return sum(sum(s.sizes) * s.repeat for s in self.segments)

    def local(self, j: int) -> int:
        """Elements of the split axis that device j holds."""
        return sum(s.sizes[j] * s.repeat for s in self.segments)

    def blocks(self) -> list[Block]:
        """(device, length) pieces along the axis in data order (empty pieces left out)."""
        return _norm((d, x) for s in self.segments for _ in range(s.repeat) for d, x in enumerate(s.sizes))

    def local_blocks(self, j: int) -> list[tuple[int, int, int]]:
        """Device j's pieces: (start along the axis, start in its shard, length)."""
        out, pos, loc = [], 0, 0
        for d, ln in self.blocks():
            if d == j:
                out.append((pos, loc, ln))
                loc += ln
            pos += ln
        return out

    def with_axis(self, axis: int) -> SplitState:
        return SplitState(SplitAxis(axis), self.segments)

    def scaled(self, num: int, den: int = 1) -> SplitState | None:
        """Every size × num / den (None when a size does not divide)."""
        segs = []
        for s in self.segments:
            if any(x * num % den for x in s.sizes):
                return None
            segs.append(Segment(tuple(x * num // den for x in s.sizes), s.repeat))
        return SplitState(self.axis, tuple(segs))

    def __str__(self) -> str:
        if not self.is_split:
            return self.axis.name
        parts = [",".join(map(str, s.sizes)) + (f"x{s.repeat}" if s.repeat > 1 else "")
                 for s in self.segments]  # fmt: skip
        return f"{self.axis.name}[{' | '.join(parts)}]"


MIRRORED = SplitState.mirrored()
PARTIAL = SplitState.partial()
SplitFn = Callable[[Tensor], "SplitState | None"]


def split_sizes(length: int, n: int, granularity: int = 1,
                weights: Sequence[float] | None = None) -> tuple[int, ...]:  # fmt: skip
    """``length`` elements over ``n`` devices in whole granules, proportional to ``weights``
    (default even) by a cumulative scan rounded up, so earlier devices take the remainder:
    ``split_sizes(4, 3) == (2, 1, 1)``; ``split_sizes(2, 3) == (1, 1, 0)``."""
    if granularity < 1 or length < 0 or length % granularity:
        raise ShapeError(f"split: {length} elements are not a whole number of granules of {granularity}")
    w = [float(x) for x in (weights or [1.0] * n)]
    if len(w) != n or any(x < 0 for x in w) or sum(w) <= 0:
        raise ShapeError(f"split: weights {list(w)} must be {n} non-negative numbers, not all 0")
    units, total = length // granularity, sum(w)
    bounds, cum = [], 0.0
    for x in w[:-1]:
        cum += x
        bounds.append(min(units, math.ceil(units * cum / total - 1e-9)))
    bounds.append(units)
    prev, out = 0, []
    for b in bounds:
        b = max(b, prev)
        out.append((b - prev) * granularity)
        prev = b
    return tuple(out)


# --- layout maps (reshape and views of split tensors) -------------------------------------------------
def _prod(xs: Iterable[int]) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def _reshape_state(st: SplitState, ne: Sequence[int], ne2: Sequence[int]) -> SplitState | None:
    """The split of a contiguous tensor of ``ne`` seen as ``ne2`` (same elements in the same
    order), or None when it is not a split along one axis of ``ne2``. A device's shard keeps
    its elements in global order, so only the ownership of flat positions has to agree."""
    k = st.axis
    inner = _prod(ne[:k])
    period = inner * ne[k]
    flat = [(d, ln * inner) for d, ln in st.blocks()]
    n = st.n or 1
    for k2 in sorted(range(4), key=lambda a: ne2[a] == 1):
        inner2 = _prod(ne2[:k2])
        period2 = inner2 * ne2[k2]
        if period2 % period == 0:
            pat = _norm(flat * (period2 // period))
        elif period % period2 == 0:
            pieces = _cut(flat, period2)
            if pieces is None or any(p != pieces[0] for p in pieces):
                continue
            pat = pieces[0]
        else:
            continue
        if any(ln % inner2 for _, ln in pat):
            continue
        return SplitState(SplitAxis(k2), _parse([(d, ln // inner2) for d, ln in pat], n))
    return None


def _units_per(t: Tensor, axis: int) -> int:
    """Elements per stride step along ``axis`` (a block for axis 0 of a quantized type)."""
    return TRAITS[t.type].blck_size if axis == 0 else 1


def _coords(x: int, t: Tensor) -> list[int] | None:
    """Element coordinates c of byte offset x in t (x == sum c[d] * nb[d]), largest strides
    first; None when x is not such a sum."""
    c = [0, 0, 0, 0]
    for d in sorted((d for d in range(4) if t.ne[d] > 1), key=lambda d: -t.nb[d]):
        q, x = divmod(x, t.nb[d])
        c[d] = q * _units_per(t, d)
    return c if x == 0 else None


@dataclass
class _ViewMap:
    state: SplitState
    ne: list[tuple[int, ...]]  # per device (global index order of the meta device's local devices)
    nb: list[tuple[int, ...]]
    offs: list[int]


def _view_map(src: Tensor, st: SplitState, ne: Sequence[int], nb: Sequence[int], offs: int,
              shards: Sequence[Tensor], first: int) -> _ViewMap | None:  # fmt: skip
    """Map a VIEW (ne, nb, offs) of split tensor ``src`` onto its shards: the view's split axis
    is the view axis with the coarsest step along src's split axis; finer view axes must stay
    inside one such step and device boundaries must fall on steps. None when not so."""
    k = st.axis
    o = _coords(offs, src)
    if o is None:
        return None
    step: dict[int, tuple[int, int]] = {}  # view axis -> (src axis, multiplier)
    for e in range(4):
        if ne[e] <= 1 or nb[e] == 0:
            continue
        c = _coords(nb[e], src)
        if c is None or sum(1 for x in c if x) != 1:
            return None
        a = next(i for i in range(4) if c[i])
        step[e] = (a, c[a])
    for a in range(4):  # the view stays inside src along every axis
        if o[a] + sum((ne[e] - 1) * m for e, (aa, m) in step.items() if aa == a) >= max(src.ne[a], 1):
            return None
    on_k = [(m, e) for e, (a, m) in step.items() if a == k]
    if not on_k:
        return None
    m, es = max(on_k)
    if sum((ne[e] - 1) * mm for mm, e in on_k if e != es) >= m:
        return None
    lo, hi = o[k], o[k] + ne[es] * m
    if hi > src.ne[k]:
        return None
    sel: list[Block] = []
    pos = 0
    before = [0] * (st.n or 1)
    for d, ln in st.blocks():
        s0, s1 = max(pos, lo), min(pos + ln, hi)
        before[d] += max(0, min(pos + ln, lo) - pos)
        if s0 < s1:
            if (s0 - lo) % m or (s1 - lo) % m:
                return None
            sel.append((d, (s1 - s0) // m))
        pos += ln
    state = SplitState(SplitAxis(es), _parse(_norm(sel), st.n or 1))
    vm = _ViewMap(state, [], [], [])
    for jl, sh in enumerate(shards):
        j = first + jl
        ne_j = list(ne)
        ne_j[es] = state.local(j)
        nb_j = list(nb)
        for e, (a, mm) in step.items():
            nb_j[e] = mm // _units_per(sh, a) * sh.nb[a]
        oc = list(o)
        oc[k] = before[j]
        vm.ne.append(tuple(ne_j))
        vm.nb.append(tuple(nb_j))
        vm.offs.append(sum(oc[a] // _units_per(sh, a) * sh.nb[a] for a in range(4)))
    return vm


# --- values of the planner ----------------------------------------------------------------------------
@dataclass(eq=False)
class _Val:
    """A logical tensor on the devices: its state and one tensor per local device (a shard;
    a tensor with no elements stands for an empty shard and is never computed)."""

    state: SplitState
    t: list[Tensor]
    writable: bool = True  # False for gathered or sliced copies: writes there would be lost
    mirror: _Val | None = None  # a gathered copy, made once


@dataclass
class _Compute:
    graphs: list[Graph | None]  # per local device


@dataclass
class _Reduce:
    tensors: list[Tensor]  # per local device, summed in place
    label: str


@dataclass
class MetaStats:
    """Counters of the last planned / computed graph."""

    plans: int = 0
    segments: int = 0  # per-device subgraphs between all-reduces
    allreduces: int = 0  # PARTIAL sums per compute
    gathers: int = 0  # split values made whole (all-reduces of zero-padded copies)
    reduce_bytes: int = 0  # bytes per device summed per compute
    computes: int = 0
    replays: int = 0  # computes that replayed the backends' recordings of the steps
    algorithms: dict[str, int] = field(default_factory=dict)  # comm algorithm -> calls, last compute
    record_error: str = ""  # why the last computed plan is not recorded ("" if it is or may be)


# --- the buffer of logical tensors ----------------------------------------------------------------------
class MetaBuffer(CompositeBuffer):
    """The buffer logical tensors of a meta device point at: set/get scatter to and gather from
    their shards (a logical view reads its owner's logical bytes). ``buffers`` are the real
    per-device buffers (weights), freed with this one.

    Under an MPI group, set and get of split or PARTIAL tensors are collective: every rank
    must call them in the same order."""

    def __init__(self, meta: MetaDevice, kind: str, parts: list[Buffer]) -> None:
        # no BufferType: a meta buffer is not memory of one device
        self.buft = None  # type: ignore[assignment]
        self._fn = {}
        self.meta = meta
        self.kind = kind  # "weights" | "graph"
        self.parts = parts
        self.size = sum(p.size for p in parts)
        self.usage = BufferUsage.WEIGHTS if kind == "weights" else BufferUsage.COMPUTE
        self.freed = False
        self.ctx = None
        from accelplane.runtime.backend import _ids

        self.uid = next(_ids)
        self.name = f"{meta.name}:{kind}#{self.uid}"
        self._host = None

    @property
    def is_host(self) -> bool:
        return False

    @property
    def device(self) -> Device:
        raise DeviceError(f"{self.name}: a meta buffer spans {self.meta.n} devices; use meta.shards(t)")

    def place(self, t: Tensor, offs: int) -> None:
        raise DeviceError(f"{self.name}: allocate meta tensors with MetaDevice.alloc_weights")

    def init_view(self, t: Tensor) -> None:
        t.buffer = self
        t.offs = t.view_src.offs + t.view_offs if t.view_src is not None else 0

    def _val(self, t: Tensor) -> tuple[Tensor, _Val]:
        owner = t.view_src if t.view_src is not None else t
        v = owner.extra
        if not isinstance(v, _Val) or owner.buffer is not self:
            raise DeviceError(f"tensor {t.name or t.uid!r} is not bound to {self.name}")
        return owner, v

    def set_tensor(self, t: Tensor, data: np.ndarray, offset: int, size: int) -> None:
        self._check()
        owner, v = self._val(t)
        start = t.offs - owner.offs + offset
        if start == 0 and size == owner.nbytes and v.state.axis is M_ and owner.is_contiguous():
            # a whole mirrored input (a decode step's tokens, positions, mask): the same bytes
            # to every copy, without the unit reshaping of the general path
            raw = np.ascontiguousarray(data[:size])
            for x in v.t:
                if x.nelements and x.is_contiguous():
                    x.set_bytes(raw)
                elif x.nelements:
                    _write_units(x, strided_view(owner, raw))
            return
        if start == 0 and size == owner.nbytes:
            img = data[:size]
        else:  # part of the tensor: read, patch, write back
            img = self.meta._gather_image(owner, v)
            img[start : start + size] = data[:size]
        self.meta._scatter_image(owner, v, img)

    def get_tensor(self, t: Tensor, out: np.ndarray, offset: int, size: int) -> None:
        self._check()
        owner, v = self._val(t)
        start = t.offs - owner.offs + offset
        out[:size] = self.meta._gather_image(owner, v)[start : start + size]

    def memset_tensor(self, t: Tensor, value: int, offset: int = 0, size: int | None = None) -> None:
        size = t.nbytes - offset if size is None else size
        self.set_tensor(t, np.full(size, value, np.uint8), offset, size)


# --- the planner: one logical graph -> per-device subgraphs and all-reduces ------------------------------
_LINEAR_UNARY = frozenset({Op.DUP, Op.CONT})
_ROWWISE = frozenset({Op.NORM, Op.RMS_NORM, Op.L2_NORM, Op.SOFT_MAX, Op.SUM_ROWS, Op.MEAN, Op.ARGMAX,
                      Op.ARGSORT})  # fmt: skip
_UNARY = frozenset({Op.DUP, Op.CONT, Op.SQR, Op.SQRT, Op.LOG, Op.SIN, Op.COS, Op.CLAMP, Op.LEAKY_RELU,
                    Op.UNARY, Op.SCALE})  # fmt: skip


def _label(t: Tensor) -> str:
    return t.name or f"#{t.uid}"


class _Plan:
    """Built once per graph: every node's state and per-device clones, the steps to run."""

    def __init__(self, meta: MetaDevice, graph: Graph) -> None:
        self.meta = meta
        self.graph = graph
        nl = meta.n_local
        self.ctxs = [Context(f"{meta.name}[{meta.first + j}]") for j in range(nl)]
        self.vals: dict[int, _Val] = {}  # each tensor's value as its consumers read it
        self.leaf_vals: dict[int, _Val] = {}  # each leaf's own shards, where the host sets it
        self.derived: dict[int, SplitState] = {}  # each tensor's state as computed (before any sum)
        self.steps: list[_Compute | _Reduce] = []
        self.cur: list[list[Tensor]] = [[] for _ in range(nl)]
        self.nodes: list[list[Tensor]] = [[] for _ in range(nl)]
        self.inputs: list[list[Tensor]] = [[] for _ in range(nl)]
        self.zeros: list[list[Tensor]] = [[] for _ in range(nl)]
        self.zero_bufs: list[Buffer] = []
        self.weights: tuple[int, ...] = ()
        self.n_reduce = self.n_gather = 0
        self.reduce_bytes = 0
        self.metabuf = MetaBuffer(meta, "graph", [])
        self._build()
        self.alloc_graphs = [Graph.from_nodes(self.nodes[j], self.inputs[j]) for j in range(nl)]
        self.alloc_keep = self._alloc_keep()
        self.layout: tuple[int, ...] = ()
        self.weights_seen = -1  # MetaDevice._weights_version when the weights were last compared
        self.runs = 0  # computes since planned or last moved (recording starts at the second)
        self.recordings: list | None = None  # one per backend: the steps, replayed as one call
        self.record_error = ""  # why this plan is not recorded, once that is known
        self.algorithms: dict[str, int] = {}  # all-reduce algorithm -> calls, last run

    def _alloc_keep(self) -> list[frozenset[int]]:
        """Per device, the memory its allocator keeps to the end of the graph: the current
        shards of every logical memory owner the host reads or writes (of every input and
        output; a logical view reads its owner's value, so a view output keeps the tensor it
        views). The allocator keeps flagged shards by itself, but a value the plan replaced
        (the all-reduce's copy of a PARTIAL output) is not flagged as its logical tensor is."""
        graph_tensors = list(self.graph.leafs) + list(self.graph.nodes)
        logical = owners_to_keep(graph_tensors)
        shards: list[list[Tensor]] = [[] for _ in range(self.meta.n_local)]
        for t in graph_tensors:
            if id(t) in logical:
                for j, x in enumerate(self.bound(t).t):
                    shards[j].append(x)
        return [owners_to_keep((), xs) for xs in shards]

    def bound(self, t: Tensor) -> _Val:
        """The value the host's set/get of logical ``t`` address: a leaf's own shards (what
        the graph reads it from, whatever the plan derives from them: the all-reduced copy of a
        PARTIAL input is the plan's, computed from the shards at every compute), a node's value
        at the end of the plan (a PARTIAL output's sum)."""
        return self.leaf_vals.get(id(t)) or self.vals[id(t)]

    # --- helpers
    def _v(self, t: Tensor | None) -> _Val | None:
        return None if t is None else self.vals[id(t)]

    def _local_ne(self, ne: Sequence[int], st: SplitState, j: int) -> tuple[int, int, int, int]:
        out = list(ne)
        if st.is_split:
            out[st.axis] = st.local(self.meta.first + j)
        return tuple(out)  # type: ignore[return-value]

    def _emit(self, j: int, t: Tensor) -> Tensor:
        if t.op is not None and t.nelements > 0:
            self.cur[j].append(t)
            self.nodes[j].append(t)
        return t

    def _close(self) -> None:
        if any(self.cur):
            self.steps.append(_Compute([Graph.from_nodes(c) if c else None for c in self.cur]))
        self.cur = [[] for _ in self.cur]

    def _zero_leaf(self, j: int, type_: GGMLType, ne: Sequence[int]) -> Tensor:
        z = Tensor(type_, tuple(ne), name="meta.zeros")
        self.zeros[j].append(z)
        return z

    def _zeros(self, j: int, type_: GGMLType, ne: Sequence[int]) -> Tensor:
        """A fresh node of zeros (the CONT of a zero leaf, so in-place writes stay local)."""
        return self._emit(j, self.ctxs[j].cont(self._zero_leaf(j, type_, ne)))

    def _clone(self, n: Tensor, st: SplitState, make: Callable[[int, Context], Tensor],
               srcs: Sequence[_Val | None], writable: bool = True) -> _Val:  # fmt: skip
        out: list[Tensor] = []
        for j in range(self.meta.n_local):
            ne = self._local_ne(n.ne, st, j)
            if _prod(ne) == 0:
                out.append(Tensor(n.type, ne, name=n.name, ndim=n.ndim))  # an empty shard
                continue
            if any(v is not None and v.t[j].nelements == 0 for v in srcs):
                if st.axis is not P_:
                    raise UnsupportedOpError(
                        f"meta: {op_desc(n)} {_label(n)} on device {self.meta.first + j}: a source "
                        f"shard is empty but the result's ({st}) is not; give that device a slice")
                out.append(self._zeros(j, n.type, ne))  # its term of the sum is zero
                continue
            t = make(j, self.ctxs[j])
            if t.ne != ne:
                raise UnsupportedOpError(f"meta: {op_desc(n)} {_label(n)}: shard {j} has ne={list(t.ne)}, "
                                         f"the state {st} says {list(ne)}")  # fmt: skip
            t.ndim = n.ndim
            t.name = f"{n.name}#{self.meta.first + j}" if n.name else ""
            if n.flags & TensorFlag.OUTPUT:
                t.flags |= TensorFlag.OUTPUT
            out.append(self._emit(j, t))
        return _Val(st, out, writable)

    def _same(self, n: Tensor, st: SplitState, srcs: Sequence[_Val | None], writable: bool = True) -> _Val:
        """Clone ``n`` with the same op params on each device's source shards."""

        def make(j: int, ctx: Context) -> Tensor:
            return ctx._op(n.op, tuple(None if v is None else v.t[j] for v in srcs), n.op_params)  # type: ignore[arg-type]

        return self._clone(n, st, make, srcs, writable)

    # --- state conversions
    def _reduce(self, tensors: list[Tensor], label: str) -> None:
        self._close()
        self.steps.append(_Reduce(tensors, label))
        self.n_reduce += 1
        self.reduce_bytes += tensors[0].nbytes if tensors else 0

    def mirror(self, v: _Val, t: Tensor) -> _Val:
        """``v`` made whole on every device: a PARTIAL summed (in place where it can), a split
        gathered."""
        if v.state.axis is M_:
            return v
        if v.state.axis is P_:
            return self._sum_partial(v, t)
        if v.mirror is None:
            v.mirror = self._gather(v, t)
        return v.mirror

    def _sum_partial(self, v: _Val, t: Tensor) -> _Val:
        if t.type not in REDUCIBLE:
            raise UnsupportedOpError(f"meta: {_label(t)} is PARTIAL of type {t.type.name}; only F32, F16 "
                                     "and BF16 partial sums can be all-reduced")  # fmt: skip
        keep = TensorFlag.INPUT | TensorFlag.PARAM
        targets: list[Tensor] = []  # what the comm sums, per device
        views: list[Tensor] = []  # the value afterwards, per device
        in_place = True
        for j, x in enumerate(v.t):
            o = x.view_src
            if (o is not None and o.op is not None and not o.flags & keep and x.view_offs == 0
                    and x.type == o.type and x.nbytes == o.nbytes
                    and x.is_contiguous() and o.is_contiguous()):  # fmt: skip
                targets.append(o)  # a reshape of a node: sum the node's memory
                views.append(x)
            elif x.op is None or o is not None or not x.is_contiguous() or x.flags & keep:
                c = self._emit(j, self.ctxs[j].cont(x))  # sum a copy, not the source's memory
                targets.append(c)
                views.append(c)
                in_place = False
            else:
                targets.append(x)
                views.append(x)
        self._reduce(targets, _label(t))
        if in_place:
            # the node and its views that were still PARTIAL now read the sum
            def on(w: _Val) -> bool:
                return all(y is x or y.view_src is x for y, x in zip(w.t, targets, strict=True))

            for w in self.vals.values():
                if w.state.axis is P_ and w is not v and len(w.t) == len(targets) and on(w):
                    w.state = MIRRORED
        else:
            v.writable = False  # a later write would land in the copies, not in v's memory
        v.state, v.t = MIRRORED, views
        return v

    def _gather(self, v: _Val, t: Tensor) -> _Val:
        """Every device writes its pieces into zeros of the full shape; the all-reduce of those
        assembles the whole tensor everywhere (x + 0 is exact)."""
        if t.type not in REDUCIBLE:
            raise UnsupportedOpError(
                f"meta: {_label(t)} ({t.type.name}, {v.state}) would have to be gathered to all devices "
                f"for its consumer, and only F32/F16/BF16 tensors can be; split it differently")
        k = v.state.axis
        ne_full = tuple(t.ne)
        out = []
        for j, x in enumerate(v.t):
            ctx = self.ctxs[j]
            z = self._zeros(j, t.type, ne_full)
            for gs, ls, ln in v.state.local_blocks(self.meta.first + j):
                ne_b = list(ne_full)
                ne_b[k] = ln
                src = ctx.view(x, ne_b, x.nb, ls * x.nb[k])
                dst = ctx.view(z, ne_b, z.nb, gs * z.nb[k])
                self._emit(j, src)
                self._emit(j, dst)
                self._emit(j, ctx.cpy(src, dst))
            out.append(z)
        self.n_gather += 1
        self._reduce(out, f"gather {_label(t)}")
        return _Val(MIRRORED, out, writable=False)

    def _slice(self, v: _Val, st: SplitState, t: Tensor) -> _Val:
        """Device j's pieces of a mirrored ``v`` (``st`` may cover a prefix of the axis)."""
        assert v.state.axis is M_
        k = st.axis
        bs = _units_per(t, k)
        out = []
        for j, x in enumerate(v.t):
            g = self.meta.first + j
            pieces = st.local_blocks(g)
            ne = self._local_ne(t.ne, st, j)
            ctx = self.ctxs[j]
            if any(gs % bs or ln % bs for gs, _, ln in pieces):
                raise ShapeError(f"meta: cannot slice {_label(t)} ({t.type.name}) at {st}: not whole blocks")
            if _prod(ne) == 0:
                out.append(Tensor(t.type, ne, name=t.name))
            elif len(pieces) == 1:
                out.append(self._emit(j, ctx.view(x, ne, x.nb, pieces[0][0] // bs * x.nb[k])))
            else:  # several pieces: copy them next to each other
                z = self._zeros(j, t.type, ne)
                for gs, ls, ln in pieces:
                    ne_b = list(ne)
                    ne_b[k] = ln
                    src = self._emit(j, ctx.view(x, ne_b, x.nb, gs // bs * x.nb[k]))
                    dst = self._emit(j, ctx.view(z, ne_b, z.nb, ls // bs * z.nb[k]))
                    self._emit(j, ctx.cpy(src, dst))
                out.append(z)
        return _Val(st, out, writable=False)

    def to_state(self, v: _Val, st: SplitState, t: Tensor) -> _Val:
        if v.state == st:
            return v
        m = self.mirror(v, t)
        return m if st.axis is M_ else self._slice(m, st, t)

    # --- the walk
    def _build(self) -> None:
        meta = self.meta
        weights = []
        for t in self.graph.leafs:
            v = self._leaf(t)
            self.vals[id(t)] = v
            # a separate record: summing a PARTIAL leaf rebinds vals[id(t)] to the sum's copies
            self.leaf_vals[id(t)] = _Val(v.state, list(v.t))
            self.derived[id(t)] = v.state
            if isinstance(t.buffer, MetaBuffer) and t.buffer.kind == "weights":
                weights.append(id(t.extra))
        self.weights = tuple(weights)
        for n in self.graph.nodes:
            try:
                self.vals[id(n)] = self._node(n)
                self.derived[id(n)] = self.vals[id(n)].state
            except UnsupportedOpError:
                raise
            except ShapeError as e:
                raise UnsupportedOpError(f"meta: {op_desc(n)} {_label(n)}: {e}") from e
        for n in self.graph.nodes:  # outputs leave whole, like ggml's cut at every PARTIAL
            if n.flags & TensorFlag.OUTPUT and self.vals[id(n)].state.axis is P_:
                self.mirror(self.vals[id(n)], n)
        self._close()
        if meta.debug:
            for line in self.describe():
                print(f"meta: {line}", file=sys.stderr)

    def _leaf(self, t: Tensor) -> _Val:
        buf = t.buffer
        if isinstance(buf, MetaBuffer) and buf.meta is self.meta and buf.kind == "weights":
            w = t.extra
            return _Val(w.state, list(w.t))
        if buf is not None and not (isinstance(buf, MetaBuffer) and buf.meta is self.meta):
            raise DeviceError(f"meta: leaf {_label(t)} is in buffer {buf.name!r}, outside {self.meta.name}; "
                              "allocate weights with MetaDevice.alloc_weights and leave inputs "
                              "unallocated")  # fmt: skip
        st = self.meta._state(t, default=MIRRORED)
        out = []
        for j in range(self.meta.n_local):
            x = Tensor(t.type, self._local_ne(t.ne, st, j), name=t.name, ndim=t.ndim)
            if x.nelements:
                x.flags |= TensorFlag.INPUT
                self.inputs[j].append(x)
            out.append(x)
        return _Val(st, out)

    def _node(self, n: Tensor) -> _Val:
        op = n.op
        if op in VIEW_OPS:
            return self._view(n)
        if op in _UNARY:
            return self._unary(n)
        if op in (Op.ADD, Op.SUB, Op.MUL, Op.DIV) or (op is Op.GLU and n.src[1] is not None):
            return self._binary(n)
        if op in _ROWWISE or op is Op.GLU:
            return self._rows(n)
        handler = {
            Op.ROPE: self._rope, Op.MUL_MAT: self._mul_mat, Op.MUL_MAT_ID: self._mul_mat_id,
            Op.GET_ROWS: self._get_rows, Op.SET_ROWS: self._set_rows, Op.CPY: self._cpy,
            Op.CONCAT: self._concat, Op.SUM: self._sum,
        }.get(op)  # fmt: skip
        if handler is not None:
            return handler(n)
        return self._whole(n)

    def _whole(self, n: Tensor) -> _Val:
        """Any op, on whole operands (the fallback)."""
        srcs = [None if s is None else self.mirror(self._v(s), s) for s in n.src]  # type: ignore[arg-type]
        return self._same(n, MIRRORED, srcs)

    # --- rules (see the module docstring's table)
    def _unary(self, n: Tensor) -> _Val:
        a = self._v(n.src[0])
        assert a is not None
        linear = n.op in _LINEAR_UNARY or (n.op is Op.SCALE and n.op_params[1] == 0)
        if a.state.axis is P_ and not linear:
            a = self.mirror(a, n.src[0])
        return self._same(n, a.state, [a])

    def _binary(self, n: Tensor) -> _Val:
        sa, sb = n.src[0], n.src[1]
        a, b = self._v(sa), self._v(sb)
        assert a is not None and b is not None and sa is not None and sb is not None
        pa, pb = a.state.axis is P_, b.state.axis is P_
        if pa or pb:
            op = n.op
            bm, am = b.state.axis is M_, a.state.axis is M_
            if ((op in (Op.ADD, Op.SUB) and pa and pb) or (op in (Op.MUL, Op.DIV) and pa and bm)
                    or (op is Op.MUL and pb and am)):  # fmt: skip
                return self._same(n, PARTIAL, [a, b])
            a, b = self.mirror(a, sa), self.mirror(b, sb)
        if a.state.is_split:
            k = a.state.axis
            if sb.ne[k] == sa.ne[k]:
                b = self.to_state(b, a.state, sb)
            elif sb.ne[k] == 1:
                b = self.mirror(b, sb)
            else:
                a, b = self.mirror(a, sa), self.mirror(b, sb)
        elif b.state.is_split:
            k = b.state.axis
            if sb.ne[k] == sa.ne[k]:
                a = self.to_state(a, b.state, sa)
            else:
                b = self.mirror(b, sb)
        return self._same(n, a.state, [a, b])

    def _rows(self, n: Tensor) -> _Val:
        sa = n.src[0]
        a = self._v(sa)
        assert a is not None and sa is not None
        op = n.op
        if a.state.axis is P_:
            if op in (Op.SUM_ROWS, Op.MEAN):
                return self._same(n, PARTIAL, [a])
            a = self.mirror(a, sa)
        if a.state.axis == 0:
            if op is Op.SUM_ROWS:
                return self._same(n, PARTIAL, [a])  # sums of slices are terms of the sum
            if op is Op.GLU:  # split form: each device must hold matching gate|up halves
                pieces = _cut(a.state.blocks(), sa.ne[0] // 2)
                if pieces and len(pieces) == 2 and pieces[0] == pieces[1]:
                    st = SplitState(SplitAxis.AXIS_0, _parse(pieces[0], a.state.n or 1))
                    return self._same(n, st, [a, None])
            a = self.mirror(a, sa)
        st = a.state
        srcs: list[_Val | None] = [a] + [None] * (len(n.src) - 1)
        if op is Op.SOFT_MAX and n.src[1] is not None:
            sm = n.src[1]
            m = self._v(sm)
            assert m is not None
            if m.state.axis is P_ or not st.is_split:
                m = self.mirror(m, sm)
            else:
                k = st.axis
                if k == 2 and n.op_params[1] != 0:  # ALiBi slopes depend on the head index
                    a, st = self.mirror(a, sa), MIRRORED
                    m = self.mirror(m, sm)
                elif sm.ne[k] == 1:
                    m = self.mirror(m, sm)
                elif k == 1 or sm.ne[k] == sa.ne[k]:
                    m = self.to_state(m, st, sm)
                else:
                    a, st = self.mirror(a, sa), MIRRORED
                    m = self.mirror(m, sm)
            srcs = [a, m]
        if op is Op.ARGMAX and st.is_split:
            st = st.with_axis(0)  # rows of a matrix become the result's elements
        return self._same(n, st, srcs)

    def _rope(self, n: Tensor) -> _Val:
        sa, sp = n.src[0], n.src[1]
        a, p = self._v(sa), self._v(sp)
        assert a is not None and p is not None and sa is not None and sp is not None
        if a.state.axis == 0:
            a = self.mirror(a, sa)  # rotation pairs inside a head
        p = self.mirror(p, sp)
        if a.state.axis == 2:  # tokens split: each device takes its tokens' positions
            p = self.to_state(p, SplitState(SplitAxis.AXIS_0, a.state.segments), sp)
        srcs = [a, p]
        if len(n.src) > 2:  # frequency factors: one per rotated pair, whole on every device
            sf = n.src[2]
            f = self._v(sf)
            assert f is not None and sf is not None
            srcs.append(self.mirror(f, sf))
        return self._same(n, a.state, srcs)  # rotation is linear: PARTIAL stays PARTIAL

    def _mul_mat(self, n: Tensor) -> _Val:
        sa, sb = n.src[0], n.src[1]
        a, b = self._v(sa), self._v(sb)
        assert a is not None and b is not None and sa is not None and sb is not None
        if a.state.axis is P_:
            a = self.mirror(a, sa)
        if b.state.axis is P_:
            if a.state.axis is M_:
                return self._same(n, PARTIAL, [a, b])  # linear in b
            b = self.mirror(b, sb)
        A, B = a.state.axis, b.state.axis
        if A is M_ and B is M_:
            return self._same(n, MIRRORED, [a, b])
        if A == 1:  # column parallel: each device computes its output features
            return self._same(n, a.state.with_axis(0), [a, self.mirror(b, sb)])
        if A == 0:  # row parallel: each device's product over its K slice is a term
            return self._same(n, PARTIAL, [a, self.to_state(b, a.state, sb)])
        if A is M_:
            if B == 1:
                return self._same(n, b.state, [a, b])
            if B == 0:
                return self._same(n, PARTIAL, [self.to_state(a, b.state, sa), b])
            k = B
            if sa.ne[k] == 1:
                return self._same(n, b.state, [a, b])
            ta = b.state.scaled(1, sb.ne[k] // sa.ne[k])
            if ta is not None:
                return self._same(n, b.state, [self.to_state(a, ta, sa), b])
            return self._same(n, MIRRORED, [a, self.mirror(b, sb)])
        # a split along a batch axis (heads): b's groups follow (b.ne[k] / a.ne[k] per a head)
        k = A
        tb = a.state.scaled(sb.ne[k] // sa.ne[k])
        assert tb is not None
        return self._same(n, tb, [a, self.to_state(b, tb, sb)])

    def _mul_mat_id(self, n: Tensor) -> _Val:
        sa, sb, si = n.src
        a, b, ids = self._v(sa), self._v(sb), self._v(si)
        assert a is not None and b is not None and ids is not None
        assert sa is not None and sb is not None and si is not None
        ids = self.mirror(ids, si)
        if a.state.axis is P_:
            a = self.mirror(a, sa)
        if b.state.axis is P_:
            if a.state.axis is M_:
                return self._same(n, PARTIAL, [a, b, ids])
            b = self.mirror(b, sb)
        if a.state.axis == 1:
            return self._same(n, a.state.with_axis(0), [a, self.mirror(b, sb), ids])
        if a.state.axis == 0:
            return self._same(n, PARTIAL, [a, self.to_state(b, a.state, sb), ids])
        return self._same(n, MIRRORED, [self.mirror(a, sa), self.mirror(b, sb), ids])

    def _get_rows(self, n: Tensor) -> _Val:
        sa, si = n.src[0], n.src[1]
        a, ids = self._v(sa), self._v(si)
        assert a is not None and ids is not None and sa is not None and si is not None
        ids = self.mirror(ids, si)
        if a.state.axis is P_ or a.state.axis == 0:
            return self._same(n, a.state, [a, ids])
        return self._same(n, MIRRORED, [self.mirror(a, sa), ids])

    def _dst(self, n: Tensor, t: Tensor) -> _Val:
        d = self._v(t)
        assert d is not None
        if not d.writable:
            raise UnsupportedOpError(f"meta: {op_desc(n)} {_label(n)} writes into {_label(t)}, a gathered, "
                                     "sliced or summed copy on the devices; the write would be "
                                     "lost")  # fmt: skip
        if d.state.axis is P_:
            raise UnsupportedOpError(f"meta: {op_desc(n)} {_label(n)} writes into PARTIAL {_label(t)}")
        return d

    def _set_rows(self, n: Tensor) -> _Val:
        sd, ss, si = n.src
        assert sd is not None and ss is not None and si is not None
        d = self._dst(n, sd)
        s, ids = self._v(ss), self._v(si)
        assert s is not None and ids is not None
        ids = self.mirror(ids, si)
        k = d.state.axis
        if k is M_:
            s = self.mirror(s, ss)
        elif k in (0, 2, 3):
            s = self.to_state(s, d.state, ss)
            if k >= 2 and si.ne[k - 1] > 1:  # per-batch row indices follow the batch split
                ids = self.to_state(ids, SplitState(SplitAxis(k - 1), d.state.segments), si)
        else:
            raise UnsupportedOpError(
                f"meta: SET_ROWS {_label(n)} into {_label(sd)} split along its rows ({d.state}): row "
                "indices are global; split the destination along another axis")
        return self._same(n, d.state, [d, s, ids])

    def _cpy(self, n: Tensor) -> _Val:
        sa, sb = n.src[0], n.src[1]
        assert sa is not None and sb is not None
        d = self._dst(n, sb)
        a = self._v(sa)
        assert a is not None
        if d.state.axis is M_:
            a = self.mirror(a, sa)
        elif sa.ne == sb.ne:
            a = self.to_state(a, d.state, sa)
        else:
            st = _reshape_state(d.state, sb.ne, sa.ne) if sa.is_contiguous() and sb.is_contiguous() else None
            if st is None:
                raise UnsupportedOpError(f"meta: CPY {_label(sa)} -> {_label(sb)} ({d.state}): the split of "
                                         "the destination does not map onto the source's shape")  # fmt: skip
            a = self.to_state(a, st, sa)
        return self._same(n, d.state, [a, d])

    def _concat(self, n: Tensor) -> _Val:
        sa, sb = n.src[0], n.src[1]
        a, b = self._v(sa), self._v(sb)
        assert a is not None and b is not None and sa is not None and sb is not None
        if a.state.axis is P_ and b.state.axis is P_:
            return self._same(n, PARTIAL, [a, b])
        if a.state == b.state and a.state.is_split and a.state.axis != n.op_params[0]:
            return self._same(n, a.state, [a, b])
        return self._same(n, MIRRORED, [self.mirror(a, sa), self.mirror(b, sb)])

    def _sum(self, n: Tensor) -> _Val:
        a = self._v(n.src[0])
        assert a is not None
        return self._same(n, MIRRORED if a.state.axis is M_ else PARTIAL, [a])

    def _view(self, n: Tensor) -> _Val:
        s_log = n.src[0]
        s = self._v(s_log)
        assert s is not None and s_log is not None
        op = n.op
        st = s.state
        if st.is_split and op in (Op.PERMUTE, Op.TRANSPOSE):
            axes = n.op_params[3] if op is Op.PERMUTE else (1, 0, 2, 3)
            return self._clone(n, st.with_axis(axes[st.axis]),
                               lambda j, ctx: ctx.permute(s.t[j], *axes), [s], s.writable)  # fmt: skip
        if st.is_split and op is Op.RESHAPE:
            st2 = _reshape_state(st, s_log.ne, n.ne)
            if st2 is not None:
                return self._clone(n, st2, lambda j, ctx: ctx.reshape_ne(self._contig(j, s.t[j]),
                                   *self._local_ne(n.ne, st2, j)), [s], s.writable)  # fmt: skip
        if st.is_split and op is Op.VIEW:
            ne, nb, offs = n.op_params
            vm = _view_map(s_log, st, ne, nb, offs, s.t, self.meta.first)
            if vm is not None:
                return self._clone(n, vm.state,
                                   lambda j, ctx: ctx.view(s.t[j], vm.ne[j], vm.nb[j], vm.offs[j]),
                                   [s], s.writable)  # fmt: skip
        if st.is_split:
            s = self.mirror(s, s_log)
        if s.state.axis is M_ and any(x.nelements and x.nb != s_log.nb for x in s.t):
            # the whole copies of s_log are packed, not laid out as s_log (a gathered or summed
            # copy of a strided view), and n's strides and offset are bytes of s_log's memory
            # owner (a transpose of a transposed view is contiguous again, as its consumers
            # may need): view the owner's whole value instead
            o_log = n.view_src
            ov = self.mirror(self._v(o_log), o_log)
            return self._clone(n, MIRRORED, lambda j, ctx: ctx.view(ov.t[j], n.ne, n.nb, n.view_offs),
                               [ov], ov.writable)  # fmt: skip
        return self._clone(n, s.state, lambda j, ctx: self._view_like(n, ctx, j, s.t[j]), [s], s.writable)

    def _contig(self, j: int, x: Tensor) -> Tensor:
        return x if x.is_contiguous() else self._emit(j, self.ctxs[j].cont(x))

    def _view_like(self, n: Tensor, ctx: Context, j: int, x: Tensor) -> Tensor:
        """``n``'s view op with its own params over a whole shard ``x``."""
        if n.op is Op.RESHAPE:
            return ctx.reshape_ne(self._contig(j, x), *n.ne)
        if n.op is Op.PERMUTE:
            return ctx.permute(x, *n.op_params[3])
        if n.op is Op.TRANSPOSE:
            return ctx.transpose(x)
        if n.op is Op.VIEW:
            ne, nb, offs = n.op_params
            return ctx.view(x, ne, nb, offs)
        return ctx._op(n.op, (x,), n.op_params)

    def describe(self) -> list[str]:
        lines = [f"graph #{self.graph.uid} over {self.meta.name}: {len(self.steps)} steps, "
                 f"{self.n_reduce} all-reduces ({self.n_gather} gathers)"]  # fmt: skip
        for t in list(self.graph.leafs) + list(self.graph.nodes):
            st = self.derived.get(id(t))
            if st is not None:
                summed = " -> all-reduce" if st.axis is P_ and self.vals[id(t)].state.axis is M_ else ""
                lines.append(f"  {op_desc(t):<10} {_label(t):<24} {list(t.ne)} {st}{summed}")
        return lines


# --- the meta device ---------------------------------------------------------------------------------
class MetaDevice(GraphRunner):
    """Tensor parallelism over ``devices`` (Devices, for which backends are made, or Backends
    to use as they are; the same device may appear several times).

    ``split_state(t)`` gives the split of a statically allocated tensor (weights, caches) and
    of graph inputs; None means MIRRORED. ``tensor_split``: relative share of each device for
    :meth:`split` (default even). ``algorithm``, ``compress``, ``compress_threshold``: the
    all-reduce (:class:`accelplane.parallel.comm.AllReduce`). ``group``: a process group
    (:class:`accelplane.parallel.mpi.MPIGroup`) whose ranks each run a MetaDevice over their local
    devices, in rank order; split states then give sizes for all devices of all ranks.

    Lifecycle as a scheduler's: :meth:`alloc_graph` (plans once per graph, places inputs and
    intermediates on each device), set the inputs, :meth:`graph_compute` /
    :meth:`synchronize` (or :meth:`compute`), read outputs; :meth:`free` at the end.
    Not thread-safe.
    """

    def __init__(self, devices: Sequence[Device | Backend], split_state: SplitFn | None = None, *,
                 tensor_split: Sequence[float] | None = None, algorithm: str = "auto",
                 compress: str | None = None, compress_threshold: int | None = None,
                 group: ProcessGroup | None = None) -> None:  # fmt: skip
        if not devices:
            raise DeviceError("a meta device needs at least one device")
        for d in devices:
            if not isinstance(d, Backend | Device):
                raise DeviceError(f"meta device: {d!r} is neither a Device nor a Backend")
            if isinstance(d, Backend):
                d._check()
        self._own_backends = [d.new_backend() for d in devices if isinstance(d, Device)]
        own = iter(self._own_backends)
        self.backends: list[Backend] = [d if isinstance(d, Backend) else next(own) for d in devices]
        self.devices = [b.device for b in self.backends]
        self.n_local = len(self.backends)
        self.group = group
        if group is not None and group.size > 1:
            counts = group.allgather_int(self.n_local, "meta device sizes")
            self.first = sum(counts[: group.rank])
            self.n = sum(counts)
        else:
            self.first, self.n = 0, self.n_local
        if self.n > MAX_DEVICES:
            raise DeviceError(f"meta device: {self.n} devices, at most {MAX_DEVICES}")
        if tensor_split is not None and len(tensor_split) != self.n:
            raise ShapeError(f"meta device: tensor_split has {len(tensor_split)} entries for "
                             f"{self.n} devices")  # fmt: skip
        self.tensor_split = list(tensor_split) if tensor_split is not None else None
        self.split_state = split_state
        self.algorithm, self.compress, self.compress_threshold = algorithm, compress, compress_threshold
        names = ",".join(d.name for d in self.devices)
        where = f"@rank{group.rank}/{group.size}" if group is not None and group.size > 1 else ""
        self.name = f"Meta({names}){where}"
        self.debug = env.META_DEBUG.get()
        self.stats = MetaStats()
        self._ar: AllReduce | None = None
        self._galloc = [GraphAllocator(b.device.buffer_type) for b in self.backends]
        self._plans: dict[int, _Plan] = {}
        self._allocated: _Plan | None = None
        self._weights: list[MetaBuffer] = []
        self._weights_version = 0  # bumped by alloc_weights
        self.freed = False
        if self.n_local > 1:  # fail early on bad comm settings (nothing is opened yet)
            try:
                self._ar = AllReduce(self.backends, algorithm, compress, compress_threshold)
            except BaseException:
                for bk in self._own_backends:
                    bk.free()
                raise

    def __repr__(self) -> str:
        return f"MetaDevice({self.name})"

    def _check(self) -> None:
        if self.freed:
            raise DeviceError(f"{self.name} used after free")

    # --- split states
    def split(self, t: Tensor, axis: int, granularity: int = 1,
              segments: Sequence[tuple[int, int]] | None = None) -> SplitState:  # fmt: skip
        """``t`` split along ggml ``axis`` in whole ``granularity`` elements (a head: head_dim;
        bumped to the block size for axis 0 of a quantized type), even or by ``tensor_split``.
        ``segments``: ``[(length, repeat), …]`` along the axis for fused tensors, each length
        split on its own: QKV = ``[(n_embd_q, 1), (n_embd_kv, 2)]``."""
        if not 0 <= axis < 4:
            raise ShapeError(f"split of {_label(t)}: axis {axis} is not 0..3")
        if axis == 0 and t.type.is_quantized:
            granularity = math.lcm(granularity, TRAITS[t.type].blck_size)
        length = t.ne[axis]
        segs = segments or [(length, 1)]
        if sum(ln * r for ln, r in segs) != length:
            raise ShapeError(f"split of {_label(t)}: segments {list(segs)} do not add up to "
                             f"ne[{axis}]={length}")  # fmt: skip
        try:
            return SplitState(SplitAxis(axis), tuple(
                Segment(split_sizes(ln, self.n, granularity, self.tensor_split), r) for ln, r in segs))
        except ShapeError as e:
            raise ShapeError(f"split of {_label(t)} along axis {axis}: {e}") from None

    def _state(self, t: Tensor, default: SplitState | None = None) -> SplitState:
        st = self.split_state(t) if self.split_state is not None else None
        st = default if st is None else st
        if st is None:
            st = MIRRORED
        if not isinstance(st, SplitState):
            raise ShapeError(f"split_state({_label(t)}) returned {st!r}, not a SplitState or None")
        if st.is_split:
            if st.n != self.n:
                raise ShapeError(f"split state of {_label(t)} gives sizes for {st.n} devices; "
                                 f"{self.name} has {self.n}")  # fmt: skip
            if st.length != t.ne[st.axis]:
                raise ShapeError(f"split state of {_label(t)} ({st}) covers {st.length} elements of "
                                 f"axis {int(st.axis)}, which has {t.ne[st.axis]}")  # fmt: skip
            bs = _units_per(t, st.axis)
            if bs > 1 and any(ln % bs for _, ln in st.blocks()):
                raise ShapeError(f"split state of {_label(t)} ({st}) cuts {t.type.name} blocks of {bs}; "
                                 "use MetaDevice.split (it rounds to whole blocks)")  # fmt: skip
        return st

    def _is_weight(self, t: Tensor) -> bool:
        b = t.buffer
        return (isinstance(t.extra, _Val) and isinstance(b, MetaBuffer) and b.meta is self
                and b.kind == "weights")  # fmt: skip

    def state_of(self, t: Tensor) -> SplitState:
        """The split state of a weight, or of a tensor of the last allocated graph."""
        owner = t.view_src if t.view_src is not None and t.op is None else t
        if self._is_weight(owner):
            return owner.extra.state
        if self._allocated is not None and id(t) in self._allocated.vals:
            return self._allocated.bound(t).state
        raise DeviceError(f"{_label(t)} is not a tensor of {self.name}")

    def shards(self, t: Tensor) -> list[Tensor]:
        """The per-device tensors of ``t`` (this process's devices)."""
        if self._is_weight(t):
            return list(t.extra.t)
        if self._allocated is not None and id(t) in self._allocated.vals:
            return list(self._allocated.bound(t).t)
        raise DeviceError(f"{_label(t)} is not a tensor of {self.name}")

    # --- weights
    def alloc_weights(self, tensors: Context | Iterable[Tensor], split_state: SplitFn | None = None,
                      usage: BufferUsage = BufferUsage.WEIGHTS) -> MetaBuffer:  # fmt: skip
        """Allocate each tensor (leaves, not views) as one shard per device, split as
        ``split_state`` (default: the device's callback) says, in one buffer per device; the
        tensors then point at the returned :class:`MetaBuffer` (set/get scatter/gather).
        Raises ShapeError on a bad split state, before allocating anything."""
        self._check()
        ts = list(tensors.tensors) if isinstance(tensors, Context) else list(tensors)
        fn = split_state or self.split_state
        plan = []
        for t in ts:
            if t.view_src is not None or t.op is not None:
                raise DeviceError(f"alloc_weights: {_label(t)} is a view or a node, not a leaf")
            if t.buffer is not None:
                raise DeviceError(f"alloc_weights: {_label(t)} is already in buffer {t.buffer.name!r}")
            st = self._state_with(fn, t)
            shards = []
            for j in range(self.n_local):
                ne = list(t.ne)
                if st.is_split:
                    ne[st.axis] = st.local(self.first + j)
                shards.append(Tensor(t.type, tuple(ne), name=f"{t.name}#{self.first + j}", ndim=t.ndim))
            plan.append((t, st, shards))
        parts: list[Buffer] = []
        try:
            for j in range(self.n_local):
                sh = [s[j] for _, _, s in plan if s[j].nelements]
                for s in sh:
                    s.flags |= TensorFlag.PARAM
                buf = alloc_tensors(sh, self.devices[j].buffer_type, usage) if sh else None
                if buf is not None:
                    parts.append(buf)
        except BaseException:
            for p in parts:
                p.free()
            raise
        mb = MetaBuffer(self, "weights", parts)
        for t, st, shards in plan:
            t.buffer, t.offs, t.extra = mb, 0, _Val(st, shards)
        self._weights.append(mb)
        self._weights_version += 1  # plans re-check which weights their graphs are bound to
        return mb

    def _state_with(self, fn: SplitFn | None, t: Tensor) -> SplitState:
        saved = self.split_state
        self.split_state = fn
        try:
            return self._state(t)
        finally:
            self.split_state = saved

    # --- host data: scatter and gather of logical byte images
    def _group_sum(self, arr: np.ndarray, what: str) -> np.ndarray:
        if self.group is None or self.group.size == 1:
            return arr
        return self.group.allreduce(arr, what)

    def _gather_image(self, t: Tensor, v: _Val) -> np.ndarray:
        """The logical bytes of owner ``t`` (contiguous or strided as t says)."""
        span = np.zeros(t.nbytes, np.uint8)
        full = strided_view(t, span)
        st = v.state
        shards = [x for x in v.t if x.nelements]
        if st.axis is M_:
            if not shards:
                raise DeviceError(f"{_label(t)}: no device holds it")
            full[...] = strided_view(shards[0], shards[0].get_bytes())
            return span
        if st.axis is P_:
            if t.type.is_quantized or t.type not in REDUCIBLE:
                raise UnsupportedOpError(f"{_label(t)}: PARTIAL {t.type.name} cannot be read back")
            acc = np.zeros(full.shape, np.float64)
            for x in shards:
                acc += strided_view(x, x.get_bytes())
            acc = self._group_sum(acc, f"get {_label(t)}")
            full[...] = acc.astype(full.dtype)
            return span
        ax = 3 - st.axis
        bs = _units_per(t, st.axis)
        scale = TRAITS[t.type].type_size if bs > 1 else 1
        for j, x in enumerate(v.t):
            if not x.nelements:
                continue
            u = strided_view(x, x.get_bytes())
            for gs, ls, ln in st.local_blocks(self.first + j):
                dst = [slice(None)] * 4
                src = [slice(None)] * 4
                dst[ax] = slice(gs // bs * scale, (gs + ln) // bs * scale)
                src[ax] = slice(ls // bs * scale, (ls + ln) // bs * scale)
                full[tuple(dst)] = u[tuple(src)]
        if self.group is not None and self.group.size > 1:
            # each byte is some rank's; the others hold zeros there, so a byte sum assembles it
            span = self.group.allreduce(span, f"get {_label(t)}")
        return span

    def _scatter_image(self, t: Tensor, v: _Val, img: np.ndarray) -> None:
        full = strided_view(t, np.ascontiguousarray(img).reshape(-1)[: t.nbytes])
        st = v.state
        for j, x in enumerate(v.t):
            if not x.nelements:
                continue
            g = self.first + j
            if st.axis is M_:
                u = full
            elif st.axis is P_:  # the value on device 0, zeros elsewhere: the sum is exact
                u = full if g == 0 else np.zeros_like(full)
            else:
                ax = 3 - st.axis
                bs = _units_per(t, st.axis)
                scale = TRAITS[t.type].type_size if bs > 1 else 1
                parts = []
                for gs, _, ln in st.local_blocks(g):
                    sl = [slice(None)] * 4
                    sl[ax] = slice(gs // bs * scale, (gs + ln) // bs * scale)
                    parts.append(full[tuple(sl)])
                u = np.concatenate(parts, axis=ax)
            _write_units(x, u)

    # --- graphs
    def _plan_for(self, graph: Graph) -> _Plan:
        plan = self._plans.get(graph.uid)
        if plan is not None and plan.weights_seen != self._weights_version:
            # weights were (re)allocated since this plan last looked: are its own still bound?
            now = tuple(id(t.extra) for t in graph.leafs
                        if isinstance(t.buffer, MetaBuffer) and t.buffer.kind == "weights")  # fmt: skip
            plan.weights_seen = self._weights_version
            if now != plan.weights:
                self._drop(plan)
                plan = None
        if plan is None:
            plan = _Plan(self, graph)
            plan.weights_seen = self._weights_version
            try:
                self._alloc_zeros(plan)
            except BaseException:
                self._drop(plan)
                raise
            self._plans[graph.uid] = plan
            self.stats.plans += 1
        return plan

    def _alloc_zeros(self, plan: _Plan) -> None:
        for j, zs in enumerate(plan.zeros):
            if zs:
                buf = alloc_tensors(zs, self.devices[j].buffer_type, BufferUsage.COMPUTE)
                if buf is not None:
                    buf.clear(0)
                    plan.zero_bufs.append(buf)

    def _drop(self, plan: _Plan) -> None:
        plan.metabuf.freed = True  # its logical tensors now raise BufferFreedError
        plan.recordings = None  # before the memory and comm they reference go
        for b in plan.zero_bufs:
            b.free()
        plan.zero_bufs = []
        self._plans.pop(plan.graph.uid, None)
        if self._allocated is plan:
            self._allocated = None

    def reserve(self, graph: Graph) -> None:
        """Plan and allocate ``graph`` (like the scheduler's reserve)."""
        self.alloc_graph(graph)

    def alloc_graph(self, graph: Graph) -> None:
        """Plan ``graph`` (once) and place its inputs and intermediates on every device; the
        graph's logical tensors then read and write through the meta device."""
        self._check()
        plan = self._plan_for(graph)
        for ga, g, keep in zip(self._galloc, plan.alloc_graphs, plan.alloc_keep, strict=True):
            ga.alloc_graph(g, keep)
        layout = tuple(g.layout_version for g in plan.alloc_graphs)
        if plan is self._allocated and layout == plan.layout:
            return  # nothing moved since this plan was bound: a decode step skips the rebinding
        if layout != plan.layout:  # tensors moved: plugins must re-plan the cached subgraphs
            plan.layout = layout
            plan.recordings, plan.runs = None, 0
            for st in plan.steps:
                if isinstance(st, _Compute):
                    for g in st.graphs:
                        if g is not None:
                            g.layout_version += 1
        mb = plan.metabuf
        for t in list(graph.leafs) + list(graph.nodes):
            if isinstance(t.buffer, MetaBuffer) and t.buffer.kind == "weights":
                continue
            if t.view_src is None:
                t.buffer, t.offs, t.extra = mb, 0, plan.bound(t)
        for t in graph.nodes:
            if t.view_src is not None and t.view_src.buffer is not None:
                t.buffer, t.offs = t.view_src.buffer, t.view_src.offs + t.view_offs
        self._allocated = plan
        self.stats.segments = sum(isinstance(s, _Compute) for s in plan.steps)
        self.stats.allreduces = plan.n_reduce - plan.n_gather
        self.stats.gathers = plan.n_gather
        self.stats.reduce_bytes = plan.reduce_bytes

    def graph_compute(self, graph: Graph) -> None:
        """Queue every device's subgraphs and the all-reduces between them (allocating first
        if ``graph`` is not the allocated one); returns before the devices finish, except
        around process-group reductions (host-staged).

        From the second compute of a plan on, when every backend can record
        (hookspecs.record_begin) and every all-reduce ran through the plugins' communicator,
        the steps are recorded once per backend and then replayed with one call each: a
        decode token costs the host a few calls instead of two per segment
        (ACCELPLANE_META_RECORD=0 turns this off)."""
        self._check()
        plan = self._plans.get(graph.uid)
        if plan is None or plan is not self._allocated:
            self.alloc_graph(graph)
            plan = self._allocated
        assert plan is not None
        self.stats.computes += 1
        if plan.recordings is None:
            plan.runs += 1
            if plan.runs >= 2 and not plan.record_error:
                plan.record_error = self._why_not_record(plan)
                if not plan.record_error:  # nothing runs while recording: replayed just below
                    plan.recordings, plan.record_error = self._record(plan)
        self.stats.record_error = plan.record_error
        if plan.recordings is None:
            self._run_steps(plan)
            return
        for b, r in zip(self.backends, plan.recordings, strict=True):
            b.record_replay(r)
        self.stats.replays += 1

    def _run_steps(self, plan: _Plan) -> None:
        self.stats.algorithms = plan.algorithms = {}
        for st in plan.steps:
            if isinstance(st, _Compute):
                for b, g in zip(self.backends, st.graphs, strict=True):
                    if g is not None:
                        b.graph_compute(g)
            else:
                self._allreduce(st)

    def _why_not_record(self, plan: _Plan) -> str:
        if not env.META_RECORD.get():
            return "ACCELPLANE_META_RECORD=0"
        if self.group is not None and self.group.size > 1:
            return "process-group all-reduces go through the host"
        other = sorted(set(plan.algorithms) - {"plugin"})
        if other:  # the SDK's fallbacks copy and wait on events: not recordable as a whole
            return f"all-reduces ran through {', '.join(other)}"
        return ""

    def _record(self, plan: _Plan) -> tuple[list | None, str]:
        """(each backend's recording of the plan's steps, "") or (None, why not); nothing has
        run either way."""
        begun: list[Backend] = []
        why = ""
        try:
            for b in self.backends:
                if not b.record_begin():
                    why = f"{b.name} cannot record"
                    break
                begun.append(b)
            else:
                self._run_steps(plan)
        except Exception as e:  # e.g. a library call that refuses recording: run unrecorded
            why = f"recording failed: {type(e).__name__}: {e}"
        finally:
            recs = [b.record_end() for b in begun]  # always: the queues must stop recording
        if not why and any(r is None for r in recs):
            why = "a backend's recording failed"
        return (None, why) if why else (recs, "")

    def _allreduce(self, st: _Reduce) -> None:
        if self._ar is not None:
            used = self._ar(st.tensors)
            self.stats.algorithms[used] = self.stats.algorithms.get(used, 0) + 1
        if self.group is not None and self.group.size > 1:
            # host-staged: the local sum to host memory, summed across processes, back to each
            # device (the comm already left the same bits on every local device)
            for b in self.backends:
                b.synchronize()
            x = st.tensors[0]
            vals = x.get_bytes().view(np_dtype(x.type))
            red = self.group.allreduce(vals.astype(np.float32), f"all-reduce {st.label}")
            raw = red.astype(np_dtype(x.type)).view(np.uint8)
            for t in st.tensors:
                t.set_bytes(raw)
            key = f"{self.group.kind}"
            self.stats.algorithms[key] = self.stats.algorithms.get(key, 0) + 1

    def describe(self, graph: Graph) -> list[str]:
        """Lines: every leaf and node of ``graph`` with its split state (plans if needed)."""
        return self._plan_for(graph).describe()

    def free(self) -> None:
        """Release plans, compute memory, weights allocated here, the comm, and the backends
        this device made. Idempotent."""
        if self.freed:
            return
        for b in self.backends:
            if not b.freed:
                b.synchronize()
        for p in list(self._plans.values()):
            self._drop(p)
        for ga in self._galloc:
            ga.free()
        for w in self._weights:
            w.free()
        if self._ar is not None:
            self._ar.free()
            self._ar = None
        for b in self._own_backends:
            b.free()
        self.freed = True

    def __enter__(self) -> MetaDevice:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()


def _write_units(x: Tensor, u: np.ndarray) -> None:
    """Write a shard from its unit array (elements, or row bytes of a block type)."""
    if x.is_contiguous():
        x.set_bytes(np.ascontiguousarray(u).reshape(-1).view(np.uint8))
        return
    span = x.get_bytes()
    strided_view(x, span)[...] = u
    x.set_bytes(span)

