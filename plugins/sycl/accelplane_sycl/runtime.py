"""The SYCL runtime through dpctl: opening it, logical devices, their buffer types, USM memory.

dpctl (which loads the SYCL runtime) is imported on the first get_devices (open_dpctl), never at
plugin discovery: this module imports nothing heavy.

Settings are in tuning.py (ACCELPLANE_SYCL_DEVICES: which dpctl devices to expose, an index
may repeat: "0,0" opens one SYCL device as two logical devices, each with its own context and
queues). OCL_ICD_FILENAMES is set here to the intel-opencl-rt wheel's runtime library when
unset (the wheel's .icd file names a path that does not exist).
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from accelplane.errors import AllocationError, ConfigError, DeviceError

from . import program, tuning
from .tuning import Tuning

RUNTIME_DIST = "intel-opencl-rt"
RUNTIME_LIB = "libintelocl.so"
ALIGNMENT = 128  # of every buffer type


def _runtime_library() -> str | None:
    """Path of the OpenCL CPU runtime installed by the intel-opencl-rt wheel, if any."""
    try:
        files = metadata.files(RUNTIME_DIST) or []
    except metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == RUNTIME_LIB:
            return str(f.locate())
    p = Path(sys.prefix, "lib", RUNTIME_LIB)
    return str(p) if p.exists() else None


def open_dpctl() -> Any:
    """Import dpctl, pointing the OpenCL ICD loader at the wheel's runtime first."""
    if "OCL_ICD_FILENAMES" not in os.environ:
        lib = _runtime_library()
        if lib:
            os.environ["OCL_ICD_FILENAMES"] = lib
    try:
        import dpctl
    except ImportError as e:
        raise DeviceError(f"no SYCL device: dpctl is not importable ({e})") from e
    return dpctl


def _device_indices(n: int, wanted: tuple[int, ...] | None) -> list[int]:
    if not wanted:
        return list(range(n))
    bad = [i for i in wanted if not 0 <= i < n]
    if bad:
        raise ConfigError(
            f"ACCELPLANE_SYCL_DEVICES: dpctl lists {n} device(s), indices 0..{n - 1}; got {bad}"
        )
    return list(wanted)


def discover() -> list[DevState]:
    """The logical devices: one per index of ACCELPLANE_SYCL_DEVICES (default: every device)."""
    settings = tuning.read()
    dpctl = open_dpctl()
    phys = list(dpctl.get_devices())
    if not phys:
        lib = _runtime_library()
        raise DeviceError(
            f"no SYCL device: dpctl {dpctl.__version__} lists none (OCL_ICD_FILENAMES="
            f"{os.environ.get('OCL_ICD_FILENAMES', '<unset>')}; {RUNTIME_DIST} "
            f"{'runtime at ' + lib if lib else 'not installed'})"
        )
    idx = _device_indices(len(phys), settings.devices)
    return [DevState(i, phys[j], j, idx.count(j) > 1, settings) for i, j in enumerate(idx)]


class DevState:
    """One logical device: a SYCL device with its own context, a queue for blocking buffer
    operations, the kernel program (built on first use) and the streams opened on it."""

    def __init__(self, index: int, dev: Any, phys_index: int, shared: bool, settings: Tuning) -> None:
        import dpctl

        self.settings = settings
        self.index = index
        self.name = f"SYCL{index}"
        self.dev = dev
        self.phys_index = phys_index
        self.description = (f"{dev.name} ({dev.filter_string}, driver {dev.driver_version}"
                            + (f", logical device {index} of it" if shared else "") + ")")  # fmt: skip
        self.ctx = _context(dpctl, dev, shared)
        # DLPack names USM by a root device's index, and dpctl/dpnp take a pointer of the
        # platform's default context only: exchange zero-copy in that context, else copy
        self.dlpack_id: int | None = dev.get_device_id() if self.ctx == _default_context(dev) else None
        self.queue = dpctl.SyclQueue(self.ctx, dev, property="in_order")
        self.lock = threading.Lock()
        self.allocated = 0
        self.streams: weakref.WeakSet = weakref.WeakSet()
        self._kernels: dict[str, Any] = {}
        self._onemkl: Any = None
        self._spin: UsmBuffer | None = None

    def __repr__(self) -> str:
        return f"DevState({self.name}, {self.dev.filter_string})"

    # --- kernels -----------------------------------------------------------------------------------
    def kernel(self, name: str) -> Any:
        """Kernel ``name`` of kernels/*.cl, built for this device's context on first use (each
        kernel its own program: program.py)."""
        k = self._kernels.get(name)
        if k is None:
            with self.lock:
                k = self._kernels.get(name)
                if k is None:
                    k = self._kernels[name] = program.build(self.queue, self.dev, self.name, name)
        return k

    def onemkl(self) -> Any:
        """dpnp (oneMKL gemm) when installed and not disabled, else None."""
        if self._onemkl is None:
            mod: Any = False
            if self.settings.onemkl:
                try:
                    import dpnp

                    mod = dpnp
                except Exception:  # not installed, or its runtime does not load here
                    mod = False
            self._onemkl = mod
        return self._onemkl or None

    def spin_mem(self) -> Any:
        """4 bytes that k_spin writes (so the busy loop is not optimized away)."""
        if self._spin is None:
            self._spin = self.alloc(4, host=False)
        return self._spin.mem

    # --- memory ------------------------------------------------------------------------------------
    def alloc(self, size: int, host: bool) -> UsmBuffer:
        import dpctl.memory as dm

        cls = dm.MemoryUSMHost if host else dm.MemoryUSMDevice
        try:
            mem = cls(max(size, 1), queue=self.queue)
        except Exception as e:
            kind = "USM host" if host else "USM device"
            raise AllocationError(
                f"{self.name} ({self.dev.name}): cannot allocate {size} bytes of {kind} memory: "
                f"{type(e).__name__}: {e}"
            ) from e
        with self.lock:
            self.allocated += size
        return UsmBuffer(mem, size, self, host)

    def wrap(self, ptr: int, size: int, host: bool, owner: Any) -> UsmBuffer | None:
        """Another library's USM at ``ptr`` as a buffer (kept alive through ``owner``), when it is
        memory of this context of the kind the buffer type holds (host; device or shared), else
        None."""
        import dpctl.memory as dm

        try:
            mem = dm.as_usm_memory(_UsmPointer(ptr, size, self.queue, owner))
        except ValueError:  # not a pointer of this context
            return None
        if mem.get_usm_type() not in (("host",) if host else ("device", "shared")):
            return None
        return UsmBuffer(mem, size, self, host, counted=False)

    def wait_streams(self) -> None:
        """Wait for every queue of this device (before memory they may use is released)."""
        self.queue.wait()
        for s in list(self.streams):
            s.queue.wait()


@dataclass(frozen=True)
class BuftInfo:
    """A buffer type's ctx: USM device memory of ``dev``, or USM host memory (``host``)."""

    dev: DevState
    host: bool


class UsmBuffer:
    """A buffer's ctx: USM memory of one logical device."""

    __slots__ = ("mem", "ptr", "size", "dev", "host", "counted", "__weakref__")

    def __init__(self, mem: Any, size: int, dev: DevState, host: bool, counted: bool = True) -> None:
        self.mem = mem
        self.ptr: int = mem.__sycl_usm_array_interface__["data"][0]
        self.size = size
        self.dev = dev
        self.host = host
        self.counted = counted  # allocated by the plugin (device_memory counts it), not wrapped

    def at(self, offset: int, nbytes: int, queue: Any) -> Any:
        """A dpctl memory object for ``nbytes`` at ``offset``, bound to ``queue``."""
        return usm_view(self.ptr + offset, nbytes, queue)

    def release(self) -> None:
        if self.mem is not None:
            if self.counted:
                with self.dev.lock:
                    self.dev.allocated -= self.size
            self.mem = None


def usm_of(buffer, dev: DevState | None = None) -> UsmBuffer | None:
    """The buffer's UsmBuffer when it is SYCL memory (of ``dev`` when given), else None."""
    u = buffer.ctx if buffer is not None else None
    if not isinstance(u, UsmBuffer) or (dev is not None and u.dev is not dev):
        return None
    return u


class _UsmPointer:
    """A bare __sycl_usm_array_interface__: how dpctl takes a pointer it does not own (the dpctl
    memory made from it keeps it, and so ``owner``, alive)."""

    __slots__ = ("__sycl_usm_array_interface__", "owner")

    def __init__(self, ptr: int, nbytes: int, queue: Any, owner: Any = None) -> None:
        self.__sycl_usm_array_interface__ = {
            "data": (ptr, False), "shape": (nbytes,), "strides": None, "typestr": "|u1",
            "version": 1, "syclobj": queue,
        }  # fmt: skip
        self.owner = owner


def _default_context(dev: Any) -> Any:
    try:
        return dev.sycl_platform.default_context
    except Exception:  # a runtime without the default-context extension
        return None


def _context(dpctl: Any, dev: Any, shared: bool) -> Any:
    """The logical device's SYCL context: the platform's default context when the device is the
    only logical device over ``dev`` and that context holds ``dev`` alone (USM then crosses
    DLPack to dpctl/dpnp without a copy, and contexts still tell devices apart), else a context of
    its own (the list form: dpctl's single-device form returns a cached, shared one), so logical
    devices of one SYCL device behave as separate devices."""
    ctx = None if shared else _default_context(dev)
    if ctx is not None and ctx.device_count == 1 and ctx.get_devices()[0] == dev:
        return ctx
    return dpctl.SyclContext([dev])


def usm_view(ptr: int, nbytes: int, queue: Any) -> Any:
    import dpctl.memory as dm

    return dm.as_usm_memory(_UsmPointer(ptr, nbytes, queue))
