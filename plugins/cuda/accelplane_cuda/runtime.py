"""The CUDA plugin's objects behind the SDK handles (plugin.py's hooks): device, buffer memory,
stream, error flag, recording; and raw copies on CuPy's runtime API.

CuPy is imported on first use (:func:`cupy`), never at module load.
"""

from __future__ import annotations

import numpy as np
from accelplane.errors import AllocationError, DLPackError
from accelplane.runtime.plancache import PlanCache

from . import tuning

MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from unified addressing


def cupy():
    import cupy

    return cupy


class DevCtx:
    """A device: its index and properties, and the plugin's settings when the devices opened."""

    def __init__(self, index: int, props: dict, settings: tuning.Tuning) -> None:
        self.index = index
        self.props = props
        self.tuning = settings


class DevMem:
    """cudaMalloc'd bytes (device buffer ctx)."""

    __slots__ = ("mem", "ptr", "size", "device", "repack")

    def __init__(self, size: int, device: int, repack: bool = False) -> None:
        cp = cupy()
        with cp.cuda.Device(device):
            try:
                self.mem = cp.cuda.Memory(max(size, 1))
            except cp.cuda.memory.OutOfMemoryError as e:
                raise AllocationError(f"CUDA{device}: cannot allocate {size} bytes: {e}") from e
        self.ptr = int(self.mem.ptr)
        self.size = size
        self.device = device
        self.repack = repack  # a weights buffer: Q4_0/Q8_0/Q4_K weights take the x8 layouts (layout.py)

    @classmethod
    def wrap(cls, ptr: int, size: int, device: int, owner) -> DevMem:
        """Another library's device memory at ``ptr`` (a DLPack import), kept alive through
        ``owner``. The producer ordered its work before the legacy default stream (it was asked
        with stream=None), which the plugin's non-blocking streams do not wait for: the host
        waits for it here, once."""
        cp = cupy()
        self = cls.__new__(cls)
        with cp.cuda.Device(device):
            cp.cuda.Stream.null.synchronize()
            self.mem = cp.cuda.UnownedMemory(ptr, max(size, 1), owner, device)
        self.ptr, self.size, self.device, self.repack = ptr, size, device, False
        return self


class PinnedMem:
    """Page-locked host memory (host buffer ctx): numpy view for the host, fast DMA for the GPU."""

    __slots__ = ("mem", "arr", "ptr")

    def __init__(self, size: int) -> None:
        cp = cupy()
        self.mem = cp.cuda.alloc_pinned_memory(max(size, 1))
        self.arr = np.frombuffer(self.mem, np.uint8, size)
        self.ptr = int(self.mem.ptr)


class ErrFlag:
    """The int32 that kernels set on a bad row or expert index (1) or a peer that never joined
    an all-reduce (2), in page-locked host memory: with unified addressing a kernel writes it
    through the host pointer, and the host reads it after a stream synchronization with no
    device-to-host copy (one per synchronize before; a decode synchronizes several times)."""

    __slots__ = ("mem", "arr", "ptr")

    def __init__(self) -> None:
        self.mem = cupy().cuda.alloc_pinned_memory(4)
        self.arr = np.frombuffer(self.mem, np.int32, 1)
        self.arr[0] = 0
        self.ptr = np.uint64(self.mem.ptr)  # a kernel argument


class StreamCtx:
    """A backend: one non-blocking stream, its error flag, its plans, and the settings when it
    started."""

    def __init__(self, device: int) -> None:
        cp = cupy()
        with cp.cuda.Device(device):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.err = ErrFlag()
            cp.cuda.runtime.deviceSynchronize()
        self.device = device
        self.tuning = tuning.read()
        self.check_err = False
        self.plans = PlanCache(lambda g, s=self: _build_plan(g, s))
        self.recording: list | None = None  # plans run while the stream is captured (record_begin)


def _build_plan(graph, sctx: StreamCtx):
    from .plan import CudaPlan

    return CudaPlan(graph, sctx)


class Recording:
    """One CUDA graph of everything queued between record_begin and record_end."""

    def __init__(self, graph, plans: list) -> None:
        self.graph = graph
        self.plans = plans  # their parameter arrays and scratch are what the graph's kernels read


STREAM_LEGACY = 1  # cudaStreamLegacy


def dlpack_wait(device: int, streams: list, stream) -> None:
    """Make a DLPack consumer's ``stream`` (the array API's CUDA values: None or 1 the legacy
    default stream, 2 the per-thread one, else a cudaStream_t) wait, device-side, for the work
    queued on ``streams`` (the device's backends) and on the legacy default stream (where the
    blocking buffer copies run): an event recorded on each, waited for on ``stream``."""
    if stream is None:
        stream = STREAM_LEGACY
    if not isinstance(stream, int) or isinstance(stream, bool) or stream < 1:
        raise DLPackError(f"CUDA{device}: DLPack stream {stream!r} is not a CUDA stream (None, 1 the legacy "
                          "default stream, 2 the per-thread one, a cudaStream_t, or -1 for no ordering; "
                          "0 is ambiguous)")  # fmt: skip
    cp = cupy()
    rt = cp.cuda.runtime
    with cp.cuda.Device(device):
        for s in [*streams, STREAM_LEGACY]:
            ev = rt.eventCreateWithFlags(rt.eventDisableTiming)
            try:
                rt.eventRecord(ev, s)
                rt.streamWaitEvent(stream, ev, 0)
            finally:
                rt.eventDestroy(ev)  # released once it has completed


def address(t) -> int:
    return t.buffer.ctx.ptr + t.offs


def memcpy(dst: int, src: int, size: int) -> None:
    cupy().cuda.runtime.memcpy(dst, src, size, MEMCPY_DEFAULT)


def memset(mem: DevMem, ptr: int, value: int, size: int) -> None:
    cp = cupy()
    with cp.cuda.Device(mem.device):  # cudaMemset acts on the current device's memory only
        cp.cuda.runtime.memset(ptr, value, size)


def raw_io(mem: DevMem):
    """(write(offset, uint8 array), read(offset, nbytes) → array) on a buffer's bytes."""

    def write(off: int, arr: np.ndarray) -> None:
        memcpy(mem.ptr + off, arr.ctypes.data, arr.nbytes)

    def read(off: int, n: int) -> np.ndarray:
        out = np.empty(n, np.uint8)
        memcpy(out.ctypes.data, mem.ptr + off, n)
        return out

    return write, read
