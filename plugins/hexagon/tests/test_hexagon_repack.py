"""The repack buffer: tile sizes, allocation sizes, the byte map of htp-tile.h, padding rows,
and exact round trips (whole, partial, through views)."""

from __future__ import annotations

import numpy as np
import pytest
from accelplane.core.graph import Context
from accelplane.core.types import GGMLType, dequantize, quantize

from accelplane_hexagon import npu
from accelplane_hexagon import repack as rp

T = GGMLType
SHAPES = [(32, 1, 1), (64, 70, 1), (96, 33, 3), (256, 32, 2), (32, 1, 5)]  # ne0, ne1, ne2


def test_tile_sizes_match_the_npu_side():
    _, lib = npu.load()
    assert rp.FORMATS[T.Q4_0].tile_bytes == lib.HTP_Q4_0_TILE_BYTES == 576
    assert rp.FORMATS[T.Q8_0].tile_bytes == lib.HTP_Q8_0_TILE_BYTES == 1088
    for f in rp.FORMATS.values():  # quants of 32 rows x 32 K, then 32 fp16 scales
        assert f.tile_bytes == f.qbytes + 64 and f.groups * 128 == f.qbytes


@pytest.mark.parametrize("ty", [T.Q4_0, T.Q8_0], ids=str)
@pytest.mark.parametrize("ne", SHAPES, ids=str)
def test_alloc_size_rounds_rows_up_to_32(repack, htp, ty, ne):
    t = Context().new_tensor_ne(ty, *ne)
    rows = -(-ne[1] // 32) * 32
    assert repack.alloc_size(t) == rows // 32 * (ne[0] // 32) * ne[2] * rp.FORMATS[ty].tile_bytes
    assert repack.alloc_size(t) == t.row_bytes * rows * ne[2]  # tiles are as big as padded rows
    assert htp.buffer_type.alloc_size(t) == t.nbytes  # the normal buffer does not pad


@pytest.mark.parametrize("ty", [T.Q4_0, T.Q8_0], ids=str)
@pytest.mark.parametrize("ne", SHAPES, ids=str)
def test_roundtrip_any_bytes(repack, placed, rng, ty, ne):
    t = Context().new_tensor_ne(ty, *ne)
    placed.put(repack, t)
    data = rng.integers(0, 256, t.nbytes, dtype=np.uint8)  # NaN/inf scales included
    t.set_bytes(data)
    assert np.array_equal(t.get_bytes(), data)
    mem = t.buffer.ctx.mem[t.offs : t.offs + repack.alloc_size(t)]
    if t.ne[1] % 32 == 0:  # no padding: the tiles are a permutation of the same bytes
        assert np.array_equal(np.sort(mem), np.sort(data))


@pytest.mark.parametrize("ty", [T.Q4_0, T.Q8_0], ids=str)
def test_roundtrip_values(repack, placed, rng, ty):
    t = Context().new_tensor_ne(ty, 128, 45, 2)
    placed.put(repack, t)
    v = rng.uniform(-2, 2, t.shape).astype(np.float32)
    t.set(v)
    want = dequantize(ty, quantize(ty, v.reshape(-1, 128)), 128).reshape(t.shape)
    assert np.array_equal(t.get(), want)


@pytest.mark.parametrize("ty", [T.Q4_0, T.Q8_0], ids=str)
def test_partial_writes_and_views_match_a_plain_buffer(htp, repack, placed, rng, ty):
    ctx = Context()
    tiled = ctx.new_tensor_ne(ty, 64, 37, 2, name="tiled")
    plain = ctx.new_tensor_ne(ty, 64, 37, 2, name="plain")
    vt = ctx.view(tiled, (64, 3), tiled.nb, 5 * tiled.nb[1])  # rows 5..7 of plane 0
    vp = ctx.view(plain, (64, 3), plain.nb, 5 * plain.nb[1])
    placed.put(repack, tiled)
    placed.put(htp.buffer_type, plain)
    tiled.buffer.init_view(vt)
    plain.buffer.init_view(vp)
    data = rng.integers(0, 256, tiled.nbytes, dtype=np.uint8)
    tiled.set_bytes(data)
    plain.set_bytes(data)
    for off, size in ((0, 1), (17, 40), (tiled.nbytes - 3, 3), (1000, 777)):
        patch = rng.integers(0, 256, size, dtype=np.uint8)
        tiled.set_bytes(patch, off)
        plain.set_bytes(patch, off)
        assert np.array_equal(tiled.get_bytes(off, size), patch)
    assert np.array_equal(tiled.get_bytes(), plain.get_bytes())
    patch = rng.integers(0, 256, 11, dtype=np.uint8)
    vt.set_bytes(patch, 30)
    vp.set_bytes(patch, 30)
    assert np.array_equal(vt.get_bytes(), vp.get_bytes())
    assert np.array_equal(tiled.get_bytes(), plain.get_bytes())


def test_byte_map_and_padding(repack, placed, rng):
    """Element (row r, k) of a Q8_0 tensor sits where htp-tile.h says; padding rows have zero
    scales and zero quants (Q4_0: 0x88)."""
    ctx = Context()
    q8 = ctx.new_tensor_ne(T.Q8_0, 64, 40, name="q8")  # 2 K tiles, 2 row tiles (24 padding rows)
    q4 = ctx.new_tensor_ne(T.Q4_0, 32, 5, name="q4")
    placed.put(repack, q8, q4)
    data = rng.integers(0, 256, q8.nbytes, dtype=np.uint8)
    q8.set_bytes(data)
    blocks = data.reshape(40, 2, 34)
    mem = q8.buffer.ctx.mem[q8.offs : q8.offs + repack.alloc_size(q8)].reshape(2, 2, 1088)
    for r, k in ((0, 0), (5, 37), (31, 63), (33, 1), (39, 40)):
        rt, kt, rr, kk = r // 32, k // 32, r % 32, k % 32
        g, j = kk // 4, kk % 4
        assert mem[rt, kt, g * 128 + 4 * rr + j] == blocks[r, kt, 2 + kk]
        assert np.array_equal(mem[rt, kt, 1024 + 2 * rr : 1026 + 2 * rr], blocks[r, kt, :2])
    pad = mem[1]  # rows 40..63 of the second row tile
    for kt in range(2):
        assert np.all(pad[kt, 1024 + 2 * 8 :] == 0), "padding rows need zero scales"
        for g in range(8):
            assert np.all(pad[kt, g * 128 + 4 * 8 : g * 128 + 128] == 0)
    q4.set_bytes(rng.integers(0, 256, q4.nbytes, dtype=np.uint8))
    m4 = q4.buffer.ctx.mem[q4.offs : q4.offs + 576]
    assert np.all(m4[512 + 2 * 5 :] == 0)
    for v in range(4):
        assert np.all(m4[v * 128 + 4 * 5 : v * 128 + 128] == 0x88)


def test_plain_types_in_the_repack_buffer(repack, placed, rng):
    """Other types live unchanged in the repack buffer (e.g. norms next to the weights)."""
    t = Context().new_tensor_ne(T.F32, 100, 3)
    placed.put(repack, t)
    v = rng.standard_normal((3, 100)).astype(np.float32)
    t.set(v)
    assert np.array_equal(t.get(), v)
    assert repack.alloc_size(t) == t.nbytes
    assert not repack.is_host
