#!/usr/bin/env python3
"""llama.cpp's logits of small synthetic models, one per architecture and weight type, saved as
the reference files of tests/test_reference_logits.py (which needs no llama.cpp).

    python tools/reference_logits.py [--out tests/data/reference_logits] [--only NAME ...]

Needs llama.cpp's Python binding ``llama_cpp`` over a llama.cpp build (a CPU build is enough;
LLAMA_CPP_LIB_PATH names its shared libraries). For each entry of MODELS it writes the model
with ``accelplane.models.make_model`` (deterministic in its arguments: the test rebuilds the
same bytes), evaluates TOKENS in one batch with llama.cpp (every position's logits, F16 KV
cache, no flash attention, no weight repacking: llama.cpp's plain CPU kernels) and saves
``NAME.npz``: the logits (float16), their argmax (from the float32 logits), the tokens, the
make_model arguments, a hash of the tensor data, and the llama.cpp version. The agreement
table in docs/models.md comes from ``python -m pytest tests/test_reference_logits.py -s``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

N_TOKENS = 256
N_CTX = 512  # llama.cpp's context; the models' context_length is the same
SMALL = dict(n_layers=2, d_model=64, n_head=4, n_head_kv=2, d_ff=96, n_vocab=264, n_ctx=N_CTX, seed=11)
# name -> make_model arguments; each exercises what its architecture adds
ARCHS = {
    # Llama 3: rope_freqs factors (Llama 3.1's scaling from an original context of 64), permuted
    # Q/K rows
    "llama": dict(SMALL, arch="llama", rope_scaling="llama3"),
    # Mixtral-style MoE llama: 4 experts, 2 used
    "llama-moe": dict(SMALL, arch="llama", n_expert=4, n_expert_used=2, seed=12),
    # Q/K/V biases, NEOX rope
    "qwen2": dict(SMALL, arch="qwen2", seed=13),
    # per-head Q/K norms, a head size (32) other than d_model / n_head, tied output
    "qwen3": dict(SMALL, arch="qwen3", head_dim=32, tied=True, seed=14),
    # Qwen3's attention with 4 experts (2 used) of their own FFN length in every layer
    "qwen3moe": dict(SMALL, arch="qwen3moe", head_dim=32, n_expert=4, n_expert_used=2, d_ff_exp=64, seed=16),
    # sliding window (32 positions) in five layers of six, linear rope scaling on the global
    # one, soft-capped logits, post norms, GEGLU, scaled embeddings
    "gemma3": dict(SMALL, arch="gemma3", n_layers=6, head_dim=32, sliding_window=32, logit_softcap=30.0,
                   rope_scaling="linear", rope_factor=8.0, seed=15),
}
MODELS = {f"{name}-{wt}": dict(kw, wtype=wt) for name, kw in ARCHS.items() for wt in ("f32", "q8_0")}
# the MoE architectures in Q4_0 too: the weight type of the MoE benchmarks' files
MOE_ARCHS = ("llama-moe", "qwen3moe")
MODELS |= {f"{name}-q4_0": dict(ARCHS[name], wtype="q4_0") for name in MOE_ARCHS}


def tokens(n_vocab: int) -> np.ndarray:
    """The fixed token sequence: N_TOKENS ids past the three control tokens."""
    return np.random.default_rng(2024).integers(3, n_vocab, N_TOKENS).astype(np.int32)


def llama_cpp_logits(path: Path, toks: np.ndarray) -> tuple[np.ndarray, str]:
    """Every position's float32 logits from llama.cpp, and its version."""
    import llama_cpp
    import llama_cpp.llama as lcp

    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False  # llama.cpp's plain kernels, not a repacked (AMX, ...) layout
        return p

    lcp.llama_cpp.llama_model_default_params = params
    try:
        m = lcp.Llama(model_path=str(path), logits_all=True, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX,
                      n_gpu_layers=0, flash_attn=False, verbose=False)  # fmt: skip
    finally:
        lcp.llama_cpp.llama_model_default_params = default
    m.eval(toks.tolist())
    scores = np.array(m.scores[: len(toks)], np.float32)
    sysinfo = llama_cpp.llama_print_system_info().decode(errors="replace")
    del m
    return scores, f"llama_cpp {llama_cpp.__version__}{_llama_cpp_commit()}; {sysinfo.strip()}"


def save_reference(path: Path, logits: np.ndarray, toks: np.ndarray, make_model: dict, **extra) -> bool:
    """Save llama.cpp's ``logits`` of ``toks`` (float16, with their argmax from the float32
    values), the tokens, the model's make_model arguments and ``extra`` fields as ``path``; False
    (and nothing saved) when the logits are not finite."""
    if not np.isfinite(logits).all():
        print(f"{path.stem}: llama.cpp's logits are not finite", file=sys.stderr)
        return False
    np.savez_compressed(path, logits=logits.astype(np.float16), argmax=logits.argmax(-1).astype(np.int16),
                        tokens=toks.astype(np.int16), make_model=json.dumps(make_model, sort_keys=True),
                        **extra)  # fmt: skip
    return True


def _llama_cpp_commit() -> str:
    """`` (llama.cpp <commit>)`` of the build LLAMA_CPP_LIB_PATH names, when it is in a git checkout."""
    import os
    import subprocess

    lib = os.environ.get("LLAMA_CPP_LIB_PATH")
    if not lib:
        return ""
    try:
        r = subprocess.run(["git", "-C", lib, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return f" (llama.cpp {r.stdout.strip()})" if r.returncode == 0 and r.stdout.strip() else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests" / "data" /
                                         "reference_logits"))  # fmt: skip
    ap.add_argument("--only", nargs="*", choices=sorted(MODELS), help="these models only")
    args = ap.parse_args(argv)
    from accelplane.models import make_model, read_gguf
    from accelplane.models.gguf import tensor_digest

    def digest(path: Path) -> str:
        with read_gguf(path) as f:
            return tensor_digest(f)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.only or MODELS:
        kw = MODELS[name]
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / f"{name}.gguf"
            make_model(path, jobs=1, **kw)
            toks = tokens(kw["n_vocab"])
            logits, version = llama_cpp_logits(path, toks)
            settings = dict(n_ctx=N_CTX, cache_type="f16", flash_attn=False, extra_bufts=False)
            if not save_reference(out / f"{name}.npz", logits, toks, kw, tensor_sha256=digest(path),
                                  llama_cpp=version, settings=json.dumps(settings)):  # fmt: skip
                return 1
        gap = np.sort(logits, -1)
        margin = float((gap[:, -1] - gap[:, -2]).min())
        print(f"{name}: {out / (name + '.npz')}  (smallest top-2 gap {margin:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
