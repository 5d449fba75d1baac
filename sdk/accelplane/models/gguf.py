"""GGUF files through the ``gguf`` package: reading (memory-mapped), writing, model metadata,
and a maker of synthetic models of every supported architecture, so no download is needed.

Reading: :func:`read_gguf` opens the file with ``gguf.GGUFReader`` (an ``np.memmap``: tensor
data is paged in when copied to a device, never read up front) and checks everything but the
tensor values — the header, every read inside the file, value types, array and string
lengths, keys, ``general.alignment``, each tensor's name, dims and type, and that the tensors
tile the data section exactly (aligned, inside the file, no overlap, each exactly the bytes
its type and dims make) — raising :class:`~accelplane.errors.GGUFError` that names the key or
tensor at fault and its file offset instead of crashing, hanging or loading garbage.

Writing: :func:`write_gguf` streams tensors one at a time (header, metadata, tensor infos,
then each tensor's bytes), so a model larger than memory can be written. Saving what
:func:`read_gguf` returned gives the same bytes (:func:`save_gguf`).

Metadata uses llama.cpp's keys (``general.architecture``, ``{arch}.block_count``,
``{arch}.embedding_length``, ``{arch}.attention.head_count_kv``, ...);
:func:`accelplane.models.archs.config_from_metadata` reads them per architecture.

Synthetic models (:func:`make_model`) are written the way llama.cpp's converter would write a
Hugging Face checkpoint of the architecture: its metadata keys, and its changes to the
checkpoint's tensors (llama's Q/K row permutation, gemma's ``1 + w`` norms, Llama 3's computed
``rope_freqs``; see :mod:`accelplane.models.architecture`; bert: :mod:`accelplane.models.bert`).
The checkpoint's values are deterministic per (seed, tensor name): matrices N(0, 1/K) (K = row
length), the token, position and token-type embeddings N(0, 1), norms 1 + N(0, 0.1) (gemma: the
stored 1 + w), biases N(0, 0.1). F32/F16/BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q5_K,
IQ4_NL and IQ4_XS quantize those values with :func:`accelplane.core.types.quantize` (byte-exact
with ggml), in row chunks so big matrices stay fast. Q4_K and Q6_K blocks are written directly
as random *valid* blocks of the same spread (random quants, positive random sub-block scales, a
d/dmin pair that centres the values), because their reference quantizers' scale searches are
too slow for a ~1B model in numpy; the values are still well-formed K-quant data that every
backend must decode the same way.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from accelplane.core.types import GGMLType, parse_type, quantize, row_size
from accelplane.errors import GGUFError, ShapeError
from accelplane.models.architecture import Architecture, RopeScaling
from accelplane.models.archs import ARCHITECTURES, architecture, config_from_metadata
from accelplane.models.decoder import DecoderConfig, WeightSpec

T = GGMLType
SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K,
                   T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS)  # fmt: skip
GGUF_MAGIC = b"GGUF"
HEADER_BYTES = 24  # magic, version, tensor count, kv count
SEED_KEY = "accelplane.synthetic.seed"


def _gguf():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - gguf is a dependency
        raise GGUFError("GGUF I/O needs the 'gguf' package: pip install gguf") from e
    return gguf


@dataclass(frozen=True)
class MetaValue:
    """A metadata value with its GGUF value type (and element type for arrays), so that it is
    written back exactly as read."""

    value: Any
    type: Any  # gguf.GGUFValueType
    sub_type: Any = None
    offset: int | None = field(default=None, compare=False)  # of the entry, when read from a file

    def at(self) -> str:
        """`` (file offset N)`` when read from a file, else empty (for messages)."""
        return "" if self.offset is None else f" (file offset {self.offset})"


@dataclass
class GGUFTensor:
    """One tensor: numpy-ordered ``shape``, ``data`` its raw bytes (uint8, the GGUF block layout;
    a view of the memory map when read from a file, at ``data_offset`` in the data section and
    ``file_offset`` in the file)."""

    name: str
    type: GGMLType
    shape: tuple[int, ...]
    data: np.ndarray
    data_offset: int | None = None
    file_offset: int | None = None

    def at(self) -> str:
        """`` (data offset D, file offset F)`` when read from a file, else empty (for messages)."""
        if self.file_offset is None:
            return ""
        return f" (data offset {self.data_offset}, file offset {self.file_offset})"

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class GGUFFile:
    """What :func:`read_gguf` returns: ``metadata`` (key → :class:`MetaValue`, file order),
    ``tensors`` (name → :class:`GGUFTensor`, file order), ``alignment``. Tensor data are views of
    the file's memory map, valid until :meth:`close`."""

    def __init__(self, path: Path | None, metadata: dict[str, MetaValue],
                 tensors: dict[str, GGUFTensor], alignment: int, reader: Any = None) -> None:  # fmt: skip
        self.path = path
        self.metadata = metadata
        self.tensors = tensors
        self.alignment = alignment
        self._reader = reader

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def release(self, name: str) -> None:
        """Tell the kernel this process no longer needs the pages of tensor ``name``'s bytes
        (madvise MADV_DONTNEED on the memory map; they are read from the file again if used), so
        that loading a model tensor by tensor never holds the file's data beside the device
        buffers. Nothing where the platform has no madvise or the tensor is not from a file."""
        t = self.tensors.get(name)
        mm = getattr(getattr(self._reader, "data", None), "_mmap", None)  # np.memmap's mmap.mmap
        if t is None or mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = t.file_offset if t.file_offset is not None else -1
        if start < 0 or t.nbytes == 0:
            return
        lo = start - start % mmap.PAGESIZE
        end = min(start + t.nbytes, len(mm))
        hi = end - end % mmap.PAGESIZE  # whole pages only: a shared edge page may be needed next
        if hi > lo:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        """Drop the memory map (tensor data must not be used afterwards)."""
        self.tensors = {}
        self._reader = None

    def get(self, key: str, default: Any = None) -> Any:
        mv = self.metadata.get(key)
        return default if mv is None else mv.value

    def model_config(self) -> DecoderConfig:
        """The model's hyper-parameters, read as llama.cpp reads its architecture (GGUFError
        naming the file and the key when one is missing or bad, or the architecture is not
        supported)."""
        try:
            return config_from_metadata(self.metadata, self.tensors)
        except GGUFError as e:
            raise GGUFError(f"{self.path}: {e}" if self.path else str(e)) from None

    def check_tensors(self, cfg: DecoderConfig) -> None:
        """Every tensor the config needs is present with the right shape and a usable type,
        and there is no tensor the model does not have; GGUFError naming it otherwise."""
        where = f"{self.path}: " if self.path else ""
        meta = f"the {cfg.arch}.* metadata"
        if cfg.n_layers > len(self.tensors):  # a corrupted block count: do not list its weights
            have = self.tensors
            i = next(i for i in range(len(have) + 1) if f"blk.{i}.attn_norm.weight" not in have)
            raise GGUFError(f"{where}missing tensor 'blk.{i}.attn_norm.weight' required by {meta} "
                            f"({cfg.arch}.block_count = {cfg.n_layers})")  # fmt: skip
        check_weights(self, cfg.weights(), cfg.arch,
                      must_be_float=lambda s: "norm" in s.name or s.name.endswith(".bias"))  # fmt: skip
        t = self.tensors.get("rope_freqs.weight")
        if t is not None and t.type != T.F32:
            raise GGUFError(f"{where}tensor 'rope_freqs.weight' has type {t.type.name}; rope factors must be "
                            f"F32 (as ggml_rope_ext takes them){t.at()}")  # fmt: skip


def check_weights(f: GGUFFile, specs: Iterable[WeightSpec], arch: str, *,
                  optional: frozenset[str] = frozenset(), ignored: frozenset[str] = frozenset(),
                  must_be_float: Callable[[WeightSpec], bool] = lambda s: False) -> None:  # fmt: skip
    """``f`` holds a tensor of each spec's shape (those named in ``optional`` may be absent), of a
    float type where ``must_be_float(spec)``, and no other tensor (but those named in
    ``ignored``); GGUFError naming the file, the tensor and its offset otherwise. The tensor
    check of every architecture (:meth:`GGUFFile.check_tensors`, bert's)."""
    where = f"{f.path}: " if f.path else ""
    specs = {s.name: s for s in specs}
    for name, t in f.tensors.items():
        if name not in specs and name not in ignored:
            raise GGUFError(f"{where}tensor {_shown(name)} is not part of a {arch} model with this "
                            f"configuration (unsupported tensor){t.at()}")  # fmt: skip
    for name, s in specs.items():
        t = f.tensors.get(name)
        if t is None:
            if name in optional:
                continue
            raise GGUFError(f"{where}missing tensor {name!r} (shape {s.shape}) required by the "
                            f"{arch}.* metadata")  # fmt: skip
        if tuple(t.shape) != tuple(s.shape):
            raise GGUFError(f"{where}tensor {name!r} has shape {tuple(t.shape)}, but the {arch}.* "
                            f"metadata needs {tuple(s.shape)}{t.at()}")  # fmt: skip
        if must_be_float(s) and not t.type.is_float:
            kind = "norm tensor" if "norm" in name else "bias tensor" if name.endswith(".bias") else "tensor"
            raise GGUFError(f"{where}{kind} {name!r} has type {t.type.name}; it must be "
                            f"F32, F16 or BF16{t.at()}")  # fmt: skip


# --- reading -----------------------------------------------------------------------------------
GGUF_VERSIONS = (2, 3)  # what llama.cpp reads (v1 had 32-bit counts)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32  # without general.alignment
MAX_ALIGNMENT = 1 << 24  # a larger general.alignment is a corrupted field, not a layout
# the fewest bytes a metadata entry (key length, a 1-byte key, value type, a 1-byte value) and a
# tensor info (name length, n_dims, one dim, type, offset) take: counts that cannot fit are refused
# before parsing
_KV_MIN_BYTES, _TENSOR_INFO_MIN_BYTES = 8 + 1 + 4 + 1, 8 + 4 + 8 + 4 + 8
_HEADER_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")  # gguf.GGUFReader's, not keys


def _shown(v: Any, width: int = 80) -> str:
    """repr of ``v`` cut to ``width`` characters (a corrupted length can make a name huge)."""
    r = repr(v)
    return r if len(r) <= width else r[: width - 3] + "..."


def _pad(n: int, align: int) -> int:
    return -(-n // align) * align


def _check_header(p: Path, size: int, head: bytes) -> None:
    """The fixed header: magic, a little-endian version accelplane reads, counts that fit the file."""
    if size < HEADER_BYTES:
        raise GGUFError(f"{p}: truncated: {size} bytes is shorter than a GGUF header ({HEADER_BYTES})")
    magic, version, n_tensors, n_kv = struct.unpack("<4sIQQ", head)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{p}: bad magic {magic!r}: not a GGUF file (expected {GGUF_MAGIC!r})")
    if version and not version & 0xFFFF:
        raise GGUFError(f"{p}: version field {version:#010x} at file offset 4 is that of a big-endian "
                        "GGUF file; accelplane reads little-endian files")  # fmt: skip
    if version not in GGUF_VERSIONS:
        raise GGUFError(f"{p}: GGUF version {version} (file offset 4) is not supported; accelplane "
                        f"reads versions {' and '.join(map(str, GGUF_VERSIONS))}")  # fmt: skip
    need = n_tensors * _TENSOR_INFO_MIN_BYTES + n_kv * _KV_MIN_BYTES
    if need > size - HEADER_BYTES:
        raise GGUFError(f"{p}: truncated or corrupted header: {n_tensors} tensors (count at file offset 8) "
                        f"and {n_kv} metadata keys (count at file offset 16) need at least {need} bytes "
                        f"after the header, the file has {size - HEADER_BYTES}")  # fmt: skip


def _tensor_at(name: str, data_offset: int, file_offset: int) -> str:
    return f"tensor {_shown(name)} at data offset {data_offset} (file offset {file_offset})"


@functools.cache
def _reader_class():
    gguf = _gguf()
    V = gguf.GGUFValueType

    class Reader(gguf.GGUFReader):
        """gguf.GGUFReader that checks the file as it parses it: every read inside the file (the
        stock reader returns short arrays there), value types known, arrays that fit the file
        (read in one piece: the stock reader makes an array per element), no empty or repeated
        key, a sane ``general.alignment``; then :meth:`_check_tensors` before it maps any tensor.
        Every error is a GGUFError naming the key or tensor being read and its file offset; any
        other exception of the stock parser (a name that is not UTF-8, ...) becomes one too."""

        def __init__(self, path: Path) -> None:
            self._kind, self._index, self._at, self._name = "header", 0, 0, None
            self._mv, self.strings = None, {}  # see _string_array
            try:
                super().__init__(path)
            except GGUFError:
                raise
            except Exception as e:
                raise GGUFError(f"{self._where()}: {type(e).__name__}: {e}") from None

        # what is being parsed, for messages: a key or tensor info from its first byte on
        def _begin(self, kind: str, index: int, at: int) -> None:
            self._kind, self._index, self._at, self._name = kind, index, at, None

        def _where(self) -> str:
            if self._kind == "header":
                return "header"
            what = f"#{self._index}" if self._name is None else _shown(self._name)
            return f"{self._kind} {what} at file offset {self._at}"

        def _get(self, offset, dtype, count=1, override_order=None):
            offset, count = int(offset), int(count)
            end = offset + np.dtype(dtype).itemsize * count
            if end > self.data.size:
                raise GGUFError(f"{self._where()}: truncated: needs file bytes [{offset}, {end}), the file "
                                f"has {self.data.size}")  # fmt: skip
            return super()._get(offset, dtype, count, override_order)

        def _get_str(self, offset):
            parts = super()._get_str(offset)
            if offset == self._at and self._name is None:  # the key or tensor name
                self._name = bytes(parts[1]).decode("utf-8", "replace")
            return parts

        def _push_field(self, field, skip_sum=False):
            first = self.fields.get(field.name)
            if first is not None or not field.name:
                why = f"duplicate key (first at file offset {first.offset})" if first else "empty key"
                raise GGUFError(f"{self._where()}: {why}")
            n = super()._push_field(field, skip_sum)
            end = field.offset + sum(int(x.nbytes) for x in field.parts)
            self._begin("metadata key", len(self.fields) - len(_HEADER_FIELDS), end)
            return n

        def _value_type(self, raw) -> Any:
            try:
                return V(int(raw))
            except ValueError:
                raise GGUFError(f"{self._where()}: unknown value type {int(raw)}") from None

        def _get_field_parts(self, orig_offs, raw_type):
            if self._value_type(raw_type) != V.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_sub, n = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            sub, start = self._value_type(raw_sub[0]), orig_offs + 12
            if sub == V.ARRAY:
                raise GGUFError(f"{self._where()}: an array of arrays (llama.cpp does not read them either)")
            item = 8 if sub == V.STRING else np.dtype(self.gguf_scalar_to_np[sub]).itemsize
            if int(n[0]) > (self.data.size - start) // item:
                raise GGUFError(f"{self._where()}: truncated or corrupted: an array of {int(n[0])} "
                                f"{sub.name} values does not fit in the {self.data.size - start} bytes left "
                                "in the file")  # fmt: skip
            if sub == V.STRING:
                return self._string_array(orig_offs, raw_sub, n)
            values = self._get(start, self.gguf_scalar_to_np[sub], n[0])
            return 12 + int(values.nbytes), [raw_sub, n, values], [2], [V.ARRAY, sub]

        def _string_array(self, orig_offs, raw_sub, n):
            """An array of strings in one pass over the file (the stock reader makes two numpy
            arrays per string, tens of times slower on a 128K-token vocabulary with its merges). The
            strings' bytes go to ``self.strings[field offset]``; the parts hold one slice of the
            file over all of them, so the field's size is still the sum of its parts."""
            if self._mv is None:
                self._mv = memoryview(self.data)
            mv, size, start = self._mv, self.data.size, orig_offs + 12
            o, out = start, []

            def need(k: int) -> None:
                if o + k > size:
                    raise GGUFError(f"{self._where()}: truncated: needs file bytes [{o}, {o + k}), the file "
                                    f"has {size}")  # fmt: skip

            for _ in range(int(n[0])):
                need(8)
                k = int.from_bytes(mv[o : o + 8], "little")
                o += 8
                need(k)
                out.append(bytes(mv[o : o + k]))
                o += k
            self.strings[self._at] = out
            return o - orig_offs, [raw_sub, n, self.data[start:o]], [], [V.ARRAY, V.STRING]

        def _build_tensor_info(self, offs, count):
            align = self.fields.get("general.alignment")
            if align is not None:  # checked here, before any tensor offset is read against it
                a = int(align.parts[-1][0]) if align.types == [V.UINT32] else None
                if a is None or a <= 0 or a & (a - 1) or a > MAX_ALIGNMENT:
                    got = f"a {align.types[0].name}" if a is None else a
                    raise GGUFError(f"metadata key 'general.alignment' at file offset {align.offset}: must "
                                    f"be a UINT32 power of two <= {MAX_ALIGNMENT}, got {got}")  # fmt: skip
            self._infos = 0
            return super()._build_tensor_info(offs, count)

        def _get_tensor_info_field(self, orig_offs):
            self._begin("tensor", self._infos, orig_offs)
            self._infos += 1
            return super()._get_tensor_info_field(orig_offs)

        def _build_tensors(self, start_offs, fields):
            self._check_tensors(int(start_offs), fields)
            super()._build_tensors(start_offs, fields)

        def _check_tensors(self, start: int, fields) -> None:
            """Each tensor info: a new name, 1 to 4 dims each >= 1 whose product fits int64, a
            type accelplane supports, rows of whole blocks. Then the data section (from ``start``
            to the end of the file): sorted by offset the tensors tile it exactly, as llama.cpp
            lays them out — each aligned, starting where the previous one's padded bytes end, the
            last one ending at the end of the file or in its padding — so none overlaps another,
            runs past the file, or has a byte size its type and dims do not account for."""
            seen: dict[str, int] = {}
            extents = []
            for f in fields:
                info = f"tensor {_shown(f.name)} (tensor info at file offset {f.offset})"
                if f.name in seen:
                    raise GGUFError(f"{info}: duplicate tensor name (first at file offset {seen[f.name]})")
                seen[f.name] = f.offset
                dims, raw = [int(x) for x in f.parts[3]], int(f.parts[4][0])
                ty = _supported_type(info, raw)
                if not 1 <= len(dims) <= MAX_DIMS or min(dims) < 1 or math.prod(dims) >= 1 << 63:
                    raise GGUFError(f"{info}: dims {dims}: accelplane reads 1 to {MAX_DIMS} dims, each >= 1, "
                                    "whose product fits int64")  # fmt: skip
                if dims[0] % ty.blck_size:
                    raise GGUFError(f"{info}: rows of {dims[0]} elements are not a whole number of "
                                    f"{ty.name} blocks ({ty.blck_size} elements)")  # fmt: skip
                nbytes = row_size(ty, dims[0]) * math.prod(dims[1:])
                extents.append((int(f.parts[5][0]), nbytes, f"{ty.name} {dims}", f.name))
            align, data_size = int(self.alignment), self.data.size - start
            end, prev = 0, None  # the padded end of the tensors so far, the last one
            for off, n, what, name in sorted(extents):
                at = f"{_tensor_at(name, off, start + off)} ({what}, {n} bytes)"
                if off % align:
                    raise GGUFError(f"{at}: the offset is not a multiple of the data alignment {align}")
                if off + n > data_size:
                    raise GGUFError(f"truncated: {at} needs file bytes [{start + off}, {start + off + n}), "
                                    f"the file has {self.data.size}")  # fmt: skip
                if prev is not None and off < prev[0] + prev[1]:
                    raise GGUFError(f"{prev[2]} overlaps {at}")
                if off > end and prev is None:
                    raise GGUFError(f"{at}: the first tensor does not start at data offset 0")
                if off > end:
                    raise GGUFError(f"{prev[2]}: its type and dims account for {_pad(prev[1], align)} "
                                    f"bytes (padded), but {at} starts {off - prev[0]} bytes after it: the "
                                    "type or dims do not match the data")  # fmt: skip
                end, prev = _pad(off + n, align), (off, n, at)
            if prev is not None and data_size > end:
                raise GGUFError(f"{prev[2]}: its type and dims account for {_pad(prev[1], align)} bytes "
                                f"(padded), but it is the last tensor and {data_size - prev[0]} bytes follow "
                                "its start in the file: the type or dims do not match the data")  # fmt: skip

    return Reader


def _supported_type(info: str, raw: int) -> GGMLType:
    """The tensor type with id ``raw`` if accelplane supports it, else GGUFError naming it."""
    try:
        ty = GGMLType(raw)
    except ValueError:
        ty = None
    if ty in SUPPORTED_TYPES:
        return ty
    try:
        name = _gguf().GGMLQuantizationType(raw).name
    except ValueError:
        raise GGUFError(f"{info} has unknown tensor type id {raw}") from None
    raise GGUFError(f"{info} has type {name}, which accelplane does not support (type id {raw}; "
                    f"supported: {', '.join(t.name for t in SUPPORTED_TYPES)})")  # fmt: skip


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file memory-mapped, checking everything but the tensor values; nothing is read
    past the end of the file. GGUFError names the file, the key or tensor at fault and its file
    offset, for: a missing or unreadable file; a bad magic; a version other than 2 or 3, or a
    big-endian file; anything truncated; an unknown value type, an array of arrays, a string or
    array longer than the rest of the file; an empty or duplicate key; a ``general.alignment``
    that is not a UINT32 power of two (at most 2**24); a duplicate tensor name; dims not
    1 to 4 of at least 1 each, or whose product overflows int64; a tensor type accelplane does
    not support; rows that are not whole blocks; tensor data that is misaligned, overlaps
    another tensor, lies outside the file, or is not exactly its type's and dims' byte size (the
    tensors must tile the data section, as llama.cpp writes and requires)."""
    gguf = _gguf()
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as fh:
            head = fh.read(HEADER_BYTES)
    except OSError as e:
        raise GGUFError(f"{p}: cannot read: {e.strerror or e}") from None
    _check_header(p, size, head)
    try:
        r = _reader_class()(p)
    except GGUFError as e:
        raise GGUFError(f"{p}: {e}") from None
    md: dict[str, MetaValue] = {}
    for key, f in r.fields.items():
        if key in _HEADER_FIELDS:
            continue
        vt = f.types[0]
        sub = gguf.GGUFValueType(int(f.parts[3][0])) if vt == gguf.GGUFValueType.ARRAY else None
        strs = r.strings.get(int(f.offset))
        try:
            value = [x.decode("utf-8") for x in strs] if strs is not None else f.contents()
        except UnicodeDecodeError as e:
            raise GGUFError(f"{p}: metadata key {_shown(key)} at file offset {f.offset}: a string is not "
                            f"UTF-8 ({e})") from None  # fmt: skip
        md[key] = MetaValue(value, vt, sub, int(f.offset))
    tensors: dict[str, GGUFTensor] = {}
    for rt in r.tensors:
        shape = tuple(int(x) for x in reversed(rt.shape.tolist()))
        data, at = rt.data.reshape(-1).view(np.uint8), int(rt.data_offset)
        ty = GGMLType(int(rt.tensor_type))
        tensors[rt.name] = GGUFTensor(rt.name, ty, shape, data, at - int(r.data_offset), at)
    return GGUFFile(p, md, tensors, int(r.alignment), r)


# --- metadata ----------------------------------------------------------------------------------
def model_metadata(cfg: DecoderConfig, scaling: RopeScaling | None = None, name: str = "",
                   file_type: int | None = None, tokenizer: bool = True) -> dict[str, MetaValue]:  # fmt: skip
    """The metadata llama.cpp's converter writes for a checkpoint of ``cfg``'s architecture
    (its keys and value types; ``scaling``: the checkpoint's rope scaling). ``tokenizer``: add a
    minimal SentencePiece-style vocabulary (<unk>, <s>, </s>, the 256 byte tokens, then
    placeholders) when the vocabulary is large enough for it."""
    gguf = _gguf()
    V = gguf.GGUFValueType
    a = cfg.arch + "."
    md: dict[str, MetaValue] = {"general.architecture": MetaValue(cfg.arch, V.STRING)}
    if name:
        md["general.name"] = MetaValue(name, V.STRING)
    for k, (v, vt) in architecture(cfg.arch).metadata(cfg, scaling or RopeScaling()).items():
        md[a + k] = MetaValue(float(np.float32(v)) if vt == "FLOAT32" else v, V[vt])
    if file_type is not None:
        md["general.file_type"] = MetaValue(int(file_type), V.UINT32)
        md["general.quantization_version"] = MetaValue(2, V.UINT32)
    if tokenizer and cfg.n_vocab >= 3 + 256:
        toks = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
        toks += [f"\u2581t{i}" for i in range(len(toks), cfg.n_vocab)]
        ttype = [2, 3, 3] + [6] * 256 + [1] * (cfg.n_vocab - 259)
        md["tokenizer.ggml.model"] = MetaValue("llama", V.STRING)
        md["tokenizer.ggml.tokens"] = MetaValue(toks, V.ARRAY, V.STRING)
        md["tokenizer.ggml.scores"] = MetaValue([0.0] * cfg.n_vocab, V.ARRAY, V.FLOAT32)
        md["tokenizer.ggml.token_type"] = MetaValue(ttype, V.ARRAY, V.INT32)
        md["tokenizer.ggml.unknown_token_id"] = MetaValue(0, V.UINT32)
        md["tokenizer.ggml.bos_token_id"] = MetaValue(1, V.UINT32)
        md["tokenizer.ggml.eos_token_id"] = MetaValue(2, V.UINT32)
    return md


# --- writing ------------------------------------------------------------------------------------
@dataclass
class TensorSource:
    """A tensor to write whose bytes are produced only when written (``produce()`` → uint8
    array of exactly ``row_size(type, shape[-1]) * rows`` bytes)."""

    name: str
    type: GGMLType
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        rows = int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1
        return row_size(self.type, self.shape[-1]) * rows


def write_gguf(path: str | os.PathLike, metadata: Mapping[str, MetaValue],
               tensors: Iterable[GGUFTensor | TensorSource], alignment: int | None = None,
               progress: Callable[[int], None] | None = None) -> None:  # fmt: skip
    """Write a GGUF file: ``metadata`` in the given order (llama.cpp puts
    ``general.architecture`` first), then ``tensors`` in order, streamed one at a time.
    ``alignment``: tensor data alignment (default: ``general.alignment`` of the metadata, else
    32; a power of two; any other than 32 is written as ``general.alignment``, which must agree
    with it). The file is written next to ``path`` and renamed into place, so a crash never
    leaves a partial model."""
    gguf = _gguf()
    p = Path(path)
    arch = metadata.get("general.architecture")
    w = gguf.GGUFWriter(None, arch.value if arch is not None else "llama")
    w.kv_data[0].clear()  # the writer adds general.architecture itself; keep the caller's order
    given = metadata.get("general.alignment")
    if given is not None and given.type != gguf.GGUFValueType.UINT32:
        raise GGUFError(f"general.alignment must be a UINT32, got a {given.type.name}")
    align = int(alignment if alignment is not None else given.value if given else DEFAULT_ALIGNMENT)
    if align <= 0 or align & (align - 1) or align > MAX_ALIGNMENT:
        raise GGUFError(f"alignment {align} is not a power of two <= {MAX_ALIGNMENT}")
    if given is not None and int(given.value) != align:
        raise GGUFError(f"alignment {align} differs from the metadata's general.alignment {given.value}")
    if given is None and align != DEFAULT_ALIGNMENT:  # readers would assume the default
        metadata = {**metadata, "general.alignment": MetaValue(align, gguf.GGUFValueType.UINT32)}
    w.data_alignment = align
    for key, mv in metadata.items():
        if mv.type == gguf.GGUFValueType.ARRAY and len(mv.value) == 0:
            continue  # GGUFWriter cannot write empty arrays
        w.add_key_value(key, mv.value, mv.type, mv.sub_type)
    tensors = list(tensors)
    for t in tensors:
        ty = parse_type(t.type)
        if ty not in SUPPORTED_TYPES:
            raise GGUFError(f"tensor {t.name!r}: type {ty.name} cannot be written")
        rb = row_size(ty, t.shape[-1])
        byte_shape = (*t.shape[:-1], rb)
        w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes,
                          raw_dtype=gguf.GGMLQuantizationType(int(ty)))  # fmt: skip
    tmp = p.with_name(p.name + f".tmp{os.getpid()}")
    try:
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in tensors:
            data = t.data if isinstance(t, GGUFTensor) else t.produce()
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            if data.size != t.nbytes:
                raise GGUFError(f"tensor {t.name!r}: {data.size} bytes produced, {t.nbytes} expected")
            w.write_tensor_data(data)
            if progress is not None:
                progress(data.size)
        w.close()
        os.replace(tmp, p)
    except BaseException as e:
        if w.fout:
            for f in w.fout:
                f.close()
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise GGUFError(f"{p}: cannot write: {e.strerror or e}") from None
        raise


def save_gguf(path: str | os.PathLike, f: GGUFFile) -> None:
    """Write a read file back (same metadata, tensors, alignment: the same bytes)."""
    write_gguf(path, f.metadata, list(f.tensors.values()), f.alignment)


# --- synthetic models ------------------------------------------------------------------------------
# llama.cpp's general.file_type (LLAMA_FTYPE_MOSTLY_*; the K-quants as their _M mixes)
FILE_TYPES = {T.F32: 0, T.F16: 1, T.Q4_0: 2, T.Q4_1: 3, T.Q8_0: 7, T.Q5_0: 8, T.Q5_1: 9, T.Q2_K: 10,
              T.Q3_K: 12, T.Q4_K: 15, T.Q5_K: 17, T.Q6_K: 18, T.IQ4_NL: 25, T.IQ4_XS: 30,
              T.BF16: 32}  # fmt: skip
_CHUNK_ELEMENTS = 1 << 21  # rows generated and quantized per chunk (keeps temporaries in cache)


def _kquant_rows(ty: GGMLType, rows: int, ne0: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random valid Q4_K / Q6_K rows whose values have spread ``std`` and mean ~0."""
    nb = rows * ne0 // 256
    if ty == T.Q4_K:
        blk = np.empty((nb, 144), np.uint8)
        s = rng.integers(32, 64, (nb, 8), dtype=np.uint8)  # 6-bit sub-block scales = mins
        # value = d*s*q - dmin*s with q in 0..15 uniform: dmin = 7.5 d centres it
        d = std / (np.sqrt(np.mean(s.astype(np.float64) ** 2, axis=1)) * np.sqrt(255 / 12))
        blk[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
        blk[:, 2:4] = (7.5 * d).astype(np.float16).view(np.uint8).reshape(nb, 2)
        sc = blk[:, 4:16]
        sc[:, 0:4] = (s[:, 0:4] & 63) | ((s[:, 4:8] >> 4) << 6)  # scales j<4 (+ high bits of j>=4)
        sc[:, 4:8] = (s[:, 0:4] & 63) | ((s[:, 4:8] >> 4) << 6)  # mins j<4 (+ high bits)
        sc[:, 8:12] = (s[:, 4:8] & 0xF) | ((s[:, 4:8] & 0xF) << 4)  # low bits of j>=4
        blk[:, 16:] = rng.integers(0, 256, (nb, 128), dtype=np.uint8)
    elif ty == T.Q6_K:
        blk = np.empty((nb, 210), np.uint8)
        blk[:, :192] = rng.integers(0, 256, (nb, 192), dtype=np.uint8)  # ql, qh: q uniform 0..63
        sc = rng.integers(64, 128, (nb, 16), dtype=np.int8)
        blk[:, 192:208] = sc.view(np.uint8)
        rms = np.sqrt(np.mean(sc.astype(np.float64) ** 2, axis=1))
        d = std / (rms * np.sqrt((64**2 - 1) / 12))  # value = d * sc * (q - 32)
        blk[:, 208:210] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    else:  # pragma: no cover
        raise ShapeError(f"no random-block generator for {ty.name}")
    return blk.reshape(rows, -1)


def synthetic_tensor(spec: WeightSpec, ty: GGMLType, seed: int, cfg: DecoderConfig | None = None,
                     scaling: RopeScaling | None = None) -> np.ndarray:  # fmt: skip
    """The synthetic weight ``spec`` of a model of ``cfg`` (default: a checkpoint's value as it
    is, no converter changes: bert's weights) as raw bytes of type ``ty`` (see the module
    docstring)."""
    arch = architecture(cfg.arch) if cfg is not None else Architecture()
    ne0 = spec.shape[-1]
    rows = int(np.prod(spec.shape[:-1], dtype=np.int64)) if len(spec.shape) > 1 else 1
    if cfg is not None:
        vals = arch.computed(spec, cfg, scaling or RopeScaling())
        if vals is not None:
            return quantize(ty, np.asarray(vals, np.float32).reshape(rows, ne0)).reshape(rows, -1)
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    mean, std = arch.hf_spread(spec)
    mean += arch.norm_shift(spec.name)
    order = arch.row_order(spec, cfg) if cfg is not None and ty not in (T.Q4_K, T.Q6_K) else None
    out = np.empty((rows, row_size(ty, ne0)), np.uint8)
    step = max(1, _CHUNK_ELEMENTS // ne0)
    full = np.empty((rows, ne0), np.float32) if order is not None else None
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        if ty in (T.Q4_K, T.Q6_K):
            out[r0:r1] = _kquant_rows(ty, r1 - r0, ne0, std, rng)
            continue
        x = rng.standard_normal((r1 - r0, ne0), dtype=np.float32)
        x *= np.float32(std)
        x += np.float32(mean)
        if full is not None:  # the converter reorders rows: quantize once all are drawn
            full[r0:r1] = x
        else:
            out[r0:r1] = quantize(ty, x)
    if full is not None:
        full = full[order]
        for r0 in range(0, rows, step):
            out[r0 : r0 + step] = quantize(ty, full[r0 : r0 + step])
    return out


def weight_sources(specs: Iterable[WeightSpec], wtype: GGMLType, seed: int,
                   types: Mapping[str, GGMLType] | None = None, cfg: DecoderConfig | None = None,
                   scaling: RopeScaling | None = None) -> list[TensorSource]:  # fmt: skip
    """One lazily produced :func:`synthetic_tensor` per spec (of a model of ``cfg`` with rope
    ``scaling``, as synthetic_tensor takes them): matrices of ``types[name]``, else ``wtype``; the
    other weights F32. ShapeError for a type that cannot be written or rows that are not whole
    blocks of it."""
    srcs = []
    for spec in specs:
        ty = (types or {}).get(spec.name, wtype) if spec.matrix else T.F32
        if ty not in SUPPORTED_TYPES:
            raise ShapeError(f"{spec.name}: weight type {ty.name} is not supported")
        if spec.shape[-1] % ty.blck_size:
            raise ShapeError(f"{spec.name}: rows of {spec.shape[-1]} elements are not a multiple of "
                             f"{ty.name}'s block size {ty.blck_size}")  # fmt: skip
        # picklable: worker processes make them
        make = functools.partial(synthetic_tensor, spec, ty, seed, cfg, scaling)
        srcs.append(TensorSource(spec.name, ty, spec.shape, make))
    return srcs


def _bert_sources(**kw: Any):
    from accelplane.models.bert import synthetic_sources as bert_sources

    return bert_sources(**kw)


def synthetic_sources(*, arch: str = "llama",
                      **kw: Any) -> tuple[Any, dict[str, MetaValue], list[TensorSource]]:  # fmt: skip
    """The config, metadata and (lazily produced) tensors of a synthetic model of ``arch``
    (:data:`SYNTHETIC_ARCHS`); keywords as that architecture's maker takes them (the decoders':
    :func:`make_model`; bert's: :func:`accelplane.models.bert.synthetic_sources`). GGUFError for
    an architecture without one, ShapeError for a keyword it does not take."""
    maker = SYNTHETIC_ARCHS.get(arch)
    if maker is None:
        raise GGUFError(f"no synthetic {arch!r} model: architectures {', '.join(SYNTHETIC_ARCHS)}")
    try:
        return maker(**kw)
    except TypeError as e:  # a keyword this architecture does not take
        raise ShapeError(f"synthetic {arch} model: {e}") from None


def decoder_sources(
    *,
    arch: str = "llama",
    n_layers: int = 2,
    d_model: int = 64,
    n_head: int = 4,
    n_head_kv: int | None = None,
    d_ff: int | None = None,
    n_vocab: int = 256,
    n_ctx: int = 2048,
    wtype: GGMLType | str = T.Q8_0,
    embd_type: GGMLType | str | None = None,
    output_type: GGMLType | str | None = None,
    n_expert: int = 0,
    n_expert_used: int = 0,
    d_ff_exp: int = 0,
    head_dim: int = 0,
    rope_base: float | None = None,
    rope_scaling: str = "none",
    rope_factor: float = 8.0,
    rms_eps: float | None = None,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
    tied: bool = False,
    seed: int = 0,
    name: str = "",
) -> tuple[DecoderConfig, dict[str, MetaValue], list[TensorSource]]:
    """The config, metadata and (lazily produced) tensors of a synthetic decoder of ``arch``; see
    :func:`make_model` for the arguments."""
    a = architecture(arch)
    # Llama 3's original context: the model's context over the factor (Llama 3.1: 8192 of 131072)
    orig = max(1, int(n_ctx / rope_factor))
    scaling = RopeScaling(rope_scaling, rope_factor, original_max_position_embeddings=orig)
    extra: dict[str, Any] = {}
    if sliding_window or logit_softcap:
        if arch != "gemma3":
            raise ShapeError(f"sliding_window and logit_softcap are gemma3's; {arch} has neither")
        extra = dict(n_swa=sliding_window, logit_softcap=logit_softcap)
    if d_ff_exp and not a.expert_ff:
        raise ShapeError(f"d_ff_exp (expert_feed_forward_length) is qwen3moe's; {arch}'s experts have d_ff")
    if rope_scaling == "llama3" and not a.rope_freqs:
        raise ShapeError(f"llama3 rope scaling (rope_freqs) is llama's; {arch} does not read it")
    base = a.default_rope_base if rope_base is None else rope_base
    try:
        cfg = a.synthetic_config(
            n_vocab=n_vocab, d_model=d_model, n_layers=n_layers, n_head=n_head,
            n_head_kv=n_head_kv or n_head, d_ff=d_ff or 4 * d_model, n_ctx_train=n_ctx,
            rms_eps=a.default_rms_eps if rms_eps is None else rms_eps, rope_base=base,
            rope_scale=1.0 / rope_factor if rope_scaling == "linear" else 1.0,
            rope_freqs=rope_scaling == "llama3", n_expert=n_expert, n_expert_used=n_expert_used,
            d_ff_exp=d_ff_exp,
            n_embd_head=head_dim, tied_output=tied, **extra,
        )  # fmt: skip
    except TypeError as e:  # a switch the architecture sets itself
        raise ShapeError(f"{arch}: {e}") from None
    wt = parse_type(wtype)
    types = {"token_embd.weight": parse_type(embd_type or wt), "output.weight": parse_type(output_type or wt)}
    srcs = weight_sources(cfg.weights(), wt, seed, types, cfg, scaling)
    md = model_metadata(cfg, scaling, name or f"synthetic-{arch}-{wt.name.lower()}", FILE_TYPES.get(wt))
    md[SEED_KEY] = MetaValue(int(seed), _gguf().GGUFValueType.UINT32)
    # the config as a reader of the file sees it (float32 epsilon, explicit n_rot)
    return config_from_metadata(md, {s.name: s for s in srcs}), md, srcs


# general.architecture -> its synthetic model maker (config, metadata, sources): every decoder
# architecture (accelplane.models.archs), then bert
SYNTHETIC_ARCHS: dict[str, Callable[..., tuple[Any, dict[str, MetaValue], list[TensorSource]]]] = {
    **{name: functools.partial(decoder_sources, arch=name) for name in ARCHITECTURES},
    "bert": _bert_sources,
}


class _Ahead:
    """Produces sources in worker processes, a bounded window ahead of the (in-order) writer:
    each synthetic tensor depends only on its name and the seed, so the bytes are the same as
    a serial run's."""

    def __init__(self, srcs: list[TensorSource], jobs: int) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.srcs, self.window, self.next = srcs, 2 * jobs, 0
        fork = "fork" in multiprocessing.get_all_start_methods()  # workers inherit the sources
        ctx = multiprocessing.get_context("fork" if fork else None)
        self.pool = ProcessPoolExecutor(jobs, mp_context=ctx)
        self.futs: dict[int, Any] = {}

    def get(self, i: int) -> np.ndarray:
        while self.next < min(len(self.srcs), i + self.window):
            self.futs[self.next] = self.pool.submit(self.srcs[self.next].produce)
            self.next += 1
        return self.futs.pop(i).result()

    def sources(self) -> list[TensorSource]:
        return [TensorSource(s.name, s.type, s.shape, functools.partial(self.get, i))
                for i, s in enumerate(self.srcs)]  # fmt: skip


def parallel_sources(srcs: list[TensorSource], jobs: int | None = None):
    """A context manager giving ``srcs`` produced by ``jobs`` worker processes (default: the
    CPUs this process may use; 1 = in this process). Producers must be picklable."""
    import contextlib

    if not jobs:
        from accelplane.cpu.host import usable_cpus

        jobs = usable_cpus()
    if jobs <= 1 or len(srcs) < 2:
        return contextlib.nullcontext(srcs)

    @contextlib.contextmanager
    def run():
        ahead = _Ahead(srcs, jobs)
        try:
            yield ahead.sources()
        finally:
            ahead.pool.shutdown(cancel_futures=True)

    return run()


def make_model(path: str | os.PathLike, *, progress: Callable[[int], None] | None = None,
               jobs: int | None = None, **kw: Any) -> Any:  # fmt: skip
    """Write a synthetic GGUF model to ``path``, as llama.cpp's converter would write a checkpoint
    of its architecture, and return its config. ``arch``: a key of :data:`SYNTHETIC_ARCHS`
    (llama, qwen2, qwen3, qwen3moe, gemma3: a DecoderConfig; bert: a BertConfig, keywords as
    :func:`accelplane.models.bert.synthetic_sources` takes them; default llama). The decoders'
    keywords: ``n_layers``, ``d_model``, ``n_head``, ``n_head_kv`` (default n_head),
    ``d_ff`` (default 4 d_model), ``head_dim`` (default d_model / n_head), ``n_vocab``,
    ``n_ctx`` (context_length), ``wtype`` (matrices; default Q8_0), ``embd_type`` and
    ``output_type`` (token embedding and head; default wtype), ``tied`` (no output.weight;
    gemma3 always), ``n_expert``, ``n_expert_used`` (a MoE: llama, or qwen3moe, which needs
    them) and ``d_ff_exp`` (qwen3moe: an expert's FFN length; default d_ff), ``rope_base`` and ``rms_eps``
    (default: the architecture's usual ones), ``rope_scaling`` (none, linear: the
    ``rope.scaling.*`` keys; llama3, llama only: the ``rope_freqs`` tensor of Llama 3's scaling
    from an original context of n_ctx / factor) with its ``rope_factor``, ``sliding_window``
    (gemma3: the window of five layers in six; 0 = none) and ``logit_softcap`` (gemma3),
    ``seed`` (weights are deterministic in it), ``name``.
    Norms, biases, rope factors and the router are F32. ``progress(nbytes)`` after each tensor;
    ``jobs``: worker processes making the weights (default: one per CPU; the file is the same
    for any number). Raises ShapeError when a row length is not a multiple of a type's block
    size or an option does not apply to the architecture, GGUFError for an unknown architecture."""
    cfg, md, srcs = synthetic_sources(**kw)
    with parallel_sources(srcs, jobs) as srcs:
        write_gguf(path, md, srcs, progress=progress)
    return cfg


def total_bytes(f: GGUFFile) -> int:
    return sum(t.nbytes for t in f.tensors.values())


def tensor_digest(f: GGUFFile) -> str:
    """sha256 (hex) of every tensor's name, type, shape and bytes in file order: what the model
    computes with, whatever the metadata beside it."""
    import hashlib

    h = hashlib.sha256()
    for t in f.tensors.values():
        h.update(f"{t.name}|{t.type.name}|{t.shape}\0".encode())
        h.update(memoryview(np.ascontiguousarray(t.data)))
    return h.hexdigest()


__all__ = [
    "GGUFFile", "GGUFTensor", "MetaValue", "SUPPORTED_TYPES", "TensorSource", "config_from_metadata",
    "model_metadata", "make_model", "parallel_sources", "read_gguf", "save_gguf", "synthetic_sources",
    "synthetic_tensor", "tensor_digest", "check_weights", "weight_sources", "decoder_sources", "FILE_TYPES",
    "SYNTHETIC_ARCHS",
    "total_bytes",
    "write_gguf",
]  # fmt: skip
