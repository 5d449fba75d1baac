"""The asynchronous test device: a plugin whose streams are worker threads with random
delays, whose memory is not host-visible (only reachable through its hooks), whose events
are real cross-thread events and whose freed memory is poisoned. Its host buffer type (as a
GPU's pinned host memory) is host memory the CPU computes on; copies from it read it when
their task runs, as a DMA would, and its kernels read it in place when their task runs, as a
GPU's do through unified addressing (caps.host_reads).

It is a test double for the SDK's ordering logic, not a backend. Load it with
``ACCELPLANE_EXTRA_PLUGINS=asynctest=accelplane.testing.asyncdev``.

Environment:
  ACCELPLANE_ASYNCDEV_NDEV    number of devices (default 2: ASYNC0, ASYNC1)
  ACCELPLANE_TEST_DELAY_US    max random delay before each queued task (default 100);
                              read when a backend is created
  ACCELPLANE_ASYNCDEV_SEED    seed of the delay generator (default: from the clock)
  ACCELPLANE_ASYNCDEV_MAX_SIZE  max bytes of one buffer (default 32 MiB: larger allocations
                              through accelplane.runtime.alloc become multi-buffers)
"""

from __future__ import annotations

import queue
import random
import threading
import time

import numpy as np

from accelplane import env
from accelplane.core.ops import RULES, Op
from accelplane.env import TEST_DELAY_US
from accelplane.errors import AllocationError, ComputeError
from accelplane.interface import BufferTypeSpec, DeviceCaps, DeviceSpec, DeviceType, hookimpl
from accelplane.runtime.plancache import PlanCache

POISON = 0xCD
TOTAL_MEMORY = 4 << 30
WAIT_TIMEOUT_S = 60.0
_SUPPORTED = frozenset(RULES) - {Op.NONE}


class Stream:
    """An in-order queue executed by one worker thread, with a random delay before each task."""

    def __init__(self, name: str, max_delay_us: float, seed: int | None) -> None:
        self.name = name
        self.max_delay = max_delay_us * 1e-6
        self.rng = random.Random(seed)
        self.q: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.timeline: list[tuple[str, float, float]] = []  # (label, start, end) when recording
        self.record_timeline = False
        self.recording: list | None = None  # between record_begin and record_end: (fn, label, plan)
        self.thread = threading.Thread(target=self._run, name=f"asyncdev-{name}", daemon=True)
        self.thread.start()

    def submit(self, fn, label: str = "", plan=None) -> None:
        if self.recording is not None:
            self.recording.append((fn, label, plan))
        else:
            self.q.put((fn, label))

    def _run(self) -> None:
        while True:
            item = self.q.get()
            try:
                if item is None:
                    return
                fn, label = item
                if self.max_delay:
                    time.sleep(self.rng.uniform(0, self.max_delay))
                if self.error is None:
                    t0 = time.perf_counter()
                    fn()
                    if self.record_timeline:
                        self.timeline.append((label, t0, time.perf_counter()))
            except BaseException as e:  # kept and raised by synchronize()
                self.error = self.error or e
            finally:
                self.q.task_done()

    def synchronize(self) -> None:
        self.q.join()
        if self.error is not None:
            e, self.error = self.error, None
            raise ComputeError(f"asyncdev stream {self.name}: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=WAIT_TIMEOUT_S)


class Memory:
    __slots__ = ("mem", "device", "host")

    def __init__(self, size: int, device, host: bool = False) -> None:
        self.mem = np.full(size, POISON, np.uint8)
        self.device = device
        self.host = host  # the device's host buffer type: not counted in its memory


class DevState:
    def __init__(self, index: int) -> None:
        self.index = index
        self.allocated = 0
        self.lock = threading.Lock()


class EventState:
    """Generations: record() bumps ``recorded`` on the host; the stream task bumps ``done``."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.recorded = 0
        self.done = 0

    def complete(self, gen: int) -> None:
        with self.cond:
            self.done = max(self.done, gen)
            self.cond.notify_all()

    def wait(self, gen: int) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.done >= gen, WAIT_TIMEOUT_S):
                raise ComputeError("asyncdev: event wait timed out (was the event ever recorded?)")


def _plan(graph):
    from accelplane.cpu.plan import Plan

    return Plan(graph, _memory)


class BackendState:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.plans = PlanCache(_plan)


def _memory(buffer) -> np.ndarray:
    return buffer.ctx.mem


def _bytes(t) -> np.ndarray:
    return t.buffer.ctx.mem[t.offs : t.offs + t.nbytes]


def _is_ours(buffer) -> bool:
    """Device memory of this plugin (its host buffers are host memory like any other)."""
    return isinstance(buffer.ctx, Memory) and not buffer.ctx.host


# --- registration ------------------------------------------------------------------------------
@hookimpl
def api_version():
    return (1, 3)  # the interface version this plugin was written for: a literal, never the SDK's


@hookimpl
def get_devices():
    n = env.ASYNCDEV_NDEV.get()
    caps = DeviceCaps(async_=True, events=True, host_buffer=True, host_reads=True)
    return [DeviceSpec(f"ASYNC{i}", "asynchronous test device (worker-thread stream, random "
                       "delays; a test double, not a backend)", DeviceType.GPU, caps,
                       DevState(i)) for i in range(n)]  # fmt: skip


@hookimpl
def device_memory(device):
    return TOTAL_MEMORY - device.ctx.allocated, TOTAL_MEMORY


@hookimpl
def init_backend(device, backend, params):
    delay = TEST_DELAY_US.get()
    return BackendState(Stream(backend.name, 100.0 if delay is None else delay, env.ASYNCDEV_SEED.get()))


@hookimpl
def backend_free(backend):
    backend.ctx.stream.synchronize()
    backend.ctx.stream.close()


@hookimpl
def get_buffer_type(device):
    return BufferTypeSpec(f"{device.name}_mem")


@hookimpl
def get_host_buffer_type(device):
    return BufferTypeSpec(f"{device.name}_Host", "host")


@hookimpl
def buft_is_host(buft):
    return buft.ctx == "host"


@hookimpl
def buffer_host_array(buffer):
    return buffer.ctx.mem


@hookimpl
def supports_op(device, op):
    return op.op in _SUPPORTED


@hookimpl
def supports_buft(device, buft):
    return buft.device is device and buft.ctx != "host"


@hookimpl
def buft_alloc(buft, buffer, size):
    if buft.ctx == "host":
        return Memory(size, buft.device, host=True)
    st = buft.device.ctx
    with st.lock:
        if st.allocated + size > TOTAL_MEMORY:
            raise AllocationError(f"{buft.device.name}: out of memory allocating {size} bytes")
        st.allocated += size
    return Memory(size, buft.device)


@hookimpl
def buft_alignment(buft):
    return 128


@hookimpl
def buft_max_size(buft):
    # small on purpose, so multi-buffer paths get exercised
    return env.ASYNCDEV_MAX_SIZE.get()


@hookimpl
def buffer_free(buffer):
    # poison: work still queued on a stream that reads this memory now sees garbage
    buffer.ctx.mem[:] = POISON
    if buffer.ctx.host:
        return
    st = buffer.buft.device.ctx
    with st.lock:
        st.allocated -= buffer.size


@hookimpl
def buffer_set_tensor(buffer, tensor, data, offset, size):
    s = tensor.offs + offset
    buffer.ctx.mem[s : s + size] = data[:size]


@hookimpl
def buffer_get_tensor(buffer, tensor, out, offset, size):
    s = tensor.offs + offset
    out[:size] = buffer.ctx.mem[s : s + size]


@hookimpl
def buffer_clear(buffer, value):
    buffer.ctx.mem[:] = value


# --- stream work ---------------------------------------------------------------------------------
@hookimpl
def synchronize(backend):
    backend.ctx.stream.synchronize()


@hookimpl
def set_tensor_async(backend, tensor, data, offset, size):
    mem, s = tensor.buffer.ctx.mem, tensor.offs + offset

    def task() -> None:
        mem[s : s + size] = data[:size]

    backend.ctx.stream.submit(task, "set")
    return True


@hookimpl
def get_tensor_async(backend, tensor, out, offset, size):
    mem, s = tensor.buffer.ctx.mem, tensor.offs + offset

    def task() -> None:
        out[:size] = mem[s : s + size]

    backend.ctx.stream.submit(task, "get")
    return True


@hookimpl
def cpy_tensor_async(backend_src, backend_dst, src, dst):
    if not _is_ours(dst.buffer) or dst.buffer.ctx.device is not backend_dst.device:
        return False
    d = _bytes(dst)
    if _is_ours(src.buffer) and isinstance(backend_src.ctx, BackendState):
        s = _bytes(src)
        done = EventState()

        def copy() -> None:
            d[...] = s
            done.complete(1)

        backend_src.ctx.stream.submit(copy, "copy")
        if backend_dst is not backend_src:
            backend_dst.ctx.stream.submit(lambda: done.wait(1), "wait-copy")
        return True
    if src.buffer.is_host:
        # host → device (llama.cpp #17795): the host data must stay unchanged until dst syncs
        s = src.buffer.host_array[src.offs : src.offs + src.nbytes]
        backend_dst.ctx.stream.submit(lambda: d.__setitem__(Ellipsis, s), "h2d")
        return True
    return False


@hookimpl
def graph_compute(backend, graph):
    plan = backend.ctx.plans.get(graph)
    backend.ctx.stream.submit(plan.run, f"graph#{graph.uid}", plan)


# --- recording: the queued tasks, kept and queued again ------------------------------------------
@hookimpl
def record_begin(backend):
    backend.ctx.stream.recording = []
    return True


@hookimpl
def record_end(backend):
    st = backend.ctx.stream
    rec, st.recording = st.recording, None
    return rec


@hookimpl
def record_replay(backend, recording):
    for fn, label, _plan in recording:
        backend.ctx.stream.submit(fn, label)


# --- timeline: the worker thread's clock around each task ------------------------------------------
_KINDS = {"set": "copy", "get": "copy", "copy": "copy", "h2d": "copy"}


@hookimpl
def timeline_begin(backend):
    st = backend.ctx.stream
    st.timeline.clear()
    st.record_timeline = True
    return True


@hookimpl
def timeline_end(backend):
    st = backend.ctx.stream
    st.record_timeline = False
    out = [(_KINDS.get(lb, "compute" if lb.startswith("graph#") else ""), t0, t1)
           for lb, t0, t1 in st.timeline]  # fmt: skip
    st.timeline.clear()
    return [x for x in out if x[0]]


# --- events ----------------------------------------------------------------------------------------
@hookimpl
def event_new(device):
    return EventState()


@hookimpl
def event_record(backend, event):
    st: EventState = event.ctx
    with st.cond:
        st.recorded += 1
        gen = st.recorded
    backend.ctx.stream.submit(lambda: st.complete(gen), "record")


@hookimpl
def event_wait(backend, event):
    st: EventState = event.ctx
    gen = st.recorded
    backend.ctx.stream.submit(lambda: st.wait(gen), "wait")


@hookimpl
def event_synchronize(device, event):
    st: EventState = event.ctx
    st.wait(st.recorded)


# --- comm: a host-staged all-reduce on the streams -----------------------------------------------
class Comm:
    def __init__(self, backends) -> None:
        self.backends = list(backends)


@hookimpl
def comm_init(backends):
    if len(backends) < 2 or not all(isinstance(b.ctx, BackendState) for b in backends):
        return None
    return Comm(backends)


@hookimpl
def comm_allreduce_tensor(comm, tensors):
    from accelplane.core.tensor import strided_view

    n = len(comm.backends)
    parts: list[np.ndarray | None] = [None] * n
    barrier = threading.Barrier(n, timeout=WAIT_TIMEOUT_S)
    for i, (b, t) in enumerate(zip(comm.backends, tensors, strict=True)):

        def task(i=i, t=t) -> None:
            v = strided_view(t, _bytes(t))
            parts[i] = v.astype(np.float32)
            barrier.wait()
            total = parts[0].copy()
            for p in parts[1:]:
                total += p
            barrier.wait()  # nobody overwrites before everyone has summed
            v[...] = total

        b.ctx.stream.submit(task, "allreduce")
    return True


@hookimpl
def comm_free(comm):
    comm.ctx.backends = []
