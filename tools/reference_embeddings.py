#!/usr/bin/env python3
"""llama.cpp's embeddings of a synthetic bert model, the reference tests/test_bert_gguf.py holds
accelplane's bert to.

Makes a deterministic synthetic bert GGUF file (:data:`MODEL`, F32 and Q8_0) with
``accelplane.models.make_model``, runs llama.cpp on it through its Python binding (llama_cpp)
for :data:`LENGTHS` sequences of token ids ([CLS] ... [SEP]; 263 tokens in all, one of 129),
each decoded alone, and saves the raw (unnormalised) embeddings per file type and pooling (the
file's mean, and cls, last and none by the context's pooling override) with the files' SHA-256,
so the test can rebuild the same files without llama.cpp and notice when they are no longer the
same.

    python tools/reference_embeddings.py [--out tests/data/bert_reference.npz]

It needs llama_cpp importable, over a llama.cpp CPU build (LLAMA_CPP_LIB_PATH).

llama.cpp runs with its extra CPU buffer types off (``use_extra_bufts = false``): the repacked
Q8_0 kernels a native build selects on this machine stop the process with SIGILL; without them
llama.cpp computes with ggml's standard CPU kernels.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np

MODEL = dict(arch="bert", n_layers=2, d_model=64, n_head=4, d_ff=256, n_vocab=512, n_ctx=256, n_token_types=2,
             pooling="mean", seed=7)  # fmt: skip
WTYPES = ("f32", "q8_0")
POOLINGS = {"f32": ("mean", "cls", "last", "none"), "q8_0": ("mean", "cls")}
LENGTHS = (3, 17, 64, 129, 50)
CLS, SEP = 101, 102  # bert-base's ids, as accelplane's synthetic vocabulary has them
OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "bert_reference.npz"


def sequences(n_vocab: int = int(MODEL["n_vocab"]), seed: int = 0) -> list[list[int]]:
    """The token id sequences: [CLS], random ordinary tokens, [SEP]."""
    rng = np.random.default_rng(seed)
    return [[CLS, *rng.integers(104, n_vocab, n - 2).tolist(), SEP] for n in LENGTHS]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_file(path: Path, wtype: str) -> str:
    """The synthetic model of ``wtype`` at ``path``; its SHA-256."""
    from accelplane.models import make_model

    make_model(path, wtype=wtype, jobs=1, **MODEL)
    return sha256(path)


def llama_cpp_embeddings(path: Path, pooling: str, seqs: list[list[int]]) -> np.ndarray:
    """llama.cpp's raw embeddings: [n_seqs, d] pooled, [total tokens, d] with pooling none."""
    import llama_cpp
    import llama_cpp.llama_cpp as lc

    default_params = lc.llama_model_default_params

    def params():
        p = default_params()
        p.use_extra_bufts = False  # see the module docstring
        return p

    pt = {"none": 0, "mean": 1, "cls": 2, "last": 3}[pooling]
    lc.llama_model_default_params = params
    try:
        n = int(MODEL["n_ctx"])
        llm = llama_cpp.Llama(model_path=str(path), embedding=True, n_ctx=n, n_batch=n, n_ubatch=n,
                              n_gpu_layers=0, pooling_type=pt, verbose=False)  # fmt: skip
    finally:
        lc.llama_model_default_params = default_params
    if llm.pooling_type() != pt:
        raise SystemExit(f"llama.cpp pools by {llm.pooling_type()}, not {pt}")
    d, out = llm.n_embd(), []
    for s in seqs:
        llm._ctx.kv_cache_clear()
        llm._batch.reset()
        llm._batch.add_sequence(s, 0, True)
        llm._ctx.decode(llm._batch)
        if pt == 0:
            ptr = lc.llama_get_embeddings(llm._ctx.ctx)
            out.append(np.ctypeslib.as_array(ptr, shape=(len(s), d)).copy())
        else:
            ptr = lc.llama_get_embeddings_seq(llm._ctx.ctx, 0)
            out.append(np.ctypeslib.as_array(ptr, shape=(1, d)).copy())
    llm.close()
    return np.concatenate(out).astype(np.float32)


def llama_cpp_version() -> str:
    import llama_cpp

    src = Path(llama_cpp.__file__).resolve().parents[1] / "vendor" / "llama.cpp"
    try:
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return f"llama-cpp-python {llama_cpp.__version__}, llama.cpp {commit}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    seqs = sequences()
    data: dict[str, np.ndarray] = {"ids": np.concatenate(seqs).astype(np.int32),
                                   "lengths": np.array([len(s) for s in seqs], np.int32)}  # fmt: skip
    meta = {"model": MODEL, "cases": [], "sha256": {}, "source": llama_cpp_version()}
    with tempfile.TemporaryDirectory() as tmp:
        for wt in WTYPES:
            path = Path(tmp) / f"bert-{wt}.gguf"
            meta["sha256"][wt] = make_file(path, wt)
            for pooling in POOLINGS[wt]:
                data[f"{wt}_{pooling}"] = llama_cpp_embeddings(path, pooling, seqs)
                meta["cases"].append([wt, pooling])
                print(f"{wt} {pooling}: {data[f'{wt}_{pooling}'].shape}")
    data["meta"] = np.array(json.dumps(meta))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **data)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes; {meta['source']})")


if __name__ == "__main__":
    main()
