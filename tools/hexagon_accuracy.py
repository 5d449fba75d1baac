#!/usr/bin/env python3
"""What the Hexagon plugin's HVX kernels' fp16 per-tile accumulators cost: MUL_MAT on repacked
Q4_0 / Q8_0 weights, with fp16 and with fp32 accumulators, against the float64 oracle (NMSE,
ggml's metric). Both runs share the dynamic Q8_0 quantization of the activations, so the fp32 column
is that quantization's error alone and the difference is what fp16 accumulation adds.

    python tools/hexagon_accuracy.py            # markdown table (plugins/hexagon/README.md has one)

These are accuracy figures of the emulated arithmetic; nothing here measures speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KS = (256, 1024, 4096, 14336, 32768)
DISTS = ("uniform", "normal")


@dataclass
class Row:
    type: str
    k: int
    dist: str
    nmse_fp16: float
    nmse_fp32: float
    max_abs: float  # largest |result|: fp16 accumulators overflow past 65504


def _values(dist: str, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    if dist == "uniform":  # the conformance suite's inputs
        return rng.uniform(-1.0, 1.0, shape)
    return rng.standard_normal(shape)  # heavier tails: bigger blocks' scales, bigger sums


def measure(types=("q4_0", "q8_0"), ks=KS, dists=DISTS, m: int = 64, n: int = 8,
            seed: int = 0) -> list[Row]:  # fmt: skip
    import accelplane
    from accelplane.core.graph import Context
    from accelplane.oracle import reference
    from accelplane.oracle.compare import nmse
    from accelplane.runtime.alloc import alloc_tensors

    dev = next(d for d in accelplane.devices() if d.name.startswith("HTP"))
    repack = dev.extra_buffer_types[0]
    backends = {acc: dev.new_backend(f"acc={acc}") for acc in ("fp16", "fp32")}
    rows = []
    rng = np.random.default_rng(seed)
    for ty in types:
        for k in ks:
            for dist in dists:
                ctx = Context()
                w = ctx.new_tensor(ty, (m, k), "w")
                x = ctx.new_tensor("f32", (n, k), "x")
                y = ctx.mul_mat(w, x)
                g = ctx.graph(y)
                bufs = [alloc_tensors([w], repack), alloc_tensors([x, y], dev.buffer_type)]
                w.set(_values(dist, rng, (m, k)))
                x.set(_values(dist, rng, (n, k)))
                want = reference.evaluate(g)[y].reshape(n, m)
                got = {}
                for acc, b in backends.items():
                    b.compute(g)
                    got[acc] = y.get()
                rows.append(Row(ty, k, dist, nmse(want, got["fp16"]), nmse(want, got["fp32"]),
                                float(np.abs(want).max())))  # fmt: skip
                for buf in bufs:
                    buf.free()
    for b in backends.values():
        b.free()
    return rows


def table(rows: list[Row]) -> str:
    out = ["| weights | K | inputs | NMSE fp16 acc | NMSE fp32 acc | fp16 acc adds | max abs result |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r.type} | {r.k} | {r.dist} | {r.nmse_fp16:.2e} | {r.nmse_fp32:.2e} | "
                   f"{r.nmse_fp16 - r.nmse_fp32:.2e} | {r.max_abs:.3g} |")  # fmt: skip
    return "\n".join(out)


if __name__ == "__main__":
    print(table(measure()))
