"""Logical devices: a VkDevice with its queues, memory types, shaders, pipelines and deferred
destruction (LogicalDevice): an accelplane device's runtime (``device.runtime``), made on the
device's first use from the physical device the probe (probe.py) listed."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import NamedTuple

from accelplane.errors import AllocationError, DeviceError

from .. import tuning
from ..probe import PhysInfo
from .stream import Stream
from .vk import NULL, V, check, create, ffi, lib, new_struct

MAX_QUEUES = 4  # queues asked of the compute family; streams share them round-robin
N_BINDINGS = 5  # storage buffers of every pipeline: A, B, C, D and the stream's error word


class Queue:
    __slots__ = ("handle", "lock")

    def __init__(self, handle) -> None:
        self.handle = handle
        self.lock = threading.Lock()  # vkQueueSubmit needs external synchronization


class _Family(NamedTuple):
    flags: int
    count: int
    timestamp_bits: int


def _families(h) -> list[_Family]:
    """The queue families of physical device ``h`` (copied out of the driver's structs)."""
    n = ffi.new("uint32_t*")
    lib.vkGetPhysicalDeviceQueueFamilyProperties(h, n, NULL)
    fams = ffi.new("VkQueueFamilyProperties[]", n[0])
    lib.vkGetPhysicalDeviceQueueFamilyProperties(h, n, fams)
    return [_Family(f.queueFlags, f.queueCount, f.timestampValidBits) for f in (fams[i] for i in range(n[0]))]


def _compute_family(phys: PhysInfo, h, label: str) -> tuple[int, int]:
    """(queue family, queues to ask of it) of ``phys`` (``h``: its handle): a compute-only
    family if there is one (async compute engines), else the first with compute."""
    fams = _families(h)
    compute = [i for i, f in enumerate(fams) if f.flags & V.VK_QUEUE_COMPUTE_BIT]
    if not compute:
        raise DeviceError(f"{label}: no compute queue family on {phys.name}")
    only = [i for i in compute if not fams[i].flags & V.VK_QUEUE_GRAPHICS_BIT]
    family = (only or compute)[0]
    return family, max(1, min(fams[family].count, MAX_QUEUES))


def transfer_family(h) -> int | None:
    """A transfer-only queue family of physical device ``h`` (its copy engines: no compute, no
    graphics), or None."""
    other = V.VK_QUEUE_COMPUTE_BIT | V.VK_QUEUE_GRAPHICS_BIT
    only = [i for i, f in enumerate(_families(h))
            if f.flags & V.VK_QUEUE_TRANSFER_BIT and not f.flags & other]  # fmt: skip
    return only[0] if only else None


def _create_device(phys: PhysInfo, h, family: int, nq: int, xfam: int | None):
    """vkCreateDevice with ``nq`` queues of ``family`` (and one of ``xfam`` when it is another
    family) and the features the kernels use."""
    prio = ffi.new("float[]", [1.0] * nq)
    qci = ffi.new("VkDeviceQueueCreateInfo[2]")
    for i, (fam, count) in enumerate([(family, nq)] + ([(xfam, 1)] if xfam not in (None, family) else [])):
        qci[i].sType = V.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO
        qci[i].queueFamilyIndex = fam
        qci[i].queueCount = count
        qci[i].pQueuePriorities = prio
    n_qci = 1 + (xfam not in (None, family))
    f12 = new_struct(
        "VkPhysicalDeviceVulkan12Features",
        V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES,
        timelineSemaphore=1,
        hostQueryReset=int(phys.host_query_reset),  # the timeline's timestamp pools
    )
    f13 = new_struct(  # kept referenced until vkCreateDevice: pNext does not own it
        "VkPhysicalDeviceVulkan13Features",
        V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES,
        shaderIntegerDotProduct=1,
    )
    if phys.int_dot:  # mul_mat_vec_q8's OpSDotKHR / OpSUDotKHR
        f12.pNext = f13
    f11 = new_struct(
        "VkPhysicalDeviceVulkan11Features",
        V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES,
        pNext=f12,
        storageBuffer16BitAccess=int(phys.storage16),
    )
    f2 = new_struct("VkPhysicalDeviceFeatures2", V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, pNext=f11)
    f2.features.shaderInt16 = int(phys.int16)
    dci = new_struct(
        "VkDeviceCreateInfo",
        V.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO,
        pNext=f2,
        queueCreateInfoCount=n_qci,
        pQueueCreateInfos=qci,
    )
    return create("Device", h, dci, f"vkCreateDevice ({phys.name})")


class LogicalDevice:
    """A VkDevice with its queues, memory types, pipeline layout, shader modules (built by
    load_shaders, at the first backend), pipelines, an internal stream for blocking transfers,
    and deferred destruction of freed buffers."""

    def __init__(self, phys: PhysInfo, label: str) -> None:
        self.phys = phys
        self.label = label
        self.phys_handle = ffi.cast("VkPhysicalDevice", phys.handle)  # the probe's, through ctypes
        self.family, nq = _compute_family(phys, self.phys_handle, label)
        # copies go to a transfer-only family's queue where there is one (ACCELPLANE_VK_TRANSFER_QUEUE):
        # the copy engines, so they overlap the compute queues' kernels (a MoE's expert prefetch)
        self.xfer_family = transfer_family(self.phys_handle) if tuning.read().transfer_queue else None
        self.handle = _create_device(phys, self.phys_handle, self.family, nq, self.xfer_family)
        self.queues = []
        for i in range(nq):
            q = ffi.new("VkQueue*")
            lib.vkGetDeviceQueue(self.handle, self.family, i, q)
            self.queues.append(Queue(q[0]))
        self.xfer_queue: Queue | None = None  # None: copies on the stream's own queue
        if self.xfer_family == self.family:  # (a family given for tests: its last queue)
            self.xfer_queue = self.queues[-1]
        elif self.xfer_family is not None:
            q = ffi.new("VkQueue*")
            lib.vkGetDeviceQueue(self.handle, self.xfer_family, 0, q)
            self.xfer_queue = Queue(q[0])
            self.queues.append(self.xfer_queue)  # (locked by wait_idle; never a stream's compute queue)
        self._next_queue = 0
        # device timestamps for the streams' timelines (Backend.timeline_begin): both families'
        # queues stamp, the pools reset from the host; seconds = (ticks - origin) * period
        props = _families(self.phys_handle)
        used = (self.family, self.family if self.xfer_family is None else self.xfer_family)
        self.timestamps = phys.host_query_reset and phys.limits["timestampPeriod"] > 0 and all(
            props[f].timestamp_bits for f in used)
        self.ts_origin: int | None = None
        self._pick_memory_types()
        self._make_layouts()
        self.modules: dict[str, object] = {}
        self.pipelines: dict[tuple, object] = {}
        self.lock = threading.RLock()
        self.allocated = 0
        self.streams: weakref.WeakSet[Stream] = weakref.WeakSet()
        self.garbage: list[tuple[list[tuple[Stream, int]], Callable[[], None]]] = []
        self.transfer = Stream(self, f"{label}/transfer")

    # memory types
    def _pick_memory_types(self) -> None:
        mp = ffi.new("VkPhysicalDeviceMemoryProperties*")
        lib.vkGetPhysicalDeviceMemoryProperties(self.phys_handle, mp)
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
        ci = new_struct(
            "VkDescriptorSetLayoutCreateInfo",
            V.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO,
            bindingCount=N_BINDINGS,
            pBindings=binds,
        )
        self.set_layout = create("DescriptorSetLayout", self.handle, ci)
        pcr = ffi.new("VkPushConstantRange*", {"stageFlags": V.VK_SHADER_STAGE_COMPUTE_BIT, "size": 128})
        sl = ffi.new("VkDescriptorSetLayout[1]", [self.set_layout])
        pci = new_struct(
            "VkPipelineLayoutCreateInfo",
            V.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO,
            setLayoutCount=1,
            pSetLayouts=sl,
            pushConstantRangeCount=1,
            pPushConstantRanges=pcr,
        )
        self.pipeline_layout = create("PipelineLayout", self.handle, pci)

    def load_shaders(self) -> None:
        """Every shader module, built once (all or nothing, before any backend exists: a shader
        that does not compile raises ShaderCompileError here, and again at the next backend)."""
        if self.modules:
            return
        with self.lock:
            if not self.modules:
                from .. import shaders

                spirv = shaders.compile_all(shaders.shader_dir())
                self.modules = {name: self._module(code) for name, code in spirv.items()}

    def _module(self, code: bytes):
        buf = ffi.new("char[]", code)
        ci = new_struct(
            "VkShaderModuleCreateInfo",
            V.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO,
            codeSize=len(code),
            pCode=ffi.cast("uint32_t*", buf),
        )
        return create("ShaderModule", self.handle, ci)

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
            ci = new_struct(
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
        """A compute queue for a new stream (round-robin)."""
        n = len(self.queues) - (self.xfer_family not in (None, self.family))
        q = self.queues[self._next_queue % n]
        self._next_queue += 1
        return q

    def sharing(self) -> tuple[int, list[int]]:
        """(sharing mode, queue families) of every buffer: concurrent over the compute and the
        transfer family where copies have a family of their own (no ownership transfers)."""
        if self.xfer_family in (None, self.family):
            return V.VK_SHARING_MODE_EXCLUSIVE, []
        return V.VK_SHARING_MODE_CONCURRENT, [self.family, self.xfer_family]

    def new_query_pool(self, n: int):
        """A pool of ``n`` timestamp queries, reset."""
        ci = new_struct(
            "VkQueryPoolCreateInfo",
            V.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
            queryType=V.VK_QUERY_TYPE_TIMESTAMP,
            queryCount=n,
        )
        pool = create("QueryPool", self.handle, ci)
        lib.vkResetQueryPool(self.handle, pool, 0, n)
        return pool

    def new_timeline(self, initial: int = 0):
        tci = new_struct(
            "VkSemaphoreTypeCreateInfo",
            V.VK_STRUCTURE_TYPE_SEMAPHORE_TYPE_CREATE_INFO,
            semaphoreType=V.VK_SEMAPHORE_TYPE_TIMELINE,
            initialValue=initial,
        )
        ci = new_struct("VkSemaphoreCreateInfo", V.VK_STRUCTURE_TYPE_SEMAPHORE_CREATE_INFO, pNext=tci)
        return create("Semaphore", self.handle, ci)

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
