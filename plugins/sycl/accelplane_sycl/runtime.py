"""The SYCL runtime through dpctl: opening it, logical devices, USM memory, the kernel program.

Imported on the first get_devices, never at plugin discovery (dpctl loads the SYCL runtime).

Settings are in tuning.py (ACCELPLANE_SYCL_DEVICES: which dpctl devices to expose, an index
may repeat: "0,0" opens one SYCL device as two logical devices, each with its own context and
queues). OCL_ICD_FILENAMES is set here to the intel-opencl-rt wheel's runtime library when
unset (the wheel's .icd file names a path that does not exist).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
import weakref
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from accelplane.errors import AllocationError, ComputeError, ConfigError, DeviceError

from . import tuning
from .tuning import Tuning

RUNTIME_DIST = "intel-opencl-rt"
RUNTIME_LIB = "libintelocl.so"
_KERNEL_SOURCE = "kernels.cl"


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


_sources: tuple[str, dict[str, str]] | None = None


def kernel_sources() -> tuple[str, dict[str, str]]:
    """kernels.cl split into (the helpers every kernel shares, {kernel name: its source})."""
    global _sources
    if _sources is None:
        text = resources.files(__package__).joinpath(_KERNEL_SOURCE).read_text()
        common: list[str] = []
        kernels: dict[str, str] = {}
        for i, part in enumerate(re.split(r"(?m)^(?=__kernel void )", text)):
            if i == 0:
                common.append(part)
                continue
            end = part.index("\n}\n") + 3  # a kernel ends at the first closing brace in column 0
            kernels[re.match(r"__kernel void (\w+)", part).group(1)] = part[:end]
            common.append(part[end:])
        _sources = ("".join(common), kernels)
    return _sources


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
        # a context of its own (the list form: dpctl's single-device form returns a cached,
        # shared one), so logical devices of one SYCL device behave as separate devices
        self.ctx = dpctl.SyclContext([dev])
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
        """Kernel ``name`` of kernels.cl, built for this device's context on first use. Each
        kernel is its own program (the shared helpers plus that kernel): the OpenCL CPU
        compiler takes about 0.3 s per kernel, 13 s for all of them at once."""
        k = self._kernels.get(name)
        if k is None:
            with self.lock:
                k = self._kernels.get(name)
                if k is None:
                    k = self._kernels[name] = self._build(name).get_sycl_kernel(name)
        return k

    def _build(self, name: str) -> Any:
        import dpctl.program as dpp

        common, kernels = kernel_sources()
        if name not in kernels:
            raise ComputeError(f"{self.name}: no kernel {name!r} in {_KERNEL_SOURCE}")
        src = common + kernels[name]
        try:
            return dpp.create_program_from_source(self.queue, src)
        except Exception as e:
            log = opencl_build_log(self.dev, src) if self.dev.backend.name == "opencl" else ""
            raise ComputeError(
                f"{self.name} ({self.dev.name}): building OpenCL C kernel {name} failed: "
                f"{type(e).__name__}: {e}" + (f"\nbuild log:\n{log}" if log else "")
            ) from e

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

    def wait_streams(self) -> None:
        """Wait for every queue of this device (before memory they may use is released)."""
        self.queue.wait()
        for s in list(self.streams):
            s.queue.wait()


class UsmBuffer:
    """A buffer's ctx: USM memory of one logical device."""

    __slots__ = ("mem", "ptr", "size", "dev", "host", "__weakref__")

    def __init__(self, mem: Any, size: int, dev: DevState, host: bool) -> None:
        self.mem = mem
        self.ptr: int = mem.__sycl_usm_array_interface__["data"][0]
        self.size = size
        self.dev = dev
        self.host = host

    def at(self, offset: int, nbytes: int, queue: Any) -> Any:
        """A dpctl memory object for ``nbytes`` at ``offset``, bound to ``queue``."""
        return usm_view(self.ptr + offset, nbytes, queue)

    def release(self) -> None:
        if self.mem is not None:
            with self.dev.lock:
                self.dev.allocated -= self.size
            self.mem = None


class _UsmPointer:
    """A bare __sycl_usm_array_interface__: how dpctl takes a pointer it does not own."""

    __slots__ = ("__sycl_usm_array_interface__",)

    def __init__(self, ptr: int, nbytes: int, queue: Any) -> None:
        self.__sycl_usm_array_interface__ = {
            "data": (ptr, False), "shape": (nbytes,), "strides": None, "typestr": "|u1",
            "version": 1, "syclobj": queue,
        }  # fmt: skip


def usm_view(ptr: int, nbytes: int, queue: Any) -> Any:
    import dpctl.memory as dm

    return dm.as_usm_memory(_UsmPointer(ptr, nbytes, queue))


# --- the build log dpctl does not give -------------------------------------------------------------
def opencl_build_log(dev: Any, src: str) -> str:
    """Build ``src`` again through the OpenCL ICD loader for the device of the same name and
    return the compiler's log (dpctl's SyclProgramCompilationError carries none)."""
    try:
        cl = ctypes.CDLL("libOpenCL.so.1")
    except OSError:
        lib = Path(sys.prefix, "lib", "libOpenCL.so.1")
        try:
            cl = ctypes.CDLL(str(lib))
        except OSError:
            return ""
    vp, u32, sz = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_size_t
    all_types = ctypes.c_uint64(0xFFFFFFFF)  # CL_DEVICE_TYPE_ALL
    n = u32()
    if cl.clGetPlatformIDs(0, None, ctypes.byref(n)) or not n.value:
        return ""
    plats = (vp * n.value)()
    cl.clGetPlatformIDs(n, plats, None)
    for plat in plats:
        nd = u32()
        if cl.clGetDeviceIDs(vp(plat), all_types, 0, None, ctypes.byref(nd)) or not nd.value:
            continue
        devs = (vp * nd.value)()
        cl.clGetDeviceIDs(vp(plat), all_types, nd, devs, None)
        for d in devs:
            name = ctypes.create_string_buffer(256)
            cl.clGetDeviceInfo(vp(d), u32(0x102B), sz(256), name, None)  # CL_DEVICE_NAME
            if name.value.decode(errors="replace").strip() != dev.name.strip():
                continue
            err = ctypes.c_int()
            cl.clCreateContext.restype = vp
            ctx = cl.clCreateContext(None, 1, ctypes.byref(vp(d)), None, None, ctypes.byref(err))
            if err.value:
                return ""
            cl.clCreateProgramWithSource.restype = vp
            s = ctypes.c_char_p(src.encode())
            prog = cl.clCreateProgramWithSource(vp(ctx), 1, ctypes.byref(s), None, ctypes.byref(err))
            cl.clBuildProgram(vp(prog), 1, ctypes.byref(vp(d)), None, None, None)
            size = sz()
            cl.clGetProgramBuildInfo(vp(prog), vp(d), u32(0x1183), sz(0), None, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value + 1)
            cl.clGetProgramBuildInfo(vp(prog), vp(d), u32(0x1183), size, buf, None)  # BUILD_LOG
            cl.clReleaseProgram(vp(prog))
            cl.clReleaseContext(vp(ctx))
            return buf.value.decode(errors="replace").strip()
    return ""
