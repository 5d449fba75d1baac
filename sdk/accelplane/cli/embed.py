"""``accelplane embed``: one embedding per text (or sequence of token ids) by a bert GGUF model,
pooled as the file says (or ``--pooling``) and normalized as llama.cpp's embedding tool does it
(``--normalize``, Euclidean by default); printed one per line, with the cosine similarity of
every pair when there are several, or written to ``--out`` as a float32 .npy array."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TextIO

import numpy as np

from accelplane.models import bert
from accelplane.models.gguf import read_gguf, total_bytes
from accelplane.models.runner import describe_model, pick_devices
from accelplane.runtime.progress import Bar


def parse_ids(text: str) -> list[int]:
    """Token ids from ``"101, 7592 102"`` (comma and/or space separated); UsageError otherwise."""
    from accelplane.cli import UsageError

    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if not parts:
        raise UsageError("--ids: an empty sequence (give at least one token id)")
    try:
        return [int(p, 10) for p in parts]
    except ValueError:
        raise UsageError(f"--ids {text!r}: expected integers separated by commas or spaces") from None


def cmd_embed(args, out: TextIO | None = None) -> int:
    """``accelplane embed`` (see the module docstring). Returns the exit status."""
    import accelplane
    from accelplane.cli import UsageError

    out = out or sys.stdout
    if args.out == "-":
        raise UsageError("embed: --out -: give a file name (without --out the embeddings are printed)")
    if bool(args.text) == bool(args.ids):
        raise UsageError("embed: give either TEXT arguments or --ids sequences, not both or neither")
    f = read_gguf(Path(args.model))
    cfg = bert.config_from_gguf(f)
    bert.check_gguf_tensors(f, cfg)
    seqs = [parse_ids(s) for s in args.ids] if args.ids else bert.encode_texts(f, args.text)
    bert.check_ids(cfg, seqs)  # bad ids or a bad p fail before the model loads
    bert.check_norm(args.normalize)
    pooling = bert.parse_pooling(args.pooling) if args.pooling else cfg.pooling
    reg = accelplane.get_registry()
    devs = pick_devices(reg, args.device)
    with Bar("load", total_bytes(f), "MiB", 2**-20) as bar:  # (on a terminal, without -q)
        model = bert.BertModel.from_gguf(f, devs, progress=bar.update)
    try:
        embs = model.embed(seqs, pooling=pooling, normalize_p=args.normalize)
    finally:
        model.free()
    p = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    if args.out:
        arr = np.concatenate([e.reshape(-1, cfg.d_model) for e in embs]).astype(np.float32)
        with open(args.out, "wb") as fh:  # np.save would append .npy to a name without it
            np.save(fh, arr)
        p(f"wrote {args.out}: {arr.shape[0]} x {arr.shape[1]} float32 ({describe_model(f)}; on "
          f"{devs[0].name}; pooling {pooling.name.lower()})")  # fmt: skip
        return 0
    for i, e in enumerate(embs):
        rows = e.reshape(-1, cfg.d_model)
        for j, r in enumerate(rows):
            tag = f"embedding {i}" + (f" token {j}" if pooling is bert.Pooling.NONE else "")
            p(f"{tag}: " + " ".join(f"{x:.6f}" for x in r))
    if pooling is not bert.Pooling.NONE and len(embs) > 1:
        m = np.stack(embs).astype(np.float64)
        m /= np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-300)
        p("cosine similarity matrix:")
        for row in m @ m.T:
            p(" ".join(f"{x:6.3f}" for x in row))
    return 0
