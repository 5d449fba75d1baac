"""The decoders of kernels/quants.cuh (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL, IQ4_XS) on the
host, no GPU needed: the header is compiled by the host's C++ compiler with the two CUDA
intrinsics it uses written as CUDA documents them (__dp4a: the sum of the four int8 products
plus c; __byte_perm(x, y, s): byte n of the result is byte (s >> 4n) & 7 of y:x), and with
-fsanitize=alignment so that a 32-bit load of a block word that is not 4-byte aligned shows.

deq32 must give gguf's dequantization bit for bit (the host compile does not contract a*b + c
into an FMA; NVRTC may, which changes the last bit, not the value); unit_dot, over a 16-byte
aligned row as k_mmv_pipe stages it, must give dx * sum(w * xq) of gguf's weights within float32
rounding. Skipped without a C++ compiler."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
from accelplane.core.types import GGMLType

T = GGMLType
TYPES = [T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q5_K, T.IQ4_NL, T.IQ4_XS]
HEADER = Path(__file__).resolve().parent.parent / "accelplane_cuda" / "kernels" / "quants.cuh"
CXX = shutil.which("c++") or shutil.which("g++")

PRELUDE = r"""
#include <cmath>
typedef long long i64;
typedef unsigned char u8;
#define __device__
#define __forceinline__ inline
static float f16at(const u8* p) {  // IEEE half to float, exact
    const unsigned h = p[0] | (p[1] << 8), e = (h >> 10) & 31, m = h & 1023;
    const float v = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? (m ? NAN : INFINITY)
                                                                 : std::ldexp((float)(m | 1024), (int)e - 25);
    return (h >> 15) ? -v : v;
}
static int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
static unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned int r = 0;
    for (int n = 0; n < 4; ++n) r |= (unsigned int)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
    return r;
}
template <int TYPE> void deq32(const u8* row, int c, float* y);
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    if CXX is None:
        pytest.skip("no C++ compiler")
    d = tmp_path_factory.mktemp("quants")
    wrappers = "".join(
        f'extern "C" void deq_{int(t)}(const u8* r, int c, float* y) {{ deq32<{int(t)}>(r, c, y); }}\n'
        f'extern "C" float dot_{int(t)}(const u8* r, int u, const int* q, float dx, int sx) '
        f"{{ return unit_dot<{int(t)}>(r, u, q, dx, sx); }}\n"
        for t in TYPES
    )
    src = d / "harness.cpp"
    src.write_text(f'{PRELUDE}\n#include "{HEADER}"\n{wrappers}')
    so = d / "harness.so"
    cmd = [CXX, "-std=c++17", "-O1", "-ffp-contract=off", "-fsanitize=alignment", "-shared", "-fPIC",
           "-Wall", "-Wno-unknown-pragmas", "-o", str(so), str(src)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    h = ctypes.CDLL(str(so))
    for t in TYPES:
        getattr(h, f"deq_{int(t)}").argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        f = getattr(h, f"dot_{int(t)}")
        f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_int]
        f.restype = ctypes.c_float
    return h


def random_row(t: GGMLType, nb: int, rng: np.random.Generator) -> np.ndarray:
    """A row of nb random blocks in 16-byte aligned memory: random bytes, f16 scales finite
    (subnormal ones included), of either sign."""
    buf = np.zeros(nb * t.type_size + 16, np.uint8)
    off = (-buf.ctypes.data) % 16
    row = buf[off : off + nb * t.type_size]
    row[:] = rng.integers(0, 256, row.size, dtype=np.uint8)
    blocks = row.reshape(nb, t.type_size)
    for f in t.traits.f16_fields:
        h = rng.integers(0, 1 << 16, nb, dtype=np.uint16)
        h = np.where((h & 0x7C00) == 0x7C00, h & 0xBFFF, h)
        blocks[:, f : f + 2] = h.astype("<u2").view(np.uint8).reshape(nb, 2)
    assert row.ctypes.data % 16 == 0
    return row


def oracle(t: GGMLType, row: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(row.reshape(1, -1), gguf.GGMLQuantizationType(int(t))).reshape(-1)


@pytest.mark.parametrize("t", TYPES, ids=str)
def test_deq32_is_gguf_bit_for_bit(lib, t: GGMLType, capfd) -> None:
    rng = np.random.default_rng(int(t))
    fn = getattr(lib, f"deq_{int(t)}")
    for trial in range(20):
        row = random_row(t, 8 if t.blck_size == 32 else 2, rng)
        # an unaligned copy too: deq32 reads any row
        odd = np.zeros(row.size + 1, np.uint8)[1:]
        odd[:] = row
        want = oracle(t, row).astype(np.float32)
        for r in (row, odd):
            y = np.empty(32, np.float32)
            got = np.empty_like(want)
            for c in range(want.size // 32):
                fn(r.ctypes.data, c, y.ctypes.data)
                got[32 * c : 32 * c + 32] = y
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), f"{t.name} {trial}")
    assert "misaligned" not in capfd.readouterr().err


@pytest.mark.parametrize("t", TYPES, ids=str)
def test_unit_dot_against_float64(lib, t: GGMLType, capfd) -> None:
    rng = np.random.default_rng(100 + int(t))
    fn = getattr(lib, f"dot_{int(t)}")
    for trial in range(20):
        row = random_row(t, 8 if t.blck_size == 32 else 2, rng)
        w = oracle(t, row).astype(np.float64).reshape(-1, 32)
        for u in range(w.shape[0]):
            xq = rng.integers(-127, 128, 32).astype(np.int8)
            if trial == 0:
                xq[:] = 127 if u % 2 else -127  # the extremes: int sums at their largest
            dx = np.float32(rng.uniform(0.001, 0.1))
            sx = int(xq.astype(np.int64).sum())
            got = fn(row.ctypes.data, u, xq.view(np.int32).ctypes.data, dx, sx)
            want = float(dx) * float(w[u] @ xq.astype(np.float64))
            scale = float(dx) * float(np.abs(w[u]) @ np.abs(xq.astype(np.float64)))
            assert abs(got - want) <= 2e-6 * scale + 1e-30, (t.name, trial, u, got, want)
    assert "misaligned" not in capfd.readouterr().err
