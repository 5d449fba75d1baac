"""All-reduce for Vulkan devices without peer access: partials staged through host memory.

Default ("host"): every rank downloads its partial into a host-visible area of its device,
a host thread (the first rank's bridge) sums the partials in accelplane.comm's canonical
order and writes the sum back into every rank's area, and every rank uploads it. Each rank
sends and receives the tensor once. The tensor goes in chunks (ACCELPLANE_VK_COMM_CHUNK
bytes, default 4 MiB) queued as download 0, download 1, upload 0, download 2, upload 1, ...
so the host sums chunk c while the devices move chunks c-1 and c+1. Everything is queued on
the streams up front and ordered by timeline semaphores (host bridges), so the caller's host
never blocks, between layers or otherwise.

F32 tensors of at least ACCELPLANE_COMM_COMPRESS_MIN bytes (the SDK's threshold) travel as
F16: each rank converts its partial on the device, the host adds the F16 partials in F32 and
rounds the sum to F16 once, every rank converts it back into its F32 tensor (so all ranks hold
the same bits). ACCELPLANE_VK_COMM_FP32=1 keeps F32 on the wire. Uncompressed F32 results are
byte-identical to the SDK's butterfly and ring (the same canonical order of additions).

ACCELPLANE_VK_COMM_OFF=1 makes comm_init return None, leaving the SDK's butterfly. There is no
peer-memory path (DMA-BUF import between devices): lavapipe and NVIDIA's driver do not
advertise it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from accelplane.core.graph import Context, Graph
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType, np_dtype
from accelplane.errors import ComputeError
from accelplane.runtime.collective import canonical_sum, compress_threshold_default

from .runtime import Memory, Stream
from .tuning import Tuning

T = GGMLType
REDUCIBLE = (T.F32, T.F16, T.BF16)
MAX_GRAPHS = 32  # conversion graphs kept per layout (one pair per tensor seen)


@dataclass
class _Layout:
    """Host areas and device scratch for one (elements, type, wire type)."""

    wire: GGMLType
    nel: int
    host: list[Memory]  # one host-visible area per rank, on that rank's device
    scratch: list[Tensor] = field(default_factory=list)  # F16 images of the partials (compressed)
    buffers: list = field(default_factory=list)  # SDK buffers of the scratch
    graphs: OrderedDict = field(default_factory=OrderedDict)  # (rank, tensor) -> (to wire, from wire)


class VkComm:
    """The communicator of a set of Vulkan backends (one per rank)."""

    def __init__(self, backends, settings: Tuning) -> None:
        self.backends = list(backends)
        self.streams: list[Stream] = [b.ctx for b in self.backends]
        self.layouts: dict[tuple, _Layout] = {}
        self.settings = settings

    # --- entry --------------------------------------------------------------------------------------
    def allreduce(self, tensors: list[Tensor]) -> bool:
        ref = tensors[0]
        if ref.type not in REDUCIBLE or any(not t.is_contiguous() for t in tensors):
            return False
        if ref.nelements == 0:
            return True
        wire = ref.type
        if (
            ref.type == T.F32
            and not self.settings.comm_fp32
            and ref.nbytes >= compress_threshold_default()
        ):
            wire = T.F16
        self._host_reduce(tensors, self._layout(ref, wire))
        return True

    # --- scratch ------------------------------------------------------------------------------------
    def _layout(self, ref: Tensor, wire: GGMLType) -> _Layout:
        key = (ref.nelements, ref.type, wire)
        lay = self.layouts.get(key)
        if lay is not None:
            return lay
        nbytes = ref.nelements * wire.type_size
        lay = _Layout(wire, ref.nelements, [Memory(s.dev, nbytes, host=True) for s in self.streams])
        if wire != ref.type:
            for r, b in enumerate(self.backends):
                t = Context(f"vkcomm{r}").new_tensor_ne(wire, ref.nelements, name=f"vkcomm.h{r}")
                buf = b.device.buffer_type.alloc(b.device.buffer_type.alloc_size(t))
                buf.place(t, 0)
                lay.scratch.append(t)
                lay.buffers.append(buf)
        self.layouts[key] = lay
        return lay

    def _convert_graphs(self, lay: _Layout, r: int, x: Tensor) -> tuple[Graph, Graph]:
        """CPY graphs partial (F32) -> F16 scratch and back, over ``x``'s memory."""
        key = (r, x.uid, x.buffer.uid, x.offs)  # type: ignore[union-attr]
        g = lay.graphs.get(key)
        if g is None:
            h = lay.scratch[r]
            alias = Tensor(x.type, (x.nelements,), name=f"vkcomm.x{r}")
            x.buffer.place(alias, x.offs)  # type: ignore[union-attr]
            ctx = Context("vkcomm")
            down, up = ctx.cpy(alias, h), ctx.cpy(h, alias)
            for node in (down, up):
                node.view_src.buffer.init_view(node)
            g = lay.graphs[key] = (Graph([down]), Graph([up]))
            if len(lay.graphs) > MAX_GRAPHS:
                lay.graphs.popitem(last=False)
        return g

    # --- the host-staged reduction -------------------------------------------------------------------
    def _host_reduce(self, tensors: list[Tensor], lay: _Layout) -> None:
        n, streams = len(tensors), self.streams
        es = lay.wire.type_size
        step = max(1, self.settings.comm_chunk // es)
        chunks = [(lo, min(step, lay.nel - lo)) for lo in range(0, lay.nel, step)]
        compressed = lay.wire != tensors[0].type
        # the device memory that travels: the partial itself, or its F16 image
        src: list[tuple[Memory, int]] = []
        for r, (s, x) in enumerate(zip(streams, tensors, strict=True)):
            if compressed:
                s.plans.get(self._convert_graphs(lay, r, x)[0]).replay()
                h = lay.scratch[r]
                src.append((h.buffer.ctx, h.offs))  # type: ignore[union-attr]
            else:
                src.append((x.buffer.ctx, x.offs))  # type: ignore[union-attr]
        done = [threading.Event() for _ in chunks]
        failed: list[BaseException] = []
        down_values: list[list[int]] = [[0] * len(chunks) for _ in range(n)]
        dtype = np.dtype(np_dtype(lay.wire))
        views = [m.host.view(dtype) for m in lay.host]  # type: ignore[union-attr]

        def reduce(c: int) -> None:  # on the first rank's bridge thread
            lo, ln = chunks[c]
            try:
                for s, vals in zip(streams, down_values, strict=True):
                    s.wait_raw(vals[c], "an all-reduce partial")
                parts = [v[lo : lo + ln] for v in views]
                if compressed:  # F16 partials added in F32, rounded to F16 once
                    total = canonical_sum([p.astype(np.float32) for p in parts]).astype(dtype)
                else:
                    total = canonical_sum(parts)
                for v in views:
                    v[lo : lo + ln] = total
            except BaseException as e:
                failed.append(e)
                raise
            finally:
                done[c].set()  # never leave a queue waiting

        def wait_reduced(c: int):
            def step() -> None:
                done[c].wait()
                if failed:
                    raise ComputeError(f"all-reduce: the host reduction failed: {failed[0]}")

            return step

        def download(r: int, c: int) -> None:
            s, (mem, offs), lo, ln = streams[r], src[r], chunks[c][0] * es, chunks[c][1] * es
            down_values[r][c] = s.copy(mem, offs + lo, lay.host[r], lo, ln, to_host=True)

        def upload(r: int, c: int) -> None:
            s, (mem, offs), lo, ln = streams[r], src[r], chunks[c][0] * es, chunks[c][1] * es
            w = s.bridge_in(None, 0, _bind(reduce, c) if r == 0 else wait_reduced(c))
            s.copy(lay.host[r], lo, mem, offs + lo, ln, ((s.bridge.sem, w),))  # type: ignore[union-attr]

        # download c+1 is queued before upload c: the queue moves the next chunk while the
        # host sums this one (each upload waits for its chunk's sum on the device)
        for r in range(n):
            download(r, 0)
        for c in range(len(chunks)):
            for r in range(n):
                if c + 1 < len(chunks):
                    download(r, c + 1)
                upload(r, c)
        if compressed:
            for r, (s, x) in enumerate(zip(streams, tensors, strict=True)):
                s.plans.get(self._convert_graphs(lay, r, x)[1]).replay()

    # --- release --------------------------------------------------------------------------------------
    def free(self) -> None:
        for s in self.streams:
            if not s.closed:
                s.synchronize()
        for lay in self.layouts.values():
            for m in lay.host:
                m.free()
            for b in lay.buffers:
                b.free()
        self.layouts.clear()


def _bind(fn, c: int):
    return lambda: fn(c)
