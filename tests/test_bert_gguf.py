"""bert GGUF models (accelplane.models.bert, `accelplane embed`, `make-model --arch bert`): the
embeddings against llama.cpp's (tests/data/bert_reference.npz, made by
tools/reference_embeddings.py from the same synthetic files, rebuilt here byte for byte),
variants llama.cpp's reference does not cover against an independent float64 numpy BERT, the
file layout against the gguf package's names, and every bad input as a typed error."""

from __future__ import annotations

import hashlib
import json
import sys
import types
from pathlib import Path

import accelplane
import gguf
import numpy as np
import pytest
from accelplane.cli import main
from accelplane.errors import ConfigError, GGUFError, OutOfRangeError, ShapeError, TokenizerError
from accelplane.interface import DeviceType
from accelplane.models import BertModel, make_model, read_gguf, save_gguf
from accelplane.models import bert as B
from accelplane.models.gguf import MetaValue
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

REF_PATH = Path(__file__).parent / "data" / "bert_reference.npz"
COS_MIN = {"f32": 0.99999, "q8_0": 0.9999}


@pytest.fixture(scope="module")
def ref():
    with np.load(REF_PATH, allow_pickle=False) as z:
        data = {k: z[k] for k in z.files}
    meta = json.loads(str(data.pop("meta")))
    ids, lengths = data.pop("ids"), data.pop("lengths")
    seqs = [s.tolist() for s in np.split(ids, np.cumsum(lengths)[:-1])]
    return meta, seqs, data


@pytest.fixture(scope="module")
def files(ref, tmp_path_factory):
    """The reference's synthetic files, rebuilt: wtype -> path."""
    meta = ref[0]
    d = tmp_path_factory.mktemp("bert")
    out = {}
    for wt in meta["sha256"]:
        out[wt] = d / f"bert-{wt}.gguf"
        make_model(out[wt], wtype=wt, jobs=1, **meta["model"])
    return out


@pytest.fixture(scope="module")
def cpu_models(files):
    ms = {wt: BertModel.from_gguf(p, [accelplane.device("CPU")]) for wt, p in files.items()}
    yield ms
    for m in ms.values():
        m.free()


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_reference_files_are_rebuilt_byte_identical(ref, files):
    """The files the test runs are the ones llama.cpp ran (else: rerun tools/reference_embeddings.py)."""
    for wt, p in files.items():
        assert hashlib.sha256(p.read_bytes()).hexdigest() == ref[0]["sha256"][wt], (
            f"the synthetic bert {wt} file differs from the one the reference was made from")
    assert sum(map(len, ref[1])) >= 256 and max(map(len, ref[1])) >= 128


def _embed(m, seqs, **kw) -> np.ndarray:
    return np.concatenate([e.reshape(-1, m.cfg.d_model) for e in m.embed(seqs, **kw)])


def test_cpu_embeddings_match_llama_cpp(ref, cpu_models):
    """Every case (file type, pooling): the five sequences, padded into one batch, each within
    the cosine bound of llama.cpp's, per pooled vector or, without pooling, per token."""
    meta, seqs, data = ref
    for wt, pooling in meta["cases"]:
        got = _embed(cpu_models[wt], seqs, pooling=pooling, normalize_p=-1)
        want = data[f"{wt}_{pooling}"]
        assert got.shape == want.shape
        cos = cosines(got, want)
        assert cos.min() >= COS_MIN[wt], (wt, pooling, 1 - cos.min())


def test_batching_and_normalization(ref, cpu_models):
    """One sequence per graph gives llama.cpp's result too; the default output is its direction
    at unit length (Euclidean, llama.cpp's default)."""
    meta, seqs, data = ref
    m = cpu_models["f32"]
    m.max_batch_tokens = 150
    try:
        unit = _embed(m, seqs)
    finally:
        m.max_batch_tokens = 4096
    np.testing.assert_allclose(np.linalg.norm(unit, axis=-1), 1.0, rtol=1e-6)
    assert cosines(unit, data["f32_mean"]).min() >= COS_MIN["f32"]


def _other_devices():
    return [d.name for d in accelplane.devices() if d.type != DeviceType.CPU and d.plugin.name in
            ("vulkan", "sycl")]  # fmt: skip


@pytest.mark.parametrize("dev", _other_devices())
def test_device_embeddings_match_llama_cpp(ref, files, dev):
    meta, seqs, data = ref
    for wt in files:
        m = BertModel.from_gguf(files[wt], [accelplane.device(dev)])
        try:
            got = np.stack(m.embed(seqs, normalize_p=-1))
        finally:
            m.free()
        assert cosines(got, data[f"{wt}_mean"]).min() >= COS_MIN[wt], (dev, wt)


# --- an independent float64 BERT ------------------------------------------------------------------
def numpy_bert(f, seq: list[int], pooling: str) -> np.ndarray:
    """llama.cpp's bert forward pass in float64 numpy from the file's tensors (gguf's dequantizer)."""
    w = {n: gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType(int(t.type)))
         .reshape(t.shape).astype(np.float64) for n, t in f.tensors.items()}  # fmt: skip
    d = f.get("bert.embedding_length")
    h = f.get("bert.attention.head_count")
    eps = f.get("bert.attention.layer_norm_epsilon")
    n = len(seq)

    def ln(x, p):
        c = x - x.mean(-1, keepdims=True)
        return c / np.sqrt((c**2).mean(-1, keepdims=True) + eps) * w[p + ".weight"] + w[p + ".bias"]

    def lin(x, p):
        return x @ w[p + ".weight"].T + w.get(p + ".bias", 0.0)

    x = w["token_embd.weight"][seq] + w["position_embd.weight"][:n]
    if "token_types.weight" in w:
        x = x + w["token_types.weight"][0]
    x = ln(x, "token_embd_norm")
    for i in range(f.get("bert.block_count")):
        p = f"blk.{i}."
        q, k, v = (lin(x, p + f"attn_{c}").reshape(n, h, -1).transpose(1, 0, 2) for c in "qkv")
        s = q @ k.transpose(0, 2, 1) / np.sqrt(d // h)
        a = np.exp(s - s.max(-1, keepdims=True))
        o = ((a / a.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(n, d)
        x = ln(lin(o, p + "attn_output") + x, p + "attn_output_norm")
        u = lin(x, p + "ffn_up")
        g = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3)))
        x = ln(lin(g, p + "ffn_down") + x, p + "layer_output_norm")
    return {"none": x, "mean": x.mean(0), "cls": x[0], "last": x[-1]}[pooling]


def _without(f, drop: set[str], path: Path):
    f.tensors = {n: t for n, t in f.tensors.items() if n not in drop}
    save_gguf(path, f)
    return read_gguf(path)


def test_optional_tensors_absent_match_numpy(files, tmp_path, ref):
    """Without the token-type embeddings and the projections' biases (llama.cpp's optional
    tensors) the graph omits them, as the numpy oracle does; their absence changes the result."""
    seqs = ref[1][:3]
    f = read_gguf(files["f32"])
    drop = {n for n in f.tensors if n.endswith(("attn_q.bias", "attn_v.bias", "ffn_down.bias"))}
    g = _without(f, drop | {"token_types.weight"}, tmp_path / "lean.gguf")
    full = read_gguf(files["f32"])
    m = BertModel.from_gguf(g, [accelplane.device("CPU")])
    try:
        for pooling in ("mean", "cls", "last", "none"):
            got = m.embed(seqs, pooling=pooling, normalize_p=-1)
            for s, e in zip(seqs, got, strict=True):
                want = numpy_bert(g, s, pooling)
                assert np.abs(e - want).max() <= 2e-4 * np.abs(want).max()
                assert np.abs(e - numpy_bert(full, s, pooling)).max() > 1e-2 * np.abs(want).max()
    finally:
        m.free()


# --- the file ---------------------------------------------------------------------------------------
def test_synthetic_file_has_llama_cpp_names(files):
    """Tensor names and shapes of gguf's MODEL_ARCH.BERT, keys of gguf.Keys, types as
    convert_hf_to_gguf.py writes them, read back by gguf's own reader."""
    r = gguf.GGUFReader(files["q8_0"])
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BERT]
    assert r.fields["general.architecture"].contents() == arch
    names = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.BERT]}
    n_layers = r.fields[gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)].contents()
    allowed = {n.format(bid=i) + sfx for n in names for i in range(n_layers) for sfx in (".weight", ".bias")}
    d = r.fields[gguf.Keys.LLM.EMBEDDING_LENGTH.format(arch=arch)].contents()
    for t in r.tensors:
        assert t.name in allowed, t.name
        quantized = t.name.endswith(".weight") and len(t.shape) == 2 and t.name not in (
            "position_embd.weight", "token_types.weight")  # fmt: skip
        want = gguf.GGMLQuantizationType.Q8_0 if quantized else gguf.GGMLQuantizationType.F32
        assert t.tensor_type == want, t.name
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}  # ggml order
    n_vocab = len(r.fields[gguf.Keys.Tokenizer.LIST].contents())
    n_ctx = r.fields[gguf.Keys.LLM.CONTEXT_LENGTH.format(arch=arch)].contents()
    assert shapes["token_embd.weight"] == (d, n_vocab) and shapes["position_embd.weight"] == (d, n_ctx)
    assert shapes["token_types.weight"] == (d, r.fields[gguf.Keys.Tokenizer.TOKEN_TYPE_COUNT].contents())
    keys = {gguf.Keys.Attention.LAYERNORM_EPS.format(arch=arch), gguf.Keys.Attention.CAUSAL.format(arch=arch),
            gguf.Keys.LLM.POOLING_TYPE.format(arch=arch), gguf.Keys.LLM.FEED_FORWARD_LENGTH.format(arch=arch),
            gguf.Keys.Attention.HEAD_COUNT.format(arch=arch), gguf.Keys.Tokenizer.MODEL,
            gguf.Keys.Tokenizer.SEP_ID, gguf.Keys.Tokenizer.PAD_ID}  # fmt: skip
    assert keys <= set(r.fields)
    assert r.fields[gguf.Keys.Tokenizer.MODEL].contents() == "bert"
    assert r.fields[gguf.Keys.LLM.POOLING_TYPE.format(arch=arch)].contents() == gguf.PoolingType.MEAN
    assert r.fields[gguf.Keys.Attention.CAUSAL.format(arch=arch)].contents() is False
    toks = r.fields[gguf.Keys.Tokenizer.LIST].contents()
    assert toks[0] == "[PAD]" and toks[101] == "[CLS]" and toks[102] == "[SEP]" and "\u2581hello" in toks


def _edited(path: Path, tmp: Path, *, set_md=None, drop_md=(), rename=None) -> Path:
    f = read_gguf(path)
    for k in drop_md:
        del f.metadata[k]
    V = gguf.GGUFValueType
    for k, v in (set_md or {}).items():
        f.metadata[k] = MetaValue(v, V.UINT32)
    if rename:
        f.tensors = {rename.get(n, n): t for n, t in f.tensors.items()}
        for n, t in f.tensors.items():
            t.name = n
    out = tmp / "edited.gguf"
    save_gguf(out, f)
    return out


@pytest.mark.parametrize(("edit", "parts"), [
    (dict(drop_md=["bert.attention.layer_norm_epsilon"]), ["bert.attention.layer_norm_epsilon"]),
    (dict(drop_md=["tokenizer.ggml.token_type_count"]), ["tokenizer.ggml.token_type_count"]),
    (dict(set_md={"bert.pooling_type": 4}), ["pooling_type = 4", "RANK", "file offset"]),
    (dict(set_md={"bert.pooling_type": 9}), ["pooling_type = 9", "unknown"]),
    (dict(set_md={"bert.attention.head_count_kv": 2}), ["head_count_kv = 2"]),
    (dict(set_md={"bert.block_count": 1 << 30}), ["missing tensor 'blk.2.attn_q.weight'"]),
    (dict(set_md={"bert.block_count": 3}), ["missing tensor 'blk.2.attn_q.weight'"]),
    (dict(set_md={"bert.feed_forward_length": 128}), ["blk.0.ffn_up.weight", "shape"]),
    (dict(set_md={"tokenizer.ggml.token_type_count": 3}), ["token_types.weight", "shape"]),
    (dict(rename={"blk.1.attn_q.weight": "blk.1.attn_qkv.weight"}), ["blk.1.attn_qkv", "unsupported"]),
    (dict(rename={"blk.0.ffn_down.weight": "blk.0.ffn_gate.weight"}), ["blk.0.ffn_gate.weight"]),
])  # fmt: skip
def test_bad_files_are_gguf_errors(files, tmp_path, edit, parts):
    p = _edited(files["f32"], tmp_path, **edit)
    with pytest.raises(GGUFError) as e:
        BertModel.from_gguf(p, [accelplane.device("CPU")])
    for part in parts:
        assert part in str(e.value), (part, str(e.value))
    assert str(p) in str(e.value)


def test_quantized_norm_and_other_arch_are_gguf_errors(files, tmp_path):
    f = read_gguf(files["q8_0"])
    t = f.tensors["position_embd.weight"]
    f.tensors["position_embd.weight"] = type(t)(t.name, f.tensors["token_embd.weight"].type, t.shape,
                                                np.zeros(t.nbytes * 34 // 128, np.uint8))  # fmt: skip
    save_gguf(tmp_path / "q.gguf", f)
    with pytest.raises(GGUFError, match="'position_embd.weight' has type Q8_0; it must be F32"):
        BertModel.from_gguf(tmp_path / "q.gguf", [accelplane.device("CPU")])
    llama = tmp_path / "llama.gguf"
    make_model(llama, n_layers=1, d_model=64, n_head=4, d_ff=128, n_vocab=256, wtype="f32")
    with pytest.raises(GGUFError, match="architecture 'llama' is not bert"):
        BertModel.from_gguf(llama, [accelplane.device("CPU")])
    with pytest.raises(GGUFError, match="accelplane embed"):
        read_gguf(files["f32"]).model_config()


def test_bad_inputs_are_typed_errors(cpu_models):
    m = cpu_models["f32"]
    n_ctx, n_vocab = m.cfg.n_ctx_train, m.cfg.n_vocab
    with pytest.raises(ShapeError, match="sequence 1: 0 tokens"):
        m.embed([[101, 102], []])
    with pytest.raises(ShapeError, match=f"{n_ctx + 1} tokens"):
        m.embed([[5] * (n_ctx + 1)])
    with pytest.raises(OutOfRangeError, match=f"sequence 0, token 2: id {n_vocab}"):
        m.embed([[101, 5, n_vocab]])
    with pytest.raises(OutOfRangeError, match="id -1"):
        m.embed([[-1]])
    with pytest.raises(ShapeError, match="integer token ids"):
        m.embed([[1.5, 2.0]])
    with pytest.raises(ConfigError, match="pooling 'rank'"):
        m.embed([[101]], pooling="rank")
    with pytest.raises(ConfigError, match="pooling 'max'"):
        m.embed([[101]], pooling="max")
    with pytest.raises(ConfigError, match="normalize"):
        m.embed([[101]], normalize_p=-2)
    with pytest.raises(ShapeError, match="at least 104"):
        B.vocabulary(100)
    with pytest.raises(ShapeError, match="multiple of n_head"):
        B.BertConfig(d_model=30, n_head=4)


@settings(max_examples=60, deadline=None)
@given(x=hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 40)),
                    elements=st.floats(-1e3, 1e3, width=32)),
       p=st.sampled_from([-1, 0, 1, 2, 3, 5]))  # fmt: skip
@example(x=np.array([[3.0, -4.0, 0.5], [0.0, 0.0, 0.0]], np.float32), p=0)
@example(x=np.array([[3.0, -4.0, 0.5]], np.float32), p=1)
@example(x=np.array([[3.0, -4.0, 0.5]], np.float32), p=3)
def test_normalize_is_llama_cpps(x, p):
    """common_embd_normalize, restated in float64 per row."""
    got = B.normalize(x, p)
    for row, g in zip(x.astype(np.float64), got, strict=True):
        a = np.abs(row)
        if p == -1:
            s = 1.0
        elif p == 0:
            s = a.max() / 32760.0
        else:
            s = (a**p).sum() ** (1 / p)
        want = row * (1.0 / s) if s > 0 else np.zeros_like(row)
        np.testing.assert_allclose(g, want, rtol=2e-6, atol=1e-30)


# --- the command line -------------------------------------------------------------------------------
def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_make_model_arch_bert(tmp_path, capsys):
    p = tmp_path / "b.gguf"
    rc, out, err = run(capsys, "make-model", str(p), "--arch", "bert", "--preset", "tiny", "--layers", "1",
                       "--pooling", "cls", "--wtype", "f32")  # fmt: skip
    assert rc == 0, err
    assert "bert, 1 layers, d_model 64" in out and "pooling cls" in out
    assert B.config_from_gguf(read_gguf(p)).pooling is B.Pooling.CLS
    for argv, part in ((["--kv-heads", "2"], "--kv-heads does not apply to --arch bert"),
                       (["--tied"], "--tied does not apply"), (["--preset", "8b"], "not a bert preset"),
                       (["--vocab", "50"], "at least 104")):  # fmt: skip
        rc, _, err = run(capsys, "make-model", str(tmp_path / "x.gguf"), "--arch", "bert", *argv)
        assert rc == 2 and part in err, err
    rc, _, err = run(capsys, "make-model", str(tmp_path / "x.gguf"), "--pooling", "mean")
    assert rc == 2 and "--pooling does not apply to --arch llama" in err


def test_embed_command(files, ref, tmp_path, capsys, cpu_models):
    seqs = ref[1][:2]
    ids = [" ".join(map(str, s)) for s in seqs]
    rc, out, err = run(capsys, "embed", "--model", str(files["f32"]), "--ids", ids[0], "--ids",
                       ids[1].replace(" ", ","))  # fmt: skip
    assert rc == 0, err
    lines = out.splitlines()
    want = cpu_models["f32"].embed(seqs)
    for i in range(2):
        vals = np.array(lines[i].split(": ")[1].split(), np.float64)
        np.testing.assert_allclose(vals, want[i], atol=1e-6)
    assert lines[2] == "cosine similarity matrix:"
    npy = tmp_path / "e.npy"
    rc, out, err = run(capsys, "embed", "--model", str(files["f32"]), "--ids", ids[0], "--pooling", "none",
                       "--normalize", "-1", "--out", str(npy))  # fmt: skip
    assert rc == 0 and "wrote" in out, err
    assert cosines(np.load(npy), ref[2]["f32_none"][: len(seqs[0])]).min() >= COS_MIN["f32"]
    for argv, part in (([], "either TEXT"), (["--ids", "1 x"], "expected integers"),
                       (["--ids", " "], "empty"), (["--ids", "1", "hi"], "not both"),
                       (["--ids", "600"], "outside the vocabulary"),
                       (["--ids", "1", "--normalize", "-2"], "--normalize")):  # fmt: skip
        rc, _, err = run(capsys, "embed", "--model", str(files["f32"]), *argv)
        assert rc == 2 and part in err, (argv, err)


def test_embed_text_goes_through_the_tokenizer(files, capsys, monkeypatch):
    """TEXT is encoded by models.tokenizer's Tokenizer.from_gguf(f).encode(text, add_special=True);
    without that module, a one-line error (exit 2) says to pass --ids."""
    monkeypatch.setitem(sys.modules, "accelplane.models.tokenizer", None)
    rc, _, err = run(capsys, "embed", "--model", str(files["f32"]), "hello world")
    assert rc == 2 and "accelplane.models.tokenizer" in err and "--ids" in err
    with pytest.raises(TokenizerError):
        B.encode_texts(read_gguf(files["f32"]), ["hello"])
    calls = []

    class Tokenizer:
        @classmethod
        def from_gguf(cls, f):
            assert f.get("tokenizer.ggml.model") == "bert"
            return cls()

        def encode(self, text, add_special=True):
            calls.append((text, add_special))
            return [101, 5 + len(text), 102]

    fake = types.SimpleNamespace(Tokenizer=Tokenizer)
    monkeypatch.setitem(sys.modules, "accelplane.models.tokenizer", fake)
    rc, out, err = run(capsys, "embed", "--model", str(files["f32"]), "ab", "abc")
    assert rc == 0, err
    assert calls == [("ab", True), ("abc", True)]
    rc, out2, _ = run(capsys, "embed", "--model", str(files["f32"]), "--ids", "101 7 102", "--ids",
                      "101,8,102")  # fmt: skip
    assert out2 == out
