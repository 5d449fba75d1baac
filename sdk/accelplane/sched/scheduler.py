"""The scheduler: one graph over several backends (ggml_backend_sched).

Assignment follows ggml's five passes (pre-allocated tensors and weights, expansion to
neighbours, upgrades and best fit, leftovers, splits with input copies); user pins and
op offload are honoured. A graph's plan (assignment, splits, input copies, per-split graphs)
is cached by graph identity and the buffer types of its leaves, so repeating a graph costs no
re-planning. Execution follows docs/ordering.md with a pluggable synchronization policy:

* ``strict`` (ggml today): before each input copy, wait for the split's backend (event or
  synchronize); user inputs are copied blocking;
* ``relaxed`` (llama.cpp #20793): one synchronize before and one after the input copies of a
  split, asynchronous copies in between (user inputs too, and host→device copies from a CPU
  split). A device whose caps say ``relaxed_sync=False`` gets ``strict`` for its splits.

  A CPU split's output (no graph input, not written in place by a later node) that a device
  split reads is, under relaxed, not waited for once queued: a device whose kernels reach the
  CPU's memory (``caps.host_reads``, the CPU computing in the device's pinned host memory) reads
  one of up to :data:`HOST_READ_BYTES` where it is, with no copy (a decode's expert outputs
  with experts in host memory: a copy call costs more host time than the device's read over
  its link); a bigger one is copied without the synchronize after the copies. Either way the
  allocator keeps that memory to the end of the compute, so only a later compute writes it:
  one of the same plan synchronizes every backend before its first host split (below), and the
  allocation of another plan, whose inputs the caller may write over that memory, first waits
  for those reads.

A compute queued before the last one was synchronized (a pipeline: with ``n_copies`` > 1 each
compute takes the next copy slot) orders its copies by the slots' events as ``strict`` does,
under either policy: relaxed's synchronizations would wait for the computes still queued, and
its asynchronous user-input copies would hold the caller's input memory until they ran. A
split computed by the host in such a compute first waits for every backend.

Host synchronizations that really wait (on asynchronous devices) are counted in ``stats``.

Environment: ACCELPLANE_SCHED_DEBUG=1 prints the splits, 2 also each node's assignment and
why; ACCELPLANE_CHECK_RESULTS=1 compares every node with the float64 oracle as it runs and
stops at the first one over its threshold; ACCELPLANE_SCHED_PREFETCH_EXPERTS=N sets how many
MUL_MAT_ID expert uploads are prefetched on a second stream (experts in host memory computed
on a device: accelplane.sched.experts).
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from accelplane import env
from accelplane.core.graph import Graph
from accelplane.core.ops import VIEW_OPS, Op, op_desc
from accelplane.core.tensor import Tensor, TensorFlag, memory_owner, owners_to_keep
from accelplane.errors import CheckResultsError, DeviceError, TypeMismatchError, UnsupportedOpError
from accelplane.interface import DeviceType
from accelplane.runtime.alloc import GraphAllocator
from accelplane.runtime.backend import (
    Backend,
    BufferType,
    BufferUsage,
    Device,
    Event,
    tensor_copy,
    tensor_copy_async,
)
from accelplane.sched.experts import ExpertSlots, ExpertUploads, is_expert_input, reads_in_place

MAX_COPIES = 4
# a CPU split's output up to this size is read in place by a device that reaches the CPU's
# memory (module docstring); a bigger one is copied (one DMA rather than reads by each node)
HOST_READ_BYTES = 256 << 10
EvalCallback = Callable[[Tensor, bool], bool]


@dataclass
class SplitInput:
    src: Tensor  # the tensor as produced (on another backend)
    src_backend: int
    copies: list[Tensor]  # one per copy slot, on the split's backend
    user_input: bool
    moe_ids: Tensor | None = None  # host expert weights of a MUL_MAT_ID: copy the used ones
    # a CPU split's output (no graph input) copied to an asynchronous device: the relaxed
    # policy does not wait for its copy (the module docstring)
    host_output: bool = False


@dataclass
class Split:
    backend: int
    nodes: list[Tensor] = field(default_factory=list)
    inputs: list[SplitInput] = field(default_factory=list)  # copied in before the split runs
    # graph inputs an earlier split on the same backend copied in this compute: read, not copied
    reused: list[SplitInput] = field(default_factory=list)
    graphs: list[Graph] = field(default_factory=list)  # one per copy slot
    keep: frozenset[int] | None = None  # memory read outside the split (accelplane.core.fusion)
    host_reads: bool = False  # a node reads a CPU split's output where it is (module docstring)


@dataclass
class Stats:
    splits: int = 0
    copies: int = 0
    host_syncs: int = 0  # waits on asynchronous devices issued by the last graph_compute
    computes: int = 0
    queued_behind: int = 0  # computes queued while an earlier one could still run (a pipeline)
    plans: int = 0  # plans built (a repeated graph builds none)
    expert_bytes: int = 0  # host expert weights uploaded in the last compute
    expert_bytes_total: int = 0  # what uploading every expert would have cost
    prefetched: int = 0  # expert inputs prefetched on a second stream in the last compute


class _Plan:
    def __init__(self) -> None:
        self.assign: dict[int, int] = {}  # id(tensor) -> backend index
        self.cause: dict[int, str] = {}
        self.splits: list[Split] = []
        self.alloc_graphs: list[Graph] = []  # per backend
        self.keep: list[frozenset[int]] = []
        self.clones: list[Tensor] = []
        self.node_graphs: dict[tuple, Graph] = {}
        self.layout: tuple[int, ...] = ()  # alloc graphs' layout versions at the last alloc
        self.views_placed = False  # clones' views placed for this layout
        self.inputs_released: bool | None = None  # Scheduler.inputs_released, once known
        self.experts = ExpertSlots()  # host expert inputs' slots (experts.py)
        # split index -> later host splits' inputs it computes (and their backend): copied out
        # right behind it (Scheduler._early_outputs)
        self.early: dict[int, list[tuple[SplitInput, int]]] = {}

    def graphs(self):
        for sp in self.splits:
            yield from sp.graphs
        yield from self.node_graphs.values()


class GraphRunner(ABC):
    """What a host drives to run graphs over several backends: the :class:`Scheduler` and the
    tensor-parallel :class:`accelplane.parallel.meta.MetaDevice` both are one (``alloc_graph``,
    ``graph_compute``, ``free`` are theirs; ``backends`` their streams)."""

    backends: list[Backend]

    @abstractmethod
    def graph_compute(self, graph: Graph) -> None:
        """Queue every part of ``graph`` on the runner's backends; may return before they finish."""

    def compute(self, graph: Graph) -> None:
        """graph_compute + synchronize."""
        self.graph_compute(graph)
        self.synchronize()

    def synchronize(self) -> None:
        """Block until every backend is done."""
        for b in self.backends:
            b.synchronize()


class Scheduler(GraphRunner):
    """Schedules graphs over ``backends`` (priority order; the last must be a CPU device).

    ``bufts``: buffer type per backend (default: each device's, except that with one
    accelerator whose pinned host buffer type it does not compute on itself, the CPU computes in
    that memory, as llama.cpp's CPU backend does beside a GPU: its splits' inputs and outputs
    cross as DMA copies, without staging. An accelerator that would read that memory in place
    keeps the CPU's own: the copies into the slots are what keep a queued compute's CPU outputs
    from the last's); ``n_copies`` > 1 enables
    pipeline parallelism (input copies per slot, events per backend and slot);
    ``op_offload``: devices may take big ops whose weights live in host memory;
    ``policy``: 'strict' or 'relaxed' (see the module docstring);
    ``prefetch_experts``: how many upcoming host-expert uploads to start early on a second
    stream of the device (default: ACCELPLANE_SCHED_PREFETCH_EXPERTS, else 3; accelplane.sched.experts).
    """

    def __init__(
        self,
        backends: Sequence[Backend],
        bufts: Sequence[BufferType] | None = None,
        n_copies: int = 1,
        op_offload: bool = True,
        policy: str = "strict",
        prefetch_experts: int | None = None,
    ) -> None:
        if not backends:
            raise DeviceError("a scheduler needs at least one backend")
        if backends[-1].device.type != DeviceType.CPU:
            raise DeviceError(
                f"the last backend of a scheduler must be a CPU device, got {backends[-1].device.name}"
            )
        if not 1 <= n_copies <= MAX_COPIES:
            raise DeviceError(f"n_copies must be in 1..{MAX_COPIES}, got {n_copies}")
        if policy not in ("strict", "relaxed"):
            raise DeviceError(f"unknown sync policy {policy!r} (strict or relaxed)")
        self.backends = list(backends)
        self.bufts = list(bufts) if bufts is not None else _default_bufts(self.backends)
        for b, bt in zip(self.backends, self.bufts, strict=True):
            if not b.device.supports_buft(bt):
                raise DeviceError(f"{b.device.name} cannot use buffer type {bt.name}")
        self.n_copies = n_copies
        self.op_offload = op_offload
        self.policy = policy
        self.events: list[list[Event | None]] = [
            [b.device.new_event() if n_copies > 1 and b.device.has_events else None
             for _ in range(n_copies)]
            for b in self.backends
        ]  # fmt: skip
        self.galloc = [GraphAllocator(bt) for bt in self.bufts]
        self._owned: list[Backend] = []  # backends from_devices made, freed with the scheduler
        self.pins: dict[int, int] = {}
        self.eval_callback: EvalCallback | None = None
        self.stats = Stats()
        self.cur_copy = 0
        self.next_copy = 0
        self._plans: dict[tuple, _Plan] = {}
        self._key_memo: dict[int, tuple[list, tuple]] = {}  # graph uid → (leaf placements, key)
        self._last_plan: dict[int, tuple[tuple, _Plan]] = {}  # graph uid → (its key, its plan)
        self._allocated: _Plan | None = None
        self._allocated_uid = -1  # the graph alloc_graph allocated last
        self._computed: _Plan | None = None  # the plan graph_compute queued last
        self._queued = False  # a compute was queued since the last synchronize
        self.prefetch_experts = (env.PREFETCH_EXPERTS.get()
                                 if prefetch_experts is None else prefetch_experts)  # fmt: skip
        self._experts = ExpertUploads(self)
        # (split, copy slot, backend) -> recorded after its copy-out (_copy_out)
        self._out_events: dict[tuple[int, int, int], Event] = {}
        self._copied_out: dict[int, Event] = {}  # id(SplitInput) -> its copy-out's event, this compute
        # backends with copies or reads of CPU splits' outputs queued and not waited for
        # (module docstring)
        self._host_reads: set[int] = set()
        self._debug = int(env.SCHED_DEBUG.get())
        self._check = env.CHECK_RESULTS.get()

    @classmethod
    def from_devices(cls, devices: Sequence[Device | str] | None = None, **kw) -> Scheduler:
        """A scheduler over one new backend per device, in the given order, with the CPU device
        last (appended when absent): a node the first device lacks runs on the next that has it.
        ``devices`` (Device objects or names): default, the registry's accelerators
        (:meth:`Registry.accelerators`: the default order without emulated devices), so on a
        machine without one, the CPU alone. ``kw`` as the constructor's. The scheduler owns these
        backends: :meth:`free` frees them."""
        from accelplane.runtime.registry import get_registry

        reg = get_registry()
        if devices is None:
            devs = reg.accelerators()
        elif isinstance(devices, (str, Device)):
            raise TypeMismatchError("devices must be a sequence of devices or names, e.g. ['CUDA0']")
        else:
            devs = [d if isinstance(d, Device) else reg.device(d) for d in devices]
        cpus = [d for d in reg.devices if d.type == DeviceType.CPU]
        if not devs or devs[-1].type != DeviceType.CPU:
            if not cpus:
                raise DeviceError("no CPU device registered: a scheduler needs one last (the cpu plugin)")
            devs.append(cpus[0])
        devs = list(dict.fromkeys(devs))
        backends = [d.new_backend() for d in devs]
        try:
            sched = cls(backends, **kw)
        except BaseException:
            for b in backends:
                b.free()
            raise
        sched._owned = backends
        return sched

    # --- configuration -----------------------------------------------------------------------
    def set_tensor_backend(self, t: Tensor, backend: Backend) -> None:
        """Pin ``t`` to ``backend`` (never overridden by the assignment passes)."""
        self.pins[id(t)] = self._index(backend)

    def get_tensor_backend(self, t: Tensor) -> Backend | None:
        """The backend ``t`` is assigned to in the graph last allocated or computed (before any:
        its pin, if pinned), or None."""
        p = self._allocated or self._computed
        i = p.assign.get(id(t)) if p else self.pins.get(id(t))
        return None if i is None else self.backends[i]

    def placement(self) -> list[tuple[Tensor, Backend]]:
        """Where the graph last allocated or computed runs: each of its nodes in graph order
        with its backend (a view with the split it belongs to); [] before any graph."""
        p = self._allocated or self._computed
        return [] if p is None else [(n, self.backends[sp.backend]) for sp in p.splits for n in sp.nodes]

    def set_eval_callback(self, cb: EvalCallback | None) -> None:
        """``cb(t, True)`` asks whether the caller wants node t; if so the scheduler computes
        up to t, synchronizes and calls ``cb(t, False)``; returning False stops the compute."""
        self.eval_callback = cb

    def _index(self, backend: Backend) -> int:
        for i, b in enumerate(self.backends):
            if b is backend:
                return i
        raise DeviceError(f"{backend} is not one of this scheduler's backends")

    # --- assignment (ggml's passes) --------------------------------------------------------------
    def _supports(self, i: int, t: Tensor) -> bool:
        return t.op is None or t.op in VIEW_OPS or self.backends[i].device.supports_op(t)

    def _backend_from_buffer(self, t: Tensor, check_op: bool) -> int | None:
        buf = t.buffer if t.buffer is not None else (t.view_src.buffer if t.view_src else None)
        if buf is None:
            return None
        for i, b in enumerate(self.backends):
            if b.device.supports_buft(buf.buft) and (not check_op or self._supports(i, t)):
                return i
        return -2  # allocated where no backend can run it

    def _from_cur(self, t: Tensor) -> tuple[int | None, str]:
        i = self._backend_from_buffer(t, t.op is not None)
        if i == -2:
            raise UnsupportedOpError(
                f"{op_desc(t)} {t.name or t.uid}: its data lives in buffer "
                f"{(t.buffer or t.view_src.buffer).name}, which no scheduled backend can run it on"
            )
        if i is not None:
            return i, "buffer"
        if t.flags & TensorFlag.INPUT:
            return len(self.backends) - 1, "input"
        if t.op is Op.ROPE:
            return None, ""
        for s in t.src:
            if s is None:
                continue
            owner = s.view_src or s
            buf = owner.buffer
            if buf is not None and buf.usage == BufferUsage.WEIGHTS:
                # the weight's backend, if it can run this op (ggml asks supports_op here too)
                w = next((i for i, b in enumerate(self.backends)
                          if b.device.supports_buft(buf.buft) and self._supports(i, t)), None)  # fmt: skip
                if w is None:
                    continue
                if (self.op_offload and w == len(self.backends) - 1 and buf.is_host):
                    for j in range(w):
                        d = self.backends[j].device
                        if d.supports_op(t) and d.offload_op(t):
                            return j, "offload"
                return w, "weight"
        return None, ""

    def _assign(self, graph: Graph, plan: _Plan) -> None:
        a, cause = plan.assign, plan.cause
        n_be = len(self.backends)
        cpu = n_be - 1
        for t in list(graph.leafs) + list(graph.nodes):
            if id(t) in self.pins:
                a[id(t)] = self.pins[id(t)]
                cause[id(t)] = "pinned"
                if not self._supports(a[id(t)], t):
                    raise UnsupportedOpError(
                        f"{op_desc(t)} {t.name or t.uid} is pinned to "
                        f"{self.backends[a[id(t)]].device.name}, which does not support it"
                    )
                continue
            i, why = self._from_cur(t)
            if i is not None:
                a[id(t)], cause[id(t)] = i, why
        nodes = [n for n in graph.nodes if n.op not in VIEW_OPS]

        def sweep(seq, include_cpu: bool, tag: str) -> None:
            cur = None
            for n in seq:
                i = a.get(id(n))
                if i is not None:
                    cur = None if (i == cpu and not include_cpu) else i
                elif cur is not None and self._supports(cur, n):
                    a[id(n)], cause[id(n)] = cur, tag
        sweep(nodes, False, "expand gpu down")
        sweep(reversed(nodes), False, "expand gpu up")
        sweep(nodes, True, "expand rest down")
        sweep(reversed(nodes), True, "expand rest up")
        # pass 3: best fit for unassigned; upgrade to a higher-priority backend of the same buft
        for n in nodes:
            i = a.get(id(n))
            if i is None:
                best, best_n = None, -1
                for j in range(n_be):
                    if not self._supports(j, n):
                        continue
                    k = sum(1 for s in n.src if s is not None and self._src_ok(j, s))
                    if k > best_n:
                        best, best_n = j, k
                if best is not None:
                    a[id(n)], cause[id(n)] = best, "best fit"
            elif cause.get(id(n)) != "pinned":
                for j in range(i):
                    if self.bufts[j] is self.bufts[i] and self._supports(j, n) and all(
                        s is None or self._src_ok(j, s) for s in n.src
                    ):
                        a[id(n)], cause[id(n)] = j, "upgrade"
                        break
        # pass 4: leftovers
        for n in graph.nodes:
            if n.view_src is not None and id(n) not in a and n.op in VIEW_OPS:
                owner = n.view_src
                if id(owner) in a:
                    a[id(n)], cause[id(n)] = a[id(owner)], "view"
            if id(n) not in a:
                for j in range(n_be):
                    if self._supports(j, n):
                        a[id(n)], cause[id(n)] = j, "first supporting"
                        break
                else:
                    raise UnsupportedOpError(
                        f"node {n.name or n.uid} ({op_desc(n)}, {n.type.name}, ne={list(n.ne)}) is "
                        f"supported by none of {', '.join(b.device.name for b in self.backends)}"
                    )
            for s in n.src:
                if s is not None and id(s) not in a:
                    owner = s.view_src
                    a[id(s)] = a[id(owner)] if owner is not None and id(owner) in a else a[id(n)]
                    cause[id(s)] = "src of consumer"
        for t in graph.leafs:
            a.setdefault(id(t), cpu)

    def _src_ok(self, j: int, s: Tensor) -> bool:
        """Backend j can read s where it lives (or will live)."""
        owner = s.view_src or s
        if owner.buffer is not None:
            return self.backends[j].device.supports_buft(owner.buffer.buft)
        return False

    def _tensor_buft(self, plan: _Plan, t: Tensor) -> BufferType:
        owner = t.view_src or t
        if owner.buffer is not None:
            return owner.buffer.buft
        return self.bufts[plan.assign[id(owner)] if id(owner) in plan.assign else plan.assign[id(t)]]

    # --- splits and copies ------------------------------------------------------------------------
    def _split(self, graph: Graph, plan: _Plan) -> None:
        a = plan.assign
        splits: list[Split] = []
        cur: Split | None = None
        copies: dict[tuple[int, int], SplitInput] = {}
        # graph inputs no node writes into keep their value through a compute: copied to a
        # backend once, by its first split that reads them (ggml's rule for every input)
        written = {id(memory_owner(n)) for n in graph.nodes
                   if n.op not in VIEW_OPS and n.view_src is not None}  # fmt: skip
        for n in graph.nodes:
            b = a[id(n)]
            if n.op in VIEW_OPS:
                if cur is not None and b == cur.backend:
                    cur.nodes.append(n)
                continue
            if cur is None or b != cur.backend or self._moe_cut(plan, n, cur):
                cur = Split(b)
                splits.append(cur)
            cur.nodes.append(n)
            dev = self.backends[b].device
            for s in n.src:
                if s is None:
                    continue
                sb = a.get(id(s), a.get(id(s.view_src), b) if s.view_src is not None else b)
                if sb == b or dev.supports_buft(self._tensor_buft(plan, s)) or self._in_place(dev, n, s):
                    continue
                host_out = self._host_output(dev, sb, s, written)
                if host_out and self._reads_host(plan, dev, s):
                    cur.host_reads = True
                    continue
                key = (id(s), b)
                inp = copies.get(key)
                if inp is not None and inp.user_input and id(memory_owner(s)) not in written:
                    if inp not in cur.inputs and inp not in cur.reused:
                        cur.reused.append(inp)
                    continue
                if inp is None:
                    user = bool(s.flags & TensorFlag.INPUT)
                    cps = []
                    for c in range(self.n_copies):
                        cp = Tensor(s.type, s.ne, s.nb, name=f"{dev.name}#{s.name or s.uid}#{c}",
                                    ndim=s.ndim)  # fmt: skip
                        if self.n_copies > 1:
                            cp.flags |= TensorFlag.INPUT | TensorFlag.OUTPUT
                        a[id(cp)] = b
                        cps.append(cp)
                    inp = copies[key] = SplitInput(s, sb, cps, user, self._moe_ids(n, s), host_out)
                if inp not in cur.inputs:
                    cur.inputs.append(inp)
        if self.policy == "relaxed":
            splits = self._cut_for_host(splits)
        plan.splits = splits
        plan.early = self._early_outputs(splits) if self.policy == "relaxed" else {}
        plan.experts = self._experts.plan(splits)
        # what each split's plugin must still write if it fuses nodes (accelplane.core.fusion):
        # memory read by any other split, and what the caller asked for
        reads = [{id(s.view_src or s) for n in sp.nodes for s in (*n.src, n.view_src) if s is not None}
                 for sp in splits]  # fmt: skip
        base_keep = graph.keep
        for si, sp in enumerate(splits):
            if base_keep is None:
                sp.keep = None
            else:
                sp.keep = frozenset(base_keep.union(*(r for j, r in enumerate(reads) if j != si)))
        # per-slot split graphs: nodes whose sources were copied get a clone that reads the
        # copy and writes the original's memory (the clone is a view of the original)
        for sp in splits:
            remap_inputs = {id(i.src): i for i in sp.inputs + sp.reused}
            for c in range(self.n_copies):
                remap: dict[int, Tensor] = {k: v.copies[c] for k, v in remap_inputs.items()}
                nodes = []
                for n in sp.nodes:
                    if any(s is not None and id(s) in remap for s in n.src):
                        cl = Tensor(n.type, n.ne, n.nb, op=n.op, op_params=n.op_params,
                                    src=tuple(remap.get(id(s), s) if s is not None else None
                                              for s in n.src),
                                    view_src=n.view_src or n, view_offs=n.view_offs if n.view_src
                                    else 0, name=n.name, ndim=n.ndim)  # fmt: skip
                        if n.view_src is None:  # a clone of an in-place op writes another's memory
                            cl.flags |= TensorFlag.CLONE
                        remap[id(n)] = cl
                        plan.clones.append(cl)
                        nodes.append(cl)
                    else:
                        nodes.append(n)
                sp.graphs.append(Graph.from_nodes(nodes, keep=sp.keep))
        # allocation: one graph per backend with its nodes in graph order (views included, so
        # they get bound) and the input copies of its splits as leafs (allocated first). Each
        # backend's allocator sees only its own nodes, so it keeps to the end what the others
        # read: sources of copies, memory read in place by another backend's nodes, and the
        # owners of the graph's outputs and inputs (a view output may sit on another backend)
        kept = [i.src for sp in splits for i in sp.inputs]
        for n in graph.nodes:
            for s in n.src:
                if s is not None and a.get(id(memory_owner(s)), a[id(n)]) != a[id(n)]:
                    kept.append(s)
        keep_ids = owners_to_keep(list(graph.leafs) + list(graph.nodes), kept)
        for k in range(len(self.backends)):
            leafs = [t for t in graph.leafs if a.get(id(t)) == k]
            for sp in splits:
                if sp.backend == k:
                    for i in sp.inputs:
                        if not is_expert_input(i):  # those live in the expert slots (experts.py)
                            leafs.extend(i.copies)
            nodes = [n for n in graph.nodes if a[id(n)] == k]
            plan.alloc_graphs.append(Graph.from_nodes(nodes, leafs))
            plan.keep.append(keep_ids)

    @staticmethod
    def _moe_ids(n: Tensor, s: Tensor) -> Tensor | None:
        """The ids of a MUL_MAT_ID whose expert weights ``s`` live in a host weights buffer."""
        owner = s.view_src or s
        buf = owner.buffer
        if (n.op is Op.MUL_MAT_ID and n.src[0] is s and buf is not None and buf.is_host
                and buf.usage == BufferUsage.WEIGHTS and s.is_contiguous()):  # fmt: skip
            return n.src[2]
        return None

    def _host_output(self, dev: Device, sb: int, s: Tensor, written: set[int]) -> bool:
        """Whether ``s``, computed on backend ``sb`` and read on ``dev``, is a CPU split's output
        whose reads need no wait once queued (module docstring)."""
        owner = memory_owner(s)
        return (dev.caps.async_ and not self.backends[sb].device.caps.async_ and owner.op not in VIEW_OPS
                and id(owner) not in written and not owner.flags & TensorFlag.INPUT)  # fmt: skip

    def _reads_host(self, plan: _Plan, dev: Device, s: Tensor) -> bool:
        """Whether ``dev`` reads such an output ``s`` where it is (module docstring)."""
        return (dev.caps.host_reads and self.n_copies == 1 and self.policy == "relaxed"
                and s.nbytes <= HOST_READ_BYTES
                and self._tensor_buft(plan, s) is dev.host_buffer_type)  # fmt: skip

    def _in_place(self, dev: Device, n: Tensor, s: Tensor) -> bool:
        """Whether node ``n`` on ``dev`` reads host experts ``s`` where they are (experts.py)."""
        return self._moe_ids(n, s) is not None and reads_in_place(dev, s, n.src[2])

    def _cut_for_host(self, splits: list[Split]) -> list[Split]:
        """Cut a split of an asynchronous device with events after its last node whose result a
        later host split reads, where a matrix product follows it in the split (work worth
        running beside the host's; a few small nodes are not worth another launch): those
        results are then copied out as soon as that node is queued (:meth:`_early_outputs`), and
        the host split computes while the device runs the rest (docs/ordering.md)."""
        out: list[Split] = []
        for k, sp in enumerate(splits):
            dev = self.backends[sp.backend].device
            hosts = [h for h in splits[k + 1 :] if not self.backends[h.backend].device.caps.async_]
            wanted = set() if not (dev.caps.async_ and dev.has_events) else {
                id(memory_owner(i.src)) for h in hosts for i in h.inputs
                if i.src_backend == sp.backend and not i.user_input}  # fmt: skip
            last = max((j for j, n in enumerate(sp.nodes)
                        if n.op not in VIEW_OPS and id(memory_owner(n)) in wanted), default=-1)  # fmt: skip
            if last < 0 or not any(n.op in (Op.MUL_MAT, Op.MUL_MAT_ID) for n in sp.nodes[last + 1 :]):
                out.append(sp)
                continue
            head, tail = Split(sp.backend, sp.nodes[: last + 1]), Split(sp.backend, sp.nodes[last + 1 :])
            head.host_reads = tail.host_reads = sp.host_reads
            hs, ts = ({id(x) for n in part.nodes for x in n.src if x is not None} for part in (head, tail))
            # an input goes with its first reader; the tail reads what the head copied in
            head.inputs = [i for i in sp.inputs if id(i.src) in hs]
            tail.inputs = [i for i in sp.inputs if id(i.src) not in hs]
            head.reused = [i for i in sp.reused if id(i.src) in hs]
            tail.reused = [i for i in (*sp.reused, *head.inputs) if id(i.src) in ts]
            out += [head, tail]
        return out

    def _early_outputs(self, splits: list[Split]) -> dict[int, list[tuple[SplitInput, int]]]:
        """Split index → the inputs of later host splits (with the host split's backend) that it
        computes, on an asynchronous device with events: copied out right after it is queued."""
        where: dict[int, int] = {}
        for k, sp in enumerate(splits):
            for n in sp.nodes:
                if n.op not in VIEW_OPS:
                    where[id(memory_owner(n))] = k
        early: dict[int, list[tuple[SplitInput, int]]] = {}
        for h, sp in enumerate(splits):
            if self.backends[sp.backend].device.caps.async_:
                continue
            for i in sp.inputs:
                k = where.get(id(memory_owner(i.src)), -1)
                dev = self.backends[i.src_backend].device
                if (0 <= k < h and splits[k].backend == i.src_backend and not i.user_input
                        and not is_expert_input(i) and dev.caps.async_ and dev.has_events):  # fmt: skip
                    early.setdefault(k, []).append((i, sp.backend))
        return early

    def _moe_cut(self, plan: _Plan, n: Tensor, cur: Split) -> bool:
        """Start a new split at a MUL_MAT_ID that uploads host experts when its ids are computed
        in the current split: the ids must be known when the split's inputs are copied."""
        if n.op is not Op.MUL_MAT_ID or not cur.nodes:
            return False
        s = n.src[0]
        dev = self.backends[cur.backend].device
        if (self._moe_ids(n, s) is None or dev.supports_buft(self._tensor_buft(plan, s))
                or self._in_place(dev, n, s)):  # fmt: skip
            return False
        ids = n.src[2]
        produced = {id(x) for x in cur.nodes}
        return id(ids) in produced or (ids.view_src is not None and id(ids.view_src) in produced)

    # --- public lifecycle -------------------------------------------------------------------------
    def _plan_for(self, graph: Graph) -> _Plan:
        key = self._key(graph)
        last = self._last_plan.get(graph.uid)
        if last is not None and last[0] is key:  # the memoized key: no hashing of its leaves
            return last[1]
        plan = self._plans.get(key)
        if plan is None:
            plan = _Plan()
            self._assign(graph, plan)
            self._split(graph, plan)
            # a changed buffer-type fingerprint for the same graph replaces its old plan
            for k in [k for k in self._plans if k[0] == graph.uid]:
                del self._plans[k]
            self._plans[key] = plan
            self.stats.plans += 1
            if self._debug:
                self._print(graph, plan)
        self._last_plan[graph.uid] = (key, plan)
        return plan

    def reserve(self, graph: Graph) -> None:
        """Plan and allocate ``graph`` (ggml_backend_sched_reserve)."""
        self.alloc_graph(graph)

    def alloc_graph(self, graph: Graph) -> None:
        """Assign, split and allocate; advances the pipeline copy slot."""
        plan = self._plan_for(graph)
        if self._host_reads and plan is not self._computed:
            self._drain_host_reads()  # another layout: the caller's inputs may take that memory
        self.cur_copy = self.next_copy
        self.next_copy = (self.next_copy + 1) % self.n_copies
        for k, g in enumerate(plan.alloc_graphs):
            self.galloc[k].alloc_graph(g, plan.keep[k])
        pools = self._experts.place(plan.experts, plan.splits)
        layout = tuple(g.layout_version for g in plan.alloc_graphs) + pools
        if layout != plan.layout or not plan.views_placed:
            # tensors moved (or first use): place the views on their sources again, and make
            # plugins re-plan the split graphs they cached. Unmoved, nothing needs redoing: a
            # decode step would otherwise re-place hundreds of views per token.
            for cl in plan.clones:
                cl.view_src.buffer.init_view(cl)
            plan.views_placed = True
            if layout != plan.layout:
                plan.layout = layout
                for g in plan.graphs():
                    g.layout_version += 1
        self._allocated = plan
        self._allocated_uid = graph.uid
        self.stats.splits = len(plan.splits)
        self.stats.copies = sum(len(sp.inputs) for sp in plan.splits)

    def graph_compute(self, graph: Graph) -> None:
        """Allocate (if this graph is not the allocated one) and queue every split. Right
        after ``alloc_graph(graph)`` the allocation stands as made: the plan is not looked up
        again (a decode step would hash its leaves twice per token)."""
        plan = self._allocated
        if plan is None or self._allocated_uid != graph.uid:
            plan = self._plans.get(self._key(graph))
            if plan is None or plan is not self._allocated:
                self.alloc_graph(graph)
                plan = self._allocated
        self.stats.computes += 1
        self.stats.queued_behind += self._queued
        self.stats.host_syncs = 0
        self._computed = None
        self._compute_splits(plan, behind=self._queued)
        self._computed = plan
        self._queued = True
        self._allocated = None  # the next compute allocates again (advancing the copy slot)

    def inputs_released(self) -> bool:
        """After graph_compute: every graph input (TensorFlag.INPUT) the splits read has been
        copied to its split's backend (both policies finish those copies before queueing the
        split) or is read by a backend that computes synchronously, so the caller may write
        the next step's inputs while the devices still run. False when an asynchronous backend
        reads an input in place, or before the first compute."""
        plan = self._computed
        if plan is None:
            return False
        if plan.inputs_released is None:
            plan.inputs_released = not any(
                self._reads_input_in_place(sp) for sp in plan.splits
                if self.backends[sp.backend].device.caps.async_)  # fmt: skip
        return plan.inputs_released

    @staticmethod
    def _reads_input_in_place(sp: Split) -> bool:
        """A node of ``sp`` reads a graph input (or a view of one) that was not copied in."""
        copied = {id(i.src) for i in sp.inputs + sp.reused}
        return any(t is not None and (t.view_src or t).flags & TensorFlag.INPUT and id(t) not in copied
                   for n in sp.nodes for t in n.src)  # fmt: skip

    def synchronize(self) -> None:
        """Block until every backend is done, the expert prefetch streams too (the caller's
        wait; not counted in stats)."""
        super().synchronize()
        for pb in self._experts.pf_backends.values():
            pb.synchronize()
        self._host_reads.clear()
        self._queued = False
        if self._allocated is None:
            self.next_copy = 0  # token generation keeps reusing slot 0 (stable device graphs)

    def free(self) -> None:
        self._drain_host_reads()
        for row in self.events:
            for e in row:
                if e is not None:
                    e.free()
        self._experts.free()
        for e in self._out_events.values():
            e.free()
        self._out_events.clear()
        for g in self.galloc:
            g.free()
        self._key_memo.clear()  # it holds the leaves' buffers
        self._last_plan.clear()
        for b in self._owned:
            b.free()
        self._owned = []

    @property
    def prefetch_backends(self) -> list[Backend]:
        """The second streams expert prefetch made (one per device it prefetched to)."""
        return list(self._experts.pf_backends.values())

    @property
    def expert_pool_bytes(self) -> int:
        """Device memory holding uploaded host experts (the slots of accelplane.sched.experts)."""
        return self._experts.pool_bytes

    def _key(self, graph: Graph) -> tuple:
        # re-plan when a leaf placed outside the scheduler moved (e.g. weights went to another
        # buffer type: re-reservation); leaves the scheduler placed itself don't count. A
        # decode step asks every token: when no leaf's (buffer, offset) changed since the last
        # call, the last key stands (a buffer's owner never changes), at a tenth of the cost.
        raw = list(map(_BUF_OFFS, graph.leafs))
        memo = self._key_memo.get(graph.uid)
        if memo is not None and memo[0] == raw:
            return memo[1]

        def placed_outside(t: Tensor) -> bool:
            return t.buffer is not None and not any(g.owns(t.buffer) for g in self.galloc)

        key = (graph.uid, tuple((id(t.buffer), t.offs) if placed_outside(t) else None
                                for t in graph.leafs))  # fmt: skip
        self._key_memo[graph.uid] = (raw, key)
        return key

    # --- execution ---------------------------------------------------------------------------------
    def _sync(self, b: Backend) -> None:
        if b.device.caps.async_:
            self.stats.host_syncs += 1
        b.synchronize()

    def _event_sync(self, ev: Event) -> None:
        if ev.device.caps.async_:
            self.stats.host_syncs += 1
        ev.synchronize()

    def _drain_host_reads(self) -> None:
        """Wait for every queued copy or read of a CPU split's output (module docstring)."""
        while self._host_reads:
            self._sync(self.backends[self._host_reads.pop()])

    def _wait_slot(self, bi: int, b: Backend) -> None:
        ev = self.events[bi][self.cur_copy]
        if ev is not None:
            ev.wait(b)
        else:
            self._sync(b)

    @staticmethod
    def _copy_async(src_b: Backend, dst_b: Backend, src: Tensor, dst: Tensor, relaxed: bool) -> bool:
        """An asynchronous copy where one exists: the destination plugin's cpy_tensor_async,
        or (relaxed only: its closing synchronize covers the source stream) a get_tensor_async
        into a host destination queued on the source stream. False: nothing was done."""
        f = dst_b._cpy_async
        if f is not None and f(src_b, dst_b, src, dst):
            return True
        if relaxed and dst.buffer.is_host and src_b._get_async is not None:
            arr = dst.buffer.host_array[dst.offs : dst.offs + dst.nbytes]
            if src_b._get_async(src_b, src, arr, 0, src.nbytes):
                return True
        return False

    def _compute_splits(self, plan: _Plan, behind: bool) -> None:
        """Queue ``plan``'s splits in copy slot ``cur_copy``; ``behind``: an earlier compute
        may still be running (then a slot with events is ordered by them, never relaxed)."""
        c = self.cur_copy
        prev: int | None = None
        self.stats.expert_bytes = self.stats.expert_bytes_total = self.stats.prefetched = 0
        self._copied_out.clear()
        self._experts.begin()
        for k, sp in enumerate(plan.splits):
            bi = sp.backend
            b = self.backends[bi]
            if behind and not b.device.caps.async_:
                # a host split writes its outputs now, while an earlier compute may still be
                # copying the last ones out (asynchronous copies from host memory): wait for it
                for ob in self.backends:
                    self._sync(ob)
                self._host_reads.clear()
                behind = False
            relaxed = (self.policy == "relaxed" and b.device.caps.relaxed_sync
                       and not (behind and self.events[bi][c] is not None))  # fmt: skip
            if not sp.inputs and prev is not None and prev != bi:
                # llama.cpp #26040: a split without inputs must not overtake the previous
                # split's use of memory the allocator may hand it
                pev = self.events[prev][c]
                if pev is not None:
                    pev.wait(b)
                else:
                    self._sync(self.backends[prev])
            if relaxed:
                self._copy_inputs_relaxed(plan, sp, bi, b, c)
            else:
                self._copy_inputs_strict(plan, sp, bi, b, c)
            if self.prefetch_experts > 0:
                self._experts.prefetch(plan.experts, plan.splits, k, c)
            g = sp.graphs[c]
            if self._check:
                self._compute_checked(plan, sp, bi, b, c)
            elif self.eval_callback is not None:
                if not self._compute_with_callback(plan, sp, bi, b, c):
                    return
            else:
                b.graph_compute(g)
            if sp.host_reads:
                self._host_reads.add(bi)
            ev = self.events[bi][c]
            if ev is not None:
                ev.record(b)
            self._experts.computed(plan.experts, sp, b, c)
            if k in plan.early and not behind:
                self._copy_out(plan, k, b, c)
            prev = bi

    def _copy_out(self, plan: _Plan, k: int, b: Backend, c: int) -> None:
        """Right behind split ``k`` on ``b``: queue the copies of what later host splits read
        from it, and an event after them that those splits wait for instead of ``b``'s stream
        (which meanwhile runs the splits queued after ``k``)."""
        done = [inp for inp, hb in plan.early[k]
                if self._copy_async(b, self.backends[hb], inp.src, inp.copies[c], True)]  # fmt: skip
        if not done:
            return
        key = (k, c, plan.splits[k].backend)
        ev = self._out_events.get(key)
        if ev is None:
            ev = self._out_events[key] = b.device.new_event()
        ev.record(b)
        for inp in done:
            self._copied_out[id(inp)] = ev

    def _copy_inputs_strict(self, plan: _Plan, sp: Split, bi: int, b: Backend, c: int) -> None:
        for inp in sp.inputs:
            src_b = self.backends[inp.src_backend]
            dst = inp.copies[c]
            if is_expert_input(inp):
                self._experts.upload(plan, inp, bi, b, c)
                continue
            if inp.user_input:
                ev = self.events[bi][c]
                if ev is not None:
                    self._event_sync(ev)
                else:
                    self._sync(b)
                tensor_copy(inp.src, dst)
                continue
            self._wait_slot(bi, b)
            tensor_copy_async(src_b, b, inp.src, dst, sync=self._sync)

    def _copy_inputs_relaxed(self, plan: _Plan, sp: Split, bi: int, b: Backend, c: int) -> None:
        if not sp.inputs:
            return
        self._sync(b)
        self._host_reads.discard(bi)
        # the streams whose copies read host memory that may change once this returns; the
        # experts uploaded from weights never change, so a split reading only them goes on
        # while its uploads run
        touched: dict[int, Backend] = {}
        waited: set[int] = set()
        deferred = False
        for inp in sp.inputs:
            ev = self._copied_out.pop(id(inp), None)
            if ev is not None:  # copied right behind the split that computed it
                if id(ev) not in waited:
                    waited.add(id(ev))
                    self._event_sync(ev)
                continue
            src_b = self.backends[inp.src_backend]
            dst = inp.copies[c]
            if is_expert_input(inp):
                self._experts.upload(plan, inp, bi, b, c)
                continue
            if self._copy_async(src_b, b, inp.src, dst, True):
                if inp.host_output:  # waited for by the next allocation
                    deferred = True
                else:
                    touched[inp.src_backend] = src_b
                    touched[bi] = b
            else:
                self._sync(src_b)
                tensor_copy(inp.src, dst)
        for tb in touched.values():
            self._sync(tb)
        if deferred and bi not in touched:
            self._host_reads.add(bi)

    def _node_graph(self, plan: _Plan, key: tuple, nodes: list[Tensor]) -> Graph:
        g = plan.node_graphs.get(key)
        if g is None:
            g = plan.node_graphs[key] = Graph.from_nodes(nodes)
        return g

    def _compute_with_callback(self, plan: _Plan, sp: Split, bi: int, b: Backend, c: int) -> bool:
        cb = self.eval_callback
        nodes = sp.graphs[c].nodes
        start = 0
        for i, n in enumerate(nodes):
            want = n.op not in VIEW_OPS and bool(cb(n, True))
            if not want and i < len(nodes) - 1:
                continue
            b.graph_compute(self._node_graph(plan, (id(sp), c, start, i), nodes[start : i + 1]))
            start = i + 1
            if want:
                self._sync(b)
                if cb(n, False) is False:
                    return False
        return True

    def _compute_checked(self, plan: _Plan, sp: Split, bi: int, b: Backend, c: int) -> None:
        from accelplane.oracle import reference
        from accelplane.oracle.compare import compare

        for i, n in enumerate(sp.graphs[c].nodes):
            if n.op in VIEW_OPS:
                continue
            values = {}
            for s in n.src:
                if s is not None:
                    values[s] = s.get().reshape(tuple(reversed(s.ne)))
                    if s.op is None and values[s].dtype.kind == "f" and np.isnan(values[s]).any():
                        raise CheckResultsError(
                            f"check-results: {s.name or s.uid} (a weight or input of node "
                            f"{n.name or n.uid}, {op_desc(n)}) holds NaN"
                        )
            b.graph_compute(self._node_graph(plan, (id(sp), c, "node", i), [n]))
            self._sync(b)
            got = n.get().reshape(tuple(reversed(n.ne)))
            want = reference.compute_node(n, values)
            thr = _check_threshold(n)
            exact = n.type.name == "I32"
            ok, err, msg = compare(np.asarray(want), got, thr, exact)
            if ok and got.dtype.kind == "f" and np.isnan(got).any() and not any(
                v.dtype.kind == "f" and np.isnan(v).any() for v in values.values()
            ):  # where the oracle agrees (e.g. inf - inf): still where the NaN comes from
                raise CheckResultsError(
                    f"check-results: node {n.name or n.uid} ({op_desc(n)}) on {b.device.name} is "
                    "the first to produce NaN (its sources hold none)"
                )
            if not ok:
                raise CheckResultsError(
                    f"check-results: node {n.name or n.uid} ({op_desc(n)}) on "
                    f"{b.device.name} is over its threshold: {msg}"
                )

    # --- debug ---------------------------------------------------------------------------------------
    def _print(self, graph: Graph, plan: _Plan) -> None:
        out = sys.stderr
        print(f"sched: graph #{graph.uid}: {len(plan.splits)} splits", file=out)
        for k, sp in enumerate(plan.splits):
            ins = ", ".join(f"{i.src.name or i.src.uid}<-{self.backends[i.src_backend].device.name}"
                            for i in sp.inputs)  # fmt: skip
            names = ", ".join(str(i.src.name or i.src.uid) for i in sp.reused)
            reused = f", reused [{names}]" if sp.reused else ""
            reused += ", reads CPU outputs in place" if sp.host_reads else ""
            print(f"  split {k}: {self.backends[sp.backend].device.name}, {len(sp.nodes)} nodes,"
                  f" inputs [{ins}]{reused}", file=out)  # fmt: skip
            if self._debug >= 2:
                for n in sp.nodes:
                    why = plan.cause.get(id(n), "")
                    print(f"    {op_desc(n):<12} {n.name or n.uid!s:<20} ({why})", file=out)


_BUF_OFFS = attrgetter("buffer", "offs")


def _default_bufts(backends: Sequence[Backend]) -> list[BufferType]:
    """Each device's buffer type; the CPU's (last) in the one accelerator's pinned host memory
    where that accelerator reaches it only through copies (the class docstring)."""
    bufts = [b.device.buffer_type for b in backends]
    accel = {id(b.device): b.device for b in backends[:-1]}
    if len(accel) == 1:
        dev, cpu = next(iter(accel.values())), backends[-1].device
        host = dev.host_buffer_type
        if host is not None and host.is_host and cpu.supports_buft(host) and not dev.supports_buft(host):
            bufts[-1] = host
    return bufts


def _check_threshold(n: Tensor) -> float:
    if n.op in (Op.MUL_MAT, Op.MUL_MAT_ID):
        return 5e-4
    if n.type.is_quantized:
        return 1e-2
    return {"F16": 1e-6, "BF16": 5e-5}.get(n.type.name, 1e-6)
