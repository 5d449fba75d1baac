"""Logits equal to llama.cpp's, per architecture: the synthetic models of
tools/reference_logits.py, rebuilt here byte for byte (their make_model arguments and a digest
of their tensors are in the reference files), run through accelplane over the same 256 tokens
as llama.cpp ran them (one batch, every position's logits), against the logits llama.cpp gave.
F32 weights: every position's cosine >= 0.99999 and the same top-1 token everywhere; Q8_0:
the cosine of all the logits >= 0.9999 (llama.cpp quantizes each product's activations to
Q8_0 blocks, an error of its own of that order; for the MoE models, whose near-tied expert
choices flip under that error, >= 0.999 with 95 % of the positions >= 0.9999 against llama.cpp
or, for a device whose products keep the activations in float, against the float64 forward pass
of tests/decoder_ref.py). The two MoE architectures also in Q4_0 (the MoE benchmarks' weight
type), held to the MoE check. Vulkan and SYCL run two F32 models too, where installed; Vulkan,
SYCL and CUDA run the MoE models with every expert in host memory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import accelplane
import numpy as np
import pytest
from accelplane.models import DecoderModel, make_model, read_gguf
from accelplane.models.gguf import tensor_digest

sys.path.insert(0, str(Path(__file__).parent))
import decoder_ref  # noqa: E402

DATA = Path(__file__).parent / "data" / "reference_logits"
NAMES = sorted(p.stem for p in DATA.glob("*.npz"))
ARCHS = ("llama", "llama-moe", "qwen2", "qwen3", "qwen3moe", "gemma3")
MOE_ARCHS = ("llama-moe", "qwen3moe")


def test_every_architecture_has_its_references():
    want = sorted([f"{a}-{t}" for a in ARCHS for t in ("f32", "q8_0")] + [f"{a}-q4_0" for a in MOE_ARCHS])
    assert want == NAMES, "tools/reference_logits.py makes the reference files"


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """name -> (the rebuilt GGUF file, the reference), each model made once."""
    d = tmp_path_factory.mktemp("reference")
    made: dict[str, Path] = {}

    def get(name: str) -> tuple[Path, dict]:
        ref = dict(np.load(DATA / f"{name}.npz"))
        if name not in made:
            path = d / f"{name}.gguf"
            make_model(path, jobs=1, **json.loads(str(ref["make_model"])))
            with read_gguf(path) as f:
                assert tensor_digest(f) == str(ref["tensor_sha256"]), (
                    f"{name}: the synthetic weights changed; remake the references "
                    "(tools/reference_logits.py)")
            made[name] = path
        return made[name], ref

    return get


@pytest.fixture(scope="module")
def exact(model_file):
    """name -> the float64 forward pass's logits of the reference's tokens (decoder_ref), as a
    reference for agreement(); computed once per model."""
    done: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in done:
            path, ref = model_file(name)
            w, md = decoder_ref.read(path)
            logits = decoder_ref.forward(w, md, ref["tokens"].astype(np.int64))
            done[name] = dict(logits=logits, argmax=logits.argmax(-1))
        return done[name]

    return get


def _run(path: Path, devices, toks: np.ndarray, cpu_moe: int = 0) -> np.ndarray:
    m = DecoderModel.from_gguf(path, devices, n_ctx=512, kv_pad=256, cache_type="f16", cpu_moe=cpu_moe)
    try:
        return m.eval(toks.astype(np.int64), all_logits=True).logits
    finally:
        m.free()


def agreement(got: np.ndarray, ref: dict) -> dict:
    """Per-position (min) and overall cosine, top-1 agreement and the largest difference."""
    want, g = ref["logits"].astype(np.float64), got.astype(np.float64)
    rows = (g * want).sum(-1) / np.linalg.norm(g, axis=-1) / np.linalg.norm(want, axis=-1)
    overall = (g.ravel() @ want.ravel()) / np.linalg.norm(g) / np.linalg.norm(want)
    top1 = float(np.mean(got.argmax(-1) == ref["argmax"]))
    close = float(np.mean(rows >= 0.9999))
    return dict(min_cos=float(rows.min()), cos=float(overall), top1=top1, close=close,
                max_abs=float(np.abs(g - want).max()))  # fmt: skip


def needs_exact(name: str) -> bool:
    """A quantized MoE model: its check also takes the float64 forward pass's agreement."""
    return "moe" in name and "-f32" not in name


def check(name: str, a: dict, exact: dict | None = None) -> None:
    """Assert the agreement ``a`` with llama.cpp meets ``name``'s bar; ``exact``, the agreement with
    the float64 forward pass, for a quantized MoE model (needs_exact)."""
    also = f"; against float64: cos {exact['cos']:.7f}, {exact['close']:.1%} of positions" if exact else ""
    print(f"\n{name}: per-position cos >= {a['min_cos']:.7f}, cos {a['cos']:.7f}, top-1 {a['top1']:.1%}, "
          f"positions with cos >= 0.9999 {a['close']:.1%}, max |diff| {a['max_abs']:.2g}" + also)  # fmt: skip
    if "-f32" in name:
        assert a["min_cos"] >= 0.99999 and a["top1"] == 1.0, (name, a)
    elif "moe" in name:
        # a token whose router scores nearly tie takes another expert under either side's
        # rounding of the activations: llama.cpp quantizes them to Q8_0 blocks (as the CPU
        # plugin does), a device that keeps them in float follows the exact product instead, so
        # those few positions agree with one reference, and the rest as the dense models do
        assert exact is not None, f"{name}: a quantized MoE model is checked with exact="
        assert a["cos"] >= 0.999 and max(a["close"], exact["close"]) >= 0.95, (name, a, exact)
    else:
        assert a["cos"] >= 0.9999, (name, a)


def check_run(name: str, got: np.ndarray, ref: dict, exact, where: str = "") -> None:
    """check() of logits ``got`` of model ``name`` (run ``where``) against llama.cpp's ``ref`` and,
    where the check takes it, the float64 forward pass from the ``exact`` fixture."""
    check(name + where, agreement(got, ref), agreement(got, exact(name)) if needs_exact(name) else None)


@pytest.mark.parametrize("name", NAMES)
def test_cpu_logits_equal_llama_cpp(model_file, exact, name):
    path, ref = model_file(name)
    check_run(name, _run(path, [accelplane.device("CPU")], ref["tokens"]), ref, exact)


@pytest.mark.parametrize("kind", ["vulkan", "sycl"])
@pytest.mark.parametrize("name", ["llama-f32", "gemma3-f32"])
def test_device_logits_equal_llama_cpp(model_file, exact, plugin_device, kind, name):
    dev = plugin_device(kind)
    path, ref = model_file(name)
    check_run(name, _run(path, [dev], ref["tokens"]), ref, exact, f" on {dev.name}")


MOE_NAMES = ["llama-moe-f32", "qwen3moe-f32", "qwen3moe-q8_0", "llama-moe-q4_0", "qwen3moe-q4_0"]


@pytest.mark.parametrize("kind", ["vulkan", "sycl", "cuda"])
@pytest.mark.parametrize("name", MOE_NAMES)
def test_experts_in_host_memory_equal_llama_cpp(model_file, exact, plugin_device, kind, name):
    """Every layer's experts in host memory (--experts cpu), the rest on the device: the
    256-token batch is offloaded, so the scheduler uploads the experts the router chose."""
    dev = plugin_device(kind)
    path, ref = model_file(name)
    n_layers = json.loads(str(ref["make_model"]))["n_layers"]
    check_run(name, _run(path, [dev], ref["tokens"], cpu_moe=n_layers), ref, exact,
              f" on {dev.name}, experts in host memory")  # fmt: skip


@pytest.mark.parametrize("kind", ["vulkan", "sycl"])
@pytest.mark.parametrize("name", [n for n in MOE_NAMES if "-q4_0" in n])
def test_q4_0_experts_on_the_device_equal_llama_cpp(model_file, exact, plugin_device, kind, name):
    """The Q4_0 MoE models with every expert on the device (host memory: the test above)."""
    dev = plugin_device(kind)
    path, ref = model_file(name)
    check_run(name, _run(path, [dev], ref["tokens"]), ref, exact, f" on {dev.name}")


@pytest.mark.parametrize("name", NAMES)
def test_cuda_logits_equal_llama_cpp(model_file, exact, plugin_device, name):
    """Every reference on a CUDA device (skipped without one)."""
    dev = plugin_device("cuda")
    path, ref = model_file(name)
    check_run(name, _run(path, [dev], ref["tokens"]), ref, exact, f" on {dev.name}")


@pytest.mark.parametrize(
    ("name", "mistake"),
    [("llama-f32", "neox rope"), ("llama-f32", "no rope factors"), ("qwen3moe-q4_0", "one expert used"),
     ("llama-moe-q4_0", "one expert used")],
)  # fmt: skip
def test_a_wrong_model_fails_the_check(model_file, exact, name, mistake):
    """The check has teeth: the llama file read as if its rope were NEOX (ignoring the
    converter's Q/K permutation), or without Llama 3's rope factors, misses the reference; so
    does a MoE model run with one expert a token instead of two, against llama.cpp and the
    float64 forward pass alike."""
    from dataclasses import replace

    from accelplane.core.ops import ROPE_TYPE_NEOX

    path, ref = model_file(name)
    with read_gguf(path) as f:
        cfg = f.model_config()
        wrong = {"neox rope": dict(rope_mode=ROPE_TYPE_NEOX), "no rope factors": dict(rope_freqs=False),
                 "one expert used": dict(n_expert_used=1)}[mistake]  # fmt: skip
        cfg = replace(cfg, **wrong)
        m = DecoderModel(cfg, [accelplane.device("CPU")], n_ctx=512, kv_pad=256,
                         types={n: t.type for n, t in f.tensors.items()})  # fmt: skip
        try:
            m.load_weights(lambda n: f.tensors[n].data)
            got = m.eval(ref["tokens"].astype(np.int64), all_logits=True).logits
        finally:
            m.free()
    with pytest.raises(AssertionError):
        check_run(name, got, ref, exact, f" with {mistake}")
