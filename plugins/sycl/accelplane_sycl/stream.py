"""A backend's stream: its own in-order queue on the device's context, the plans of its graphs,
host memory its queued copies use, memory retired by dropped plans, the error word its index
kernels report bad indices in, and the random test delays; and the events recorded on it.

Semantics follow llama.cpp's SYCL per-instance-queue work (docs/ordering.md): every backend
owns a new in-order queue (never a shared default queue), so a second backend of one device (a
copy or prefetch stream) overlaps with compute.
"""

from __future__ import annotations

import ctypes
import random
from typing import TYPE_CHECKING, Any

import numpy as np
from accelplane.errors import ComputeError
from accelplane.runtime.plancache import PlanCache

from . import tuning
from .runtime import usm_of

if TYPE_CHECKING:
    from .runtime import DevState

SPINS_PER_US = 700  # k_spin steps per microsecond on the OpenCL CPU device, roughly
# bits of a backend's error word (kernels/common.cl ERR_*): kernels that meet a bad index set one
# and still never read or write out of bounds; the backend's next synchronize raises
INDEX_ERRORS = {
    1: "GET_ROWS: a row index was out of range",
    2: "SET_ROWS: a row index was out of range",
    4: "MUL_MAT_ID: an expert id was out of range",
}
_ZERO_WORD = np.zeros(1, np.uint32)  # the source of the error word's resets (alive for good)


class Stream:
    """A backend's ctx: its own in-order queue, its plans, memory retired by dropped plans, and
    the error word its index kernels (GET_ROWS, SET_ROWS, MUL_MAT_ID) report bad indices in."""

    def __init__(self, dev: DevState) -> None:
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

    def queue_copy(self, tensor, host, offset: int, size: int, to_device: bool) -> bool:
        """Queue a copy between host memory and the tensor on this queue (False: the tensor is
        not in this device's USM, so the SDK falls back)."""
        u = usm_of(tensor.buffer, self.dev)
        if u is None:
            return False
        if size:
            self.delay()
            q = self.queue
            dev = u.at(tensor.offs + offset, size, q)
            src, dst = (host[:size], dev) if to_device else (dev, host[:size])
            self.last = q.memcpy_async(dst, src, size)
        return True

    def close(self) -> None:
        """Free the stream; never raises: errors of work that nobody synchronized go with it."""
        self.sync(check=False)
        self.plans.clear()
        self.dev.streams.discard(self)
        if self.err is not None:
            self.err.release()
            self.err = None


class EventState:
    """An event's ctx: the queue event of its latest record (None: never recorded)."""

    __slots__ = ("ev",)

    def __init__(self) -> None:
        self.ev: Any = None
