"""Tensor data in and out of a plugin's memory (ggml_backend_tensor_set/get): bytes, and
numpy arrays converted, quantized and dequantized on the way. ``Tensor.set``/``get``/
``set_bytes``/``get_bytes`` are these functions; the buffer hooks they call, and their
fallbacks, are in :mod:`accelplane.runtime.backend`."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from accelplane.core import tensor as _tensor
from accelplane.core.tensor import Tensor, strided_view
from accelplane.core.types import GGMLType, dequantize, np_dtype, quantize
from accelplane.errors import (
    BufferFreedError,
    DataError,
    DeviceError,
    OutOfRangeError,
    ShapeError,
    TypeMismatchError,
)

if TYPE_CHECKING:
    from accelplane.runtime.backend import Buffer


def check_range(t: Tensor, offset: int, size: int) -> Buffer:
    """The tensor's buffer, after checking that it is allocated, not freed, and that bytes
    ``[offset, offset + size)`` lie inside the tensor."""
    buf = t.buffer
    if buf is None:
        raise DeviceError(f"tensor {t.name or t.uid!r} is not allocated in any buffer")
    if buf.freed:
        raise BufferFreedError(f"tensor {t.name or t.uid!r}: its buffer {buf.name!r} was freed")
    if offset < 0 or size < 0 or offset + size > t.nbytes:
        raise OutOfRangeError(
            f"tensor {t.name or t.uid!r}: bytes [{offset}, {offset + size}) are outside "
            f"its {t.nbytes} bytes"
        )
    return buf


def set_bytes(t: Tensor, data: bytes | bytearray | memoryview | np.ndarray, offset: int = 0) -> None:
    """Write raw bytes at byte ``offset`` of the tensor's data."""
    arr = as_u8(data)
    buf = check_range(t, offset, arr.size)
    if arr.size:
        buf.set_tensor(t, arr, offset, arr.size)


def get_bytes(t: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
    """Raw bytes of the tensor's data, in a new uint8 array."""
    size = t.nbytes - offset if size is None else size
    buf = check_range(t, offset, size)
    out = np.empty(size, np.uint8)
    if size:
        buf.get_tensor(t, out, offset, size)
    return out


def set(t: Tensor, value: Any) -> None:  # noqa: A001 - Tensor.set's implementation
    """Write a numpy-compatible array of ``t.shape`` (a flat array of as many values will do),
    converted and quantized to the tensor's type.

    Float types take any real numbers (F16/BF16 round to nearest; values past their range
    become infinities, as in numpy and ggml). Block-quantized types reject NaN and infinity
    with DataError: ggml's quantizers take the block's scale from its largest magnitude, so one
    such value silently turns its whole block (32 or 256 values) into zeros or NaN. Integer
    types reject values outside their range and fractions (DataError) rather than wrap or
    truncate them. Non-numeric arrays raise TypeMismatchError."""
    arr = _numeric(value, t)
    if arr.shape != t.shape and arr.size == t.nelements and arr.ndim <= 1:
        arr = arr.reshape(t.shape)
    if arr.shape != t.shape:
        raise ShapeError(
            f"tensor {t.name or t.uid!r}: cannot set an array of shape {arr.shape} into a tensor "
            f"of shape {t.shape}"
        )
    full = arr.reshape(tuple(reversed(t.ne)))
    if t.type.is_quantized:
        raw = quantize(t.type, _finite(full, t))
    elif t.type.is_float:
        with np.errstate(over="ignore"):  # past the type's range: infinity, as documented
            raw = np.ascontiguousarray(full, dtype=np_dtype(t.type))
    else:
        raw = _integers(full, np_dtype(t.type), t)
    if t.is_contiguous():
        set_bytes(t, raw.reshape(-1).view(np.uint8))
        return
    # strided: read-modify-write the byte span through a strided numpy view
    span = get_bytes(t)
    strided_view(t, span)[...] = raw
    set_bytes(t, span)


def get(t: Tensor) -> np.ndarray:
    """A new numpy array of ``t.shape`` with the tensor's values (dequantized to f32)."""
    span = get_bytes(t)
    view = strided_view(t, span)
    if t.type.is_quantized:
        out = dequantize(t.type, np.ascontiguousarray(view), t.ne[0])
    else:
        out = np.array(view)
    return out.reshape(t.shape)


def as_u8(data: Any) -> np.ndarray:
    """``data`` (bytes, a buffer, any contiguous or not numpy array) as a flat uint8 array."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(data).cast("B"), np.uint8)


def _numeric(value: Any, t: Tensor) -> np.ndarray:
    """``value`` as a numpy array of real numbers, else TypeMismatchError."""
    name = t.name or t.uid
    try:
        arr = np.asarray(value)
        if arr.dtype.kind == "O":  # Python ints past 64 bits and the like: as numbers, if they are
            arr = arr.astype(np.float64)
    except (ValueError, TypeError, OverflowError) as e:  # ragged sequences, objects
        raise TypeMismatchError(f"tensor {name!r}: the value is not an array of numbers ({e})") from None
    if arr.dtype.kind not in "biuf" and arr.dtype != np_dtype(GGMLType.BF16):  # ml_dtypes' bfloat16
        raise TypeMismatchError(f"tensor {name!r}: values of dtype {arr.dtype} are not real numbers")
    return arr


def _finite(x: np.ndarray, t: Tensor) -> np.ndarray:
    """``x`` as float32 for quantizing, or DataError naming the first non-finite value."""
    x = np.ascontiguousarray(x, np.float32)
    bad = ~np.isfinite(x)
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0][::-1])
        raise DataError(
            f"tensor {t.name or t.uid!r} ({t.type.name}): {x[bad][0]} at ggml index {list(i)} "
            f"cannot be quantized ({int(bad.sum())} non-finite values); a block-quantized type "
            "holds finite values only"
        )
    return x


def _integers(x: np.ndarray, dt: np.dtype, t: Tensor) -> np.ndarray:
    """``x`` converted to the integer dtype ``dt``, or DataError for values it cannot hold."""
    info = np.iinfo(dt)
    if x.dtype.kind == "f" and (not np.isfinite(x).all() or (x != np.trunc(x)).any()):
        raise DataError(f"tensor {t.name or t.uid!r} ({dt}): values must be whole numbers")
    if x.size and (x.min() < info.min or x.max() > info.max):
        raise DataError(
            f"tensor {t.name or t.uid!r} ({dt}): values outside [{info.min}, {info.max}] "
            f"(min {x.min()}, max {x.max()})"
        )
    return np.ascontiguousarray(x, dtype=dt)


_tensor.DATA = sys.modules[__name__]  # Tensor's data methods delegate here
