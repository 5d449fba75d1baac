"""The ``vulkan`` package loaded (libvulkan through cffi), result checks, struct construction
and the command-recording helpers every part of the runtime shares.

Every Vulkan call goes through the raw cffi functions of the ``vulkan`` package (``vk.lib``)
with structs built by ``ffi.new``: its convenience wrappers lose nested pointers (a second
vkCreateComputePipelines through them fails on lavapipe) and cost 5-40 us per call.
"""

from __future__ import annotations

from accelplane.errors import AllocationError, ComputeError, DeviceError

from ..tuning import LOADER

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


def result_name(r: int) -> str:
    cls = getattr(_vk, "exception_codes", {}).get(r)
    return cls.__name__ if cls is not None else f"VkResult {r}"


def check(r: int, what: str) -> None:
    if r == V.VK_SUCCESS:
        return
    msg = f"Vulkan: {what} failed: {result_name(r)}"
    if r in (V.VK_ERROR_OUT_OF_DEVICE_MEMORY, V.VK_ERROR_OUT_OF_HOST_MEMORY):
        raise AllocationError(msg)
    raise ComputeError(msg)


def create(kind: str, parent, info, what: str | None = None):
    """The handle ``vkCreate<kind>(parent, info, NULL, &handle)`` makes (``Vk<kind>``), its
    result checked (``what`` names the call in the error; default the function's name)."""
    out = ffi.new(f"Vk{kind}*")
    check(getattr(lib, f"vkCreate{kind}")(parent, info, NULL, out), what or f"vkCreate{kind}")
    return out[0]


def new_struct(ctype: str, stype: int | None = None, **fields):
    """A zeroed ``ctype`` struct (a cffi pointer) with ``fields`` set and sType = ``stype``."""
    s = ffi.new(ctype + "*", fields)
    if stype is not None:
        s.sType = stype
    return s


def cstr(b) -> str:
    return ffi.string(b).decode(errors="replace")


# --- command recording helpers --------------------------------------------------------------------
def cmd_copy(cmd, src, src_off: int, dst, dst_off: int, size: int) -> None:
    region = ffi.new("VkBufferCopy*", {"srcOffset": src_off, "dstOffset": dst_off, "size": size})
    lib.vkCmdCopyBuffer(cmd, src, dst, 1, region)


def cmd_barrier(cmd, src_stage: int, src_access: int, dst_stage: int, dst_access: int) -> None:
    mb = new_struct(
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
