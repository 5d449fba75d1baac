"""supports_op on the host (no GPU needed): the quantized weights offered to the kernels are
exactly the block types they decode (args.QUANT); every other block type of the catalog is
declined for each op that reads it, so the scheduler runs those nodes elsewhere."""

from __future__ import annotations

import pytest
from accelplane.core.graph import Context
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType
from accelplane_cuda.args import QUANT
from accelplane_cuda.support import supports

T = GGMLType


def _readers(ty: GGMLType) -> list[Tensor]:
    """Every op of the catalog that reads a ``ty`` tensor: MUL_MAT, MUL_MAT_ID, GET_ROWS and the
    dequantizing CPY (unallocated: supports_op looks at types and layout only)."""
    ctx = Context()
    k = 256
    w = ctx.new_tensor_ne(ty, k, 8, 4, name="w")
    x = ctx.new_tensor_ne(T.F32, k, 3, 4, name="x")
    ids = ctx.new_tensor_ne(T.I32, 2, 4, name="ids")
    xe = ctx.new_tensor_ne(T.F32, k, 1, 4, name="xe")
    rows = ctx.new_tensor_ne(T.I32, 5, 4, name="rows")
    dst = ctx.new_tensor_ne(T.F32, k, 8, 4, name="dst")
    return [ctx.mul_mat(w, x), ctx.mul_mat_id(w, xe, ids), ctx.get_rows(w, rows), ctx.cpy(w, dst)]


@pytest.mark.parametrize("ty", [t for t in T if t.is_quantized], ids=str)
def test_supports_exactly_the_decoded_block_types(ty: GGMLType) -> None:
    got = {n.op.name: supports(n) for n in _readers(ty)}
    assert got == dict.fromkeys(got, ty in QUANT)
