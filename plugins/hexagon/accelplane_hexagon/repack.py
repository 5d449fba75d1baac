"""The repack buffer's weight layout: Q4_0 / Q8_0 tensors stored as 32x32 tiles.

A tile is 32 output rows (ne1, padded to a multiple of 32) by one 32-wide block of K (ne0);
tiles go row-tile major, then K tiles, and repeat per plane (expert) ne2*ne3. Inside a tile
(see htp/htp-tile.h for the byte map) the quants come first, grouped the way HVX's vrmpy reads
them (lane r = 4 consecutive K elements of row r), then the 32 rows' fp16 scales:

    Q4_0 tile  576 bytes = 4 x 128 nibble-pair bytes + 32 x fp16
    Q8_0 tile 1088 bytes = 8 x 128 int8 bytes        + 32 x fp16

Padding rows have scale 0 and zero quants (0x88 nibbles for Q4_0). The repack is a byte
permutation of the rows' blocks, so ``unpack(pack(x)) == x`` for any bytes, NaN scales
included (the tests check this).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType

T = GGMLType
TILE = 32


@dataclass(frozen=True)
class TileFormat:
    tile_bytes: int
    qbytes: int  # quant bytes of one tile
    groups: int  # 128-byte vectors of quants per tile
    block_qbytes: int  # quant bytes of one ggml block (after its fp16 scale)
    pad_quant: int  # quant byte of a padding row


FORMATS: dict[GGMLType, TileFormat] = {
    T.Q4_0: TileFormat(576, 512, 4, 16, 0x88),
    T.Q8_0: TileFormat(1088, 1024, 8, 32, 0x00),
}


def _round_up(n: int) -> int:
    return -(-n // TILE) * TILE


@dataclass(frozen=True)
class TileInfo:
    """Where a repacked tensor's tiles are: set as ``tensor.extra`` by the repack buffer."""

    fmt: TileFormat
    planes: int  # ne2 * ne3
    n_rt: int  # row tiles (ne1 rounded up to 32, / 32)
    n_kt: int  # K tiles (ne0 rounded up to 32, / 32)

    @property
    def nbytes(self) -> int:
        return self.planes * self.n_rt * self.n_kt * self.fmt.tile_bytes


def tile_info(t: Tensor) -> TileInfo:
    fmt = FORMATS[t.type]
    return TileInfo(fmt, t.ne[2] * t.ne[3], _round_up(t.ne[1]) // TILE, _round_up(t.ne[0]) // TILE)


def alloc_size(t: Tensor) -> int:
    """Bytes of ``t`` in the repack buffer: ne0 and ne1 rounded up to 32."""
    return tile_info(t).nbytes


def pack(std: np.ndarray, info: TileInfo, rows: int) -> np.ndarray:
    """ggml-layout bytes of a contiguous tensor (``rows`` = ne1 rows per plane) → tile bytes."""
    fmt, P, n_rt, n_kt = info.fmt, info.planes, info.n_rt, info.n_kt
    blocks = std.reshape(P, rows, n_kt, 2 + fmt.block_qbytes)
    q = np.full((P, n_rt * TILE, n_kt, fmt.block_qbytes), fmt.pad_quant, np.uint8)
    d = np.zeros((P, n_rt * TILE, n_kt, 2), np.uint8)
    q[:, :rows] = blocks[..., 2:]
    d[:, :rows] = blocks[..., :2]
    # quants [P, rt, r, kt, g, j] -> [P, rt, kt, g, r, j]; scales [P, rt, r, kt, 2] -> [P, rt, kt, r, 2]
    q = q.reshape(P, n_rt, TILE, n_kt, fmt.groups, 4).transpose(0, 1, 3, 4, 2, 5)
    d = d.reshape(P, n_rt, TILE, n_kt, 2).transpose(0, 1, 3, 2, 4)
    out = np.empty((P, n_rt, n_kt, fmt.tile_bytes), np.uint8)
    out[..., : fmt.qbytes] = q.reshape(P, n_rt, n_kt, fmt.qbytes)
    out[..., fmt.qbytes :] = d.reshape(P, n_rt, n_kt, 2 * TILE)
    return out.reshape(-1)


def unpack(tiles: np.ndarray, info: TileInfo, rows: int) -> np.ndarray:
    """The inverse of :func:`pack`: tile bytes → the ggml-layout bytes of the ``rows`` real rows."""
    fmt, P, n_rt, n_kt = info.fmt, info.planes, info.n_rt, info.n_kt
    t = tiles[: info.nbytes].reshape(P, n_rt, n_kt, fmt.tile_bytes)
    q = t[..., : fmt.qbytes].reshape(P, n_rt, n_kt, fmt.groups, TILE, 4).transpose(0, 1, 4, 2, 3, 5)
    d = t[..., fmt.qbytes :].reshape(P, n_rt, n_kt, TILE, 2).transpose(0, 1, 3, 2, 4)
    blocks = np.empty((P, n_rt * TILE, n_kt, 2 + fmt.block_qbytes), np.uint8)
    blocks[..., :2] = d.reshape(P, n_rt * TILE, n_kt, 2)
    blocks[..., 2:] = q.reshape(P, n_rt * TILE, n_kt, fmt.block_qbytes)
    return np.ascontiguousarray(blocks[:, :rows]).reshape(-1)


# --- repacked tensors in the plugin's buffers ------------------------------------------------------
def tiled_in(buft, tensor: Tensor) -> bool:
    """``tensor`` is stored as tiles when placed in buffer type ``buft``: a repack buffer type,
    a tiled format, and not a view."""
    return buft.ctx.repack and tensor.type in FORMATS and tensor.view_src is None


def tiles_of(buffer, tensor: Tensor) -> tuple[Tensor, np.ndarray, int] | None:
    """(owner, its tile bytes, byte position of ``tensor`` in the owner's ggml layout) when
    ``tensor`` is (a view of) a repacked tensor of ``buffer``, else None."""
    o = tensor.data_owner
    if not buffer.ctx.repack or not isinstance(o.extra, TileInfo) or o.buffer is not buffer:
        return None
    return o, buffer.ctx.mem[o.offs : o.offs + o.extra.nbytes], tensor.offs - o.offs
