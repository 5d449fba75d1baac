"""The Vulkan runtime under the plugin: instance and physical devices, logical devices (queues,
memory types, pipelines), buffers, streams (a queue, command buffers and a timeline
semaphore), staging, events and host bridges between devices.

Imported on first use (get_devices), never at plugin discovery. Every Vulkan call goes
through the raw cffi functions of the ``vulkan`` package (``vk.lib``) with structs built by
``ffi.new``: its convenience wrappers lose nested pointers (a second vkCreateComputePipelines
through them fails on lavapipe) and cost 5-40 us per call.

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
import queue as queue_mod
import random
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from accelplane.errors import AllocationError, BufferFreedError, ComputeError, ConfigError, DeviceError

from . import tuning
from .tuning import LOADER

if LOADER.get():  # a loader outside the library path (e.g. unpacked from the libvulkan1 .deb):
    import ctypes  # loaded first, the package's dlopen finds it by soname

    try:
        ctypes.CDLL(LOADER.get(), mode=ctypes.RTLD_GLOBAL)
    except OSError as _e:
        raise DeviceError(f"no Vulkan driver found: ACCELPLANE_VK_LOADER: {_e}") from _e

try:
    import vulkan as _vk
except OSError as _e:  # the package dlopens libvulkan.so.1 at import
    raise DeviceError(
        "no Vulkan driver found: the Vulkan loader libvulkan.so.1 is not installed "
        f"(apt-get install libvulkan1 plus a driver, e.g. mesa-vulkan-drivers) [{_e}]"
    ) from _e

ffi, lib = _vk.ffi, _vk.lib
NULL = ffi.NULL
V = _vk  # constants

MAX_QUEUES = 4  # queues asked of the compute family; streams share them round-robin
N_BINDINGS = 5  # storage buffers of every pipeline: A, B, C, D and the stream's error word
# error word bits, set by kernels that meet bad indices (they never read or write out of bounds)
ERRORS = {
    1: "GET_ROWS: a row index out of range (its row was written as zeros)",
    2: "SET_ROWS: a row index out of range (that row was not written)",
    4: "MUL_MAT_ID: an expert id out of range (its output was written as zeros)",
}
STAGING_CHUNK = 16 << 20  # blocking transfers go through staging in pieces of this size
WAIT_SLICE_NS = 200_000_000  # host waits wake up this often (Ctrl-C, timeout checks)
DEVICE_TYPES = {0: "other", 1: "integrated GPU", 2: "discrete GPU", 3: "virtual GPU", 4: "CPU"}
_TYPE_ORDER = {2: 0, 1: 1, 3: 2, 0: 3, 4: 4}  # discrete first, CPU (lavapipe) last


def _result_name(r: int) -> str:
    cls = getattr(_vk, "exception_codes", {}).get(r)
    return cls.__name__ if cls is not None else f"VkResult {r}"


def check(r: int, what: str) -> None:
    if r == V.VK_SUCCESS:
        return
    msg = f"Vulkan: {what} failed: {_result_name(r)}"
    if r in (V.VK_ERROR_OUT_OF_DEVICE_MEMORY, V.VK_ERROR_OUT_OF_HOST_MEMORY):
        raise AllocationError(msg)
    raise ComputeError(msg)


def _new(ctype: str, stype: int | None = None, **fields):
    s = ffi.new(ctype + "*", fields)
    if stype is not None:
        s.sType = stype
    return s


def _cstr(b) -> str:
    return ffi.string(b).decode(errors="replace")


# --- instance and physical devices ---------------------------------------------------------------
@dataclass
class PhysInfo:
    handle: object
    name: str
    type: int
    api: tuple[int, int]
    driver: str
    limits: dict
    storage16: bool
    int16: bool
    timeline: bool
    heap_size: int
    extensions: frozenset[str]
    subgroup_size: int
    subgroup_arith: bool = False  # subgroupAdd & co. in compute shaders
    int_dot: bool = False  # shaderIntegerDotProduct (Vulkan 1.3): packed 4x8-bit dot products

    @property
    def usable(self) -> str:
        """'' when usable, else why not."""
        if self.api < (1, 2):
            return f"Vulkan {self.api[0]}.{self.api[1]} < 1.2"
        if not self.timeline:
            return "no timeline semaphores"
        return ""


class Instance:
    """The process's VkInstance and its physical devices (best first)."""

    def __init__(self) -> None:
        name = ffi.new("char[]", b"accelplane")
        app = _new(
            "VkApplicationInfo",
            V.VK_STRUCTURE_TYPE_APPLICATION_INFO,
            pApplicationName=name,
            pEngineName=name,
            apiVersion=V.VK_MAKE_VERSION(1, 3, 0),
        )
        ci = _new("VkInstanceCreateInfo", V.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, pApplicationInfo=app)
        out = ffi.new("VkInstance*")
        r = lib.vkCreateInstance(ci, NULL, out)
        if r == V.VK_ERROR_INCOMPATIBLE_DRIVER:
            raise DeviceError(
                "no Vulkan driver found: the Vulkan loader found no driver (ICD); install "
                "one (mesa-vulkan-drivers for lavapipe, or the GPU vendor's driver)"
            )
        if r != V.VK_SUCCESS:
            raise DeviceError(f"no Vulkan driver found: vkCreateInstance failed: {_result_name(r)}")
        self.handle = out[0]
        n = ffi.new("uint32_t*")
        check(lib.vkEnumeratePhysicalDevices(self.handle, n, NULL), "vkEnumeratePhysicalDevices")
        arr = ffi.new("VkPhysicalDevice[]", n[0])
        check(lib.vkEnumeratePhysicalDevices(self.handle, n, arr), "vkEnumeratePhysicalDevices")
        infos = [_phys_info(arr[i]) for i in range(n[0])]
        # stable sort: discrete GPUs first, lavapipe (a CPU device) last
        self.physical = sorted(infos, key=lambda p: _TYPE_ORDER.get(p.type, 3))


def _phys_info(h) -> PhysInfo:
    p = ffi.new("VkPhysicalDeviceProperties*")
    lib.vkGetPhysicalDeviceProperties(h, p)
    api = ((p.apiVersion >> 22) & 0x7F, (p.apiVersion >> 12) & 0x3FF)
    lim = p.limits
    limits = {
        "maxStorageBufferRange": lim.maxStorageBufferRange,
        "minStorageBufferOffsetAlignment": lim.minStorageBufferOffsetAlignment,
        "maxComputeWorkGroupCount": tuple(lim.maxComputeWorkGroupCount),
        "maxPushConstantsSize": lim.maxPushConstantsSize,
        "maxMemoryAllocationSize": 1 << 30,
        "maxBufferSize": 1 << 62,
    }
    driver, storage16, int16, timeline, subgroup, arith, int_dot = "", False, False, False, 0, False, False
    if api >= (1, 2):
        p11 = _new(
            "VkPhysicalDeviceVulkan11Properties", V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_PROPERTIES
        )
        p12 = _new(
            "VkPhysicalDeviceVulkan12Properties", V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_PROPERTIES
        )
        p11.pNext = p12
        p2 = _new("VkPhysicalDeviceProperties2", V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, pNext=p11)
        m4 = None
        if api >= (1, 3):
            m4 = _new(
                "VkPhysicalDeviceMaintenance4Properties",
                V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_4_PROPERTIES,
            )
            p12.pNext = m4
        lib.vkGetPhysicalDeviceProperties2(h, p2)
        limits["maxMemoryAllocationSize"] = p11.maxMemoryAllocationSize
        if m4 is not None:
            limits["maxBufferSize"] = m4.maxBufferSize
        driver = f"{_cstr(p12.driverName)} {_cstr(p12.driverInfo)}".strip()
        subgroup = p11.subgroupSize
        arith = bool(p11.subgroupSupportedStages & V.VK_SHADER_STAGE_COMPUTE_BIT) and bool(
            p11.subgroupSupportedOperations & V.VK_SUBGROUP_FEATURE_ARITHMETIC_BIT
        )
        f11 = _new(
            "VkPhysicalDeviceVulkan11Features", V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES
        )
        f12 = _new(
            "VkPhysicalDeviceVulkan12Features", V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES
        )
        f11.pNext = f12
        f13 = None
        if api >= (1, 3):
            f13 = _new(
                "VkPhysicalDeviceVulkan13Features", V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES
            )
            f12.pNext = f13
        f2 = _new("VkPhysicalDeviceFeatures2", V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, pNext=f11)
        lib.vkGetPhysicalDeviceFeatures2(h, f2)
        storage16 = bool(f11.storageBuffer16BitAccess)
        int16 = bool(f2.features.shaderInt16)
        timeline = bool(f12.timelineSemaphore)
        int_dot = f13 is not None and bool(f13.shaderIntegerDotProduct)
    mp = ffi.new("VkPhysicalDeviceMemoryProperties*")
    lib.vkGetPhysicalDeviceMemoryProperties(h, mp)
    heap = max(
        (
            mp.memoryHeaps[i].size
            for i in range(mp.memoryHeapCount)
            if mp.memoryHeaps[i].flags & V.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT
        ),
        default=0,
    )
    n = ffi.new("uint32_t*")
    lib.vkEnumerateDeviceExtensionProperties(h, NULL, n, NULL)
    exts = ffi.new("VkExtensionProperties[]", n[0])
    lib.vkEnumerateDeviceExtensionProperties(h, NULL, n, exts)
    names = frozenset(_cstr(exts[i].extensionName) for i in range(n[0]))
    return PhysInfo(
        h,
        _cstr(p.deviceName),
        p.deviceType,
        api,
        driver,
        limits,
        storage16,
        int16,
        timeline,
        heap,
        names,
        subgroup,
        arith,
        int_dot,
    )


_instance: Instance | None = None
_instance_lock = threading.Lock()


def instance() -> Instance:
    global _instance
    with _instance_lock:
        if _instance is None:
            _instance = Instance()
        return _instance


def select_physical(inst: Instance, wanted: tuple[int, ...] | None) -> list[tuple[int, PhysInfo]]:
    """(physical index, info) of each accelplane device: ``wanted`` (ACCELPLANE_VK_DEVICES:
    indices into the sorted physical list; repeats open one physical device as several
    logical devices), else every usable GPU, else every usable device (lavapipe)."""
    phys = inst.physical
    usable = [(i, p) for i, p in enumerate(phys) if not p.usable]
    if wanted:
        out = []
        for i in wanted:
            if i >= len(phys):
                raise ConfigError(
                    f"ACCELPLANE_VK_DEVICES: {i} is not an index 0..{len(phys) - 1} of the physical "
                    f"devices ({', '.join(p.name for p in phys)})"
                )
            p = phys[i]
            if p.usable:
                raise DeviceError(
                    f"ACCELPLANE_VK_DEVICES: physical device {i} ({p.name}) is not usable: {p.usable}"
                )
            out.append((i, p))
        return out
    if not phys:
        raise DeviceError("no Vulkan driver found: the driver reports no physical device")
    if not usable:
        raise DeviceError("no usable Vulkan device: " + "; ".join(f"{p.name}: {p.usable}" for p in phys))
    gpus = [x for x in usable if x[1].type != 4]
    return gpus or usable


# --- logical devices ------------------------------------------------------------------------------
class Queue:
    __slots__ = ("handle", "lock")

    def __init__(self, handle) -> None:
        self.handle = handle
        self.lock = threading.Lock()  # vkQueueSubmit needs external synchronization


class LogicalDevice:
    """A VkDevice with its queues, memory types, pipeline layout, shader modules, pipelines,
    an internal stream for blocking transfers, and deferred destruction of freed buffers."""

    def __init__(self, phys: PhysInfo, label: str, spirv: dict[str, bytes]) -> None:
        self.phys = phys
        self.label = label
        h = phys.handle
        n = ffi.new("uint32_t*")
        lib.vkGetPhysicalDeviceQueueFamilyProperties(h, n, NULL)
        fams = ffi.new("VkQueueFamilyProperties[]", n[0])
        lib.vkGetPhysicalDeviceQueueFamilyProperties(h, n, fams)
        compute = [i for i in range(n[0]) if fams[i].queueFlags & V.VK_QUEUE_COMPUTE_BIT]
        if not compute:
            raise DeviceError(f"{label}: no compute queue family on {phys.name}")
        # a compute-only family if there is one (async compute engines), else the first
        only = [i for i in compute if not fams[i].queueFlags & V.VK_QUEUE_GRAPHICS_BIT]
        self.family = (only or compute)[0]
        nq = max(1, min(fams[self.family].queueCount, MAX_QUEUES))
        prio = ffi.new("float[]", [1.0] * nq)
        qci = _new(
            "VkDeviceQueueCreateInfo",
            V.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
            queueFamilyIndex=self.family,
            queueCount=nq,
            pQueuePriorities=prio,
        )
        f12 = _new(
            "VkPhysicalDeviceVulkan12Features",
            V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES,
            timelineSemaphore=1,
        )
        f13 = _new(  # kept referenced until vkCreateDevice: pNext does not own it
            "VkPhysicalDeviceVulkan13Features",
            V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES,
            shaderIntegerDotProduct=1,
        )
        if phys.int_dot:  # mul_mat_vec_q8's OpSDotKHR / OpSUDotKHR
            f12.pNext = f13
        f11 = _new(
            "VkPhysicalDeviceVulkan11Features",
            V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES,
            pNext=f12,
            storageBuffer16BitAccess=int(phys.storage16),
        )
        f2 = _new("VkPhysicalDeviceFeatures2", V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, pNext=f11)
        f2.features.shaderInt16 = int(phys.int16)
        dci = _new(
            "VkDeviceCreateInfo",
            V.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO,
            pNext=f2,
            queueCreateInfoCount=1,
            pQueueCreateInfos=qci,
        )
        out = ffi.new("VkDevice*")
        check(lib.vkCreateDevice(h, dci, NULL, out), f"vkCreateDevice ({phys.name})")
        self.handle = out[0]
        self.queues = []
        for i in range(nq):
            q = ffi.new("VkQueue*")
            lib.vkGetDeviceQueue(self.handle, self.family, i, q)
            self.queues.append(Queue(q[0]))
        self._next_queue = 0
        self._pick_memory_types()
        self._make_layouts()
        self.modules = {name: self._module(code) for name, code in spirv.items()}
        self.pipelines: dict[tuple, object] = {}
        self.lock = threading.RLock()
        self.allocated = 0
        self.streams: weakref.WeakSet[Stream] = weakref.WeakSet()
        self.garbage: list[tuple[list[tuple[Stream, int]], Callable[[], None]]] = []
        self.transfer = Stream(self, f"{label}/transfer")

    # memory types
    def _pick_memory_types(self) -> None:
        mp = ffi.new("VkPhysicalDeviceMemoryProperties*")
        lib.vkGetPhysicalDeviceMemoryProperties(self.phys.handle, mp)
        self.mem_flags = [mp.memoryTypes[i].propertyFlags for i in range(mp.memoryTypeCount)]
        self.mem_heap = [mp.memoryTypes[i].heapIndex for i in range(mp.memoryTypeCount)]
        self.heap_size = [mp.memoryHeaps[i].size for i in range(mp.memoryHeapCount)]

    def memory_type(self, host: bool, allowed_bits: int) -> int:
        """Index of the memory type for device-local (``host`` False) or host-visible memory."""
        DL, HV, HC, CA = (
            V.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT,
            V.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT,
            V.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT,
            V.VK_MEMORY_PROPERTY_HOST_CACHED_BIT,
        )
        cand = [i for i in range(len(self.mem_flags)) if allowed_bits & (1 << i)]
        if host:
            prefs = [lambda f: f & (HV | HC | CA) == HV | HC | CA, lambda f: f & (HV | HC) == HV | HC]
        else:  # VRAM proper first (not the host-visible BAR window), then any device-local
            prefs = [lambda f: f & DL and not f & HV, lambda f: f & DL, lambda f: True]
        for ok in prefs:
            for i in cand:
                if ok(self.mem_flags[i]):
                    return i
        raise AllocationError(f"{self.label}: no {'host-visible' if host else 'device'} memory type")

    def _make_layouts(self) -> None:
        binds = ffi.new(f"VkDescriptorSetLayoutBinding[{N_BINDINGS}]")
        for i in range(N_BINDINGS):
            binds[i].binding = i
            binds[i].descriptorType = V.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
            binds[i].descriptorCount = 1
            binds[i].stageFlags = V.VK_SHADER_STAGE_COMPUTE_BIT
        ci = _new(
            "VkDescriptorSetLayoutCreateInfo",
            V.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO,
            bindingCount=N_BINDINGS,
            pBindings=binds,
        )
        out = ffi.new("VkDescriptorSetLayout*")
        check(lib.vkCreateDescriptorSetLayout(self.handle, ci, NULL, out), "vkCreateDescriptorSetLayout")
        self.set_layout = out[0]
        pcr = ffi.new("VkPushConstantRange*", {"stageFlags": V.VK_SHADER_STAGE_COMPUTE_BIT, "size": 128})
        sl = ffi.new("VkDescriptorSetLayout[1]", [self.set_layout])
        pci = _new(
            "VkPipelineLayoutCreateInfo",
            V.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO,
            setLayoutCount=1,
            pSetLayouts=sl,
            pushConstantRangeCount=1,
            pPushConstantRanges=pcr,
        )
        out2 = ffi.new("VkPipelineLayout*")
        check(lib.vkCreatePipelineLayout(self.handle, pci, NULL, out2), "vkCreatePipelineLayout")
        self.pipeline_layout = out2[0]

    def _module(self, code: bytes):
        buf = ffi.new("char[]", code)
        ci = _new(
            "VkShaderModuleCreateInfo",
            V.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO,
            codeSize=len(code),
            pCode=ffi.cast("uint32_t*", buf),
        )
        out = ffi.new("VkShaderModule*")
        check(lib.vkCreateShaderModule(self.handle, ci, NULL, out), "vkCreateShaderModule")
        return out[0]

    def pipeline(self, shader: str, spec: tuple[int, ...]):
        """The compute pipeline of ``shader`` with specialization constants 0..n-1 = ``spec``."""
        key = (shader, spec)
        p = self.pipelines.get(key)
        if p is not None:
            return p
        with self.lock:
            p = self.pipelines.get(key)
            if p is not None:
                return p
            n = len(spec)
            entries = ffi.new("VkSpecializationMapEntry[]", max(n, 1))
            for i in range(n):
                entries[i].constantID, entries[i].offset, entries[i].size = i, 4 * i, 4
            data = ffi.new("uint32_t[]", [int(x) & 0xFFFFFFFF for x in spec] or [0])
            si = ffi.new(
                "VkSpecializationInfo*",
                {"mapEntryCount": n, "pMapEntries": entries, "dataSize": 4 * n, "pData": data},
            )
            main = ffi.new("char[]", b"main")
            ci = _new(
                "VkComputePipelineCreateInfo",
                V.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO,
                layout=self.pipeline_layout,
                basePipelineIndex=-1,
            )
            ci.stage.sType = V.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO
            ci.stage.stage = V.VK_SHADER_STAGE_COMPUTE_BIT
            ci.stage.module = self.modules[shader]
            ci.stage.pName = main
            if n:
                ci.stage.pSpecializationInfo = si
            out = ffi.new("VkPipeline*")
            check(
                lib.vkCreateComputePipelines(self.handle, NULL, 1, ci, NULL, out),
                f"vkCreateComputePipelines({shader}, spec={spec})",
            )
            self.pipelines[key] = out[0]
            return out[0]

    def next_queue(self) -> Queue:
        q = self.queues[self._next_queue % len(self.queues)]
        self._next_queue += 1
        return q

    def new_timeline(self, initial: int = 0):
        tci = _new(
            "VkSemaphoreTypeCreateInfo",
            V.VK_STRUCTURE_TYPE_SEMAPHORE_TYPE_CREATE_INFO,
            semaphoreType=V.VK_SEMAPHORE_TYPE_TIMELINE,
            initialValue=initial,
        )
        ci = _new("VkSemaphoreCreateInfo", V.VK_STRUCTURE_TYPE_SEMAPHORE_CREATE_INFO, pNext=tci)
        out = ffi.new("VkSemaphore*")
        check(lib.vkCreateSemaphore(self.handle, ci, NULL, out), "vkCreateSemaphore")
        return out[0]

    # deferred destruction: a freed buffer may still be read by queued work (a caller error by
    # docs/ordering.md rule 8, but it must not fault the device), so it dies when every stream
    # has finished what was queued when it was freed
    def defer(self, destroy: Callable[[], None]) -> None:
        snapshot = [(s, s.submitted) for s in list(self.streams) if not s.closed]
        with self.lock:
            self.garbage.append((snapshot, destroy))
        self.collect()

    def collect(self) -> None:
        with self.lock:
            keep = []
            for snap, destroy in self.garbage:
                if all(s.closed or s.completed() >= v for s, v in snap):
                    destroy()
                else:
                    keep.append((snap, destroy))
            self.garbage = keep

    def wait_idle(self) -> None:
        """vkDeviceWaitIdle (every queue locked, as it requires). Needed before destroying a
        semaphore: a driver may still touch one after its work completed (Mesa's emulated
        timelines release their points when the queue thread cleans a submission up)."""
        for q in self.queues:
            q.lock.acquire()
        try:
            check(lib.vkDeviceWaitIdle(self.handle), f"vkDeviceWaitIdle ({self.label})")
        finally:
            for q in self.queues:
                q.lock.release()

    def max_buffer_size(self) -> int:
        lim = self.phys.limits
        return min(lim["maxStorageBufferRange"], lim["maxMemoryAllocationSize"], lim["maxBufferSize"]) & ~255


# --- memory ------------------------------------------------------------------------------------
class Memory:
    """A VkBuffer with its own memory: device-local, or host-visible and mapped (``host``:
    numpy uint8 over the mapping). The ctx of every buffer and of staging areas."""

    __slots__ = ("dev", "buf", "mem", "size", "host", "freed", "__weakref__")

    def __init__(self, dev: LogicalDevice, size: int, host: bool) -> None:
        self.dev, self.size, self.freed, self.host = dev, size, False, None
        vsize = max(16, (size + 15) & ~15)
        usage = (
            V.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT
            | V.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
            | V.VK_BUFFER_USAGE_TRANSFER_DST_BIT
        )
        bci = _new(
            "VkBufferCreateInfo",
            V.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO,
            size=vsize,
            usage=usage,
            sharingMode=V.VK_SHARING_MODE_EXCLUSIVE,
        )
        out = ffi.new("VkBuffer*")
        check(lib.vkCreateBuffer(dev.handle, bci, NULL, out), f"vkCreateBuffer({size} bytes)")
        self.buf = out[0]
        req = ffi.new("VkMemoryRequirements*")
        lib.vkGetBufferMemoryRequirements(dev.handle, self.buf, req)
        try:
            mtype = dev.memory_type(host, req.memoryTypeBits)
        except AllocationError:
            lib.vkDestroyBuffer(dev.handle, self.buf, NULL)
            raise
        ai = _new(
            "VkMemoryAllocateInfo",
            V.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
            allocationSize=req.size,
            memoryTypeIndex=mtype,
        )
        mout = ffi.new("VkDeviceMemory*")
        r = lib.vkAllocateMemory(dev.handle, ai, NULL, mout)
        if r != V.VK_SUCCESS:
            lib.vkDestroyBuffer(dev.handle, self.buf, NULL)
            raise AllocationError(
                f"{dev.label}: cannot allocate {size} bytes of "
                f"{'host-visible' if host else 'device'} memory: {_result_name(r)}"
            )
        self.mem = mout[0]
        check(lib.vkBindBufferMemory(dev.handle, self.buf, self.mem, 0), "vkBindBufferMemory")
        if host:
            ptr = ffi.new("void**")
            check(lib.vkMapMemory(dev.handle, self.mem, 0, vsize, 0, ptr), "vkMapMemory")
            self.host = np.frombuffer(ffi.buffer(ptr[0], vsize), np.uint8)[:size]
        else:
            with dev.lock:
                dev.allocated += size

    def free(self) -> None:
        """Release now; destruction waits for work queued before this call (LogicalDevice.defer)."""
        if self.freed:
            return
        self.freed = True
        dev, buf, mem, host = self.dev, self.buf, self.mem, self.host is not None
        self.host = None

        def destroy() -> None:
            lib.vkDestroyBuffer(dev.handle, buf, NULL)
            lib.vkFreeMemory(dev.handle, mem, NULL)

        if not host:
            with dev.lock:
                dev.allocated -= self.size
        dev.defer(destroy)


# --- command recording helpers --------------------------------------------------------------------
def cmd_copy(cmd, src, src_off: int, dst, dst_off: int, size: int) -> None:
    region = ffi.new("VkBufferCopy*", {"srcOffset": src_off, "dstOffset": dst_off, "size": size})
    lib.vkCmdCopyBuffer(cmd, src, dst, 1, region)


def cmd_barrier(cmd, src_stage: int, src_access: int, dst_stage: int, dst_access: int) -> None:
    mb = _new(
        "VkMemoryBarrier",
        V.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
        srcAccessMask=src_access,
        dstAccessMask=dst_access,
    )
    lib.vkCmdPipelineBarrier(cmd, src_stage, dst_stage, 0, 1, mb, 0, NULL, 0, NULL)


def cmd_to_host(cmd) -> None:
    """Make transfer writes visible to host reads (after the semaphore wait)."""
    cmd_barrier(
        cmd,
        V.VK_PIPELINE_STAGE_TRANSFER_BIT,
        V.VK_ACCESS_TRANSFER_WRITE_BIT,
        V.VK_PIPELINE_STAGE_HOST_BIT,
        V.VK_ACCESS_HOST_READ_BIT,
    )


# --- streams ----------------------------------------------------------------------------------------
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
    value completes (copies into the caller's arrays), and a host bridge when needed."""

    def __init__(self, dev: LogicalDevice, label: str) -> None:
        self.dev = dev
        self.label = label
        self.queue = dev.next_queue()
        ci = _new(
            "VkCommandPoolCreateInfo",
            V.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
            flags=V.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
            queueFamilyIndex=dev.family,
        )
        out = ffi.new("VkCommandPool*")
        check(lib.vkCreateCommandPool(dev.handle, ci, NULL, out), "vkCreateCommandPool")
        self.pool = out[0]
        self.sem = dev.new_timeline()
        self.submitted = 0
        self._done = 0
        self.drained = 0  # host tasks up to this value have run
        self.closed = False
        self.idle_cmds: list = []
        self.busy_cmds: collections.deque = collections.deque()  # (value, cmd)
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
        wi = _new(
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
            self.idle_cmds.append(self.busy_cmds.popleft()[1])
        if self.garbage:
            keep = []
            for cell, destroy in self.garbage:
                if cell[0] <= done:
                    destroy()
                else:
                    keep.append((cell, destroy))
            self.garbage = keep

    # recording and submission
    def alloc_cmd(self):
        ai = _new(
            "VkCommandBufferAllocateInfo",
            V.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
            commandPool=self.pool,
            level=V.VK_COMMAND_BUFFER_LEVEL_PRIMARY,
            commandBufferCount=1,
        )
        out = ffi.new("VkCommandBuffer*")
        check(lib.vkAllocateCommandBuffers(self.dev.handle, ai, out), "vkAllocateCommandBuffers")
        return out[0]

    def begin(self, flags: int = V.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT, cmd=None):
        """A command buffer in the recording state (a recycled one when possible)."""
        if cmd is None:
            self.drain()
            if self.idle_cmds:
                cmd = self.idle_cmds.pop()
                lib.vkResetCommandBuffer(cmd, 0)
            else:
                cmd = self.alloc_cmd()
        bi = _new("VkCommandBufferBeginInfo", V.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO, flags=flags)
        check(lib.vkBeginCommandBuffer(cmd, bi), "vkBeginCommandBuffer")
        return cmd

    def submit(self, cmds: tuple = (), waits: tuple = (), transient: bool = True) -> int:
        """Queue ``cmds`` after everything queued so far and after ``waits`` ((semaphore,
        value) pairs of the same VkDevice); returns the value that marks their completion."""
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
        tl = _new(
            "VkTimelineSemaphoreSubmitInfo",
            V.VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO,
            waitSemaphoreValueCount=n,
            pWaitSemaphoreValues=c_vals,
            signalSemaphoreValueCount=1,
            pSignalSemaphoreValues=sig_v,
        )
        c_cmds = ffi.new("VkCommandBuffer[]", list(cmds)) if cmds else NULL
        si = _new(
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
        with self.queue.lock:
            r = lib.vkQueueSubmit(self.queue.handle, 1, si, NULL)
        check(r, f"vkQueueSubmit ({self.label})")
        self.submitted = v
        self.stats["submits"] += 1
        if transient:
            for c in cmds:
                self.busy_cmds.append((v, c))
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
        cmd = self.begin()
        cmd_copy(cmd, st.mem.buf, 0, mem.buf, offset, size)
        v = self.submit((cmd,), waits)
        st.busy = (self, v)
        return v

    def download(self, mem: Memory, offset: int, out: np.ndarray, size: int) -> int:
        """Queue mem[offset:offset+size] → ``out`` (written when the value completes and the
        stream drains: at synchronize or event_synchronize)."""
        st = self.stage(size)
        cmd = self.begin()
        cmd_copy(cmd, mem.buf, offset, st.mem.buf, 0, size)
        cmd_to_host(cmd)
        v = self.submit((cmd,))
        st.busy = (self, v)
        host = st.mem.host

        def land() -> None:
            out[:size] = host[:size]

        self.after(v, land)
        return v

    def copy(self, src: Memory, src_off: int, dst: Memory, dst_off: int, size: int, waits: tuple = ()) -> int:
        cmd = self.begin()
        cmd_copy(cmd, src.buf, src_off, dst.buf, dst_off, size)
        return self.submit((cmd,), waits)

    def fill(self, mem: Memory, offset: int, size: int, value: int) -> int:
        """vkCmdFillBuffer: offset and size multiples of 4."""
        cmd = self.begin()
        word = (value & 0xFF) * 0x01010101
        lib.vkCmdFillBuffer(cmd, mem.buf, offset, size, word)
        return self.submit((cmd,))

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
        self.err.free()
        self.closed = True
        self._done = self.submitted
        lib.vkDestroyCommandPool(self.dev.handle, self.pool, NULL)
        lib.vkDestroySemaphore(self.dev.handle, self.sem, NULL)


def _sleeper(seconds: float) -> Callable[[], None]:
    return lambda: time.sleep(seconds)


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
                si = _new(
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


def check_live(mem: Memory, what: str) -> None:
    if mem.freed:
        raise BufferFreedError(f"Vulkan: {what} uses a freed buffer")
