"""cffi (API mode) build of ``accelplane_hexagon._htp``, the emulated NPU side: the C sources
under ``htp/`` compiled for the host.

setup.py names ``ffibuilder`` in ``cffi_modules``, so ``pip install [-e] plugins/hexagon``
compiles it. Without installing: ``python plugins/hexagon/accelplane_hexagon/_build.py`` (puts
the extension next to this file).

The declarations come from the cdef region of ``htp/htp-msg.h``, the header the C side
includes, so the host and the NPU side share one message format. ``-ffp-contract=off``: the
tile arithmetic must round exactly as written, the same bits the ISA tier computes on Hexagon.
"""

from __future__ import annotations

import os
import re

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("htp/main.c", "htp/matmul.c", "htp/ops.c")
HEADERS = ("htp/htp-msg.h", "htp/htp-tile.h", "htp/htp-ops.h")
CFLAGS = ["-O2", "-std=gnu11", "-ffp-contract=off", "-fno-strict-aliasing"]


def _src(name: str, absolute: bool) -> str:
    # setuptools wants paths relative to the project root (the cwd of the build)
    path = os.path.join(_HERE, name)
    if absolute:
        return path
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def cdef_text() -> str:
    with open(os.path.join(_HERE, "htp", "htp-msg.h")) as f:
        text = f.read()
    m = re.search(r"/\* cdef-begin \*/(.*)/\* cdef-end \*/", text, re.S)
    if m is None:
        raise RuntimeError("htp/htp-msg.h has no cdef-begin/cdef-end region")
    return m.group(1)


def make_builder(absolute: bool = False) -> FFI:
    ffi = FFI()
    ffi.cdef(cdef_text())
    ffi.set_source(
        "accelplane_hexagon._htp",
        '#include "htp-msg.h"',
        sources=[_src(s, absolute) for s in SOURCES],
        include_dirs=[_src("htp", absolute)],
        depends=[_src(h, absolute) for h in HEADERS],
        extra_compile_args=CFLAGS,
        libraries=["m"],
    )
    return ffi


ffibuilder = make_builder()

if __name__ == "__main__":
    from accelplane.runtime.cffibuild import build_in_place  # the SDK: this plugin's dependency

    print(build_in_place(make_builder(absolute=True), _HERE, "_htp"))
