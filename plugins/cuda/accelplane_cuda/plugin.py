"""accelplane's CUDA plugin on CuPy.

One stream per Backend (non-blocking CUDA streams), CUDA events for events, device memory
from cudaMalloc, a pinned host buffer type for truly asynchronous host→device copies,
cpy_tensor_async between CUDA devices (peer copies) and from host buffers of CPU backends
(llama.cpp #17795's copy_from_host). Kernels are CUDA C compiled by NVRTC (kernels.cu);
matrix products of float weights and large batches go through cuBLAS. graph_compute plans a
graph once and, from the second run of an unchanged graph on, replays it as a CUDA graph.

Nothing heavy is imported at module load: CuPy is imported in get_devices.
"""

from __future__ import annotations

import numpy as np
from accelplane.errors import AllocationError, CommTimeoutError, ComputeError, DeviceError
from accelplane.interface import BufferTypeSpec, DeviceCaps, DeviceSpec, DeviceType, hookimpl
from accelplane.runtime.backend import BufferUsage
from accelplane.runtime.plancache import PlanCache

from . import (
    layout,  # numpy and the SDK only: nothing heavy at import
    tuning,
)

ALIGNMENT = 256
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from unified addressing


def _cp():
    import cupy

    return cupy


class DevCtx:
    def __init__(self, index: int, props: dict) -> None:
        self.index = index
        self.props = props


class DevMem:
    """cudaMalloc'd bytes (device buffer ctx)."""

    __slots__ = ("mem", "ptr", "size", "device", "repack")

    def __init__(self, size: int, device: int, repack: bool = False) -> None:
        cp = _cp()
        with cp.cuda.Device(device):
            try:
                self.mem = cp.cuda.Memory(max(size, 1))
            except cp.cuda.memory.OutOfMemoryError as e:
                raise AllocationError(f"CUDA{device}: cannot allocate {size} bytes: {e}") from e
        self.ptr = int(self.mem.ptr)
        self.size = size
        self.device = device
        self.repack = repack  # Q4_0/Q8_0 weights take the x8 layouts (layout.py)


class PinnedMem:
    """Page-locked host memory (host buffer ctx): numpy view for the host, fast DMA for the GPU."""

    __slots__ = ("mem", "arr", "ptr")

    def __init__(self, size: int) -> None:
        cp = _cp()
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
        self.mem = _cp().cuda.alloc_pinned_memory(4)
        self.arr = np.frombuffer(self.mem, np.int32, 1)
        self.arr[0] = 0
        self.ptr = np.uint64(self.mem.ptr)  # a kernel argument


class StreamCtx:
    def __init__(self, device: int) -> None:
        cp = _cp()
        with cp.cuda.Device(device):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.err = ErrFlag()
            cp.cuda.runtime.deviceSynchronize()
        self.device = device
        self.check_err = False
        self.plans = PlanCache(lambda g, s=self: _build_plan(g, s))
        self.recording: list | None = None  # plans run while the stream is captured (record_begin)


def _build_plan(graph, sctx: StreamCtx):
    from .plan import CudaPlan

    return CudaPlan(graph, sctx)


# --- registration ------------------------------------------------------------------------------
@hookimpl
def api_version():
    return (1, 1)  # the interface version this plugin was written for: a literal, never the SDK's


@hookimpl
def get_devices():
    try:
        cp = _cp()
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # no CuPy, no driver, no device
        raise DeviceError(f"no CUDA device: {type(e).__name__}: {e}") from None
    if n == 0:
        raise DeviceError("no CUDA device: the CUDA runtime reports 0 devices")
    out = []
    caps = DeviceCaps(async_=True, host_buffer=True, events=True)
    for i in range(n):
        p = cp.cuda.runtime.getDeviceProperties(i)
        name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
        desc = f"{name} (sm_{p['major']}{p['minor']}, {p['totalGlobalMem'] / 2**30:.0f} GiB)"
        out.append(DeviceSpec(f"CUDA{i}", desc, DeviceType.GPU, caps, DevCtx(i, p)))
    return out


@hookimpl
def device_memory(device):
    cp = _cp()
    with cp.cuda.Device(device.ctx.index):
        free, total = cp.cuda.runtime.memGetInfo()
    return int(free), int(total)


@hookimpl
def init_backend(device, backend, params):
    return StreamCtx(device.ctx.index)


@hookimpl
def backend_free(backend):
    backend.ctx.stream.synchronize()
    backend.ctx.plans.clear()


@hookimpl
def get_buffer_type(device):
    return BufferTypeSpec(f"CUDA{device.ctx.index}", ("device", device.ctx.index))


@hookimpl
def get_host_buffer_type(device):
    return BufferTypeSpec("CUDA_Host", ("host", device.ctx.index))


@hookimpl
def supports_buft(device, buft):
    return buft.ctx == ("device", device.ctx.index)


@hookimpl
def supports_op(device, op):
    from .plan import supports

    return supports(op)


@hookimpl
def offload_op(device, op):
    # a big batch amortizes copying host weights to the GPU (ggml: GGML_OP_OFFLOAD_MIN_BATCH)
    from accelplane.core.ops import Op

    min_batch = tuning.OFFLOAD_MIN_BATCH.get()
    if op.op is Op.MUL_MAT:
        return op.src[1].ne[1] * op.src[1].ne[2] * op.src[1].ne[3] >= min_batch
    if op.op is Op.MUL_MAT_ID:
        return op.src[2].ne[1] >= min_batch
    return False


# --- buffer types and buffers -----------------------------------------------------------------------
@hookimpl
def buft_alloc(buft, buffer, size):
    kind, dev = buft.ctx
    if kind != "device":
        return PinnedMem(size)
    return DevMem(size, dev, repack=buffer.usage == BufferUsage.WEIGHTS and layout.enabled())


@hookimpl
def buft_alignment(buft):
    return ALIGNMENT


@hookimpl
def buft_is_host(buft):
    return buft.ctx[0] == "host"


@hookimpl
def buffer_host_array(buffer):
    return buffer.ctx.arr


@hookimpl
def buffer_free(buffer):
    buffer.ctx = None


def _memcpy(dst: int, src: int, size: int) -> None:
    _cp().cuda.runtime.memcpy(dst, src, size, MEMCPY_DEFAULT)


def _raw_io(mem: DevMem):
    """(write(offset, uint8 array), read(offset, nbytes) → array) on a buffer's bytes."""

    def write(off: int, arr: np.ndarray) -> None:
        _memcpy(mem.ptr + off, arr.ctypes.data, arr.nbytes)

    def read(off: int, n: int) -> np.ndarray:
        out = np.empty(n, np.uint8)
        _memcpy(out.ctypes.data, mem.ptr + off, n)
        return out

    return write, read


@hookimpl
def buffer_set_tensor(buffer, tensor, data, offset, size):
    if isinstance(buffer.ctx, PinnedMem):
        s = tensor.offs + offset
        buffer.ctx.arr[s : s + size] = data[:size]
    elif buffer.ctx.repack and layout.region(tensor) is not None:
        layout.write(tensor, data, offset, size, *_raw_io(buffer.ctx))
    else:
        data = np.ascontiguousarray(data)
        _memcpy(buffer.ctx.ptr + tensor.offs + offset, data.ctypes.data, size)


@hookimpl
def buffer_get_tensor(buffer, tensor, out, offset, size):
    if isinstance(buffer.ctx, PinnedMem):
        s = tensor.offs + offset
        out[:size] = buffer.ctx.arr[s : s + size]
    elif buffer.ctx.repack and layout.region(tensor) is not None:
        layout.read(tensor, out, offset, size, _raw_io(buffer.ctx)[1])
    else:
        if not out.flags.c_contiguous:
            raise DeviceError("get_tensor needs a contiguous output array")
        _memcpy(out.ctypes.data, buffer.ctx.ptr + tensor.offs + offset, size)


def _memset(mem: DevMem, ptr: int, value: int, size: int) -> None:
    cp = _cp()
    with cp.cuda.Device(mem.device):  # cudaMemset acts on the current device's memory only
        cp.cuda.runtime.memset(ptr, value, size)


@hookimpl
def buffer_memset_tensor(buffer, tensor, value, offset, size):
    if isinstance(buffer.ctx, PinnedMem):
        s = tensor.offs + offset
        buffer.ctx.arr[s : s + size] = value
    elif buffer.ctx.repack and layout.region(tensor) is not None:  # a byte pattern is not layout-free
        layout.write(tensor, np.full(size, value, np.uint8), offset, size, *_raw_io(buffer.ctx))
    else:
        _memset(buffer.ctx, buffer.ctx.ptr + tensor.offs + offset, value, size)


@hookimpl
def buffer_clear(buffer, value):
    if isinstance(buffer.ctx, PinnedMem):
        buffer.ctx.arr[:] = value
    else:
        _memset(buffer.ctx, buffer.ctx.ptr, value, buffer.size)


@hookimpl
def buffer_cpy_tensor(buffer, src, dst):
    if src.buffer is None or not isinstance(src.buffer.ctx, (DevMem, PinnedMem)):
        return False
    if not layout.same_layout(src, dst):
        return False  # the SDK copies through the host, where the hooks convert
    _memcpy(buffer.ctx.ptr + dst.offs, src.buffer.ctx.ptr + src.offs, src.nbytes)
    return True


# --- streams ---------------------------------------------------------------------------------------------
def _ptr(t) -> int:
    return t.buffer.ctx.ptr + t.offs


@hookimpl
def synchronize(backend):
    sc: StreamCtx = backend.ctx
    sc.stream.synchronize()
    if sc.check_err:
        flag = int(sc.err.arr[0])
        if flag:
            sc.err.arr[0] = 0
            if flag == 2:  # kernels.cu: k_allreduce_p2p
                raise CommTimeoutError(f"{backend.device.name}: a peer GPU never joined an all-reduce "
                                       "(~10 s); the communicator is out of step and must be freed")
            raise ComputeError(f"{backend.device.name}: a row or expert index was out of range")


@hookimpl
def set_tensor_async(backend, tensor, data, offset, size):
    if layout.region(tensor) is not None:
        return False  # x8 rows are converted on the host: the synchronous path does it
    data = np.ascontiguousarray(data)
    cp = _cp()
    with cp.cuda.Device(backend.ctx.device):  # the stream's device, whichever is current
        cp.cuda.runtime.memcpyAsync(_ptr(tensor) + offset, data.ctypes.data, size, MEMCPY_DEFAULT,
                                    backend.ctx.stream.ptr)  # fmt: skip
    return True


@hookimpl
def get_tensor_async(backend, tensor, out, offset, size):
    if not out.flags.c_contiguous or layout.region(tensor) is not None:
        return False
    cp = _cp()
    with cp.cuda.Device(backend.ctx.device):
        cp.cuda.runtime.memcpyAsync(out.ctypes.data, _ptr(tensor) + offset, size, MEMCPY_DEFAULT,
                                    backend.ctx.stream.ptr)  # fmt: skip
    return True


@hookimpl
def cpy_tensor_async(backend_src, backend_dst, src, dst):
    cp = _cp()
    if not isinstance(dst.buffer.ctx, DevMem) or dst.buffer.ctx.device != backend_dst.ctx.device:
        return False
    if not layout.same_layout(src, dst):
        return False
    sctx = src.buffer.ctx
    dst_stream = backend_dst.ctx.stream
    if isinstance(sctx, DevMem) and isinstance(backend_src.ctx, StreamCtx):
        if sctx.device != backend_src.ctx.device:
            return False
        # copy on the source stream (after its prior work), then make dst's stream wait
        src_stream = backend_src.ctx.stream
        with cp.cuda.Device(sctx.device):
            if sctx.device == dst.buffer.ctx.device:
                cp.cuda.runtime.memcpyAsync(_ptr(dst), _ptr(src), src.nbytes, MEMCPY_DEFAULT, src_stream.ptr)
            else:
                cp.cuda.runtime.memcpyPeerAsync(_ptr(dst), dst.buffer.ctx.device, _ptr(src), sctx.device,
                                                src.nbytes, src_stream.ptr)  # fmt: skip
            if backend_src is not backend_dst:
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(src_stream)
        if backend_src is not backend_dst:
            with cp.cuda.Device(backend_dst.ctx.device):
                dst_stream.wait_event(ev)
        return True
    if src.buffer.is_host and backend_src.device.type == DeviceType.CPU:
        # copy_from_host: async H2D on the destination stream; the host data must stay as is
        # until that stream is synchronized (docs/ordering.md rule 5)
        with cp.cuda.Device(backend_dst.ctx.device):
            arr = src.buffer.host_array
            cp.cuda.runtime.memcpyAsync(_ptr(dst), arr.ctypes.data + src.offs, src.nbytes, MEMCPY_DEFAULT,
                                        dst_stream.ptr)  # fmt: skip
        return True
    return False


@hookimpl
def graph_compute(backend, graph):
    sc: StreamCtx = backend.ctx
    plan = sc.plans.get(graph)
    plan.run()


# --- recording: one CUDA graph of everything queued between record_begin and record_end ----------
class Recording:
    def __init__(self, graph, plans: list) -> None:
        self.graph = graph
        self.plans = plans  # their parameter arrays and scratch are what the graph's kernels read
        # every buffer the recorded plans use, once (a replay checks none was freed)
        self.buffers = list({id(b): b for p in plans for b in p.buffers.values()}.values())


@hookimpl
def record_begin(backend):
    sc: StreamCtx = backend.ctx
    if not tuning.GRAPHS.get():
        return False
    cp = _cp()
    with cp.cuda.Device(sc.device):
        sc.stream.begin_capture()  # relaxed mode: other streams and devices go on meanwhile
    sc.recording = []
    return True


@hookimpl
def record_end(backend):
    sc: StreamCtx = backend.ctx
    plans, sc.recording = sc.recording, None
    cp = _cp()
    with cp.cuda.Device(sc.device):
        try:
            graph = sc.stream.end_capture()
        except Exception:  # the capture was invalidated (an uncapturable call): not recorded
            return None
    return Recording(graph, plans or [])


@hookimpl
def record_replay(backend, recording):
    from .plan import check_buffers

    sc: StreamCtx = backend.ctx
    check_buffers(recording.buffers)
    cp = _cp()
    with cp.cuda.Device(sc.device):
        recording.graph.launch(sc.stream)


# --- events ------------------------------------------------------------------------------------------------
@hookimpl
def event_new(device):
    cp = _cp()
    with cp.cuda.Device(device.ctx.index):
        return cp.cuda.Event(disable_timing=True)


@hookimpl
def event_free(device, event):
    event.ctx = None


@hookimpl
def event_record(backend, event):
    cp = _cp()
    with cp.cuda.Device(backend.ctx.device):
        event.ctx.record(backend.ctx.stream)


@hookimpl
def event_wait(backend, event):
    cp = _cp()
    with cp.cuda.Device(backend.ctx.device):
        backend.ctx.stream.wait_event(event.ctx)


@hookimpl
def event_synchronize(device, event):
    event.ctx.synchronize()


# --- comm: NCCL -------------------------------------------------------------------------------------------
@hookimpl
def comm_init(backends):
    from .nccl import init

    return init(backends)


@hookimpl
def comm_allreduce_tensor(comm, tensors):
    return comm.ctx.allreduce(comm.backends, tensors)


@hookimpl
def comm_free(comm):
    comm.ctx.free()
