"""What a plugin's comm hooks share with the SDK's all-reduce (accelplane.parallel.comm): the
canonical order of additions, so that every algorithm and every plugin leaves the same bits on
every rank for an uncompressed F32 all-reduce, and the size from which partials may travel
compressed (ACCELPLANE_COMM_COMPRESS_MIN)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from accelplane import env
from accelplane.errors import ShapeError

DEFAULT_COMPRESS_MIN: int = env.COMM_COMPRESS_MIN.default  # bytes


def compress_threshold_default() -> int:
    """``ACCELPLANE_COMM_COMPRESS_MIN`` (bytes), else :data:`DEFAULT_COMPRESS_MIN`."""
    return env.COMM_COMPRESS_MIN.get()


def pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def merge_order(n: int) -> list[tuple[int, int]]:
    """The canonical association for ``n`` ranks as merges ``(a, b)``: "group a += group b",
    in evaluation order (fold first, then the pairwise levels; see the module docstring).
    The result ends in group 0. ``merge_order(5) == [(0, 4), (0, 1), (2, 3), (0, 2)]``."""
    if n < 1:
        raise ShapeError(f"merge_order: need at least one rank, got {n}")
    p = pow2_floor(n)
    merges = [(i, i + p) for i in range(n - p)]
    d = 1
    while d < p:
        merges += [(a, a + d) for a in range(0, p, 2 * d)]
        d *= 2
    return merges


def canonical_sum(parts: Sequence[np.ndarray]) -> np.ndarray:
    """numpy evaluation of the canonical order in the parts' own dtype (one rounding per
    merge): the bits an uncompressed F32 all-reduce leaves on every rank."""
    vals = [np.array(p) for p in parts]
    for a, b in merge_order(len(vals)):
        vals[a] = (vals[a] + vals[b]).astype(vals[a].dtype)
    return vals[0]
