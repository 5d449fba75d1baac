"""Memory: a VkBuffer with its own memory, the ctx of every buffer and staging area."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from accelplane.errors import AllocationError

from .vk import NULL, V, check, create, ffi, lib, new_struct, result_name

if TYPE_CHECKING:
    from .device import LogicalDevice


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
        mode, fams = dev.sharing()
        c_fams = ffi.new("uint32_t[]", fams) if fams else NULL
        bci = new_struct(
            "VkBufferCreateInfo",
            V.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO,
            size=vsize,
            usage=usage,
            sharingMode=mode,
            queueFamilyIndexCount=len(fams),
            pQueueFamilyIndices=c_fams,
        )
        self.buf = create("Buffer", dev.handle, bci, f"vkCreateBuffer({size} bytes)")
        req = ffi.new("VkMemoryRequirements*")
        lib.vkGetBufferMemoryRequirements(dev.handle, self.buf, req)
        try:
            mtype = dev.memory_type(host, req.memoryTypeBits)
        except AllocationError:
            lib.vkDestroyBuffer(dev.handle, self.buf, NULL)
            raise
        ai = new_struct(
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
                f"{'host-visible' if host else 'device'} memory: {result_name(r)}"
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
