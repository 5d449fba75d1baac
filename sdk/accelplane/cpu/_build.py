"""cffi (API mode) build of ``accelplane.cpu._kernels``.

setup.py names ``ffibuilder`` in ``cffi_modules``, so ``pip install .`` / ``pip install -e .``
compile it. For a source-tree build without installing: ``python sdk/accelplane/cpu/_build.py``
(puts the extension next to this file).

No -march flags: the AVX2/FMA/F16C code is compiled per function with
``__attribute__((target))`` and picked at run time, so one build runs on any x86-64 CPU.
"""

from __future__ import annotations

import os
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


CDEF = """
int ap_cpu_has_avx2(void);
int ap_set_isa(int isa);
int ap_get_isa(void);
int ap_max_threads(void);
int ap_mul_mat(int type, const void *w, int64_t w_stride, int64_t w_size, int64_t M, int64_t K,
               const float *x, int64_t x_stride, int64_t x_size, int64_t N, float *y,
               int64_t y_stride, int64_t y_size, int nthreads);
int ap_dequantize(int type, const void *w, int64_t w_stride, int64_t w_size, int64_t M,
                  int64_t K, const int64_t *rows, int64_t R, float *y, int64_t y_stride,
                  int64_t y_size, int nthreads);
int ap_norm_rows(int op, int64_t nrows, int64_t n, const float *x, int64_t xs, int64_t x_size,
                 float *y, int64_t ys, int64_t y_size, const float *w, int64_t wrows, int64_t ws,
                 int64_t w_size, float eps);
int ap_soft_max_rows(int64_t nrows, int64_t n, const float *x, int64_t xs, int64_t x_size, float *y,
                     int64_t ys, int64_t y_size, const float *mask, int64_t mrows, int64_t ms,
                     int64_t m_size, float scale);
int ap_swiglu_rows(int64_t nrows, int64_t n, const float *x, int64_t xs, int64_t x_size,
                   const float *g, int64_t gs, int64_t g_size, float *y, int64_t ys, int64_t y_size);
int ap_rope_rows(int64_t ntok, int64_t nhead, int64_t hd, int64_t n_dims, int neox, const float *x,
                 int64_t xs_tok, int64_t xs_head, int64_t x_size, float *y, int64_t ys_tok,
                 int64_t ys_head, int64_t y_size, const float *cs, const float *sn, int64_t cs_size);
"""

_openmp = [] if sys.platform == "darwin" else ["-fopenmp"]  # Apple clang has no -fopenmp


def make_builder(absolute: bool = False) -> FFI:
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        "accelplane.cpu._kernels",
        '#include "_kernels.h"',
        sources=[_src("_kernels.c", absolute), _src("_rowops.c", absolute)],
        include_dirs=[_src(".", absolute)],
        depends=[_src("_kernels.h", absolute)],
        extra_compile_args=["-O3", "-std=gnu11", *_openmp],
        extra_link_args=_openmp,
        libraries=[] if sys.platform == "win32" else ["m"],
    )
    return ffi


ffibuilder = make_builder()

if __name__ == "__main__":
    # compile into sdk/ so the module lands at sdk/accelplane/cpu/_kernels.*.so
    import importlib.machinery
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        # compile() chdirs into tmp, so sources must be absolute here
        out = make_builder(absolute=True).compile(tmpdir=tmp, verbose=True)
        # cffi's C already targets the limited API, so take the name pip's build gives it
        # (_kernels.abi3.so): a second build under another suffix would shadow or be shadowed
        name = os.path.basename(out)
        if ".abi3.so" in importlib.machinery.EXTENSION_SUFFIXES and name.endswith(".so"):
            name = "_kernels.abi3.so"
        for old in os.listdir(_HERE):  # drop builds under other suffixes
            if old.startswith("_kernels.") and old.endswith((".so", ".pyd")):
                os.remove(os.path.join(_HERE, old))
        dest = os.path.join(_HERE, name)
        os.replace(out, dest)
        print(dest)
