"""What the plan's launch builders share: the kernels' C types, parameter encodings, and the
layout conditions some kernels need of a tensor."""

from __future__ import annotations

import math

import numpy as np
from accelplane.core.types import GGMLType as T

from .layout import X8Type
from .runtime import address

CTYPE = {T.F32: "float", T.F16: "__half", T.BF16: "__nv_bfloat16"}  # element type → the kernels' C type
HALF_TYPES = ("float", "__half")  # kernels compiled for F32 and F16 only
THREADS = 256  # block size of the grid-stride kernels
# the GGUF block types the kernels decode (kernels/common.cuh and quants.cuh: deq32, unit_dot); a
# block type the catalog (accelplane.core.ops.QUANT) gains is declined by support.py until it is here
_GGUF_QUANT = (T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q5_K, T.IQ4_NL,
               T.IQ4_XS)  # fmt: skip
QUANT = frozenset(_GGUF_QUANT)
# the kernel type ids of quantized data the kernels dequantize (deq32): GGUF's and the x8 layouts
QUANT_IDS = (*_GGUF_QUANT, *X8Type)
# bytes of the units a row segment staged in shared memory is a multiple of (kernels: qfmt::UNIT):
# whole blocks in whole 16-byte words, lcm(block bytes, 16); an x8 group
SEGMENT_UNIT = {T.Q4_0: 144, T.Q8_0: 272, T.Q4_K: 144, T.Q6_K: 1680, T.Q4_1: 80, T.Q5_0: 176, T.Q5_1: 48,
                T.Q2_K: 336, T.Q3_K: 880, T.Q5_K: 176, T.IQ4_NL: 144, T.IQ4_XS: 272,
                X8Type.Q4_0X8: 144, X8Type.Q8_0X8: 272, X8Type.Q4_KX8: 144}  # fmt: skip


def f64(x: float) -> int:
    """A float parameter as the kernels read it (kernels/common.cuh: pf): the bits of a double."""
    return int(np.array([x], np.float64).view(np.int64)[0])


def fastdiv(d: int) -> list[int]:
    """The magic multiplier, shift and divisor of kernels/conv.cu's fast division by ``d``."""
    d = max(1, int(d))
    shift = max(0, math.ceil(math.log2(d)))
    mul = ((1 << 32) * ((1 << shift) - d)) // d + 1
    return [mul & 0xFFFFFFFF, shift, d]


def rows_contig(t) -> bool:
    """Elements (blocks) of a row adjacent."""
    return t.nb[0] == t.type.type_size


def rows_aligned(a) -> bool:
    """Rows fit the kernels staging them in 16-byte words: 16-byte aligned, a whole number of
    16-byte words, contiguous."""
    aligned = address(a) % 16 == 0 and all(x % 16 == 0 for x in a.nb[1:])
    return aligned and a.row_bytes % 16 == 0 and rows_contig(a)


def f32_rows16(t) -> bool:
    """F32 rows of contiguous elements, every row 16-byte aligned (float4 kernels)."""
    return t.type == T.F32 and t.nb[0] == 4 and all(x % 16 == 0 for x in t.nb[1:]) and address(t) % 16 == 0
