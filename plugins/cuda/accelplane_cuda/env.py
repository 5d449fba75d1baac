"""The plugin's ACCELPLANE_CUDA_* choices, parsed in one place: a value outside the allowed
ones raises DeviceError naming the variable, instead of being taken for the default."""

from __future__ import annotations

import os

from accelplane.errors import DeviceError


def choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    """``os.environ[name]`` (``default`` when unset), one of ``allowed``."""
    v = os.environ.get(name, default)
    if v not in allowed:
        raise DeviceError(f"{name} must be {' or '.join(allowed)}, got {v!r}")
    return v


def flag(name: str, default: bool = True) -> bool:
    """A 1|0 switch."""
    return choice(name, "1" if default else "0", ("1", "0")) == "1"
