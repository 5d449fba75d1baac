"""Handles over plugin objects — Device, BufferType, Buffer, MultiBuffer, Backend, Event —
and ggml's fallbacks for every optional hook, in this one place.

A handle keeps the plugin's dispatch table (``_fn``: hook name → function, resolved once at
registration) and the plugin's own state in ``ctx``. Calls go straight to the plugin's
function; a missing optional hook takes the fallback written here.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np

from accelplane.errors import (
    AccelplaneError,
    AllocationError,
    BufferFreedError,
    ComputeError,
    ConfigError,
    DeviceError,
    DeviceOpenError,
    OutOfRangeError,
    ShapeError,
    UnsupportedOpError,
)
from accelplane.interface import (
    BufferTypeSpec,
    DeviceCaps,
    DeviceSpec,
    DeviceType,
    DLDeviceType,
    DLPackMemory,
)
from accelplane.runtime.data import as_u8, check_range

if TYPE_CHECKING:
    from accelplane.core.graph import Graph
    from accelplane.core.tensor import Tensor
    from accelplane.runtime.registry import Plugin

_ids = itertools.count()
_exports_lock = threading.Lock()  # Buffer._exports: DLPack consumers release from any thread


class BufferUsage(IntEnum):
    ANY = 0
    WEIGHTS = 1
    COMPUTE = 2


_CLOSED = object()  # a device's runtime before it is opened


class Device:
    """One device of a plugin (ggml_backend_dev).

    Listing devices only probes them: ``ctx`` is what the plugin's get_devices said. The
    device's runtime (``runtime``: the plugin's DeviceSpec ``open`` result, e.g. its contexts
    and queues) opens here, once, for every plugin, on the first use: a backend, a buffer, an
    event, a memory query the probe cannot answer, or a hook reading ``device.runtime``. A
    failure becomes DeviceOpenError naming the plugin, the device and the cause (a ConfigError
    stays itself), and every later use raises it again."""

    def __init__(self, plugin: Plugin, spec: DeviceSpec, index: int) -> None:
        self.plugin = plugin
        self._fn = plugin.fn
        self.name = spec.name
        self.description = spec.description
        self.type: DeviceType = spec.type
        self.caps: DeviceCaps = spec.caps
        self.ctx = spec.ctx
        self.index = index  # position within the plugin
        self._opener = spec.open
        self._runtime: Any = spec.ctx if spec.open is None else _CLOSED
        self.open_error: AccelplaneError | None = None  # why the runtime did not open
        self._open_lock = threading.Lock()
        self._buft: BufferType | None = None
        self._host_buft: BufferType | None | bool = False
        self._extra: list[BufferType] | None = None
        self._lock = threading.Lock()
        self._backends: weakref.WeakSet[Backend] = weakref.WeakSet()  # what DLPack exports order after

    def __repr__(self) -> str:
        return f"Device({self.name!r}, plugin={self.plugin.name!r}, type={self.type.value})"

    @property
    def is_open(self) -> bool:
        """Whether the runtime is open (always, for a plugin whose devices have no ``open``)."""
        return self._runtime is not _CLOSED

    @property
    def runtime(self) -> Any:
        """The plugin's runtime of this device, opened on first access (see :meth:`open`)."""
        r = self._runtime
        return self.open() if r is _CLOSED else r

    def open(self) -> Any:
        """Open the device's runtime now, if it is not open, and return it. Raises
        DeviceOpenError (naming the plugin, the device and the cause, chained) or the plugin's
        ConfigError; the failure is kept, and every later call raises it again."""
        if self._runtime is _CLOSED:
            with self._open_lock:
                if self._runtime is _CLOSED:
                    if self.open_error is not None:
                        raise self.open_error
                    try:
                        self._runtime = self._opener()  # type: ignore[misc]
                    except ConfigError as e:  # the user's setting to fix: as it is
                        self.open_error = e
                        raise
                    except Exception as e:
                        self.open_error = DeviceOpenError(
                            f"plugin {self.plugin.name!r}: device {self.name} did not open: "
                            f"{type(e).__name__}: {e}"
                        )
                        raise self.open_error from e
        return self._runtime

    def memory(self, open: bool = True) -> tuple[int, int] | None:
        """(free, total) bytes; (0, 0) when the device has nothing to report. The plugin
        answers from its probe where it can; where the figures need the runtime, it opens
        first, or with ``open=False`` (listings that must stay cheap) the answer is None."""
        f = self._fn.get("device_memory")
        if f is None:
            return (0, 0)
        r = f(self)
        if r is None and open and not self.is_open:
            self.open()
            r = f(self)
        if r is None:
            return None if not open else (0, 0)
        return int(r[0]), int(r[1])

    @property
    def buffer_type(self) -> BufferType:
        if self._buft is None:
            with self._lock:
                if self._buft is None:
                    self._buft = BufferType(self, self._fn["get_buffer_type"](self))
        return self._buft

    @property
    def host_buffer_type(self) -> BufferType | None:
        if self._host_buft is False:
            f = self._fn.get("get_host_buffer_type")
            spec = f(self) if f else None
            self._host_buft = BufferType(self, spec) if spec is not None else None
        return self._host_buft  # type: ignore[return-value]

    @property
    def extra_buffer_types(self) -> list[BufferType]:
        if self._extra is None:
            f = self._fn.get("get_extra_buffer_types")
            self._extra = [BufferType(self, s) for s in (f(self) if f else [])]
        return self._extra

    def supports_op(self, op: Tensor) -> bool:
        return bool(self._fn["supports_op"](self, op))

    def supports_buft(self, buft: BufferType) -> bool:
        return bool(self._fn["supports_buft"](self, buft))

    def offload_op(self, op: Tensor) -> bool:
        f = self._fn.get("offload_op")
        return bool(f(self, op)) if f else False

    def new_backend(self, params: str = "") -> Backend:
        """A new stream on this device (each call an independent in-order queue)."""
        self.open()
        b = Backend.__new__(Backend)
        b._init(self)
        b.ctx = self._fn["init_backend"](self, b, params)
        self._backends.add(b)
        return b

    @property
    def backends(self) -> list[Backend]:
        """This device's backends that are alive and not freed (in no particular order)."""
        return [b for b in list(self._backends) if not b.freed]

    def synchronize_backends(self) -> None:
        """Block the host until the work queued on every backend of this device has completed."""
        for b in self.backends:
            b.synchronize()

    def dlpack_wait(self, stream: Any) -> None:
        """Order a DLPack consumer's ``stream`` after the work queued on this device's backends
        (hookspecs.device_dlpack_wait); ``-1`` asks for no ordering. Fallback: synchronize them."""
        if isinstance(stream, int) and stream == -1:
            return
        f = self._fn.get("device_dlpack_wait")
        if f is not None:
            f(self, stream)
        else:
            self.synchronize_backends()

    @property
    def has_events(self) -> bool:
        return "event_new" in self._fn and self.caps.events

    def new_event(self) -> Event:
        return Event(self)


class BufferType:
    """A kind of memory of a device (ggml_backend_buffer_type)."""

    def __init__(self, device: Device, spec: BufferTypeSpec) -> None:
        self.device = device
        self._fn = device._fn
        self.name = spec.name
        self.ctx = spec.ctx
        f = self._fn.get("buft_alignment")
        self.alignment: int = int(f(self)) if f else 64
        f = self._fn.get("buft_max_size")
        self.max_size: int = int(f(self)) if f else 1 << 62
        f = self._fn.get("buft_is_host")
        self.is_host: bool = bool(f(self)) if f else False
        self._alloc_size = self._fn.get("buft_alloc_size")

    def __repr__(self) -> str:
        return f"BufferType({self.name!r})"

    def alloc_size(self, t: Tensor) -> int:
        return int(self._alloc_size(self, t)) if self._alloc_size else t.nbytes

    def alloc(self, size: int, usage: BufferUsage = BufferUsage.ANY) -> Buffer:
        """One buffer of ``size`` bytes (no max-size splitting: see alloc.py for that)."""
        if size < 0:
            raise AllocationError(f"{self.name}: negative buffer size {size}")
        if size > self.max_size:
            raise AllocationError(
                f"{self.name}: {size} bytes exceed the buffer type's max size {self.max_size}; "
                "allocate through accelplane.runtime.alloc to get a multi-buffer"
            )
        self.device.open()
        b = Buffer.__new__(Buffer)
        b._init(self, size, usage)
        b.ctx = self._fn["buft_alloc"](self, b, size)
        return b

    def from_dlpack(self, memory: DLPackMemory, size: int) -> Buffer | None:
        """A buffer over ``size`` bytes of another library's memory, not copied
        (hookspecs.buft_from_dlpack), or None when this buffer type cannot address it
        (fallback: None)."""
        f = self._fn.get("buft_from_dlpack")
        if f is None:
            return None
        self.device.open()  # the plugin wraps the memory in its runtime's objects
        b = Buffer.__new__(Buffer)
        b._init(self, size, BufferUsage.ANY)
        ctx = f(self, b, memory, size)
        if ctx is None:
            return None
        b.ctx = ctx
        return b


class Buffer:
    """Memory of one buffer type (ggml_backend_buffer). Tensors are placed with place()."""

    def _init(self, buft: BufferType, size: int, usage: BufferUsage) -> None:
        self.buft = buft
        self._fn = buft._fn
        self.size = size
        self.usage = usage
        self.freed = False
        self.ctx: Any = None
        self.uid = next(_ids)
        self.name = f"{buft.name}#{self.uid}"
        self._host: np.ndarray | None = None
        self._exports = 0  # live zero-copy DLPack exports: the plugin's buffer_free waits for them

    def __repr__(self) -> str:
        state = " freed" if self.freed else ""
        return f"Buffer({self.name!r}, {self.size} bytes{state})"

    @property
    def is_host(self) -> bool:
        return self.buft.is_host

    @property
    def device(self) -> Device:
        return self.buft.device

    def _check(self) -> None:
        if self.freed:
            raise BufferFreedError(f"buffer {self.name!r} was freed")

    @property
    def host_array(self) -> np.ndarray:
        """uint8 array over the whole buffer; only for host buffers."""
        self._check()
        if self._host is None:
            if not self.is_host:
                raise DeviceError(f"buffer {self.name!r} is not in host memory")
            self._host = self._fn["buffer_host_array"](self)
        return self._host

    def place(self, t: Tensor, offs: int) -> None:
        """Put tensor ``t`` (not a view) at byte ``offs`` of this buffer."""
        self._check()
        if t.view_src is not None:
            raise DeviceError(f"tensor {t.name!r} is a view; place its view_src instead")
        need = self.buft.alloc_size(t)
        if offs < 0 or offs + need > self.size:
            raise OutOfRangeError(
                f"tensor {t.name or t.uid!r} ({need} bytes) at offset {offs} does not fit "
                f"buffer {self.name!r} of {self.size} bytes"
            )
        t.buffer = self
        t.offs = offs
        f = self._fn.get("buffer_init_tensor")
        if f:
            f(self, t)

    def init_view(self, t: Tensor) -> None:
        """Bind view ``t`` to its view_src's memory (the view invariant)."""
        src = t.view_src
        if src is None or src.buffer is None:
            raise DeviceError(f"view {t.name or t.uid!r}: its view_src is not allocated")
        t.buffer = src.buffer
        t.offs = src.offs + t.view_offs
        f = t.buffer._fn.get("buffer_init_tensor")
        if f:
            f(t.buffer, t)

    # data: ranges are checked by Tensor before these are called
    def set_tensor(self, t: Tensor, data: np.ndarray, offset: int, size: int) -> None:
        self._check()
        self._fn["buffer_set_tensor"](self, t, data, offset, size)

    def get_tensor(self, t: Tensor, out: np.ndarray, offset: int, size: int) -> None:
        self._check()
        self._fn["buffer_get_tensor"](self, t, out, offset, size)

    def memset_tensor(self, t: Tensor, value: int, offset: int = 0, size: int | None = None) -> None:
        size = t.nbytes - offset if size is None else size
        if check_range(t, offset, size) is not self:
            raise DeviceError(f"tensor {t.name or t.uid!r} is not in buffer {self.name!r}")
        f = self._fn.get("buffer_memset_tensor")
        if f:
            f(self, t, value, offset, size)
        else:
            self.set_tensor(t, np.full(size, value, np.uint8), offset, size)

    def clear(self, value: int = 0) -> None:
        self._check()
        f = self._fn.get("buffer_clear")
        if f:
            f(self, value)
        elif self.is_host:
            self.host_array[:] = value
        else:
            raise DeviceError(f"buffer {self.name!r}: plugin has no buffer_clear")

    def set_usage(self, usage: BufferUsage) -> None:
        self.usage = usage

    # DLPack (accelplane.runtime.dlpack): where a tensor's memory is, and exports that keep it
    def dlpack_memory(self, t: Tensor) -> DLPackMemory | None:
        """Where ``t``'s bytes are for a zero-copy DLPack export (hookspecs.buffer_dlpack), or
        None when no other library can address them. Fallback: a host buffer's memory as CPU."""
        self._check()
        f = self._fn.get("buffer_dlpack")
        mem = f(self, t) if f is not None else None
        if mem is None and self.is_host:
            mem = DLPackMemory(DLDeviceType.CPU, 0, int(self.host_array.ctypes.data) + t.offs)
        return mem

    def export_acquire(self) -> None:
        """A DLPack export now uses this buffer's memory: free() leaves the memory to it."""
        self._check()
        with _exports_lock:
            self._exports += 1

    def export_release(self) -> None:
        """A DLPack export is done with the memory; the last one after free() releases it."""
        with _exports_lock:
            self._exports -= 1
            last = self.freed and self._exports == 0
        if last:
            self._release()

    def free(self) -> None:
        """Release the memory; later use of the buffer or its tensors raises BufferFreedError.
        While DLPack exports of it are alive the plugin's buffer_free waits for the last one."""
        if self.freed:
            return
        with _exports_lock:
            self.freed = True
            exported = self._exports > 0
        self._host = None
        if not exported:
            self._release()

    def _release(self) -> None:
        f = self._fn.get("buffer_free")
        if f:
            f(self)

    @property
    def buffers(self) -> list[Buffer]:
        return [self]


class CompositeBuffer(Buffer):
    """A buffer made of real ``parts`` (which hold the memory): clearing, usage and freeing go
    to every part. MultiBuffer and the meta device's buffer are composites."""

    parts: list[Buffer]

    def clear(self, value: int = 0) -> None:
        for p in self.parts:
            p.clear(value)

    def set_usage(self, usage: BufferUsage) -> None:
        self.usage = usage
        for p in self.parts:
            p.set_usage(usage)

    def free(self) -> None:
        if self.freed:
            return
        self.freed = True
        for p in self.parts:
            p.free()

    @property
    def buffers(self) -> list[Buffer]:
        return list(self.parts)


class MultiBuffer(CompositeBuffer):
    """Several real buffers acting as one (ggml's multi_buffer). Tensors never point at the
    multi-buffer: each is placed in, and points at, one real sub-buffer."""

    def __init__(self, buft: BufferType, parts: list[Buffer], usage: BufferUsage) -> None:
        self._init(buft, sum(p.size for p in parts), usage)
        self.parts = parts
        self.name = f"{buft.name}#multi{self.uid}"

    def place(self, t: Tensor, offs: int) -> None:
        raise DeviceError("tensors are placed in a multi-buffer's parts, not in the multi-buffer")

    @property
    def host_array(self) -> np.ndarray:
        raise DeviceError(f"{self.name}: a multi-buffer has no single host array; use its parts")

    def set_tensor(self, t, data, offset, size):  # pragma: no cover - tensors use their part
        raise DeviceError("multi-buffer: use the tensor's own buffer")

    get_tensor = set_tensor


class Event:
    """A device event (ggml_backend_event). Fallback without event hooks: record means
    synchronize, so the event is complete as soon as it is recorded."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._fn = device._fn
        self.freed = False
        f = self._fn.get("event_new") if device.caps.events else None
        if f:
            device.open()
        self.ctx = f(device) if f else None
        self.native = f is not None

    def _check(self) -> None:
        if self.freed:
            raise DeviceError(f"event of {self.device.name} used after free")

    def record(self, backend: Backend) -> None:
        """Complete when all work queued on ``backend`` so far has completed."""
        self._check()
        if backend.device is not self.device:
            raise DeviceError(
                f"event of device {self.device.name} cannot be recorded on a backend of "
                f"{backend.device.name}"
            )
        if self.native:
            self._fn["event_record"](backend, self)
        else:
            backend.synchronize()

    def synchronize(self) -> None:
        """Block the host until the event has completed."""
        self._check()
        if self.native:
            self._fn["event_synchronize"](self.device, self)

    def wait(self, backend: Backend) -> None:
        """Make later work on ``backend`` wait for this event (device-side when the event and
        the backend belong to the same plugin and it implements event_wait)."""
        self._check()
        if not self.native:
            return
        f = backend._fn.get("event_wait")
        if f is not None and backend.device.plugin is self.device.plugin:
            f(backend, self)
        else:
            self.synchronize()

    def free(self) -> None:
        if self.freed:
            return
        self.freed = True
        f = self._fn.get("event_free") if self.native else None
        if f:
            f(self.device, self)


class Backend:
    """A stream on a device (ggml_backend): an in-order queue of work (docs/ordering.md)."""

    def _init(self, device: Device) -> None:
        self.device = device
        self._fn = device._fn
        self.ctx: Any = None
        self.freed = False
        self.uid = next(_ids)
        self.name = f"{device.name}/{self.uid}"
        self.n_syncs = 0  # host synchronizations issued through this handle (stats)
        # graph -> (layout version, buffers it uses): what graph_compute checked of it
        self._uses: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._recorded: dict[int, Buffer] | None = None  # buffers used while recording
        fn = self._fn
        self._graph_compute = fn["graph_compute"]
        self._sync = fn.get("synchronize")
        self._set_async = fn.get("set_tensor_async")
        self._get_async = fn.get("get_tensor_async")
        self._cpy_async = fn.get("cpy_tensor_async")

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"

    def _check(self) -> None:
        if self.freed:
            raise DeviceError(f"backend {self.name} used after free")

    def synchronize(self) -> None:
        self._check()
        self.n_syncs += 1
        if self._sync is not None:
            self._sync(self)

    def graph_compute(self, graph: Graph) -> None:
        """Queue ``graph``; returns possibly before completion (synchronize to wait).

        Before the plugin sees it (docs/writing-a-plugin.md, "What the SDK checks"): every
        node is one the device supports (``supports_op``, asked once per graph; else
        UnsupportedOpError; the Scheduler places such nodes elsewhere), every tensor is
        allocated and no buffer it uses is freed (BufferFreedError). An exception from inside
        the plugin that is not an accelplane error becomes ComputeError."""
        self._check()
        use = self._uses.get(graph)
        if use is None or use[0] != graph.layout_version:
            use = self._uses[graph] = (graph.layout_version, _graph_buffers(graph, self, use is None))
        _check_not_freed(use[1], f"{self.name}: graph #{graph.uid}")
        if self._recorded is not None:
            self._recorded.update((b.uid, b) for b in use[1])
        try:
            self._graph_compute(self, graph)
        except AccelplaneError:
            raise
        except Exception as e:
            raise ComputeError(
                f"{self.name}: plugin {self.device.plugin.name!r} failed on graph #{graph.uid} "
                f"({len(graph.nodes)} nodes): {type(e).__name__}: {e}"
            ) from e

    def compute(self, graph: Graph) -> None:
        """graph_compute + synchronize."""
        self.graph_compute(graph)
        self.synchronize()

    # recording (hookspecs.record_begin): a caller that queues the same sequence every step
    # (the meta device's decode) records it once and replays it with one call per backend
    def record_begin(self) -> bool:
        """Start recording (work queued until record_end is recorded, not run); False when
        this backend cannot record."""
        self._check()
        f = self._fn.get("record_begin")
        ok = bool(f is not None and f(self))
        self._recorded = {} if ok else None
        return ok

    def record_end(self) -> Recording | None:
        """Stop recording: the recording, or None if it failed (nothing recorded has run)."""
        used, self._recorded = self._recorded or {}, None
        rec = self._fn["record_end"](self)
        return None if rec is None else Recording(rec, tuple(used.values()))

    def record_replay(self, recording: Recording) -> None:
        """Queue a recording of this backend again (BufferFreedError when a buffer its work
        uses was freed since)."""
        self._check()
        _check_not_freed(recording.buffers, f"{self.name}: a recording")
        self._fn["record_replay"](self, recording.plugin)

    # timeline (hookspecs.timeline_begin): when the device ran each queued copy and compute
    def timeline_begin(self) -> bool:
        """Start noting when the work queued from now on runs; False when the plugin cannot."""
        self._check()
        f = self._fn.get("timeline_begin")
        return bool(f is not None and f(self))

    def timeline_end(self) -> list[tuple[str, float, float]]:
        """Synchronize, stop noting, and return (kind, start_s, end_s) of each copy and compute
        run since timeline_begin, on a clock shared by the device's streams ([] without one)."""
        self._check()
        f = self._fn.get("timeline_end")
        if f is None:
            return []
        self.synchronize()
        return [(str(k), float(s), float(e)) for k, s, e in f(self) or []]

    def graph_optimize(self, graph: Graph) -> None:
        f = self._fn.get("graph_optimize")
        if f:
            f(self, graph)

    def set_tensor_async(self, t: Tensor, data: np.ndarray, offset: int = 0,
                         size: int | None = None) -> None:  # fmt: skip
        """Queue a host→tensor copy; keep ``data`` alive and unchanged until synchronized."""
        self._check()
        data = as_u8(data)
        size = data.size if size is None else size
        buf = check_range(t, offset, size)
        if self._set_async is None or not self._set_async(self, t, data, offset, size):
            self.synchronize()
            buf.set_tensor(t, data, offset, size)

    def get_tensor_async(self, t: Tensor, out: np.ndarray, offset: int = 0,
                         size: int | None = None) -> None:  # fmt: skip
        """Queue a tensor→host copy into the uint8 array ``out``; valid after synchronize."""
        self._check()
        size = out.size if size is None else size
        buf = check_range(t, offset, size)
        if out.size < size:
            raise OutOfRangeError(f"get_tensor_async: out has {out.size} bytes, need {size}")
        if self._get_async is None or not self._get_async(self, t, out, offset, size):
            self.synchronize()
            buf.get_tensor(t, out, offset, size)

    def free(self) -> None:
        if self.freed:
            return
        f = self._fn.get("backend_free")
        if f:
            f(self)
        self.freed = True


@dataclass(frozen=True)
class Recording:
    """A backend's recording: the plugin's own object (``plugin``, what record_end returned)
    and the buffers the recorded work uses, checked for being freed at every replay."""

    plugin: Any
    buffers: tuple[Buffer, ...]


def _check_not_freed(buffers, what: str) -> None:
    for b in buffers:
        if b.freed:
            raise BufferFreedError(f"{what} uses buffer {b.name!r}, which was freed")


def _graph_buffers(graph: Graph, backend: Backend, first: bool) -> tuple[Buffer, ...]:
    """The buffers ``graph`` uses, after checking (when ``first``) that ``backend``'s device
    supports every node and (always) that every tensor is allocated."""
    from accelplane.core.ops import VIEW_OPS, op_desc

    dev = backend.device
    bufs: dict[int, Buffer] = {}
    for t in (*graph.leafs, *graph.nodes):
        if first and t.op is not None and t.op not in VIEW_OPS and not dev.supports_op(t):
            srcs = ", ".join(s.type.name for s in t.src if s is not None)
            raise UnsupportedOpError(
                f"{dev.name} does not support node {t.name or t.uid!r} ({op_desc(t)} of {srcs} -> "
                f"{t.type.name} ne={list(t.ne)}); Backend.compute runs a graph on one device only: "
                "accelplane.sched.Scheduler places such nodes on a device that supports them"
            )
        if t.buffer is None:
            raise DeviceError(f"{backend.name}: tensor {t.name or t.uid!r} of graph #{graph.uid} is not "
                              "allocated (alloc_ctx_tensors / GraphAllocator.alloc_graph first)")  # fmt: skip
        bufs.setdefault(t.buffer.uid, t.buffer)
    return tuple(bufs.values())


# --- copies between tensors (ggml_backend_tensor_copy / _copy_async) ------------------------------
def same_layout(a: Tensor, b: Tensor) -> bool:
    return a.type == b.type and a.ne == b.ne and a.nb == b.nb


def tensor_copy(src: Tensor, dst: Tensor) -> None:
    """Blocking copy of src's data into dst (same layout), across any two buffers."""
    if not same_layout(src, dst):
        raise ShapeError(
            f"copy {src.name or src.uid} → {dst.name or dst.uid}: layouts differ "
            f"({src.type.name} {list(src.ne)} {list(src.nb)} vs {dst.type.name} {list(dst.ne)} "
            f"{list(dst.nb)})"
        )
    if src is dst or src.nbytes == 0:
        return
    sbuf = check_range(src, 0, src.nbytes)
    dbuf = check_range(dst, 0, dst.nbytes)
    if sbuf.is_host:
        arr = sbuf.host_array[src.offs : src.offs + src.nbytes]
        dbuf.set_tensor(dst, arr, 0, dst.nbytes)
    elif dbuf.is_host:
        arr = dbuf.host_array[dst.offs : dst.offs + dst.nbytes]
        sbuf.get_tensor(src, arr, 0, src.nbytes)
    else:
        f = dbuf._fn.get("buffer_cpy_tensor")
        if f is None or not f(dbuf, src, dst):
            tmp = np.empty(src.nbytes, np.uint8)
            sbuf.get_tensor(src, tmp, 0, src.nbytes)
            dbuf.set_tensor(dst, tmp, 0, dst.nbytes)


def tensor_copy_async(
    backend_src: Backend, backend_dst: Backend, src: Tensor, dst: Tensor, sync=None
) -> bool:
    """Copy src → dst ordered after prior work on backend_src and before later work on
    backend_dst. Tries the destination plugin's cpy_tensor_async; when it is missing or
    returns False, synchronizes both backends (through ``sync(backend)`` if given, e.g. a
    counting wrapper) and copies blocking (ggml's fallback). Returns True when the plugin
    did it asynchronously."""
    if not same_layout(src, dst):
        raise ShapeError(f"async copy {src.name} → {dst.name}: layouts differ")
    if src is dst:
        return True
    f = backend_dst._cpy_async
    if f is not None and f(backend_src, backend_dst, src, dst):
        return True
    sync = sync or Backend.synchronize
    sync(backend_src)
    if backend_dst is not backend_src:
        sync(backend_dst)
    tensor_copy(src, dst)
    return False


class Comm:
    """A plugin communicator over backends of that plugin (the comm extension). The SDK's
    butterfly/ring fallbacks for plugins without one live in accelplane.parallel.comm."""

    def __init__(self, backends: list[Backend], ctx: Any) -> None:
        self.backends = backends
        self.ctx = ctx
        self._fn = backends[0]._fn
        self.freed = False

    @classmethod
    def init(cls, backends: list[Backend]) -> Comm | None:
        """The plugin's communicator, or None when the plugin has none for this set."""
        if not backends:
            raise DeviceError("comm_init needs at least one backend")
        plugin = backends[0].device.plugin
        if any(b.device.plugin is not plugin for b in backends):
            return None
        f = backends[0]._fn.get("comm_init")
        ctx = f(backends) if f else None
        return None if ctx is None else cls(list(backends), ctx)

    def allreduce(self, tensors: list[Tensor]) -> bool:
        """Sum ``tensors`` (one per backend) in place, queued on each backend's stream.
        False means the plugin asks for the SDK fallback for this call."""
        if self.freed:
            raise DeviceError("communicator used after free")
        if len(tensors) != len(self.backends):
            raise ShapeError(f"all-reduce over {len(self.backends)} backends got {len(tensors)} tensors")
        ref = tensors[0]
        for t in tensors[1:]:
            if not same_layout(ref, t):
                raise ShapeError(f"all-reduce tensors differ in layout: {ref} vs {t}")
        for b, t in zip(self.backends, tensors, strict=True):
            buf = check_range(t, 0, t.nbytes)
            if b._recorded is not None:
                b._recorded[buf.uid] = buf
        return bool(self._fn["comm_allreduce_tensor"](self, tensors))

    def free(self) -> None:
        if not self.freed:
            self.freed = True
            f = self._fn.get("comm_free")
            if f:
                f(self)
