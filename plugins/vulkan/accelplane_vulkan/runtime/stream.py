"""Streams: an in-order stream on a LogicalDevice (a queue, command buffers, a timeline
semaphore chaining every submission), its staging areas, and copies between streams.

Ordering model (docs/ordering.md): each Stream owns a timeline semaphore; submission k waits
for value k-1 and signals k, so a stream runs in order whatever queue it shares, and "value
v reached" means "all work up to submission v done". An event is such a (stream, value). A
stream waits for another stream of the same VkDevice on the device (a semaphore wait); for a
stream of another VkDevice (semaphores cannot be shared there) a host bridge thread waits on
the host, runs an optional host step (a staging copy), then signals a semaphore of the
waiting stream: the host that queued the work is never blocked.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from accelplane.errors import ComputeError, DeviceError

from .. import tuning
from .memory import Memory
from .sync import Bridge
from .timestamps import Timeline
from .vk import NULL, V, check, cmd_copy, cmd_to_host, create, ffi, lib, new_struct

if TYPE_CHECKING:
    from .device import LogicalDevice

# error word bits, set by kernels that meet bad indices (they never read or write out of bounds)
ERRORS = {
    1: "GET_ROWS: a row index out of range (its row was written as zeros)",
    2: "SET_ROWS: a row index out of range (that row was not written)",
    4: "MUL_MAT_ID: an expert id out of range (its output was written as zeros)",
}
STAGING_CHUNK = 16 << 20  # blocking transfers go through staging in pieces of this size
WAIT_SLICE_NS = 200_000_000  # host waits wake up this often (Ctrl-C, timeout checks)


class Staging:
    """A host-visible area of a stream (``owner``), busy until (stream, value) completes."""

    __slots__ = ("mem", "owner", "busy")

    def __init__(self, mem: Memory, owner: Stream) -> None:
        self.mem = mem
        self.owner = owner
        self.busy: tuple[Stream, int] | None = None

    def free_now(self) -> bool:
        if self.busy is None:
            return True
        s, v = self.busy
        if s.closed:
            return True
        # the owner's host tasks (downloads landing in the caller's array) read the area after
        # the value completes: it is free once they ran
        return (s.drained if s is self.owner else s.completed()) >= v


class Stream:
    """An in-order stream on a LogicalDevice: a queue (maybe shared), a command pool, a
    timeline semaphore chaining every submission, staging areas, host tasks that run once a
    value completes (copies into the caller's arrays), and a host bridge when needed. Its
    copies (upload, download, copy, fill) go to the device's transfer queue where it has one,
    recorded from a second pool of that family: the semaphore keeps them in the stream's order."""

    def __init__(self, dev: LogicalDevice, label: str) -> None:
        self.dev = dev
        self.label = label
        self.queue = dev.next_queue()
        self.pool = self._new_pool(dev.family)
        self.xqueue = dev.xfer_queue
        self.xpool = None  # made at the first copy
        self.sem = dev.new_timeline()
        self.submitted = 0
        self._done = 0
        self.drained = 0  # host tasks up to this value have run
        self.closed = False
        self.idle_cmds: list = []
        self.idle_xcmds: list = []  # the transfer pool's
        self.busy_cmds: collections.deque = collections.deque()  # (value, cmd, its idle list)
        self.host_tasks: collections.deque = collections.deque()  # (value, fn)
        self.garbage: list[tuple[list, Callable[[], None]]] = []  # ([value], destroy)
        self.staging: list[Staging] = []
        self.bridge: Bridge | None = None
        self.bridge_refs = 0  # bridge jobs (of other streams) still waiting on this stream
        self.refs_lock = threading.Lock()
        self.lock = threading.RLock()
        self.stats: collections.Counter = collections.Counter()  # submits, plans and dispatches recorded
        self.err = Memory(dev, 16, host=True)  # kernels OR error bits into word 0
        self.err.host[:] = 0
        self._counter = ffi.new("uint64_t*")
        self.plans = None  # a PlanCache, set by the plugin for backend streams
        self.timeline: Timeline | None = None  # while noting (Backend.timeline_begin)
        # ACCELPLANE_TEST_DELAY_US (set for backend streams): each submission also waits for a
        # host bridge job that sleeps a random time, so queued work lags the host and ordering
        # bugs show up in the conformance suite's race cases
        self.delay_s = 0.0
        self._rng = random.Random()
        self.timeout_s = tuning.read().timeout_s  # host waits give up after this long
        dev.streams.add(self)

    def __repr__(self) -> str:
        return f"Stream({self.label}, submitted={self.submitted})"

    # progress
    def completed(self) -> int:
        if self._done >= self.submitted or self.closed:
            return self._done
        lib.vkGetSemaphoreCounterValue(self.dev.handle, self.sem, self._counter)
        self._done = self._counter[0]
        return self._done

    def wait_raw(self, value: int, what: str = "") -> None:
        """Block until ``value`` is reached (no host tasks run: callable from any thread)."""
        if value <= self._done or self.closed:
            return
        sems = ffi.new("VkSemaphore[1]", [self.sem])
        vals = ffi.new("uint64_t[1]", [value])
        wi = new_struct(
            "VkSemaphoreWaitInfo",
            V.VK_STRUCTURE_TYPE_SEMAPHORE_WAIT_INFO,
            semaphoreCount=1,
            pSemaphores=sems,
            pValues=vals,
        )
        deadline = time.monotonic() + self.timeout_s
        while True:
            r = lib.vkWaitSemaphores(self.dev.handle, wi, WAIT_SLICE_NS)
            if r == V.VK_SUCCESS:
                break
            if r != V.VK_TIMEOUT:
                check(r, f"vkWaitSemaphores ({self.label})")
            if time.monotonic() > deadline:
                raise ComputeError(
                    f"Vulkan {self.label}: timed out after {self.timeout_s:.0f} s waiting for "
                    f"{what or 'queued work'} (ACCELPLANE_VK_TIMEOUT_S)"
                )

    def wait(self, value: int, what: str = "") -> None:
        """Block until ``value`` is reached, then run the host tasks it released."""
        self.wait_raw(value, what)
        self.drain()

    def synchronize(self) -> None:
        self.wait(self.submitted)
        if self.dev.garbage:
            self.dev.collect()
        self.raise_errors()

    def raise_errors(self) -> None:
        """Raise what kernels (error word) or the host bridge reported, once."""
        if self.bridge is not None:
            self.bridge.raise_errors()
        word = int(self.err.host[:4].view(np.uint32)[0])
        if word:
            self.err.host[:4] = 0
            what = "; ".join(m for bit, m in ERRORS.items() if word & bit) or f"error word {word:#x}"
            raise ComputeError(f"Vulkan {self.label}: {what}")

    def drain(self) -> None:
        """Run host tasks, recycle command buffers and release garbage up to the completed value."""
        done = self.completed()
        while self.host_tasks and self.host_tasks[0][0] <= done:
            self.host_tasks.popleft()[1]()
        self.drained = done
        while self.busy_cmds and self.busy_cmds[0][0] <= done:
            _, cmd, idle = self.busy_cmds.popleft()
            idle.append(cmd)
        if self.garbage:
            keep = []
            for cell, destroy in self.garbage:
                if cell[0] <= done:
                    destroy()
                else:
                    keep.append((cell, destroy))
            self.garbage = keep

    # recording and submission
    def _new_pool(self, family: int):
        ci = new_struct(
            "VkCommandPoolCreateInfo",
            V.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
            flags=V.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
            queueFamilyIndex=family,
        )
        return create("CommandPool", self.dev.handle, ci)

    def alloc_cmd(self, pool=None):
        ai = new_struct(
            "VkCommandBufferAllocateInfo",
            V.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
            commandPool=self.pool if pool is None else pool,
            level=V.VK_COMMAND_BUFFER_LEVEL_PRIMARY,
            commandBufferCount=1,
        )
        out = ffi.new("VkCommandBuffer*")
        check(lib.vkAllocateCommandBuffers(self.dev.handle, ai, out), "vkAllocateCommandBuffers")
        return out[0]

    def begin(self, flags: int = V.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT, cmd=None, xfer: bool = False):
        """A command buffer in the recording state (a recycled one when possible); ``xfer``: of
        the transfer pool, for submit(.., xfer=True) (copies only)."""
        if cmd is None:
            self.drain()
            idle = self.idle_xcmds if xfer else self.idle_cmds
            if idle:
                cmd = idle.pop()
                lib.vkResetCommandBuffer(cmd, 0)
            elif xfer:
                if self.xpool is None:
                    self.xpool = self._new_pool(self.dev.xfer_family)
                cmd = self.alloc_cmd(self.xpool)
            else:
                cmd = self.alloc_cmd()
        bi = new_struct(
            "VkCommandBufferBeginInfo", V.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO, flags=flags
        )
        check(lib.vkBeginCommandBuffer(cmd, bi), "vkBeginCommandBuffer")
        return cmd

    def submit(self, cmds: tuple = (), waits: tuple = (), transient: bool = True, xfer: bool = False) -> int:
        """Queue ``cmds`` after everything queued so far and after ``waits`` ((semaphore,
        value) pairs of the same VkDevice); returns the value that marks their completion.
        ``xfer``: on the transfer queue (``cmds`` from begin(xfer=True): copies only)."""
        if self.closed:
            raise DeviceError(f"Vulkan stream {self.label} used after free")
        if transient:  # recorded by begin(): end them here (plans end theirs when recorded)
            for c in cmds:
                check(lib.vkEndCommandBuffer(c), "vkEndCommandBuffer")
        if self.delay_s > 0:
            w = self.bridge_in(None, 0, _sleeper(self._rng.uniform(0, self.delay_s)))
            waits = (*waits, (self.bridge.sem, w))  # type: ignore[union-attr]
        v = self.submitted + 1
        sems = [self.sem] + [s for s, _ in waits]
        n = len(sems)
        c_sems = ffi.new("VkSemaphore[]", sems)
        c_vals = ffi.new("uint64_t[]", [v - 1] + [int(x) for _, x in waits])
        c_stages = ffi.new("VkPipelineStageFlags[]", [V.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT] * n)
        sig = ffi.new("VkSemaphore[1]", [self.sem])
        sig_v = ffi.new("uint64_t[1]", [v])
        tl = new_struct(
            "VkTimelineSemaphoreSubmitInfo",
            V.VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO,
            waitSemaphoreValueCount=n,
            pWaitSemaphoreValues=c_vals,
            signalSemaphoreValueCount=1,
            pSignalSemaphoreValues=sig_v,
        )
        c_cmds = ffi.new("VkCommandBuffer[]", list(cmds)) if cmds else NULL
        si = new_struct(
            "VkSubmitInfo",
            V.VK_STRUCTURE_TYPE_SUBMIT_INFO,
            pNext=tl,
            waitSemaphoreCount=n,
            pWaitSemaphores=c_sems,
            pWaitDstStageMask=c_stages,
            commandBufferCount=len(cmds),
            pCommandBuffers=c_cmds,
            signalSemaphoreCount=1,
            pSignalSemaphores=sig,
        )
        queue = self.xqueue if xfer else self.queue
        with queue.lock:
            r = lib.vkQueueSubmit(queue.handle, 1, si, NULL)
        check(r, f"vkQueueSubmit ({self.label})")
        self.submitted = v
        self.stats["xfer_submits" if xfer else "submits"] += 1
        if transient:
            for c in cmds:
                self.busy_cmds.append((v, c, self.idle_xcmds if xfer else self.idle_cmds))
        return v

    def after(self, value: int, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the host once ``value`` completes (at the next drain)."""
        self.host_tasks.append((value, fn))

    # staging
    def stage(self, size: int) -> Staging:
        """A host-visible area of at least ``size`` bytes that no queued work still uses;
        mark it with ``st.busy = (stream, value)`` once work using it is queued."""
        self.drain()
        best = None
        for st in self.staging:
            if st.mem.size >= size and st.free_now() and (best is None or st.mem.size < best.mem.size):
                best = st
        if best is not None and best.mem.size <= max(4 * size, 1 << 20):
            best.busy = None
            return best
        if len(self.staging) >= 8:  # keep the pool small: drop idle areas
            for st in [s for s in self.staging if s.free_now()]:
                self.staging.remove(st)
                st.mem.free()
        st = Staging(Memory(self.dev, max(1 << 16, 1 << (max(size, 1) - 1).bit_length()), host=True), self)
        self.staging.append(st)
        return st

    # transfers (queued; the host returns at once)
    def upload(self, mem: Memory, offset: int, data: np.ndarray, waits: tuple = ()) -> int:
        """Queue host data → mem[offset:]: copied into staging now, so ``data`` is free at once."""
        size = data.size
        st = self.stage(size)
        st.mem.host[:size] = data
        v = self.copy(st.mem, 0, mem, offset, size, waits)
        st.busy = (self, v)
        return v

    def download(self, mem: Memory, offset: int, out: np.ndarray, size: int) -> int:
        """Queue mem[offset:offset+size] → ``out`` (written when the value completes and the
        stream drains: at synchronize or event_synchronize)."""
        st = self.stage(size)
        v = self.copy(mem, offset, st.mem, 0, size, to_host=True)
        st.busy = (self, v)
        host = st.mem.host

        def land() -> None:
            out[:size] = host[:size]

        self.after(v, land)
        return v

    def copy(self, src: Memory, src_off: int, dst: Memory, dst_off: int, size: int, waits: tuple = (),
             to_host: bool = False) -> int:  # fmt: skip
        """Queue src[src_off:] → dst[dst_off:]; ``to_host``: made visible to host reads of dst."""
        x = self.xqueue is not None
        cmd = self.begin(xfer=x)
        q = self.timeline.stamps("copy") if self.timeline is not None else None
        if q:
            lib.vkCmdWriteTimestamp(cmd, V.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, q[0], q[1])
        cmd_copy(cmd, src.buf, src_off, dst.buf, dst_off, size)
        if q:
            lib.vkCmdWriteTimestamp(cmd, V.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, q[0], q[1] + 1)
        if to_host:
            cmd_to_host(cmd)
        return self.submit((cmd,), waits, xfer=x)

    def run_recorded(self, cmd) -> int:
        """Queue ``cmd``, recorded once and resubmitted (a plan's), after everything queued so
        far; between two timestamps of its own while a timeline is noted."""
        q = self.timeline.stamps("compute") if self.timeline is not None else None
        if not q:
            return self.submit((cmd,), transient=False)
        stamps = []
        top, bottom = V.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, V.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT
        for stage, i in ((top, q[1]), (bottom, q[1] + 1)):
            c = self.begin()
            lib.vkCmdWriteTimestamp(c, stage, q[0], i)
            check(lib.vkEndCommandBuffer(c), "vkEndCommandBuffer")
            stamps.append(c)
        v = self.submit((stamps[0], cmd, stamps[1]), transient=False)
        self.busy_cmds.extend((v, c, self.idle_cmds) for c in stamps)
        return v

    def fill(self, mem: Memory, offset: int, size: int, value: int) -> int:
        """vkCmdFillBuffer: offset and size multiples of 4."""
        x = self.xqueue is not None
        cmd = self.begin(xfer=x)
        word = (value & 0xFF) * 0x01010101
        lib.vkCmdFillBuffer(cmd, mem.buf, offset, size, word)
        return self.submit((cmd,), xfer=x)

    # blocking transfers in pieces (bounded staging), for buffer_set/get_tensor
    def upload_blocking(self, mem: Memory, offset: int, data: np.ndarray) -> None:
        with self.lock:
            inflight: collections.deque = collections.deque()
            for lo in range(0, data.size, STAGING_CHUNK):
                if len(inflight) >= 2:
                    self.wait(inflight.popleft())
                inflight.append(self.upload(mem, offset + lo, data[lo : lo + STAGING_CHUNK]))
            self.wait(self.submitted)

    def download_blocking(self, mem: Memory, offset: int, out: np.ndarray, size: int) -> None:
        with self.lock:
            for lo in range(0, size, STAGING_CHUNK):
                n = min(STAGING_CHUNK, size - lo)
                self.download(mem, offset + lo, out[lo : lo + n], n)
                self.wait(self.submitted)  # lands the piece before its staging is reused

    # waiting for other streams
    def wait_for(self, other: Stream, value: int) -> int:
        """Make later work of this stream wait for ``other`` reaching ``value``: device-side on
        the same VkDevice, through the host bridge otherwise. Returns this stream's value."""
        if other is self or value <= 0 or other.closed or other.completed() >= value:
            return self.submitted
        if other.dev is self.dev:
            return self.submit((), ((other.sem, value),))
        w = self.bridge_in(other, value, None)
        return self.submit((), ((self.bridge.sem, w),))  # type: ignore[union-attr]

    def bridge_in(self, src: Stream | None, value: int, step: Callable[[], None] | None) -> int:
        """A bridge job: after ``src`` reaches ``value`` (host wait) run ``step`` on the host,
        then signal this stream's bridge semaphore; returns the value to wait on."""
        if self.bridge is None:
            self.bridge = Bridge(self)
        return self.bridge.add(src, value, step)

    def retire(self, cell: list, destroy: Callable[[], None]) -> None:
        """Destroy resources once the value in ``cell`` (their last use) completes."""
        if self.closed:
            return
        self.garbage.append((cell, destroy))

    def close(self) -> None:
        if self.closed:
            return
        self.synchronize()
        while self.bridge_refs:  # another stream's bridge still waits on our semaphore
            time.sleep(0.001)
        # other streams' submissions may name our semaphore, the driver may still be cleaning
        # up ours: nothing is destroyed before the device is idle
        self.dev.wait_idle()
        if self.bridge is not None:
            self.bridge.stop()
        if self.plans is not None:
            self.plans.clear()  # their finalizers retire command buffers into self.garbage
        for _, destroy in self.garbage:
            destroy()
        self.garbage = []
        for st in self.staging:
            st.mem.free()
        self.staging = []
        if self.timeline is not None:
            self.timeline.free()
            self.timeline = None
        self.err.free()
        self.closed = True
        self._done = self.submitted
        lib.vkDestroyCommandPool(self.dev.handle, self.pool, NULL)
        if self.xpool is not None:
            lib.vkDestroyCommandPool(self.dev.handle, self.xpool, NULL)
        lib.vkDestroySemaphore(self.dev.handle, self.sem, NULL)


def _sleeper(seconds: float) -> Callable[[], None]:
    return lambda: time.sleep(seconds)


# --- between the plugin's handles and streams -----------------------------------------------------
def stream_of(backend) -> Stream | None:
    """The backend's Stream, or None for another plugin's backend."""
    s = getattr(backend, "ctx", None)
    return s if isinstance(s, Stream) else None


def memory_of(t) -> Memory | None:
    """The Memory of a tensor's buffer, or None for another plugin's buffer."""
    ctx = t.buffer.ctx if t.buffer is not None else None
    return ctx if isinstance(ctx, Memory) else None


def copy_across(ss: Stream, ds: Stream, smem: Memory, soffs: int, dmem: Memory, doffs: int, n: int) -> None:
    """Between VkDevices: out to staging on the source stream, a host copy on the bridge into
    the destination's stream (after the source's value), in from staging. The host returns."""
    out = ss.stage(n)
    cmd = ss.begin()
    cmd_copy(cmd, smem.buf, soffs, out.mem.buf, 0, n)
    cmd_to_host(cmd)
    va = ss.submit((cmd,))
    inn = ds.stage(n)

    def across() -> None:
        inn.mem.host[:n] = out.mem.host[:n]

    w = ds.bridge_in(ss, va, across)
    v = ds.copy(inn.mem, 0, dmem, doffs, n, ((ds.bridge.sem, w),))  # type: ignore[union-attr]
    out.busy = inn.busy = (ds, v)
