"""GGUF files through the ``gguf`` package: reading (memory-mapped), writing, llama metadata,
and a maker of synthetic llama models so no download is needed.

Reading: :func:`read_gguf` opens the file with ``gguf.GGUFReader`` (an ``np.memmap``: tensor
data is paged in when copied to a device, never read up front) and checks everything a bad
file could get wrong — size, magic, every read inside the file, tensor type ids, tensor data
inside the file — raising :class:`~accelplane.errors.GGUFError` that names the problem
(and the key or tensor) instead of crashing or hanging.

Writing: :func:`write_gguf` streams tensors one at a time (header, metadata, tensor infos,
then each tensor's bytes), so a model larger than memory can be written. Saving what
:func:`read_gguf` returned gives the same bytes (:func:`save_gguf`).

Metadata uses llama.cpp's keys (``general.architecture = "llama"``, ``llama.block_count``,
``llama.embedding_length``, ``llama.attention.head_count_kv``, ...). accelplane adds
``accelplane.rope.neox`` (bool; llama.cpp always uses normal rope for llama and ignores it).

Synthetic weights (:func:`make_model`): deterministic per (seed, tensor name); matrices are
N(0, 1/K) (K = row length), the token embedding N(0, 1), norms 1 + N(0, 0.01). F32/F16/BF16,
Q8_0 and Q4_0 quantize those values with :func:`accelplane.types.quantize` (byte-exact with
ggml), in row chunks so big matrices stay fast. Q4_K and Q6_K blocks are written directly as
random *valid* blocks of the same spread (random quants, positive random sub-block scales,
a d/dmin pair that centres the values), because their reference quantizers' scale searches
are too slow for a ~1B model in numpy; the values are still well-formed K-quant data that
every backend must decode the same way.
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import GGUFError, ShapeError
from ..types import GGMLType, parse_type, quantize, row_size
from .llama import LlamaConfig, WeightSpec

T = GGMLType
SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K)
GGUF_MAGIC = b"GGUF"
HEADER_BYTES = 24  # magic, version, tensor count, kv count
ROPE_NEOX_KEY = "accelplane.rope.neox"
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


@dataclass
class GGUFTensor:
    """One tensor: numpy-ordered ``shape``, ``data`` its raw bytes (uint8, the GGUF block layout;
    a view of the memory map when read from a file)."""

    name: str
    type: GGMLType
    shape: tuple[int, ...]
    data: np.ndarray

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

    def close(self) -> None:
        """Drop the memory map (tensor data must not be used afterwards)."""
        self.tensors = {}
        self._reader = None

    def get(self, key: str, default: Any = None) -> Any:
        mv = self.metadata.get(key)
        return default if mv is None else mv.value

    def llama_config(self) -> LlamaConfig:
        """The llama hyper-parameters (GGUFError naming the key when one is missing or bad)."""
        return config_from_metadata(self.metadata, self.tensors)

    def check_llama_tensors(self, cfg: LlamaConfig) -> None:
        """Every tensor the config needs is present with the right shape and a usable type,
        and there is no tensor a llama model does not have; GGUFError naming it otherwise."""
        where = f"{self.path}: " if self.path else ""
        specs = {s.name: s for s in cfg.weights()}
        for name in self.tensors:
            if name not in specs:
                raise GGUFError(f"{where}tensor {name!r} is not part of a llama model with this "
                                "configuration (unsupported tensor)")  # fmt: skip
        for name, s in specs.items():
            t = self.tensors.get(name)
            if t is None:
                raise GGUFError(f"{where}missing tensor {name!r} (shape {s.shape}) required by the "
                                "llama.* metadata")  # fmt: skip
            if tuple(t.shape) != tuple(s.shape):
                raise GGUFError(f"{where}tensor {name!r} has shape {tuple(t.shape)}, but the llama.* "
                                f"metadata needs {tuple(s.shape)}")  # fmt: skip
            if "norm" in name and not t.type.is_float:
                raise GGUFError(f"{where}norm tensor {name!r} has type {t.type.name}; it must be "
                                "F32, F16 or BF16")  # fmt: skip


# --- reading -----------------------------------------------------------------------------------
@functools.cache
def _reader_class():
    gguf = _gguf()

    class Reader(gguf.GGUFReader):
        """GGUFReader that refuses every read past the end of the file (the stock reader
        returns short arrays there, which can loop for a very long time on a bad count) and
        checks each tensor's type and extent before mapping it."""

        def _get(self, offset, dtype, count=1, override_order=None):
            count = int(count)
            end = int(offset) + np.dtype(dtype).itemsize * count
            if count < 0 or end > self.data.size:
                raise GGUFError(f"truncated: a header field at byte {offset} needs {end - offset} bytes, "
                                f"the file has {self.data.size}")  # fmt: skip
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs, fields):
            size = self.data.size
            for f in fields:
                name = bytes(f.parts[1]).decode("utf-8", "replace")
                raw = int(f.parts[4][0])
                dims = [int(x) for x in f.parts[3]]
                try:
                    qt = gguf.GGMLQuantizationType(raw)
                except ValueError:
                    raise GGUFError(f"tensor {name!r} has unknown tensor type id {raw}") from None
                blck, tsize = gguf.GGML_QUANT_SIZES[qt]
                if dims and dims[0] % blck:
                    raise GGUFError(f"tensor {name!r}: row of {dims[0]} elements is not a whole number "
                                    f"of {qt.name} blocks ({blck})")  # fmt: skip
                n = int(np.prod(dims, dtype=np.int64)) if dims else 1
                start = int(start_offs) + int(f.parts[5][0])
                end = start + n * tsize // blck
                if end > size:
                    raise GGUFError(f"truncated: tensor {name!r} ({qt.name} {dims}) needs bytes "
                                    f"[{start}, {end}), the file has {size}")  # fmt: skip
            super()._build_tensors(start_offs, fields)

    return Reader


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file memory-mapped. Raises GGUFError (naming the file and what is wrong) for
    a missing, empty, truncated or malformed file, a bad magic, a duplicate key or tensor, an
    unknown tensor type id, or a tensor type accelplane does not support."""
    gguf = _gguf()
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise GGUFError(f"{p}: cannot read: {e.strerror or e}") from None
    if size < HEADER_BYTES:
        raise GGUFError(f"{p}: truncated: {size} bytes is shorter than a GGUF header ({HEADER_BYTES})")
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{p}: bad magic {magic!r}: not a GGUF file (expected {GGUF_MAGIC!r})")
    try:
        r = _reader_class()(p)
    except GGUFError as e:
        raise GGUFError(f"{p}: {e}") from None
    except Exception as e:
        raise GGUFError(f"{p}: malformed GGUF file ({type(e).__name__}: {e})") from None
    md: dict[str, MetaValue] = {}
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        vt = f.types[0]
        try:
            if vt == gguf.GGUFValueType.ARRAY:
                sub = gguf.GGUFValueType(int(f.parts[3][0]))
                md[key] = MetaValue(f.contents(), vt, sub)
            else:
                md[key] = MetaValue(f.contents(), vt)
        except Exception as e:
            raise GGUFError(
                f"{p}: metadata key {key!r} cannot be decoded ({type(e).__name__}: {e})"
            ) from None
    tensors: dict[str, GGUFTensor] = {}
    for rt in r.tensors:
        try:
            ty = GGMLType(int(rt.tensor_type))
        except ValueError:
            ty = None
        if ty not in SUPPORTED_TYPES:
            raise GGUFError(
                f"{p}: tensor {rt.name!r} has type {rt.tensor_type.name}, which accelplane "
                f"does not support (supported: {', '.join(t.name for t in SUPPORTED_TYPES)})"
            )
        shape = tuple(int(x) for x in reversed(rt.shape.tolist()))
        tensors[rt.name] = GGUFTensor(rt.name, ty, shape, rt.data.reshape(-1).view(np.uint8))
    return GGUFFile(p, md, tensors, int(r.alignment), r)


# --- llama metadata ------------------------------------------------------------------------------
_MISSING = object()


def _meta(md: Mapping[str, MetaValue], key: str, kind: type, default: Any = _MISSING) -> Any:
    mv = md.get(key)
    if mv is None:
        if default is _MISSING:
            raise GGUFError(f"missing metadata key {key!r}")
        return default
    v = mv.value
    if kind is int:
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise GGUFError(f"metadata key {key!r} must be an integer, got {v!r}")
        return int(v)
    if kind is float:
        if isinstance(v, bool) or not isinstance(v, int | float | np.number):
            raise GGUFError(f"metadata key {key!r} must be a number, got {v!r}")
        return float(v)
    if kind is bool:
        if not isinstance(v, bool | np.bool_):
            raise GGUFError(f"metadata key {key!r} must be a bool, got {v!r}")
        return bool(v)
    if not isinstance(v, str):
        raise GGUFError(f"metadata key {key!r} must be a string, got {v!r}")
    return v


def config_from_metadata(md: Mapping[str, MetaValue],
                         tensors: Mapping[str, GGUFTensor] | None = None) -> LlamaConfig:  # fmt: skip
    """LlamaConfig from llama.cpp's keys. ``tensors`` supplies the vocabulary size when
    ``llama.vocab_size`` is absent (as llama.cpp does) and whether the output head is tied."""
    arch = _meta(md, "general.architecture", str)
    if arch != "llama":
        raise GGUFError(f"architecture {arch!r} is not supported (accelplane models: llama)")
    a = arch + "."
    d_model = _meta(md, a + "embedding_length", int)
    n_head = _meta(md, a + "attention.head_count", int)
    tensors = tensors or {}
    emb = tensors.get("token_embd.weight")
    n_vocab = _meta(md, a + "vocab_size", int, emb.shape[0] if emb is not None else _MISSING)
    if n_head > 0 and d_model % n_head == 0:
        hd = d_model // n_head
        kl = _meta(md, a + "attention.key_length", int, hd)
        vl = _meta(md, a + "attention.value_length", int, hd)
        if kl != hd or vl != hd:
            raise GGUFError(
                f"attention.key_length/value_length {kl}/{vl} differ from embedding_length"
                f" / head_count = {hd}, which accelplane's llama does not support"
            )
    try:
        return LlamaConfig(
            n_vocab=n_vocab,
            d_model=d_model,
            n_layers=_meta(md, a + "block_count", int),
            n_head=n_head,
            n_head_kv=_meta(md, a + "attention.head_count_kv", int, n_head),
            d_ff=_meta(md, a + "feed_forward_length", int),
            n_ctx_train=_meta(md, a + "context_length", int),
            rms_eps=_meta(md, a + "attention.layer_norm_rms_epsilon", float, 1e-5),
            rope_base=_meta(md, a + "rope.freq_base", float, 10000.0),
            rope_neox=_meta(md, ROPE_NEOX_KEY, bool, False),
            n_rot=_meta(md, a + "rope.dimension_count", int, 0),
            n_expert=_meta(md, a + "expert_count", int, 0),
            n_expert_used=_meta(md, a + "expert_used_count", int, 0),
            tied_output=bool(tensors) and "output.weight" not in tensors,
        )
    except ShapeError as e:
        raise GGUFError(f"bad llama metadata: {e}") from None


def llama_metadata(cfg: LlamaConfig, name: str = "", file_type: int | None = None,
                   tokenizer: bool = True) -> dict[str, MetaValue]:  # fmt: skip
    """llama.cpp's metadata for ``cfg`` (value types as llama.cpp's converter writes them).
    ``tokenizer``: add a minimal SentencePiece-style vocabulary (<unk>, <s>, </s>, the 256
    byte tokens, then placeholders) when the vocabulary is large enough for it."""
    gguf = _gguf()
    V = gguf.GGUFValueType
    a = "llama."
    md: dict[str, MetaValue] = {"general.architecture": MetaValue("llama", V.STRING)}
    if name:
        md["general.name"] = MetaValue(name, V.STRING)
    u32 = {
        "context_length": cfg.n_ctx_train, "embedding_length": cfg.d_model,
        "block_count": cfg.n_layers, "feed_forward_length": cfg.d_ff,
        "attention.head_count": cfg.n_head, "attention.head_count_kv": cfg.n_head_kv,
        "rope.dimension_count": cfg.rot, "vocab_size": cfg.n_vocab,
    }  # fmt: skip
    for k, v in u32.items():
        md[a + k] = MetaValue(int(v), V.UINT32)
    md[a + "rope.freq_base"] = MetaValue(float(np.float32(cfg.rope_base)), V.FLOAT32)
    md[a + "attention.layer_norm_rms_epsilon"] = MetaValue(float(np.float32(cfg.rms_eps)), V.FLOAT32)
    if cfg.is_moe:
        md[a + "expert_count"] = MetaValue(cfg.n_expert, V.UINT32)
        md[a + "expert_used_count"] = MetaValue(cfg.n_expert_used, V.UINT32)
    if file_type is not None:
        md["general.file_type"] = MetaValue(int(file_type), V.UINT32)
        md["general.quantization_version"] = MetaValue(2, V.UINT32)
    md[ROPE_NEOX_KEY] = MetaValue(bool(cfg.rope_neox), V.BOOL)
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
    32). The file is written next to ``path`` and renamed into place, so a crash never leaves
    a partial model."""
    gguf = _gguf()
    p = Path(path)
    arch = metadata.get("general.architecture")
    w = gguf.GGUFWriter(None, arch.value if arch is not None else "llama")
    w.kv_data[0].clear()  # the writer adds general.architecture itself; keep the caller's order
    if alignment is None and "general.alignment" in metadata:
        alignment = int(metadata["general.alignment"].value)
    if alignment is not None:
        w.data_alignment = int(alignment)
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
    except BaseException:
        if w.fout:
            for f in w.fout:
                f.close()
        tmp.unlink(missing_ok=True)
        raise


def save_gguf(path: str | os.PathLike, f: GGUFFile) -> None:
    """Write a read file back (same metadata, tensors, alignment: the same bytes)."""
    write_gguf(path, f.metadata, list(f.tensors.values()), f.alignment)


# --- synthetic models ------------------------------------------------------------------------------
_FILE_TYPES = {T.F32: 0, T.F16: 1, T.Q4_0: 2, T.Q8_0: 7, T.Q4_K: 15, T.Q6_K: 18, T.BF16: 32}
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


def synthetic_tensor(spec: WeightSpec, ty: GGMLType, seed: int) -> np.ndarray:
    """The synthetic weight ``spec`` as raw bytes of type ``ty`` (see the module docstring)."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    ne0 = spec.shape[-1]
    rows = int(np.prod(spec.shape[:-1], dtype=np.int64)) if len(spec.shape) > 1 else 1
    if "norm" in spec.name:
        mean, std = 1.0, 0.1
    elif spec.name == "token_embd.weight":
        mean, std = 0.0, 1.0
    else:
        mean, std = 0.0, 1.0 / np.sqrt(ne0)
    out = np.empty((rows, row_size(ty, ne0)), np.uint8)
    step = max(1, _CHUNK_ELEMENTS // ne0)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        if ty in (T.Q4_K, T.Q6_K):
            out[r0:r1] = _kquant_rows(ty, r1 - r0, ne0, std, rng)
        else:
            x = rng.standard_normal((r1 - r0, ne0), dtype=np.float32)
            x *= np.float32(std)
            x += np.float32(mean)
            out[r0:r1] = quantize(ty, x)
    return out


def synthetic_sources(
    *,
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
    rope_neox: bool = False,
    rope_base: float = 10000.0,
    rms_eps: float = 1e-5,
    seed: int = 0,
    name: str = "",
) -> tuple[LlamaConfig, dict[str, MetaValue], list[TensorSource]]:
    """The config, metadata and (lazily produced) tensors of a synthetic llama; see
    :func:`make_model` for the arguments."""
    cfg = LlamaConfig(
        n_vocab=n_vocab, d_model=d_model, n_layers=n_layers, n_head=n_head,
        n_head_kv=n_head_kv or n_head, d_ff=d_ff or 4 * d_model, n_ctx_train=n_ctx,
        rms_eps=rms_eps, rope_base=rope_base, rope_neox=rope_neox, n_expert=n_expert,
        n_expert_used=n_expert_used,
    )  # fmt: skip
    wt = parse_type(wtype)
    types = {"token_embd.weight": parse_type(embd_type or wt), "output.weight": parse_type(output_type or wt)}
    srcs = []
    for spec in cfg.weights():
        ty = types.get(spec.name, wt) if spec.matrix else T.F32
        if ty not in SUPPORTED_TYPES:
            raise ShapeError(f"{spec.name}: weight type {ty.name} is not supported")
        if spec.shape[-1] % ty.blck_size:
            raise ShapeError(f"{spec.name}: rows of {spec.shape[-1]} elements are not a multiple of "
                             f"{ty.name}'s block size {ty.blck_size}")  # fmt: skip
        make = functools.partial(synthetic_tensor, spec, ty, seed)  # picklable: worker processes
        srcs.append(TensorSource(spec.name, ty, spec.shape, make))
    md = llama_metadata(cfg, name or f"synthetic-llama-{wt.name.lower()}", _FILE_TYPES.get(wt))
    md[SEED_KEY] = MetaValue(int(seed), _gguf().GGUFValueType.UINT32)
    # the config as a reader of the file sees it (float32 epsilon, explicit n_rot)
    return config_from_metadata(md), md, srcs


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
        affinity = getattr(os, "sched_getaffinity", None)
        jobs = len(affinity(0)) if affinity else os.cpu_count() or 1
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
               jobs: int | None = None, **kw: Any) -> LlamaConfig:  # fmt: skip
    """Write a synthetic llama (or MoE llama with ``n_expert`` > 0) GGUF model to ``path`` and
    return its config. Keywords: ``n_layers``, ``d_model``, ``n_head``, ``n_head_kv`` (default
    n_head), ``d_ff`` (default 4 d_model), ``n_vocab``, ``n_ctx`` (context_length), ``wtype``
    (matrices; default Q8_0), ``embd_type`` and ``output_type`` (token embedding and head;
    default wtype), ``n_expert``, ``n_expert_used``, ``rope_neox``, ``rope_base``, ``rms_eps``,
    ``seed`` (weights are deterministic in it), ``name``. Norms and the router are F32.
    ``progress(nbytes)`` after each tensor; ``jobs``: worker processes making the weights
    (default: one per CPU; the file is the same for any number). Raises ShapeError when a row
    length is not a multiple of a type's block size."""
    cfg, md, srcs = synthetic_sources(**kw)
    with parallel_sources(srcs, jobs) as srcs:
        write_gguf(path, md, srcs, progress=progress)
    return cfg


def total_bytes(f: GGUFFile) -> int:
    return sum(t.nbytes for t in f.tensors.values())


__all__ = [
    "GGUFFile", "GGUFTensor", "MetaValue", "SUPPORTED_TYPES", "TensorSource", "config_from_metadata",
    "llama_metadata", "make_model", "parallel_sources", "read_gguf", "save_gguf", "synthetic_sources",
    "synthetic_tensor",
    "total_bytes",
    "write_gguf",
]  # fmt: skip
