"""Tensor: a ggml-style 4-D tensor description (type, ne[4], nb[4], op, sources, view, placement).

Two views of the same object:

* plugin code reads ``t.ne`` / ``t.nb`` exactly as ggml's (``ne[0]`` innermost, strides in bytes)
  and ``t.op_params`` laid out as ggml's op_params;
* host code reads ``t.shape`` / ``t.strides`` numpy-ordered (outermost first) and moves data with
  ``t.set(array)`` / ``t.get()`` / ``np.asarray(t)``.

Invariant (llama.cpp #22197): a view never owns memory: ``t.buffer`` of a view is always its
``view_src``'s buffer, and ``t.offs == view_src.offs + view_offs``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from enum import IntFlag
from typing import TYPE_CHECKING, Any

import numpy as np

from accelplane.core.types import TRAITS, GGMLType, np_dtype, parse_type, row_size
from accelplane.errors import DeviceError, ShapeError

if TYPE_CHECKING:
    from accelplane.core.ops import Op
    from accelplane.runtime.backend import Buffer

GGML_MAX_DIMS = 4
_ids = itertools.count()


class TensorFlag(IntFlag):
    NONE = 0
    INPUT = 1  # graph input: allocated first, never overwritten by the allocator
    OUTPUT = 2  # graph output: never freed or reused by the allocator
    PARAM = 4  # a weight (model parameter)
    # a scheduler clone of a node that owns its memory: the same node reading copied inputs, a
    # view of the original writing the original's memory (accelplane.core.fusion treats it as owning
    # that memory; clones of in-place ops such as SET_ROWS stay plain views)
    CLONE = 8


def _check_strides(t: GGMLType, ne: tuple[int, ...], nb: tuple[int, ...], name: str) -> None:
    """ShapeError unless ``nb`` are strides a kernel may trust: 4 of them, none negative (ggml's
    are unsigned), element strides whole elements, block types whole blocks and rows."""
    if len(nb) != GGML_MAX_DIMS:
        raise ShapeError(f"tensor {name!r}: nb needs {GGML_MAX_DIMS} strides, got {list(nb)}")
    if min(nb) < 0:
        raise ShapeError(f"tensor {name!r}: negative stride in nb={list(nb)} (strides are byte "
                         "offsets >= 0, as in ggml)")  # fmt: skip
    tr = TRAITS[t]
    if tr.blck_size > 1:
        if ne[0] % tr.blck_size:
            raise ShapeError(f"tensor {name!r}: ne0={ne[0]} not a multiple of {t.name} block")
        if nb[0] != tr.type_size:
            raise ShapeError(f"tensor {name!r}: nb0={nb[0]} of a {t.name} tensor must be its block "
                             f"size {tr.type_size}")  # fmt: skip
    elif tr.type_size > 1 and (nb[0] % tr.type_size or nb[1] % tr.type_size or nb[2] % tr.type_size
                               or nb[3] % tr.type_size):  # fmt: skip
        raise ShapeError(f"tensor {name!r}: strides nb={list(nb)} are not whole {t.name} elements "
                         f"({tr.type_size} bytes)")  # fmt: skip


def _check_extent(v: Tensor, owner: Tensor) -> None:
    """ShapeError unless view ``v`` (offset, ne, nb) lies inside its memory owner."""
    es = TRAITS[v.type].type_size if TRAITS[v.type].blck_size == 1 else 1
    if v.view_offs < 0 or v.view_offs % es or v.view_offs + v.nbytes > owner.nbytes:
        what = v.name or (v.op.name if v.op is not None else "view")
        raise ShapeError(
            f"view {what!r}: bytes [{v.view_offs}, {v.view_offs + v.nbytes}) (offset, ne="
            f"{list(v.ne)}, nb={list(v.nb)}) are not inside the {owner.nbytes} bytes of "
            f"{owner.name or owner.uid!r}" + (" (the offset is not a whole element)"
                                              if v.view_offs % es else "")
        )  # fmt: skip


KEEP_FLAGS = TensorFlag.INPUT | TensorFlag.OUTPUT | TensorFlag.PARAM


def memory_owner(t: Tensor) -> Tensor:
    """The tensor whose memory ``t`` is: its ``view_src`` (a view's is always the memory owner,
    never another view), else ``t`` itself."""
    return t.view_src if t.view_src is not None else t


def owners_to_keep(tensors: Iterable[Tensor], kept: Iterable[Tensor] = ()) -> frozenset[int]:
    """ids of the memory owners (:func:`memory_owner`) that an allocation must keep alive to
    the end of the graph and never hand to another node: the owner of every tensor of
    ``tensors`` flagged INPUT, OUTPUT or PARAM, and of every tensor of ``kept``. A view that
    is a graph output thus keeps the tensor it views."""
    ids = {id(memory_owner(t)) for t in tensors if t.flags & KEEP_FLAGS}
    ids.update(id(memory_owner(t)) for t in kept)
    return frozenset(ids)


def contiguous_strides(type_: GGMLType, ne: tuple[int, int, int, int]) -> tuple[int, ...]:
    """ggml's strides of a contiguous tensor of ``ne`` (bytes; row 0 is a packed row)."""
    tr = TRAITS[type_]
    nb0 = tr.type_size
    nb1 = row_size(type_, ne[0])
    nb2 = nb1 * ne[1]
    nb3 = nb2 * ne[2]
    return (nb0, nb1, nb2, nb3)


class Tensor:
    """A node or leaf of a compute graph. Create them through a :class:`~accelplane.core.graph.Context`.

    Attributes are ggml's: ``type``, ``ne``, ``nb``, ``op``, ``op_params``, ``src``,
    ``view_src``, ``view_offs``, ``buffer`` (a Buffer handle or None), ``offs`` (byte offset of
    element 0 in the buffer), ``flags``, ``name``; ``extra`` is free for the plugin that owns
    the buffer (ggml's tensor->extra); ``ndim`` is the host-facing rank.
    """

    __slots__ = (
        "type", "ne", "nb", "op", "op_params", "src", "view_src", "view_offs",
        "buffer", "offs", "flags", "name", "extra", "ndim", "uid", "__weakref__",
    )  # fmt: skip

    def __init__(
        self,
        type_: GGMLType | str | int,
        ne: tuple[int, ...],
        nb: tuple[int, ...] | None = None,
        *,
        op: Op | None = None,
        op_params: tuple = (),
        src: tuple[Tensor | None, ...] = (),
        view_src: Tensor | None = None,
        view_offs: int = 0,
        name: str = "",
        ndim: int | None = None,
    ) -> None:
        t = type_ if type(type_) is GGMLType else parse_type(type_)
        ne = tuple(map(int, ne))
        if len(ne) > GGML_MAX_DIMS:
            raise ShapeError(f"tensor {name!r}: at most 4 dimensions, got {len(ne)}")
        if ne and min(ne) < 0:
            raise ShapeError(f"tensor {name!r}: negative dimension in ne={ne}")
        ndim = len(ne) if ndim is None else ndim
        if len(ne) < GGML_MAX_DIMS:
            ne = ne + (1,) * (GGML_MAX_DIMS - len(ne))
        if nb is None:
            nb = contiguous_strides(t, ne)  # raises ShapeError on a partial block
        else:
            nb = tuple(map(int, nb))
            _check_strides(t, ne, nb, name)
        self.type = t
        self.ne: tuple[int, int, int, int] = ne  # type: ignore[assignment]
        self.nb: tuple[int, int, int, int] = nb  # type: ignore[assignment]
        self.op = op
        self.op_params = op_params
        self.src = src
        self.view_src = view_src
        self.view_offs = view_offs
        self.buffer: Buffer | None = None
        self.offs = 0
        self.flags = TensorFlag.NONE
        self.name = name
        self.extra: Any = None
        self.ndim = max(0, min(ndim, GGML_MAX_DIMS))
        self.uid = next(_ids)
        if view_src is not None:
            # a view of a view points at the memory owner (ggml does the same)
            while view_src.view_src is not None:
                self.view_offs += view_src.view_offs
                view_src = view_src.view_src
            self.view_src = view_src
            _check_extent(self, view_src)
            if view_src.buffer is not None:
                self.buffer = view_src.buffer
                self.offs = view_src.offs + self.view_offs

    # --- ggml facts --------------------------------------------------------------------
    @property
    def nelements(self) -> int:
        n0, n1, n2, n3 = self.ne
        return n0 * n1 * n2 * n3

    @property
    def nrows(self) -> int:
        return self.ne[1] * self.ne[2] * self.ne[3]

    @property
    def nbytes(self) -> int:
        """ggml_nbytes: the byte span from element 0 to the end of the last element."""
        n0, n1, n2, n3 = self.ne
        if n0 <= 0 or n1 <= 0 or n2 <= 0 or n3 <= 0:
            return 0
        tr = TRAITS[self.type]
        b0, b1, b2, b3 = self.nb
        rest = (n1 - 1) * b1 + (n2 - 1) * b2 + (n3 - 1) * b3
        if tr.blck_size == 1:
            return tr.type_size + (n0 - 1) * b0 + rest
        return n0 * b0 // tr.blck_size + rest

    @property
    def row_bytes(self) -> int:
        return row_size(self.type, self.ne[0])

    def is_contiguous(self) -> bool:
        """Packed in ggml order, ignoring strides of dimensions of size 1 (ggml_is_contiguous)."""
        nxt = TRAITS[self.type].type_size
        for i in range(4):
            if self.ne[i] != 1:
                if self.nb[i] != nxt:
                    return False
                nxt *= self.ne[i] if i else self.ne[0] // TRAITS[self.type].blck_size
            elif i == 0:
                nxt = row_size(self.type, self.ne[0])
        return True

    def is_contiguous_rows(self) -> bool:
        """Each row (ne[0] elements) is packed; rows may be anywhere (ggml_is_contiguous_rows)."""
        return self.ne[0] == 1 or self.nb[0] == TRAITS[self.type].type_size

    def is_transposed(self) -> bool:
        return self.nb[0] > self.nb[1]

    def is_permuted(self) -> bool:
        nb = self.nb
        return nb[0] > nb[1] or nb[1] > nb[2] or nb[2] > nb[3]

    @property
    def is_view(self) -> bool:
        return self.view_src is not None

    @property
    def data_owner(self) -> Tensor:
        return self.view_src if self.view_src is not None else self

    # --- host-facing (numpy-ordered) ----------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne[: self.ndim]))

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(reversed(self.nb[: self.ndim]))

    @property
    def dtype(self) -> np.dtype:
        """numpy dtype of get(): the element dtype, float32 for block-quantized types."""
        return np.dtype(np.float32) if self.type.is_quantized else np_dtype(self.type)

    def set_input(self) -> Tensor:
        self.flags |= TensorFlag.INPUT
        return self

    def set_output(self) -> Tensor:
        self.flags |= TensorFlag.OUTPUT
        return self

    def set_param(self) -> Tensor:
        self.flags |= TensorFlag.PARAM
        return self

    def set_name(self, name: str) -> Tensor:
        self.name = name
        return self

    def __repr__(self) -> str:
        op = f" op={self.op.name}" if self.op is not None else ""
        where = f" @{self.buffer.name}+{self.offs}" if self.buffer is not None else ""
        label = self.name or f"#{self.uid}"
        return f"Tensor({label} {self.type.name} ne={list(self.ne)}{op}{where})"

    # --- data in and out: implemented by the runtime (accelplane.runtime.data) -------------
    def set_bytes(self, data: bytes | bytearray | memoryview | np.ndarray, offset: int = 0) -> None:
        """Write raw bytes at byte ``offset`` of the tensor's data (ggml_backend_tensor_set)."""
        _data().set_bytes(self, data, offset)

    def get_bytes(self, offset: int = 0, size: int | None = None) -> np.ndarray:
        """Read raw bytes (ggml_backend_tensor_get) into a new uint8 array."""
        return _data().get_bytes(self, offset, size)

    def set(self, value: Any) -> Tensor:
        """Write a numpy-compatible array of ``self.shape``, converted and quantized to the
        tensor's type (the rules: :func:`accelplane.runtime.data.set`)."""
        _data().set(self, value)
        return self

    def get(self) -> np.ndarray:
        """A new numpy array of ``self.shape`` with the tensor's values (dequantized to f32)."""
        return _data().get(self)

    def __array__(self, dtype=None, copy=None):
        a = self.get()
        return a if dtype is None else a.astype(dtype)

    # --- DLPack (the array API's exchange protocol): accelplane.runtime.dlpack, docs/interop.md -----
    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[Any, int] | None = None, copy: bool | None = None) -> Any:  # fmt: skip
        """A DLPack capsule of the tensor, zero-copy where its memory allows (the rules:
        :func:`accelplane.runtime.dlpack.export`); ``np.from_dlpack(t)``, ``torch.from_dlpack(t)``."""
        return _runtime("DLPACK").export(self, stream=stream, max_version=max_version,
                                         dl_device=dl_device, copy=copy)  # fmt: skip

    def __dlpack_device__(self) -> tuple[Any, int]:
        """(DLPack device type, device id) of the memory ``__dlpack__()`` exports."""
        return _runtime("DLPACK").dlpack_device(self)


# the runtime modules that move tensor data and exchange it through DLPack (accelplane.runtime.data
# and .dlpack register themselves here when imported: the core describes tensors and imports
# nothing of the runtime)
DATA: Any = None
DLPACK: Any = None


def _runtime(name: str):
    mod = globals()[name]
    if mod is None:
        raise DeviceError("tensor data moves through accelplane.runtime (import accelplane first)")
    return mod


def _data():
    return _runtime("DATA")


def _row_shape(t: Tensor) -> tuple[int, ...]:
    return (t.ne[3], t.ne[2], t.ne[1], t.row_bytes)


def strided_view(t: Tensor, span: np.ndarray) -> np.ndarray:
    """numpy view over ``span`` (the tensor's bytes starting at element 0), ne reversed.

    Element types give an array of ``reversed(ne)``; block types give rows of raw bytes
    ``[ne3, ne2, ne1, row_bytes]``.
    """
    if t.type.is_quantized:
        shape, strides, dtype = _row_shape(t), (t.nb[3], t.nb[2], t.nb[1], 1), np.dtype(np.uint8)
    else:
        shape, strides, dtype = t.ne[::-1], t.nb[::-1], np_dtype(t.type)
    if type(span) is np.ndarray and span.flags.c_contiguous and span.flags.writeable:
        # the direct constructor: several times faster than as_strided, and it checks that the
        # view stays inside span
        return np.ndarray(shape, dtype, span, 0, strides)
    base = span if t.type.is_quantized else span.view(dtype)
    return np.lib.stride_tricks.as_strided(base, shape, strides, writeable=True)
