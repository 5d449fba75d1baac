"""faulty_devices_bug: the CPU plugin, whose get_devices has a bug (it dereferences a handle it
never opened): the registry records a failure at the devices stage that is not "no device"."""

from accelplane.cpu.plugin import *  # noqa: F403
from accelplane.interface import hookimpl

_runtime = None  # the bug: never opened


@hookimpl
def get_devices():
    return list(_runtime.enumerate())
