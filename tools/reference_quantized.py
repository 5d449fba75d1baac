#!/usr/bin/env python3
"""Files that llama.cpp's llama-quantize writes, and llama.cpp's logits on them, saved as the
reference files of tests/test_quantized_files.py (which needs no llama.cpp).

    python tools/reference_quantized.py [--llama-quantize PATH] [--out DIR] [--only NAME ...]

Needs llama-quantize (default: the one on PATH; LD_LIBRARY_PATH gets its directory) and
llama.cpp's Python binding ``llama_cpp`` over the same build (LLAMA_CPP_LIB_PATH), as
tools/reference_logits.py does. For each architecture of SOURCES and each llama-quantize type of
MIXES it writes the synthetic F16 model with ``accelplane.models.make_model``, quantizes it with
llama-quantize (no importance matrix), evaluates TOKENS tokens of the quantized file with
llama.cpp in one batch and saves ``ARCH-MIX.npz``: the type llama-quantize chose for every
tensor, a digest of the quantized file's tensor data, the bytes of the tensors whose quantizer
llama-quantize refines beyond ggml's reference (IQ4_NL block scales), llama.cpp's logits
(float16) and argmax, the tokens, the source's make_model arguments and the llama.cpp version.
The test rebuilds each quantized file from those (accelplane's quantizers give the bytes) and
compares the digest, then the logits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_logits import llama_cpp_logits, save_reference  # noqa: E402

N_TOKENS = 128
SMALL = dict(n_layers=2, d_model=256, n_head=4, n_head_kv=2, n_vocab=264, n_ctx=512, wtype="f16")
# d_ff 320: the FFN down projection's rows (320) are not a multiple of 256, so every K-quant
# and IQ4_XS mix falls back to a 32-block type there, as in published files
SOURCES = {
    "llama": dict(SMALL, arch="llama", d_ff=320, seed=21),
    "qwen3": dict(SMALL, arch="qwen3", d_ff=320, tied=True, seed=22),  # tied: the head is token_embd
}
MIXES = ["Q4_K_M", "Q5_K_M", "Q3_K_M", "Q2_K", "IQ4_XS", "Q4_0"]
REFINED = ("IQ4_NL",)  # llama-quantize's bytes differ from ggml's reference quantizer's
NAMES = {f"{a}-{m}": (a, m) for a in SOURCES for m in MIXES}


def tokens(n_vocab: int) -> np.ndarray:
    return np.random.default_rng(2025).integers(3, n_vocab, N_TOKENS).astype(np.int32)


def quantize_file(exe: str, src: Path, dst: Path, mix: str) -> None:
    lib = f"{Path(exe).resolve().parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    env = {**os.environ, "LD_LIBRARY_PATH": lib}
    r = subprocess.run([exe, str(src), str(dst), mix], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"llama-quantize {mix} failed: {r.stderr.strip().splitlines()[-1:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-quantize", default=shutil.which("llama-quantize"))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests" / "data" /
                                         "reference_quantized"))  # fmt: skip
    ap.add_argument("--only", nargs="*", choices=sorted(NAMES), help="these files only")
    args = ap.parse_args(argv)
    if not args.llama_quantize:
        ap.error("llama-quantize is not on PATH: give --llama-quantize PATH")
    from accelplane.models import make_model, read_gguf
    from accelplane.models.gguf import tensor_digest

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        made: dict[str, Path] = {}
        for name in args.only or NAMES:
            arch, mix = NAMES[name]
            if arch not in made:
                made[arch] = Path(d) / f"{arch}-f16.gguf"
                make_model(made[arch], jobs=1, **SOURCES[arch])
            q = Path(d) / f"{name}.gguf"
            quantize_file(args.llama_quantize, made[arch], q, mix)
            with read_gguf(q) as f:
                types = {t.name: t.type.name for t in f.tensors.values()}
                raw = {f"raw:{t.name}": np.array(t.data).reshape(-1) for t in f.tensors.values()
                       if t.type.name in REFINED}  # fmt: skip
                digest = tensor_digest(f)
            toks = tokens(SOURCES[arch]["n_vocab"])
            logits, version = llama_cpp_logits(q, toks)
            # the types in the file's order
            if not save_reference(out / f"{name}.npz", logits, toks, SOURCES[arch], mix=mix,
                                  types=json.dumps(types), tensor_sha256=digest, llama_cpp=version, **raw):
                return 1
            counts: dict[str, int] = {}
            for t in types.values():
                counts[t] = counts.get(t, 0) + 1
            print(f"{name}: {out / (name + '.npz')}  {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
