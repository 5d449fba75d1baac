"""The CPU plugin's repack buffer type (``CPU_REPACK``, ggml's name): weights whose products
run faster in another layout are stored in it.

Q4_0 and Q8_0 tensors of at least two rows are kept in the x8 layout (accelplane.cpu.kernels:
8 rows interleaved per block, so a mat-vec dots 8 rows per activation broadcast); every other
tensor is stored as it is. The layout keeps every byte count and every group of 8 rows where
ggml's layout has it, so a tensor's size, offsets and views are the same as in a plain buffer.
``set_tensor`` packs and ``get_tensor`` unpacks, for any byte range (a partial write re-packs the
groups it touches), so what goes in comes back exactly. The buffer is not host memory to the
SDK (its bytes are not ggml's); the CPU plugin computes on it directly.

:func:`x8_rows` says when a tensor's bytes can be handed to the x8 kernels: an owner or a
group-aligned range of its rows. Plans read any other view of such a tensor through
:func:`unpacked`.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType

NAME = "CPU_REPACK"
TYPES = frozenset((GGMLType.Q4_0, GGMLType.Q8_0))  # kernels.X8_TYPES (not imported: plugin loads stay cheap)


class X8:
    """``tensor.extra`` of a tensor the repack buffer keeps in the x8 layout: P planes (ne2 *
    ne3, e.g. experts) of M rows, each plane an x8 matrix."""

    __slots__ = ("planes", "rows")

    def __init__(self, t: Tensor) -> None:
        self.rows = t.ne[1]
        self.planes = t.ne[2] * t.ne[3]


def is_repack(buffer) -> bool:
    return buffer is not None and buffer.buft.name == NAME and not buffer.buft.is_host


def init_tensor(t: Tensor) -> None:
    """Mark an owner tensor placed in the repack buffer that gets the x8 layout."""
    if t.view_src is None and t.type in TYPES and t.ne[1] > 1 and t.is_contiguous():
        t.extra = X8(t)


def x8_owner(t: Tensor) -> Tensor | None:
    """The x8 owner whose bytes ``t`` reads, or None when t's bytes are ggml's."""
    o = t.data_owner
    return o if isinstance(o.extra, X8) and is_repack(o.buffer) else None


def x8_rows(t: Tensor) -> bool:
    """Whether ``t`` (an x8 owner or a view of one) is itself x8 matrices of its rows: the owner,
    or a 2-D range of whole rows of a 2-D owner that starts on a group of 8 and ends on one or at
    the owner's last row."""
    o = x8_owner(t)
    if o is None:
        return False
    if t is o:
        return True
    rb = o.row_bytes
    if o.extra.planes != 1 or t.type != o.type or t.ne[0] != o.ne[0] or t.ne[2] * t.ne[3] != 1:
        return False
    if t.nb[1] != rb or t.view_offs % (8 * rb):
        return False
    r0 = t.view_offs // rb
    return (t.ne[1] % 8 == 0 or r0 + t.ne[1] == o.ne[1]) and r0 + t.ne[1] <= o.ne[1]


def _units(o: Tensor, start: int, end: int) -> Iterator[tuple[int, int]]:
    """Byte ranges of ``o`` (relative to it) that are x8 matrices and together cover [start,
    end): per plane, the groups of 8 rows the range touches (through the tail rows when it
    reaches them)."""
    rb, m = o.row_bytes, o.extra.rows
    full = m // 8 * 8
    plane = m * rb
    for p in range(start // plane, (end - 1) // plane + 1):
        base = p * plane
        lo, hi = max(start - base, 0), min(end - base, plane)
        r0, r1 = lo // rb, -(-hi // rb)
        r0 = min(r0 // 8 * 8, full)
        r1 = m if r1 > full else -(-r1 // 8) * 8
        yield base + r0 * rb, base + r1 * rb


def _convert(o: Tensor, src: np.ndarray, dst: np.ndarray, to_x8: bool) -> None:
    from accelplane.cpu import kernels

    rb = o.row_bytes
    kernels.x8_convert(o.type, src.reshape(-1, rb), dst.reshape(-1, rb), to_x8)


def write(buffer, t: Tensor, data: np.ndarray, offset: int, size: int) -> None:
    """buffer_set_tensor of the repack buffer: bytes of ggml's layout in, packed where x8."""
    mem = buffer.ctx
    o = x8_owner(t)
    start = t.offs + offset
    if o is None:
        mem[start : start + size] = data[:size]
        return
    rel = start - o.offs
    for lo, hi in _units(o, rel, rel + size):
        dst = mem[o.offs + lo : o.offs + hi]
        a, b = max(lo, rel), min(hi, rel + size)  # the part of this unit the write covers
        if (a, b) == (lo, hi):
            _convert(o, np.ascontiguousarray(data[lo - rel : hi - rel]), dst, True)
            continue
        plain = np.empty(hi - lo, np.uint8)
        _convert(o, dst, plain, False)
        plain[a - lo : b - lo] = data[a - rel : b - rel]
        _convert(o, plain, dst, True)


def read(buffer, t: Tensor, out: np.ndarray, offset: int, size: int) -> None:
    """buffer_get_tensor of the repack buffer: ggml's layout out, whatever is stored."""
    mem = buffer.ctx
    o = x8_owner(t)
    start = t.offs + offset
    if o is None:
        out[:size] = mem[start : start + size]
        return
    rel = start - o.offs
    for lo, hi in _units(o, rel, rel + size):
        plain = np.empty(hi - lo, np.uint8)
        _convert(o, mem[o.offs + lo : o.offs + hi], plain, False)
        a, b = max(lo, rel), min(hi, rel + size)
        out[a - rel : b - rel] = plain[a - lo : b - lo]


def unpacked(o: Tensor, mem: np.ndarray, out: np.ndarray) -> None:
    """All of x8 owner ``o``'s bytes (``mem``: the buffer's array) in ggml's layout, into
    ``out`` (uint8, o.nbytes)."""
    plane = o.extra.rows * o.row_bytes
    for p in range(o.extra.planes):
        a = p * plane
        _convert(o, mem[o.offs + a : o.offs + a + plane], out[a : a + plane], False)
