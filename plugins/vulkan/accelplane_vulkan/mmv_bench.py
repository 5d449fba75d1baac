"""Few-column MUL_MAT (matrix-vector) timings under the ACCELPLANE_VK_MMV_* knobs, side by
side in one process, for tuning on a GPU:

    python -m accelplane_vulkan.mmv_bench [--types q4_0,q8_0] [--n 1,2,8] [--copy-gbps 4200]
        [--settings "ROWS=0;ROWS=4;ROWS=4,WG=256"] [--time 0.5] [--repeat 16]

Each setting is a ';'-separated item of ','-separated KNOB=VALUE pairs (ACCELPLANE_VK_MMV_
prefix implied; an empty item is the defaults). Every (type, n) graph is built once with
``repeat`` independent weight copies sharing one activation (as `accelplane bench ops`), then
timed under each setting on a fresh backend (plans are built per backend, so the knobs are
read again). Each setting's first result is compared with the first setting's (max relative
difference), so a wrong kernel shows up next to its time.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from accelplane import get_registry
from accelplane.alloc import GraphAllocator, alloc_ctx_tensors
from accelplane.bench import random_rows
from accelplane.graph import Context
from accelplane.ops import op_bytes
from accelplane.types import parse_type

KNOB = "ACCELPLANE_VK_MMV_"


def _settings(spec: str) -> list[dict[str, str]]:
    out = []
    for item in spec.split(";"):
        env = {}
        for kv in filter(None, (x.strip() for x in item.split(","))):
            k, _, v = kv.partition("=")
            env[KNOB + k.strip().upper()] = v.strip()
        out.append(env)
    return out


def _timed(dev, graph, out, min_time: float) -> tuple[float, np.ndarray]:
    be = dev.new_backend()
    try:
        be.compute(graph)  # warm-up: plan, pipelines
        runs, t0 = 0, time.perf_counter()
        while True:
            be.graph_compute(graph)
            runs += 1
            if runs % 4 == 0:
                be.synchronize()
                if time.perf_counter() - t0 >= min_time:
                    break
        el = time.perf_counter() - t0
        return el / runs, out.get().copy()
    finally:
        be.free()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="Vulkan0")
    ap.add_argument("--types", default="f16,q8_0,q4_0,q4_k,q6_k")
    ap.add_argument("--n", default="1")
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--k", type=int, default=14336)
    ap.add_argument("--settings", default="ROWS=0;;ROWS=1;ROWS=2;ROWS=8;WG=64;WG=256;SUBGROUP=0")
    ap.add_argument("--time", type=float, default=0.5)
    ap.add_argument("--repeat", type=int, default=16)
    ap.add_argument("--copy-gbps", type=float, default=4200.0)
    a = ap.parse_args(argv)
    dev = next(d for d in get_registry().devices if d.name == a.device)
    settings = _settings(a.settings)
    print(f"{dev.name}: {dev.description}")
    print(f"{'type':<6} {'n':>2} {'setting':<28} {'us/op':>8} {'GB/s':>7} {'%copy':>6} {'maxrel':>9}")
    saved = {k: v for k, v in os.environ.items() if k.startswith(KNOB)}
    for tname in a.types.split(","):
        ta = parse_type(tname)
        for n in (int(x) for x in a.n.split(",")):
            ctx = Context(f"mmv {tname} n={n}")
            b = ctx.new_tensor_ne(parse_type("f32"), a.k, n, name="b")
            outs = [ctx.mul_mat(ctx.new_tensor_ne(ta, a.k, a.m, name=f"a{i}"), b) for i in range(a.repeat)]
            graph = ctx.graph(*outs)
            wbuf = alloc_ctx_tensors(ctx, dev.buffer_type)
            galloc = GraphAllocator(dev.buffer_type)
            galloc.alloc_graph(graph)
            rng = np.random.default_rng(0)
            for t in graph.leafs:
                random_rows(t, rng)
            nbytes = op_bytes(outs[0])
            ref = None
            try:
                for env in settings if ta.is_quantized else settings[:1]:  # the knobs are for quants
                    for k in [k for k in os.environ if k.startswith(KNOB)]:
                        del os.environ[k]
                    os.environ.update(env)
                    name = ",".join(f"{k[len(KNOB) :]}={v}" for k, v in env.items()) or "defaults"
                    try:
                        s, got = _timed(dev, graph, outs[0], a.time)
                    except Exception as e:  # noqa: BLE001 - report and go on with the next setting
                        print(f"{tname:<6} {n:>2} {name:<28} failed: {e}")
                        continue
                    us = s / a.repeat * 1e6
                    gbps = nbytes / (us * 1e-6) / 1e9
                    if ref is None:
                        ref = got
                    rel = float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
                    print(
                        f"{tname:<6} {n:>2} {name:<28} {us:8.2f} {gbps:7.0f} "
                        f"{100 * gbps / a.copy_gbps:5.1f}% {rel:9.2e}",
                        flush=True,
                    )
            finally:
                galloc.free()
                if wbuf is not None:
                    wbuf.free()
    for k in [k for k in os.environ if k.startswith(KNOB)]:
        del os.environ[k]
    os.environ.update(saved)


if __name__ == "__main__":
    main()
