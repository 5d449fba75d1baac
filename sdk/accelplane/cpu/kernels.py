"""Python boundary of the CPU plugin's native kernels (``accelplane.cpu._kernels``).

Everything the C code is given is validated here first (dtypes, shapes, strides, extents), so a
bad call raises a typed :mod:`accelplane.errors` exception instead of crashing; the C side checks
extents again as a backstop.

``mul_mat`` picks the strategy per call:

* small N (activation rows): the direct kernel, which streams W once and dots each row against
  all N activation rows (int8 activation dot products on AVX2, like ggml; with vpdpbusd where
  the CPU has AVX-VNNI or AVX512-VNNI);
* large N: dequantize W in row tiles to float32 and multiply with numpy/BLAS sgemm, which is
  compute-efficient once the dequantization is amortized over enough rows of x (never for
  weights in the x8 layout on the AVX2 levels: their direct kernel is faster at every N).

The crossover N per type was measured with ``scripts/bench_cpu_kernels.py``.

Code paths, in order: ``portable`` (C), ``avx2`` (AVX2+FMA+F16C), ``avx2-vnni`` (the AVX2 code,
its int8 dot products of the 32-element block types with vpdpbusd on ymm registers, AVX-VNNI's or
AVX512-VNNI+VL's) and ``avx512`` (the avx2-vnni code, and zmm kernels where they are faster: the
Q4_0 mat-vec in ggml's layout; AVX-512 F, BW, VL, VNNI and VBMI); the best the CPU has is the
default. Environment: ``ACCELPLANE_CPU_ISA`` (``auto``, ``avx512``, ``avx2-vnni``, ``avx2``,
``portable``) picks
one (``set_isa`` changes it at run time); ``ACCELPLANE_NTHREADS`` sets the default thread count
(else the CPUs the process may run on: :func:`accelplane.cpu.host.usable_cpus`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Final, Literal

import numpy as np

from accelplane import env
from accelplane.core.types import GGMLType, parse_type
from accelplane.cpu.host import usable_cpus
from accelplane.errors import ComputeError, ConfigError, OutOfRangeError, ShapeError, TypeMismatchError

_CPU_COUNT: Final = usable_cpus()  # cached: the mask is read once, at import

# OpenMP threads that spin while waiting starve everything else on a busy or oversubscribed
# machine (measured: 13x slower decode at load 4.5 on 2 cores); sleep instead, unless the user
# chose otherwise. Must be set before the OpenMP runtime starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ...but spin first, so back-to-back kernel calls and in-region barriers find the other threads
# awake: a futex wake of a sleeping vCPU costs tens of us. On 2 cores a short spin (~0.1 ms):
# 4096x4096 Q4_0 mat-vecs in a loop, load ~1.4, median per call: passive 600-690 us, passive +
# 10000 spins 500-530 us, fully active 530-550 us. With more cores, ~10 ms, longer than a device's
# share of a layer between two host expert products (qwen3moe, experts in host memory, 16 cores
# beside an H200, tg64 tokens/s at 1e4 / 1e5 / 1e6 / 1e7 spins: 52.7 / 55.3 / 54-60 / 65.7).
_SPIN = env.CPU_SPIN.get()
if _SPIN is not None:
    os.environ["GOMP_SPINCOUNT"] = str(_SPIN)
else:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000" if _CPU_COUNT <= 4 else "1000000")

try:
    from accelplane.cpu._kernels import ffi as _ffi
    from accelplane.cpu._kernels import lib as _lib
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "accelplane.cpu._kernels (the CPU plugin's compiled kernels) is not built: install the "
        "package (pip install -e .) or run: python sdk/accelplane/cpu/_build.py"
    ) from exc

__all__ = [
    "SUPPORTED_TYPES",
    "default_threads",
    "dequantize",
    "gelu_erf",
    "get_isa",
    "has_avx2",
    "has_avx2_vnni",
    "has_avx512",
    "mul_mat",
    "mul_mat_id",
    "prepare_attention",
    "prepare_moe_topk",
    "prepare_mul_mat_id",
    "prepare_mul_mat_id_ids",
    "prepare_set_rows",
    "blas_wins",
    "set_isa",
    "X8_TYPES",
    "x8_convert",
]

T = GGMLType
# (elements per block, bytes per block) of the types the kernels handle
_BLOCK: Final[dict[GGMLType, tuple[int, int]]] = {
    t: (t.blck_size, t.type_size)
    for t in (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K,
              T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS)
}
SUPPORTED_TYPES: Final[tuple[GGMLType, ...]] = tuple(_BLOCK)

# N at and above which mul_mat dequantizes tiles of W and uses BLAS sgemm instead of the direct
# kernel. Measured at M=4096, K=14336, 2 threads (scripts/bench_cpu_kernels.py --sweep), GFLOPS
# direct/BLAS: F32 48/40 at N=8, 54/60 at 16; F16 65/62 at 32, 77/92 at 48; Q8_0 106/104 at
# 128, 113/130 at 192; Q4_0 122/113 at 128, 137/149 at 192; Q4_K and Q6_K about even at 256-512.
_CROSSOVER_N: Final[dict[GGMLType, int]] = {
    GGMLType.F32: 12,
    GGMLType.F16: 40,
    GGMLType.BF16: 40,
    GGMLType.Q4_0: 160,
    GGMLType.Q4_1: 160,
    GGMLType.Q5_0: 160,
    GGMLType.Q5_1: 160,
    GGMLType.Q8_0: 128,
    GGMLType.Q2_K: 256,
    GGMLType.Q3_K: 256,
    GGMLType.Q4_K: 256,
    GGMLType.Q5_K: 256,
    GGMLType.Q6_K: 256,
    GGMLType.IQ4_NL: 160,
    GGMLType.IQ4_XS: 256,
}
# the portable C kernel has no SIMD FMA or int8 dot: dequantize + BLAS wins from N = 2 on
_PORTABLE_CROSSOVER_N: Final = 2
# bytes of the float32 tile of W dequantized per sgemm call. Larger tiles mean fewer sgemm
# calls, each of which re-packs x: one thread, M=2048 K=14336 N=256 Q4_0 ran at 47/62/69/71/75
# GFLOPS with 2/4/16/32/64 MiB tiles; fewer calls also suffer less when BLAS threads get
# descheduled on a busy machine. 32 MiB bounds the temporary.
_TILE_BYTES = 32 << 20

# the types with an x8 layout (_kernels.c: 8 weight rows interleaved per block), and the flag
# that says so on the kernels' type argument (AP_LAYOUT_X8)
X8_TYPES: Final = frozenset(t for t in (T.Q4_0, T.Q8_0) if _lib.ap_x8_supported(int(t)))
_LAYOUT_X8: Final = 0x100


def _x8_names() -> str:
    return ", ".join(sorted(t.name for t in X8_TYPES))

Layout = Literal["ggml", "x8"]

_ISA_NAMES: Final = {0: "portable", 1: "avx2", 2: "avx2-vnni", 3: "avx512"}  # AP_ISA_* of _kernels.h
_ISA_CODES: Final = {"": 3, "auto": 3, **{name: code for code, name in _ISA_NAMES.items()}}
_ERRORS: Final = {
    -1: (ShapeError, "invalid size or stride"),
    -2: (TypeMismatchError, "type not handled by the CPU kernels"),
    -3: (MemoryError, "could not allocate the kernel workspace"),
    -4: (OutOfRangeError, "a buffer is smaller than its sizes and strides need"),
}
_RANGE: Final = -4  # AP_ERANGE: also a row index outside its matrix


# --- configuration -------------------------------------------------------------------------


def has_avx2() -> bool:
    """True when this CPU runs the AVX2+FMA+F16C path."""
    return bool(_lib.ap_cpu_has_avx2())


def has_avx2_vnni() -> bool:
    """True when this CPU (and this build) runs the ``"avx2-vnni"`` path: AVX2+FMA+F16C and AVX-VNNI
    or AVX512-VNNI+VL."""
    return bool(_lib.ap_cpu_has_avx2_vnni())


def has_avx512() -> bool:
    """True when this CPU (and this build) runs the ``"avx512"`` path: the ``"avx2-vnni"`` path and
    AVX-512 F, BW, VL, VNNI and VBMI (Ice Lake, Sapphire Rapids, Zen 4 and later)."""
    return bool(_lib.ap_cpu_has_avx512())


def set_isa(isa: str) -> str:
    """Select the code path: ``"auto"`` (the best available), ``"avx512"``, ``"avx2-vnni"``,
    ``"avx2"`` or ``"portable"``.

    A path the CPU lacks falls back to the best one below it (``"avx512"`` to ``"avx2-vnni"``, that
    to ``"avx2"``, that to ``"portable"``). Returns the path now in use. Raises ConfigError for any
    other name.
    """
    code = _ISA_CODES.get(isa.strip().lower())
    if code is None:
        expected = ", ".join(repr(n) for n in ("auto", "avx512", "avx2-vnni", "avx2", "portable"))
        raise ConfigError(f"unknown CPU kernel ISA {isa!r}; expected one of {expected}")
    return _ISA_NAMES[_lib.ap_set_isa(code)]


def get_isa() -> str:
    """The code path in use: ``"avx512"``, ``"avx2-vnni"``, ``"avx2"`` or ``"portable"``."""
    return _ISA_NAMES[_lib.ap_get_isa()]


def default_threads() -> int:
    """Threads used when a call passes none: ``ACCELPLANE_NTHREADS``, else the CPUs the
    process may run on (:func:`accelplane.cpu.host.usable_cpus`)."""
    return env.NTHREADS.get() or _CPU_COUNT


set_isa(env.CPU_ISA.get())


# --- validation helpers --------------------------------------------------------------------


_TYPE_CACHE: dict[object, GGMLType] = {}


def _wtype(wtype: GGMLType | str | int) -> GGMLType:
    t = _TYPE_CACHE.get(wtype)  # per-call overhead matters for small mat-vecs
    if t is not None:
        return t
    t = parse_type(wtype)
    if t not in _BLOCK:
        raise TypeMismatchError(
            f"the CPU kernels do not handle weight type {t.name}; "
            f"supported: {', '.join(x.name for x in SUPPORTED_TYPES)}"
        )
    _TYPE_CACHE[wtype] = t
    return t


def _extent(a: np.ndarray) -> int:
    """Bytes from a 2-D array's first element to one past its last (strides validated >= 0)."""
    (n0, n1), (s0, s1) = a.shape, a.strides
    if n0 == 0 or n1 == 0:
        return 0
    return (n0 - 1) * s0 + (n1 - 1) * s1 + a.itemsize


def _ptr(a: np.ndarray, ctype: str, writable: bool = False) -> object:
    """cffi pointer to a's first element (from_buffer: ~10x cheaper than a.ctypes.data).

    A strided view has no flat buffer, but its first element alone does: a[:1, :1]."""
    if not a.flags.c_contiguous:
        a = a[:1, :1]
    return _ffi.from_buffer(ctype, a, require_writable=writable)


def _float_dtype_ok(t: GGMLType, dt: np.dtype) -> bool:
    if t == GGMLType.F32:
        return dt == np.float32
    if t == GGMLType.F16:
        return dt == np.float16
    if t == GGMLType.BF16:
        return dt == np.uint16 or (dt.itemsize == 2 and dt.name == "bfloat16")
    return False


class _Rows:
    """A validated weight matrix: M rows of K elements of type t, row r at base + r * stride."""

    __slots__ = ("arr", "k", "m", "ptr", "size", "stride", "t", "x8")

    def __init__(self, t: GGMLType, w: object, k: int | None, what: str, layout: Layout = "ggml") -> None:
        if not isinstance(w, np.ndarray):
            raise TypeMismatchError(f"{what} must be a numpy array, got {type(w).__name__}")
        if w.ndim != 2:
            raise ShapeError(f"{what} must be 2-D [rows, ...], got shape {w.shape}")
        blk, bsz = _BLOCK[t]
        m, inner = w.shape
        if w.dtype == np.uint8:
            # raw rows of t, e.g. a view into a backend buffer
            if inner % bsz:
                raise ShapeError(
                    f"{what} rows are {inner} bytes, not a whole number of {t.name} blocks "
                    f"({bsz} bytes per {blk} elements)"
                )
            row_k = inner // bsz * blk
        elif t.is_float and _float_dtype_ok(t, w.dtype):
            row_k = inner
        else:
            want = "uint8 (raw rows)"
            if t.is_float:
                want += f" or {t.name} elements"
            msg = f"{what} of type {t.name} must have dtype {want}, got {w.dtype}"
            raise TypeMismatchError(msg)
        if k is not None and row_k != k:
            msg = f"{what} rows hold {row_k} elements of {t.name}, the other operand {k}"
            raise ShapeError(msg)
        m_stride, e_stride = w.strides
        if (m > 1 and m_stride < 0) or (inner > 1 and e_stride != w.itemsize):
            msg = f"{what} must have contiguous rows, row stride >= 0; got strides {w.strides}"
            raise ShapeError(msg)
        if layout not in ("ggml", "x8"):
            raise ConfigError(f"layout must be 'ggml' or 'x8', got {layout!r}")
        self.x8 = layout == "x8"
        if self.x8 and t not in X8_TYPES:
            raise TypeMismatchError(f"{what}: {t.name} has no x8 layout (only {_x8_names()})")
        if self.x8 and m > 1 and m_stride != inner:
            raise ShapeError(f"{what}: x8 rows must be contiguous (row stride {m_stride}, row {inner} bytes)")
        self.t, self.arr, self.m, self.k = t, w, m, row_k
        self.stride = m_stride if m > 1 else 0
        self.size = _extent(w)
        self.ptr = _ptr(w, "uint8_t[]") if self.size else _ffi.NULL

    @property
    def code(self) -> int:
        """The kernels' type argument: the type id, with AP_LAYOUT_X8 for x8 rows."""
        return int(self.t) | (_LAYOUT_X8 if self.x8 else 0)


def _as_x(x: object, what: str = "x") -> np.ndarray:
    """float32 2-D x with a contiguous, aligned inner axis (copied only when it is not)."""
    if not isinstance(x, np.ndarray):
        raise TypeMismatchError(f"{what} must be a numpy array, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise TypeMismatchError(f"{what} must be float32, got {x.dtype}")
    if x.ndim != 2:
        raise ShapeError(f"{what} must be 2-D [N, K], got shape {x.shape}")
    flags = x.flags
    if flags.c_contiguous and flags.aligned:
        return x
    (n, k), (s0, s1) = x.shape, x.strides
    if not flags.aligned or (k > 1 and s1 != 4) or (n > 1 and (s0 < 0 or s0 % 4)):
        x = np.ascontiguousarray(x)
    return x


def _check_out(out: object, shape: tuple[int, int]) -> np.ndarray:
    if not isinstance(out, np.ndarray):
        raise TypeMismatchError(f"out must be a numpy array, got {type(out).__name__}")
    if out.dtype != np.float32:
        raise TypeMismatchError(f"out must be float32, got {out.dtype}")
    if out.shape != shape:
        raise ShapeError(f"out must have shape {shape}, got {out.shape}")
    if not out.flags.writeable:
        raise ShapeError("out is read-only")
    return out


def _direct_out(out: np.ndarray, a: np.ndarray, b: np.ndarray | None = None) -> bool:
    """Can the C kernel write out in place (layout it handles, no overlap with an input)?"""
    (n, m), (s0, s1) = out.shape, out.strides
    if not out.flags.aligned or (m > 1 and s1 != 4) or (n > 1 and (s0 < m * 4 or s0 % 4)):
        return False
    return not (np.may_share_memory(out, a) or (b is not None and np.may_share_memory(out, b)))


def _row_stride(a: np.ndarray) -> int:
    """Row stride in elements (0 for a single row, whose stride is meaningless)."""
    return a.strides[0] // a.itemsize if a.shape[0] > 1 else 0


def _raise(rc: int, what: str) -> None:
    cls, msg = _ERRORS.get(rc, (ComputeError, f"kernel error {rc}"))
    raise cls(f"{what}: {msg}")


def _threads(nthreads: int | None) -> int:
    if nthreads is None:
        return default_threads()
    if int(nthreads) < 1:
        raise OutOfRangeError(f"nthreads must be >= 1, got {nthreads}")
    return int(nthreads)


# --- kernels -------------------------------------------------------------------------------


def mul_mat(
    wtype: GGMLType | str | int,
    w: np.ndarray,
    x: np.ndarray,
    out: np.ndarray,
    nthreads: int | None = None,
    strategy: Literal["auto", "direct", "blas"] = "auto",
    layout: Layout = "ggml",
) -> np.ndarray:
    """out[n, m] = sum_k dequant(w[m, k]) * x[n, k] (ggml's MUL_MAT of one 2-D slice).

    ``w``: [M, row_bytes] uint8 rows of ``wtype`` (row stride may exceed the row size), or for
    float types a [M, K] array of that dtype (float32 / float16 / bfloat16 or uint16 bits).
    ``x``: float32 [N, K]. ``out``: float32 [N, M], may be a strided view. Returns ``out``.
    ``strategy`` forces the direct kernel or dequantize + BLAS (for tests and benchmarks).
    ``layout="x8"``: w's bytes are in the x8 layout (:func:`x8_convert`; Q4_0 and Q8_0).
    """
    t = _wtype(wtype)
    x = _as_x(x)
    n, k = x.shape
    rows = _Rows(t, w, k, "w", layout)
    m = rows.m
    out = _check_out(out, (n, m))
    if n == 0 or m == 0:
        return out
    if k == 0:  # empty sums
        out[...] = 0.0
        return out
    nt = _threads(nthreads)
    if strategy not in ("auto", "direct", "blas"):
        raise ValueError(f"unknown strategy {strategy!r}")
    if strategy == "auto":
        strategy = "blas" if blas_wins(t, n, layout) else "direct"
    if strategy == "blas":
        # BLAS needs a unit inner stride in out; numpy's fallback loop would be ~100x slower
        y = out if out.strides[1] == 4 or m == 1 else np.empty((n, m), np.float32)
        _mul_mat_blas(rows, x, y, nt)
        if y is not out:
            out[...] = y
        return out
    y = out if _direct_out(out, x, rows.arr) else np.empty((n, m), np.float32)
    rc = _lib.ap_mul_mat(*_direct_args(t, rows, x, y, nt))
    if rc:
        _raise(rc, f"mul_mat {t.name} [{m}x{k}] x [{n}x{k}]")
    if y is not out:
        out[...] = y
    return out


def mul_mat_id(
    wtype: GGMLType | str | int,
    w: np.ndarray,
    x: np.ndarray,
    out: np.ndarray,
    experts: np.ndarray,
    starts: np.ndarray,
    nthreads: int | None = None,
    layout: Layout = "ggml",
) -> np.ndarray:
    """Grouped products, MUL_MAT_ID's work in one call: out[n] = dequant(w[e]) @ x[n] for the
    rows n in [starts[g], starts[g + 1]) with e = experts[g] (the direct kernel, activation rows
    quantized once, the (group, row chunk) items shared among the threads).

    ``w``: [E, M, row_bytes] uint8 (or [E, M, K] of a float type's dtype), each expert's rows
    evenly spaced. ``x``: float32 [N, K]. ``out``: float32 [N, M]. ``experts``: [G] expert ids in
    [0, E); ``starts``: [G + 1] non-decreasing row offsets from 0 to N. Returns ``out``.
    """
    prepare_mul_mat_id(wtype, w, _as_x(x), out, experts, starts, nthreads, layout)()
    return out


def prepare_mul_mat_id(
    wtype: GGMLType | str | int,
    w: np.ndarray,
    x: np.ndarray,
    out: np.ndarray,
    experts: np.ndarray,
    starts: np.ndarray,
    nthreads: int | None = None,
    layout: Layout = "ggml",
) -> Callable[[], None]:
    """:func:`mul_mat_id` as a call to repeat on the same memory (a plan's step; grouped-query
    attention's heads are its groups): operands validated and C arguments built once; x, out,
    experts and starts are read at every call. x must be float32 [N, K] with evenly spaced rows
    of unit stride (:func:`mul_mat_id` converts any other x)."""
    t = _wtype(wtype)
    if not isinstance(w, np.ndarray) or w.ndim != 3:
        got = getattr(w, "shape", type(w).__name__)
        raise ShapeError(f"w must be a 3-D numpy array [experts, rows, ...], got {got}")
    if _as_x(x) is not x:
        raise ShapeError(f"x must be float32 [N, K] with evenly spaced unit-stride rows, strides {x.strides}")
    n, k = x.shape
    if w.shape[0] == 0:
        raise ShapeError("w has no experts")
    rows = _Rows(t, w[0], k, "w[0]", layout)
    m = rows.m
    out = _check_out(out, (n, m))
    ex = np.ascontiguousarray(experts, dtype=np.int32)
    st = np.ascontiguousarray(starts, dtype=np.int64)
    if ex.ndim != 1 or st.shape != (ex.size + 1,):
        raise ShapeError(f"experts [G] and starts [G + 1] expected, got shapes {ex.shape} and {st.shape}")
    if w.strides[0] < 0:
        raise ShapeError(f"w's expert stride must be >= 0, got {w.strides[0]}")
    e_stride = w.strides[0] if w.shape[0] > 1 else 0
    size = (w.shape[0] - 1) * e_stride + rows.size
    nt = _threads(nthreads)
    if n == 0 or m == 0:
        return lambda: None
    direct = _direct_out(out, x, w)
    y = out if direct else np.empty((n, m), np.float32)
    base = w if w.flags.c_contiguous else w[:1, :1, :1]
    args = (rows.code, _ffi.from_buffer("uint8_t[]", base), e_stride, rows.stride, size, w.shape[0], m, k,
            _ptr(x, "float[]"), _row_stride(x), _extent(x) // 4, n, _ptr(y, "float[]", True), _row_stride(y),
            _extent(y) // 4, _ffi.from_buffer("int32_t[]", ex), _ffi.from_buffer("int64_t[]", st), ex.size,
            nt)  # fmt: skip
    fn = _lib.ap_mul_mat_id

    def call() -> None:
        rc = fn(*args)
        if rc:
            _raise(rc, f"mul_mat_id {t.name} [{w.shape[0]}x{m}x{k}] x [{n}x{k}]")
        if not direct:
            out[...] = y

    return call


def _elem_strides(a: np.ndarray, what: str) -> tuple[int, ...]:
    """a's strides in elements, every one >= 0 and the last axis unit (or of one element)."""
    st = a.strides
    if any(s < 0 or s % a.itemsize for s in st) or (a.shape[-1] > 1 and st[-1] != a.itemsize):
        raise ShapeError(f"{what} needs non-negative strides and a contiguous last axis, got strides {st}")
    return tuple(s // a.itemsize for s in st)


def prepare_mul_mat_id_ids(
    wtype: GGMLType | str | int, w: np.ndarray, x: np.ndarray, ids: np.ndarray, out: np.ndarray,
    nthreads: int | None = None, layout: Layout = "ggml",
) -> Callable[[], None]:
    """MUL_MAT_ID as ggml states it, as a call to repeat on the same memory (a plan's step): for
    token t and slot u, ``out[t, u] = dequant(w[ids[t, u]]) @ x[t, u % S]``, the rows grouped by
    expert in C, ids read at every call (an id out of range raises OutOfRangeError).

    ``w``: [E, M, row_bytes] uint8 (or [E, M, K] of a float type's dtype). ``x``: float32
    [T, S, K] (S = 1: one row for every slot). ``ids``: int32 [T, U]. ``out``: float32 [T, U, M],
    not overlapping the others. Operands are validated and the C arguments built once."""
    t = _wtype(wtype)
    nt = _threads(nthreads)
    for a, name, dt, nd in ((w, "w", None, 3), (x, "x", np.float32, 3), (ids, "ids", np.int32, 2),
                            (out, "out", np.float32, 3)):  # fmt: skip
        if not isinstance(a, np.ndarray):
            raise TypeMismatchError(f"{name} must be a numpy array, got {type(a).__name__}")
        if dt is not None and a.dtype != dt:
            raise TypeMismatchError(f"{name} must be {dt.__name__}, got {a.dtype}")
        if a.ndim != nd:
            raise ShapeError(f"{name} must be {nd}-D, got shape {a.shape}")
    n_exp = w.shape[0]
    n_tok, n_sl, k = x.shape
    rows = _Rows(t, w[0], k, "w[0]", layout) if n_exp else None
    if rows is None:
        raise ShapeError("w has no experts")
    m = rows.m
    if ids.shape[0] != n_tok or out.shape != (n_tok, ids.shape[1], m) or n_sl < 1:
        raise ShapeError(f"x {x.shape}, ids {ids.shape} and out {out.shape} disagree with w [{n_exp}, {m}]")
    if not out.flags.writeable or any(np.may_share_memory(out, a) for a in (w, x, ids)):
        raise ShapeError("out must be writable and not overlap w, x or ids")
    if w.strides[0] < 0:
        raise ShapeError(f"w's expert stride must be >= 0, got {w.strides[0]}")
    xs, (is_, _), ys = _elem_strides(x, "x"), _elem_strides(ids, "ids"), _elem_strides(out, "out")
    e_stride = w.strides[0] if n_exp > 1 else 0
    size = (n_exp - 1) * e_stride + rows.size
    n_used = ids.shape[1]

    def span(a: np.ndarray) -> int:  # elements from a's first to one past its last
        return _span_bytes(a) // a.itemsize

    args = (rows.code, _first(w, "uint8_t[]"), e_stride, rows.stride, size, n_exp, m, k,
            _first(x, "float[]"), xs[0], xs[1], n_sl, span(x), _first(ids, "int32_t[]"), is_, span(ids),
            n_tok, n_used, _first(out, "float[]", True), ys[0], ys[1], span(out), nt)  # fmt: skip
    fn = _lib.ap_mul_mat_id_ids

    def call() -> None:
        rc = fn(*args)
        if rc:
            _raise(rc, f"mul_mat_id {t.name} [{n_exp}x{m}x{k}], ids [{n_tok}x{n_used}]")

    return call


def blas_wins(t: GGMLType, n: int, layout: Layout = "ggml") -> bool:
    """Whether dequantize + sgemm beats the direct kernel for N activation rows. Never for x8
    rows on the AVX2 levels: 2 Zen 4 threads, Q4_0 / Q8_0 at N=512 (M, K of 2048 and 5632), ran
    the x8 kernel at 324-340 / 235-295 GFLOPS with vpdpbusd and 138-177 / 122-194 without,
    dequantize + sgemm at 149-169 / 119-162."""
    if _lib.ap_get_isa() < 1:
        return n >= _PORTABLE_CROSSOVER_N
    return layout != "x8" and n >= _CROSSOVER_N[t]


def _direct_args(t: GGMLType, rows: _Rows, x: np.ndarray, y: np.ndarray, nt: int) -> tuple:
    """ap_mul_mat's arguments (pointers, strides and extents) for validated operands."""
    n, k = x.shape
    return (rows.code, rows.ptr, rows.stride, rows.size, rows.m, k,
            _ptr(x, "float[]"), _row_stride(x), _extent(x) // 4, n,
            _ptr(y, "float[]", True), _row_stride(y), _extent(y) // 4, nt)  # fmt: skip


def prepare_mul_mat(
    wtype: GGMLType | str | int, w: np.ndarray, x: np.ndarray, out: np.ndarray, nthreads: int | None = None,
    layout: Layout = "ggml",
) -> Callable[[], None]:
    """``mul_mat(wtype, w, x, out)`` as a call to repeat on the same memory (a plan's step):
    the operands are validated, the strategy picked and the C arguments (pointers and byte
    extents, which the kernel still bounds-checks) built once, so a decode step's hundreds of
    small products pay one C call each, not the Python checks. Where x is not float32 with
    contiguous rows, out cannot be written in place, or N takes the BLAS path, every call is
    a plain :func:`mul_mat` (x converted each time: it may change between calls)."""
    t = _wtype(wtype)
    nt = _threads(nthreads)

    def plain() -> None:
        xx = x if x.dtype == np.float32 else x.astype(np.float32)
        mul_mat(t, w, xx, out, nt, layout=layout)

    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or _as_x(x) is not x:
        return plain
    n, k = x.shape
    rows = _Rows(t, w, k, "w", layout)
    m = rows.m
    out = _check_out(out, (n, m))
    if n == 0 or m == 0 or k == 0 or blas_wins(t, n, layout) or not _direct_out(out, x, rows.arr):
        return plain
    args = _direct_args(t, rows, x, out, nt)
    fn = _lib.ap_mul_mat

    def call() -> None:
        rc = fn(*args)
        if rc:
            _raise(rc, f"mul_mat {t.name} [{m}x{k}] x [{n}x{k}]")

    return call


# --- row kernels (the decode path's small ops) ------------------------------------------------


def rows_view(a: np.ndarray) -> np.ndarray | None:
    """``a``'s float32 elements as a 2-D [rows, last axis] view (no copy), or None when its rows
    are not evenly spaced with a unit inner stride (the row kernels' layout)."""
    if a.dtype != np.float32 or a.ndim == 0 or not a.flags.aligned or a.size == 0:
        return None
    n = a.shape[-1]
    if n > 1 and a.strides[-1] != 4:
        return None
    r = a.reshape(-1, n)
    if not np.may_share_memory(r, a) or (r.shape[0] > 1 and (r.strides[0] < 0 or r.strides[0] % 4)):
        return None  # reshape had to copy: the rows are not evenly spaced
    return r


def _rowarg(a: np.ndarray | None, writable: bool = False) -> tuple:
    """A 2-D float32 rows view as the row kernels take it: (pointer, row stride, extent), in
    elements; (NULL, 0, 0) for None."""
    if a is None:
        return _ffi.NULL, 0, 0
    return _ptr(a, "float[]", writable), a.strides[0] // 4 if a.shape[0] > 1 else 0, _extent(a) // 4


def prepare_norm(
    op: int, x: np.ndarray, y: np.ndarray, eps: float, w: np.ndarray | None = None
) -> Callable[[], None] | None:
    """y = norm(x) (op 0 NORM, 1 RMS_NORM, 2 L2_NORM) per row, times w's row (one row for all,
    or one per row) when given; None where a layout is not the row kernels' (rows_view)."""
    xr, yr = rows_view(x), rows_view(y)
    wr = rows_view(w) if w is not None else None
    if xr is None or yr is None or xr.shape != yr.shape or (w is not None and wr is None):
        return None
    if wr is not None and (wr.shape[1] != xr.shape[1] or wr.shape[0] not in (1, xr.shape[0])):
        return None
    nrows, n = xr.shape
    wrows = wr.shape[0] if wr is not None else 1
    args = (op, nrows, n, *_rowarg(xr), *_rowarg(yr, True), *_rowarg(wr), wrows, float(eps))
    return _checked(_lib.ap_norm_rows, args, "norm rows")


def prepare_soft_max(
    x: np.ndarray, y: np.ndarray, scale: float, mask: np.ndarray | None = None
) -> Callable[[], None] | None:
    """y = softmax(x * scale + mask) per row of x [ne3, ne2, ne1, n] (float32), the mask
    [m3, m2, >= ne1, n] broadcast over ne2 and ne3 by repetition (ggml's); None where a layout is
    not the row kernels'."""
    if x.ndim != 4 or y.shape != x.shape:
        return None
    if mask is not None and (mask.ndim != 4 or mask.dtype != np.float32 or mask.size == 0):
        return None
    xr, yr = rows_view(x), rows_view(y)
    if xr is None or yr is None:
        return None
    ne3, ne2, ne1, n = x.shape
    margs: tuple = (_ffi.NULL, 0, 0, 1, 1, 1, 1, 0, 0)
    if mask is not None:
        m3, m2, mr, mn = mask.shape
        if mn != n or mr < ne1 or ne2 % m2 or ne3 % m3 or mask.strides[3] != 4 or min(mask.strides) < 0:
            return None
        if any(s % 4 for s in mask.strides):
            return None
        ms, ms2, ms3 = (mask.strides[k] // 4 for k in (2, 1, 0))
        extent = sum((d - 1) * st for d, st in zip(mask.shape, mask.strides, strict=True)) + 4
        first = mask if mask.flags.c_contiguous else mask[:1, :1, :1, :1]
        margs = (_ffi.from_buffer("float[]", first), ms, extent // 4, ne1, ne2, m2, m3, ms2, ms3)
    args = (xr.shape[0], n, *_rowarg(xr), *_rowarg(yr, True), *margs, float(scale))
    return _checked(_lib.ap_soft_max_rows, args, "soft_max rows")


def _span_bytes(a: np.ndarray) -> int:
    """Bytes from an array's first element to one past its last (strides >= 0)."""
    return sum((n - 1) * st for n, st in zip(a.shape, a.strides, strict=True)) + a.itemsize if a.size else 0


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _first(a: np.ndarray, ctype: str, writable: bool = False) -> object:
    """cffi pointer to a's first element, any layout."""
    return _ffi.from_buffer(ctype, a if a.flags.c_contiguous else a[(slice(0, 1),) * a.ndim],
                            require_writable=writable)  # fmt: skip


def prepare_attention(
    ktype: GGMLType | str | int, k: np.ndarray, vtype: GGMLType | str | int, v: np.ndarray,
    q: np.ndarray, out: np.ndarray, n_batches: int, scale: float, mask: np.ndarray | None = None,
    nthreads: int | None = None,
) -> Callable[[], None] | None:
    """``out = softmax(scale * q K^T + mask) V^T`` per batch as one kernel call to repeat on the
    same memory (attention's KQ, SOFT_MAX and KQV, the scores kept in cache), or None where a
    layout is not the kernel's.

    ``k``: [G, W, D] and ``v``: [G, DV, W] of F32/F16/BF16 elements (unit inner stride);
    ``q``: float32 [n_batches * R, D], ``out``: float32 [n_batches * R, DV], rows evenly spaced,
    batch b's R rows after batch b - 1's, batch b against matrices b // (n_batches / G);
    ``mask``: float32 [m2, >= R, W] (batch b reads plane b % m2) or None. ``out`` may be ``q``
    itself (the same rows), else overlaps no operand. Where a whole block
    of query rows is masked -inf at a slot, that slot is skipped (ggml's flash attention)."""
    kt, vt = _wtype(ktype), _wtype(vtype)
    if not (kt.is_float and vt.is_float) or k.ndim != 3 or v.ndim != 3 or q.ndim != 2 or out.ndim != 2:
        return None
    g, w, d = k.shape
    dv = v.shape[1]
    if v.shape != (g, dv, w) or g == 0 or n_batches % g or q.shape[1] != d or out.shape[1] != dv:
        return None
    if q.shape[0] != out.shape[0] or q.shape[0] % max(n_batches, 1):
        return None
    if q.dtype != np.float32 or out.dtype != np.float32:
        return None
    if not (_float_dtype_ok(kt, k.dtype) and _float_dtype_ok(vt, v.dtype)):
        return None
    if (d > 1 and k.strides[2] != k.itemsize) or (w > 1 and v.strides[2] != v.itemsize):
        return None
    if min(k.strides + v.strides) < 0:
        return None
    # out may be q itself (an allocator reuses the queries' memory once KQ has read them): each
    # block of rows reads its queries before it writes its results; any other overlap is refused
    same = out.shape == q.shape and out.strides == q.strides and _addr(out) == _addr(q)
    if _as_x(q) is not q or not (same or _direct_out(out, q)):
        return None
    if any(a is not None and np.may_share_memory(out, a) for a in (k, v, mask)):
        return None
    r = q.shape[0] // n_batches
    margs: tuple = (_ffi.NULL, 0, 0, 1, 0)
    if mask is not None:
        if mask.ndim != 3 or mask.dtype != np.float32 or mask.shape[1] < r or mask.shape[2] != w:
            return None
        if (w > 1 and mask.strides[2] != 4) or min(mask.strides) < 0 or any(st % 4 for st in mask.strides):
            return None
        m2 = mask.shape[0]
        margs = (_first(mask, "float[]"), mask.strides[1] // 4, mask.strides[0] // 4 if m2 > 1 else 0, m2,
                 _span_bytes(mask) // 4)  # fmt: skip
    args = (int(kt), _first(k, "uint8_t[]"), k.strides[0] if g > 1 else 0, k.strides[1] if w > 1 else 0,
            _span_bytes(k), int(vt), _first(v, "uint8_t[]"), v.strides[0] if g > 1 else 0,
            v.strides[1] if dv > 1 else 0, _span_bytes(v), _ptr(q, "float[]"), _row_stride(q),
            _extent(q) // 4, *margs, _ptr(out, "float[]", True), _row_stride(out), _extent(out) // 4,
            n_batches, n_batches // g, r, w, d, dv, float(scale), _threads(nthreads))  # fmt: skip
    return _checked(_lib.ap_attention, args, f"attention [{n_batches}x{r}] over {w} slots")


def prepare_moe_topk(
    p: np.ndarray, order: np.ndarray, w: np.ndarray, total: np.ndarray | None = None,
    normed: np.ndarray | None = None,
) -> Callable[[], None] | None:
    """A MoE router's choice per token as one call to repeat on the same memory: from the
    float32 probabilities p [T, E] (rows evenly spaced), ``order`` [T, E] int32 = the experts by
    descending probability (stable, NaN last: ARGSORT DESC), ``w`` [T, k] = the top k
    probabilities (GET_ROWS), and with ``total`` [T] and ``normed`` [T, k] their sum (in
    double) and ``w / total`` (SUM_ROWS, DIV). Outputs C-contiguous; total and normed may
    share p's or order's memory and normed may be w itself (the allocator's reuse: those are
    dead by then), any other overlap, a layout or a dtype not the kernel's gives None."""
    pr = rows_view(p) if p.ndim == 2 else None
    if pr is None or p.shape[1] == 0:
        return None
    t, e = p.shape
    k = w.shape[1] if w.ndim == 2 else 0
    outs = [(order, np.int32, (t, e)), (w, np.float32, (t, k))]
    if (total is None) != (normed is None):
        return None
    if total is not None:
        outs += [(total, np.float32, (t,)), (normed, np.float32, (t, k))]
    for a, dt, shape in outs:
        if a.dtype != dt or a.shape != shape or not a.flags.c_contiguous or not a.flags.writeable:
            return None
    # total and normed may lie in p's or order's memory and normed exactly in w's (the kernel's
    # second pass reads only w); any other overlap is refused
    arrays = [p] + [a for a, _, _ in outs]
    for i, a in enumerate(arrays):
        for j in range(i + 1, len(arrays)):
            b = arrays[j]
            ok = (i <= 1 and j >= 3) or ((i, j) == (2, 4) and a.ctypes.data == b.ctypes.data)
            if not ok and np.may_share_memory(a, b):
                return None
    if not 1 <= k <= e:
        return None
    args = (t, e, *_rowarg(pr), _ffi.from_buffer("int32_t[]", order, require_writable=True), order.size, k,
            _ptr(w, "float[]", True), w.size,
            _ffi.NULL if total is None else _ffi.from_buffer("float[]", total, require_writable=True),
            _ffi.NULL if normed is None else _ptr(normed, "float[]", True))  # fmt: skip
    return _checked(_lib.ap_moe_topk, args, f"moe top-{k} of {e}")


def prepare_set_rows(
    dst: np.ndarray, src: np.ndarray, idx: np.ndarray, what: str
) -> Callable[[], None] | None:
    """SET_ROWS of one slice as a call to repeat on the same memory: ``dst[idx[r]] = src[r]``
    for the float32 rows of src [R, n] into dst [n_dst, n] (float32 or float16, rounded to
    nearest even), idx [R] int32 or int64 read at every call; an index outside [0, n_dst)
    raises ComputeError naming ``what``, before anything is written. None where a layout is
    not the kernel's (rows evenly spaced, unit inner stride, dst not overlapping src)."""
    if dst.ndim != 2 or src.ndim != 2 or idx.ndim != 1 or src.dtype != np.float32:
        return None
    if dst.dtype not in (np.float32, np.float16) or idx.dtype not in (np.int32, np.int64):
        return None
    (n_dst, n), (nr, ns) = dst.shape, src.shape
    if ns != n or idx.shape[0] != nr or n == 0 or nr == 0 or n_dst == 0:
        return None
    es = dst.itemsize
    if (n > 1 and (dst.strides[1] != es or src.strides[1] != 4)) or min(dst.strides[0], src.strides[0]) < 0:
        return None
    if dst.strides[0] % es or src.strides[0] % 4 or (nr > 1 and idx.strides[0] != idx.itemsize):
        return None
    if not (dst.flags.aligned and src.flags.aligned and idx.flags.aligned) or np.may_share_memory(dst, src):
        return None
    d = dst if dst.flags.c_contiguous else dst[:1, :1]
    i = idx if idx.flags.c_contiguous else idx[:1]
    args = (int(dst.dtype == np.float16), _ffi.from_buffer("uint8_t[]", d, require_writable=True),
            dst.strides[0] // es if n_dst > 1 else 0, _extent(dst) // es, n_dst, n, _ptr(src, "float[]"),
            _row_stride(src), _extent(src) // 4, nr, _ffi.from_buffer("uint8_t[]", i),
            int(idx.dtype == np.int64), nr)  # fmt: skip
    fn = _lib.ap_set_rows

    def call() -> None:
        rc = fn(*args)
        if rc == _RANGE:
            raise ComputeError(f"SET_ROWS {what}: row index out of range 0..{n_dst - 1}")
        if rc:
            _raise(rc, f"set_rows {what}")

    return call


def prepare_swiglu(x: np.ndarray, g: np.ndarray, y: np.ndarray) -> Callable[[], None] | None:
    """y = silu(x) * g per row; None where a layout is not the row kernels'."""
    xr, gr, yr = rows_view(x), rows_view(g), rows_view(y)
    if xr is None or gr is None or yr is None or not xr.shape == gr.shape == yr.shape:
        return None
    nrows, n = xr.shape
    args = (nrows, n, *_rowarg(xr), *_rowarg(gr), *_rowarg(yr, True))
    return _checked(_lib.ap_swiglu_rows, args, "swiglu rows")


def prepare_rope(
    x: np.ndarray, y: np.ndarray, n_dims: int, neox: bool
) -> Callable[[np.ndarray, np.ndarray], None] | None:
    """A call ``f(cos, sin)`` rotating x [tokens, heads, hd] (float32, unit inner stride) into y
    by the angles' cos and sin [tokens, n_dims / 2] (float32, packed); None where a layout is
    not the kernel's."""
    if x.ndim != 3 or y.shape != x.shape or x.dtype != np.float32 or y.dtype != np.float32:
        return None
    if any(
        a.strides[2] != 4
        or a.strides[0] < 0
        or a.strides[1] < 0
        or a.strides[0] % 4
        or a.strides[1] % 4
        or not a.flags.aligned
        for a in (x, y)
    ):
        return None
    ntok, nhead, hd = x.shape

    def ext(a: np.ndarray) -> int:
        return ((a.shape[0] - 1) * a.strides[0] + (a.shape[1] - 1) * a.strides[1]) // 4 + hd

    head = (
        ntok,
        nhead,
        hd,
        n_dims,
        int(neox),
        _ptr(x[:1, :1], "float[]"),
        x.strides[0] // 4,
        x.strides[1] // 4,
        ext(x),
        _ptr(y[:1, :1], "float[]", True),
        y.strides[0] // 4,
        y.strides[1] // 4,
        ext(y),
    )
    need = ntok * (n_dims // 2)
    fn = _lib.ap_rope_rows

    def call(c: np.ndarray, s: np.ndarray) -> None:
        if c.size < need or s.size < need or not (c.flags.c_contiguous and s.flags.c_contiguous):
            raise ShapeError(f"rope: cos/sin hold {c.size}/{s.size} packed floats, {need} needed")
        rc = fn(*head, _ffi.from_buffer("float[]", c), _ffi.from_buffer("float[]", s), min(c.size, s.size))
        if rc:
            _raise(rc, "rope rows")

    return call


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """The exact GELU ``0.5*x*(1 + erf(x/sqrt(2)))`` of a float32 array (any layout), as a new
    C-contiguous float32 array of x's shape."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise TypeMismatchError(f"gelu_erf takes a float32 numpy array, got {getattr(x, 'dtype', type(x))}")
    xc = np.ascontiguousarray(x)
    y = np.empty(xc.shape, np.float32)
    if y.size:
        xf, yf = xc.reshape(-1), y.reshape(-1)
        rc = _lib.ap_gelu_erf(y.size, _ffi.from_buffer("float[]", xf), xf.size,
                              _ffi.from_buffer("float[]", yf, require_writable=True), yf.size)  # fmt: skip
        if rc:
            _raise(rc, "gelu_erf")
    return y


def _checked(fn, args: tuple, what: str) -> Callable[[], None]:
    def call() -> None:
        rc = fn(*args)
        if rc:
            _raise(rc, what)

    return call


def _mul_mat_blas(rows: _Rows, x: np.ndarray, out: np.ndarray, nt: int) -> None:
    """Large N: dequantize W in row tiles, then sgemm each tile (x @ tile.T) into out."""
    w, m, k = rows.arr, rows.m, rows.k
    if rows.t == GGMLType.F32:
        wf = w if w.dtype == np.float32 else _float32_view(w)
        if wf is not None:
            np.matmul(x, wf.T, out=out)
            return
    tile_rows = max(1, min(m, _TILE_BYTES // (4 * k)))
    if rows.x8:  # a tile of whole groups is itself an x8 matrix
        tile_rows = max(8, tile_rows // 8 * 8)
    buf = np.empty((tile_rows, k), np.float32)
    for m0 in range(0, m, tile_rows):
        m1 = min(m, m0 + tile_rows)
        tile = buf[: m1 - m0]
        _dequantize_rows(rows, None, m0, m1 - m0, tile, nt)
        np.matmul(x, tile.T, out=out[:, m0:m1])


def _float32_view(w: np.ndarray) -> np.ndarray | None:
    """uint8 rows of F32 seen as float32 without a copy, if aligned (else None: BLAS would
    copy an unaligned array anyway, so the tile path is as good)."""
    if w.ctypes.data % 4 or (w.shape[0] > 1 and w.strides[0] % 4):
        return None
    return w.view(np.float32)


def _dequantize_rows(
    rows: _Rows, idx: np.ndarray | None, m0: int, count: int, y: np.ndarray, nt: int
) -> None:
    """y[i] = dequant(row idx[i]) (or row m0 + i); y is float32 with a contiguous inner axis."""
    if idx is None:  # rows m0 .. m0 + count - 1
        ptr, size = rows.ptr + m0 * rows.stride, rows.size - m0 * rows.stride
        mrows, iptr = count, _ffi.NULL
    else:
        ptr, size, mrows = rows.ptr, rows.size, rows.m
        iptr = _ffi.from_buffer("int64_t[]", idx)
    rc = _lib.ap_dequantize(
        rows.code, ptr, rows.stride, size, mrows, rows.k, iptr, count,
        _ptr(y, "float[]", True), _row_stride(y), _extent(y) // 4, nt,
    )  # fmt: skip
    if rc:
        _raise(rc, f"dequantize {rows.t.name} rows of {rows.k}")


def dequantize(
    wtype: GGMLType | str | int,
    w: np.ndarray,
    out: np.ndarray,
    rows: np.ndarray | None = None,
    nthreads: int | None = None,
    layout: Layout = "ggml",
) -> np.ndarray:
    """Dequantize rows of ``w`` to float32 (ggml's GET_ROWS when ``rows`` is given).

    ``w`` and ``layout`` as in :func:`mul_mat`; ``out``: float32 [R, K] where R = len(rows) or M.
    ``rows``: integer row indices into ``w`` (0 <= r < M). Returns ``out``.
    """
    t = _wtype(wtype)
    wr = _Rows(t, w, None, "w", layout)
    idx: np.ndarray | None = None
    if rows is not None:
        idx = np.asarray(rows)
        if idx.ndim != 1:
            raise ShapeError(f"rows must be 1-D, got shape {idx.shape}")
        if idx.size and idx.dtype.kind not in "iu":
            raise TypeMismatchError(f"rows must be integers, got {idx.dtype}")
        idx = np.ascontiguousarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= wr.m):
            bad = idx[(idx < 0) | (idx >= wr.m)][0]
            raise OutOfRangeError(f"row index {bad} is outside w's {wr.m} rows")
    r = wr.m if idx is None else idx.size
    out = _check_out(out, (r, wr.k))
    if r == 0 or wr.k == 0:
        return out
    y = out if _direct_out(out, wr.arr) else np.empty((r, wr.k), np.float32)
    _dequantize_rows(wr, idx, 0, r, y, _threads(nthreads))
    if y is not out:
        out[...] = y
    return out


def x8_convert(wtype: GGMLType | str | int, src: np.ndarray, dst: np.ndarray, to_x8: bool) -> np.ndarray:
    """The x8 layout of a Q4_0 / Q8_0 matrix (``to_x8``), or back to ggml's. ``src``, ``dst``:
    uint8 [M, row_bytes], C-contiguous, the same shape, not overlapping. The conversion is a
    permutation of the bytes (exact for any bytes: ``x8_convert(t, x8_convert(t, a, b, True), c,
    False)`` equals ``a``). Returns ``dst``."""
    t = _wtype(wtype)
    if t not in X8_TYPES:
        raise TypeMismatchError(f"{t.name} has no x8 layout (only {_x8_names()})")
    for a, name in ((src, "src"), (dst, "dst")):
        if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 2 or not a.flags.c_contiguous:
            raise ShapeError(f"{name} must be a C-contiguous uint8 [rows, row_bytes] array")
    if src.shape != dst.shape or src.shape[1] % t.type_size:
        raise ShapeError(f"src {src.shape}, dst {dst.shape}: the same [rows, whole {t.name} blocks] expected")
    if not dst.flags.writeable or np.may_share_memory(src, dst):
        raise ShapeError("dst must be writable and not overlap src")
    m, k = src.shape[0], src.shape[1] // t.type_size * t.blck_size
    if src.size:
        rc = _lib.ap_x8_convert(int(t), int(bool(to_x8)), _ffi.from_buffer("uint8_t[]", src),
                                _ffi.from_buffer("uint8_t[]", dst, require_writable=True), m, k, src.size)
        if rc:
            _raise(rc, f"x8_convert {t.name} [{m}x{k}]")
    return dst
