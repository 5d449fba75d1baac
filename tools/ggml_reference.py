#!/usr/bin/env python3
"""Reference bytes of ggml's quantizers, for tests that run without ggml.

    python tools/ggml_reference.py LIBGGML_BASE [--out tests/data/ggml_quant_ref.npz]

LIBGGML_BASE is a CPU build of ggml's base library (llama.cpp: ``build/bin/libggml-base.so``).
Through ctypes, each block type of ``accelplane.core.types`` is quantized from the fixed input of
:func:`reference_input` by ggml's own reference quantizer (``ggml_get_type_traits(type)
->from_float_ref``: ``quantize_row_<type>_ref``, what ggml's CPU backend uses to set or copy into
that type). The file holds the input (``x``, float32 [rows, ne0]), one uint8 array of quantized
rows per type (named as ``TypeTraits.name``) and ``ggml`` (the library's version and commit).
tests/test_types.py compares ``accelplane.core.types.quantize`` with it byte for byte.

Exits 2 when the library cannot be loaded or its block sizes differ from ours.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np
from accelplane.core.types import GGMLType, row_size

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "data" / "ggml_quant_ref.npz"
ROWS, NE0 = 16, 512


class _TypeTraits(ctypes.Structure):  # ggml.h: struct ggml_type_traits
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]  # fmt: skip


_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


def reference_input() -> np.ndarray:
    """float32 [16, 512] from PCG64 raw bits with exact float ops (the same on every platform):
    ~Gaussian rows, and rows reaching the quantizers' corner cases: zero, constant and one-signed
    blocks, an outlier, values on a grid (rounding ties), sub-blocks of very different
    magnitudes, f16-subnormal and f16-overflowing scales, sparse blocks, zero blocks between others."""
    raw = np.random.PCG64(20261202).random_raw(4 * ROWS * NE0)
    u = ((raw >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)).reshape(4, ROWS, NE0)
    x = ((u[0] + u[1]) + (u[2] + u[3]) - np.float32(2)) * np.float32(1.7)
    x[0, :256] = 0
    x[1, 32:64] = np.float32(0.75)
    x[1, 256:] = -np.abs(x[1, 256:])
    x[2, 100] = np.float32(60)
    x[3] = np.round(x[3] * np.float32(4)) / np.float32(4)
    x[4] = np.ldexp(x[4], -(raw[: NE0 // 16] % 20).astype(np.int32).repeat(16))
    x[5] *= np.float32(1e-6)
    x[6] *= np.float32(1e-38)
    x[7] *= np.float32(1e6)
    x[8] *= np.float32(1e20)
    x[9, raw[NE0 : 2 * NE0] % 6 != 0] = 0
    x[10] = np.abs(x[10]) + np.float32(2)
    x[11, :16] = np.float32(-3)
    x[12] = (np.arange(NE0) % 16 - 8).astype(np.float32)
    x[13, 64:96] = 0
    x[13, 320:352] = 0
    return x


def load(lib_path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(lib_path)
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    lib.ggml_version.restype = lib.ggml_commit.restype = ctypes.c_char_p
    return lib


def quantize_ref(lib: ctypes.CDLL, t: GGMLType, x: np.ndarray) -> np.ndarray:
    """Rows of x quantized by ggml's from_float_ref of t (one call per row)."""
    tr = lib.ggml_get_type_traits(int(t)).contents
    if (tr.blck_size, tr.type_size) != (t.blck_size, t.type_size) or not tr.from_float_ref:
        raise ValueError(f"{t.name}: ggml's block is ({tr.blck_size}, {tr.type_size}) bytes, ours "
                         f"({t.blck_size}, {t.type_size})")  # fmt: skip
    fn = _FROM_FLOAT(tr.from_float_ref)
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros((x.shape[0], row_size(t, x.shape[1])), np.uint8)
    for r in range(x.shape[0]):
        fn(x[r].ctypes.data, out[r].ctypes.data, x.shape[1])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("lib", help="path of libggml-base.so")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="npz to write (default %(default)s)")
    args = p.parse_args(argv)
    try:
        lib = load(args.lib)
        x = reference_input()
        arrays = {t.traits.name: quantize_ref(lib, t, x) for t in GGMLType if t.is_quantized}
    except (OSError, ValueError) as e:
        print(f"ggml_reference: {e}", file=sys.stderr)
        return 2
    arrays["ggml"] = np.array(f"{lib.ggml_version().decode()} {lib.ggml_commit().decode()}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, x=x, **arrays)
    print(f"wrote {args.out}: {', '.join(k for k in arrays if k != 'ggml')} ({arrays['ggml']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
