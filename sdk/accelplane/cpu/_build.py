"""cffi (API mode) build of ``accelplane.cpu._kernels``.

setup.py names ``ffibuilder`` in ``cffi_modules``, so ``pip install .`` / ``pip install -e .``
compile it. For a source-tree build without installing: ``python sdk/accelplane/cpu/_build.py``
(puts the extension next to this file).

No -march flags: the AVX2/FMA/F16C code is compiled per function with
``__attribute__((target))`` and picked at run time, so one build runs on any x86-64 CPU.
"""

from __future__ import annotations

import os
import re
import sys

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))


def _src(name: str, absolute: bool = False) -> str:
    # setuptools wants sources relative to the project root (the cwd of the build)
    path = os.path.join(_HERE, name)
    if absolute:
        return path
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith("..") else rel


def header_cdef(path: str) -> str:
    """The function declarations of _kernels.h (comments and preprocessor lines dropped), as
    cffi's cdef takes them: one source of truth for the C interface."""
    with open(path) as f:
        text = re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)
    return "\n".join(ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#"))


CDEF = header_cdef(os.path.join(_HERE, "_kernels.h"))

_openmp = [] if sys.platform == "darwin" else ["-fopenmp"]  # Apple clang has no -fopenmp


def make_builder(absolute: bool = False) -> FFI:
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        "accelplane.cpu._kernels",
        '#include "_kernels.h"',
        sources=[_src("_kernels.c", absolute), _src("_rowops.c", absolute)],
        include_dirs=[_src(".", absolute)],
        depends=[_src("_kernels.h", absolute), _src("_kernels_q32.h", absolute)],
        # -fno-trapping-math: no FP traps are enabled, so the compiler may if-convert float
        # comparisons (clamps, selects) and vectorize those loops; results stay IEEE's
        extra_compile_args=["-O3", "-std=gnu11", "-fno-trapping-math", *_openmp],
        extra_link_args=_openmp,
        libraries=[] if sys.platform == "win32" else ["m"],
    )
    return ffi


ffibuilder = make_builder()

if __name__ == "__main__":  # the extension lands at sdk/accelplane/cpu/_kernels.*.so
    sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))  # sdk/: run from a source tree
    from accelplane.runtime.cffibuild import build_in_place

    print(build_in_place(make_builder(absolute=True), _HERE, "_kernels", verbose=True))
