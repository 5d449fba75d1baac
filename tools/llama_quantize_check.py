#!/usr/bin/env python3
"""Files that llama.cpp's llama-quantize writes, against accelplane (needs a llama.cpp build).

    python tools/llama_quantize_check.py LLAMA_QUANTIZE [MIX ...]   (default: Q4_K_M Q5_K_M ...)

Makes a small synthetic F32 llama (d_model 256, so every block type applies), quantizes it with
llama-quantize to each mix (LD_LIBRARY_PATH: the binary's directory), and checks each file:
read_gguf loads it; every tensor dequantizes bit for bit as the gguf package does; and every
quantized tensor's bytes equal accelplane.core.types.quantize of the F32 weights, except for
IQ4_NL: llama-quantize refines IQ4_NL's block scales (ggml_quantize_chunk, 7 steps) while ggml's
reference quantizer, which ours follows, does not. Prints one line per mix; exits 1 on a
mismatch, 2 when llama-quantize fails.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
from accelplane.core.types import GGMLType, dequantize, quantize
from accelplane.models import make_model, read_gguf

MIXES = ["Q4_K_M", "Q5_K_M", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL", "Q4_1", "Q5_0", "Q5_1"]
REFINED = {GGMLType.IQ4_NL}  # llama-quantize's bytes differ from the reference quantizer's


def check(src, path: Path) -> tuple[dict[str, int], list[str]]:
    """(tensors per type, problems) of llama-quantize's file at path made from F32 file src."""
    problems = []
    with read_gguf(path) as f:
        types = collections.Counter(t.type.name for t in f.tensors.values())
        for rt in gguf.GGUFReader(path).tensors:
            t = f.tensors[rt.name]
            data = np.asarray(t.data).reshape(-1)
            want = gguf.quants.dequantize(rt.data, rt.tensor_type).astype(np.float32).reshape(-1)
            got = dequantize(t.type, data, t.shape[-1]).reshape(-1)
            if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
                problems.append(f"{rt.name} ({t.type.name}): dequantized values differ from gguf's")
            if t.type.is_quantized and t.type not in REFINED:
                s = src.tensors[rt.name]
                x = np.asarray(s.data).view(np.float32).reshape(-1, s.shape[-1])
                if not np.array_equal(quantize(t.type, x).reshape(-1), data):
                    problems.append(f"{rt.name} ({t.type.name}): bytes differ from accelplane's quantizer")
    return dict(types), problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("llama_quantize", help="path of llama.cpp's llama-quantize")
    p.add_argument("mixes", nargs="*", default=MIXES, help="llama-quantize types (default: %(default)s)")
    args = p.parse_args(argv)
    exe = Path(args.llama_quantize).resolve()
    env = {**os.environ, "LD_LIBRARY_PATH": f"{exe.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    failed = False
    with tempfile.TemporaryDirectory() as d:
        f32 = Path(d) / "f32.gguf"
        make_model(f32, n_layers=2, d_model=256, n_head=4, n_head_kv=2, d_ff=512, n_vocab=512, n_ctx=256,
                   wtype="f32", seed=3)  # fmt: skip
        with read_gguf(f32) as src:
            for mix in args.mixes:
                out = Path(d) / f"{mix}.gguf"
                cmd = [str(exe), str(f32), str(out), mix]
                r = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if r.returncode != 0:
                    last = r.stderr.strip().splitlines()[-1:]
                    print(f"{mix}: llama-quantize failed: {last}", file=sys.stderr)
                    return 2
                types, problems = check(src, out)
                failed |= bool(problems)
                print(f"{mix}: {types}: " + ("; ".join(problems) if problems else "OK"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
