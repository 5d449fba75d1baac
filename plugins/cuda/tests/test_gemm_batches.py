"""The grouping of a product's batch matrices into strided-batched cuBLAS calls (no GPU needed):
every batch matrix of ggml's broadcast rule, in order, exactly once, against a direct
enumeration."""

from __future__ import annotations

from accelplane_cuda.gemm import batch_groups
from hypothesis import given, settings
from hypothesis import strategies as st

BASES = (1 << 20, 1 << 30, 1 << 40)


def _enumerated(a2, a3, b2, b3, anb, bnb, cnb):
    r2, r3 = b2 // a2, b3 // a3
    return [(BASES[0] + (i2 // r2) * anb[2] + (i3 // r3) * anb[3], BASES[1] + i2 * bnb[2] + i3 * bnb[3],
             BASES[2] + i2 * cnb[2] + i3 * cnb[3]) for i3 in range(b3) for i2 in range(b2)]  # fmt: skip


def _expanded(groups):
    return [(pa + j * sa, pb + j * sb, pc + j * sc) for pa, pb, pc, n, sa, sb, sc in groups for j in range(n)]


def _nb(ne2: int, ne3: int, row: int, rows: int, permuted: bool) -> list[int]:
    if permuted:  # heads interleaved in the rows (a permuted view): nb2 < nb1
        return [4, row * ne2, row, row * ne2 * rows]
    return [4, row, row * rows, row * rows * ne2]


@settings(max_examples=300, deadline=None)
@given(a2=st.integers(1, 4), a3=st.integers(1, 3), r2=st.integers(1, 4), r3=st.integers(1, 3),
       pa=st.booleans(), pb=st.booleans())  # fmt: skip
def test_groups_cover_every_batch_matrix_in_order(a2, a3, r2, r3, pa, pb):
    b2, b3 = a2 * r2, a3 * r3
    anb, bnb = _nb(a2, a3, 256, 8, pa), _nb(b2, b3, 256, 5, pb)
    cnb = [4, 32, 32 * 5, 32 * 5 * b2]
    groups = batch_groups((a2, a3), (b2, b3), (anb, bnb, cnb), BASES)
    assert _expanded(groups) == _enumerated(a2, a3, b2, b3, anb, bnb, cnb)
    assert all(g[6] > 0 for g in groups if g[3] > 1)


def test_common_layouts_are_one_call():
    # attention over 12 heads x 16 sequences: contiguous, broadcast weight, permuted heads
    c = [4, 248, 248 * 62, 248 * 62 * 12]
    assert len(batch_groups((12, 16), (12, 16), ([4, 256, 256 * 62, 256 * 62 * 12],) * 2 + (c,), BASES)) == 1
    assert len(batch_groups((1, 1), (12, 16), ([4, 256, 0, 0], [4, 256, 256 * 62, 256 * 62 * 12], c),
                            BASES)) == 1  # fmt: skip
    perm = [4, 256 * 12, 256, 256 * 12 * 62]
    assert len(batch_groups((12, 16), (12, 16), (perm, perm, c), BASES)) == 16  # a run per sequence
