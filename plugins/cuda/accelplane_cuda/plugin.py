"""accelplane's CUDA plugin on CuPy.

One stream per Backend (non-blocking CUDA streams), CUDA events for events, device memory
from cudaMalloc, a pinned host buffer type for truly asynchronous host→device copies,
cpy_tensor_async between CUDA devices (peer copies) and from host buffers of CPU backends
(llama.cpp #17795's copy_from_host). Kernels are CUDA C compiled by NVRTC (kernels/, compiler.py);
matrix products of float weights and large batches go through cuBLAS. graph_compute plans a
graph once and, from the second run of an unchanged graph on, replays it as a CUDA graph.

This module holds the hook implementations only; the objects behind the handles are in
runtime.py. Nothing heavy is imported at module load: get_devices asks the driver (runtime.probe,
no CuPy, no context), and CuPy is imported when a device opens (its first use).
"""

from __future__ import annotations

from functools import partial

import numpy as np
from accelplane.errors import CommTimeoutError, ComputeError, DeviceError
from accelplane.interface import (
    BufferTypeSpec,
    DeviceCaps,
    DeviceSpec,
    DeviceType,
    DLDeviceType,
    DLPackMemory,
    hookimpl,
)
from accelplane.runtime.backend import BufferUsage

from . import layout, tuning  # numpy and the SDK only: nothing heavy at import
from .runtime import (
    MEMCPY_DEFAULT,
    DevCtx,
    DevMem,
    PinnedMem,
    Recording,
    StreamCtx,
    address,
    cupy,
    dlpack_wait,
    memcpy,
    memset,
    open_device,
    probe,
    raw_io,
)

ALIGNMENT = 256


# --- registration ------------------------------------------------------------------------------
@hookimpl
def api_version():
    return (1, 3)  # the interface version this plugin was written for: a literal, never the SDK's


@hookimpl
def get_devices():
    found = probe()  # DeviceError when CuPy, the driver or a device is missing
    settings = tuning.read()
    out = []
    caps = DeviceCaps(async_=True, host_buffer=True, events=True, host_reads=True)
    for i, (name, cc, total) in enumerate(found):
        ctx = DevCtx(i, name, cc, total, settings)
        desc = f"{name} (sm_{cc[0]}{cc[1]}, {total / 2**30:.0f} GiB)"
        out.append(DeviceSpec(f"CUDA{i}", desc, DeviceType.GPU, caps, ctx, open=partial(open_device, ctx)))
    return out


@hookimpl
def device_memory(device):
    if not device.is_open:
        return None  # free memory needs a context: the listing shows the total in the description
    cp = cupy()
    with cp.cuda.Device(device.ctx.index):
        free, total = cp.cuda.runtime.memGetInfo()
    return int(free), int(total)


@hookimpl
def init_backend(device, backend, params):
    return StreamCtx(device.ctx.index)  # (the SDK has opened the device: CuPy is imported)


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
    from .support import supports

    return supports(op)


@hookimpl
def offload_op(device, op):
    # a big batch amortizes copying host weights to the GPU
    from accelplane.core.ops import offload_batch

    return offload_batch(op) >= device.ctx.tuning.offload_min_batch


# --- buffer types and buffers -----------------------------------------------------------------------
@hookimpl
def buft_alloc(buft, buffer, size):
    kind, dev = buft.ctx
    if kind != "device":
        return PinnedMem(size)
    return DevMem(size, dev, repack=buffer.usage == BufferUsage.WEIGHTS)


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


@hookimpl
def buffer_set_tensor(buffer, tensor, data, offset, size):
    if isinstance(buffer.ctx, PinnedMem):
        s = tensor.offs + offset
        buffer.ctx.arr[s : s + size] = data[:size]
    elif buffer.ctx.repack and layout.region(tensor) is not None:
        layout.write(tensor, data, offset, size, *raw_io(buffer.ctx))
    else:
        data = np.ascontiguousarray(data)
        memcpy(buffer.ctx.ptr + tensor.offs + offset, data.ctypes.data, size)


@hookimpl
def buffer_get_tensor(buffer, tensor, out, offset, size):
    if isinstance(buffer.ctx, PinnedMem):
        s = tensor.offs + offset
        out[:size] = buffer.ctx.arr[s : s + size]
    elif buffer.ctx.repack and layout.region(tensor) is not None:
        layout.read(tensor, out, offset, size, raw_io(buffer.ctx)[1])
    else:
        if not out.flags.c_contiguous:
            raise DeviceError("get_tensor needs a contiguous output array")
        memcpy(out.ctypes.data, buffer.ctx.ptr + tensor.offs + offset, size, to_host=True)


@hookimpl
def buffer_memset_tensor(buffer, tensor, value, offset, size):
    if isinstance(buffer.ctx, PinnedMem):
        s = tensor.offs + offset
        buffer.ctx.arr[s : s + size] = value
    elif buffer.ctx.repack and layout.region(tensor) is not None:  # a byte pattern is not layout-free
        layout.write(tensor, np.full(size, value, np.uint8), offset, size, *raw_io(buffer.ctx))
    else:
        memset(buffer.ctx, buffer.ctx.ptr + tensor.offs + offset, value, size)


@hookimpl
def buffer_clear(buffer, value):
    if isinstance(buffer.ctx, PinnedMem):
        buffer.ctx.arr[:] = value
    else:
        memset(buffer.ctx, buffer.ctx.ptr, value, buffer.size)


@hookimpl
def buffer_dlpack(buffer, tensor):
    # device memory in ggml layout (x8 weights are not); pinned host memory is left to the SDK,
    # which shares it as CPU memory
    mem = buffer.ctx
    if not isinstance(mem, DevMem) or layout.region(tensor) is not None:
        return None
    return DLPackMemory(DLDeviceType.CUDA, mem.device, mem.ptr + tensor.offs)


@hookimpl
def device_dlpack_wait(device, stream):
    dlpack_wait(device.ctx.index, [b.ctx.stream.ptr for b in device.backends], stream)


@hookimpl
def buft_from_dlpack(buft, buffer, memory, size):
    # memory of this GPU at the alignment the buffer type promises (kernels take vector loads)
    kind, dev = buft.ctx
    if kind != "device" or memory.device_type != DLDeviceType.CUDA or memory.device_id != dev:
        return None
    if memory.ptr % ALIGNMENT:
        return None
    return DevMem.wrap(memory.ptr, size, dev, memory.owner)


@hookimpl
def buffer_cpy_tensor(buffer, src, dst):
    if src.buffer is None or not isinstance(src.buffer.ctx, (DevMem, PinnedMem)):
        return False
    if not layout.same_layout(src, dst):
        return False  # the SDK copies through the host, where the hooks convert
    memcpy(buffer.ctx.ptr + dst.offs, src.buffer.ctx.ptr + src.offs, src.nbytes)
    return True


# --- streams ---------------------------------------------------------------------------------------------
@hookimpl
def synchronize(backend):
    sc: StreamCtx = backend.ctx
    sc.stream.synchronize()
    if sc.check_err:
        flag = int(sc.err.arr[0])
        if flag:
            sc.err.arr[0] = 0
            if flag == 2:  # kernels/allreduce.cu: k_allreduce_p2p
                raise CommTimeoutError(f"{backend.device.name}: a peer GPU never joined an all-reduce "
                                       "(~10 s); the communicator is out of step and must be freed")
            raise ComputeError(f"{backend.device.name}: a row or expert index was out of range")


@hookimpl
def set_tensor_async(backend, tensor, data, offset, size):
    if layout.region(tensor) is not None:
        return False  # x8 rows are converted on the host: the synchronous path does it
    data = np.ascontiguousarray(data)
    cp = cupy()
    with cp.cuda.Device(backend.ctx.device), backend.ctx.timed("copy"):  # the stream's device
        cp.cuda.runtime.memcpyAsync(address(tensor) + offset, data.ctypes.data, size, MEMCPY_DEFAULT,
                                    backend.ctx.stream.ptr)  # fmt: skip
    return True


@hookimpl
def get_tensor_async(backend, tensor, out, offset, size):
    if not out.flags.c_contiguous or layout.region(tensor) is not None:
        return False
    cp = cupy()
    with cp.cuda.Device(backend.ctx.device):
        cp.cuda.runtime.memcpyAsync(out.ctypes.data, address(tensor) + offset, size, MEMCPY_DEFAULT,
                                    backend.ctx.stream.ptr)  # fmt: skip
    return True


@hookimpl
def cpy_tensor_async(backend_src, backend_dst, src, dst):
    cp = cupy()
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
                cp.cuda.runtime.memcpyAsync(address(dst), address(src), src.nbytes, MEMCPY_DEFAULT,
                                            src_stream.ptr)  # fmt: skip
            else:
                cp.cuda.runtime.memcpyPeerAsync(address(dst), dst.buffer.ctx.device, address(src),
                                                sctx.device, src.nbytes, src_stream.ptr)  # fmt: skip
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
        with cp.cuda.Device(backend_dst.ctx.device), backend_dst.ctx.timed("copy"):
            arr = src.buffer.host_array
            cp.cuda.runtime.memcpyAsync(address(dst), arr.ctypes.data + src.offs, src.nbytes, MEMCPY_DEFAULT,
                                        dst_stream.ptr)  # fmt: skip
        return True
    return False


@hookimpl
def graph_compute(backend, graph):
    sc: StreamCtx = backend.ctx
    plan = sc.plans.get(graph)
    with sc.timed("compute"):
        plan.run()


# --- recording: one CUDA graph of everything queued between record_begin and record_end ----------
@hookimpl
def record_begin(backend):
    sc: StreamCtx = backend.ctx
    if not sc.tuning.graphs:
        return False
    cp = cupy()
    with cp.cuda.Device(sc.device):
        sc.stream.begin_capture()  # relaxed mode: other streams and devices go on meanwhile
    sc.recording = []
    return True


@hookimpl
def record_end(backend):
    sc: StreamCtx = backend.ctx
    plans, sc.recording = sc.recording, None
    cp = cupy()
    with cp.cuda.Device(sc.device):
        try:
            graph = sc.stream.end_capture()
        except Exception:  # the capture was invalidated (an uncapturable call): not recorded
            return None
    return Recording(graph, plans or [])


@hookimpl
def record_replay(backend, recording):
    sc: StreamCtx = backend.ctx
    cp = cupy()
    with cp.cuda.Device(sc.device):
        recording.graph.launch(sc.stream)


# --- timeline: timing events around each copy and compute ------------------------------------------------
@hookimpl
def timeline_begin(backend):
    backend.ctx.timeline = []
    return True


@hookimpl
def timeline_end(backend):
    return backend.ctx.timeline_times()


# --- events ------------------------------------------------------------------------------------------------
@hookimpl
def event_new(device):
    cp = cupy()
    with cp.cuda.Device(device.ctx.index):
        return cp.cuda.Event(disable_timing=True)


@hookimpl
def event_free(device, event):
    event.ctx = None


@hookimpl
def event_record(backend, event):
    cp = cupy()
    with cp.cuda.Device(backend.ctx.device):
        event.ctx.record(backend.ctx.stream)


@hookimpl
def event_wait(backend, event):
    cp = cupy()
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
