"""accelplane's Vulkan plugin: the hookimpls.

One accelplane device per Vulkan physical device (GPUs; lavapipe when it is the only one),
or ACCELPLANE_VK_DEVICES="0,0" to open one physical device as several logical devices (for
multi-device tests on one GPU or on lavapipe). Each device has a device-local buffer type
(memory the SDK reaches only through these hooks) and a host buffer type (host-visible,
coherent, mapped: is_host). A backend is a Stream (runtime/stream.py): one queue, command buffers, a
timeline semaphore; graph_compute records a graph once (plan.py) and resubmits it; events are
timeline values; copies between devices that cannot share semaphores cross a host bridge.

Nothing heavy at import. get_devices probes (probe.py: libvulkan through ctypes, the instance,
the physical devices' properties), raising DeviceError("no Vulkan driver found: ...") when the
loader or driver is missing; the registry records that and the host carries on. A device's
runtime (runtime/: the ``vulkan`` package, a VkDevice with its queues; its shaders at the first
backend) opens on its first use (``device.runtime``).
"""

from __future__ import annotations

from functools import partial

from accelplane.interface import BufferTypeSpec, DeviceCaps, DeviceSpec, DeviceType, hookimpl
from accelplane.runtime.plancache import PlanCache

from . import probe, tuning


def _rt():
    from . import runtime

    return runtime


# --- registration ------------------------------------------------------------------------------
@hookimpl
def api_version():
    return (1, 3)  # the interface version this plugin was written for: a literal, never the SDK's


def _open(ctx: probe.DeviceCtx):
    return _rt().LogicalDevice(ctx.phys, ctx.label)  # DeviceError when the vulkan package cannot load


@hookimpl
def get_devices():
    return [
        DeviceSpec(d.label, d.description, DeviceType.IGPU if d.phys.type == 1 else DeviceType.GPU,
                   DeviceCaps(async_=True, host_buffer=True, events=True, emulated=d.phys.type == 4), d,
                   open=partial(_open, d))
        for d in probe.list_devices(tuning.read())  # DeviceError when libvulkan is missing
    ]  # (physical type 4: a CPU, i.e. lavapipe)


@hookimpl
def device_memory(device):
    """The device-local heap, less what this device allocated (the probe's size: no need to open)."""
    total = device.ctx.phys.heap_size
    return max(0, total - (device.runtime.allocated if device.is_open else 0)), total


@hookimpl
def init_backend(device, backend, params):
    dev = device.runtime  # first: the runtime's own failure to load is the device's DeviceOpenError
    dev.load_shaders()  # a shader that does not compile fails here, before any backend exists
    from .plan import Plan

    ctx: probe.DeviceCtx = device.ctx
    stream = _rt().Stream(dev, backend.name)
    stream.delay_s = (tuning.read().delay_us or 0.0) * 1e-6
    stream.plans = PlanCache(lambda graph: Plan(stream, graph, ctx.caps))
    return stream


@hookimpl
def backend_free(backend):
    backend.ctx.close()


# --- buffer types -------------------------------------------------------------------------------
@hookimpl
def get_buffer_type(device):
    return BufferTypeSpec(device.name, probe.BuftCtx(device.ctx, host=False))


@hookimpl
def get_host_buffer_type(device):
    return BufferTypeSpec(f"{device.name}_Host", probe.BuftCtx(device.ctx, host=True))


@hookimpl
def supports_op(device, op):
    from .kernels import supports

    return supports(op, device.ctx.caps)


@hookimpl
def offload_op(device, op):
    # a big batch amortizes copying host weights to the device, as ggml's backends decide
    from accelplane.core.ops import OFFLOAD_MIN_BATCH, offload_batch

    return offload_batch(op) >= OFFLOAD_MIN_BATCH


@hookimpl
def supports_buft(device, buft):
    # kernels read and write the device's own device-local buffers; the host type is for
    # transfers (over PCIe a kernel would crawl), as ggml's pinned host buffers
    c = buft.ctx
    return isinstance(c, probe.BuftCtx) and not c.host and c.dev is device.ctx


@hookimpl
def buft_alloc(buft, buffer, size):
    return _rt().Memory(buft.device.runtime, size, host=buft.ctx.host)  # the device opens on its first buffer


@hookimpl
def buft_alignment(buft):
    return max(64, buft.ctx.dev.phys.limits["minStorageBufferOffsetAlignment"])


@hookimpl
def buft_max_size(buft):
    return buft.ctx.dev.phys.max_buffer_size


@hookimpl
def buft_is_host(buft):
    return buft.ctx.host


# --- buffers ---------------------------------------------------------------------------------------
@hookimpl
def buffer_free(buffer):
    buffer.ctx.free()


@hookimpl
def buffer_host_array(buffer):
    return buffer.ctx.host


@hookimpl
def buffer_set_tensor(buffer, tensor, data, offset, size):
    mem, start = buffer.ctx, tensor.offs + offset
    if mem.host is not None:
        mem.host[start : start + size] = data[:size]
    else:
        mem.dev.transfer.upload_blocking(mem, start, data[:size])


@hookimpl
def buffer_get_tensor(buffer, tensor, out, offset, size):
    mem, start = buffer.ctx, tensor.offs + offset
    if mem.host is not None:
        out[:size] = mem.host[start : start + size]
    else:
        mem.dev.transfer.download_blocking(mem, start, out, size)


@hookimpl
def buffer_memset_tensor(buffer, tensor, value, offset, size):
    import numpy as np

    mem, start = buffer.ctx, tensor.offs + offset
    if mem.host is not None:
        mem.host[start : start + size] = value
    elif start % 4 == 0 and size % 4 == 0:  # vkCmdFillBuffer's alignment rules
        tr = mem.dev.transfer
        with tr.lock:
            tr.wait(tr.fill(mem, start, size, value))
    else:
        mem.dev.transfer.upload_blocking(mem, start, np.full(size, value, np.uint8))


@hookimpl
def buffer_clear(buffer, value):
    mem = buffer.ctx
    if mem.host is not None:
        mem.host[:] = value
    else:
        tr = mem.dev.transfer
        with tr.lock:
            tr.wait(tr.fill(mem, 0, (mem.size + 3) & ~3, value))


@hookimpl
def buffer_cpy_tensor(buffer, src, dst):
    smem, dmem = _rt().memory_of(src), buffer.ctx
    if smem is None or smem.dev is not dmem.dev:
        return False
    tr = dmem.dev.transfer
    with tr.lock:
        tr.wait(tr.copy(smem, src.offs, dmem, dst.offs, src.nbytes))
    return True


# --- streams -----------------------------------------------------------------------------------------
@hookimpl
def synchronize(backend):
    backend.ctx.synchronize()


@hookimpl
def graph_compute(backend, graph):
    backend.ctx.plans.get(graph).replay()


@hookimpl
def set_tensor_async(backend, tensor, data, offset, size):
    s, mem = backend.ctx, _rt().memory_of(tensor)
    if mem is None or mem.dev is not s.dev:
        return False
    s.upload(mem, tensor.offs + offset, data[:size])
    return True


@hookimpl
def get_tensor_async(backend, tensor, out, offset, size):
    s, mem = backend.ctx, _rt().memory_of(tensor)
    if mem is None or mem.dev is not s.dev:
        return False
    s.download(mem, tensor.offs + offset, out, size)
    return True


@hookimpl
def cpy_tensor_async(backend_src, backend_dst, src, dst):
    rt = _rt()
    ds, dmem, smem = rt.stream_of(backend_dst), rt.memory_of(dst), rt.memory_of(src)
    if ds is None or dmem is None or dmem.dev is not ds.dev:
        return False
    n = src.nbytes
    ss = rt.stream_of(backend_src)
    if ss is None and backend_src.device.caps.async_:
        return False  # another plugin's asynchronous stream: nothing to order after
    if smem is not None and smem.dev is ds.dev:  # one device-side copy
        if ss is None or ss is ds:
            waits = ()
        elif ss.dev is ds.dev:
            waits = ((ss.sem, ss.submitted),)
        else:  # (a source stream of another device: its buffer's device differs from its own)
            ds.wait_for(ss, ss.submitted)
            waits = ()
        ds.copy(smem, src.offs, dmem, dst.offs, n, waits)
        return True
    if smem is not None and ss is not None and smem.dev is ss.dev:
        rt.copy_across(ss, ds, smem, src.offs, dmem, dst.offs, n)
        return True
    if src.buffer.is_host:  # host memory whose producer has finished (a synchronous backend)
        ds.upload(dmem, dst.offs, src.buffer.host_array[src.offs : src.offs + n])
        return True
    return False


# --- timeline: device timestamps around each copy and compute ------------------------------------------
@hookimpl
def timeline_begin(backend):
    s = backend.ctx
    if not s.dev.timestamps:  # (no host-reset query pools, or a family without timestamps)
        return False
    if s.timeline is not None:  # a timeline still being noted is dropped
        s.timeline.free()
    s.timeline = _rt().Timeline(s.dev)
    return True


@hookimpl
def timeline_end(backend):
    s = backend.ctx
    t, s.timeline = s.timeline, None
    return t.end() if t is not None else []


# --- events --------------------------------------------------------------------------------------------
@hookimpl
def event_new(device):
    return _rt().EventState()


@hookimpl
def event_free(device, event):
    event.ctx.stream = None


@hookimpl
def event_record(backend, event):
    event.ctx.record(backend.ctx)


@hookimpl
def event_wait(backend, event):
    event.ctx.wait(backend.ctx)


@hookimpl
def event_synchronize(device, event):
    event.ctx.synchronize()


# --- comm --------------------------------------------------------------------------------------------------
@hookimpl
def comm_init(backends):
    from .comm import VkComm

    rt = _rt()
    streams = [rt.stream_of(b) for b in backends]
    settings = tuning.read()
    if settings.comm_off or len(backends) < 2 or any(s is None for s in streams):
        return None  # the SDK's butterfly serves
    if len({id(s) for s in streams}) < len(streams):
        return None
    return VkComm(backends, settings)


@hookimpl
def comm_allreduce_tensor(comm, tensors):
    rt = _rt()
    for s, t in zip(comm.ctx.streams, tensors, strict=True):
        mem = rt.memory_of(t)
        if mem is None or mem.dev is not s.dev:
            return False
    return comm.ctx.allreduce(list(tensors))


@hookimpl
def comm_free(comm):
    comm.ctx.free()
