"""The CUDA plugin's objects behind the SDK handles (plugin.py's hooks): device, buffer memory,
stream, error flag, recording; and raw copies on CuPy's runtime API.

Listing devices asks the driver (libcuda through ctypes: :func:`probe`), without CuPy; CuPy is
imported when a device opens (its first use: :func:`open_device`), never at module load.
"""

from __future__ import annotations

import bisect
import ctypes
import importlib.util
import weakref
from dataclasses import dataclass

import numpy as np
from accelplane.errors import AllocationError, DeviceError, DLPackError
from accelplane.runtime.plancache import PlanCache

from . import tuning

MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from unified addressing
CC_MAJOR, CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR


def cupy():
    import cupy

    return cupy


@dataclass(frozen=True)
class DevCtx:
    """A device as the driver lists it (``device.ctx``), and the plugin's settings when the
    devices were listed."""

    index: int
    name: str
    cc: tuple[int, int]
    total_memory: int
    tuning: tuning.Tuning


def _driver():
    return ctypes.CDLL("libcuda.so.1")


def probe() -> list[tuple[str, tuple[int, int], int]]:
    """(name, compute capability, memory bytes) of each device the driver lists: cuInit and
    attribute queries of libcuda, no context (no CuPy, no memory on the GPU). DeviceError when
    CuPy, the driver or a device is missing ("no device")."""
    if importlib.util.find_spec("cupy") is None:
        raise DeviceError("no CUDA device: CuPy is not installed (pip install cupy-cuda13x)")
    try:
        cu = _driver()
    except OSError as e:
        raise DeviceError(f"no CUDA device: the NVIDIA driver's libcuda.so.1 does not load ({e})") from None

    def check(r: int, what: str) -> None:
        if r != 0:
            msg = ctypes.c_char_p()
            cu.cuGetErrorName(r, ctypes.byref(msg))
            raise DeviceError(f"no CUDA device: {what}: {(msg.value or b'').decode() or f'CUresult {r}'}")

    check(cu.cuInit(0), "cuInit")
    n = ctypes.c_int()
    check(cu.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
    if n.value == 0:
        raise DeviceError("no CUDA device: the CUDA driver reports 0 devices")
    out = []
    for i in range(n.value):
        dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        total, name = ctypes.c_size_t(), ctypes.create_string_buffer(256)
        check(cu.cuDeviceGet(ctypes.byref(dev), i), f"cuDeviceGet({i})")
        check(cu.cuDeviceGetName(name, len(name), dev), f"cuDeviceGetName({i})")
        check(cu.cuDeviceTotalMem_v2(ctypes.byref(total), dev), f"cuDeviceTotalMem({i})")
        check(cu.cuDeviceGetAttribute(ctypes.byref(major), CC_MAJOR, dev), f"cuDeviceGetAttribute({i})")
        check(cu.cuDeviceGetAttribute(ctypes.byref(minor), CC_MINOR, dev), f"cuDeviceGetAttribute({i})")
        out.append((name.value.decode(errors="replace"), (major.value, minor.value), total.value))
    return out


def open_device(ctx: DevCtx) -> DevCtx:
    """A device's runtime, on its first use: CuPy imported, and the device among CuPy's (the
    runtime sees what the driver listed). Returns ``ctx`` (the hooks reach CuPy through cupy())."""
    n = cupy().cuda.runtime.getDeviceCount()
    if ctx.index >= n:
        raise DeviceError(f"CUDA{ctx.index}: the driver lists it, but CuPy's runtime sees {n} device(s)")
    return ctx


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


# every live PinnedMem as sorted (address, size) pairs (pinned(): a bisection, since experts in
# host memory make many blocks)
_PINNED: list[tuple[int, int]] = []


class PinnedMem:
    """Page-locked host memory (host buffer ctx): numpy view for the host, fast DMA for the GPU."""

    __slots__ = ("mem", "arr", "ptr", "__weakref__")

    def __init__(self, size: int) -> None:
        cp = cupy()
        self.mem = cp.cuda.alloc_pinned_memory(max(size, 1))
        self.arr = np.frombuffer(self.mem, np.uint8, size)
        self.ptr = int(self.mem.ptr)
        entry = (self.ptr, size)
        bisect.insort(_PINNED, entry)
        weakref.finalize(self, _PINNED.remove, entry)


def pinned(addr: int, size: int) -> bool:
    """Whether host bytes ``[addr, addr + size)`` lie in one live PinnedMem."""
    i = bisect.bisect_right(_PINNED, (addr, 1 << 64)) - 1
    return i >= 0 and addr + size <= _PINNED[i][0] + _PINNED[i][1]


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
        self.timeline: list | None = None  # (kind, start event, end event) while noting (timeline_begin)

    def timed(self, kind: str):
        """A context that brackets the work queued inside it with timing events, when a
        timeline is being noted (and the stream is not being captured)."""
        return _Timed(self, kind) if self.timeline is not None and self.recording is None else _UNTIMED

    def timeline_times(self) -> list[tuple[str, float, float]]:
        """The noted work as (kind, start, end) in seconds since the device's epoch event."""
        cp = cupy()
        epoch = _epoch(self.device)
        out = [(k, cp.cuda.get_elapsed_time(epoch, e0) / 1e3, cp.cuda.get_elapsed_time(epoch, e1) / 1e3)
               for k, e0, e1 in self.timeline or []]  # fmt: skip
        self.timeline = None
        return out


class _Timed:
    def __init__(self, sc: StreamCtx, kind: str) -> None:
        self.sc, self.kind = sc, kind

    def __enter__(self) -> None:
        self.e0 = cupy().cuda.Event()
        self.e0.record(self.sc.stream)

    def __exit__(self, *exc) -> None:
        e1 = cupy().cuda.Event()
        e1.record(self.sc.stream)
        self.sc.timeline.append((self.kind, self.e0, e1))


class _Untimed:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


_UNTIMED = _Untimed()
_EPOCHS: dict[int, object] = {}


def _epoch(device: int):
    """The device's timeline origin: an event recorded once on an idle stream of its own, so
    it completes as it is issued, before any work noted after it."""
    ev = _EPOCHS.get(device)
    if ev is None:
        cp = cupy()
        with cp.cuda.Device(device):
            st = cp.cuda.Stream(non_blocking=True)
            ev = _EPOCHS[device] = cp.cuda.Event()
            ev.record(st)
            ev.synchronize()
    return ev


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


def memcpy(dst: int, src: int, size: int, *, to_host: bool = False) -> None:
    """A blocking copy (docs/ordering.md rule 4): complete on return. cudaMemcpy returns before
    its DMA ends for a device→device copy and for one from pageable host memory (once staged),
    and the plugin's non-blocking streams do not wait for the legacy stream it ran on: wait for
    that stream then. A copy to the host (``to_host``) or from pinned memory is synchronous
    already, and skips the wait."""
    cp = cupy()
    cp.cuda.runtime.memcpy(dst, src, size, MEMCPY_DEFAULT)
    if not to_host and not pinned(src, size):
        cp.cuda.Stream.null.synchronize()


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
        memcpy(out.ctypes.data, mem.ptr + off, n, to_host=True)
        return out

    return write, read
