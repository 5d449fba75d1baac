"""accelplane.models: GGUF I/O (round trip, malformed files), the decoder of every architecture
against an independent float64 numpy forward pass (tests/decoder_ref.py), the KV cache against
full recomputation, the CPU
plugin against the asynchronous test device and every installed plugin, graph reuse across
tokens, and `accelplane run` / `bench model` end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import accelplane
import gguf
import numpy as np
import pytest
from accelplane.core.ops import Op
from accelplane.core.types import GGMLType, dequantize
from accelplane.errors import ConfigError, DeviceError, GGUFError, OutOfRangeError, ShapeError
from accelplane.interface import DeviceType
from accelplane.models import LlamaModel, make_model, read_gguf, save_gguf, write_gguf
from accelplane.models.decoder import SplitKind, SplitRole, WeightSpec
from accelplane.models.gguf import MetaValue, synthetic_tensor
from accelplane.models.runner import NMSE_TOL
from accelplane.oracle.compare import nmse
from accelplane.testing.plugins import cpu_and_async_registry

sys.path.insert(0, str(Path(__file__).parent))
import decoder_ref  # noqa: E402

TINY = dict(n_layers=2, d_model=64, n_head=4, n_head_kv=2, d_ff=96, n_vocab=128, n_ctx=256)
MOE = dict(TINY, n_expert=4, n_expert_used=2)
# what each architecture adds: Llama 3's rope factors; qwen2's biases; qwen3's Q/K norms with a
# head size other than d_model / n_head, tied head; qwen3moe's experts of their own FFN length;
# gemma3's sliding window (8 positions) in
# five layers of six, linear rope scaling, soft-capping; gemma3_swa: every layer has the window
# (fewer layers than the pattern), so no layer reads the full causal mask
ARCH_MODELS = {
    "llama3": dict(TINY, wtype="f32", rope_scaling="llama3", seed=3),
    "qwen2": dict(TINY, arch="qwen2", wtype="f32", seed=4),
    "qwen3": dict(TINY, arch="qwen3", wtype="f32", head_dim=32, tied=True, seed=5),
    "qwen3moe": dict(MOE, arch="qwen3moe", wtype="f32", head_dim=32, d_ff_exp=64, seed=8),
    "gemma3": dict(TINY, arch="gemma3", wtype="f32", n_layers=6, sliding_window=8, logit_softcap=30.0,
                   rope_scaling="linear", rope_factor=4.0, seed=6),
    "gemma3_swa": dict(TINY, arch="gemma3", wtype="f32", sliding_window=8, seed=7),
}


@pytest.fixture(scope="module")
def reg():
    """A private registry: the CPU plugin and the asynchronous test device."""
    os.environ.setdefault("ACCELPLANE_TEST_DELAY_US", "20")
    return cpu_and_async_registry(n_async=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny model files, made once: name -> path."""
    d = tmp_path_factory.mktemp("models")
    out = {}
    for name, kw in {
        "f32": dict(TINY, wtype="f32"),
        "q8_0": dict(TINY, wtype="q8_0", seed=1),
        "moe": dict(MOE, wtype="f32", seed=2),
        **ARCH_MODELS,
    }.items():
        out[name] = d / f"{name}.gguf"
        make_model(out[name], **kw)
    return out


# --- GGUF ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "wtype, d_model, d_ff",
    [("f32", 64, 96), ("f16", 64, 96), ("bf16", 64, 96), ("q8_0", 64, 96), ("q4_0", 64, 96),
     ("q4_1", 64, 96), ("q5_0", 64, 96), ("q5_1", 64, 96), ("q2_k", 256, 256), ("q3_k", 256, 256),
     ("q4_k", 256, 256), ("q5_k", 256, 256), ("q6_k", 256, 256), ("iq4_nl", 64, 96), ("iq4_xs", 256, 256)],
)  # fmt: skip
def test_gguf_round_trip(tmp_path, wtype, d_model, d_ff):
    """make → read → save gives the same bytes; metadata and tensor bytes are what was written;
    the gguf package reads the same tensors back."""
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    cfg = make_model(a, n_layers=1, d_model=d_model, n_head=4, n_head_kv=2, d_ff=d_ff, n_vocab=288,
                     wtype=wtype, output_type="q6_k" if d_model % 256 == 0 else None, seed=7)  # fmt: skip
    with read_gguf(a) as f:
        assert f.model_config() == cfg
        assert f.get("llama.block_count") == 1 and f.get("general.architecture") == "llama"
        assert len(f.get("tokenizer.ggml.tokens")) == 288
        for spec in cfg.weights():
            t = f.tensors[spec.name]
            assert t.shape == spec.shape
            assert t.type == (GGMLType[wtype.upper()] if spec.matrix else GGMLType.F32) or (
                spec.name == "output.weight")  # fmt: skip
            want = synthetic_tensor(spec, t.type, 7, cfg).reshape(-1)
            assert np.array_equal(t.data, want), spec.name
        save_gguf(b, f)
    assert a.read_bytes() == b.read_bytes()
    with read_gguf(b) as g, read_gguf(a) as f:
        assert g.metadata == f.metadata
        r = gguf.GGUFReader(b)
        for rt in r.tensors:
            assert bytes(rt.data.reshape(-1).view(np.uint8)) == bytes(f.tensors[rt.name].data)


def test_make_model_in_worker_processes_is_the_same_file(tmp_path):
    """Weights made by worker processes (written in order, a window ahead) give the serial bytes."""
    kw = dict(n_layers=3, d_model=64, n_head=4, n_head_kv=2, d_ff=96, n_vocab=288, wtype="q4_0", seed=3)
    make_model(tmp_path / "serial.gguf", jobs=1, **kw)
    make_model(tmp_path / "parallel.gguf", jobs=3, **kw)
    assert (tmp_path / "serial.gguf").read_bytes() == (tmp_path / "parallel.gguf").read_bytes()


@pytest.mark.parametrize("ty", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q4_0])
def test_synthetic_blocks_are_valid(ty):
    """Synthetic weights decode (by the gguf package and by accelplane identically) to finite
    values of the intended spread N(0, 1/K)."""
    spec = WeightSpec("blk.0.ffn_up.weight", (96, 512), 0, True)
    raw = synthetic_tensor(spec, ty, 0)
    x = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(ty)))
    assert np.isfinite(x).all()
    assert np.array_equal(x.astype(np.float32), dequantize(ty, raw, 512))
    assert abs(x.std() * np.sqrt(512) - 1) < 0.1 and abs(x.mean() * np.sqrt(512)) < 0.1


def _tensor_info_offset(data: bytes, name: str) -> int:
    """Byte offset of the type id in the tensor info of ``name``."""
    key = len(name).to_bytes(8, "little") + name.encode()
    i = data.index(key) + len(key)
    n_dims = int.from_bytes(data[i : i + 4], "little")
    return i + 4 + 8 * n_dims


def test_malformed_files(tmp_path, models):
    good = models["q8_0"].read_bytes()

    def variant(name: str, data: bytes) -> Path:
        p = tmp_path / name
        p.write_bytes(data)
        return p

    cases = {
        "missing": (tmp_path / "nope.gguf", "cannot read"),
        "empty": (variant("empty.gguf", b""), "shorter than a GGUF header"),
        "bad magic": (variant("magic.gguf", b"GGUX" + good[4:]), "bad magic"),
        "truncated header": (variant("th.gguf", good[:200]), "truncated"),
        "truncated data": (variant("td.gguf", good[:-100]), "truncated: tensor 'output.weight'"),
    }
    for what, (path, msg) in cases.items():
        with pytest.raises(GGUFError, match=msg):
            read_gguf(path)
        with pytest.raises(GGUFError, match=msg):
            LlamaModel.from_gguf(path, [accelplane.device("CPU")])
        print(what, "ok")
    # unknown and unsupported tensor type ids
    off = _tensor_info_offset(good, "blk.0.attn_q.weight")
    for tid, msg in ((99, "unknown tensor type id 99"), (16, "IQ2_XXS, which accelplane does not support")):
        bad = bytearray(good)
        bad[off : off + 4] = tid.to_bytes(4, "little")
        with pytest.raises(GGUFError, match=f"blk.0.attn_q.weight.*{msg}|{msg}"):
            read_gguf(variant(f"type{tid}.gguf", bytes(bad)))
    # missing key, bad key type, shape mismatch, missing and extra tensors
    with read_gguf(models["q8_0"]) as f:
        md, ts = dict(f.metadata), list(f.tensors.values())
        no_key = {k: v for k, v in md.items() if k != "llama.block_count"}
        write_gguf(tmp_path / "nokey.gguf", no_key, ts)
        with pytest.raises(GGUFError, match="missing metadata key 'llama.block_count'"):
            read_gguf(tmp_path / "nokey.gguf").model_config()
        bad_type = dict(md, **{"llama.block_count": MetaValue("two", gguf.GGUFValueType.STRING)})
        write_gguf(tmp_path / "badkey.gguf", bad_type, ts)
        with pytest.raises(GGUFError, match="'llama.block_count' must be an integer"):
            LlamaModel.from_gguf(tmp_path / "badkey.gguf", [accelplane.device("CPU")])
        wrong_ff = dict(md, **{"llama.feed_forward_length": MetaValue(128, gguf.GGUFValueType.UINT32)})
        write_gguf(tmp_path / "shape.gguf", wrong_ff, ts)
        with pytest.raises(GGUFError, match=r"tensor 'blk.0.ffn_gate.weight' has shape \(96, 64\), "
                                            r"but the llama.\* metadata needs \(128, 64\)"):  # fmt: skip
            LlamaModel.from_gguf(tmp_path / "shape.gguf", [accelplane.device("CPU")])
        write_gguf(tmp_path / "notensor.gguf", md, [t for t in ts if t.name != "blk.1.attn_k.weight"])
        with pytest.raises(GGUFError, match="missing tensor 'blk.1.attn_k.weight'"):
            LlamaModel.from_gguf(tmp_path / "notensor.gguf", [accelplane.device("CPU")])
        arch = dict(md, **{"general.architecture": MetaValue("gpt2", gguf.GGUFValueType.STRING)})
        write_gguf(tmp_path / "arch.gguf", arch, ts)
        with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
            read_gguf(tmp_path / "arch.gguf").model_config()


def _with(path: Path, out: Path, drop=(), tensors=None, **keys) -> Path:
    """``path`` rewritten with metadata ``keys`` (name with dots as __; a MetaValue, or a value
    with the type of the key it replaces), without the keys ``drop``, with ``tensors``."""
    with read_gguf(path) as f:
        md = {k: v for k, v in f.metadata.items() if k not in drop}
        for k, v in keys.items():
            k = k.replace("__", ".")
            md[k] = v if isinstance(v, MetaValue) else MetaValue(v, md[k].type, md[k].sub_type)
        write_gguf(out, md, list(f.tensors.values()) if tensors is None else tensors(f))
    return out


def test_architecture_metadata_as_llama_cpp_reads_it(tmp_path, models):
    """Keys and tensors per architecture as llama.cpp's loader takes them, and a GGUFError
    naming the key or tensor for what accelplane does not implement."""
    V = gguf.GGUFValueType
    u32 = lambda v: MetaValue(v, V.UINT32)  # noqa: E731
    with read_gguf(models["gemma3"]) as f:
        cfg = f.model_config()
    assert cfg.swa_layers == (True,) * 5 + (False,) and cfg.n_swa == 8 and cfg.logit_softcap == 30.0
    assert cfg.rope_scale == 0.25 and cfg.rope_base_swa == 10000.0 and cfg.embd_scale == 8.0
    p = _with(models["gemma3"], tmp_path / "pattern.gguf", gemma3__attention__sliding_window_pattern=u32(2))
    assert read_gguf(p).model_config().swa_layers == (True, False) * 3
    flags = MetaValue([True, False, False, True, True, False], V.ARRAY, V.BOOL)
    p = _with(models["gemma3"], tmp_path / "flags.gguf", gemma3__attention__sliding_window_pattern=flags)
    assert read_gguf(p).model_config().swa_layers == tuple(flags.value)
    p = _with(models["gemma3"], tmp_path / "noswa.gguf", drop=["gemma3.attention.sliding_window"])
    assert not read_gguf(p).model_config().has_swa
    with read_gguf(models["qwen3"]) as f:
        q3 = f.model_config()
    assert q3.head_dim == 32 and q3.qk_norm and q3.tied_output and q3.rope_neox
    with read_gguf(models["qwen2"]) as f:
        assert f.model_config().biases == {"attn_q", "attn_k", "attn_v"}
    bad = {
        "yarn": (dict(qwen2__rope__scaling__type=MetaValue("yarn", V.STRING)), "rope.scaling.type' = 'yarn'"),
        "scaling": (dict(qwen2__rope__scaling__type=MetaValue("cubic", V.STRING)), "not a rope scaling type"),
        "value_length": (dict(qwen2__attention__value_length=u32(8)), "differs from value_length"),
        "per_layer": (dict(qwen2__attention__head_count_kv=MetaValue([2, 4], V.ARRAY, V.UINT32)),
                      r"per-layer values \[2, 4\] differ"),
        "n_rot": (dict(qwen2__rope__dimension_count=u32(8)), "rope.dimension_count 8 differs"),
    }  # fmt: skip
    for what, (keys, msg) in bad.items():
        with pytest.raises(GGUFError, match=msg):
            read_gguf(_with(models["qwen2"], tmp_path / f"{what}.gguf", **keys)).model_config()
    with pytest.raises(GGUFError, match="missing metadata key 'qwen2.attention.layer_norm_rms_epsilon'"):
        read_gguf(_with(models["qwen2"], tmp_path / "eps.gguf",
                        drop=["qwen2.attention.layer_norm_rms_epsilon"])).model_config()  # fmt: skip
    three = MetaValue([True, True, False], V.ARRAY, V.BOOL)
    with pytest.raises(GGUFError, match="3 flags for 6 layers"):
        read_gguf(_with(models["gemma3"], tmp_path / "flags3.gguf",
                        gemma3__attention__sliding_window_pattern=three)).model_config()  # fmt: skip
    # llama's rope factors are not another architecture's tensor
    with read_gguf(models["llama3"]) as llama3:
        p = _with(models["qwen2"], tmp_path / "rf.gguf",
                  tensors=lambda f: [*f.tensors.values(), llama3.tensors["rope_freqs.weight"]])  # fmt: skip
    with pytest.raises(GGUFError, match="'rope_freqs.weight' is not part of a qwen2 model"):
        LlamaModel.from_gguf(p, [accelplane.device("CPU")])


def test_fuzzed_headers_never_crash(tmp_path, models):
    """Truncations and byte flips anywhere in the header: GGUFError or a valid file, never
    another exception (nor a hang)."""
    good = models["q8_0"].read_bytes()
    header_end = _tensor_info_offset(good, "output.weight") + 12
    rng = np.random.default_rng(0)
    p = tmp_path / "fuzz.gguf"
    for i in range(150):
        data = bytearray(good)
        if i % 3 == 0:
            data = data[: int(rng.integers(0, header_end + 64))]
        else:
            for _ in range(int(rng.integers(1, 4))):
                data[int(rng.integers(4, header_end))] = int(rng.integers(0, 256))
        p.write_bytes(bytes(data))
        try:
            with read_gguf(p) as f:
                f.check_tensors(f.model_config())
        except GGUFError:
            pass


_LOAD_RSS = """
import json, sys
import accelplane
from accelplane.models import DecoderModel, read_gguf

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

cpu = accelplane.device("CPU")
f = read_gguf(sys.argv[1])
warm = DecoderModel.from_gguf(sys.argv[2], [cpu], n_ctx=256)  # kernels and libraries loaded
warm.free()
with open("/proc/self/clear_refs", "w") as c:
    c.write("5")  # resets the peak (VmHWM) to the current RSS
before = status("VmRSS")
m = DecoderModel.from_gguf(f, [cpu], n_ctx=256)
print(json.dumps({"peak": status("VmHWM") - before, "weights": sum(m.weight_bytes().values()),
                  "largest": max(t.nbytes for t in f.tensors.values())}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_loading_holds_no_second_copy_of_the_weights(tmp_path, models):
    """Weights go from the file's memory map to the device buffers tensor by tensor and each
    tensor's pages are released once uploaded: loading a 250 MB file raises the process's peak
    memory by the weights, one tensor and a little more, not by twice the weights."""
    path = tmp_path / "big.gguf"
    make_model(path, n_layers=12, d_model=1024, n_head=16, n_head_kv=4, d_ff=2816, n_vocab=32000,
               n_ctx=512, wtype="q8_0", jobs=1)  # fmt: skip
    r = subprocess.run([sys.executable, "-c", _LOAD_RSS, str(path), str(models["q8_0"])], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)
    assert m["weights"] > 200 << 20
    assert m["peak"] < m["weights"] + m["largest"] + (32 << 20), m


# --- the model against an independent numpy forward pass ----------------------------------------------
@pytest.mark.parametrize(
    "name, cache, tol",
    [("f32", "f32", 1e-9), ("moe", "f32", 1e-9), ("q8_0", "f16", 2e-4),
     *((a, "f32", 1e-9) for a in ARCH_MODELS)],
)  # fmt: skip
def test_logits_match_numpy_float64(models, name, cache, tol):
    """Prefill (all rows) and then decode steps, against the float64 numpy forward pass (from
    the checkpoint's side: llama's rows unpermuted and rotate-half rope, gemma's 1 + w norms)."""
    w, md = decoder_ref.read(models[name])
    n = 12 if name.startswith("gemma3") else 10  # past gemma3's window of 8
    tokens = np.random.default_rng(5).integers(0, TINY["n_vocab"], n)
    want = decoder_ref.forward(w, md, tokens)
    m = LlamaModel.from_gguf(models[name], [accelplane.device("CPU")], n_ctx=32, kv_pad=16,
                             cache_type=cache)  # fmt: skip
    try:
        pre = m.eval(tokens[:6], all_logits=True)
        got = [pre.logits] + [m.eval([t]).logits for t in tokens[6:]]
    finally:
        m.free()
    got = np.concatenate(got)
    e = nmse(got, want)
    assert e < tol, (name, e)
    assert np.array_equal(pre.ids, want[:6].argmax(-1))


def test_numpy_oracle_sees_the_conventions(models):
    """The oracle is not blind to what it checks: without Llama 3's rope factors, or without
    gemma's sliding window, it gives other logits."""
    tokens = np.random.default_rng(5).integers(0, TINY["n_vocab"], 12)
    drops = {
        "llama3": lambda w, md: ({k: v for k, v in w.items() if "rope" not in k}, md),
        "gemma3": lambda w, md: (w, {**md, "gemma3.attention.sliding_window": 0}),
    }
    for name, drop in drops.items():
        w, md = decoder_ref.read(models[name])
        want = decoder_ref.forward(w, md, tokens)
        assert nmse(decoder_ref.forward(*drop(w, md), tokens), want) > 1e-6, name


def test_kv_cache_decode_equals_full_prefill(models):
    """16 teacher-forced tokens decoded one at a time with the cache equal, at every step,
    the last row of a fresh prefill of the whole sequence so far."""
    cpu = accelplane.device("CPU")
    tokens = np.random.default_rng(6).integers(0, TINY["n_vocab"], 16)
    m = LlamaModel.from_gguf(models["f32"], [cpu], n_ctx=32, kv_pad=8)  # windows 8, 16 (2 graphs)
    full = LlamaModel.from_gguf(models["f32"], [cpu], n_ctx=32, kv_pad=8)
    try:
        for i, t in enumerate(tokens):
            step = m.eval([t]).logits[0]
            full.reset()
            ref = full.eval(tokens[: i + 1]).logits[-1]
            assert nmse(step, ref) < 1e-9, i
            assert step.argmax() == ref.argmax()
    finally:
        m.free()
        full.free()


def test_kv_windows_double_or_pad(models):
    """kv_growth: "double" windows are kv_pad times a power of two (capped at n_ctx), "pad" ones
    multiples of kv_pad; 40 one-token evals build 4 decode graphs against 6 (each eval also builds
    the next position's, to write its positions early), with the same logits (slots past the last
    position are masked either way). Bad values raise ConfigError."""
    cpu = accelplane.device("CPU")
    tokens = np.random.default_rng(7).integers(0, TINY["n_vocab"], 40)
    got = {}
    for growth in ("double", "pad"):
        m = LlamaModel.from_gguf(models["f32"], [cpu], n_ctx=48, kv_pad=8, kv_growth=growth)
        try:
            assert m.kv_growth == growth
            want = {"double": [8, 8, 16, 32, 32, 48, 48], "pad": [8, 8, 16, 24, 32, 40, 48]}[growth]
            assert [m.window(n) for n in (1, 8, 9, 17, 32, 33, 48)] == want
            got[growth] = np.stack([m.eval([t]).logits[0] for t in tokens])
            assert len({k[1] for k in m._steps if k[0] == 1}) == {"double": 4, "pad": 6}[growth]
        finally:
            m.free()
    assert nmse(got["double"], got["pad"]) < 1e-12
    assert LlamaModel.from_gguf(models["f32"], [cpu], n_ctx=16).kv_growth == "pad"  # a CPU's default
    for bad in ({"kv_growth": "linear"}, {"kv_pad": 0}, {"kv_pad": 2.5}):
        with pytest.raises(ConfigError):
            LlamaModel.from_gguf(models["f32"], [cpu], n_ctx=16, **bad)


# --- devices -----------------------------------------------------------------------------------------
def _teacher_forced_64(path: Path, devices, cpu, inspect=None, **kw) -> np.ndarray:
    tokens = np.random.default_rng(7).integers(0, TINY["n_vocab"], 64)
    m = LlamaModel.from_gguf(path, devices, cpu=cpu, n_ctx=128, kv_pad=64, **kw)
    try:
        out = [m.eval(tokens[:8], all_logits=True).logits]
        out += [m.eval([t]).logits for t in tokens[8:]]
        if inspect is not None:
            inspect(m)
    finally:
        m.free()
    return np.concatenate(out)


def test_tensor_split_decode_replays_recordings(reg, models):
    """Tensor split over two devices that can record: from the second decode step on, each
    step is one replay per device (accelplane.parallel.meta), with the CPU plugin's logits."""
    cpu = reg.device("CPU")
    stats = []
    want = _teacher_forced_64(models["q8_0"], [cpu], cpu)
    got = _teacher_forced_64(models["q8_0"], [reg.device("ASYNC0"), reg.device("ASYNC1")], cpu,
                             inspect=lambda m: stats.append(m.meta.stats), split="tensor")  # fmt: skip
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.95
    assert nmse(got, want) <= NMSE_TOL
    st = stats[0]
    assert st.record_error == "" and st.replays == 56 - 1, st  # 56 decode steps: the first records


def _installed_devices() -> list[str]:
    try:
        return [d.name for d in accelplane.get_registry().devices if d.type != DeviceType.CPU]
    except Exception:  # a broken plugin setup must not break collection
        return []


@pytest.mark.parametrize("split", ["none", "layer"])
def test_cpu_vs_async_device_64_tokens(reg, models, split):
    """The same model teacher-forced over 64 tokens on the CPU plugin and on the asynchronous
    test device(s): same top-1 on >= 95% of positions, NMSE <= 1e-6 (same kernels, so in fact
    equal)."""
    cpu = reg.device("CPU")
    devs = [reg.device("ASYNC0")] + ([reg.device("ASYNC1")] if split == "layer" else [])
    want = _teacher_forced_64(models["q8_0"], [cpu], cpu)
    got = _teacher_forced_64(models["q8_0"], devs, cpu, split=split)
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.95
    assert nmse(got, want) <= 1e-6


@pytest.mark.parametrize("device", _installed_devices())
def test_installed_plugins_64_tokens(models, device):
    """Every installed non-CPU plugin device: same top-1 as the CPU plugin on >= 95% of 64
    teacher-forced positions, logits within `accelplane run`'s NMSE tolerance."""
    reg = accelplane.get_registry()
    cpu = reg.device("CPU")
    want = _teacher_forced_64(models["q8_0"], [cpu], cpu)
    got = _teacher_forced_64(models["q8_0"], [reg.device(device)], cpu)
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.95
    assert nmse(got, want) <= NMSE_TOL


def test_cpu_computes_in_the_device_host_memory(reg, models, monkeypatch):
    """One accelerator with a host buffer type it reaches only through copies (a GPU's pinned
    memory; the asynchronous test device's): the CPU's compute memory is of that type, and a
    CPU split (experts in host memory) gives the CPU-only model's logits, whose copies read it
    when they run. A device that would read that memory in place keeps the CPU's own type (the
    copies into the scheduler's slots keep a queued step's CPU outputs from the last's)."""
    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    host = dev.host_buffer_type
    toks = [3, 17, 42, 5, 99, 7]

    def logits(m) -> np.ndarray:  # a 4-token prefill, then two decode steps
        steps = [m.eval(toks[:4], all_logits=True).logits] + [m.eval([t]).logits for t in toks[4:]]
        return np.concatenate(steps)

    want = LlamaModel.from_gguf(models["qwen3moe"], [cpu], cpu=cpu, n_ctx=64)
    try:
        ref = logits(want)
    finally:
        want.free()
    m = LlamaModel.from_gguf(models["qwen3moe"], [dev], cpu=cpu, cpu_moe=2, n_ctx=64)
    try:
        assert host is not None and m.sched.bufts[-1] is host
        got = logits(m)
        last = len(m.sched.backends) - 1  # the CPU
        cpu_out = [n for sp in m.sched._computed.splits if sp.backend == last for n in sp.nodes]
        assert cpu_out and all(n.buffer.buft is host for n in cpu_out if n.view_src is None)
    finally:
        m.free()
    assert nmse(got, ref) < 1e-9
    monkeypatch.setitem(dev._fn, "supports_buft", lambda device, buft: buft.device is device)
    m = LlamaModel.from_gguf(models["qwen3moe"], [dev], cpu=cpu, n_ctx=64)
    try:
        assert m.sched.bufts[-1] is cpu.buffer_type
    finally:
        m.free()


def test_decode_shares_host_experts_with_the_device(reg, models):
    """Experts in host memory on a device that reads its host memory in place (the asynchronous
    test device, with its randomized delays): a decode step computes each token's first slots on
    the device, reading their experts where they are (no upload), queued behind the copies of
    what the CPU needs, so the CPU computes the other slots meanwhile; a 6-token prefill none of
    that; every step's logits are the CPU-only model's. 0 turns it off; a share outside [0, 1] is
    refused."""
    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    toks = [3, 17, 42, 5, 99, 7, 11, 23, 64]
    ref = LlamaModel.from_gguf(models["qwen3moe"], [cpu], cpu=cpu, n_ctx=64)
    try:
        want = np.concatenate([ref.eval(toks[:6], all_logits=True).logits]
                              + [ref.eval([t]).logits for t in toks[6:]])  # fmt: skip
    finally:
        ref.free()
    for share, device_experts in ((0.375, True), (0.0, False)):
        m = LlamaModel.from_gguf(models["qwen3moe"], [dev], cpu=cpu, cpu_moe=2, n_ctx=64,
                                 moe_device_share=share)  # fmt: skip
        try:
            got = [m.eval(toks[:6], all_logits=True).logits]
            for t in toks[6:]:
                got.append(m.eval([t]).logits)
                plan = m.sched._computed
                on = ["CPU" if m.sched.backends[sp.backend].device is cpu else "dev" for sp in plan.splits]
                assert not any(i.moe_ids is not None for sp in plan.splits for i in sp.inputs)
                assert m.sched.stats.expert_bytes == 0
                # per layer: attention and router, then (a share) the device's experts, then the CPU's
                assert on == (["dev", "dev", "CPU"] * 2 if device_experts else ["dev", "CPU"] * 2) + ["dev"]
                ids = [n for sp in plan.splits for n in sp.nodes if n.op is Op.MUL_MAT_ID]
                assert len(ids) == (12 if device_experts else 6)
                # what the CPU reads is copied out right behind the split computing it
                assert sorted(plan.early) == ([0, 3] if device_experts else [0, 2])
        finally:
            m.free()
        assert nmse(np.concatenate(got), want) < 1e-9, share
    with pytest.raises(ConfigError, match="moe_device_share"):
        LlamaModel.from_gguf(models["qwen3moe"], [dev], cpu=cpu, cpu_moe=2, n_ctx=64, moe_device_share=1.5)


@pytest.mark.parametrize("device", _installed_devices())
def test_experts_in_host_memory(models, device):
    """cpu_moe (--experts cpu, --n-cpu-moe N): the expert tensors of the first N layers live in
    host memory (the device's pinned host buffers), computed on by the CPU, every other weight
    on the device; a 40-token prefill (offloaded: the
    device runs the products on uploaded experts) and decode steps (the CPU runs them) give
    the all-on-device model's logits."""
    reg = accelplane.get_registry()
    cpu, dev = reg.device("CPU"), reg.device(device)
    toks = np.random.default_rng(9).integers(0, TINY["n_vocab"], 43)
    out = {}
    for n in (0, 1, 2):
        m = LlamaModel.from_gguf(models["qwen3moe"], [dev], cpu=cpu, cpu_moe=n, n_ctx=64)
        try:
            on_cpu = {k for k, d in m.placement.items() if d is cpu}
            want = {f"blk.{i}.ffn_{p}_exps.weight" for i in range(n) for p in ("gate", "up", "down")}
            assert on_cpu == want
            # in the device's pinned host buffers where it has them (asynchronous uploads)
            host = dev.host_buffer_type
            pinned = host.name if host is not None and host.is_host else cpu.buffer_type.name
            assert {m.w[k].buffer.buft.name for k in want} <= {pinned}
            out[n] = np.concatenate([m.eval(toks[:40], all_logits=True).logits]
                                    + [m.eval([t]).logits for t in toks[40:]])  # fmt: skip
        finally:
            m.free()
    for n in (1, 2):
        assert nmse(out[n], out[0]) < 1e-9, (device, n)


def test_run_and_bench_model_with_experts_in_host_memory(models, capsys):
    from accelplane import cli

    dev = (_installed_devices() or ["CPU"])[0]
    argv = ["run", "--model", str(models["qwen3moe"]), "-d", dev, "--n-cpu-moe", "1", "--tokens", "2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"weights on {dev}" in out and "weights on CPU" in out and ": OK" in out, out
    route = r"routing check vs CPU \(\d+ expert choices, replayed on the CPU\): \d+ differ .*: OK"
    assert re.search(route, out), out
    assert cli.main(["run", "--model", str(models["f32"]), "--experts", "cpu"]) == 2
    assert "--experts cpu: the model (llama) has no experts" in capsys.readouterr().err
    assert cli.main(["bench", "model", "--model", str(models["qwen3moe"]), "-d", dev, "--n-cpu-moe", "0,2",
                     "--pp", "8", "--tg", "2", "--reps", "1"]) == 0  # fmt: skip
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| synthetic-qwen3moe")]
    assert [ln.split("|")[6].strip() for ln in rows] == ["0", "0", "2", "2"], rows  # ncmoe per pp, tg row


def test_moe_routing_traced_and_forced(models):
    """eval(trace_routing=True) returns each MoE layer's router probabilities (rows of a
    softmax) and the experts used (their top k, stable); eval(routing=...) makes every layer
    use the given experts: the traced ones reproduce the logits bit for bit, others change
    them and come back as used; bad routing is refused."""
    from accelplane.errors import OutOfRangeError
    from accelplane.models.decoder import Routing

    cpu = accelplane.get_registry().device("CPU")
    m = LlamaModel.from_gguf(models["qwen3moe"], [cpu], n_ctx=64)
    toks = [3, 17, 40, 99, 5]
    try:
        plain = m.eval(toks).logits
        m.reset()
        r = m.eval(toks, trace_routing=True)
        assert len(r.routing) == MOE["n_layers"] and np.array_equal(r.logits, plain)
        for layer in r.routing:
            assert layer.probs.shape == (5, MOE["n_expert"]) and layer.ids.shape == (5, MOE["n_expert_used"])
            assert np.allclose(layer.probs.astype(np.float64).sum(1), 1.0, atol=1e-6)
            top = np.argsort(-layer.probs.astype(np.float64), axis=1, kind="stable")[:, :2]
            assert np.array_equal(layer.ids, top)
        m.reset()
        assert np.array_equal(m.eval(toks, routing=r.routing).logits, plain)
        other = [Routing(x.probs, (x.ids + 1) % MOE["n_expert"]) for x in r.routing]
        m.reset()
        got = m.eval(toks, routing=other)
        assert np.abs(got.logits - plain).max() > 1e-3
        assert all(np.array_equal(g.ids, o.ids) for g, o in zip(got.routing, other, strict=True))
        with pytest.raises(ShapeError, match="routing for 2 MoE layers"):
            m.eval([1], routing=[Routing(r.routing[0].probs[:1], r.routing[0].ids[:1])])
        with pytest.raises(ShapeError, match="shape"):
            m.eval([1], routing=r.routing)
        bad = [Routing(x.probs[:1], np.full((1, 2), MOE["n_expert"], np.int32)) for x in r.routing]
        with pytest.raises(OutOfRangeError, match="routing ids"):
            m.eval([1], routing=bad)
    finally:
        m.free()
    dense = LlamaModel.from_gguf(models["f32"], [cpu], n_ctx=16)
    try:
        with pytest.raises(ShapeError, match="MoE models only"):
            dense.eval([1], trace_routing=True)
    finally:
        dense.free()


def test_routing_agreement_measures_the_distance_from_a_tie():
    """routing_agreement: choices equal to the reference's own top k count as agreeing; a swap
    is measured by the log of the reference's probability ratio across it (float64 by hand)."""
    from accelplane.models.decoder import Routing
    from accelplane.models.runner import routing_agreement

    probs = np.array([[0.4, 0.3, 0.2, 0.1], [0.25, 0.249, 0.3, 0.201]], np.float32)
    same = [[Routing(probs, np.array([[0, 1], [2, 0]], np.int32))]]
    ag = routing_agreement(same, [[Routing(probs, same[0][0].ids)]])
    assert (ag.choices, ag.differ, ag.worst, ag.ok) == (2, 0, 0.0, True)
    # token 1: the run's router put expert 1 a hair above expert 0, the reference's a hair below
    dev_probs = probs.copy()
    dev_probs[1, :2] = [0.249, 0.25]
    near = [[Routing(dev_probs, np.array([[0, 1], [2, 1]], np.int32))]]
    ag = routing_agreement(near, [[Routing(probs, near[0][0].ids)]])
    f64 = lambda v: float(np.float32(v))  # noqa: E731  (the probabilities as stored)
    assert ag.differ == 1 and ag.ok and np.isclose(ag.worst, np.log(f64(0.25) / f64(0.249)), rtol=1e-9)
    far = [[Routing(probs, np.array([[0, 3], [2, 0]], np.int32))]]  # token 0: 0.1 for 0.3
    ag = routing_agreement(far, [[Routing(probs, far[0][0].ids)]])
    assert ag.differ == 1 and not ag.ok and np.isclose(ag.worst, np.log(f64(0.3) / f64(0.1)), rtol=1e-9)
    assert ag.not_top == 1  # expert 3 (0.1) over expert 1 (0.3): not this run's own top 2 either
    # the run's own probabilities pick other experts than it used: a defect even where the
    # reference agrees with the choice
    mine = np.array([[0.1, 0.1, 0.4, 0.4], [0.25, 0.249, 0.3, 0.201]], np.float32)
    ag = routing_agreement([[Routing(mine, same[0][0].ids)]], [[Routing(probs, same[0][0].ids)]])
    assert (ag.differ, ag.not_top, ag.ok) == (0, 1, False)


def test_context_past_the_v_slot_indices_is_refused(models):
    """A context whose V cache slots (n_embd_kv x n_ctx) would need indices past int32 is a
    ConfigError before any memory is allocated."""
    f = read_gguf(models["f32"])
    n_embd_kv = f.model_config().n_embd_kv
    with pytest.raises(ConfigError, match="too large"):
        LlamaModel.from_gguf(models["f32"], [accelplane.device("CPU")], n_ctx=(1 << 31) // n_embd_kv + 1)


def test_cpu_moe_is_validated(models):
    cpu = accelplane.device("CPU")
    with pytest.raises(ConfigError, match="no experts"):
        LlamaModel.from_gguf(models["f32"], [cpu], cpu_moe=1)
    with pytest.raises(ConfigError, match="integer >= 0"):
        LlamaModel.from_gguf(models["moe"], [cpu], cpu_moe=-1)


def test_qwen3moe_metadata(tmp_path, models):
    """qwen3moe reads expert_feed_forward_length (else feed_forward_length / expert_used_count,
    as llama.cpp) and refuses a file without experts; d_ff_exp is qwen3moe's alone."""
    with read_gguf(models["qwen3moe"]) as f:
        cfg = f.model_config()
        assert (cfg.n_expert, cfg.n_expert_used, cfg.d_ff_exp, cfg.qk_norm) == (4, 2, 64, True)
        assert f.tensors["blk.0.ffn_down_exps.weight"].shape == (4, 64, 64)
    p = _with(models["qwen3moe"], tmp_path / "noff.gguf", drop=["qwen3moe.expert_feed_forward_length"])
    assert read_gguf(p).model_config().d_ff_exp == TINY["d_ff"] // 2
    p = _with(models["qwen3moe"], tmp_path / "noexp.gguf", drop=["qwen3moe.expert_count"])
    with pytest.raises(GGUFError, match="expert_count"):
        read_gguf(p).model_config()
    with pytest.raises(ShapeError, match="d_ff_exp"):
        make_model(tmp_path / "x.gguf", **dict(MOE, d_ff_exp=64))
    with pytest.raises(GGUFError, match="n_expert > 0"):
        make_model(tmp_path / "x.gguf", arch="qwen3moe", **TINY)


def test_token_loops_have_no_gc_pauses(models):
    """generate's decode loop runs with the cyclic collector off: decode steps that make
    container garbage (enough for many gen-0 collections) trigger none between them; the
    collector is back on afterwards."""
    import gc

    from accelplane.models.runner import generate

    m = LlamaModel.from_gguf(models["f32"], [accelplane.device("CPU")], n_ctx=64)
    real = m.eval
    log: list[tuple] = []

    def eval_(tokens, **kw):
        if len(tokens) == 1:
            log.append(("decode", gc.isenabled()))
            [[i] for i in range(20000)]  # noqa: B018 - garbage the collector would otherwise chase
        return real(tokens, **kw)

    def cb(phase, info):
        if phase == "start":
            log.append(("gc", info["generation"]))

    m.eval = eval_
    gc.callbacks.append(cb)
    try:
        generate(m, [1, 2, 3], 8, False, show=False)
    finally:
        gc.callbacks.remove(cb)
        m.free()
    steps = [i for i, e in enumerate(log) if e[0] == "decode"]
    assert len(steps) == 8 and all(not log[i][1] for i in steps), log
    assert all(e[0] == "decode" for e in log[steps[0] : steps[-1] + 1]), log
    assert gc.isenabled()


def test_graphs_and_plans_reused_across_tokens(reg, models):
    """Decode steps recompute the same graph object: no new graphs, no new scheduler plans, no
    new CPU-plugin or device plans once the first steps are done."""
    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    for devices in ([cpu], [dev]):
        m = LlamaModel.from_gguf(models["q8_0"], devices, cpu=cpu, n_ctx=64, kv_pad=64)
        try:
            m.eval([1, 2, 3, 4])
            m.eval([5])
            g = m.step(1, 64).graph
            n_graphs, plans = len(m._steps), m.sched.stats.plans
            caches = [b.ctx if hasattr(b.ctx, "builds") else b.ctx.plans for b in m.backends]
            builds = [c.builds for c in caches]
            for t in range(6, 30):
                m.eval([t])
            assert m.step(1, 64).graph is g
            assert len(m._steps) == n_graphs == 2
            assert m.sched.stats.plans == plans == 2
            assert [c.builds for c in caches] == builds
        finally:
            m.free()


def test_merged_projections(reg, models):
    """Merged Q/K/V and gate/up matrices: a decode step runs 6 products per layer, not 9, and
    no CONT (either way); the logits equal the unmerged model's (prefill and decode)."""
    from accelplane.core.ops import Op

    cpu = reg.device("CPU")
    tokens = np.random.default_rng(8).integers(0, TINY["n_vocab"], 12)
    out, counts = [], []
    for merge in (True, False):
        m = LlamaModel.from_gguf(models["q8_0"], [cpu], n_ctx=32, kv_pad=16, merge=merge)
        try:
            assert bool(m.merged) is merge
            got = [m.eval(tokens[:6], all_logits=True).logits] + [m.eval([t]).logits for t in tokens[6:]]
            out.append(np.concatenate(got))
            ops = [n.op for n in m.step(1, 16).graph.nodes]
            counts.append((ops.count(Op.MUL_MAT), ops.count(Op.CONT)))
        finally:
            m.free()
    L = TINY["n_layers"]
    assert counts == [(6 * L + 1, 0), (9 * L + 1, 0)]  # single-token permutes need no copy
    assert _nmse(out[0], out[1]) < 1e-10


def test_cpu_matrices_in_the_repack_buffer(reg, models, monkeypatch):
    """On the CPU the Q8_0 model's matrices (all but the embeddings) live in the CPU's repack
    buffer in the x8 layout, and everything else in host memory; ACCELPLANE_MODEL_REPACK=0 keeps
    them all in host memory as in the file. Both give the same logits (prefill and decode) and
    the same weight bytes back."""
    cpu = reg.device("CPU")
    tokens = np.random.default_rng(4).integers(0, TINY["n_vocab"], 12)
    out = []
    for repack in ("1", "0"):
        monkeypatch.setenv("ACCELPLANE_MODEL_REPACK", repack)
        m = LlamaModel.from_gguf(models["q8_0"], [cpu], n_ctx=32, kv_pad=16)
        try:
            where = {name: t.buffer.buft.name for name, t in m.w.items()}
            matrices = {n for n, t in m.w.items() if t.ne[1] > 1 and n != "token_embd.weight"}
            assert matrices and "token_embd.weight" in m.w
            if repack == "1":
                assert {where[n] for n in matrices} == {"CPU_REPACK"}
                assert all(m.w[n].data_owner.extra is not None for n in matrices)
                assert {where[n] for n in set(m.w) - matrices} == {"CPU"}
            else:
                assert set(where.values()) == {"CPU"}
            got = [m.eval(tokens[:6], all_logits=True).logits] + [m.eval([t]).logits for t in tokens[6:]]
            out.append((np.concatenate(got), {n: m.w[n].get_bytes() for n in sorted(matrices)}))
        finally:
            m.free()
    assert _nmse(out[0][0], out[1][0]) < 1e-10
    assert all(np.array_equal(out[0][1][n], out[1][1][n]) for n in out[0][1])


def test_merge_skips_groups_of_mixed_types(reg, models):
    """A V projection of another type than Q and K (as in llama.cpp's Q4_K_M files) leaves that
    layer's Q/K/V unmerged; gate/up of one type still merge; the logits equal merge=False."""
    from accelplane.models.gguf import read_gguf

    cfg = read_gguf(models["f32"]).model_config()
    w, _ = decoder_ref.read(models["f32"])
    types = {n: ("f32" if n.endswith("attn_v.weight") or w[n].ndim == 1 else "q8_0") for n in w}
    tokens = [3, 1, 4, 1, 5]
    out = []
    for merge in (True, False):
        m = LlamaModel(cfg, [reg.device("CPU")], types=types, n_ctx=16, kv_pad=16, merge=merge)
        try:
            m.set_weights({n: v.astype(np.float32) for n, v in w.items()})
            if merge:
                want = [f"blk.{i}.ffn_gate_up.weight" for i in range(TINY["n_layers"])]
                assert sorted(m.merged) == sorted(want)
            out.append(np.concatenate([m.eval([t]).logits for t in tokens]))
        finally:
            m.free()
    assert _nmse(out[0], out[1]) < 1e-10


def _nmse(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sum((a - b) ** 2) / np.sum(b * b))


@pytest.mark.parametrize("name", ["f32", "llama3", "qwen2", "qwen3", "gemma3"])
def test_split_tensor_matches_split_none(reg, models, name):
    """Tensor split over the two asynchronous test devices (meta device): the prefill's logits
    for every token and a decode step through the split KV cache match split none (biases split
    with their projections, per-head norms, post norms of all-reduced sums, rope factors)."""
    cpu = reg.device("CPU")
    devs = [reg.device("ASYNC0"), reg.device("ASYNC1")]
    toks = [3, 17, 5, 125, 9, 1, 77, 4, 120, 33, 2, 8]
    outs = {}
    for split, d in (("none", devs[:1]), ("tensor", devs)):
        m = LlamaModel.from_gguf(models[name], d, cpu=cpu, split=split)
        try:
            pre = m.eval(toks, all_logits=True)
            dec = m.eval([int(pre.ids[-1])])
            outs[split] = (pre.logits, dec.logits, pre.ids)
            if split == "tensor":
                plan = "\n".join(m.describe_plan(1))
                assert "tensor split over 2 devices" in plan and "ASYNC1" in plan
                assert m.meta.stats.allreduces > 0
        finally:
            m.free()
    for got, want in zip(outs["tensor"][:2], outs["none"][:2], strict=True):
        assert _nmse(got, want) < 1e-8
    assert np.array_equal(outs["tensor"][2], outs["none"][2])


def test_embeddings_on_the_device(reg, models, monkeypatch):
    """embd="device" keeps the token embeddings on the first layer's device: a decode step is
    then one scheduler split, with the same logits as embd="cpu" (embeddings in host memory,
    GET_ROWS on the CPU, its result copied over). The default, "auto", picks the device when it
    runs the GET_ROWS, and host memory on a CPU; a bad value is a DeviceError."""
    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    toks = [3, 17, 5, 125, 9, 1]
    outs = {}
    monkeypatch.delenv("ACCELPLANE_MODEL_EMBD", raising=False)
    m = LlamaModel.from_gguf(models["f32"], [dev], cpu=cpu)
    assert m.placement["token_embd.weight"] is dev  # auto: ASYNC0 runs GET_ROWS
    m.free()
    m = LlamaModel.from_gguf(models["f32"], [cpu], cpu=cpu)
    assert m.placement["token_embd.weight"] is cpu
    m.free()
    for embd in ("cpu", "device"):
        monkeypatch.setenv("ACCELPLANE_MODEL_EMBD", embd)
        m = LlamaModel.from_gguf(models["f32"], [dev], cpu=cpu)
        try:
            assert m.placement["token_embd.weight"] is (dev if embd == "device" else cpu)
            pre = m.eval(toks, all_logits=True)
            dec = m.eval([int(pre.ids[-1])])
            outs[embd] = (pre.logits, dec.logits)
            assert m.sched.stats.splits == (1 if embd == "device" else 2), m.sched.stats  # the decode's
        finally:
            m.free()
    for got, want in zip(outs["device"], outs["cpu"], strict=True):
        assert _nmse(got, want) < 1e-12
    with pytest.raises(ConfigError, match="embd must be"):
        LlamaModel.from_gguf(models["f32"], [dev], cpu=cpu, embd="gpu")
    monkeypatch.setenv("ACCELPLANE_MODEL_EMBD", "gpu")
    with pytest.raises(ConfigError, match="ACCELPLANE_MODEL_EMBD='gpu'"):
        LlamaModel.from_gguf(models["f32"], [dev], cpu=cpu)


def test_decode_writes_next_positions_early(reg, models):
    """A decode step writes the next step's positions, mask and V slots while the device
    runs (the scheduler has copied this step's inputs: Scheduler.inputs_released), so the
    next eval only writes its token; across window changes (kv_pad 8) it writes them itself.
    Teacher-forced logits equal those of a model that never writes early."""
    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    tokens = np.random.default_rng(8).integers(0, TINY["n_vocab"], 20)
    outs, writes = [], []
    for early in (True, False):
        m = LlamaModel.from_gguf(models["f32"], [dev], cpu=cpu, n_ctx=32, kv_pad=8)
        if not early:
            m.sched.inputs_released = lambda: False
        calls = []  # (position written, ahead of the model's position: written early)
        orig = m._set_positions

        def count(st, n_past, m=m, orig=orig, calls=calls):
            calls.append((n_past, n_past > m.n_past))
            orig(st, n_past)

        m._set_positions = count
        try:
            out = [m.eval(tokens[:4], all_logits=True).logits]
            out += [m.eval([t]).logits for t in tokens[4:]]
            outs.append(np.concatenate(out))
            writes.append(calls)
        finally:
            m.free()
    assert _nmse(outs[0], outs[1]) < 1e-12
    # without: one write per eval; with: the prefill's and the first of each window of 8
    # (the step before it ran another graph), the others early (and one past the last token)
    assert writes[1] == [(p, False) for p in (0, *range(4, 20))]
    ahead = [(p, p not in (0, 4, 8, 16)) for p in (0, *range(4, 21))]
    assert writes[0] == ahead, writes[0]


def _eval_loop(m, prompt, n: int) -> list[int]:
    """The greedy picks after ``prompt`` and ``n`` more, one eval (and its wait) per token."""
    m.reset()
    out = [int(m.eval(prompt, want_logits=False).ids[-1])]
    for _ in range(n):
        out.append(int(m.eval(out[-1:], want_logits=False).ids[-1]))
    return out


DECODE_SETUPS = {  # model, devices, keyword arguments
    "cpu": ("q8_0", ["CPU"], {}),
    "async": ("q8_0", ["ASYNC0"], {}),
    "async, embeddings in host memory": ("q8_0", ["ASYNC0"], {"embd": "cpu"}),
    "layer split": ("q8_0", ["ASYNC0", "ASYNC1"], {"split": "layer"}),
    "moe": ("qwen3moe", ["ASYNC0"], {}),
    "moe, experts in host memory": ("qwen3moe", ["ASYNC0"], {"cpu_moe": 1}),
    "tensor split (one eval a step)": ("q8_0", ["ASYNC0", "ASYNC1"], {"split": "tensor"}),
    **{f"installed {d}": ("qwen3moe", [d], {}) for d in _installed_devices()},
}


@pytest.mark.parametrize("setup", list(DECODE_SETUPS))
def test_decode_feeds_picks_back_on_the_device(reg, models, setup):
    """decode(): each step's argmax is copied over the next step's token on the device, and
    the host queues step i + 1 before it reads step i's pick. On the asynchronous test device
    (random delays) a step that ran before its positions were copied, or read a token before
    the last step wrote it, would pick differently: the picks equal a loop of evals that
    each wait, across attention windows (kv_pad 8); steps after the first were queued behind
    the last (Stats.queued_behind), except where a window changes. The host reads each pick
    on a second queue of an asynchronous device, after an event of the computing one: a read
    that did not wait would find the pick's slot unwritten. A stop ends it at that pick with
    the context where it was, and decoding on from there picks the same again."""
    name, devs, kw = DECODE_SETUPS[setup]
    if setup.startswith("installed"):
        reg = accelplane.get_registry()
    cpu = reg.device("CPU")
    m = LlamaModel.from_gguf(models[name], [reg.device(d) for d in devs], cpu=cpu, n_ctx=64, kv_pad=8, **kw)
    prompt = [3, 17, 42, 5, 99]
    try:
        want = _eval_loop(m, prompt, 30)
        m.reset()
        m.eval(prompt, want_logits=False)
        behind = m.sched.stats.queued_behind if m.meta is None else 0
        seen: list[int] = []
        assert m.decode(want[0], 30, on_token=seen.append) == want[1:] == seen
        assert m.n_past == len(prompt) + 30
        if m.meta is None:
            assert (m._ring.reader is not None) == (m.embd_dev.caps.async_ and m.embd_dev.has_events)
        if m.meta is None:  # 30 steps, the first and the first of each new window not behind
            windows = len({m.window(p + 1) for p in range(len(prompt), len(prompt) + 30)})
            assert m.sched.stats.queued_behind - behind == 30 - windows
        m.reset()
        m.eval(prompt, want_logits=False)
        stop_at = want[7]
        got = m.decode(want[0], 30, stop=lambda t: t == stop_at)
        k = want[1:].index(stop_at) + 1
        assert got == want[1 : k + 1] and m.n_past == len(prompt) + k
        assert m.decode(got[-1], 30 - k) == want[k + 1 :]
    finally:
        m.free()


def test_decode_checks_its_arguments(reg, models):
    m = LlamaModel.from_gguf(models["f32"], [reg.device("CPU")], n_ctx=16)
    try:
        m.eval([1, 2, 3], want_logits=False)
        for first, n, err in ((-1, 2, OutOfRangeError), (TINY["n_vocab"], 2, OutOfRangeError),
                              (True, 2, OutOfRangeError), (1, -1, ShapeError), (1, "2", ShapeError),
                              (1, 14, OutOfRangeError)):  # fmt: skip
            with pytest.raises(err):
                m.decode(first, n)
        assert m.n_past == 3 and m.decode(1, 0) == []
        assert len(m.decode(1, 13)) == 13 and m.n_past == 16
    finally:
        m.free()


def test_scheduler_policy(reg, models, monkeypatch):
    """The model's scheduler runs the relaxed policy unless ACCELPLANE_MODEL_POLICY (or the
    argument) says strict; on the asynchronous test device the two give the same logits, the
    relaxed one with fewer host synchronizations per decode step; an unknown name is an error."""
    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    tokens = np.random.default_rng(9).integers(0, TINY["n_vocab"], 8)
    outs, syncs = {}, {}
    for pol in ("relaxed", "strict"):
        if pol == "strict":
            monkeypatch.setenv("ACCELPLANE_MODEL_POLICY", "strict")
        m = LlamaModel.from_gguf(models["f32"], [dev], cpu=cpu, n_ctx=32)
        try:
            assert m.sched.policy == pol
            out = [m.eval(tokens[:4], all_logits=True).logits]
            out += [m.eval([t]).logits for t in tokens[4:]]
            outs[pol] = np.concatenate(out)
            syncs[pol] = m.sched.stats.host_syncs
        finally:
            m.free()
    assert _nmse(outs["relaxed"], outs["strict"]) < 1e-12
    assert syncs["relaxed"] < syncs["strict"], syncs
    with pytest.raises(ConfigError, match="policy"):
        LlamaModel.from_gguf(models["f32"], [dev], cpu=cpu, n_ctx=32, policy="eager")


def test_split_modes(reg, models):
    cpu = reg.device("CPU")
    m = LlamaModel.from_gguf(models["moe"], [reg.device("ASYNC0"), reg.device("ASYNC1")], cpu=cpu,
                             split="layer", embd="cpu")  # fmt: skip
    try:
        assert [d.name for d in m.layer_dev] == ["ASYNC0", "ASYNC1"]
        assert m.placement["token_embd.weight"] is cpu and m.placement["output.weight"].name == "ASYNC1"
        plan = "\n".join(m.describe_plan(1))
        assert "blk.0" in plan and "ASYNC1" in plan and "KV cache on ASYNC0" in plan
    finally:
        m.free()
    cfg = read_gguf(models["moe"]).model_config()
    assert cfg.split_role("blk.0.attn_q.weight").kind is SplitKind.COLUMN
    assert cfg.split_role("blk.0.ffn_down_exps.weight").kind is SplitKind.ROW
    assert cfg.split_role("blk.0.attn_output.weight").granularity == cfg.head_dim
    assert cfg.split_role("blk.0.ffn_norm.weight").kind is SplitKind.MIRRORED
    assert cfg.split_role("cache_v_l0") == SplitRole(SplitKind.COLUMN, 1, cfg.head_dim)
    with pytest.raises(ShapeError):
        make_model(Path("/nonexistent/x.gguf"), d_model=64, wtype="q4_k")  # rows of 64: no K-quant


# --- command line -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cli_env(tmp_path_factory):
    """A fresh cache (the default model is made) and only the CPU plugin and the asynchronous
    test devices (the installed plugins are covered above; with a fresh cache they would
    recompile their kernels)."""
    return dict(os.environ, ACCELPLANE_CACHE_DIR=str(tmp_path_factory.mktemp("cache")),
                ACCELPLANE_PLUGINS="cpu,asynctest", ACCELPLANE_TEST_DELAY_US="20",
                ACCELPLANE_EXTRA_PLUGINS="asynctest=accelplane.testing.asyncdev")  # fmt: skip


def test_make_model_writes_every_architecture(tmp_path, capsys):
    """`accelplane make-model --arch A` for every architecture accelplane reads: the file says
    A, loads, and describes itself."""
    from accelplane import cli
    from accelplane.models import ARCHITECTURES

    for arch in ARCHITECTURES:
        p = tmp_path / f"{arch}.gguf"
        assert cli.main(["make-model", str(p), "--arch", arch, "--preset", "tiny", "--jobs", "1"]) == 0
        assert f": {arch}, 2 layers" in capsys.readouterr().out
        with read_gguf(p) as f:
            assert f.get("general.architecture") == arch and f.model_config().arch == arch
            assert ("accelplane.rope.neox" in f.metadata) is False


def test_make_model_architectures_are_one_table():
    """make-model's --arch choices, its presets table and the synthetic makers name the same
    architectures: every decoder, then bert."""
    from accelplane import cli
    from accelplane.models import ARCHITECTURES
    from accelplane.models.gguf import SYNTHETIC_ARCHS
    from accelplane.models.runner import MAKE_ARCHS

    assert cli.MAKE_ARCH_NAMES == list(MAKE_ARCHS) == list(SYNTHETIC_ARCHS) == [*ARCHITECTURES, "bert"]


def test_run_prompt_on_every_decoder_architecture(tmp_path, capsys):
    """`run --prompt` tokenizes with the synthetic file's vocabulary and generates on every
    decoder architecture, up to --tokens tokens."""
    from accelplane import cli
    from accelplane.models import ARCHITECTURES
    from accelplane.models.tokenizer import Tokenizer

    for arch in ARCHITECTURES:
        p = tmp_path / f"{arch}.gguf"
        assert cli.main(["make-model", str(p), "--arch", arch, "--preset", "tiny", "--vocab", "300",
                         "--jobs", "1"]) == 0  # fmt: skip
        capsys.readouterr()
        rc = cli.main(["run", "--model", str(p), "--prompt", "hi", "--tokens", "4", "-d", "CPU"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        tok = Tokenizer.from_gguf(str(p))
        assert f"prompt: {len(tok.encode('hi', add_special=True))} tokens" in err, err
        n = int(re.search(r"generated (\d+) tokens; stopped at", err).group(1))
        assert 0 <= n <= 4 and out.endswith("\n")


def test_accelplane_run_end_to_end(cli_env):
    """`accelplane run --tokens 4` makes the default model, runs on the best devices (the two
    asynchronous test devices), prints the plan, tokens/s and the logits check, and exits 0."""
    r = subprocess.run([sys.executable, "-m", "accelplane.cli", "run", "--tokens", "4",
                        "--prompt-tokens", "8"], capture_output=True, text=True, env=cli_env,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "split plan" in r.stdout and "devices found" in r.stdout and "ASYNC0" in r.stdout
    assert "tokens/s" in r.stdout and "logits check vs CPU" in r.stdout and ": OK" in r.stdout
    assert list(Path(cli_env["ACCELPLANE_CACHE_DIR"], "models").glob("*.gguf"))


def test_accelplane_run_split_tensor_and_bench_model(cli_env, models, tmp_path, capsys):
    from accelplane import cli

    r = subprocess.run([sys.executable, "-m", "accelplane.cli", "run", "--model", str(models["f32"]),
                        "--split", "tensor", "--tokens", "4", "--prompt-tokens", "8"],
                       capture_output=True, text=True, env=cli_env, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tensor split over 2 devices" in r.stdout and ": OK" in r.stdout
    js = tmp_path / "bench.json"
    assert cli.main(["bench", "model", "--model", str(models["q8_0"]), "-d", "CPU", "--pp", "16",
                     "--tg", "4", "--reps", "1", "--json", str(js)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "pp16" in out and "tg4" in out
    rows = json.loads(js.read_text())["results"]
    assert {r["test"] for r in rows} == {"pp16", "tg4"} and all(r["tokens_per_s"] > 0 for r in rows)
    assert {r["policy"] for r in rows} == {"relaxed"}  # the model's default, recorded
    tg = next(r for r in rows if r["test"] == "tg4")
    # the same run's copy bandwidth (read + written) and the weights' read rate against it
    assert tg["copy_gb_per_s"] > 0.1
    assert tg["weights_frac_of_copy"] == pytest.approx(tg["weights_gb_per_s"] / tg["copy_gb_per_s"])
    assert "% of copy" in out
    # the decode graph alone, computed back to back (no host work between tokens)
    assert tg["graph_only_tokens_per_s"] > 0 and "graph only t/s" in out


def test_bench_model_multi_device_rows_get_their_speedup(reg, models):
    """A multi-device config's rows carry tokens/s over its first device alone (split none)."""
    from accelplane.bench.model import bench_model, format_bench

    a0, a1 = [d for d in reg.devices if d.type != DeviceType.CPU][:2]
    cpu = next(d for d in reg.devices if d.type == DeviceType.CPU)
    with read_gguf(models["q8_0"]) as f:
        rows = bench_model(f, [([a0], "none"), ([a0, a1], "layer"), ([a1, a0], "tensor")], cpu, pp=8, tg=2,
                           reps=1)  # fmt: skip
    by = {(r["devices"], r["split"], r["test"]): r for r in rows}
    one = by[(a0.name, "none", "tg2")]
    layer = by[(f"{a0.name},{a1.name}", "layer", "tg2")]
    assert "vs_first_device" not in one
    assert layer["vs_first_device"] == pytest.approx(layer["tokens_per_s"] / one["tokens_per_s"])
    assert "vs_first_device" not in by[(f"{a1.name},{a0.name}", "tensor", "tg2")]  # a1 alone did not run
    assert "vs 1 device" in format_bench(rows)
    tensor = by[(f"{a1.name},{a0.name}", "tensor", "tg2")]
    assert tensor["graph_only_tokens_per_s"] > 0 and tensor["meta"]["replays"] > 0, tensor


def test_bench_configs_pair_splits_with_the_device_sets_they_fit(reg):
    from accelplane.bench.model import bench_configs

    a0, a1 = [d.name for d in reg.devices if d.type != DeviceType.CPU][:2]
    got = bench_configs(reg, [a0, f"{a0},{a1}"], ["none", "layer", "tensor"])
    assert [([d.name for d in s], sp) for s, sp in got] == [
        ([a0], "none"), ([a0, a1], "layer"), ([a0, a1], "tensor")]  # fmt: skip
    assert [sp for _, sp in bench_configs(reg, [f"{a0},{a1}"], None)] == ["layer"]
    with pytest.raises(DeviceError, match="split none takes one device"):
        bench_configs(reg, [a0], ["tensor"])
