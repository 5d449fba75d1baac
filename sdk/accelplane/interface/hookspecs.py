"""THE backend interface: pluggy hookspecs, one per member of ggml's backend interfaces.

A plugin is a module (named by an ``accelplane.plugins`` entry point) whose functions are
decorated with :data:`hookimpl`. Every hook except the registration hooks takes, as its first
argument, the SDK handle of the object it acts on (``device``, ``buft``, ``buffer``,
``backend``, ``event``, ``comm``); ``handle.ctx`` holds whatever the plugin returned when the
object was created, and ``device.runtime`` the device's runtime, opened on first use from its
DeviceSpec ``open`` (listing devices opens none). The SDK resolves each plugin's hookimpls
once, at registration, into a dispatch table; the hot path calls those functions directly,
never ``pm.hook`` (see docs/writing-a-plugin.md for the measured cost).

Members marked *required* must be implemented; for every optional member the SDK has a
fallback, in one place (:mod:`accelplane.runtime.backend`), named in each docstring.
Ordering and synchronization contracts are specified in docs/ordering.md.

API versioning: :data:`API_VERSION` is (major, minor). A plugin whose ``api_version()``
major differs is rejected before any of its device code runs. Hooks added in a minor version
are called only for plugins that declare at least that minor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # the handles hooks receive (accelplane.runtime.backend); no import at run time
    import numpy as np

    from accelplane.core.graph import Graph
    from accelplane.core.tensor import Tensor
    from accelplane.runtime.backend import Backend, Buffer, BufferType, Comm, Device, Event

PROJECT = "accelplane"
API_VERSION: tuple[int, int] = (1, 3)

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class DeviceType(Enum):
    CPU = "CPU"
    GPU = "GPU"
    IGPU = "IGPU"
    ACCEL = "ACCEL"


@dataclass
class DeviceCaps:
    """What a device can do (ggml_backend_dev_caps)."""

    async_: bool = False  # set/get/cpy_tensor_async and graph_compute return before completion
    host_buffer: bool = False  # get_host_buffer_type gives a pinned host buffer type
    events: bool = False  # event_new/record/wait/synchronize are implemented
    relaxed_sync: bool = True  # the scheduler's relaxed policy may be used (docs/ordering.md)
    # its kernels read its own host buffer type's memory in place, as any node's source (pinned
    # memory with unified addressing): the scheduler lets a decode's few selected experts there
    # be read where they are instead of uploading them (accelplane.sched.experts:
    # reads_in_place), and small CPU split outputs (accelplane.sched.scheduler: HOST_READ_BYTES)
    host_reads: bool = False
    # the device's work runs on the host's CPU cores (an OpenCL CPU runtime, a software Vulkan
    # driver, an emulated NPU): correct, but never placed above the CPU plugin by default
    emulated: bool = False


@dataclass
class DeviceSpec:
    """One device a plugin reports from :func:`get_devices`."""

    name: str  # short unique id, e.g. "CPU", "CUDA0", "Vulkan1"
    description: str
    type: DeviceType
    caps: DeviceCaps = field(default_factory=DeviceCaps)
    ctx: Any = None  # the plugin's own device state (becomes device.ctx): what get_devices probed
    # the device's runtime (contexts, queues, a loaded library), made on the device's first use
    # instead of at listing: open() returns it, and it becomes device.runtime. The SDK opens the
    # device before init_backend, buft_alloc, buft_from_dlpack and event_new; any hook reading
    # device.runtime opens it too. It compiles no kernel (`accelplane devices` opens every
    # device). None: ctx is all there is (device.runtime is ctx). A failure becomes
    # DeviceOpenError (runtime/backend.py, Device.open).
    open: Callable[[], Any] | None = None


@dataclass
class BufferTypeSpec:
    """A buffer type a plugin returns from get_buffer_type / get_host_buffer_type / extras."""

    name: str
    ctx: Any = None


class DLDeviceType(IntEnum):
    """DLPack's device types (dlpack.h ``DLDeviceType``), as ``__dlpack_device__`` returns them."""

    CPU = 1
    CUDA = 2
    CUDA_HOST = 3  # pinned host memory (cudaMallocHost)
    OPENCL = 4
    VULKAN = 7
    METAL = 8
    VPI = 9
    ROCM = 10
    ROCM_HOST = 11
    EXT_DEV = 12
    CUDA_MANAGED = 13
    ONE_API = 14  # SYCL unified shared memory
    WEBGPU = 15
    HEXAGON = 16
    MAIA = 17
    TRN = 18


@dataclass(frozen=True)
class DLPackMemory:
    """Memory as DLPack names it: a device (``device_type``, ``device_id``) and an address on it.

    ``ptr`` is a device address in that device type's convention (a CUDA device pointer, a
    SYCL USM pointer, a host address for CPU). ``owner`` is set by the SDK on imports
    (:func:`buft_from_dlpack`): the object that keeps the memory alive."""

    device_type: DLDeviceType
    device_id: int
    ptr: int
    owner: Any = None


class Specs:
    """The hookspecs. Names are the ones the whole ecosystem reads; do not rename."""

    # --- registration (ggml_backend_reg_i) ----------------------------------------------------
    @hookspec
    def api_version(self) -> tuple[int, int]:
        """*Required.* The (major, minor) of this interface the plugin was written for, as a
        literal (never the running SDK's API_VERSION). A different major, or a newer minor than
        the SDK's, is rejected; hooks added after an older minor are not called.

        Called before any other hook; must import nothing heavy. Example::

            @hookimpl
            def api_version():
                return (1, 3)
        """

    @hookspec
    def get_devices(self) -> list[DeviceSpec]:
        """*Required.* The plugin's devices, in a stable order, from a cheap probe: what the
        runtime can say without contexts, queues or kernels (a count, names, types, memory
        sizes), as ``accelplane.devices()`` lists every plugin's devices and must stay fast.
        The rest of a device's runtime goes in its DeviceSpec ``open``, made on first use.
        This is the first call allowed to import the runtime's library. Read (and so check)
        the plugin's settings here: a ConfigError stops every use of the registry. Return []
        when the runtime has no device, and raise DeviceError when the runtime itself is
        absent: both are "no device" (``accelplane conformance --allow-no-device`` reports
        them as skipped). Raise anything else to report a broken runtime (the registry
        records it, the host carries on). Never compile kernels here. Example::

            return [DeviceSpec("GPU0", "Acme X1", DeviceType.GPU, ctx=probe,
                               open=lambda: DeviceRuntime(probe))]
        """

    # --- device (ggml_backend_device_i) -------------------------------------------------------
    @hookspec
    def device_memory(self, device: Device) -> tuple[int, int] | None:
        """(free, total) bytes. Listings call it before the device is open
        (``device.is_open`` False): answer from what get_devices probed, or return None when
        the figures need the runtime (``device.memory()`` then opens it and asks again; a
        listing that must stay cheap shows none). Fallback: (0, 0) = "no memory to report"."""

    @hookspec
    def init_backend(self, device: Device, backend: Backend, params: str) -> Any:
        """*Required.* Create a stream (an in-order queue of work) on ``device``; return its
        ctx (becomes ``backend.ctx``). Every call makes a new, independent stream."""

    @hookspec
    def get_buffer_type(self, device: Device) -> BufferTypeSpec:
        """*Required.* The device's preferred buffer type. Called once per device; the SDK
        caches the handle."""

    @hookspec
    def get_host_buffer_type(self, device: Device) -> BufferTypeSpec | None:
        """A pinned host buffer type for faster transfers. Fallback: None (none). The decoder
        model keeps host-memory experts there; a scheduler with this device as its one
        accelerator puts the CPU's compute memory there when the device does not compute on that
        buffer type itself (``supports_buft`` False): the CPU splits' inputs and outputs then
        cross as DMA copies, which may read the host memory after ``cpy_tensor_async`` returns,
        until the destination stream synchronizes."""

    @hookspec
    def get_extra_buffer_types(self, device: Device) -> list[BufferTypeSpec]:
        """Extra buffer types (e.g. a weight repack layout). Fallback: []."""

    @hookspec
    def supports_op(self, device: Device, op: Tensor) -> bool:
        """*Required.* Whether ``op`` (a node: type, ne, nb, op_params and sources as built)
        can run on this device with the results the conformance suite demands. False means
        "not supported" and is never a failure; True must be honest (the suite proves it)."""

    @hookspec
    def supports_buft(self, device: Device, buft: BufferType) -> bool:
        """*Required.* Whether this device's backends can read and write tensors in buffers
        of ``buft`` directly during graph_compute."""

    @hookspec
    def offload_op(self, device: Device, op: Tensor) -> bool:
        """Whether the device wants to run ``op`` although its weights live in a host buffer
        (the scheduler then copies them; for MUL_MAT_ID, only the experts the ids select).
        ggml's rule is ``accelplane.core.ops.offload_batch(op) >= OFFLOAD_MIN_BATCH`` (32 rows).
        Fallback: False."""

    @hookspec
    def event_new(self, device: Device) -> Any:
        """A new event's ctx. Fallback (no events): the scheduler synchronizes instead."""

    @hookspec
    def event_free(self, device: Device, event: Event) -> None:
        """Release an event. Fallback: nothing."""

    @hookspec
    def event_synchronize(self, device: Device, event: Event) -> None:
        """Block the host until ``event`` has completed (an unrecorded event is complete).
        Required when event_new is implemented (so is event_record); without events the
        fallback is that recording synchronizes, so there is nothing left to wait for."""

    # --- buffer type (ggml_backend_buffer_type_i) ---------------------------------------------
    @hookspec
    def buft_alloc(self, buft: BufferType, buffer: Buffer, size: int) -> Any:
        """*Required.* Allocate ``size`` bytes; return the buffer's ctx. Raise
        accelplane.errors.AllocationError when the memory is not there."""

    @hookspec
    def buft_alignment(self, buft: BufferType) -> int:
        """Alignment of tensor offsets in bytes. Fallback: 64."""

    @hookspec
    def buft_max_size(self, buft: BufferType) -> int:
        """Largest single allocation; bigger ones become a multi-buffer. Fallback: unlimited."""

    @hookspec
    def buft_alloc_size(self, buft: BufferType, tensor: Tensor) -> int:
        """Bytes a tensor takes in this buffer type (padding). Fallback: tensor.nbytes."""

    @hookspec
    def buft_is_host(self, buft: BufferType) -> bool:
        """Data lives in host memory in standard ggml layout, readable through
        buffer_host_array. Fallback: False."""

    # --- buffer (ggml_backend_buffer_i) ---------------------------------------------------------
    @hookspec
    def buffer_free(self, buffer: Buffer) -> None:
        """Release the buffer's memory. Fallback: nothing (garbage collection)."""

    @hookspec
    def buffer_host_array(self, buffer: Buffer) -> Any:
        """For host buffers: a writable numpy uint8 array over the whole buffer (ggml's
        get_base). Required when buft_is_host is True."""

    @hookspec
    def buffer_init_tensor(self, buffer: Buffer, tensor: Tensor) -> None:
        """Called when a tensor (or view) is placed in the buffer; may set tensor.extra.
        Fallback: nothing."""

    @hookspec
    def buffer_memset_tensor(
        self, buffer: Buffer, tensor: Tensor, value: int, offset: int, size: int
    ) -> None:
        """Set ``size`` bytes at ``offset`` of the tensor's data to ``value``.
        Fallback: buffer_set_tensor with a filled array."""

    @hookspec
    def buffer_set_tensor(
        self, buffer: Buffer, tensor: Tensor, data: np.ndarray, offset: int, size: int
    ) -> None:
        """*Required.* Copy ``size`` bytes from the uint8 array ``data`` to byte ``offset``
        of the tensor's data, blocking. Ranges are checked by the SDK before the call. The
        bytes are ggml's layout of the tensor's type; a plugin may keep another layout in its
        memory (weights regrouped for its kernels) if get_tensor gives these bytes back, its
        copies to other layouts decline (buffer_cpy_tensor, cpy_tensor_async return False)
        and its kernels read and write that layout."""

    @hookspec
    def buffer_get_tensor(
        self, buffer: Buffer, tensor: Tensor, out: np.ndarray, offset: int, size: int
    ) -> None:
        """*Required.* Copy ``size`` bytes at ``offset`` of the tensor's data into the uint8
        array ``out``, blocking."""

    @hookspec
    def buffer_cpy_tensor(self, buffer: Buffer, src: Tensor, dst: Tensor) -> bool:
        """Copy src (any buffer) into dst (in this buffer), blocking. Return False when it
        cannot; fallback: through host memory."""

    @hookspec
    def buffer_clear(self, buffer: Buffer, value: int) -> None:
        """Fill the whole buffer with the byte ``value``. Required when buft_is_host is
        False (Buffer.clear raises DeviceError without it); fallback for host buffers: the
        buffer_host_array is filled."""

    # --- DLPack (1.2): zero-copy exchange with other array libraries (docs/interop.md) ----------
    @hookspec
    def buffer_dlpack(self, buffer: Buffer, tensor: Tensor) -> DLPackMemory | None:
        """Where the tensor's bytes are, for a zero-copy ``Tensor.__dlpack__``: a
        DLPackMemory whose ``ptr`` is the address of the tensor's byte 0 (``tensor.offs`` into
        the buffer), valid for as long as the buffer is not freed, holding the tensor in ggml's
        layout (its ``nb`` strides), and readable and writable by another library on that
        DLPack device. Return None when that is not so (memory no other library can address,
        weights kept in another layout); the tensor is never quantized. Pure: no side effects.
        Fallback (hook missing or None): a host buffer (buft_is_host) shares buffer_host_array
        as ``DLDeviceType.CPU`` memory; any other buffer is exported as a host copy. Example
        (CUDA): ``return DLPackMemory(DLDeviceType.CUDA, index, mem.ptr + tensor.offs)``. The
        three DLPack hooks are called for plugins of API 1.2 and later."""

    @hookspec
    def device_dlpack_wait(self, device: Device, stream: Any) -> None:
        """Make a DLPack consumer's ``stream`` wait, device-side where possible, for the work
        queued so far on every backend of ``device`` (``device.backends``), before the consumer
        uses memory that buffer_dlpack gave it. ``stream`` follows the array API's convention
        for the device type buffer_dlpack names (CUDA: an int cudaStream_t, None or 1 the
        legacy default stream, 2 the per-thread one); -1 never reaches the hook (no ordering
        asked). Raise accelplane.errors.DLPackError for a value the plugin cannot take.
        Fallback: synchronize every backend of the device (the host waits)."""

    @hookspec
    def buft_from_dlpack(self, buft: BufferType, buffer: Buffer, memory: DLPackMemory, size: int) -> Any:
        """Wrap ``size`` bytes of another library's memory at ``memory.ptr`` as ``buffer``'s
        ctx, without copying (ggml's buffer_from_host_ptr): the ctx must keep ``memory.owner``
        referenced for as long as it uses the memory (buffer_free drops it). The tensor placed at
        offset 0 is ``size`` bytes, any alignment of its element type. Return None when buffers
        of this type cannot address that memory (another device or context, an address its
        kernels cannot take); the SDK then copies into a new buffer. Order after the producer's
        work on the memory: the producer was asked with ``stream=None`` (for CUDA: the legacy
        default stream). Fallback: None (always a copy)."""

    # --- backend / stream (ggml_backend_i) --------------------------------------------------------
    @hookspec
    def backend_free(self, backend: Backend) -> None:
        """Release the stream after finishing its work. Fallback: nothing."""

    @hookspec
    def set_tensor_async(
        self, backend: Backend, tensor: Tensor, data: np.ndarray, offset: int, size: int
    ) -> bool:
        """Queue a host→tensor copy on the stream; ``data`` must stay alive and unchanged
        until the stream is synchronized (docs/ordering.md). Return False (or leave
        unimplemented) to get the fallback: synchronize + blocking set."""

    @hookspec
    def get_tensor_async(
        self, backend: Backend, tensor: Tensor, out: np.ndarray, offset: int, size: int
    ) -> bool:
        """Queue a tensor→host copy; ``out`` is valid after a synchronize. Fallback as above."""

    @hookspec
    def cpy_tensor_async(self, backend_src: Backend, backend_dst: Backend, src: Tensor, dst: Tensor) -> bool:
        """Called for the destination's plugin. Copy src into dst ordered after prior work
        on backend_src and before later work on backend_dst, without blocking the host where
        the hardware allows. Return False when it cannot (never silently block or copy
        wrong). Fallback: synchronize both backends, then a blocking copy."""

    @hookspec
    def synchronize(self, backend: Backend) -> None:
        """Block the host until all work queued on the stream has completed. Fallback:
        nothing (a backend without it must be fully synchronous)."""

    @hookspec
    def graph_compute(self, backend: Backend, graph: Graph) -> None:
        """*Required.* Queue the computation of every node of ``graph`` (nodes whose op is a
        view op compute nothing). May return before completion if caps.async_. A plugin
        should plan once per (graph.uid, graph.layout_version) and replay. It may run
        several nodes as one kernel where accelplane.core.fusion.Fusion(graph).match allows it
        (leaving the skipped nodes' memory unwritten), never otherwise. Raise
        accelplane.errors.ComputeError on failure."""

    @hookspec
    def graph_optimize(self, backend: Backend, graph: Graph) -> None:
        """Optional reorder/fusion preparation of ``graph`` before it is allocated, called
        when the host calls Backend.graph_optimize(graph) (the Scheduler does not). Fallback:
        nothing (the graph runs as built)."""

    @hookspec
    def event_record(self, backend: Backend, event: Event) -> None:
        """Record ``event`` at the current end of the stream: it completes when all work
        queued before it has. Required when event_new is implemented. Fallback (no events):
        synchronize."""

    @hookspec
    def event_wait(self, backend: Backend, event: Event) -> None:
        """Make later work on the stream wait for ``event``, device-side where possible
        (not by blocking the host). Fallback: event_synchronize."""

    # --- recording (1.1): replay a whole sequence of queued work with one call -----------------
    @hookspec
    def record_begin(self, backend: Backend) -> bool:
        """Start recording the backend's queue: until record_end, graph_compute and
        comm_allreduce_tensor calls on it are recorded, NOT executed. The caller queues nothing
        else on it meanwhile (no tensor copies, events or synchronize), and keeps every tensor
        the recorded work touches at the same address while it keeps the recording. Several
        backends may record at once, with comm calls spanning them. Return False when
        recording is not possible now. Fallback: False (work is queued each time)."""

    @hookspec
    def record_end(self, backend: Backend) -> Any:
        """Stop recording. Return a recording for record_replay, which keeps alive whatever
        the recorded work needs (plans, scratch), or None if recording failed. Either way the
        recorded work has not run. Required when record_begin is implemented."""

    @hookspec
    def record_replay(self, backend: Backend, recording: Any) -> None:
        """Queue the recorded work again, in order, with the inputs' current contents, as
        if each call were made now (docs/ordering.md: same ordering as the calls it stands
        for). Required when record_begin is implemented."""

    # --- timeline: when the device ran each piece of queued work ------------------------------
    @hookspec
    def timeline_begin(self, backend: Backend) -> bool:
        """Start noting, on the device's own clock, when each copy and each graph compute
        queued on the stream from now on starts and ends (for CUDA: a pair of timing events
        around each). Return False when the plugin cannot. Called for plugins of API 1.3 and
        later. Fallback: False (no timeline)."""

    @hookspec
    def timeline_end(self, backend: Backend) -> list[tuple[str, float, float]]:
        """Stop noting and return what ran since timeline_begin, in queue order, as (kind,
        start, end): kind "copy" or "compute", times in seconds on one clock shared by every
        stream of the device (its origin is the plugin's). The caller has synchronized the
        stream. Required when timeline_begin is implemented."""

    # --- comm extension (tensor parallelism) ---------------------------------------------------
    @hookspec
    def comm_init(self, backends: list[Backend]) -> Any:
        """A communicator over ``backends`` (all of this plugin), or None when the plugin
        cannot serve that set (the SDK then uses its butterfly / ring fallback)."""

    @hookspec
    def comm_allreduce_tensor(self, comm: Comm, tensors: list[Tensor]) -> bool:
        """Sum ``tensors`` (one per backend, same type and shape) in place on every backend,
        asynchronously ordered on each backend's stream. Return False to ask for the SDK
        fallback for this call."""

    @hookspec
    def comm_free(self, comm: Comm) -> None:
        """Release a communicator. Fallback: nothing."""

    # --- conformance ------------------------------------------------------------------------------
    @hookspec
    def conformance_expected_failures(self) -> str | None:
        """Text of the plugin's expected-failures file for the conformance suite, or None:
        ``test id: reason`` lines, ``#`` comments, each id the case's name as the suite's JSON
        report prints it (``test_op[ADD(type=f32,...)]``). Strict: an entry whose case
        passes, or that matches no case, fails the run. Fallback: None (no expected
        failures)."""


REQUIRED_HOOKS = frozenset(
    {"api_version", "get_devices", "init_backend", "get_buffer_type", "supports_op",
     "supports_buft", "buft_alloc", "buffer_set_tensor", "buffer_get_tensor", "graph_compute"}
)  # fmt: skip
HOOK_NAMES = tuple(n for n in vars(Specs) if not n.startswith("_"))
# hooks new in a minor version: name -> minor that introduced it
HOOK_MIN_MINOR: dict[str, int] = {
    "record_begin": 1, "record_end": 1, "record_replay": 1,
    "buffer_dlpack": 2, "device_dlpack_wait": 2, "buft_from_dlpack": 2,
    "timeline_begin": 3, "timeline_end": 3,
}  # fmt: skip
