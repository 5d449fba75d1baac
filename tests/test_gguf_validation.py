"""read_gguf rejects every malformed GGUF file with a GGUFError that names the key or tensor
and its file offset, and never reads past the end of the file.

One regression test per kind of damage: each writes a small valid file, finds the field to
damage by parsing the file with the ``gguf`` package's reader (the oracle for where fields
are), patches exactly that field and checks the message. Then hypothesis fuzzing over mutated
valid files (sized by ``ACCELPLANE_FUZZ``, see tests/fuzzing.py), and ``accelplane run`` on a
damaged file.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import signal
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from accelplane import cli
from accelplane.core.types import GGMLType
from accelplane.errors import GGUFError
from accelplane.models import make_model, read_gguf, write_gguf
from accelplane.models.gguf import SUPPORTED_TYPES, GGUFTensor, MetaValue
from fuzzing import TALLY, examples
from hypothesis import given, settings
from hypothesis import strategies as st

V = gguf.GGUFValueType
TINY = dict(n_layers=2, d_model=64, n_head=4, n_head_kv=2, d_ff=96, n_vocab=128, n_ctx=256, seed=5)
# parts of the gguf reader's fields: a key/value entry, a tensor info
KEY_LEN, KEY, VALUE_TYPE, VALUE = 0, 1, 2, 3  # a string value: VALUE = its length, then bytes
ARRAY_TYPE, ARRAY_COUNT = 3, 4
NAME_LEN, NAME, N_DIMS, DIMS, TYPE, OFFSET = range(6)
# the fewest bytes a key/value entry and a tensor info take (GGUF format): a file too short for
# what its header counts is refused before anything names an entry
KV_MIN, TENSOR_INFO_MIN = 8 + 1 + 4 + 1, 8 + 4 + 8 + 4 + 8
HEADER_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")  # the gguf reader's own


class Parsed:
    """A valid file and where its fields are, by the gguf package's reader: ``kv`` key ->
    ReaderField, ``ti`` tensor name -> ReaderField (of its tensor info)."""

    def __init__(self, path: Path) -> None:
        r = gguf.GGUFReader(path)
        self.path, self.raw, self.data_start = path, path.read_bytes(), int(r.data_offset)
        self.kv: dict[str, Any] = {k: f for k, f in r.fields.items() if k not in HEADER_FIELDS}
        self.ti: dict[str, Any] = {t.name: t.field for t in r.tensors}

    def __repr__(self) -> str:  # short: hypothesis prints the fixtures of a failing case
        return f"Parsed({self.path})"

    def part(self, field: Any, i: int) -> int:
        """File offset of part ``i`` of a reader field."""
        return field.offset + sum(int(p.nbytes) for p in field.parts[:i])

    def offset(self, name: str) -> int:
        """Data offset of tensor ``name``, as its tensor info says."""
        return int(self.ti[name].parts[OFFSET][0])

    def at(self, name: str, data_offset: int | None = None) -> str:
        """How a message names tensor ``name`` at a data offset (default: its own)."""
        d = self.offset(name) if data_offset is None else data_offset
        return f"tensor {name!r} at data offset {d} (file offset {self.data_start + d})"

    def info(self, name: str) -> str:
        """How a message names tensor ``name`` by its tensor info."""
        return f"tensor {name!r} (tensor info at file offset {self.ti[name].offset})"

    def key(self, key: str) -> str:
        return f"metadata key {key!r} at file offset {self.kv[key].offset}"


def patch(raw: bytes, at: int, value: int, size: int) -> bytes:
    return raw[:at] + value.to_bytes(size, "little") + raw[at + size :]


def splice(raw: bytes, at: int, remove: int, insert: bytes = b"") -> bytes:
    return raw[:at] + insert + raw[at + remove :]


def rejects(tmp_path: Path, raw: bytes, *needles: str) -> str:
    """read_gguf of ``raw`` raises GGUFError naming the file and containing every needle."""
    p = tmp_path / "bad.gguf"
    p.write_bytes(raw)
    with pytest.raises(GGUFError) as e:
        read_gguf(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: "), msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def write_small(path: Path, alignment: int | None = None) -> Parsed:
    """Strings, scalars, a string and a float array, and three tensors of three types."""
    rng = np.random.default_rng(0)
    md = {
        "general.architecture": MetaValue("llama", V.STRING),
        "general.name": MetaValue("validation", V.STRING),
        "test.k1": MetaValue(7, V.UINT32),
        "test.k2": MetaValue(9, V.UINT32),
        "test.tokens": MetaValue([f"tok{i}" for i in range(40)], V.ARRAY, V.STRING),
        "test.scores": MetaValue([i / 4 for i in range(40)], V.ARRAY, V.FLOAT32),
        "test.flag": MetaValue(True, V.BOOL),
    }
    ts = []
    for name, ty, shape in (("w.a", GGMLType.F32, (4, 8)), ("w.b", GGMLType.Q8_0, (2, 64)),
                            ("w.c", GGMLType.F16, (64,))):  # fmt: skip
        n = math.prod(shape) // ty.blck_size * ty.type_size
        ts.append(GGUFTensor(name, ty, shape, rng.integers(0, 256, n, dtype=np.uint8)))
    write_gguf(path, md, ts, alignment)
    return Parsed(path)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Parsed:
    return write_small(tmp_path_factory.mktemp("gguf") / "small.gguf")


@pytest.fixture(scope="module")
def small64(tmp_path_factory) -> Parsed:
    """The same file with 64-byte alignment (so with a general.alignment key)."""
    return write_small(tmp_path_factory.mktemp("gguf") / "small64.gguf", alignment=64)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Parsed:
    p = tmp_path_factory.mktemp("gguf") / "llama.gguf"
    make_model(p, jobs=1, **TINY)
    return Parsed(p)


# --- valid files -----------------------------------------------------------------------------------
def test_valid_files_load_as_the_gguf_package_reads_them(small, small64, llama):
    for b in (small, small64, llama):
        r = gguf.GGUFReader(b.path)
        with read_gguf(b.path) as f:
            assert f.alignment == int(r.alignment) == (64 if b is small64 else 32)
            assert {k: mv.value for k, mv in f.metadata.items()} == {k: x.contents() for k, x in b.kv.items()}
            assert all(f.metadata[k].offset == x.offset for k, x in b.kv.items())
            assert list(f.tensors) == [t.name for t in r.tensors]
            for rt in r.tensors:
                t = f.tensors[rt.name]
                assert (t.file_offset, t.data_offset) == (rt.data_offset, rt.data_offset - r.data_offset)
                assert bytes(t.data) == bytes(rt.data.reshape(-1).view(np.uint8))
    assert small64.kv["general.alignment"].contents() == 64 and "general.alignment" not in small.kv


def test_make_model_tiny_preset_loads(tmp_path, capsys):
    p = tmp_path / "tiny.gguf"
    assert cli.main(["make-model", "--preset", "tiny", "--jobs", "1", str(p)]) == 0
    with read_gguf(p) as f:
        f.check_tensors(f.model_config())
        assert len(f.tensors) == len(gguf.GGUFReader(p).tensors) > 0


# --- the header ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "at, value, size, needle",
    [(0, int.from_bytes(b"GGUX", "little"), 4, "bad magic b'GGUX'"),
     (4, 0, 4, "GGUF version 0 (file offset 4) is not supported"),
     (4, 1, 4, "GGUF version 1 (file offset 4) is not supported"),
     (4, 4, 4, "GGUF version 4 (file offset 4) is not supported"),
     (4, 3 << 24, 4, "big-endian"),
     (8, 1 << 63, 8, f"{1 << 63} tensors (count at file offset 8)"),
     (16, 1 << 40, 8, f"{1 << 40} metadata keys (count at file offset 16)")],
)  # fmt: skip
def test_bad_header(small, tmp_path, at, value, size, needle):
    rejects(tmp_path, patch(small.raw, at, value, size), needle)


# --- truncation -----------------------------------------------------------------------------------------
def test_truncated_anywhere_names_what_is_cut(small, tmp_path):
    """A cut inside the fixed header; inside each key's value and each tensor info (after the
    name: the message names it and its offset, unless the counts of the header no longer fit in
    what is left); inside each tensor's data."""
    for n in (0, 4, 23):
        rejects(tmp_path, small.raw[:n], "shorter than a GGUF header")
    need = 24 + len(small.kv) * KV_MIN + len(small.ti) * TENSOR_INFO_MIN
    for kind, fields in (("metadata key", small.kv), ("tensor", small.ti)):
        for name, f in fields.items():
            last = f.parts[-1]
            cut = small.part(f, len(f.parts) - 1) + int(last.nbytes) // 2
            if cut < need:
                rejects(tmp_path, small.raw[:cut], "truncated or corrupted header")
            else:
                rejects(tmp_path, small.raw[:cut], f"{kind} {name!r} at file offset {f.offset}: truncated")
    for t in gguf.GGUFReader(small.path).tensors:
        cut = t.data_offset + int(t.n_bytes) // 2
        rejects(tmp_path, small.raw[:cut], f"truncated: {small.at(t.name)}", f"the file has {cut}")


# --- tensors --------------------------------------------------------------------------------------------
def test_tensor_offset_not_aligned(small, tmp_path):
    off = small.offset("w.b") + 4
    raw = patch(small.raw, small.part(small.ti["w.b"], OFFSET), off, 8)
    rejects(tmp_path, raw, small.at("w.b", off), "not a multiple of the data alignment 32")


@pytest.mark.parametrize("off", [1 << 12, 1 << 40, (1 << 64) - 32])
def test_tensor_outside_the_file(small, tmp_path, off):
    raw = patch(small.raw, small.part(small.ti["w.c"], OFFSET), off, 8)
    rejects(tmp_path, raw, f"truncated: {small.at('w.c', off)}", f"the file has {len(raw)}")


def test_tensor_runs_into_the_next(small, tmp_path):
    """w.a's second dim 4 -> 5: its data (160 bytes) now runs into w.b (at 128)."""
    raw = patch(small.raw, small.part(small.ti["w.a"], DIMS) + 8, 5, 8)
    rejects(tmp_path, raw, small.at("w.a"), f"overlaps {small.at('w.b')}")


def test_overlapping_tensors(small, tmp_path):
    raw = patch(small.raw, small.part(small.ti["w.c"], OFFSET), small.offset("w.b"), 8)
    msg = rejects(tmp_path, raw, "overlaps", small.at("w.b"))
    assert small.at("w.c", small.offset("w.b")) in msg


@pytest.mark.parametrize(
    "name, ty, needle",
    [("w.a", GGMLType.F16, "the type or dims do not match the data"),  # F32 -> F16: half the bytes
     ("w.b", GGMLType.F16, "overlaps"),  # Q8_0 -> F16: more bytes than its slot
     ("w.c", GGMLType.Q8_0, "the type or dims do not match the data")],  # the last one shrinks
)  # fmt: skip
def test_type_size_does_not_match_the_data(small, tmp_path, name, ty, needle):
    raw = patch(small.raw, small.part(small.ti[name], TYPE), int(ty), 4)
    rejects(tmp_path, raw, small.at(name), ty.name, needle)


def test_row_not_whole_blocks(small, tmp_path):
    raw = patch(small.raw, small.part(small.ti["w.b"], DIMS), 48, 8)
    rejects(tmp_path, raw, small.info("w.b"), "rows of 48 elements are not a whole number of Q8_0 blocks")


def _dims(b: Parsed, name: str, dims: list[int]) -> bytes:
    """The file with tensor ``name``'s dims replaced (n_dims too: later fields move)."""
    f = b.ti[name]
    raw = patch(b.raw, b.part(f, N_DIMS), len(dims), 4)
    new = b"".join(d.to_bytes(8, "little") for d in dims)
    return splice(raw, b.part(f, DIMS), int(f.parts[DIMS].nbytes), new)


@pytest.mark.parametrize(
    "name, dims",
    [("w.a", [8, 0]), ("w.c", [(1 << 63) + 64]), ("w.a", [8, 1 << 61]), ("w.a", [8, (1 << 63) - 1]),
     ("w.a", [8, 4, 1, 1, 1]), ("w.c", [])],
)  # fmt: skip
def test_bad_dims(small, tmp_path, name, dims):
    """A zero dim, one that is negative as int64, a product over int64, 5 dims, none."""
    rejects(tmp_path, _dims(small, name, dims), f"{small.info(name)}: dims {dims}: accelplane reads 1 to 4")


@pytest.mark.parametrize(
    "tid, needle",
    [(99, "has unknown tensor type id 99"), (4, "has unknown tensor type id 4"),
     (1 << 31, f"has unknown tensor type id {1 << 31}"),
     (16, "has type IQ2_XXS, which accelplane does not support (type id 16"),
     (24, "has type I8, which accelplane does not support (type id 24")],
)  # fmt: skip
def test_unknown_or_unsupported_tensor_type(small, tmp_path, tid, needle):
    raw = patch(small.raw, small.part(small.ti["w.b"], TYPE), tid, 4)
    rejects(tmp_path, raw, f"{small.info('w.b')} {needle}")


def test_duplicate_tensor_name(small, tmp_path):
    f = small.ti["w.c"]
    raw = splice(small.raw, small.part(f, NAME), 3, b"w.a")
    rejects(tmp_path, raw, f"tensor 'w.a' (tensor info at file offset {f.offset}): duplicate tensor name "
                           f"(first at file offset {small.ti['w.a'].offset})")  # fmt: skip


# --- metadata ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [1 << 40, (1 << 64) - 1])
def test_string_longer_than_the_file(small, tmp_path, length):
    raw = patch(small.raw, small.part(small.kv["general.name"], VALUE), length, 8)
    rejects(tmp_path, raw, f"{small.key('general.name')}: truncated")
    # a key's own length: the key is named by its position
    raw = patch(small.raw, small.kv["test.k1"].offset, length, 8)
    rejects(tmp_path, raw, f"metadata key #2 at file offset {small.kv['test.k1'].offset}: truncated")
    # a tensor name's length
    raw = patch(small.raw, small.ti["w.b"].offset, length, 8)
    rejects(tmp_path, raw, f"tensor #1 at file offset {small.ti['w.b'].offset}: truncated")


@pytest.mark.parametrize("key, ty", [("test.tokens", "STRING"), ("test.scores", "FLOAT32")])
@pytest.mark.parametrize("count", [1 << 40, (1 << 64) - 1])
def test_array_longer_than_the_file(small, tmp_path, key, ty, count):
    raw = patch(small.raw, small.part(small.kv[key], ARRAY_COUNT), count, 8)
    rejects(tmp_path, raw, f"{small.key(key)}: truncated or corrupted: an array of {count} {ty} values "
                           "does not fit")  # fmt: skip


@pytest.mark.parametrize(
    "key, part, value, needle",
    [("test.k1", VALUE_TYPE, 99, "unknown value type 99"),
     ("test.k1", VALUE_TYPE, 13, "unknown value type 13"),
     ("test.scores", ARRAY_TYPE, 99, "unknown value type 99"),
     ("test.scores", ARRAY_TYPE, int(V.ARRAY), "an array of arrays")],
)  # fmt: skip
def test_unknown_value_type(small, tmp_path, key, part, value, needle):
    raw = patch(small.raw, small.part(small.kv[key], part), value, 4)
    rejects(tmp_path, raw, f"{small.key(key)}: {needle}")


def test_duplicate_and_empty_keys(small, tmp_path):
    k1, k2 = small.kv["test.k1"], small.kv["test.k2"]
    raw = splice(small.raw, small.part(k2, KEY), 7, b"test.k1")
    rejects(tmp_path, raw, f"metadata key 'test.k1' at file offset {k2.offset}: duplicate key (first at "
                           f"file offset {k1.offset})")  # fmt: skip
    raw = splice(small.raw, k1.offset, 8 + 7, (0).to_bytes(8, "little"))
    rejects(tmp_path, raw, f"metadata key '' at file offset {k1.offset}: empty key")


def test_names_and_strings_that_are_not_utf8(small, tmp_path):
    k1 = small.kv["test.k1"]
    rejects(tmp_path, patch(small.raw, small.part(k1, KEY), 0xFF, 1), f"at file offset {k1.offset}: ",
            "UnicodeDecodeError")  # fmt: skip
    f = small.ti["w.b"]
    raw = patch(small.raw, small.part(f, NAME), 0xFF, 1)
    rejects(tmp_path, raw, f"tensor '\ufffd.b' at file offset {f.offset}: ", "UnicodeDecodeError")
    raw = patch(small.raw, small.part(small.kv["general.name"], VALUE + 1), 0xFF, 1)
    rejects(tmp_path, raw, f"{small.key('general.name')}: a string is not UTF-8")


@pytest.mark.parametrize("value", [0, 3, 48, 1 << 30])
def test_bad_alignment_value(small64, tmp_path, value):
    raw = patch(small64.raw, small64.part(small64.kv["general.alignment"], VALUE), value, 4)
    rejects(tmp_path, raw, f"{small64.key('general.alignment')}: must be a UINT32 power of two",
            f"got {value}")  # fmt: skip


def test_bad_alignment_type(small64, tmp_path):
    raw = patch(small64.raw, small64.part(small64.kv["general.alignment"], VALUE_TYPE), int(V.INT32), 4)
    rejects(tmp_path, raw, f"{small64.key('general.alignment')}: must be a UINT32", "got a INT32")


def test_alignment_that_does_not_match_the_layout(small64, tmp_path):
    """general.alignment 64 -> 32 on a file laid out at 64: a tensor's padded end no longer
    reaches the next one."""
    raw = patch(small64.raw, small64.part(small64.kv["general.alignment"], VALUE), 32, 4)
    rejects(tmp_path, raw, "tensor 'w.", "the type or dims do not match the data")


def test_writer_records_its_alignment(tmp_path):
    """write_gguf writes general.alignment for a non-default alignment and refuses one that
    disagrees with the metadata's or is not a power of two."""
    b = write_small(tmp_path / "a.gguf")
    with read_gguf(b.path) as f:
        md, ts = dict(f.metadata), list(f.tensors.values())
        for bad in (48, 0):
            with pytest.raises(GGUFError, match="not a power of two"):
                write_gguf(tmp_path / "b.gguf", md, ts, bad)
        with pytest.raises(GGUFError, match="differs from the metadata's general.alignment 64"):
            write_gguf(tmp_path / "b.gguf", {**md, "general.alignment": MetaValue(64, V.UINT32)}, ts, 128)
        with pytest.raises(GGUFError, match="cannot write"):
            write_gguf(tmp_path / "no" / "such" / "dir.gguf", md, ts)


# --- model level ----------------------------------------------------------------------------------------
def test_model_checks_name_the_tensor(llama, tmp_path):
    """A huge block count fails fast on the first missing layer; a wrong feed-forward length
    names the first tensor of the wrong shape with its offsets."""
    p = tmp_path / "m.gguf"
    p.write_bytes(patch(llama.raw, llama.part(llama.kv["llama.block_count"], VALUE), 1 << 31, 4))
    with read_gguf(p) as f, pytest.raises(GGUFError, match=r"missing tensor 'blk\.2\.attn_norm\.weight'"):
        f.check_tensors(f.model_config())
    p.write_bytes(patch(llama.raw, llama.part(llama.kv["llama.feed_forward_length"], VALUE), 128, 4))
    d = llama.offset("blk.0.ffn_gate.weight")
    with read_gguf(p) as f, pytest.raises(GGUFError) as e:
        f.check_tensors(f.model_config())
    assert "tensor 'blk.0.ffn_gate.weight' has shape (96, 64)" in str(e.value)
    assert f"(data offset {d}, file offset {llama.data_start + d})" in str(e.value)


# --- the command line -----------------------------------------------------------------------------------
@pytest.mark.parametrize("flags", [[], ["--no-check"]])
def test_run_on_a_bad_file_prints_one_error_line(llama, tmp_path, capsys, flags):
    name = "blk.0.attn_q.weight"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(patch(llama.raw, llama.part(llama.ti[name], OFFSET), llama.offset(name) + 4, 8))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    cases = [(bad, f"{bad}: " + llama.at(name, llama.offset(name) + 4)),
             (tmp_path / "missing.gguf", f"--model {tmp_path / 'missing.gguf'}: no such file"),
             (tmp_path, f"--model {tmp_path}: no such file"),
             (empty, f"{empty}: truncated: 0 bytes is shorter than a GGUF header")]  # fmt: skip
    for path, needle in cases:
        assert cli.main(["run", "--model", str(path), "--tokens", "2", *flags]) == 2  # a user error
        out, err = capsys.readouterr()
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("accelplane: error: "), err
        assert needle in lines[0] and out == "", (needle, err, out)


# --- fuzzing --------------------------------------------------------------------------------------------
INTERESTING = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 24, 31, 32, 33, 63, 64, 255, 256, 4096, 2**31 - 1,
               2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 32, 2**64 - 1]  # fmt: skip


def _int_fields(b: Parsed) -> list[tuple[int, int]]:
    """(file offset, size) of every integer of the header, the keys and the tensor infos:
    counts, lengths, types, dims, offsets, values."""
    out = [(4, 4), (8, 8), (16, 8)]
    for f in [*b.kv.values(), *b.ti.values()]:
        at = f.offset
        for p in f.parts:
            if p.dtype.kind in "ui" and p.itemsize in (4, 8):
                out += [(at + j * p.itemsize, p.itemsize) for j in range(p.size)]
            at += int(p.nbytes)
    return out


@st.composite
def mutated(draw, b: Parsed) -> bytes:
    """A valid file with 1 to 3 mutations, mostly in the header, keys and tensor infos (the
    first data_start bytes; the magic is left alone, tested above): byte flips, integers set to
    edge values or nudged, truncations of every length class, inserted or deleted bytes."""
    raw, ints = bytearray(b.raw), _int_fields(b)

    def position(hi: int) -> int:  # in [4, hi]: near an integer field or anywhere
        if draw(st.booleans()):
            at, size = draw(st.sampled_from(ints))
            return min(hi, max(4, at + draw(st.integers(-2, size + 1))))
        return draw(st.integers(4, max(4, hi)))

    for _ in range(draw(st.integers(1, 3))):
        n = len(raw)
        meta = min(b.data_start, n)
        kind = draw(st.sampled_from(["flip", "int", "int", "truncate", "insert", "delete"]))
        if kind == "flip" and n > 4:
            at = position(meta - 1) if draw(st.integers(0, 4)) else draw(st.integers(4, n - 1))
            raw[at] ^= draw(st.integers(1, 255))
        elif kind == "int":
            at, size = draw(st.sampled_from(ints))
            if at + size <= n:
                old = int.from_bytes(raw[at : at + size], "little")
                new = draw(st.sampled_from(INTERESTING) | st.integers(-3, 3).map(lambda d, o=old: o + d))
                raw[at : at + size] = (new % (1 << (8 * size))).to_bytes(size, "little")
        elif kind == "truncate":
            cut = draw(st.sampled_from([(0, 23), (24, meta), (meta, max(meta, n - 1)), "edge"]))
            if cut == "edge":  # just before, at or after a field boundary
                at, size = draw(st.sampled_from(ints))
                n = max(0, min(n, at + draw(st.sampled_from([0, 1, size - 1, size, size + 1]))))
            else:
                n = min(n, draw(st.integers(cut[0], max(cut))))
            del raw[n:]
        elif kind == "insert" and n > 4:
            at = position(meta)
            raw[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete" and n > 4:
            at = position(meta - 1)
            del raw[at : at + draw(st.integers(1, 16))]
    return bytes(raw)


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail (not hang) when the block runs longer than ``seconds``."""

    def fail(*_):
        raise AssertionError(f"read_gguf ran over {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def assert_sound(p: Path, raw: bytes, model: bool) -> None:
    """``p`` (bytes ``raw``) loads and every tensor is what the file says: a supported type,
    1 to 4 dims >= 1, its byte size by the gguf package's block sizes, aligned, inside the file,
    overlapping no other, its bytes the file's; the metadata as the gguf package reads it. Or
    GGUFError: never another exception, never a hang."""
    with deadline(10):
        try:
            f = read_gguf(p)
            if model:
                f.check_tensors(f.model_config())
        except GGUFError:
            TALLY.add("gguf", "refused (GGUFError)")
            return
    spans = []
    for t in f.tensors.values():
        blck, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t.type))]
        assert t.type in SUPPORTED_TYPES and 1 <= len(t.shape) <= 4 and min(t.shape) >= 1, t
        assert t.shape[-1] % blck == 0 and t.nbytes == math.prod(t.shape) // blck * size, t.name
        assert t.data_offset % f.alignment == 0 and t.file_offset + t.nbytes <= len(raw), t.name
        assert bytes(t.data) == raw[t.file_offset : t.file_offset + t.nbytes], t.name
        spans.append((t.file_offset, t.file_offset + t.nbytes))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
    r = gguf.GGUFReader(p)
    theirs = {k: x.contents() for k, x in r.fields.items() if k not in HEADER_FIELDS}
    assert repr({k: mv.value for k, mv in f.metadata.items()}) == repr(theirs)  # repr: NaN == NaN
    f.close()
    TALLY.add("gguf", "loaded, every tensor sound")


# ACCELPLANE_FUZZ=long: 10 000 examples over the two tests
@settings(max_examples=examples(ci=1200, long=6000), deadline=None)
@given(data=st.data())
def test_fuzzed_files_load_or_raise_gguf_error(small, tmp_path_factory, data):
    p = tmp_path_factory.getbasetemp() / "fuzz-small.gguf"
    raw = data.draw(mutated(small))
    p.write_bytes(raw)
    assert_sound(p, raw, model=False)


@settings(max_examples=examples(ci=600, long=4000), deadline=None)
@given(data=st.data())
def test_fuzzed_models_load_or_raise_gguf_error(llama, tmp_path_factory, data):
    p = tmp_path_factory.getbasetemp() / "fuzz-llama.gguf"
    raw = data.draw(mutated(llama))
    p.write_bytes(raw)
    assert_sound(p, raw, model=True)
