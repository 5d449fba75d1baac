"""Benchmark the CPU plugin's mat-mul kernels (GFLOPS = 2*m*n*k / time).

    python scripts/bench_cpu_kernels.py                      # m=4096 k=14336, n=1 and n=512
    python scripts/bench_cpu_kernels.py --sweep              # direct vs BLAS over n (crossover)
    python scripts/bench_cpu_kernels.py --types q4_0 --n 1 8 --isa portable

Weights are random blocks (f16 scales overwritten with small finite values), so the numbers do
not depend on a quantizer. Check ``uptime`` first: another job on the cores skews everything.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
from accelplane.core.types import GGMLType
from accelplane.cpu import kernels

T = GGMLType
# ggml CPU on this machine kind (GFLOPS), from the task brief; '-' where not given
GGML_REF = {
    (T.F32, 1): 9.5, (T.F16, 1): 16, (T.Q8_0, 1): 31, (T.Q4_0, 1): 40, (T.Q4_K, 1): 41,
    (T.F32, 512): 30, (T.F16, 512): 50, (T.Q8_0, 512): 63, (T.Q4_0, 512): 51,
}  # fmt: skip


def random_weights(t: GGMLType, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[m, row_bytes] uint8 rows of type t (float types: the element dtype)."""
    if t == T.F32:
        return rng.standard_normal((m, k), np.float32)
    if t == T.F16:
        return rng.standard_normal((m, k), np.float32).astype(np.float16)
    if t == T.BF16:
        return (rng.standard_normal((m, k), np.float32).view(np.uint32) >> 16).astype(np.uint16)
    blk, bsz = t.blck_size, t.type_size
    nb = k // blk
    raw = rng.integers(0, 256, size=(m, nb, bsz), dtype=np.uint8)
    for off in t.traits.f16_fields:
        d = rng.uniform(-0.01, 0.01, size=(m, nb)).astype(np.float16)
        raw[:, :, off : off + 2] = d.view(np.uint8).reshape(m, nb, 2)
    return raw.reshape(m, nb * bsz)


def bench(fn: Callable[[], object], min_time: float = 0.5, min_reps: int = 3) -> tuple[float, ...]:
    """(best, median) seconds per call after one warm-up call. Other load on the machine only
    ever slows a call down, so the best time is the better estimate on a shared machine."""
    fn()
    times: list[float] = []
    t_end = time.perf_counter() + min_time
    while len(times) < min_reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def gflops(m: int, n: int, k: int, sec: float) -> float:
    return 2.0 * m * n * k / sec / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--k", type=int, default=14336)
    ap.add_argument("--n", type=int, nargs="+", default=[1, 512])
    ap.add_argument("--types", nargs="+", default=["f32", "f16", "q8_0", "q4_0", "q4_K", "q6_K"])
    ap.add_argument("--isa", default="auto", choices=["auto", "avx512", "avx2-vnni", "avx2", "portable"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds of timing per case")
    ap.add_argument("--passes", type=int, default=1, help="repeat each case, keep the best")
    ap.add_argument("--strategy", default="auto", choices=["auto", "direct", "blas"])
    sweep_help = "time direct and blas for n in 1..256 (crossover)"
    ap.add_argument("--sweep", action="store_true", help=sweep_help)
    args = ap.parse_args()

    nt = args.threads or kernels.default_threads()
    print(f"isa={kernels.set_isa(args.isa)} threads={nt} load={os.getloadavg()[0]:.2f}", end=" ")
    print(f"m={args.m} k={args.k}  (GFLOPS of the best run)")
    rng = np.random.default_rng(0)
    m, k = args.m, args.k
    ns = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256] if args.sweep else args.n
    strategies = ["direct", "blas"] if args.sweep else [args.strategy]
    for name in args.types:
        t = GGMLType[name.upper()]
        w = random_weights(t, m, k, rng)
        for n in ns:
            x = rng.standard_normal((n, k), np.float32)
            out = np.empty((n, m), np.float32)
            row = []
            for strat in strategies:
                best, med = math.inf, math.inf
                for _ in range(args.passes):  # best over passes spread in time: load comes and goes
                    call = functools.partial(kernels.mul_mat, t, w, x, out, args.threads, strat)
                    b, md = bench(call, args.min_time)
                    best, med = min(best, b), min(med, md)
                row.append(
                    f"{strat}={gflops(m, n, k, best):6.1f} GFLOPS ({best * 1e3:7.2f} ms, "
                    f"median {gflops(m, n, k, med):6.1f})"
                )
            ref = GGML_REF.get((t, n))
            ref_s = f"  ggml {ref:g}" if ref else ""
            print(f"{t.name:5s} n={n:4d}  " + "  ".join(row) + ref_s, flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
