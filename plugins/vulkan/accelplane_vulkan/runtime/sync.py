"""Ordering between streams: host bridges (a stream waits for a stream of another VkDevice)
and events (a stream's value)."""

from __future__ import annotations

import queue as queue_mod
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from accelplane.errors import ComputeError

from .vk import NULL, V, ffi, lib, new_struct

if TYPE_CHECKING:
    from .stream import Stream


class Bridge:
    """The host bridge into one stream: a worker thread takes jobs in submission order, waits
    on the host for the source stream, runs the job's host step, and signals the stream's
    bridge semaphore, which the stream's queued work waits for on the device. In order, so
    timeline values rise monotonically; the stream consumes them in the same order."""

    def __init__(self, dst: Stream) -> None:
        self.dst = dst
        self.sem = dst.dev.new_timeline()
        self.value = 0
        self.errors: list[BaseException] = []
        self.q: queue_mod.Queue = queue_mod.Queue()
        self._sig_sem = ffi.new("VkSemaphoreSignalInfo*")
        self.thread = threading.Thread(target=self._run, name=f"vk-bridge-{dst.label}", daemon=True)
        self.thread.start()

    def add(self, src: Stream | None, value: int, step: Callable[[], None] | None) -> int:
        self.value += 1
        if src is not None:
            with src.refs_lock:
                src.bridge_refs += 1
        self.q.put((src, value, step, self.value))
        return self.value

    def _run(self) -> None:
        while True:
            job = self.q.get()
            if job is None:
                return
            src, value, step, w = job
            try:
                if src is not None:
                    src.wait_raw(value, f"work of {src.label} (host bridge)")
                if step is not None:
                    step()
            except BaseException as e:  # reported by the stream's synchronize
                self.errors.append(e)
            finally:
                if src is not None:
                    with src.refs_lock:
                        src.bridge_refs -= 1
                # always signal: a queue left waiting would hang the device
                si = new_struct(
                    "VkSemaphoreSignalInfo",
                    V.VK_STRUCTURE_TYPE_SEMAPHORE_SIGNAL_INFO,
                    semaphore=self.sem,
                    value=w,
                )
                lib.vkSignalSemaphore(self.dst.dev.handle, si)

    def raise_errors(self) -> None:
        if self.errors:
            e, self.errors = self.errors[0], []
            raise ComputeError(f"Vulkan {self.dst.label}: host bridge failed: {type(e).__name__}: {e}") from e

    def stop(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=self.dst.timeout_s)
        lib.vkDestroySemaphore(self.dst.dev.handle, self.sem, NULL)


# --- events ------------------------------------------------------------------------------------------
class EventState:
    """An event: the (stream, value) of its most recent record; unrecorded = complete."""

    __slots__ = ("stream", "value")

    def __init__(self) -> None:
        self.stream: Stream | None = None
        self.value = 0

    def record(self, stream: Stream) -> None:
        self.stream, self.value = stream, stream.submitted

    def synchronize(self) -> None:
        s = self.stream
        if s is not None and not s.closed:
            s.wait(self.value, "an event")
            s.raise_errors()

    def wait(self, stream: Stream) -> None:
        if self.stream is not None:
            stream.wait_for(self.stream, self.value)
