"""Files as llama.cpp's llama-quantize writes them (Q4_K_M, Q5_K_M, Q3_K_M, Q2_K, IQ4_XS, Q4_0
of a synthetic F16 llama and qwen3; tools/reference_quantized.py made them with llama.cpp and
kept, per file, the type llama-quantize chose for every tensor, a digest of its tensor data and
llama.cpp's logits on it). Each file is rebuilt here without llama.cpp: the F16 source from its
make_model arguments, every tensor quantized by accelplane to llama-quantize's type. The digest
proves the rebuilt tensors are llama-quantize's, byte for byte (mixes, fallback types for rows
that are not whole super-blocks, tied heads); then accelplane's logits of the 128 positions,
evaluated in one batch as llama.cpp did, are compared with llama.cpp's: cosine of all the
logits >= 0.999 and the same top-1 token on >= 95 % of the positions."""

from __future__ import annotations

import json
from pathlib import Path

import accelplane
import numpy as np
import pytest
from accelplane.core.types import GGMLType, quantize
from accelplane.models import DecoderModel, make_model, read_gguf
from accelplane.models.gguf import TensorSource, tensor_digest, write_gguf

DATA = Path(__file__).parent / "data" / "reference_quantized"
NAMES = sorted(p.stem for p in DATA.glob("*.npz"))
MIXES = ("Q4_K_M", "Q5_K_M", "Q3_K_M", "Q2_K", "IQ4_XS", "Q4_0")


def test_every_mix_has_its_references():
    assert sorted(f"{a}-{m}" for a in ("llama", "qwen3") for m in MIXES) == NAMES, (
        "tools/reference_quantized.py makes the reference files")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """make_model arguments (JSON) -> the F16 source file, each made once."""
    d = tmp_path_factory.mktemp("quantized")
    made: dict[str, Path] = {}

    def get(kw: str) -> Path:
        if kw not in made:
            made[kw] = d / f"src{len(made)}.gguf"
            make_model(made[kw], jobs=1, **json.loads(kw))
        return made[kw]

    return get


def rebuild(src: Path, ref: dict, dst: Path) -> None:
    """llama-quantize's file from the F16 source: each tensor in llama-quantize's order and type,
    by accelplane's quantizer (the refined IQ4_NL tensors' bytes from the reference)."""
    types = json.loads(str(ref["types"]))  # in llama-quantize's order (it sorts the tensors)
    with read_gguf(src) as f:
        out = []
        for name, tn in types.items():
            t, ty = f.tensors[name], GGMLType[tn]
            if ty == t.type:
                data = np.array(t.data).reshape(-1).view(np.uint8)
            elif f"raw:{t.name}" in ref:
                data = ref[f"raw:{t.name}"]
            else:
                x = np.asarray(t.data).view(np.float16 if t.type == GGMLType.F16 else np.float32)
                data = quantize(ty, x.reshape(-1, t.shape[-1]).astype(np.float32)).reshape(-1)
            out.append(TensorSource(t.name, ty, t.shape, lambda data=data: data))
        write_gguf(dst, f.metadata, out, f.alignment)


@pytest.mark.parametrize("name", NAMES)
def test_llama_quantize_file_gives_llama_cpp_logits(source, tmp_path, name):
    check(source, tmp_path, name, accelplane.device("CPU"))


@pytest.mark.parametrize("kind", ["vulkan", "sycl", "cuda"])
@pytest.mark.parametrize("name", ["llama-Q4_K_M", "llama-IQ4_XS", "qwen3-Q2_K", "qwen3-Q3_K_M"])
def test_llama_quantize_file_on_a_device(source, tmp_path, plugin_device, kind, name):
    check(source, tmp_path, name, plugin_device(kind))


def check(source, tmp_path: Path, name: str, dev) -> None:
    ref = dict(np.load(DATA / f"{name}.npz"))
    path = tmp_path / f"{name}.gguf"
    rebuild(source(str(ref["make_model"])), ref, path)
    with read_gguf(path) as f:
        assert tensor_digest(f) == str(ref["tensor_sha256"]), f"{name}: not llama-quantize's bytes"
    m = DecoderModel.from_gguf(path, [dev], n_ctx=512, kv_pad=256, cache_type="f16")
    try:
        got = m.eval(ref["tokens"].astype(np.int64), all_logits=True).logits.astype(np.float64)
    finally:
        m.free()
    want = ref["logits"].astype(np.float64)
    cos = float(got.ravel() @ want.ravel() / np.linalg.norm(got) / np.linalg.norm(want))
    top1 = float(np.mean(got.argmax(-1) == ref["argmax"]))
    print(f"\n{name} on {dev.name}: cos {cos:.6f}, top-1 {top1:.1%}")
    assert cos >= 0.999 and top1 >= 0.95, (name, cos, top1)


def test_a_wrong_type_misses_the_digest(source, tmp_path):
    """The digest has teeth: one tensor quantized to a neighbouring type is caught."""
    ref = dict(np.load(DATA / "llama-Q4_K_M.npz"))
    types = json.loads(str(ref["types"]))
    name = next(n for n, t in types.items() if t == "Q4_K")
    ref["types"] = json.dumps({**types, name: "Q5_K"})
    rebuild(source(str(ref["make_model"])), ref, tmp_path / "wrong.gguf")
    with read_gguf(tmp_path / "wrong.gguf") as f:
        assert tensor_digest(f) != str(ref["tensor_sha256"])
