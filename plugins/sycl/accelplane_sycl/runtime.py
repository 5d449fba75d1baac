"""The SYCL runtime through dpctl: listing it, logical devices, their buffer types, USM memory.

Listing the devices (get_devices) reads them through dpctl's C interface (libDPCTLSyclInterface,
by ctypes: the SYCL runtime loads, dpctl's Python package does not: its import cost as much as
the listing itself); a device's first use imports dpctl and opens it (DevState). Where that
library cannot be used, dpctl's Python API lists them. This module imports nothing heavy.

Settings are in tuning.py (ACCELPLANE_SYCL_DEVICES: which dpctl devices to expose, an index
may repeat: "0,0" opens one SYCL device as two logical devices, each with its own context and
queues). OCL_ICD_FILENAMES is set here to the intel-opencl-rt wheel's runtime library when
unset (the wheel's .icd file names a path that does not exist).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelplane.errors import AllocationError, ConfigError, DeviceError
from accelplane.runtime.progress import phase

from . import program, tuning
from .tuning import Tuning

RUNTIME_DIST = "intel-opencl-rt"
RUNTIME_LIB = "libintelocl.so"
ALIGNMENT = 128  # of every buffer type


def _runtime_library() -> str | None:
    """Path of the OpenCL CPU runtime installed by the intel-opencl-rt wheel, if any: where
    the wheel puts it (the environment's lib/), else where its file list says (importlib's
    metadata, slower to load: a third of a listing's time)."""
    p = Path(sys.prefix, "lib", RUNTIME_LIB)
    if p.exists():
        return str(p)
    from importlib import metadata

    try:
        files = metadata.files(RUNTIME_DIST) or []
    except metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == RUNTIME_LIB:
            return str(f.locate())
    return None


def _point_icd_loader() -> None:
    """OCL_ICD_FILENAMES at the wheel's OpenCL runtime, unless set (before the runtime loads)."""
    if "OCL_ICD_FILENAMES" not in os.environ:
        lib = _runtime_library()
        if lib:
            os.environ["OCL_ICD_FILENAMES"] = lib


def open_dpctl() -> Any:
    """Import dpctl, pointing the OpenCL ICD loader at the wheel's runtime first."""
    _point_icd_loader()
    try:
        import dpctl
    except ImportError as e:
        raise DeviceError(f"no SYCL device: dpctl is not importable ({e})") from e
    return dpctl


class SyclDeviceInfo:
    """What listing reads of a SYCL device, as dpctl.SyclDevice names it."""

    __slots__ = ("name", "filter_string", "driver_version", "global_mem_size", "max_mem_alloc_size", "is_cpu")

    def __init__(self, name: str, filter_string: str, driver_version: str, global_mem_size: int,
                 max_mem_alloc_size: int, is_cpu: bool) -> None:  # fmt: skip
        self.name, self.filter_string, self.driver_version = name, filter_string, driver_version
        self.global_mem_size, self.max_mem_alloc_size = global_mem_size, max_mem_alloc_size
        self.is_cpu = is_cpu

    def _key(self) -> tuple:
        return tuple(getattr(self, k) for k in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SyclDeviceInfo) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"SyclDeviceInfo({self.name!r}, {self.filter_string!r})"

    @classmethod
    def of(cls, d: Any) -> SyclDeviceInfo:
        """Of a dpctl.SyclDevice."""
        return cls(d.name, d.filter_string, d.driver_version, int(d.global_mem_size),
                   int(d.max_mem_alloc_size), bool(d.is_cpu))  # fmt: skip


# dpctl_sycl_enum_types.h: every backend and every device type, as dpctl.get_devices() asks
_ALL_BACKENDS, _ALL_DEVICE_TYPES = ((1 << 5) - 1) << 16, (1 << 6) - 1
_BACKENDS = {1 << 16: "cuda", 1 << 17: "level_zero", 1 << 18: "opencl", 1 << 19: "hip"}
_DEVICE_TYPES = {1: "accelerator", 2: "automatic", 4: "cpu", 8: "custom", 16: "gpu"}


_P, _U64 = ctypes.c_void_p, ctypes.c_uint64
_PROTOTYPES = {  # (restype, argtypes) of what listing calls, as dpctl's headers declare them
    "DPCTLDeviceMgr_GetDevices": (_P, [ctypes.c_int]), "DPCTLDeviceVector_Size": (ctypes.c_size_t, [_P]),
    "DPCTLDeviceVector_GetAt": (_P, [_P, ctypes.c_size_t]), "DPCTLDeviceVector_Delete": (None, [_P]),
    "DPCTLDevice_Delete": (None, [_P]), "DPCTLDevice_GetName": (_P, [_P]),
    "DPCTLDevice_GetDriverVersion": (_P, [_P]), "DPCTLDevice_GetGlobalMemSize": (_U64, [_P]),
    "DPCTLDevice_GetMaxMemAllocSize": (_U64, [_P]), "DPCTLDevice_IsCPU": (ctypes.c_bool, [_P]),
    "DPCTLDevice_GetBackend": (ctypes.c_int, [_P]), "DPCTLDevice_GetDeviceType": (ctypes.c_int, [_P]),
    "DPCTLDeviceMgr_GetRelativeId": (ctypes.c_int64, [_P]), "DPCTLCString_Delete": (None, [_P]),
}


def _dpctl_c() -> ctypes.CDLL | None:
    """dpctl's C interface library with the prototypes listing uses, or None when dpctl is not
    installed or the library does not load or lacks one of them."""
    spec = importlib.util.find_spec("dpctl")  # (finds the package without importing it)
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        lib = ctypes.CDLL(os.path.join(spec.submodule_search_locations[0], "libDPCTLSyclInterface.so"))
        for fn, (res, args) in _PROTOTYPES.items():
            f = getattr(lib, fn)
            f.restype, f.argtypes = res, args
    except (OSError, AttributeError):
        return None
    return lib


def _take_str(lib: ctypes.CDLL, p: int | None) -> str:
    """A string dpctl's C interface gave (and the caller frees)."""
    if not p:
        return ""
    try:
        return ctypes.string_at(p).decode(errors="replace")
    finally:
        lib.DPCTLCString_Delete(p)


def list_devices_c(lib: ctypes.CDLL) -> list[SyclDeviceInfo]:
    """Every SYCL device, in dpctl.get_devices()'s order, through dpctl's C interface."""
    vec = lib.DPCTLDeviceMgr_GetDevices(_ALL_BACKENDS | _ALL_DEVICE_TYPES)
    if not vec:
        return []
    out = []
    try:
        for i in range(lib.DPCTLDeviceVector_Size(vec)):
            d = lib.DPCTLDeviceVector_GetAt(vec, i)
            try:
                backend = _BACKENDS.get(lib.DPCTLDevice_GetBackend(d), "unknown")
                kind = _DEVICE_TYPES.get(lib.DPCTLDevice_GetDeviceType(d), "unknown")
                fs = f"{backend}:{kind}:{lib.DPCTLDeviceMgr_GetRelativeId(d)}"
                out.append(SyclDeviceInfo(_take_str(lib, lib.DPCTLDevice_GetName(d)), fs,
                                          _take_str(lib, lib.DPCTLDevice_GetDriverVersion(d)),
                                          int(lib.DPCTLDevice_GetGlobalMemSize(d)),
                                          int(lib.DPCTLDevice_GetMaxMemAllocSize(d)),
                                          bool(lib.DPCTLDevice_IsCPU(d))))  # fmt: skip
            finally:
                lib.DPCTLDevice_Delete(d)
    finally:
        lib.DPCTLDeviceVector_Delete(vec)
    return out


def list_devices() -> list[SyclDeviceInfo]:
    """Every SYCL device, in dpctl.get_devices()'s order: through dpctl's C interface where it
    loads (dpctl's Python package is not imported), else through dpctl."""
    _point_icd_loader()
    lib = _dpctl_c()
    if lib is not None:
        return list_devices_c(lib)
    return [SyclDeviceInfo.of(d) for d in open_dpctl().get_devices()]


_dpctl_devices: list | None = None


def dpctl_device(probe: Probe) -> Any:
    """The dpctl.SyclDevice a probe listed (dpctl imported here: a device's first use), checked
    to be the same device."""
    global _dpctl_devices
    dpctl = open_dpctl()
    if _dpctl_devices is None:
        _dpctl_devices = list(dpctl.get_devices())
    phys = _dpctl_devices
    j = probe.phys_index
    if j >= len(phys) or SyclDeviceInfo.of(phys[j]) != probe.dev:
        raise DeviceError(f"{probe.name}: dpctl lists {[SyclDeviceInfo.of(d) for d in phys]} now, not the "
                          f"{probe.dev!r} listed as its device {j}")  # fmt: skip
    return phys[j]


def _device_indices(n: int, wanted: tuple[int, ...] | None) -> list[int]:
    if not wanted:
        return list(range(n))
    bad = [i for i in wanted if not 0 <= i < n]
    if bad:
        raise ConfigError(
            f"ACCELPLANE_SYCL_DEVICES: dpctl lists {n} device(s), indices 0..{n - 1}; got {bad}"
        )
    return list(wanted)


@dataclass(frozen=True, eq=False)
class Probe:
    """What listing says of one logical device: its SYCL device (no context, no queue yet)."""

    index: int
    dev: SyclDeviceInfo  # (the dpctl.SyclDevice is the open device's: DevState.dev)
    phys_index: int
    shared: bool  # one of several logical devices of that SYCL device
    settings: Tuning

    @property
    def name(self) -> str:
        return f"SYCL{self.index}"

    @property
    def description(self) -> str:
        d = self.dev
        return (f"{d.name} ({d.filter_string}, driver {d.driver_version}"
                + (f", logical device {self.index} of it" if self.shared else "") + ")")  # fmt: skip


def discover() -> list[Probe]:
    """The logical devices: one per index of ACCELPLANE_SYCL_DEVICES (default: every device),
    listed from dpctl; each opens (DevState) on first use."""
    settings = tuning.read()
    phys = list_devices()
    if not phys:
        lib, dpctl = _runtime_library(), open_dpctl()  # (for the message: dpctl's version)
        raise DeviceError(
            f"no SYCL device: dpctl {dpctl.__version__} lists none (OCL_ICD_FILENAMES="
            f"{os.environ.get('OCL_ICD_FILENAMES', '<unset>')}; {RUNTIME_DIST} "
            f"{'runtime at ' + lib if lib else 'not installed'})"
        )
    idx = _device_indices(len(phys), settings.devices)
    return [Probe(i, phys[j], j, idx.count(j) > 1, settings) for i, j in enumerate(idx)]


class DevState:
    """One logical device, open (a device's runtime: made on its first use, from its Probe):
    a SYCL device with its own context, a queue for blocking buffer operations, the kernel
    program (built on first use) and the streams opened on it."""

    def __init__(self, probe: Probe) -> None:
        dpctl = open_dpctl()
        self.probe = probe
        self.settings = probe.settings
        self.index = probe.index
        self.name = probe.name
        self.dev = dev = dpctl_device(probe)
        self.phys_index = probe.phys_index
        self.description = probe.description
        self.ctx = _context(dpctl, dev, probe.shared)
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
                    with phase(f"sycl: {self.name}: compiling {name}"):  # said if it takes a while
                        k = self._kernels[name] = program.build(self.queue, self.dev, self.name, name)
        return k

    def built(self) -> set[str]:
        """The kernels built for this device so far."""
        return set(self._kernels)

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

    dev: Probe
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
