"""A graph recorded once into a command buffer, replayed with one submit.

Recording binds, per dispatch: the pipeline (shader + specialization constants), a
descriptor set over the four tensors' buffers (sets shared by dispatches that bind the same
buffers), the push constants and the workgroup grid. A barrier goes in only where a dispatch
touches memory that an earlier dispatch since the last barrier wrote (or writes memory one
read), so independent nodes run together.

Some kernels work on a derived copy of a source (kernels.Scratch: mul_mat_vec_q8's int8
activations): the plan owns one scratch buffer with a region per copy, made once and shared
by every later dispatch that wants the same copy, until a node writes the source's memory.
"""

from __future__ import annotations

import struct
import weakref

from accelplane.core.fusion import Fusion
from accelplane.core.tensor import Tensor
from accelplane.errors import ComputeError, UnsupportedOpError
from accelplane.runtime.progress import phase

from . import kernels
from .runtime import N_BINDINGS, NULL, Memory, Stream, V, check, cmd_barrier, create, ffi, lib, new_struct

_WHOLE = 0xFFFFFFFFFFFFFFFF  # VK_WHOLE_SIZE (the bindings spell it -1)
_SCRATCH = object()  # stands for the plan's scratch buffer until it is allocated
_REGION_ALIGN = 256


def _mem(t: Tensor, node: Tensor, dev) -> Memory:
    label = t.name or f"#{t.uid}"
    if t.buffer is None:
        raise ComputeError(f"{node.op.name} {node.name or node.uid}: tensor {label} is not allocated")
    mem = t.buffer.ctx
    if not isinstance(mem, Memory) or mem.dev is not dev:
        raise ComputeError(
            f"{node.op.name} {node.name or node.uid}: tensor {label} is in buffer "
            f"{t.buffer.name!r}, which {dev.label} cannot compute on"
        )
    return mem


def grid(groups: int, limits: tuple[int, int, int]) -> tuple[int, int, int]:
    """Spread ``groups`` workgroups over x, y, z within maxComputeWorkGroupCount."""
    x = min(groups, limits[0])
    y = -(-groups // x)
    z = 1
    if y > limits[1]:
        z = -(-y // limits[1])
        y = limits[1]
    return x, y, z


class Plan:
    """``graph`` bound to its memory on ``stream``'s device; ``replay()`` queues it."""

    def __init__(self, stream: Stream, graph, caps: kernels.Caps) -> None:
        dev = stream.dev
        self.stream = stream
        self.mems: dict[int, Memory] = {}
        self.fused: list[tuple[str, ...]] = []  # the ops of each fused dispatch (tests, debugging)
        regions = _Regions()
        work = self._build(dev, graph, caps, regions)
        # one buffer for every region; freed once the work queued before the plan's end is done
        self.scratch = Memory(dev, regions.size, host=False) if regions.size else None
        if self.scratch is not None:
            weakref.finalize(self, self.scratch.free)
            for w in work:
                w.resolve(self.scratch)
        self.n_dispatches = len(work)
        self._last = [0]  # value of the last submit (a cell shared with the finalizer)
        self.pool, sets = self._descriptor_sets(dev, work)
        self.cmd = stream.alloc_cmd()
        self._finalizer = weakref.finalize(self, stream.retire, self._last, _destroyer(dev, stream, self))
        self._record(dev, work, sets)
        stream.stats["plans_recorded"] += 1
        stream.stats["dispatches_recorded"] += len(work)

    def _build(self, dev, graph, caps: kernels.Caps, regions: _Regions) -> list[_Work]:
        """The dispatches of the graph's compute nodes, their memory and ranges resolved."""
        work: list[_Work] = []
        fusion = Fusion(graph)

        def record(i: int) -> int:
            node = graph.nodes[i]
            n_nodes, ds = self._node_dispatches(dev, graph.nodes, i, caps, fusion)
            for d in ds:
                w = _Work.of(d, node, dev)
                if d.scratch is not None and not regions.bind(w, d, _mem(d.scratch.src, node, dev)):
                    continue  # this copy was made earlier and its source is unchanged
                regions.invalidate(w.write)
                work.append(w)
            return n_nodes

        fusion.walk(record)
        return work

    def _node_dispatches(self, dev, nodes, i: int, caps: kernels.Caps, fusion: Fusion):
        """(nodes covered, dispatches) of node ``i``: fused with the nodes after it where
        kernels.fused_dispatches applies, else alone; every tensor read is checked and kept."""
        node = nodes[i]
        self._use(node, dev)
        if not kernels.supports(node, caps):
            raise UnsupportedOpError(
                f"Vulkan {dev.label}: {node.op.name} {node.type.name} ne={list(node.ne)} is not supported"
            )
        n_fused, ds = kernels.fused_dispatches(nodes, i, fusion)
        if not n_fused:
            return 1, kernels.dispatches(node, caps)
        self.fused.append(tuple(n.op.name for n in nodes[i : i + n_fused]))
        for n in nodes[i + 1 : i + n_fused]:
            self._use(n, dev)
        return n_fused, ds

    def _use(self, node: Tensor, dev) -> None:
        """The memory of ``node`` and its sources (the SDK checks it for being freed)."""
        for t in (node, *node.src):
            if t is not None:
                m = _mem(t, node, dev)
                self.mems[id(m)] = m

    def _descriptor_sets(self, dev, work) -> tuple[object, dict]:
        keys = list(dict.fromkeys(self._set_key(w.mems) for w in work))
        if not keys:
            return None, {}
        n = len(keys)
        size = ffi.new(
            "VkDescriptorPoolSize*",
            {"type": V.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, "descriptorCount": N_BINDINGS * n},
        )
        pci = new_struct(
            "VkDescriptorPoolCreateInfo",
            V.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
            maxSets=n,
            poolSizeCount=1,
            pPoolSizes=size,
        )
        pool = create("DescriptorPool", dev.handle, pci)
        layouts = ffi.new("VkDescriptorSetLayout[]", [dev.set_layout] * n)
        ai = new_struct(
            "VkDescriptorSetAllocateInfo",
            V.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO,
            descriptorPool=pool,
            descriptorSetCount=n,
            pSetLayouts=layouts,
        )
        handles = ffi.new("VkDescriptorSet[]", n)
        check(lib.vkAllocateDescriptorSets(dev.handle, ai, handles), "vkAllocateDescriptorSets")
        infos = ffi.new("VkDescriptorBufferInfo[]", N_BINDINGS * n)
        writes = ffi.new("VkWriteDescriptorSet[]", N_BINDINGS * n)
        for s, key in enumerate(keys):
            for b in range(N_BINDINGS):
                i = N_BINDINGS * s + b
                infos[i].buffer, infos[i].offset, infos[i].range = key[b], 0, _WHOLE
                w = writes[i]
                w.sType = V.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET
                w.dstSet, w.dstBinding, w.descriptorCount = handles[s], b, 1
                w.descriptorType = V.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
                w.pBufferInfo = infos + i
        lib.vkUpdateDescriptorSets(dev.handle, N_BINDINGS * n, writes, 0, NULL)
        return pool, {k: handles[s] for s, k in enumerate(keys)}

    def _set_key(self, mems) -> tuple:
        """The buffers of bindings A, B, C, D (an unused one repeats D) and the error word."""
        d = mems[3]
        return (*((m if m is not None else d).buf for m in mems), self.stream.err.buf)

    def _record(self, dev, work, sets) -> None:
        # the driver compiles each pipeline it has not made yet (lavapipe: to LLVM, seconds for a
        # model's first graph): made first, so a terminal is told
        new = sorted({(w.d.shader, w.d.spec) for w in work} - dev.pipelines.keys())
        if new:
            with phase(f"vulkan: {dev.label}: compiling {len(new)} pipeline{'s' * (len(new) != 1)}"):
                for shader, spec in new:
                    dev.pipeline(shader, spec)
        stream, cmd = self.stream, self.cmd
        stream.begin(V.VK_COMMAND_BUFFER_USAGE_SIMULTANEOUS_USE_BIT, cmd)
        limits = dev.phys.limits["maxComputeWorkGroupCount"]
        layout = dev.pipeline_layout
        bound_pipe = bound_set = None
        reads: list[tuple[int, int, int]] = []  # (buffer id, start, end) since the last barrier
        writes: list[tuple[int, int, int]] = []
        for w in work:
            d, mems = w.d, w.mems
            rr = [(id(m), a, b) for m, a, b in w.reads]
            ww = [(id(w.write[0]), w.write[1], w.write[2])]
            if _overlap(rr, writes) or _overlap(ww, writes) or _overlap(ww, reads):
                cmd_barrier(
                    cmd,
                    V.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                    V.VK_ACCESS_SHADER_WRITE_BIT,
                    V.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                    V.VK_ACCESS_SHADER_READ_BIT | V.VK_ACCESS_SHADER_WRITE_BIT,
                )
                reads, writes = [], []
            reads += rr
            writes += ww
            pipe = dev.pipeline(d.shader, d.spec)
            if pipe != bound_pipe:
                lib.vkCmdBindPipeline(cmd, V.VK_PIPELINE_BIND_POINT_COMPUTE, pipe)
                bound_pipe = pipe
            ds = sets[self._set_key(mems)]
            if ds != bound_set:
                arr = ffi.new("VkDescriptorSet[1]", [ds])
                lib.vkCmdBindDescriptorSets(cmd, V.VK_PIPELINE_BIND_POINT_COMPUTE, layout, 0, 1, arr, 0, NULL)
                bound_set = ds
            pc = ffi.new("char[]", w.push)
            lib.vkCmdPushConstants(cmd, layout, V.VK_SHADER_STAGE_COMPUTE_BIT, 0, len(w.push), pc)
            lib.vkCmdDispatch(cmd, *grid(d.groups, limits))
        # the error word is read by the host after the stream's value completes
        cmd_barrier(
            cmd,
            V.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
            V.VK_ACCESS_SHADER_WRITE_BIT,
            V.VK_PIPELINE_STAGE_HOST_BIT,
            V.VK_ACCESS_HOST_READ_BIT,
        )
        check(lib.vkEndCommandBuffer(cmd), "vkEndCommandBuffer")

    def replay(self) -> int:
        v = self.stream.run_recorded(self.cmd)
        self._last[0] = v
        return v


class _Work:
    """A dispatch as recorded: its memories (scratch resolved), push constants (region offset
    written in), and the ranges (memory, start, end) it reads and writes."""

    __slots__ = ("d", "mems", "push", "reads", "write")

    def __init__(self, d: kernels.Dispatch, mems: list, push: bytes) -> None:
        self.d, self.mems, self.push = d, mems, push
        self.reads: list[tuple] = []
        self.write: tuple | None = None

    @classmethod
    def of(cls, d: kernels.Dispatch, node: Tensor, dev) -> _Work:
        w = cls(d, [_mem(t, node, dev) if t is not None else None for t in d.bindings], d.push)
        w.reads = [
            (w.mems[i], t.offs, t.offs + t.nbytes) for i, t in enumerate(d.bindings[:3]) if t is not None
        ]
        t = d.bindings[3]
        w.write = (w.mems[3], t.offs, t.offs + t.nbytes) if t is not None else None
        return w

    def resolve(self, scratch: Memory) -> None:
        """Put the plan's scratch buffer where _SCRATCH stands for it."""
        self.mems = [scratch if m is _SCRATCH else m for m in self.mems]
        self.reads = [(scratch if r[0] is _SCRATCH else r[0], r[1], r[2]) for r in self.reads]
        if self.write is not None and self.write[0] is _SCRATCH:
            self.write = (scratch, self.write[1], self.write[2])


class _Regions:
    """The regions of the plan's scratch buffer: one per derived copy (kernels.Scratch), live
    and shared by later readers until a dispatch writes the copy's source memory."""

    def __init__(self) -> None:
        self.live: dict[tuple, tuple[int, tuple]] = {}  # key -> (offset, source range)
        self.size = 0

    def bind(self, w: _Work, d: kernels.Dispatch, sm: Memory) -> bool:
        """Bind ``w``'s scratch slot to its region (made for a writer); False for a writer whose
        copy is live already (the dispatch is left out)."""
        sc = d.scratch
        assert sc is not None
        src = sc.src
        key = (id(sm), src.offs, tuple(src.ne), tuple(src.nb), src.type, sc.nbytes)
        if sc.write:
            if key in self.live:
                return False
            off = -(-self.size // _REGION_ALIGN) * _REGION_ALIGN
            self.size = off + sc.nbytes
            self.live[key] = (off, (sm, src.offs, src.offs + src.nbytes))
        off = self.live[key][0]
        w.mems[sc.slot] = _SCRATCH
        rng = (_SCRATCH, off, off + sc.nbytes)
        if sc.write:
            w.write = rng
        else:
            w.reads.append(rng)
        w.push = d.push[: sc.push_at] + struct.pack("<I", off // 4) + d.push[sc.push_at + 4 :]
        return True

    def invalidate(self, write: tuple | None) -> None:
        """Drop the copies whose source ``write`` (a range a dispatch writes) overwrites."""
        if write is not None and write[0] is not _SCRATCH:
            for k in [k for k, (_, r) in self.live.items() if _overlap([r], [write])]:
                del self.live[k]


def _overlap(a: list[tuple], b: list[tuple]) -> bool:
    return any(x[0] == y[0] and x[1] < y[2] and y[1] < x[2] for x in a for y in b)


def _destroyer(dev, stream: Stream, plan: Plan):
    """Release the plan's command buffer and descriptor pool (without keeping the plan alive)."""
    cmd, pool = plan.cmd, plan.pool

    def destroy() -> None:
        if not stream.closed:
            arr = ffi.new("VkCommandBuffer[1]", [cmd])
            lib.vkFreeCommandBuffers(dev.handle, stream.pool, 1, arr)
        if pool is not None:
            lib.vkDestroyDescriptorPool(dev.handle, pool, NULL)

    return destroy
