"""The SYCL plugin's hookimpls (entry point ``sycl = "accelplane_sycl.plugin"``).

dpctl is imported on the first get_devices (runtime.open_dpctl), never at discovery; get_devices
lists dpctl's devices (runtime.Probe) and a device's context and queue (runtime.DevState, its
``device.runtime``) are made on its first use. Semantics follow llama.cpp's SYCL
per-instance-queue work (docs/ordering.md):

- every Backend owns a new in-order queue on its device's context (never a shared default
  queue), so a second backend of one device (a copy or prefetch stream) overlaps with compute;
- event_record submits a barrier (completes when all earlier work of the queue has);
  event_wait submits a barrier that depends on the event: the queue waits, the host does not;
- cpy_tensor_async(backend_src, backend_dst, src, dst) copies between SYCL buffers of the
  backends' own devices: on one backend, a memcpy on its queue; across backends, the memcpy
  on the source's queue and a barrier on the destination's queue that waits for it. Anything
  else returns False (the SDK's synchronizing fallback).
"""

from __future__ import annotations

from functools import partial

import numpy as np
from accelplane.errors import ComputeError, DeviceError
from accelplane.interface import (
    BufferTypeSpec,
    DeviceCaps,
    DeviceSpec,
    DeviceType,
    DLDeviceType,
    DLPackMemory,
    hookimpl,
)

from .runtime import ALIGNMENT, BuftInfo, DevState, discover, usm_of
from .stream import EventState, Stream


# --- registration ------------------------------------------------------------------------------
@hookimpl
def api_version():
    return (1, 2)  # the interface version this plugin was written for: a literal, never the SDK's


@hookimpl
def get_devices():
    # like ggml-sycl, every SYCL device is a GPU-type device (its own memory space, USM device);
    # one on an OpenCL CPU runtime runs on the host's cores
    return [DeviceSpec(p.name, p.description, DeviceType.GPU,
                       DeviceCaps(async_=True, host_buffer=True, events=True, emulated=p.dev.is_cpu),
                       p, open=partial(DevState, p))
            for p in discover()]  # fmt: skip


@hookimpl
def device_memory(device):
    total = int(device.ctx.dev.global_mem_size)  # the probe's: no need to open the device
    return max(0, total - (device.runtime.allocated if device.is_open else 0)), total


@hookimpl
def init_backend(device, backend, params):
    return Stream(device.runtime)


@hookimpl
def backend_free(backend):
    backend.ctx.close()


@hookimpl
def get_buffer_type(device):
    return BufferTypeSpec(device.name, BuftInfo(device.ctx, False))


@hookimpl
def get_host_buffer_type(device):
    return BufferTypeSpec(f"{device.name}_Host", BuftInfo(device.ctx, True))


@hookimpl
def supports_op(device, op):
    from .plan import supports

    return supports(op)


@hookimpl
def offload_op(device, op):
    # a big batch amortizes copying host weights to the device, as ggml's backends decide
    from accelplane.core.ops import OFFLOAD_MIN_BATCH, offload_batch

    return offload_batch(op) >= OFFLOAD_MIN_BATCH


@hookimpl
def supports_buft(device, buft):
    info = buft.ctx
    return isinstance(info, BuftInfo) and info.dev is device.ctx


# --- buffers -------------------------------------------------------------------------------------
@hookimpl
def buft_alloc(buft, buffer, size):
    return buft.device.runtime.alloc(size, buft.ctx.host)  # the device opens on its first buffer


@hookimpl
def buft_alignment(buft):
    return ALIGNMENT


@hookimpl
def buft_max_size(buft):
    return int(buft.ctx.dev.dev.max_mem_alloc_size)


@hookimpl
def buft_is_host(buft):
    return buft.ctx.host


@hookimpl
def buffer_host_array(buffer):
    return np.frombuffer(buffer.ctx.mem, np.uint8)[: buffer.size]


@hookimpl
def buffer_free(buffer):
    u = buffer.ctx
    u.dev.wait_streams()  # queued work of any stream may still use the memory
    u.release()


@hookimpl
def buffer_set_tensor(buffer, tensor, data, offset, size):
    if size:
        u, q = buffer.ctx, buffer.ctx.dev.queue
        q.memcpy(u.at(tensor.offs + offset, size, q), data[:size], size)


@hookimpl
def buffer_get_tensor(buffer, tensor, out, offset, size):
    if size:
        u, q = buffer.ctx, buffer.ctx.dev.queue
        q.memcpy(out[:size], u.at(tensor.offs + offset, size, q), size)


@hookimpl
def buffer_memset_tensor(buffer, tensor, value, offset, size):
    if size:
        u, q = buffer.ctx, buffer.ctx.dev.queue
        u.at(tensor.offs + offset, size, q).memset(value)


@hookimpl
def buffer_clear(buffer, value):
    buffer.ctx.mem.memset(value)


@hookimpl
def buffer_dlpack(buffer, tensor):
    # USM device memory of the platform's default context, as dpctl/dpnp take it (DLPack's
    # oneAPI device); host USM is left to the SDK, which shares it as CPU memory. Ordering for a
    # consumer is the SDK's fallback: the host waits for the device's streams.
    u = buffer.ctx
    if u.host or u.dev.dlpack_id is None:
        return None
    return DLPackMemory(DLDeviceType.ONE_API, u.dev.dlpack_id, u.ptr + tensor.offs)


@hookimpl
def buft_from_dlpack(buft, buffer, memory, size):
    dev = buft.device.runtime  # (open: the SDK opens the device before this hook)
    if memory.device_type != DLDeviceType.ONE_API or memory.device_id != dev.dlpack_id:
        return None
    return dev.wrap(memory.ptr, size, buft.ctx.host, memory.owner)


@hookimpl
def buffer_cpy_tensor(buffer, src, dst):
    us, ud = usm_of(src.buffer), buffer.ctx
    n = dst.nbytes
    if us is None or us.dev.ctx != ud.dev.ctx:
        return False
    if n:
        q = ud.dev.queue
        q.memcpy(ud.at(dst.offs, n, q), us.at(src.offs, n, q), n)
    return True


# --- streams ---------------------------------------------------------------------------------------
@hookimpl
def synchronize(backend):
    backend.ctx.sync()


@hookimpl
def set_tensor_async(backend, tensor, data, offset, size):
    return backend.ctx.queue_copy(tensor, data, offset, size, to_device=True)


@hookimpl
def get_tensor_async(backend, tensor, out, offset, size):
    return backend.ctx.queue_copy(tensor, out, offset, size, to_device=False)


@hookimpl
def cpy_tensor_async(backend_src, backend_dst, src, dst):
    if not (isinstance(backend_src.ctx, Stream) and isinstance(backend_dst.ctx, Stream)):
        return False
    bsrc: Stream = backend_src.ctx
    bdst: Stream = backend_dst.ctx
    # views live in their view_src's buffer, at view_src.offs + view_offs (= t.offs)
    us = usm_of((src.view_src or src).buffer, bsrc.dev)
    ud = usm_of((dst.view_src or dst).buffer, bdst.dev)
    if us is None or ud is None or src.buffer.freed or dst.buffer.freed:
        return False
    n = dst.nbytes
    if n == 0:
        return True
    q = bsrc.queue
    bsrc.delay()
    if bsrc.dev.ctx == bdst.dev.ctx:
        bsrc.last = q.memcpy_async(ud.at(dst.offs, n, q), us.at(src.offs, n, q), n)
        if bdst is not bsrc:  # later work on the destination waits for the copy, device-side
            bdst.last = bdst.queue.submit_barrier([bsrc.last])
        return True
    # separate contexts (logical devices): a USM pointer is valid only in its own context, and a
    # dependency on another context's event is not reliable on the OpenCL CPU runtime (it crashed
    # under the conformance suite's all-reduce cases): say so, and the SDK copies through the host
    return False


@hookimpl
def graph_compute(backend, graph):
    bs: Stream = backend.ctx
    plan = bs.plans.get(graph)
    bs.check_err = bs.check_err or plan.uses_index
    bs.delay()
    try:
        bs.last = plan.run()
    except Exception as e:
        raise ComputeError(f"{bs.dev.name}: graph #{graph.uid} failed: {type(e).__name__}: {e}") from e


# --- events ----------------------------------------------------------------------------------------
@hookimpl
def event_new(device):
    return EventState()


@hookimpl
def event_record(backend, event):
    # the queue's last event: in order, it completes after everything before it. A barrier only
    # when that is unknown: the OpenCL CPU runtime completes barriers (and any dependency across
    # queues) only once other queues' running kernels are done, which would hide overlap.
    bs: Stream = backend.ctx
    st: EventState = event.ctx
    if bs.last is None:
        bs.last = bs.queue.submit_barrier()
    st.ev = bs.last


@hookimpl
def event_wait(backend, event):
    st: EventState = event.ctx
    if st.ev is None:
        return
    bs: Stream = backend.ctx
    if event.device.runtime.ctx != bs.dev.ctx:
        # another context (a logical device): wait on the host, as for an event of another
        # plugin; a device-side dependency across contexts is not reliable on this runtime
        st.ev.wait()
        return
    bs.last = bs.queue.submit_barrier([st.ev])


@hookimpl
def event_synchronize(device, event):
    st: EventState = event.ctx
    if st.ev is not None:
        try:
            st.ev.wait()
        except Exception as e:
            raise DeviceError(f"{device.name}: event wait failed: {type(e).__name__}: {e}") from e


@hookimpl
def event_free(device, event):
    event.ctx.ev = None


# --- comm ------------------------------------------------------------------------------------------
@hookimpl
def comm_init(backends):
    from .comm import init

    return init(backends)


@hookimpl
def comm_allreduce_tensor(comm, tensors):
    return comm.ctx.allreduce(tensors)


@hookimpl
def comm_free(comm):
    comm.ctx.free()
