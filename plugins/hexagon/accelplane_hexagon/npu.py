"""The boundary to the emulated NPU (``accelplane_hexagon._htp``, host C built by cffi): loaded
on first use, so importing the plugin stays cheap."""

from __future__ import annotations

import importlib.util
from functools import cache
from typing import Any

from accelplane.errors import ComputeError, DeviceError

ERRORS = {
    -1: "a tensor reaches outside its buffer",
    -2: "a row or expert index is out of range",
    -3: "op or type combination not handled by the NPU kernels",
    -4: "the op needs more VTCM scratch than the batch has",
}


NOT_BUILT = ("accelplane_hexagon._htp (the emulated NPU's C kernels) is not built: "
             "pip install -e plugins/hexagon, or python plugins/hexagon/accelplane_hexagon/_build.py")


def check_built() -> None:
    """DeviceError when the NPU side is not built, without loading it (listing devices)."""
    if importlib.util.find_spec(f"{__package__}._htp") is None:
        raise DeviceError(NOT_BUILT)


@cache
def load() -> tuple[Any, Any]:
    """(ffi, lib) of the compiled NPU side; DeviceError when it is not built."""
    try:
        from ._htp import ffi, lib
    except ImportError as e:
        raise DeviceError(NOT_BUILT) from e
    return ffi, lib


def check(rsp, what: str) -> None:
    """Raise ComputeError for a failed batch response."""
    if rsp.status != 0:
        reason = ERRORS.get(rsp.status, f"status {rsp.status}")
        raise ComputeError(f"HTP: {what}: {reason}")
