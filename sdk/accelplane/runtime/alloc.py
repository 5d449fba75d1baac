"""Allocation: tensors of a context into buffers (multi-buffer past the max size), and the
graph allocator (ggml-alloc's gallocr): memory of intermediate tensors is reused once their
last consumer has run, and an op computes in place over its first source where allowed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from accelplane.core.ops import INPLACE_OPS, VIEW_OPS
from accelplane.core.tensor import Tensor, TensorFlag, memory_owner, owners_to_keep
from accelplane.errors import AllocationError, TypeMismatchError
from accelplane.runtime.backend import Buffer, BufferType, BufferUsage, MultiBuffer

if TYPE_CHECKING:
    from accelplane.core.graph import Graph

# flags of tensors whose memory must outlive the graph (or be there before it runs)


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _check_buft(buft: object, usage: object = BufferUsage.WEIGHTS) -> None:
    """A typed error, naming what to pass, for the mistakes a caller makes here."""
    if not isinstance(buft, BufferType):
        raise TypeMismatchError(f"expected a BufferType (such as device.buffer_type), got "
                                f"{type(buft).__name__}")
    if not isinstance(usage, BufferUsage):
        raise TypeMismatchError(f"usage must be a BufferUsage, got {usage!r}")


def alloc_tensors(
    tensors: Iterable[Tensor], buft: BufferType, usage: BufferUsage = BufferUsage.WEIGHTS
) -> Buffer | None:
    """Place every unallocated non-view tensor in new buffer(s) of ``buft`` and bind views
    (ggml_backend_alloc_ctx_tensors_from_buft). Tensors are packed in order; when the next one
    would pass the buffer type's max size a new buffer starts, and the buffers are returned as
    one MultiBuffer. Returns None when nothing needed memory."""
    _check_buft(buft, usage)
    tensors = list(tensors)
    bad = next((t for t in tensors if not isinstance(t, Tensor)), None)
    if bad is not None:
        raise TypeMismatchError(f"alloc_tensors takes Tensors, got {type(bad).__name__}")
    chunks: list[list[tuple[Tensor, int]]] = [[]]
    sizes = [0]
    for t in tensors:
        if t.buffer is not None or t.view_src is not None:
            continue
        need = buft.alloc_size(t)
        if need > buft.max_size:
            raise AllocationError(
                f"tensor {t.name or t.uid!r} needs {need} bytes, more than {buft.name}'s max "
                f"buffer size {buft.max_size}"
            )
        offs = _align(sizes[-1], buft.alignment)
        if offs + need > buft.max_size and chunks[-1]:
            chunks.append([])
            sizes.append(0)
            offs = 0
        chunks[-1].append((t, offs))
        sizes[-1] = offs + need
    if not chunks[0]:
        _bind_views(tensors)
        return None
    parts = []
    for chunk, size in zip(chunks, sizes, strict=True):
        buf = buft.alloc(size, usage)
        for t, offs in chunk:
            buf.place(t, offs)
        parts.append(buf)
    _bind_views(tensors)
    return parts[0] if len(parts) == 1 else MultiBuffer(buft, parts, usage)


def alloc_ctx_tensors(ctx, buft: BufferType, usage: BufferUsage = BufferUsage.WEIGHTS):
    """All leaf tensors of a Context (see :func:`alloc_tensors`); its views of them are bound
    too, as ggml binds every view in the context."""
    if not hasattr(ctx, "tensors") or not hasattr(ctx, "views"):
        raise TypeMismatchError(f"alloc_ctx_tensors takes a Context, got {type(ctx).__name__}")
    return alloc_tensors(list(ctx.tensors) + list(ctx.views), buft, usage)


def _bind_views(tensors: Iterable[Tensor]) -> None:
    for t in tensors:
        if t.view_src is not None and t.buffer is None and t.view_src.buffer is not None:
            t.view_src.buffer.init_view(t)


@dataclass
class _Block:
    chunk: int
    offs: int
    size: int


class _FreeList:
    """First-fit allocator over chunks of at most ``max_size`` bytes (ggml_dyn_tallocr)."""

    def __init__(self, alignment: int, max_size: int) -> None:
        self.alignment = alignment
        self.max_size = max_size
        self.free: list[list[tuple[int, int]]] = [[(0, max_size)]]  # per chunk: (offs, size)
        self.high: list[int] = [0]

    def alloc(self, size: int) -> _Block:
        size = max(_align(size, self.alignment), self.alignment)
        if size > self.max_size:
            raise AllocationError(f"a tensor of {size} bytes exceeds the max buffer size")
        for c, blocks in enumerate(self.free):
            for i, (offs, bsize) in enumerate(blocks):
                if bsize >= size:
                    if bsize == size:
                        blocks.pop(i)
                    else:
                        blocks[i] = (offs + size, bsize - size)
                    self.high[c] = max(self.high[c], offs + size)
                    return _Block(c, offs, size)
        self.free.append([(size, self.max_size - size)])
        self.high.append(size)
        return _Block(len(self.free) - 1, 0, size)

    def release(self, b: _Block) -> None:
        blocks = self.free[b.chunk]
        blocks.append((b.offs, b.size))
        blocks.sort()
        merged: list[tuple[int, int]] = []
        for offs, size in blocks:
            if merged and merged[-1][0] + merged[-1][1] == offs:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((offs, size))
        self.free[b.chunk] = merged


class GraphAllocator:
    """Places a graph's unallocated tensors in compute buffer(s) of one buffer type, reusing
    memory. Buffers are kept and grown across calls (ggml_gallocr_reserve / alloc_graph).

    Rules: inputs (TensorFlag.INPUT) are allocated first and never reused; memory is
    released after the last node that reads it, directly or through any view of it; the
    memory owner (:func:`memory_owner`) of every tensor flagged INPUT, OUTPUT or PARAM, of
    every tensor in the graph's ``keep`` and in alloc_graph's ``keep`` is never released nor
    computed over in place (:func:`owners_to_keep`), so a graph output that is a view keeps
    the tensor it views; a view no node of the graph reads keeps its owner too (its readers
    are elsewhere); a node whose op allows it takes over its first source's memory when that
    source is an intermediate of the same layout that nothing else reads, directly or through
    a view; tensors already in a buffer (weights) are left alone.
    """

    def __init__(self, buft: BufferType) -> None:
        _check_buft(buft)
        self.buft = buft
        self.buffers: list[Buffer] = []
        self._placed: dict[int, tuple[int, int]] = {}  # graph uid -> (generation, n placed)
        self._generation = 0
        self._mine: set[int] = set()  # uids of every buffer this allocator made
        self.n_inplace = 0  # nodes computed in place in the last planned graph

    def owns(self, buffer: Buffer) -> bool:
        """Whether this allocator made ``buffer``."""
        return buffer.uid in self._mine

    def free(self) -> None:
        for b in self.buffers:
            b.free()
        self.buffers = []

    @staticmethod
    def _protected(graph: Graph, pinned: frozenset[int]) -> frozenset[int]:
        """ids of the memory owners this plan must keep to the end (class docstring)."""
        seen: dict[int, Tensor] = {}
        read: set[int] = set()
        for t in list(graph.leafs) + list(graph.nodes):
            seen[id(t)] = t
            for s in t.src:
                if s is not None:
                    seen[id(s)] = s
                    read.add(id(s))
        kept = [t for i, t in seen.items() if i in pinned]
        # a view nobody here reads is read outside this graph (or is what the caller wants)
        kept += [n for n in graph.nodes if n.view_src is not None and id(n) not in read]
        return owners_to_keep(seen.values(), kept) | pinned | (graph.keep or frozenset())

    def _plan(self, graph: Graph, pinned: frozenset[int]) -> tuple[list[tuple[Tensor, _Block]], list[int]]:
        fl = _FreeList(self.buft.alignment, self.buft.max_size)
        owned: dict[int, _Block] = {}  # id(tensor) -> block, for tensors this plan places
        protected = self._protected(graph, pinned)
        # per memory owner: the index of the last node reading it (directly or through a
        # view), and how many references to it there are (sources and view nodes)
        last: dict[int, int] = {}
        refs: dict[int, int] = {}
        for i, n in enumerate(graph.nodes):
            for s in n.src:
                if s is not None:
                    o = id(memory_owner(s))
                    last[o] = i
                    refs[o] = refs.get(o, 0) + 1
            if n.view_src is not None:
                o = id(memory_owner(n))
                refs[o] = refs.get(o, 0) + 1
        plan: list[tuple[Tensor, _Block]] = []
        self.n_inplace = 0

        mine = self._mine

        def needs(t: Tensor) -> bool:
            # unallocated, or placed earlier by this allocator (re-planned now)
            return (
                t.view_src is None
                and id(t) not in owned
                and (t.buffer is None or t.buffer.uid in mine)
            )

        def place(t: Tensor, blk: _Block) -> None:
            owned[id(t)] = blk
            plan.append((t, blk))

        # inputs first, so nothing ever overlaps them
        for t in list(graph.leafs) + list(graph.nodes):
            if t.flags & TensorFlag.INPUT:
                o = memory_owner(t)
                if needs(o):
                    place(o, fl.alloc(self.buft.alloc_size(o)))
        for t in graph.leafs:
            if needs(t):
                place(t, fl.alloc(self.buft.alloc_size(t)))

        for i, n in enumerate(graph.nodes):
            if n.op not in VIEW_OPS and needs(n):
                s0 = n.src[0] if n.src else None
                if (
                    n.op in INPLACE_OPS
                    and s0 is not None
                    and s0.view_src is None
                    and id(s0) in owned
                    and id(s0) not in protected
                    and refs.get(id(s0), 0) == 1  # n's src[0] is the only use of its memory
                    and s0.type == n.type
                    and s0.nb == n.nb
                    and s0.ne == n.ne
                ):
                    place(n, owned.pop(id(s0)))  # s0's memory is n's now (never freed as s0)
                    self.n_inplace += 1
                else:
                    place(n, fl.alloc(self.buft.alloc_size(n)))
            # release memory whose last reader was this node
            for s in n.src:
                if s is None:
                    continue
                o = id(memory_owner(s))
                if last[o] == i and o in owned and o not in protected:
                    fl.release(owned.pop(o))
        return plan, fl.high

    def alloc_graph(self, graph: Graph, keep: frozenset[int] = frozenset()) -> None:
        """Place every unallocated tensor of ``graph`` and bind its views. The memory of the
        tensors whose id() is in ``keep`` (of their memory owners, for views the graph
        references) is never freed nor computed over in place (e.g. the scheduler's sources
        of cross-backend copies; :func:`owners_to_keep` gives owner ids). Re-planning happens
        only for a graph not seen since the buffers last changed; graph.layout_version is
        bumped only when placements actually change."""
        seen = self._placed.get(graph.uid)
        if seen is not None and seen[0] == self._generation:
            return
        plan, high = self._plan(graph, keep)
        # grow buffers where the plan needs more (keeps earlier graphs' layouts valid
        # only if nothing grew; otherwise they are re-placed on their next alloc)
        grew = False
        for c, size in enumerate(high):
            if c < len(self.buffers) and self.buffers[c].size >= size:
                continue
            if c < len(self.buffers):
                self.buffers[c].free()
                self.buffers[c] = self.buft.alloc(size, BufferUsage.COMPUTE)
            else:
                self.buffers.append(self.buft.alloc(size, BufferUsage.COMPUTE))
            self._mine.add(self.buffers[c].uid)
            grew = True
        if grew:
            self._generation += 1
        changed = False
        for t, blk in plan:
            buf = self.buffers[blk.chunk]
            if t.buffer is not buf or t.offs != blk.offs:
                changed = True
            buf.place(t, blk.offs)
        for n in graph.nodes:
            if n.view_src is not None and n.view_src.buffer is not None:
                if n.buffer is not n.view_src.buffer or n.offs != n.view_src.offs + n.view_offs:
                    changed = True
                n.view_src.buffer.init_view(n)
        if changed:
            graph.layout_version += 1
        self._placed[graph.uid] = (self._generation, len(plan))

    def reset(self, graph: Graph) -> None:
        """Forget placements this allocator made for ``graph`` (they will be re-planned)."""
        self._placed.pop(graph.uid, None)
