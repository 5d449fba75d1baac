"""The x8 weight layouts (accelplane_cuda.layout) on the host: no GPU needed. The kernels'
reading of them is checked on a GPU in test_cuda.py (test_x8_weights)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from accelplane.core.graph import Context
from accelplane.core.types import GGMLType, quantize
from accelplane.errors import UnsupportedOpError
from accelplane_cuda import layout

T = GGMLType


def _rows(ty: T, n_rows: int, k: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n_rows, k)).astype(np.float32)
    if ty == T.Q4_K:  # the gguf package has no Q4_K quantizer (its dequantizer is the oracle)
        return quantize(ty, x).reshape(n_rows, -1)
    return gguf.quantize(x, gguf.GGMLQuantizationType[ty.name]).reshape(n_rows, -1)


def _deq_x8(ty: T, rows: np.ndarray) -> np.ndarray:
    """Dequantize x8 rows as the module docstring lays them out (what the kernels read),
    independently of to_x8/from_x8."""
    n, rb = rows.shape
    if ty == T.Q4_K:
        return _deq_q4k_x8(rows)
    gb = 144 if ty == T.Q4_0 else 272
    out = []
    for g in rows.reshape(n, rb // gb, gb).transpose(1, 0, 2):  # each group: [n, gb]
        for j in range(8):
            if ty == T.Q4_0:
                d = g[:, 128 + 2 * j : 130 + 2 * j].copy().view(np.float16).astype(np.float32)
                q = g[:, 16 * j : 16 * j + 16].astype(np.int32)
                v = np.concatenate([(q & 0xF) - 8, (q >> 4) - 8], axis=1)
            else:
                d = g[:, 256 + 2 * j : 258 + 2 * j].copy().view(np.float16).astype(np.float32)
                lo = g[:, 16 * j : 16 * j + 16].view(np.int8)
                hi = g[:, 128 + 16 * j : 144 + 16 * j].view(np.int8)
                v = np.concatenate([lo, hi], axis=1).astype(np.int32)
            out.append(d * v)
    return np.concatenate(out, axis=1)


def _deq_q4k_x8(rows: np.ndarray) -> np.ndarray:
    """Q4_Kx8: sub-block j's nibbles at 16·j (Q4_0x8's order), then d, dmin and three words at
    128: the scales' low nibbles (nibble j), the mins' low nibbles, and the high two bits of
    scale j at bit 2·j and of min j at bit 16 + 2·j."""
    n, rb = rows.shape
    out = []
    for sb in rows.reshape(n, rb // 144, 144).transpose(1, 0, 2):
        d = sb[:, 128:130].copy().view(np.float16).astype(np.float32)
        dmin = sb[:, 130:132].copy().view(np.float16).astype(np.float32)
        w = [int.from_bytes(bytes(b), "little") for b in sb[:, 132:144].reshape(-1, 3, 4).reshape(-1, 4)]
        w = np.array(w, dtype=np.int64).reshape(-1, 3)
        for j in range(8):
            sc = ((w[:, 0] >> (4 * j)) & 15) | (((w[:, 2] >> (2 * j)) & 3) << 4)
            m = ((w[:, 1] >> (4 * j)) & 15) | (((w[:, 2] >> (16 + 2 * j)) & 3) << 4)
            q = sb[:, 16 * j : 16 * j + 16].astype(np.int32)
            v = np.concatenate([q & 0xF, q >> 4], axis=1).astype(np.float32)
            out.append(d * sc[:, None].astype(np.float32) * v - dmin * m[:, None].astype(np.float32))
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("ty", [T.Q4_0, T.Q8_0, T.Q4_K])
@pytest.mark.parametrize("k", [256, 2048])
def test_x8_is_the_documented_layout_and_round_trips(ty, k):
    rows = _rows(ty, 5, k)
    x8 = layout.to_x8(ty, rows)
    assert x8.shape == rows.shape and not np.array_equal(x8, rows)
    want = gguf.dequantize(rows.reshape(-1), gguf.GGMLQuantizationType[ty.name]).reshape(5, k)
    np.testing.assert_allclose(_deq_x8(ty, x8), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(layout.from_x8(ty, x8), rows)


class _Mem:
    """A stand-in for a CUDA weights buffer's memory: host bytes behind the raw read/write
    that the plugin's buffer hooks pass to layout.write/read."""

    def __init__(self, size: int) -> None:
        self.bytes = np.zeros(size, np.uint8)
        self.ptr, self.repack = 4096, True

    def write(self, off: int, arr: np.ndarray) -> None:
        self.bytes[off : off + arr.size] = arr

    def read(self, off: int, n: int) -> np.ndarray:
        return self.bytes[off : off + n].copy()


class _Buf:
    def __init__(self, mem: _Mem) -> None:
        self.ctx = mem


@pytest.mark.parametrize("ty", [T.Q4_0, T.Q8_0, T.Q4_K])
def test_write_read_whole_and_partial_rows(ty):
    """Whole-row writes are regrouped directly; a range cutting rows is read, patched and
    written back; reads of any range (views too) give GGUF bytes."""
    k, m = 512, 6
    ctx = Context()
    w = ctx.new_tensor_ne(ty, k, m, name="w")
    mem = _Mem(w.nbytes + 256)
    w.buffer, w.offs = _Buf(mem), 256
    assert layout.region(w) is w and layout.type_id(w) == layout.X8[ty]
    rows = _rows(ty, m, k, seed=1)
    layout.write(w, rows.reshape(-1), 0, w.nbytes, mem.write, mem.read)
    raw = mem.bytes[256:].reshape(m, -1)
    np.testing.assert_array_equal(raw, layout.to_x8(ty, rows))  # regrouped in device memory
    patch = np.arange(100, dtype=np.uint8)
    start = w.row_bytes * 2 + 50  # cuts rows 2 and 3
    layout.write(w, patch, start, patch.size, mem.write, mem.read)
    want = rows.reshape(-1).copy()
    want[start : start + patch.size] = patch
    out = np.empty(w.nbytes, np.uint8)
    layout.read(w, out, 0, w.nbytes, mem.read)
    np.testing.assert_array_equal(out, want)
    part = np.empty(77, np.uint8)
    layout.read(w, part, start - 10, 77, mem.read)
    np.testing.assert_array_equal(part, want[start - 10 : start + 67])
    # a view of whole rows keeps the layout's type id; one cutting rows cannot be addressed
    rows_view = ctx.view(w, (k, 2), offset=w.row_bytes * 3)
    rows_view.buffer, rows_view.offs = w.buffer, w.offs + w.row_bytes * 3
    assert layout.type_id(rows_view) == layout.X8[ty]
    half = ctx.view(w, (k // 2, 2), offset=0)
    half.buffer, half.offs = w.buffer, w.offs
    with pytest.raises(UnsupportedOpError, match="x8"):
        layout.type_id(half)
    assert layout.same_layout(w, w) and not layout.same_layout(w, half)
    # supports_op is exact: no CUDA kernel is offered a view it cannot address
    from accelplane_cuda.support import supports

    x = ctx.new_tensor_ne(T.F32, k // 2, 1, name="x")
    assert not supports(ctx.mul_mat(half, x))
    x2 = ctx.new_tensor_ne(T.F32, k, 1, name="x2")
    assert supports(ctx.mul_mat(rows_view, x2)) and supports(ctx.mul_mat(w, x2))


def test_not_regrouped_where_it_does_not_apply():
    ctx = Context()
    short = ctx.new_tensor_ne(T.Q4_0, 224, 2, name="short")  # rows of 7 blocks: no whole group
    other = ctx.new_tensor_ne(T.Q6_K, 256, 2, name="q6k")
    for t in (short, other):
        t.buffer, t.offs = _Buf(_Mem(t.nbytes)), 0
        assert layout.region(t) is None and layout.type_id(t) == int(t.type)
    full = ctx.new_tensor_ne(T.Q4_0, 256, 2, name="full")
    mem = _Mem(full.nbytes)
    mem.repack = False  # a compute buffer: GGUF bytes
    full.buffer, full.offs = _Buf(mem), 0
    assert layout.region(full) is None
