"""ggml/GGUF-compatible tensor types and quantized block layouts.

Type ids are GGUF's on-disk ids. Quantized layouts are byte-exact with ggml-common.h:

======  =====  =====  ==============================================================
type    block  bytes  layout
======  =====  =====  ==============================================================
Q4_0    32     18     d:f16, qs[16] (low nibbles = elements 0..15, high = 16..31)
Q4_1    32     20     d:f16, m:f16, qs[16] (value d*q + m)
Q5_0    32     22     d:f16, qh:u32 (bit i = 5th bit of element i), qs[16]
Q5_1    32     24     d:f16, m:f16, qh:u32, qs[16]
Q8_0    32     34     d:f16, qs[32] int8
Q2_K    256    84     scales[16] (4-bit scale | 4-bit min << 4), qs[64], d:f16, dmin:f16
Q3_K    256    110    hmask[32], qs[64], scales[12] (6-bit packed), d:f16
Q4_K    256    144    d:f16, dmin:f16, scales[12] (6-bit packed), qs[128]
Q5_K    256    176    d:f16, dmin:f16, scales[12] (6-bit packed), qh[32], qs[128]
Q6_K    256    210    ql[128], qh[64], scales[16] int8, d:f16
IQ4_NL  32     18     d:f16, qs[16] (value d * IQ4NL_VALUES[q])
IQ4_XS  256    136    d:f16, scales_h:u16, scales_l[4] (6-bit scales - 32), qs[128]
======  =====  =====  ==============================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from accelplane.errors import ShapeError, TypeMismatchError

QK4_0 = 32
QK8_0 = 32
QK_K = 256
K_SCALE_SIZE = 12
# IQ4_NL / IQ4_XS levels (ggml-common.h: kvalues_iq4nl)
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


class GGMLType(IntEnum):
    """Tensor element types; the value is the GGUF id."""

    # the int's hash (Enum's hashes the name in Python): fast dict lookups (TRAITS), and
    # consistent with == on the GGUF id
    __hash__ = int.__hash__

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ4_NL = 20
    IQ4_XS = 23
    I32 = 26
    BF16 = 30

    @property
    def traits(self) -> TypeTraits:
        return TRAITS[self]

    @property
    def blck_size(self) -> int:
        return TRAITS[self].blck_size

    @property
    def type_size(self) -> int:
        return TRAITS[self].type_size

    @property
    def is_quantized(self) -> bool:
        return TRAITS[self].is_quantized

    @property
    def is_float(self) -> bool:
        return self in (GGMLType.F32, GGMLType.F16, GGMLType.BF16)

    def __str__(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class TypeTraits:
    """Size facts of one type: ``blck_size`` elements take ``type_size`` bytes; a block type's
    ``f16_fields`` are the byte offsets of its f16 scale fields in a block."""

    name: str
    blck_size: int
    type_size: int
    is_quantized: bool
    np_dtype: np.dtype | None  # element dtype of non-block types; None for quant types
    f16_fields: tuple[int, ...] = ()


def _bf16_dtype() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


class _LazyTraits(dict):
    """TRAITS, built on first use so ``import accelplane`` stays cheap (ml_dtypes is lazy)."""

    def __missing__(self, key):
        self._build()
        return dict.__getitem__(self, key)

    def _build(self) -> None:
        T = GGMLType
        self.update(
            {
                T.F32: TypeTraits("f32", 1, 4, False, np.dtype(np.float32)),
                T.F16: TypeTraits("f16", 1, 2, False, np.dtype(np.float16)),
                T.BF16: TypeTraits("bf16", 1, 2, False, _bf16_dtype()),
                T.I32: TypeTraits("i32", 1, 4, False, np.dtype(np.int32)),
                T.Q4_0: TypeTraits("q4_0", QK4_0, 18, True, None, (0,)),
                T.Q4_1: TypeTraits("q4_1", 32, 20, True, None, (0, 2)),
                T.Q5_0: TypeTraits("q5_0", 32, 22, True, None, (0,)),
                T.Q5_1: TypeTraits("q5_1", 32, 24, True, None, (0, 2)),
                T.Q8_0: TypeTraits("q8_0", QK8_0, 34, True, None, (0,)),
                T.Q2_K: TypeTraits("q2_K", QK_K, 84, True, None, (80, 82)),
                T.Q3_K: TypeTraits("q3_K", QK_K, 110, True, None, (108,)),
                T.Q4_K: TypeTraits("q4_K", QK_K, 144, True, None, (0, 2)),
                T.Q5_K: TypeTraits("q5_K", QK_K, 176, True, None, (0, 2)),
                T.Q6_K: TypeTraits("q6_K", QK_K, 210, True, None, (208,)),
                T.IQ4_NL: TypeTraits("iq4_nl", 32, 18, True, None, (0,)),
                T.IQ4_XS: TypeTraits("iq4_xs", QK_K, 136, True, None, (0,)),
            }
        )


TRAITS: dict[GGMLType, TypeTraits] = _LazyTraits()


def parse_type(t: GGMLType | str | int) -> GGMLType:
    """GGMLType from a GGMLType, a name ('q4_0', 'Q4_K', 'f32') or a GGUF id."""
    if isinstance(t, GGMLType):
        return t
    if isinstance(t, str):
        try:
            return GGMLType[t.upper()]
        except KeyError:
            raise TypeMismatchError(
                f"unknown tensor type {t!r}; known: {', '.join(x.name for x in GGMLType)}"
            ) from None
    try:
        return GGMLType(int(t))
    except (ValueError, TypeError):
        raise TypeMismatchError(f"unknown tensor type id {t!r}") from None


def row_size(t: GGMLType, ne0: int) -> int:
    """Bytes of one row of ``ne0`` elements; ne0 must be a multiple of the block size."""
    tr = TRAITS[t]
    if ne0 % tr.blck_size:
        raise ShapeError(f"row of {ne0} elements is not a multiple of {t.name}'s block size {tr.blck_size}")
    return ne0 // tr.blck_size * tr.type_size


def np_dtype(t: GGMLType) -> np.dtype:
    """numpy dtype of a non-block type."""
    dt = TRAITS[t].np_dtype
    if dt is None:
        raise TypeMismatchError(f"{t.name} is a block-quantized type with no numpy element dtype")
    return dt


# --- quantization ------------------------------------------------------------------------
# quantize(t, x) -> uint8 array [..., row_size(t, ne0)]  (rows are the last axis of x)
# dequantize(t, data, ne0) -> float32 array [..., ne0]
# F32/F16/BF16 convert (round to nearest even); I32 is not a float type.
#
# The quantizers follow ggml's reference quantizers (quantize_row_*_ref in ggml-quants.c) step
# by step in float32, vectorized over blocks: C's left-to-right float expressions, sequential
# float sums, ggml's ``nearest_int`` and fp32->fp16 rounding.  On finite input the bytes equal
# ggml's reference output as built for x86-64 without FMA contraction (ggml-base's default).
# They are also the bytes llama.cpp's llama-quantize writes without an importance matrix, for
# every type but IQ4_NL, whose block scales llama-quantize refines (ggml_quantize_chunk) and the
# reference quantizer does not (tests/test_quantized_files.py compares the bytes).

_F32 = np.float32
_GROUP_MAX_EPS = _F32(1e-15)
_NEAREST_INT_MAGIC = _F32(12582912.0)  # 1.5 * 2**23
_K_CHUNK = 256  # blocks per vectorized chunk of the K-quant searches (keeps arrays in cache)


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: round half to even via the 1.5*2**23 trick (bit-exact, int32).

    Out of its range (|v| > 4194303, inf, nan) the result is the same garbage ggml computes.
    """
    b = (v + _NEAREST_INT_MAGIC).view(np.int32)
    b &= 0x007FFFFF
    b -= 0x00400000
    return b


def _nearest_int_f32(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``(float)MAX(lo, MIN(hi, nearest_int(v)))``."""
    return np.clip(_nearest_int(v), lo, hi).astype(np.float32)


def _seqsum(a: np.ndarray, *, from_zero: bool = True) -> np.ndarray:
    """Sum over axis 0 in index order, in float32: C's ``for (...) s += a[i];``.

    ``from_zero`` starts from ``s = 0`` (else from ``s = a[0]``); only the sign of a zero differs.
    """
    acc = a[0] + _F32(0) if from_zero else a[0].copy()
    for i in range(1, a.shape[0]):
        acc += a[i]
    return acc


def _roundf(v: np.ndarray) -> np.ndarray:
    """C ``roundf``: round half away from zero (exact for float32)."""
    t = np.trunc(v)
    return t + np.trunc((v - t) * _F32(2))


def _fp16_bits(v: np.ndarray) -> np.ndarray:
    """ggml's fp32->fp16 (round to nearest even; NaN -> sign|0x7E00) as uint16."""
    h = v.astype(np.float16).view(np.uint16)
    nan = np.isnan(v)
    if nan.any():
        h = np.where(nan, (np.signbit(v).astype(np.uint16) << 15) | np.uint16(0x7E00), h)
    return h.astype("<u2")


def _bf16_bits(v: np.ndarray) -> np.ndarray:
    """ggml's fp32->bf16 (round to nearest even via ml_dtypes; NaN -> quiet, ggml's payload)."""
    h = v.astype(np.dtype(TRAITS[GGMLType.BF16].np_dtype)).view(np.uint16)
    nan = np.isnan(v)
    if nan.any():
        u = v.view(np.uint32)
        h = np.where(nan, ((u >> 16) | 64).astype(np.uint16), h)
    return h.astype("<u2")


def _f16_to_f32(b: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] little-endian fp16 -> float32 [...]."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


# ---- Q8_0 / Q4_0 -------------------------------------------------------------------------


def _quantize_q8_0(xb: np.ndarray) -> np.ndarray:
    """float32 [n, 32] -> uint8 [n, 34] (quantize_row_q8_0_ref)."""
    amax = np.abs(xb).max(axis=1)
    d = amax / _F32(127)
    inv = np.where(d != 0, _F32(1) / d, _F32(0))
    q = _roundf(xb * inv[:, None]).astype(np.int8)
    out = np.empty((xb.shape[0], 34), np.uint8)
    out[:, :2] = _fp16_bits(d).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out


def _absmax_first(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(amax, max) along ``axis``: the greatest |x| and the signed value of its first element,
    as ggml's ``if (ax > amax) { amax = ax; max = x; }`` scan from ``amax = max = 0``."""
    ax = np.abs(x)
    first = np.expand_dims(ax.argmax(axis=axis), axis)
    amax = np.take_along_axis(ax, first, axis).squeeze(axis)
    mx = np.take_along_axis(x, first, axis).squeeze(axis)
    return amax, np.where(amax > 0, mx, _F32(0))  # the scan's max starts at +0


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 [n, 32] of 0..15 -> [n, 16]: element j in the low nibble of byte j, j + 16 high."""
    return q[:, :16] | (q[:, 16:] << 4)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_pack_nibbles`: uint8 [n, 16] -> [n, 32]."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _inverse(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f/d : 0.0f``."""
    return np.where(d != 0, _F32(1) / d, _F32(0))


def _quantize_q4_0(xb: np.ndarray) -> np.ndarray:
    """float32 [n, 32] -> uint8 [n, 18] (quantize_row_q4_0_ref)."""
    n = xb.shape[0]
    d = _absmax_first(xb, 1)[1] / _F32(-8)
    q = np.minimum(np.trunc(xb * _inverse(d)[:, None] + _F32(8.5)).astype(np.int8), 15).astype(np.uint8)
    out = np.empty((n, 18), np.uint8)
    out[:, :2] = _fp16_bits(d).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = _pack_nibbles(q)
    return out


def _quantize_q5_0(xb: np.ndarray) -> np.ndarray:
    """float32 [n, 32] -> uint8 [n, 22] (quantize_row_q5_0_ref)."""
    n = xb.shape[0]
    d = _absmax_first(xb, 1)[1] / _F32(-16)
    q = np.minimum(np.trunc(xb * _inverse(d)[:, None] + _F32(16.5)).astype(np.int8), 31).astype(np.uint8)
    out = np.empty((n, 22), np.uint8)
    out[:, :2] = _fp16_bits(d).view(np.uint8).reshape(-1, 2)
    out[:, 2:6] = _high_bits(q)
    out[:, 6:] = _pack_nibbles(q & 0x0F)
    return out


def _high_bits(q: np.ndarray) -> np.ndarray:
    """uint8 [n, 32] of 0..31 -> the little-endian u32 [n, 4 bytes] whose bit i is q[i]'s bit 4."""
    return np.packbits(q >> 4, axis=1, bitorder="little")


def _min_max_first(xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(min, max) of each row, each the first element of its value (ggml's strict scans, which
    keep the first of equal signed zeros)."""
    rows = np.arange(xb.shape[0])
    return xb[rows, xb.argmin(axis=1)], xb[rows, xb.argmax(axis=1)]


def _quantize_min_32(xb: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 / Q5_1: (d:f16 bits, m:f16 bits, q = (x - min) / d + 0.5 truncated, float32)."""
    mn, mx = _min_max_first(xb)
    d = (mx - mn) / _F32(nmax)
    q = np.trunc((xb - mn[:, None]) * _inverse(d)[:, None] + _F32(0.5))
    return _fp16_bits(d), _fp16_bits(mn), q


def _quantize_q4_1(xb: np.ndarray) -> np.ndarray:
    """float32 [n, 32] -> uint8 [n, 20] (quantize_row_q4_1_ref)."""
    n = xb.shape[0]
    d16, m16, q = _quantize_min_32(xb, 15)
    out = np.empty((n, 20), np.uint8)
    out[:, 0:2] = d16.view(np.uint8).reshape(n, 2)
    out[:, 2:4] = m16.view(np.uint8).reshape(n, 2)
    out[:, 4:] = _pack_nibbles(np.minimum(q.astype(np.int8), 15).astype(np.uint8))
    return out


def _quantize_q5_1(xb: np.ndarray) -> np.ndarray:
    """float32 [n, 32] -> uint8 [n, 24] (quantize_row_q5_1_ref)."""
    n = xb.shape[0]
    d16, m16, q = _quantize_min_32(xb, 31)
    q = q.astype(np.uint8)
    out = np.empty((n, 24), np.uint8)
    out[:, 0:2] = d16.view(np.uint8).reshape(n, 2)
    out[:, 2:4] = m16.view(np.uint8).reshape(n, 2)
    out[:, 4:8] = _high_bits(q)
    out[:, 8:] = _pack_nibbles(q & 0x0F)
    return out


def _dequantize_q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16_to_f32(b[:, :2])
    return b[:, 2:].view(np.int8).astype(np.float32) * d[:, None]


def _dequantize_q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16_to_f32(b[:, :2])
    q = _unpack_nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
    return d[:, None] * q.astype(np.float32)


def _dequantize_q4_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16_to_f32(b[:, 0:2]), _f16_to_f32(b[:, 2:4])
    return d[:, None] * _unpack_nibbles(b[:, 4:]).astype(np.float32) + m[:, None]


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 5-bit quants (uint8 [n, 32]) from qh [n, 4 bytes] and qs [n, 16]."""
    return _unpack_nibbles(qs) | (np.unpackbits(qh, axis=1, bitorder="little") << 4)


def _dequantize_q5_0(b: np.ndarray) -> np.ndarray:
    d = _f16_to_f32(b[:, :2])
    q = _q5_values(b[:, 2:6], b[:, 6:]).astype(np.int8) - np.int8(16)
    return d[:, None] * q.astype(np.float32)


def _dequantize_q5_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16_to_f32(b[:, 0:2]), _f16_to_f32(b[:, 2:4])
    return d[:, None] * _q5_values(b[:, 4:8], b[:, 8:]).astype(np.float32) + m[:, None]


# ---- K-quants with a min: Q2_K, Q4_K, Q5_K -------------------------------------------------


def _make_qkx2_quants(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's make_qkx2_quants over the columns of x [n, S] with weights w (errors summed as
    w * |diff| with ``use_mad``, else w * diff**2).

    Returns (scale [S], the_min [S], L [n, S] float32 in 0..nmax).
    """
    sum_w = _seqsum(w, from_zero=False)
    sum_x = _seqsum(w * x, from_zero=False)
    mx = x.max(axis=0)
    mn = x.min(axis=0)
    mn = np.where(mn > 0, _F32(0), mn)
    degenerate = mx == mn
    fmax = _F32(nmax)

    def error(diff: np.ndarray) -> np.ndarray:
        return _seqsum(w * (np.abs(diff) if use_mad else diff * diff))

    iscale = fmax / (mx - mn)
    scale = _F32(1) / iscale
    L = _nearest_int_f32(iscale * (x - mn), 0, nmax)
    best = error(scale * L + mn - x)
    sums = np.empty((x.shape[0], 3, x.shape[1]), np.float32)
    for step in range(nstep + 1):
        iscale = (_F32(rmin) + _F32(rdelta) * _F32(step) + fmax) / (mx - mn)
        laux = _nearest_int_f32(iscale * (x - mn), 0, nmax)
        wl = np.multiply(w, laux, out=sums[:, 0])
        np.multiply(wl, laux, out=sums[:, 1])
        np.multiply(wl, x, out=sums[:, 2])
        sum_l, sum_l2, sum_xl = _seqsum(sums)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0
        this_min = np.where(pos, _F32(0), this_min)
        this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
        cur = error(this_scale * laux + this_min - x)
        upd = (D > 0) & (cur < best) & ~degenerate
        np.copyto(L, laux, where=upd)
        best = np.where(upd, cur, best)
        scale = np.where(upd, this_scale, scale)
        mn = np.where(upd, this_min, mn)
    L[:, degenerate] = 0
    scale = np.where(degenerate, _F32(0), scale)
    return scale, -mn, L


def _positive_max(v: np.ndarray) -> np.ndarray:
    """Row maxima as ggml scans them, ``if (v > max) max = v`` from 0: NaNs (from overflowing
    x*x) are skipped, and the result is at least +0."""
    m = np.fmax.reduce(v, axis=1)
    return np.where(m > 0, m, _F32(0))


def _absmax_value(v: np.ndarray) -> np.ndarray:
    """The value of greatest |v| of each row, first of equals, NaNs skipped, +0 if none is > 0
    (ggml's ``if (fabsf(v) > amax) { amax = fabsf(v); max = v; }`` from 0)."""
    a = np.abs(v)
    a[np.isnan(a)] = 0
    first = a.argmax(axis=1)
    rows = np.arange(v.shape[0])
    return np.where(a[rows, first] > 0, v[rows, first], _F32(0))


def _f16_value(h: np.ndarray) -> np.ndarray:
    """float32 values of f16 bits (uint16)."""
    return h.view("<f2").astype(np.float32)


def _quantize_k_min(xb: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K (quantize_row_q4_K_ref, quantize_row_q5_K_ref): float32 [n, 256] -> (the
    16 bytes of d, dmin and the 6-bit scales and mins [n, 16], quants uint8 [n, 8, 32] in
    0..nmax, sub-block by sub-block)."""
    n = xb.shape[0]
    s = n * 8
    x = np.ascontiguousarray(xb.reshape(s, 32).T)  # [32, sub-block]
    av_x = np.sqrt(_seqsum(x * x) / _F32(32))
    w = av_x + np.abs(x)
    scales, mins, L = _make_qkx2_quants(x, w, nmax, rmin, 0.1, nstep)
    scales = scales.reshape(n, 8)
    mins = mins.reshape(n, 8)

    max_scale, max_min = _positive_max(scales), _positive_max(mins)
    inv_scale = np.where(max_scale > 0, _F32(63) / max_scale, _F32(0))
    inv_min = np.where(max_min > 0, _F32(63) / max_min, _F32(0))
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales).astype(np.uint8), 63)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins).astype(np.uint8), 63)
    d16 = _fp16_bits(max_scale / _F32(63))
    dmin16 = _fp16_bits(max_min / _F32(63))

    d = (_f16_value(d16)[:, None] * ls.astype(np.float32)).reshape(s)
    dm = (_f16_value(dmin16)[:, None] * lm.astype(np.float32)).reshape(s)
    L2 = _nearest_int_f32((x + dm) / d, 0, nmax)
    np.copyto(L, L2, where=d != 0)  # ggml keeps the search's L where d == 0

    head = np.empty((n, 16), np.uint8)
    head[:, 0:2] = d16.view(np.uint8).reshape(n, 2)
    head[:, 2:4] = dmin16.view(np.uint8).reshape(n, 2)
    head[:, 4:8] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    head[:, 8:12] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    head[:, 12:16] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    return head, L.astype(np.uint8).T.reshape(n, 8, 32)


def _pack_sub_nibbles(q: np.ndarray) -> np.ndarray:
    """Quants [n, 8, 32] of 0..15 -> [n, 128]: sub-blocks 2j and 2j + 1 in the low and high
    nibbles of bytes 32j .. 32j + 31."""
    q = q.reshape(q.shape[0], 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(q.shape[0], 128)


def _unpack_sub_nibbles(qs: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_pack_sub_nibbles`: [n, 128] -> [n, 8, 32]."""
    q = qs.reshape(qs.shape[0], 4, 1, 32)
    return np.concatenate([q & 0x0F, q >> 4], axis=2).reshape(qs.shape[0], 8, 32)


_BIT = np.arange(8, dtype=np.uint8)


def _bit_planes(bits: np.ndarray) -> np.ndarray:
    """bits [n, 8, 32] of 0/1 -> [n, 32]: bit j of byte l is bits[:, j, l] (Q3_K's hmask, Q5_K's qh)."""
    return (bits << _BIT[None, :, None]).sum(axis=1, dtype=np.uint8)


def _unbit_planes(b: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_bit_planes`: [n, 32] -> [n, 8, 32]."""
    return (b[:, None, :] >> _BIT[None, :, None]) & 1


def _quantize_q4_k_chunk(xb: np.ndarray) -> np.ndarray:
    """float32 [n, 256] -> uint8 [n, 144] (quantize_row_q4_K_ref)."""
    head, q = _quantize_k_min(xb, 15, -1.0, 20)
    return np.concatenate([head, _pack_sub_nibbles(q)], axis=1)


def _quantize_q5_k_chunk(xb: np.ndarray) -> np.ndarray:
    """float32 [n, 256] -> uint8 [n, 176] (quantize_row_q5_K_ref)."""
    head, q = _quantize_k_min(xb, 31, -0.5, 15)
    return np.concatenate([head, _bit_planes(q >> 4), _pack_sub_nibbles(q & 0x0F)], axis=1)


def _q4_k_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack Q4_K's 12 scale bytes [n, 12] -> (scales [n, 8], mins [n, 8]) uint8."""
    a, m, hi = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = np.concatenate([a & 0x3F, (hi & 0x0F) | ((a >> 2) & 0x30)], axis=1)
    mins = np.concatenate([m & 0x3F, (hi >> 4) | ((m >> 2) & 0x30)], axis=1)
    return scales, mins


def _dequantize_k_min(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K values d*scale*q - dmin*min of quants q [n, 8, 32] (float32)."""
    n = b.shape[0]
    d = _f16_to_f32(b[:, 0:2])
    dmin = _f16_to_f32(b[:, 2:4])
    sc, m = _q4_k_scale_min(b[:, 4:16])
    dsc = (d[:, None] * sc.astype(np.float32))[:, :, None]
    dm = (dmin[:, None] * m.astype(np.float32))[:, :, None]
    return (dsc * q - dm).reshape(n, QK_K)


def _dequantize_q4_k(b: np.ndarray) -> np.ndarray:
    return _dequantize_k_min(b, _unpack_sub_nibbles(b[:, 16:]).astype(np.float32))


def _dequantize_q5_k(b: np.ndarray) -> np.ndarray:
    q = _unpack_sub_nibbles(b[:, 48:]) | (_unbit_planes(b[:, 16:48]) << 4)
    return _dequantize_k_min(b, q.astype(np.float32))


def _pack_crumbs(L: np.ndarray) -> np.ndarray:
    """2-bit quants [n, 256] -> [n, 64] (Q2_K, Q3_K): byte 32h + l holds elements 128h + l,
    + 32, + 64, + 96 in bits 0-1, 2-3, 4-5, 6-7."""
    q = L.reshape(L.shape[0], 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(L.shape[0], 64)


def _unpack_crumbs(qs: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_pack_crumbs`: [n, 64] -> [n, 256]."""
    q = qs.reshape(qs.shape[0], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return (q & 3).reshape(qs.shape[0], QK_K)


def _quantize_q2_k_chunk(xb: np.ndarray) -> np.ndarray:
    """float32 [n, 256] -> uint8 [n, 84] (quantize_row_q2_K_ref)."""
    n = xb.shape[0]
    s = n * 16
    x = np.ascontiguousarray(xb.reshape(s, 16).T)  # [16, sub-block]
    scales, mins, L = _make_qkx2_quants(x, np.abs(x), 3, -0.5, 0.1, 15, use_mad=True)
    scales = scales.reshape(n, 16)
    mins = mins.reshape(n, 16)
    max_scale, max_min = _positive_max(scales), _positive_max(mins)
    has_s, has_m = max_scale > 0, max_min > 0
    # 4-bit scales and mins, not clipped (ggml's `scales[j] = l`, then `|= l << 4`, as bytes)
    ls = np.where(has_s[:, None], _nearest_int(np.where(has_s, _F32(15) / max_scale, 0)[:, None] * scales), 0)
    lm = np.where(has_m[:, None], _nearest_int(np.where(has_m, _F32(15) / max_min, 0)[:, None] * mins), 0)
    sc = ((ls & 0xFF) | ((lm << 4) & 0xFF)).astype(np.uint8)
    d16 = _fp16_bits(np.where(has_s, max_scale / _F32(15), _F32(0)))
    dmin16 = _fp16_bits(np.where(has_m, max_min / _F32(15), _F32(0)))

    d = (_f16_value(d16)[:, None] * (sc & 0x0F).astype(np.float32)).reshape(s)
    dm = (_f16_value(dmin16)[:, None] * (sc >> 4).astype(np.float32)).reshape(s)
    L2 = _nearest_int_f32((x + dm) / d, 0, 3)
    np.copyto(L, L2, where=d != 0)  # ggml keeps the search's L where d == 0

    out = np.empty((n, 84), np.uint8)
    out[:, 0:16] = sc
    out[:, 16:80] = _pack_crumbs(L.astype(np.uint8).T.reshape(n, QK_K))
    out[:, 80:82] = d16.view(np.uint8).reshape(n, 2)
    out[:, 82:84] = dmin16.view(np.uint8).reshape(n, 2)
    return out


def _dequantize_q2_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    sc = b[:, 0:16]
    d, dmin = _f16_to_f32(b[:, 80:82]), _f16_to_f32(b[:, 82:84])
    dl = (d[:, None] * (sc & 0x0F).astype(np.float32))[:, :, None]
    ml = (dmin[:, None] * (sc >> 4).astype(np.float32))[:, :, None]
    q = _unpack_crumbs(b[:, 16:80]).reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


# ---- Q3_K --------------------------------------------------------------------------------


def _make_q3_quants(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_q3_quants(16, 4, x, L, do_rmse=true) over the columns of x [16, S]: the
    coordinate descent on L, element by element, 5 passes (a pass that changes nothing leaves
    the state for the next pass the same, so ggml's early exit changes no result).

    Returns (scale [S], L [16, S] float32 in 0..7; 0 for all-zero columns).
    """
    amax, mx = _absmax_first(x, 0)
    zero = amax < _GROUP_MAX_EPS
    L = _nearest_int_f32((_F32(-4) / mx) * x, -4, 3)
    w = x * x
    wx = w * x
    sumlx = _seqsum(wx * L)
    suml2 = _seqsum((w * L) * L)
    for _ in range(5):
        for i in range(x.shape[0]):
            li = L[i]
            slx = sumlx - wx[i] * li
            sl2 = suml2 - (w[i] * li) * li
            new = _nearest_int_f32((x[i] * sl2) / slx, -4, 3)
            slx_new = slx + wx[i] * new
            sl2_new = sl2 + (w[i] * new) * new
            upd = (slx > 0) & (new != li) & (sl2_new > 0)
            upd &= (slx_new * slx_new) * suml2 > (sumlx * sumlx) * sl2_new
            L[i] = np.where(upd, new, li)
            sumlx = np.where(upd, slx_new, sumlx)
            suml2 = np.where(upd, sl2_new, suml2)
    scale = np.where(suml2 > 0, sumlx / suml2, _F32(0))
    L += _F32(4)
    L[:, zero] = 0
    return np.where(zero, _F32(0), scale), L


def _quantize_q3_k_chunk(xb: np.ndarray) -> np.ndarray:
    """float32 [n, 256] -> uint8 [n, 110] (quantize_row_q3_K_ref)."""
    n = xb.shape[0]
    s = n * 16
    x = np.ascontiguousarray(xb.reshape(s, 16).T)  # [16, sub-block]
    scales, L = _make_q3_quants(x)
    scales = scales.reshape(n, 16)
    max_scale = _absmax_value(scales)
    nz = max_scale != 0
    iscale = _F32(-32) / max_scale
    # ggml's `int8_t l = nearest_int(..)`: the int is cut to 8 bits before the clamp
    l6 = np.clip(_nearest_int(iscale[:, None] * scales).astype(np.int8).astype(np.int32), -32, 31) + 32
    l6 = np.where(nz[:, None], l6, 0).astype(np.uint8)
    d16 = _fp16_bits(np.where(nz, _F32(1) / iscale, _F32(0)))

    d = (_f16_value(d16)[:, None] * (l6.astype(np.float32) - _F32(32))).reshape(s)
    L2 = _nearest_int_f32(x / d, -4, 3) + _F32(4)
    np.copyto(L, L2, where=d != 0)  # ggml keeps the search's L where d == 0
    q = L.astype(np.uint8).T.reshape(n, QK_K)
    high = q >> 2  # 1 for 4..7

    out = np.empty((n, 110), np.uint8)
    out[:, 0:32] = _bit_planes(high.reshape(n, 8, 32))
    out[:, 32:96] = _pack_crumbs(q & 3)
    top = (l6 >> 4).reshape(n, 4, 4)  # [j // 4, j % 4]
    out[:, 96:104] = (l6[:, 0:8] & 0x0F) | ((l6[:, 8:16] & 0x0F) << 4)
    out[:, 104:108] = top[:, 0] | (top[:, 1] << 2) | (top[:, 2] << 4) | (top[:, 3] << 6)
    out[:, 108:110] = d16.view(np.uint8).reshape(n, 2)
    return out


def _dequantize_q3_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    sb = b[:, 96:108]
    d = _f16_to_f32(b[:, 108:110])
    low = np.concatenate([sb[:, 0:8] & 0x0F, sb[:, 0:8] >> 4], axis=1)
    top = (sb[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)) & 3
    sc = (low | (top.reshape(n, 16) << 4)).astype(np.int8) - np.int8(32)
    dl = (d[:, None] * sc.astype(np.float32))[:, :, None]
    offset = ((_unbit_planes(b[:, 0:32]).reshape(n, QK_K) ^ 1) << 2).astype(np.int8)  # 4 unless hmask
    q = _unpack_crumbs(b[:, 32:96]).astype(np.int8) - offset
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


# ---- Q6_K --------------------------------------------------------------------------------


def _make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_qx_quants(rmse_type=1, qw=NULL) over the columns of x [n, S].

    Returns (scale [S], L [n, S] float32 in 0..2*nmax-1; 0 for all-zero columns).
    """
    s = x.shape[1]
    ax = np.abs(x)
    first = ax.argmax(axis=0)  # first element of greatest |x|
    cols = np.arange(s)
    amax = ax[first, cols]
    mx = x[first, cols]
    zero = amax < _GROUP_MAX_EPS
    w = x * x
    wx = w * x
    fmax = _F32(nmax)
    sums = np.empty((x.shape[0], 2, s), np.float32)

    def sums_for(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        l = _nearest_int_f32(iscale * x, -nmax, nmax - 1)
        np.multiply(wx, l, out=sums[:, 0])
        np.multiply(w, l, out=sums[:, 1])
        sums[:, 1] *= l
        sumlx, suml2 = _seqsum(sums)
        return l, sumlx, suml2

    L, sumlx, suml2 = sums_for(-fmax / mx)
    scale = np.where(suml2 != 0, sumlx / suml2, _F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        l, sumlx, suml2 = sums_for(-(fmax + _F32(0.1) * _F32(step)) / mx)
        upd = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        np.copyto(L, l, where=upd)
        scale = np.where(upd, sumlx / suml2, scale)
        best = np.where(upd, scale * sumlx, best)
    L += fmax
    L[:, zero] = 0
    return np.where(zero, _F32(0), scale), L


def _quantize_q6_k_chunk(xb: np.ndarray) -> np.ndarray:
    """float32 [n, 256] -> uint8 [n, 210] (quantize_row_q6_K_ref)."""
    n = xb.shape[0]
    s = n * 16
    x = np.ascontiguousarray(xb.reshape(s, 16).T)  # [16, sub-block]
    scales, L = _make_qx_quants_rmse1(x, 32)
    scales = scales.reshape(n, 16)

    rows = np.arange(n)
    abs_scales = np.abs(scales)
    abs_scales[np.isnan(abs_scales)] = 0  # ggml's strict '>' scan skips NaNs
    first = abs_scales.argmax(axis=1)
    max_abs = abs_scales[rows, first]
    max_scale = scales[rows, first]
    zero = max_abs < _GROUP_MAX_EPS
    iscale = _F32(-128) / max_scale
    d16 = _fp16_bits(_F32(1) / iscale)
    sc = np.minimum(_nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
    d = (d16.view("<f2").astype(np.float32)[:, None] * sc.astype(np.float32)).reshape(s)
    L2 = _nearest_int_f32(x / d, -32, 31) + _F32(32)
    np.copyto(L, L2, where=d != 0)  # ggml keeps the search's L where d == 0
    q = L.astype(np.uint8).T.reshape(n, 2, 4, 32)

    out = np.empty((n, 210), np.uint8)
    ql = out[:, 0:128].reshape(n, 2, 2, 32)
    ql[:, :, 0] = (q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4)
    ql[:, :, 1] = (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)
    qh = out[:, 128:192].reshape(n, 2, 32)
    qh[:] = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2)
    qh |= ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d16.view(np.uint8).reshape(n, 2)
    out[zero] = 0
    return out


def _dequantize_q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 1, 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16_to_f32(b[:, 208:210])
    lo = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 8, 32)
    hi = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (lo | (hi.reshape(n, 8, 32) << 4)).astype(np.int8) - np.int8(32)
    dsc = (d[:, None] * sc)[:, :, None]
    return (dsc * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


# ---- public API --------------------------------------------------------------------------


# ---- IQ4_NL / IQ4_XS ---------------------------------------------------------------------

_IQ4_LEVELS = np.array(IQ4NL_VALUES, np.float32)
# the first level above f, for each integer f from -127 to 113, in 1..15: the levels are integers,
# so the first level above v is the first above floor(v)
_IQ4_ABOVE = np.searchsorted(_IQ4_LEVELS, np.arange(-127, 114, dtype=np.float32), side="right").clip(1, 15)


def _iq4_index(v: np.ndarray) -> np.ndarray:
    """ggml's best_index_int8(16, kvalues_iq4nl, v): between the levels either side of v, the
    lower where v - lower < upper - v (float32), else the upper (uint8); the ends for v outside
    the levels and the top one for NaN."""
    f = np.nan_to_num(np.floor(v), nan=113.0, posinf=113.0, neginf=-127.0)
    mu = _IQ4_ABOVE[np.clip(f, -127, 113).astype(np.intp) + 127]
    lower = (v - _IQ4_LEVELS[mu - 1]) < (_IQ4_LEVELS[mu] - v)
    return (mu - lower).astype(np.uint8)


def _iq4_sums(x: np.ndarray, w: np.ndarray, iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(L, sum w q x, sum w q q) of x [32, S] at inverse scale iscale [S] (sums in index order)."""
    L = _iq4_index(iscale * x)
    q = _IQ4_LEVELS[L]
    wq = w * q
    return L, _seqsum(wq * x), _seqsum(wq * q)


def _iq4_search(x: np.ndarray, ntry: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_iq4_nl_impl's scale search (no importance weights: w = x*x) over the
    columns of x [32, S]: a first scale from the signed max, then, for ntry > 0, inverse scales
    (t - 127) / max for t in -ntry..ntry, keeping the best weighted fit.

    Returns (scale [S], L [32, S] of the first scale, zero [S]: blocks of |x| < 1e-15, scale 0).
    """
    amax, mx = _absmax_first(x, 0)
    zero = amax < _GROUP_MAX_EPS
    w = x * x
    lv0 = _IQ4_LEVELS[0]
    d = (-mx) / lv0 if ntry > 0 else mx / lv0
    L, sumqx, sumq2 = _iq4_sums(x, w, _F32(1) / d)
    d = np.where(sumq2 > 0, sumqx / sumq2, _F32(0))
    best = d * sumqx
    for itry in range(-ntry, ntry + 1):
        _, sumqx, sumq2 = _iq4_sums(x, w, _F32(itry + IQ4NL_VALUES[0]) / mx)
        upd = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = np.where(upd, sumqx / sumq2, d)
        best = np.where(upd, d * sumqx, best)
    return np.where(zero, _F32(0), d), L, zero


def _quantize_iq4_nl_chunk(xb: np.ndarray) -> np.ndarray:
    """float32 [n, 32] -> uint8 [n, 18] (quantize_row_iq4_nl_ref: one scale per block, no
    refinement); the quants of all-zero blocks are left 0 (see _quantize_iq4_nl)."""
    n = xb.shape[0]
    scale, L, zero = _iq4_search(np.ascontiguousarray(xb.T), -1)
    L[:, zero] = 0
    out = np.empty((n, 18), np.uint8)
    out[:, :2] = _fp16_bits(scale).view(np.uint8).reshape(n, 2)
    out[:, 2:] = _pack_nibbles(L.T)
    return out


def _quantize_iq4_nl(x3: np.ndarray) -> np.ndarray:
    """float32 [rows, nb, 32] -> uint8 [rows * nb, 18]. ggml skips a block of |x| < 1e-15
    (d = 0) without writing its quants buffer, so such a block repeats the quants of the block
    before it in the row; before any other block of the row ggml's are undefined, ours 0."""
    rows, nb = x3.shape[:2]
    out = _chunked(_quantize_iq4_nl_chunk, 4096)(x3.reshape(-1, 32)).reshape(rows, nb, 18)
    zero = np.abs(x3).max(axis=2) < _GROUP_MAX_EPS
    if zero.any():
        last = np.maximum.accumulate(np.where(zero, -1, np.arange(nb)), axis=1)
        r, b = np.nonzero(zero & (last >= 0))
        out[r, b, 2:] = out[r, last[r, b], 2:]
    return out.reshape(rows * nb, 18)


def _quantize_iq4_xs_chunk(xb: np.ndarray) -> np.ndarray:
    """float32 [n, 256] -> uint8 [n, 136] (quantize_row_iq4_xs_ref: quantize_iq4_xs without
    importance weights, 7 refinement steps)."""
    n = xb.shape[0]
    s = n * 8
    x = np.ascontiguousarray(xb.reshape(s, 32).T)  # [32, sub-block]
    scales = _iq4_search(x, 7)[0].reshape(n, 8)
    d = -_absmax_value(scales) / _F32(32)
    ls = np.clip(_nearest_int(_inverse(d)[:, None] * scales), -32, 31)
    dl = (d[:, None] * ls.astype(np.float32)).reshape(s)
    L = _iq4_index(_inverse(dl) * x)  # the float d, not its f16 rounding, as ggml
    ls = (ls + 32).astype(np.uint8)
    out = np.empty((n, 136), np.uint8)
    out[:, 0:2] = _fp16_bits(d).view(np.uint8).reshape(n, 2)
    high = (ls >> 4).astype("<u2") << (2 * np.arange(8, dtype="<u2"))
    out[:, 2:4] = high.sum(axis=1, dtype="<u2").view(np.uint8).reshape(n, 2)
    out[:, 4:8] = (ls[:, 0::2] & 0x0F) | ((ls[:, 1::2] & 0x0F) << 4)
    out[:, 8:] = _pack_nibbles(L.T).reshape(n, 128)
    return out


def _dequantize_iq4_nl(b: np.ndarray) -> np.ndarray:
    return _f16_to_f32(b[:, :2])[:, None] * _IQ4_LEVELS[_unpack_nibbles(b[:, 2:])]


def _iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    """The 8 signed 6-bit sub-block scales (int8, 32 subtracted) of IQ4_XS blocks b."""
    high = np.ascontiguousarray(b[:, 2:4]).view("<u2") >> (2 * np.arange(8, dtype="<u2"))
    low = np.stack([b[:, 4:8] & 0x0F, b[:, 4:8] >> 4], axis=2).reshape(-1, 8)
    return (low | ((high & 3).astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)


def _dequantize_iq4_xs(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl = _f16_to_f32(b[:, :2])[:, None] * _iq4_xs_scales(b).astype(np.float32)
    q = _IQ4_LEVELS[_unpack_nibbles(b[:, 8:].reshape(n * 8, 16))].reshape(n, 8, 32)
    return (dl[:, :, None] * q).reshape(n, QK_K)


def _chunked(fn: Callable[[np.ndarray], np.ndarray], size: int) -> Callable[[np.ndarray], np.ndarray]:
    """Apply a block quantizer to ``size`` blocks at a time (bounded temporaries)."""

    def run(xb: np.ndarray) -> np.ndarray:
        return np.concatenate([fn(xb[i : i + size]) for i in range(0, xb.shape[0], size)])

    return run


_QUANTIZERS = {
    GGMLType.Q8_0: _quantize_q8_0,
    GGMLType.Q4_0: _quantize_q4_0,
    GGMLType.Q4_1: _quantize_q4_1,
    GGMLType.Q5_0: _quantize_q5_0,
    GGMLType.Q5_1: _quantize_q5_1,
    GGMLType.Q2_K: _chunked(_quantize_q2_k_chunk, _K_CHUNK),
    GGMLType.Q3_K: _chunked(_quantize_q3_k_chunk, _K_CHUNK),
    GGMLType.Q4_K: _chunked(_quantize_q4_k_chunk, _K_CHUNK),
    GGMLType.Q5_K: _chunked(_quantize_q5_k_chunk, _K_CHUNK),
    GGMLType.Q6_K: _chunked(_quantize_q6_k_chunk, _K_CHUNK),
    GGMLType.IQ4_XS: _chunked(_quantize_iq4_xs_chunk, _K_CHUNK),
}

_DEQUANTIZERS = {
    GGMLType.Q8_0: _dequantize_q8_0,
    GGMLType.Q4_0: _dequantize_q4_0,
    GGMLType.Q4_1: _dequantize_q4_1,
    GGMLType.Q5_0: _dequantize_q5_0,
    GGMLType.Q5_1: _dequantize_q5_1,
    GGMLType.Q2_K: _dequantize_q2_k,
    GGMLType.Q3_K: _dequantize_q3_k,
    GGMLType.Q4_K: _dequantize_q4_k,
    GGMLType.Q5_K: _dequantize_q5_k,
    GGMLType.Q6_K: _dequantize_q6_k,
    GGMLType.IQ4_NL: _dequantize_iq4_nl,
    GGMLType.IQ4_XS: _dequantize_iq4_xs,
}


def _check_convertible(t: GGMLType) -> GGMLType:
    t = parse_type(t)
    if t is GGMLType.I32:
        raise TypeMismatchError("i32 is not a float type; it cannot be (de)quantized")
    return t


def quantize(t: GGMLType, x: np.ndarray) -> np.ndarray:
    """Encode float rows as type ``t``, byte-exact with ggml's reference quantizers.

    ``x``: float array [..., ne0] (any real dtype; converted to float32 first). Returns uint8
    [..., row_size(t, ne0)]. F16/BF16 round to nearest even (NaN as ggml). Raises ShapeError if
    ``x`` is 0-d or ne0 is not a multiple of the block size, TypeMismatchError for I32 or
    non-real input. Block types: non-finite input does not raise but its bytes are unspecified.
    """
    t = _check_convertible(t)
    arr = np.asarray(x)
    if arr.dtype.kind in "cOSUMm":
        raise TypeMismatchError(f"cannot quantize an array of dtype {arr.dtype} (need real floats)")
    if arr.ndim == 0:
        raise ShapeError("quantize needs an array with at least one axis (rows on the last axis)")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    ne0 = arr.shape[-1]
    rs = row_size(t, ne0)
    lead = arr.shape[:-1]
    with np.errstate(all="ignore"):
        if t is GGMLType.F32:
            out = arr.astype("<f4").view(np.uint8)
        elif t is GGMLType.F16:
            out = _fp16_bits(arr).view(np.uint8)
        elif t is GGMLType.BF16:
            out = _bf16_bits(arr).view(np.uint8)
        else:
            blocks = arr.reshape(-1, t.blck_size)
            if blocks.shape[0] == 0:
                out = np.empty((0, t.type_size), np.uint8)
            elif t is GGMLType.IQ4_NL:  # its zero blocks depend on the row's blocks before them
                out = _quantize_iq4_nl(arr.reshape(-1, ne0 // 32, 32))
            else:
                out = _QUANTIZERS[t](blocks)
    return np.ascontiguousarray(out).reshape(*lead, rs)


def _as_bytes(data: np.ndarray | bytes | bytearray | memoryview) -> np.ndarray:
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            if data.dtype.itemsize != 1 or data.dtype.kind not in "iub":
                raise TypeMismatchError(f"quantized data must be uint8 bytes, got {data.dtype}")
            data = data.view(np.uint8)
        return np.ascontiguousarray(data)
    try:
        return np.frombuffer(data, dtype=np.uint8)
    except TypeError:
        raise TypeMismatchError(
            f"quantized data must be a uint8 array or bytes-like, got {type(data).__name__}"
        ) from None


def dequantize(t: GGMLType, data: np.ndarray | bytes | bytearray | memoryview, ne0: int) -> np.ndarray:
    """Decode rows of type ``t`` to float32, bit-identical to ggml / gguf.quants.dequantize.

    ``data``: uint8 [..., row_size(t, ne0)] -> float32 [..., ne0]. A 1-D array or bytes-like
    object may hold several whole rows; it decodes to a flat float32 [n_rows * ne0]. Raises
    ShapeError if ne0 is not a multiple of the block size or the byte length does not fit,
    TypeMismatchError for I32 or data that is not bytes.
    """
    t = _check_convertible(t)
    ne0 = int(ne0)
    if ne0 < 0:
        raise ShapeError(f"ne0 must be >= 0, got {ne0}")
    rs = row_size(t, ne0)
    buf = _as_bytes(data)
    if buf.ndim == 0:
        raise ShapeError("dequantize needs an array with at least one axis")
    if buf.ndim == 1:
        if (rs == 0 and buf.size) or (rs and buf.size % rs):
            raise ShapeError(
                f"{buf.size} bytes is not a whole number of {t.name} rows of {ne0} elements ({rs} bytes each)"
            )
        out_shape: tuple[int, ...] = ((buf.size // rs if rs else 0) * ne0,)
    else:
        if buf.shape[-1] != rs:
            raise ShapeError(
                f"last axis has {buf.shape[-1]} bytes but a {t.name} row of {ne0} elements takes {rs} bytes"
            )
        out_shape = (*buf.shape[:-1], ne0)
    if t is GGMLType.F32:
        return buf.view("<f4").astype(np.float32).reshape(out_shape)
    if t is GGMLType.F16:
        return buf.view("<f2").astype(np.float32).reshape(out_shape)
    if t is GGMLType.BF16:
        return (buf.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(out_shape)
    blocks = buf.reshape(-1, t.type_size)
    if blocks.shape[0] == 0:
        return np.empty(out_shape, np.float32)
    with np.errstate(all="ignore"):
        return _DEQUANTIZERS[t](blocks).reshape(out_shape)
