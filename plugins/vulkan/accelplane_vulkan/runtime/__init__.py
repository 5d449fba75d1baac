"""The Vulkan runtime under the plugin, one module per concept:

- vk: the ``vulkan`` package loaded (libvulkan), result checks, structs, command helpers;
- physical: the instance, physical devices and their features, which ones to open;
- device: logical devices (queues, memory types, pipelines) and the plugin's device contexts;
- memory: buffers (device-local, or host-visible and mapped);
- stream: in-order streams (queue, command buffers, timeline semaphore), staging, copies;
- sync: host bridges between VkDevices, and events.

Imported on first use (get_devices), never at plugin discovery: importing it loads libvulkan
and raises DeviceError("no Vulkan driver found: ...") when the loader is missing.
"""

from __future__ import annotations

from .device import N_BINDINGS, BuftCtx, DeviceCtx, LogicalDevice, Queue, open_devices
from .memory import Memory
from .physical import DEVICE_TYPES, Instance, PhysInfo, instance, select_physical
from .stream import ERRORS, Staging, Stream, copy_across, memory_of, stream_of
from .sync import Bridge, EventState
from .vk import NULL, V, check, cmd_barrier, cmd_copy, cmd_to_host, ffi, lib, new_struct

__all__ = [
    "DEVICE_TYPES", "ERRORS", "NULL", "N_BINDINGS", "Bridge", "BuftCtx", "DeviceCtx", "EventState",
    "Instance", "LogicalDevice", "Memory", "PhysInfo", "Queue", "Staging", "Stream", "V", "check",
    "cmd_barrier", "cmd_copy", "cmd_to_host", "copy_across", "ffi", "instance", "lib", "memory_of",
    "new_struct", "open_devices", "select_physical", "stream_of",
]  # fmt: skip
