"""Graph plans of the CUDA plugin: each node becomes one or a few launches whose arguments
(a small device array of shapes, strides and op parameters, and the tensors' addresses) are
built once; ``CudaPlan.run`` replays them on the backend's stream, and from the second run
of an unchanged graph on replays a captured CUDA graph instead (ACCELPLANE_CUDA_GRAPHS=0
turns that off), so the per-token host cost does not grow with the node count.

The launches of each op family are built by its module (elementwise, norm, softmax_rope, rows,
reduce, conv, matvec, moe, gemm, attention; fuse for the fused runs), which also declares the
kernels it launches (compiler.family).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
from accelplane.core.fusion import Fusion
from accelplane.core.ops import VIEW_OPS, Op
from accelplane.errors import ComputeError

from . import compiler, conv, elementwise, fuse, layout, matvec, moe, norm, reduce, rows, softmax_rope, tuning
from .args import THREADS
from .launch import Launch, pdl_wanted

# node op → the function that builds its launches
BUILDERS: dict[Op, Callable] = {**elementwise.OPS, **norm.OPS, **softmax_rope.OPS, **rows.OPS, **reduce.OPS,
                                **conv.OPS, **matvec.OPS, **moe.OPS}  # fmt: skip


def _written_buffers(graph) -> set[int]:
    """ids of the buffers that some node of ``graph`` writes (its own tensor; CPY's and
    SET_ROWS's destination)."""
    out = set()
    for n in graph.nodes:
        if n.op is not None and n.op not in VIEW_OPS:
            dst = n.src[1] if n.op is Op.CPY else n.src[0] if n.op is Op.SET_ROWS else n
            out |= {id(n.buffer), id(dst.buffer)}
    return out


class _Params:
    """One read-only parameter array on the device, shared by every plan that asks for the same
    values on that device (``CudaPlan.params``); freed once no plan keeps it."""

    __slots__ = ("arr", "ptr", "__weakref__")

    def __init__(self, arr) -> None:
        self.arr = arr
        self.ptr = np.uint64(arr.data.ptr)


# device ordinal → values → their array. The layers of a model, and the copy-slot plans of a
# decode, launch with equal parameters: one array each keeps the replays' parameter reads in
# fewer cache lines (H100, 8B Q4_0 decode: 0.3 % faster than an array per launch).
_SHARED: dict[int, weakref.WeakValueDictionary] = {}


class CudaPlan:
    """Launches for every node of a graph on one stream, replayed (as a CUDA graph once
    warm) by ``run``. The op modules build launches through ``params``, ``ptr``, ``scratch``
    and ``launch``."""

    def __init__(self, graph, sctx) -> None:
        import cupy as cp

        self.cp = cp
        self.sctx = sctx
        self.tuning = tuning.read()
        self.steps: list[Callable[[], None]] = []
        self.graph_error: str | None = None  # why graph capture failed, if it did
        self.keep: list = []  # device parameter arrays and scratch memory the steps use
        self.kernel_names: list[str] = []  # what each launch runs, in order (tests, debugging)
        self.fused: list[tuple[str, ...]] = []  # the ops of each fused launch (tests, debugging)
        self.uses_index = False  # some kernel may set the index error flag
        self.runs = 0
        self.cuda_graph = None
        self.graph_failed = not self.tuning.graphs
        self.nodes = graph.nodes
        # copies derived from a tensor's contents (the activations quantized for the register
        # mat-vecs, converted to F16 for the grouped products; the route of a layer's ids):
        # (kind, id(t)) → (t, value, index of the node that made it); see derived()
        self.memo: dict[tuple[str, int], tuple] = {}
        self.index = {id(n): i for i, n in enumerate(graph.nodes)}
        self.products: dict[int, list] | None = None  # matvec._products_reading's index
        with cp.cuda.Device(sctx.device):
            self.fns = compiler.device(sctx.device)
            self.pdl = pdl_wanted(self.fns.cc, self.tuning.pdl)
            # buffers some kernel of this graph writes: the register mat-vec waits before reading
            # weights there (kernels/common.cuh: pdl_enter)
            self.written = _written_buffers(graph)
            self._build(graph)
            # parameter uploads went through the legacy stream: finish them before any replay
            cp.cuda.runtime.deviceSynchronize()
        sctx.check_err = sctx.check_err or self.uses_index

    def _build(self, graph) -> None:
        fusion = Fusion(graph)

        def launch(i: int) -> int:  # (the SDK checked that every tensor is allocated)
            covered = fuse.fuse(self, fusion, i, graph.nodes)
            if covered > 1:
                return covered
            n = graph.nodes[i]
            build = BUILDERS.get(n.op)
            if build is None:  # pragma: no cover - supports() keeps these out
                raise ComputeError(f"CUDA plugin has no kernel for {n.op.name}")
            build(self, n)
            return 1

        fusion.walk(launch)

    # --- what the op modules build launches with --------------------------------------------------
    def params(self, vals: list[int]) -> np.uint64:
        """A kernel's parameter array on the device, kept for the plan's life: its address. Kernels
        only read it: other plans with the same values get the same array (use ``zeros`` for
        memory a kernel writes)."""
        key = tuple(int(v) for v in vals)
        shared = _SHARED.setdefault(self.sctx.device, weakref.WeakValueDictionary())
        got = shared.get(key)
        if got is None:
            got = _Params(self.cp.asarray(np.asarray(key, np.int64)))
            shared[key] = got
        self.keep.append(got)
        return got.ptr

    def zeros(self, count: int) -> np.uint64:
        """``count`` zeroed int64 words on the device, this plan's own (kept for its life): their address."""
        arr = self.cp.zeros(max(count, 1), np.int64)
        self.keep.append(arr)
        return np.uint64(arr.data.ptr)

    @staticmethod
    def ptr(t) -> np.uint64:
        return np.uint64(t.buffer.ctx.ptr + t.offs)

    @property
    def err(self) -> np.uint64:
        """The stream's index error flag (plugin.py: ErrFlag), for kernels that check indices."""
        return self.sctx.err.ptr

    def remember(self, kind: str, t, value, node) -> None:
        """Note ``value`` (a copy or table made from ``t``'s contents, in scratch) as made at ``node``."""
        self.memo[(kind, id(t))] = (t, value, self.index[id(node)])

    def derived(self, kind: str, t, node):
        """What ``remember(kind, t, ..)`` noted, if no node between it and ``node`` wrote into
        ``t``'s memory (CPY or SET_ROWS into it, an op on a view of it); else None. Scratch is
        never shared, so only such writes could make the copy stale."""
        got = self.memo.get((kind, id(t)))
        if got is None or got[0] is not t:
            return None
        own = layout.root(t)
        for n in self.nodes[got[2] + 1 : self.index[id(node)]]:
            if n.op is None or n.op in VIEW_OPS:
                continue
            dst = n.src[1] if n.op is Op.CPY else n.src[0] if n.op is Op.SET_ROWS else n
            if layout.root(dst) is own:
                return None
        return got[1]

    def scratch(self, nbytes: int) -> int:
        m = self.cp.cuda.Memory(max(nbytes, 1))
        self.keep.append(m)
        return int(m.ptr)

    def launch(self, name: str, n: int, args: tuple, block: int = THREADS, grid=None, smem: int = 0,
               cluster: int = 1) -> None:  # fmt: skip
        """Queue kernel ``name`` (compiler.name's spelling): on ``grid``, or a grid-stride grid over
        ``n`` items; ``cluster`` > 1: in thread-block clusters of that many blocks along x."""
        self.kernel_names.append(name)
        if grid is None:
            grid = (max(1, min((n + block - 1) // block, 65535)),)
        # a graph's first launch waits for all earlier work in the stream (kernels/common.cuh: pdl_enter)
        pdl = self.pdl and bool(self.steps)
        stream = self.sctx.stream.ptr
        self.steps.append(Launch(name, self.fns[name], grid, (block,), smem, stream, args, pdl, cluster))

    def library_call(self, step: Callable[[], None]) -> None:
        """Queue a library (cuBLAS) call, made on the plan's stream when ``step`` runs."""
        self.steps.append(step)

    # --- replay -------------------------------------------------------------------------------------------
    def run(self) -> None:
        cp = self.cp
        stream = self.sctx.stream
        with cp.cuda.Device(self.sctx.device), stream:
            if self.sctx.recording is not None:  # the backend's stream is being captured
                self.sctx.recording.append(self)  # (kept alive by the recording)
                for s in self.steps:
                    s()
                return
            if self.cuda_graph is not None:
                self.cuda_graph.launch(stream)
                return
            self.runs += 1
            # the first run is eager (it warms library handles and workspaces); from the second
            # on the graph is captured, or stays eager where capture fails (graph_error says why)
            if self.runs >= 2 and not self.graph_failed and self.steps:
                try:
                    self.cuda_graph = self._capture(stream, self.steps)
                except Exception as e:
                    self.graph_error = f"{type(e).__name__}: {e}"
                    self.graph_failed = True
                if self.cuda_graph is not None:
                    self.cuda_graph.launch(stream)
                    return
            for s in self.steps:
                s()

    @staticmethod
    def _capture(stream, steps):
        stream.begin_capture()
        try:
            for s in steps:
                s()
        finally:
            g = stream.end_capture()
        return g
