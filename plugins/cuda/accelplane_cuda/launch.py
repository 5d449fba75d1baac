"""Kernel launches through the driver's ``cuLaunchKernelEx``, with programmatic dependent launch.

CuPy launches kernels with ``cuLaunchKernel``, which cannot carry launch attributes. On sm_90
and newer, a launch with the programmatic-stream-serialization attribute lets a kernel start
while the one before it in the stream runs (once that one is past its own wait): its blocks are
scheduled as SMs free up and wait inside the kernel (kernels/common.cuh: ``pdl_enter``) for the
previous kernel's results. Between the
short kernels of a decode step this hides the launch and ramp-up gap; the register mat-vec
also streams its first weights during that wait. A stream capture records the attribute as a
programmatic edge of the CUDA graph, so replays keep the overlap.

``ACCELPLANE_CUDA_PDL=0`` launches without the attribute (the kernels' waits are then no-ops).
Each :class:`Launch` is built once at plan time (arguments packed, config filled); calling it
costs one ctypes call.
"""

from __future__ import annotations

import ctypes

import numpy as np
from accelplane.errors import ComputeError, DeviceError

_CLUSTER_DIMENSION, _PROGRAMMATIC_STREAM_SERIALIZATION = 4, 6  # CUlaunchAttributeID


class _Attr(ctypes.Structure):
    # CUlaunchAttribute: the id, padding to 8 bytes, then a 64-byte value union (an int, or the
    # cluster's three dimensions)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 3),
                ("rest", ctypes.c_char * 52)]  # fmt: skip


class _Config(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)),
                ("n_attrs", ctypes.c_uint)]  # fmt: skip


assert ctypes.sizeof(_Attr) == 72 and ctypes.sizeof(_Config) == 56  # the driver's ABI (cuda.h)

_ARG_TYPES = {np.uint64: ctypes.c_uint64, np.int64: ctypes.c_int64, np.int32: ctypes.c_int32,
              np.uint32: ctypes.c_uint32, np.float32: ctypes.c_float}  # fmt: skip
_LIB = None


def _driver():
    global _LIB
    if _LIB is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise DeviceError(f"the CUDA driver library could not be loaded: {e}") from e
        lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _LIB = lib
    return _LIB


def pdl_wanted(compute_capability: int, enabled: bool) -> bool:
    """Launch with programmatic dependent launch: sm_90+ and ``enabled`` (the plan's or comm's
    reading of ACCELPLANE_CUDA_PDL, tuning.py)."""
    return enabled and compute_capability >= 90


class Launch:
    """One kernel launch, prepared: ``fn`` a CuPy kernel, ``args`` NumPy scalars (device
    addresses as ``np.uint64``); ``cluster`` > 1: blocks in thread-block clusters of that many
    along x (sm_90+; the grid's x a multiple of it). Calling it enqueues the kernel on
    ``stream_ptr``."""

    def __init__(self, name: str, fn, grid: tuple, block: tuple, smem: int, stream_ptr: int, args: tuple,
                 pdl: bool, cluster: int = 1) -> None:  # fmt: skip
        self.name = name
        self.fn = ctypes.c_void_p(fn.kernel.ptr)
        self.values = []
        for a in args:
            ct = _ARG_TYPES.get(type(a))
            if ct is None:
                raise TypeError(f"{name}: kernel argument {a!r} of type {type(a).__name__} "
                                "(expected a NumPy scalar)")  # fmt: skip
            self.values.append(ct(a.item()))
        self.params = (ctypes.c_void_p * max(1, len(args)))(*[ctypes.addressof(v) for v in self.values])
        attrs = ([_Attr(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=(1, 0, 0))] if pdl else []) + (
            [_Attr(id=_CLUSTER_DIMENSION, value=(cluster, 1, 1))] if cluster > 1 else [])
        self.attrs = (_Attr * max(1, len(attrs)))(*attrs)
        dims = [*grid, 1, 1][:3], [*block, 1, 1][:3]
        first = ctypes.cast(self.attrs, ctypes.POINTER(_Attr)) if attrs else None
        self.config = _Config((ctypes.c_uint * 3)(*dims[0]), (ctypes.c_uint * 3)(*dims[1]), smem, stream_ptr,
                              first, len(attrs))  # fmt: skip
        self.cfg_ptr = ctypes.addressof(self.config)
        self.params_ptr = ctypes.addressof(self.params)
        self.lib = _driver()

    def __call__(self) -> None:
        rc = self.lib.cuLaunchKernelEx(self.cfg_ptr, self.fn, self.params_ptr, None)
        if rc:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(msg))
            text = msg.value.decode() if msg.value else "unknown error"
            raise ComputeError(f"launching {self.name} failed: CUDA error {rc} ({text})")
