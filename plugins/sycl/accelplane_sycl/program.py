"""The plugin's OpenCL C kernels (kernels/*.cl, one file per op family) and building them.

kernels/common.cl holds what every kernel shares (types, tensor descriptors, loads and stores,
quantized blocks); each family file holds its kernels and the helpers only they use. Every
kernel is built as its own program, common.cl + its family's helpers + the kernel: the OpenCL
CPU compiler takes about 0.3 s per kernel, 13 s for all of them at once. A kernel that does not
build raises ComputeError with the compiler's log.
"""

from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path
from typing import Any

from accelplane.errors import ComputeError

KERNEL_DIR = "kernels"
COMMON = "common.cl"

_sources: dict[str, str] | None = None


def _split(text: str) -> tuple[str, dict[str, str]]:
    """A .cl file's (helpers: everything outside its kernels, {kernel name: its source})."""
    helpers: list[str] = []
    kernels: dict[str, str] = {}
    for i, part in enumerate(re.split(r"(?m)^(?=__kernel void )", text)):
        if i == 0:
            helpers.append(part)
            continue
        end = part.index("\n}\n") + 3  # a kernel ends at the first closing brace in column 0
        kernels[re.match(r"__kernel void (\w+)", part).group(1)] = part[:end]
        helpers.append(part[end:])
    return "".join(helpers), kernels


def kernel_sources() -> dict[str, str]:
    """{kernel name: the source of its program} (common.cl, its family's helpers, the kernel)."""
    global _sources
    if _sources is None:
        from importlib import resources  # here: its import is a tenth of listing the devices

        root = resources.files(__package__).joinpath(KERNEL_DIR)
        common = root.joinpath(COMMON).read_text()
        out: dict[str, str] = {}
        for f in sorted((f for f in root.iterdir() if f.name.endswith(".cl") and f.name != COMMON),
                        key=lambda f: f.name):  # fmt: skip
            helpers, kernels = _split(f.read_text())
            for name, text in kernels.items():
                if name in out:
                    raise ComputeError(f"SYCL kernels: {name} is defined twice ({KERNEL_DIR}/{f.name})")
                out[name] = common + helpers + text
        _sources = out
    return _sources


def build(queue: Any, dev: Any, label: str, name: str) -> Any:
    """The SYCL kernel ``name`` built for ``queue``'s context; ComputeError naming the device
    (``label``) and the kernel, with the compiler's log, when it does not build."""
    import dpctl.program as dpp

    sources = kernel_sources()
    if name not in sources:
        raise ComputeError(f"{label}: no kernel {name!r} in {KERNEL_DIR}/*.cl")
    src = sources[name]
    try:
        return dpp.create_program_from_source(queue, src).get_sycl_kernel(name)
    except Exception as e:
        log = opencl_build_log(dev, src) if dev.backend.name == "opencl" else ""
        raise ComputeError(
            f"{label} ({dev.name}): building OpenCL C kernel {name} failed: "
            f"{type(e).__name__}: {e}" + (f"\nbuild log:\n{log}" if log else "")
        ) from e


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
