"""The SYCL plugin's hookimpls (entry point ``sycl = "accelplane_sycl.plugin"``).

dpctl is imported on the first get_devices (runtime.py), never at discovery. Semantics follow
llama.cpp's SYCL per-instance-queue work (docs/ordering.md):

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

import ctypes
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
from accelplane.errors import ComputeError, DeviceError
from accelplane.interface import BufferTypeSpec, DeviceCaps, DeviceSpec, DeviceType, hookimpl
from accelplane.runtime.plancache import PlanCache

from . import tuning

ALIGNMENT = 128
SPINS_PER_US = 700  # k_spin steps per microsecond on the OpenCL CPU device, roughly
# bits of a backend's error word (kernels.cl ERR_*): kernels that meet a bad index set one and
# still never read or write out of bounds; the backend's next synchronize raises
INDEX_ERRORS = {
    1: "GET_ROWS: a row index was out of range",
    2: "SET_ROWS: a row index was out of range",
    4: "MUL_MAT_ID: an expert id was out of range",
}
_ZERO_WORD = np.zeros(1, np.uint32)  # the source of the error word's resets (alive for good)


@dataclass(frozen=True)
class BuftInfo:
    dev: Any  # runtime.DevState
    host: bool


class BackendState:
    """A stream: its own in-order queue, its plans, memory retired by dropped plans, and the
    error word its index kernels (GET_ROWS, SET_ROWS, MUL_MAT_ID) report bad indices in."""

    def __init__(self, dev: Any) -> None:
        import dpctl

        self.dev = dev
        self.queue = dpctl.SyclQueue(dev.ctx, dev.dev, property="in_order")
        self.plans = PlanCache(self._plan)
        self.graveyard: list[Any] = []
        self.keepalive: list[Any] = []
        self.last: Any = None  # event of the latest submission (None: unknown, e.g. after dpnp)
        self.err: Any = None  # UsmBuffer: 4 bytes of device memory, allocated by the first index op
        self.check_err = False  # an index op ran since the error word was last read
        settings = tuning.read()
        self.delay_us = settings.delay_us or 0.0
        self.rng = random.Random(settings.delay_seed)
        dev.streams.add(self)

    def _plan(self, graph) -> Any:
        from .plan import Plan

        return Plan(graph, self)

    def keep(self, host: Any) -> None:
        """Keep host memory that queued copies use alive until the next synchronize."""
        self.keepalive.append(host)

    def retire(self, bufs: list) -> None:
        # a dropped plan's memory may still be read by queued kernels: free it after a sync
        self.graveyard.extend(b for b in bufs if b is not None)

    def err_mem(self) -> Any:
        """The error word's memory, zeroed on this queue ahead of any kernel that uses it."""
        if self.err is None:
            self.err = self.dev.alloc(4, host=False)
            self.queue.memcpy_async(self.err.mem, _ZERO_WORD, 4)
        return self.err.mem

    def sync(self, check: bool = True) -> None:
        """Wait for the queue; with ``check``, raise what its index kernels reported."""
        try:
            self.queue.wait()
        except Exception as e:
            raise ComputeError(f"{self.dev.name}: queue failed: {type(e).__name__}: {e}") from e
        for b in self.graveyard:
            b.release()
        self.graveyard.clear()
        self.keepalive.clear()
        if check:
            self.raise_errors()

    def raise_errors(self) -> None:
        """After a wait: read the error word when an index op ran since the last read, reset it
        and raise ComputeError naming the device and the op(s)."""
        if not self.check_err or self.err is None:
            return
        self.check_err = False
        word = np.zeros(1, np.uint32)
        self.queue.memcpy(word, self.err.mem, 4)
        bits = int(word[0])
        if bits:
            self.queue.memcpy(self.err.mem, _ZERO_WORD, 4)
            what = "; ".join(m for bit, m in INDEX_ERRORS.items() if bits & bit) or f"error word {bits:#x}"
            raise ComputeError(f"{self.dev.name}: {what}")

    def delay(self) -> None:
        """ACCELPLANE_TEST_DELAY_US: a random busy kernel before queued work (ordering tests)."""
        if self.delay_us > 0:
            n = int(self.rng.uniform(0, self.delay_us) * SPINS_PER_US)
            k = self.dev.kernel("k_spin")
            self.last = self.queue.submit_async(k, [self.dev.spin_mem(), ctypes.c_uint64(n)], [1])


class EventState:
    __slots__ = ("ev",)

    def __init__(self) -> None:
        self.ev: Any = None  # the barrier event of the latest record


def _usm(buffer, dev=None) -> Any:
    """The buffer's UsmBuffer when it is SYCL memory (of ``dev`` when given), else None."""
    from .runtime import UsmBuffer

    u = buffer.ctx if buffer is not None else None
    if not isinstance(u, UsmBuffer) or (dev is not None and u.dev is not dev):
        return None
    return u


def _ours(backend) -> bool:
    return isinstance(backend.ctx, BackendState)


# --- registration ------------------------------------------------------------------------------
@hookimpl
def api_version():
    return (1, 1)  # the interface version this plugin was written for: a literal, never the SDK's


@hookimpl
def get_devices():
    from .runtime import discover

    caps = DeviceCaps(async_=True, host_buffer=True, events=True)
    # like ggml-sycl, every SYCL device is a GPU-type device (its own memory space, USM device)
    return [DeviceSpec(d.name, d.description, DeviceType.GPU, caps, d) for d in discover()]


@hookimpl
def device_memory(device):
    dev = device.ctx
    total = int(dev.dev.global_mem_size)
    return max(0, total - dev.allocated), total


@hookimpl
def init_backend(device, backend, params):
    return BackendState(device.ctx)


@hookimpl
def backend_free(backend):
    # freeing never raises: errors of work that nobody synchronized go with the backend
    bs: BackendState = backend.ctx
    bs.sync(check=False)
    bs.plans.clear()
    bs.dev.streams.discard(bs)
    if bs.err is not None:
        bs.err.release()
        bs.err = None


@hookimpl
def get_buffer_type(device):
    return BufferTypeSpec(device.name, BuftInfo(device.ctx, False))


@hookimpl
def get_host_buffer_type(device):
    return BufferTypeSpec(f"{device.name}_Host", BuftInfo(device.ctx, True))


@hookimpl
def supports_op(device, op):
    from .plan import SUPPORTED_OPS

    return op.op in SUPPORTED_OPS


@hookimpl
def supports_buft(device, buft):
    info = buft.ctx
    return isinstance(info, BuftInfo) and info.dev is device.ctx


# --- buffers -------------------------------------------------------------------------------------
@hookimpl
def buft_alloc(buft, buffer, size):
    info: BuftInfo = buft.ctx
    return info.dev.alloc(size, info.host)


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
def buffer_cpy_tensor(buffer, src, dst):
    us, ud = _usm(src.buffer), buffer.ctx
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


def _queue_copy(backend, tensor, host, offset: int, size: int, to_device: bool) -> bool:
    """Queue a copy between host memory and the tensor on the backend's queue (False: the
    tensor is not in this backend's USM, so the SDK falls back)."""
    bs: BackendState = backend.ctx
    u = _usm(tensor.buffer, bs.dev)
    if u is None:
        return False
    if size:
        bs.delay()
        q = bs.queue
        dev = u.at(tensor.offs + offset, size, q)
        src, dst = (host[:size], dev) if to_device else (dev, host[:size])
        bs.last = q.memcpy_async(dst, src, size)
    return True


@hookimpl
def set_tensor_async(backend, tensor, data, offset, size):
    return _queue_copy(backend, tensor, data, offset, size, to_device=True)


@hookimpl
def get_tensor_async(backend, tensor, out, offset, size):
    return _queue_copy(backend, tensor, out, offset, size, to_device=False)


@hookimpl
def cpy_tensor_async(backend_src, backend_dst, src, dst):
    if not (_ours(backend_src) and _ours(backend_dst)):
        return False
    bsrc: BackendState = backend_src.ctx
    bdst: BackendState = backend_dst.ctx
    # views live in their view_src's buffer, at view_src.offs + view_offs (= t.offs)
    us = _usm((src.view_src or src).buffer, bsrc.dev)
    ud = _usm((dst.view_src or dst).buffer, bdst.dev)
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
    bs: BackendState = backend.ctx
    plan = bs.plans.get(graph)
    plan.check_buffers()
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
    bs: BackendState = backend.ctx
    st: EventState = event.ctx
    if bs.last is None:
        bs.last = bs.queue.submit_barrier()
    st.ev = bs.last


@hookimpl
def event_wait(backend, event):
    st: EventState = event.ctx
    if st.ev is None:
        return
    bs: BackendState = backend.ctx
    if event.device.ctx.ctx != bs.dev.ctx:
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
