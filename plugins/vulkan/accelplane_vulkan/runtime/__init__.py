"""The Vulkan runtime under the plugin (a device's, opened on its first use), one module per
concept:

- vk: the ``vulkan`` package loaded (libvulkan), result checks, structs, command helpers;
- device: logical devices (queues, memory types, shaders, pipelines);
- memory: buffers (device-local, or host-visible and mapped);
- stream: in-order streams (queue, command buffers, timeline semaphore), staging, copies;
- sync: host bridges between VkDevices, and events;
- timestamps: a stream's timeline (device timestamps around its copies and computes).

The instance and the physical devices are the probe's (probe.py, ctypes), which is what
listing devices runs. This package is imported on a device's first use, never at listing:
importing it loads the ``vulkan`` package, which raises DeviceError("no Vulkan driver found:
...") when the loader is missing.
"""

from __future__ import annotations

from .device import N_BINDINGS, LogicalDevice, Queue
from .memory import Memory
from .stream import ERRORS, Staging, Stream, copy_across, memory_of, stream_of
from .sync import Bridge, EventState
from .timestamps import Timeline
from .vk import NULL, V, check, cmd_barrier, cmd_copy, cmd_to_host, create, ffi, lib, new_struct

__all__ = [
    "ERRORS", "NULL", "N_BINDINGS", "Bridge", "EventState", "LogicalDevice", "Memory", "Queue", "Staging",
    "Stream", "Timeline", "V", "check", "cmd_barrier", "cmd_copy", "cmd_to_host", "copy_across", "create",
    "ffi", "lib", "memory_of", "new_struct", "stream_of",
]  # fmt: skip
