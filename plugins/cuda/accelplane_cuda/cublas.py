"""cuBLAS's GEMM entry points called directly (ctypes) on the library CuPy loaded, with CuPy's
handle: CuPy's own wrappers refuse to run during stream capture, while cuBLAS itself is
capturable, so a plan with products is replayed as one CUDA graph (plan.py)."""

from __future__ import annotations

import ctypes
import functools

from accelplane.errors import ComputeError

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
# cublasGemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
#              computeType, algo)
_GEMM = [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _I]
# cublasGemmStridedBatchedEx: the same with strideA/B/C after lda/ldb/ldc and batchCount after strideC
_GEMM_STRIDED = [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _L, _P, _I, _I, _L, _P, _P, _I, _I, _L, _I, _I, _I]
# cublasGemmBatchedEx: cublasGemmEx with device arrays of the matrices' addresses, batchCount after ldc
_GEMM_BATCHED = [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _I, _I]


@functools.cache
def library() -> ctypes.CDLL:
    """The libcublas CuPy uses (found in the process's mappings once CuPy has loaded it)."""
    from cupy_backends.cuda.libs import cublas  # noqa: F401 - loads libcublas

    path = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            f = line.rsplit(None, 1)[-1]
            if "/libcublas.so" in f:
                path = f
                break
    lib = None
    for name in [path] if path else ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        raise ComputeError("CUDA plugin: libcublas could not be loaded")
    lib.cublasSetStream_v2.argtypes = [_P, _P]
    lib.cublasGemmEx.argtypes = _GEMM
    lib.cublasGemmStridedBatchedEx.argtypes = _GEMM_STRIDED
    lib.cublasGemmBatchedEx.argtypes = _GEMM_BATCHED
    return lib


def check(status: int, what: str) -> None:
    if status:
        raise ComputeError(f"CUDA plugin: {what} failed: cuBLAS status {status}")
