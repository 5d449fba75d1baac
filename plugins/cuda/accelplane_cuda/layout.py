"""The x8 weight layouts: Q4_0, Q8_0 and Q4_K rows regrouped so that mat-vec reads are aligned.

GGUF's Q4_0 block is 18 bytes (an F16 scale, 16 bytes of nibbles) and Q8_0's 34 bytes, so a
block's quants sit at 2-byte alignment and lanes reading consecutive blocks from shared memory
collide on banks (about 5 wavefronts per 2-byte load instead of 1). The x8 layouts keep each
row's size and regroup every run of 8 blocks (256 elements) in place:

- Q4_0x8, 144 bytes per group: the 8 blocks' 16 quant bytes at 16·j, then the 8 scales at
  128 + 2·j.
- Q8_0x8, 272 bytes per group: elements 0..15 of block j at 16·j, elements 16..31 at
  128 + 16·j, then the 8 scales at 256 + 2·j.
- Q4_Kx8, 144 bytes per super-block (already 256 elements): sub-block j's 32 nibbles at 16·j as
  Q4_0x8 holds a block's (element l < 16 the low nibble of byte l, element l + 16 its high
  nibble), then a 16-byte header at 128: F16 d, F16 dmin, then the eight 6-bit scales and mins
  as three little-endian words: the scales' low nibbles (nibble j for sub-block j), the mins' low
  nibbles, and the high two bits of scale j at bit 2·j and of min j at bit 16 + 2·j. GGUF
  interleaves two sub-blocks in 32 bytes (low and high nibbles), so a lane reading one sub-block
  loaded 32 bytes and used half; and GGUF's packing of the scales and mins takes a branch on j
  and three single-byte gathers to decode, which this one does with shifts and masks (the
  mat-vec is bound by its instructions as much as by memory: 6 % faster at 4096 x 14336).

Every quant word is then 16-byte aligned and lanes reading consecutive blocks read consecutive
words (a Q4_Kx8 lane reads two words and the header that its neighbours read too). Rows stay
rows (same byte size, same stride), so views that select whole rows (the model's merged Q/K/V
views) stay valid.

Where: tensors of a CUDA *weights* buffer (BufferUsage.WEIGHTS at allocation) whose type is
Q4_0, Q8_0 or Q4_K, with contiguous rows of a multiple of 256 elements starting 16-byte aligned.
The buffer hooks convert on the host side of every set/get (so users, other plugins and the SDK's
copies always see GGUF bytes), and kernels that read or write such tensors use the layout's
kernel type id (:class:`X8Type`).
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
from accelplane.core.types import GGMLType as T
from accelplane.errors import UnsupportedOpError


class X8Type(IntEnum):
    """The kernels' type ids of the x8 layouts: past GGUF's ids, which the kernels use for every
    other type (kernels/common.cuh: namespace ty)."""

    Q4_0X8 = 102
    Q8_0X8 = 108
    Q4_KX8 = 112


X8 = {T.Q4_0: X8Type.Q4_0X8, T.Q8_0: X8Type.Q8_0X8, T.Q4_K: X8Type.Q4_KX8}  # GGUF type → its x8 layout
KernelType = T | X8Type  # what a kernel's type-id template parameter takes
GROUP = 8  # blocks per group
_BLOCK = {T.Q4_0: 18, T.Q8_0: 34}


def _nibbles_to_words(sub: np.ndarray) -> np.ndarray:
    """[..., 32] 4-bit values → [..., 16] bytes: element l < 16 low nibble of byte l, l + 16 high."""
    return sub[..., :16] | (sub[..., 16:] << 4)


def _q4k_scales_to_x8(s: np.ndarray) -> np.ndarray:
    """GGUF's 12 bytes of 6-bit scales and mins [..., 12] → the x8 header's three words, as bytes."""
    s = s.astype(np.uint32)
    lo, hi, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (top & 0xF) | ((lo >> 6) << 4)], axis=-1)  # ggml's get_scale_min_k4
    mn = np.concatenate([hi & 63, (top >> 4) | ((hi >> 6) << 4)], axis=-1)
    j = np.arange(8, dtype=np.uint32)
    words = [((sc & 15) << (4 * j)).sum(-1), ((mn & 15) << (4 * j)).sum(-1),
             ((sc >> 4) << (2 * j)).sum(-1) | ((mn >> 4) << (16 + 2 * j)).sum(-1)]  # fmt: skip
    return np.stack(words, axis=-1).astype("<u4").view(np.uint8)


def _q4k_scales_from_x8(b: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_q4k_scales_to_x8` (exact: both pack the same 96 bits)."""
    w = np.ascontiguousarray(b).view("<u4").astype(np.uint32)
    j = np.arange(8, dtype=np.uint32)
    sc = ((w[..., 0:1] >> (4 * j)) & 15) | (((w[..., 2:3] >> (2 * j)) & 3) << 4)
    mn = ((w[..., 1:2] >> (4 * j)) & 15) | (((w[..., 2:3] >> (16 + 2 * j)) & 3) << 4)
    lo = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    hi = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    top = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return np.concatenate([lo, hi, top], axis=-1).astype(np.uint8)


def _q4k_to_x8(rows: np.ndarray) -> np.ndarray:
    n, rb = rows.shape
    sb = rows.reshape(n, rb // 144, 144)
    qs = sb[..., 16:].reshape(n, -1, 4, 32)  # pair p: sub-block 2p low nibbles, 2p + 1 high
    sub = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(n, -1, 8, 32)
    head = np.concatenate([sb[..., :4], _q4k_scales_to_x8(sb[..., 4:16])], axis=2)
    return np.concatenate([_nibbles_to_words(sub).reshape(n, -1, 128), head], axis=2).reshape(n, rb)


def _q4k_from_x8(rows: np.ndarray) -> np.ndarray:
    n, rb = rows.shape
    sb = rows.reshape(n, rb // 144, 144)
    w = sb[..., :128].reshape(n, -1, 4, 2, 16)  # [pair, low/high sub-block, byte]
    sub = np.concatenate([w & 0xF, w >> 4], axis=4)  # [pair, low/high, 32 elements]
    qs = (sub[..., 0, :] | (sub[..., 1, :] << 4)).reshape(n, -1, 128)
    head = np.concatenate([sb[..., 128:132], _q4k_scales_from_x8(sb[..., 132:144])], axis=2)
    return np.concatenate([head, qs], axis=2).reshape(n, rb)


def to_x8(ty: T, rows: np.ndarray) -> np.ndarray:
    """GGUF rows (uint8 [n_rows, row_bytes]) → x8 rows of the same shape."""
    if ty == T.Q4_K:
        return _q4k_to_x8(rows)
    bb = _BLOCK[ty]
    n, rb = rows.shape
    g = rows.reshape(n, rb // (GROUP * bb), GROUP, bb)
    scales = g[..., :2].reshape(n, -1, 2 * GROUP)
    if ty == T.Q4_0:
        parts = [g[..., 2:].reshape(n, -1, 16 * GROUP), scales]
    else:
        parts = [g[..., 2:18].reshape(n, -1, 16 * GROUP), g[..., 18:].reshape(n, -1, 16 * GROUP), scales]
    return np.concatenate(parts, axis=2).reshape(n, rb)


def from_x8(ty: T, rows: np.ndarray) -> np.ndarray:
    """x8 rows → GGUF rows (the inverse of :func:`to_x8`)."""
    if ty == T.Q4_K:
        return _q4k_from_x8(rows)
    bb = _BLOCK[ty]
    n, rb = rows.shape
    g = rows.reshape(n, rb // (GROUP * bb), GROUP * bb)
    out = np.empty((n, g.shape[1], GROUP, bb), np.uint8)
    q = 16 * GROUP
    if ty == T.Q4_0:
        out[..., 2:] = g[..., :q].reshape(n, -1, GROUP, 16)
        out[..., :2] = g[..., q:].reshape(n, -1, GROUP, 2)
    else:
        out[..., 2:18] = g[..., :q].reshape(n, -1, GROUP, 16)
        out[..., 18:] = g[..., q : 2 * q].reshape(n, -1, GROUP, 16)
        out[..., :2] = g[..., 2 * q :].reshape(n, -1, GROUP, 2)
    return out.reshape(n, rb)


def root(t):
    while t.view_src is not None:
        t = t.view_src
    return t


def _eligible(r) -> bool:
    """A tensor placed in a weights buffer that takes the x8 layout."""
    return (r.type in X8 and r.ne[0] % (32 * GROUP) == 0 and r.is_contiguous()
            and (r.buffer.ctx.ptr + r.offs) % 16 == 0)  # fmt: skip


def region(t):
    """The x8 tensor whose bytes ``t`` lies in (t itself or its view source), else None."""
    buf = t.buffer
    if buf is None or not getattr(buf.ctx, "repack", False):
        return None
    r = root(t)
    return r if _eligible(r) else None


def type_id(t) -> KernelType:
    """The kernels' type id for reading or writing ``t``: its X8Type for x8 tensors, else its
    ggml type. A view into x8 memory that does not keep whole rows raises UnsupportedOpError
    (no kernel can address it)."""
    r = region(t)
    if r is None:
        return t.type
    rows_kept = (t.type == r.type and t.ne[0] == r.ne[0] and t.nb[0] == r.nb[0]
                 and all(t.nb[i] % r.nb[1] == 0 for i in (1, 2, 3) if t.ne[i] > 1)
                 and (t.offs - r.offs) % r.nb[1] == 0)  # fmt: skip
    if not rows_kept:
        raise UnsupportedOpError(f"{t.name or t.uid!r}: a view of {r.name!r} that splits its rows "
                                 "(x8-regrouped weights are addressed by whole rows)")
    return X8[r.type]


def same_layout(a, b) -> bool:
    """Raw bytes copied from a to b mean the same values (both GGUF, or both whole x8 rows of
    the same row length)."""
    ra, rb = region(a), region(b)
    if ra is None and rb is None:
        return True
    if ra is None or rb is None or ra.type != rb.type or ra.ne[0] != rb.ne[0]:
        return False
    try:
        type_id(a), type_id(b)
    except UnsupportedOpError:
        return False
    return True


def _span(r, t, offset: int, size: int) -> tuple[int, int, int]:
    """(first row, end row, byte offset of the range in the first row) of r covering t's bytes."""
    rb = r.nb[1]
    base = t.offs + offset - r.offs
    return base // rb, -(-(base + size) // rb), base % rb


def write(t, data: np.ndarray, offset: int, size: int, raw_write, raw_read) -> None:
    """Set bytes [offset, offset + size) of ``t`` (GGUF layout in ``data``) through
    ``raw_write(buffer_offset, uint8 array)`` / ``raw_read(buffer_offset, nbytes)``, regrouping
    rows of x8 tensors (a range that is not whole rows is read, patched and written back)."""
    r = region(t)
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)[:size]
    if r is None:
        raw_write(t.offs + offset, data)
        return
    rb = r.nb[1]
    r0, r1, skip = _span(r, t, offset, size)
    if skip == 0 and size % rb == 0:
        rows = data.reshape(-1, rb)
    else:
        rows = from_x8(r.type, raw_read(r.offs + r0 * rb, (r1 - r0) * rb).reshape(-1, rb))
        rows.reshape(-1)[skip : skip + size] = data
    raw_write(r.offs + r0 * rb, to_x8(r.type, rows).reshape(-1))


def read(t, out: np.ndarray, offset: int, size: int, raw_read) -> None:
    """out[:size] ← bytes [offset, offset + size) of ``t`` in GGUF layout."""
    r = region(t)
    if r is None:
        out[:size] = raw_read(t.offs + offset, size)
        return
    rb = r.nb[1]
    r0, r1, skip = _span(r, t, offset, size)
    rows = from_x8(r.type, raw_read(r.offs + r0 * rb, (r1 - r0) * rb).reshape(-1, rb))
    out[:size] = rows.reshape(-1)[skip : skip + size]
