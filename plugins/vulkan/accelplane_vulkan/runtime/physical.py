"""The process's VkInstance, its physical devices and what each offers, and which of them
become accelplane devices (ACCELPLANE_VK_DEVICES)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from accelplane.errors import ConfigError, DeviceError

from .vk import NULL, V, check, cstr, ffi, lib, new_struct, result_name

DEVICE_TYPES = {0: "other", 1: "integrated GPU", 2: "discrete GPU", 3: "virtual GPU", 4: "CPU"}
_TYPE_ORDER = {2: 0, 1: 1, 3: 2, 0: 3, 4: 4}  # discrete first, CPU (lavapipe) last


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

    @property
    def max_buffer_size(self) -> int:
        """The largest buffer kernels can bind: within every limit, 256-byte aligned."""
        lim = self.limits
        return min(lim["maxStorageBufferRange"], lim["maxMemoryAllocationSize"], lim["maxBufferSize"]) & ~255


class Instance:
    """The process's VkInstance and its physical devices (best first)."""

    def __init__(self) -> None:
        name = ffi.new("char[]", b"accelplane")
        app = new_struct(
            "VkApplicationInfo",
            V.VK_STRUCTURE_TYPE_APPLICATION_INFO,
            pApplicationName=name,
            pEngineName=name,
            apiVersion=V.VK_MAKE_VERSION(1, 3, 0),
        )
        ci = new_struct(
            "VkInstanceCreateInfo", V.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, pApplicationInfo=app
        )
        out = ffi.new("VkInstance*")
        r = lib.vkCreateInstance(ci, NULL, out)
        if r == V.VK_ERROR_INCOMPATIBLE_DRIVER:
            raise DeviceError(
                "no Vulkan driver found: the Vulkan loader found no driver (ICD); install "
                "one (mesa-vulkan-drivers for lavapipe, or the GPU vendor's driver)"
            )
        if r != V.VK_SUCCESS:
            raise DeviceError(f"no Vulkan driver found: vkCreateInstance failed: {result_name(r)}")
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
    driver, subgroup, arith = "", 0, False
    storage16 = int16 = timeline = int_dot = False
    if api >= (1, 2):
        driver, subgroup, arith = _properties12(h, api, limits)
        storage16, int16, timeline, int_dot = _features12(h, api)
    return PhysInfo(
        h, cstr(p.deviceName), p.deviceType, api, driver, limits, storage16, int16, timeline,
        _device_local_heap(h), _extensions(h), subgroup, arith, int_dot,
    )  # fmt: skip


def _properties12(h, api: tuple[int, int], limits: dict) -> tuple[str, int, bool]:
    """(driver, subgroup size, compute subgroup arithmetic) of a Vulkan >= 1.2 device; fills in
    the allocation and buffer size limits of ``limits``."""
    p11 = new_struct(
        "VkPhysicalDeviceVulkan11Properties", V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_PROPERTIES
    )
    p12 = new_struct(
        "VkPhysicalDeviceVulkan12Properties", V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_PROPERTIES
    )
    p11.pNext = p12
    p2 = new_struct(
        "VkPhysicalDeviceProperties2", V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, pNext=p11
    )
    m4 = None
    if api >= (1, 3):
        m4 = new_struct(
            "VkPhysicalDeviceMaintenance4Properties",
            V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_4_PROPERTIES,
        )
        p12.pNext = m4
    lib.vkGetPhysicalDeviceProperties2(h, p2)
    limits["maxMemoryAllocationSize"] = p11.maxMemoryAllocationSize
    if m4 is not None:
        limits["maxBufferSize"] = m4.maxBufferSize
    driver = f"{cstr(p12.driverName)} {cstr(p12.driverInfo)}".strip()
    arith = bool(p11.subgroupSupportedStages & V.VK_SHADER_STAGE_COMPUTE_BIT) and bool(
        p11.subgroupSupportedOperations & V.VK_SUBGROUP_FEATURE_ARITHMETIC_BIT
    )
    return driver, p11.subgroupSize, arith


def _features12(h, api: tuple[int, int]) -> tuple[bool, bool, bool, bool]:
    """(16-bit storage, int16, timeline semaphores, integer dot products) of a Vulkan >= 1.2 device."""
    f11 = new_struct(
        "VkPhysicalDeviceVulkan11Features", V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES
    )
    f12 = new_struct(
        "VkPhysicalDeviceVulkan12Features", V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES
    )
    f11.pNext = f12
    f13 = None
    if api >= (1, 3):
        f13 = new_struct(
            "VkPhysicalDeviceVulkan13Features", V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES
        )
        f12.pNext = f13
    f2 = new_struct("VkPhysicalDeviceFeatures2", V.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, pNext=f11)
    lib.vkGetPhysicalDeviceFeatures2(h, f2)
    return (
        bool(f11.storageBuffer16BitAccess),
        bool(f2.features.shaderInt16),
        bool(f12.timelineSemaphore),
        f13 is not None and bool(f13.shaderIntegerDotProduct),
    )


def _device_local_heap(h) -> int:
    mp = ffi.new("VkPhysicalDeviceMemoryProperties*")
    lib.vkGetPhysicalDeviceMemoryProperties(h, mp)
    return max(
        (
            mp.memoryHeaps[i].size
            for i in range(mp.memoryHeapCount)
            if mp.memoryHeaps[i].flags & V.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT
        ),
        default=0,
    )


def _extensions(h) -> frozenset[str]:
    n = ffi.new("uint32_t*")
    lib.vkEnumerateDeviceExtensionProperties(h, NULL, n, NULL)
    exts = ffi.new("VkExtensionProperties[]", n[0])
    lib.vkEnumerateDeviceExtensionProperties(h, NULL, n, exts)
    return frozenset(cstr(exts[i].extensionName) for i in range(n[0]))


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
