"""The cheap side of the Vulkan plugin: the loader, the process's VkInstance and what each
physical device offers, read through ctypes (no ``vulkan`` package, no logical device); which
physical devices become accelplane devices (ACCELPLANE_VK_DEVICES); their device contexts.

Listing devices stops here. A device's runtime (runtime/: the ``vulkan`` package, a VkDevice
with its queues and, at its first backend, its shaders) opens on its first use and adopts this
instance and these physical device handles: one loader in one process, so the handles are the
same objects to both bindings.
"""

from __future__ import annotations

import collections
import ctypes
import threading
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from accelplane.errors import ConfigError, DeviceError

from .tuning import LOADER, Tuning

DEVICE_TYPES = {0: "other", 1: "integrated GPU", 2: "discrete GPU", 3: "virtual GPU", 4: "CPU"}
_TYPE_ORDER = {2: 0, 1: 1, 3: 2, 0: 3, 4: 4}  # discrete first, CPU (lavapipe) last

# --- the structs, as the Vulkan headers declare them (tests/test_probe.py checks every size and
# offset against the ``vulkan`` package's definitions) ---------------------------------------------
_DECLS = """
struct VkApplicationInfo { VkStructureType sType; const void* pNext; const char* pApplicationName;
    uint32_t applicationVersion; const char* pEngineName; uint32_t engineVersion; uint32_t apiVersion; };
struct VkInstanceCreateInfo { VkStructureType sType; const void* pNext; VkInstanceCreateFlags flags;
    const VkApplicationInfo* pApplicationInfo; uint32_t enabledLayerCount;
    const char* const* ppEnabledLayerNames; uint32_t enabledExtensionCount;
    const char* const* ppEnabledExtensionNames; };
struct VkPhysicalDeviceLimits {
    uint32_t maxImageDimension1D, maxImageDimension2D, maxImageDimension3D, maxImageDimensionCube,
        maxImageArrayLayers, maxTexelBufferElements, maxUniformBufferRange, maxStorageBufferRange,
        maxPushConstantsSize, maxMemoryAllocationCount, maxSamplerAllocationCount;
    VkDeviceSize bufferImageGranularity, sparseAddressSpaceSize;
    uint32_t maxBoundDescriptorSets, maxPerStageDescriptorSamplers, maxPerStageDescriptorUniformBuffers,
        maxPerStageDescriptorStorageBuffers, maxPerStageDescriptorSampledImages,
        maxPerStageDescriptorStorageImages, maxPerStageDescriptorInputAttachments, maxPerStageResources,
        maxDescriptorSetSamplers, maxDescriptorSetUniformBuffers, maxDescriptorSetUniformBuffersDynamic,
        maxDescriptorSetStorageBuffers, maxDescriptorSetStorageBuffersDynamic, maxDescriptorSetSampledImages,
        maxDescriptorSetStorageImages, maxDescriptorSetInputAttachments, maxVertexInputAttributes,
        maxVertexInputBindings, maxVertexInputAttributeOffset, maxVertexInputBindingStride,
        maxVertexOutputComponents, maxTessellationGenerationLevel, maxTessellationPatchSize,
        maxTessellationControlPerVertexInputComponents, maxTessellationControlPerVertexOutputComponents,
        maxTessellationControlPerPatchOutputComponents, maxTessellationControlTotalOutputComponents,
        maxTessellationEvaluationInputComponents, maxTessellationEvaluationOutputComponents,
        maxGeometryShaderInvocations, maxGeometryInputComponents, maxGeometryOutputComponents,
        maxGeometryOutputVertices, maxGeometryTotalOutputComponents, maxFragmentInputComponents,
        maxFragmentOutputAttachments, maxFragmentDualSrcAttachments, maxFragmentCombinedOutputResources,
        maxComputeSharedMemorySize, maxComputeWorkGroupCount[3], maxComputeWorkGroupInvocations,
        maxComputeWorkGroupSize[3], subPixelPrecisionBits, subTexelPrecisionBits, mipmapPrecisionBits,
        maxDrawIndexedIndexValue, maxDrawIndirectCount;
    float maxSamplerLodBias, maxSamplerAnisotropy;
    uint32_t maxViewports, maxViewportDimensions[2];
    float viewportBoundsRange[2];
    uint32_t viewportSubPixelBits;
    size_t minMemoryMapAlignment;
    VkDeviceSize minTexelBufferOffsetAlignment, minUniformBufferOffsetAlignment,
        minStorageBufferOffsetAlignment;
    int32_t minTexelOffset; uint32_t maxTexelOffset; int32_t minTexelGatherOffset; uint32_t
        maxTexelGatherOffset;
    float minInterpolationOffset, maxInterpolationOffset;
    uint32_t subPixelInterpolationOffsetBits, maxFramebufferWidth, maxFramebufferHeight, maxFramebufferLayers;
    VkSampleCountFlags framebufferColorSampleCounts, framebufferDepthSampleCounts,
        framebufferStencilSampleCounts, framebufferNoAttachmentsSampleCounts;
    uint32_t maxColorAttachments;
    VkSampleCountFlags sampledImageColorSampleCounts, sampledImageIntegerSampleCounts,
        sampledImageDepthSampleCounts, sampledImageStencilSampleCounts, storageImageSampleCounts;
    uint32_t maxSampleMaskWords; VkBool32 timestampComputeAndGraphics; float timestampPeriod;
    uint32_t maxClipDistances, maxCullDistances, maxCombinedClipAndCullDistances, discreteQueuePriorities;
    float pointSizeRange[2], lineWidthRange[2], pointSizeGranularity, lineWidthGranularity;
    VkBool32 strictLines, standardSampleLocations;
    VkDeviceSize optimalBufferCopyOffsetAlignment, optimalBufferCopyRowPitchAlignment, nonCoherentAtomSize; };
struct VkPhysicalDeviceSparseProperties { VkBool32 residencyStandard2DBlockShape,
    residencyStandard2DMultisampleBlockShape, residencyStandard3DBlockShape, residencyAlignedMipSize,
    residencyNonResidentStrict; };
struct VkPhysicalDeviceProperties { uint32_t apiVersion, driverVersion, vendorID, deviceID;
    VkPhysicalDeviceType deviceType; char deviceName[256]; uint8_t pipelineCacheUUID[16];
    VkPhysicalDeviceLimits limits; VkPhysicalDeviceSparseProperties sparseProperties; };
struct VkPhysicalDeviceProperties2 { VkStructureType sType; void* pNext; VkPhysicalDeviceProperties
    properties; };
struct VkPhysicalDeviceVulkan11Properties { VkStructureType sType; void* pNext; uint8_t deviceUUID[16];
    uint8_t driverUUID[16]; uint8_t deviceLUID[8]; uint32_t deviceNodeMask; VkBool32 deviceLUIDValid;
    uint32_t subgroupSize; VkShaderStageFlags subgroupSupportedStages;
    VkSubgroupFeatureFlags subgroupSupportedOperations; VkBool32 subgroupQuadOperationsInAllStages;
    VkPointClippingBehavior pointClippingBehavior; uint32_t maxMultiviewViewCount, maxMultiviewInstanceIndex;
    VkBool32 protectedNoFault; uint32_t maxPerSetDescriptors; VkDeviceSize maxMemoryAllocationSize; };
struct VkConformanceVersion { uint8_t major, minor, subminor, patch; };
struct VkPhysicalDeviceDriverProperties { VkStructureType sType; void* pNext; VkDriverId driverID;
    char driverName[256]; char driverInfo[256]; VkConformanceVersion conformanceVersion; };
struct VkPhysicalDeviceMaintenance4Properties { VkStructureType sType; void* pNext; VkDeviceSize
    maxBufferSize; };
struct VkPhysicalDeviceFeatures { VkBool32 robustBufferAccess, fullDrawIndexUint32, imageCubeArray,
    independentBlend, geometryShader, tessellationShader, sampleRateShading, dualSrcBlend, logicOp,
    multiDrawIndirect, drawIndirectFirstInstance, depthClamp, depthBiasClamp, fillModeNonSolid, depthBounds,
    wideLines, largePoints, alphaToOne, multiViewport, samplerAnisotropy, textureCompressionETC2,
    textureCompressionASTC_LDR, textureCompressionBC, occlusionQueryPrecise, pipelineStatisticsQuery,
    vertexPipelineStoresAndAtomics, fragmentStoresAndAtomics, shaderTessellationAndGeometryPointSize,
    shaderImageGatherExtended, shaderStorageImageExtendedFormats, shaderStorageImageMultisample,
    shaderStorageImageReadWithoutFormat, shaderStorageImageWriteWithoutFormat,
    shaderUniformBufferArrayDynamicIndexing, shaderSampledImageArrayDynamicIndexing,
    shaderStorageBufferArrayDynamicIndexing, shaderStorageImageArrayDynamicIndexing, shaderClipDistance,
    shaderCullDistance, shaderFloat64, shaderInt64, shaderInt16, shaderResourceResidency,
    shaderResourceMinLod, sparseBinding, sparseResidencyBuffer, sparseResidencyImage2D,
    sparseResidencyImage3D, sparseResidency2Samples, sparseResidency4Samples, sparseResidency8Samples,
    sparseResidency16Samples, sparseResidencyAliased, variableMultisampleRate, inheritedQueries; };
struct VkPhysicalDeviceFeatures2 { VkStructureType sType; void* pNext; VkPhysicalDeviceFeatures features; };
struct VkPhysicalDeviceVulkan11Features { VkStructureType sType; void* pNext; VkBool32
    storageBuffer16BitAccess,
    uniformAndStorageBuffer16BitAccess, storagePushConstant16, storageInputOutput16, multiview,
    multiviewGeometryShader, multiviewTessellationShader, variablePointersStorageBuffer, variablePointers,
    protectedMemory, samplerYcbcrConversion, shaderDrawParameters; };
struct VkPhysicalDeviceVulkan12Features { VkStructureType sType; void* pNext; VkBool32
    samplerMirrorClampToEdge,
    drawIndirectCount, storageBuffer8BitAccess, uniformAndStorageBuffer8BitAccess, storagePushConstant8,
    shaderBufferInt64Atomics, shaderSharedInt64Atomics, shaderFloat16, shaderInt8, descriptorIndexing,
    shaderInputAttachmentArrayDynamicIndexing, shaderUniformTexelBufferArrayDynamicIndexing,
    shaderStorageTexelBufferArrayDynamicIndexing, shaderUniformBufferArrayNonUniformIndexing,
    shaderSampledImageArrayNonUniformIndexing, shaderStorageBufferArrayNonUniformIndexing,
    shaderStorageImageArrayNonUniformIndexing, shaderInputAttachmentArrayNonUniformIndexing,
    shaderUniformTexelBufferArrayNonUniformIndexing, shaderStorageTexelBufferArrayNonUniformIndexing,
    descriptorBindingUniformBufferUpdateAfterBind, descriptorBindingSampledImageUpdateAfterBind,
    descriptorBindingStorageImageUpdateAfterBind, descriptorBindingStorageBufferUpdateAfterBind,
    descriptorBindingUniformTexelBufferUpdateAfterBind, descriptorBindingStorageTexelBufferUpdateAfterBind,
    descriptorBindingUpdateUnusedWhilePending, descriptorBindingPartiallyBound,
    descriptorBindingVariableDescriptorCount, runtimeDescriptorArray, samplerFilterMinmax, scalarBlockLayout,
    imagelessFramebuffer, uniformBufferStandardLayout, shaderSubgroupExtendedTypes,
    separateDepthStencilLayouts, hostQueryReset, timelineSemaphore, bufferDeviceAddress,
    bufferDeviceAddressCaptureReplay, bufferDeviceAddressMultiDevice, vulkanMemoryModel,
    vulkanMemoryModelDeviceScope, vulkanMemoryModelAvailabilityVisibilityChains, shaderOutputViewportIndex,
    shaderOutputLayer, subgroupBroadcastDynamicId; };
struct VkPhysicalDeviceVulkan13Features { VkStructureType sType; void* pNext; VkBool32 robustImageAccess,
    inlineUniformBlock, descriptorBindingInlineUniformBlockUpdateAfterBind, pipelineCreationCacheControl,
    privateData, shaderDemoteToHelperInvocation, shaderTerminateInvocation, subgroupSizeControl,
    computeFullSubgroups, synchronization2, textureCompressionASTC_HDR, shaderZeroInitializeWorkgroupMemory,
    dynamicRendering, shaderIntegerDotProduct, maintenance4; };
struct VkMemoryType { VkMemoryPropertyFlags propertyFlags; uint32_t heapIndex; };
struct VkMemoryHeap { VkDeviceSize size; VkMemoryHeapFlags flags; };
struct VkPhysicalDeviceMemoryProperties { uint32_t memoryTypeCount; VkMemoryType memoryTypes[32];
    uint32_t memoryHeapCount; VkMemoryHeap memoryHeaps[16]; };
"""
_SCALARS = {"uint32_t": ctypes.c_uint32, "int32_t": ctypes.c_int32, "uint8_t": ctypes.c_uint8,
            "char": ctypes.c_char, "float": ctypes.c_float, "size_t": ctypes.c_size_t,
            "VkDeviceSize": ctypes.c_uint64, "VkBool32": ctypes.c_uint32}  # fmt: skip


def _structs(decls: str) -> dict[str, type[ctypes.Structure]]:
    """ctypes Structures of C struct declarations: scalars, Vk*Flags (uint32), other Vk* names
    (enums: int32, or a struct declared before), pointers (char* a C string, any other a
    void*), fixed arrays; a declaration may name several members (``uint32_t a, b[3];``).
    (String methods, not regular expressions: compiling those took a third of this module's
    import, which every listing of the devices pays.)"""
    out: dict[str, type[ctypes.Structure]] = {}
    for chunk in decls.split("};"):
        head, brace, body = chunk.partition("{")
        if not brace:
            continue
        name = head.split()[-1]
        fields = []
        for decl in filter(None, (" ".join(d.split()) for d in body.split(";"))):
            # the type ends at its last '*', else at the first blank after it (and a "const ")
            const = 6 if decl.startswith("const ") else 0
            cut = decl.rindex("*") + 1 if "*" in decl else decl.index(" ", const)
            ctype, members = decl[:cut].strip(), decl[cut:]
            if ctype in ("const char*", "char*"):
                base: Any = ctypes.c_char_p
            elif "*" in ctype:
                base = ctypes.c_void_p
            else:
                t = ctype.removeprefix("const ")
                enum = ctypes.c_uint32 if t.endswith("Flags") else ctypes.c_int32
                base = _SCALARS.get(t) or out.get(t) or enum
            for member in members.split(","):
                mname, bracket, count = member.strip().partition("[")
                assert mname.isidentifier() and (not bracket or count[:-1].isdigit()), decl
                fields.append((mname, base * int(count[:-1]) if bracket else base))
        out[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
    return out


S = _structs(_DECLS)
# sType values and bits (tests check each against the ``vulkan`` package)
ST = {
    "VkApplicationInfo": 0, "VkInstanceCreateInfo": 1, "VkPhysicalDeviceProperties2": 1000059001,
    "VkPhysicalDeviceFeatures2": 1000059000, "VkPhysicalDeviceVulkan11Properties": 50,
    "VkPhysicalDeviceDriverProperties": 1000196000, "VkPhysicalDeviceMaintenance4Properties": 1000413001,
    "VkPhysicalDeviceVulkan11Features": 49, "VkPhysicalDeviceVulkan12Features": 51,
    "VkPhysicalDeviceVulkan13Features": 53,
}  # fmt: skip
VK_SUCCESS, VK_INCOMPLETE, VK_ERROR_INCOMPATIBLE_DRIVER = 0, 5, -9
HEAP_DEVICE_LOCAL, STAGE_COMPUTE, SUBGROUP_ARITHMETIC = 0x1, 0x20, 0x4
_RESULTS = {-1: "VK_ERROR_OUT_OF_HOST_MEMORY", -2: "VK_ERROR_OUT_OF_DEVICE_MEMORY",
            -3: "VK_ERROR_INITIALIZATION_FAILED", -6: "VK_ERROR_LAYER_NOT_PRESENT",
            -7: "VK_ERROR_EXTENSION_NOT_PRESENT", -9: "VK_ERROR_INCOMPATIBLE_DRIVER"}  # fmt: skip


def _result(r: int) -> str:
    return _RESULTS.get(r, f"VkResult {r}")


def new(name: str, **fields: Any) -> Any:
    """A zeroed struct with its sType set (when it has one) and ``fields``."""
    s = S[name]()
    if name in ST:
        s.sType = ST[name]
    for k, v in fields.items():
        setattr(s, k, v)
    return s


def _chain(head: Any, *structs: Any) -> None:
    """head.pNext -> structs[0] -> structs[1] ... (the caller keeps them alive)."""
    for a, b in zip((head, *structs), structs, strict=False):
        a.pNext = ctypes.cast(ctypes.pointer(b), ctypes.c_void_p)


def _text(chars: Any) -> str:
    return bytes(chars).split(b"\0", 1)[0].decode(errors="replace")


# --- the loader and the instance ---------------------------------------------------------------
def load_loader() -> ctypes.CDLL:
    """libvulkan (ACCELPLANE_VK_LOADER, else libvulkan.so.1 on the library path); loaded global
    when given by path, so the ``vulkan`` package's dlopen by soname finds the same one."""
    path = LOADER.get()
    try:
        return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL) if path else ctypes.CDLL("libvulkan.so.1")
    except OSError as e:
        if path:
            raise DeviceError(f"no Vulkan driver found: ACCELPLANE_VK_LOADER: {e}") from e
        raise DeviceError(
            "no Vulkan driver found: the Vulkan loader libvulkan.so.1 is not installed "
            f"(apt-get install libvulkan1 plus a driver, e.g. mesa-vulkan-drivers) [{e}]"
        ) from e


@dataclass(frozen=True)
class PhysInfo:
    """A physical device: its handle (an address: runtime/ casts it for the ``vulkan``
    package) and what it offers."""

    handle: int
    name: str
    type: int
    api: tuple[int, int]
    driver: str
    limits: dict
    storage16: bool
    int16: bool
    timeline: bool
    heap_size: int
    subgroup_size: int
    subgroup_arith: bool = False  # subgroupAdd & co. in compute shaders
    int_dot: bool = False  # shaderIntegerDotProduct (Vulkan 1.3): packed 4x8-bit dot products
    host_query_reset: bool = False  # query pools reset from the host (timestamps on transfer queues)

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
    """The process's VkInstance (made through ctypes) and its physical devices, best first."""

    def __init__(self) -> None:
        lib = self.lib = load_loader()
        name = ctypes.c_char_p(b"accelplane")
        api = (1 << 22) | (3 << 12)  # 1.3
        app = new("VkApplicationInfo", pApplicationName=name, pEngineName=name, apiVersion=api)
        ci = new("VkInstanceCreateInfo", pApplicationInfo=ctypes.cast(ctypes.pointer(app), ctypes.c_void_p))
        out = ctypes.c_void_p()
        r = lib.vkCreateInstance(ctypes.byref(ci), None, ctypes.byref(out))
        if r == VK_ERROR_INCOMPATIBLE_DRIVER:
            raise DeviceError(
                "no Vulkan driver found: the Vulkan loader found no driver (ICD); install "
                "one (mesa-vulkan-drivers for lavapipe, or the GPU vendor's driver)"
            )
        if r != VK_SUCCESS:
            raise DeviceError(f"no Vulkan driver found: vkCreateInstance failed: {_result(r)}")
        self.handle: int = out.value or 0
        n = ctypes.c_uint32()
        self._check(lib.vkEnumeratePhysicalDevices(out, ctypes.byref(n), None))
        arr = (ctypes.c_void_p * n.value)()
        self._check(lib.vkEnumeratePhysicalDevices(out, ctypes.byref(n), arr))
        infos = [self._phys_info(arr[i]) for i in range(n.value)]
        # stable sort: discrete GPUs first, lavapipe (a CPU device) last
        self.physical = sorted(infos, key=lambda p: _TYPE_ORDER.get(p.type, 3))

    @staticmethod
    def _check(r: int) -> None:
        if r not in (VK_SUCCESS, VK_INCOMPLETE):
            raise DeviceError(f"vkEnumeratePhysicalDevices failed: {_result(r)}")

    def _phys_info(self, h: int) -> PhysInfo:
        lib, hp = self.lib, ctypes.c_void_p(h)
        p2 = new("VkPhysicalDeviceProperties2")
        lib.vkGetPhysicalDeviceProperties(hp, ctypes.byref(p2.properties))
        p = p2.properties
        api = ((p.apiVersion >> 22) & 0x7F, (p.apiVersion >> 12) & 0x3FF)
        lim = p.limits
        limits = {
            "maxStorageBufferRange": lim.maxStorageBufferRange,
            "minStorageBufferOffsetAlignment": lim.minStorageBufferOffsetAlignment,
            "maxComputeWorkGroupCount": tuple(lim.maxComputeWorkGroupCount),
            "maxPushConstantsSize": lim.maxPushConstantsSize,
            "maxMemoryAllocationSize": 1 << 30,
            "maxBufferSize": 1 << 62,
            "timestampPeriod": float(lim.timestampPeriod),  # nanoseconds per timestamp tick
        }
        driver, subgroup, arith = "", 0, False
        storage16 = int16 = timeline = int_dot = host_reset = False
        if api >= (1, 2):
            v11, drv = new("VkPhysicalDeviceVulkan11Properties"), new("VkPhysicalDeviceDriverProperties")
            m4, chain = None, [v11, drv]
            if api >= (1, 3):
                m4 = new("VkPhysicalDeviceMaintenance4Properties")
                chain.append(m4)
            _chain(p2, *chain)
            lib.vkGetPhysicalDeviceProperties2(hp, ctypes.byref(p2))
            limits["maxMemoryAllocationSize"] = v11.maxMemoryAllocationSize
            if m4 is not None:
                limits["maxBufferSize"] = m4.maxBufferSize
            driver = f"{_text(drv.driverName)} {_text(drv.driverInfo)}".strip()
            subgroup = v11.subgroupSize
            arith = bool(v11.subgroupSupportedStages & STAGE_COMPUTE) and bool(
                v11.subgroupSupportedOperations & SUBGROUP_ARITHMETIC
            )
            f2, f11, f12 = (new(n) for n in ("VkPhysicalDeviceFeatures2", "VkPhysicalDeviceVulkan11Features",
                                             "VkPhysicalDeviceVulkan12Features"))  # fmt: skip
            f13 = new("VkPhysicalDeviceVulkan13Features") if api >= (1, 3) else None
            _chain(f2, f11, f12, *([f13] if f13 is not None else []))
            lib.vkGetPhysicalDeviceFeatures2(hp, ctypes.byref(f2))
            storage16, int16 = bool(f11.storageBuffer16BitAccess), bool(f2.features.shaderInt16)
            timeline = bool(f12.timelineSemaphore)
            host_reset = bool(f12.hostQueryReset)
            int_dot = f13 is not None and bool(f13.shaderIntegerDotProduct)
        mp = new("VkPhysicalDeviceMemoryProperties")
        lib.vkGetPhysicalDeviceMemoryProperties(hp, ctypes.byref(mp))
        heap = max((mp.memoryHeaps[i].size for i in range(mp.memoryHeapCount)
                    if mp.memoryHeaps[i].flags & HEAP_DEVICE_LOCAL), default=0)  # fmt: skip
        return PhysInfo(h, _text(p.deviceName), p.deviceType, api, driver, limits, storage16, int16, timeline,
                        heap, subgroup, arith, int_dot, host_reset)  # fmt: skip


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


# --- the accelplane devices -----------------------------------------------------------------------
@dataclass(eq=False)
class DeviceCtx:
    """One accelplane device (``device.ctx``): a physical device and the settings read when the
    devices were listed. Its runtime, a LogicalDevice, is ``device.runtime``."""

    label: str
    description: str
    phys: PhysInfo
    settings: Tuning

    @cached_property
    def caps(self):
        """What the kernels may use of the device (kernels.Caps), as the settings allow."""
        from .kernels import Caps

        p = self.phys
        return Caps.of(p.storage16, p.subgroup_size if p.subgroup_arith else 0, p.int_dot, self.settings)


@dataclass(frozen=True, eq=False)
class BuftCtx:
    """A buffer type of a device: device-local, or host-visible (``host``)."""

    dev: DeviceCtx
    host: bool


def list_devices(settings: Tuning) -> list[DeviceCtx]:
    """The accelplane devices, Vulkan0.., of the physical devices ``settings.devices`` selects
    (select_physical); a physical device listed twice is described as logical device k of n."""
    sel = select_physical(instance(), settings.devices)
    per_phys = collections.Counter(i for i, _ in sel)
    seen: collections.Counter[int] = collections.Counter()
    out = []
    for n, (i, p) in enumerate(sel):
        seen[i] += 1
        desc = f"{p.name} ({DEVICE_TYPES.get(p.type, '?')}; {p.driver}; Vulkan {p.api[0]}.{p.api[1]})"
        if per_phys[i] > 1:
            desc += f", logical device {seen[i]} of {per_phys[i]} on physical device {i}"
        out.append(DeviceCtx(f"Vulkan{n}", desc, p, settings))
    return out
