"""faulty_noruntime: the CPU plugin, on a machine without its vendor runtime: get_devices
imports the runtime and raises DeviceError when it is absent (as the CUDA plugin does without
CuPy), so the registry records "no device" and the plugin is not broken."""

from accelplane.cpu.plugin import *  # noqa: F403
from accelplane.errors import DeviceError
from accelplane.interface import hookimpl


@hookimpl
def get_devices():
    try:
        import accelplane_fake_vendor_runtime  # noqa: F401  (never installed)
    except ImportError as e:
        raise DeviceError(f"no FAKE device: {type(e).__name__}: {e}") from None
    raise AssertionError("unreachable")
