"""The backend interface: the hookspecs (:mod:`.hookspecs`) and the objects hooks exchange.

A plugin imports what it implements from here::

    from accelplane.interface import BufferTypeSpec, DeviceCaps, DeviceSpec, DeviceType, hookimpl
"""

from accelplane.interface.hookspecs import (
    API_VERSION,
    HOOK_MIN_MINOR,
    HOOK_NAMES,
    PROJECT,
    REQUIRED_HOOKS,
    BufferTypeSpec,
    DeviceCaps,
    DeviceSpec,
    DeviceType,
    DLDeviceType,
    DLPackMemory,
    Specs,
    hookimpl,
    hookspec,
)

__all__ = [
    "API_VERSION", "HOOK_MIN_MINOR", "HOOK_NAMES", "PROJECT", "REQUIRED_HOOKS", "BufferTypeSpec",
    "DeviceCaps", "DeviceSpec", "DLDeviceType", "DLPackMemory", "DeviceType", "Specs", "hookimpl", "hookspec",
]  # fmt: skip
