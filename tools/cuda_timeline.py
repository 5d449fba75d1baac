"""Where a host-API graph's time goes on a CUDA device: the BERT-style encoder of
``accelplane bench graph`` run through the Scheduler, then each CUDA plan's steps replayed one at
a time between CUDA events (a per-launch device timeline), summed by kernel and listed by cost,
with the host's wall time per compute beside the device's sum.

    python tools/cuda_timeline.py [--preset bert-mini] [--batch 16] [--seq 62] [--top 25] [--json FILE]

Profiling tooling for GPU machines (scripts/gpu-run runs it); not part of any package.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict


def _timeline(plan, cp, reps: int) -> list[tuple[str, float]]:
    """(label, median ms) of each step of ``plan``, eager, bracketed by events on its stream."""
    stream = plan.sctx.stream
    per: list[list[float]] = [[] for _ in plan.steps]
    with cp.cuda.Device(plan.sctx.device), stream:
        for _ in range(reps):
            evs = [cp.cuda.Event() for _ in range(len(plan.steps) + 1)]
            evs[0].record(stream)
            for i, s in enumerate(plan.steps):
                s()
                evs[i + 1].record(stream)
            evs[-1].synchronize()
            for i in range(len(plan.steps)):
                per[i].append(cp.cuda.get_elapsed_time(evs[i], evs[i + 1]))
    labels = [getattr(s, "name", "host step") for s in plan.steps]
    return [(lab, statistics.median(ts)) for lab, ts in zip(labels, per, strict=True)]


def main() -> None:
    import accelplane as ap
    import cupy as cp
    import numpy as np
    from accelplane.models.bert import PRESETS, build_encoder, random_batch, random_weights
    from accelplane.runtime.alloc import alloc_ctx_tensors

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bert-mini", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=62)
    p.add_argument("--device", default="CUDA0")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", default=None)
    a = p.parse_args()

    cfg = PRESETS[a.preset]
    dev = ap.get_registry().device(a.device)
    enc = build_encoder(cfg, a.batch, a.seq)
    graph = enc.ctx.graph(enc.out)
    sched = ap.Scheduler.from_devices([dev])
    alloc_ctx_tensors(enc.ctx, dev.buffer_type)
    for name, t in random_weights(cfg).items():
        enc.weights[name].set(t)
    ids, mask = random_batch(cfg, a.batch, a.seq)

    def compute() -> None:
        for t, v in enc.inputs(ids, mask).items():
            t.set(v)
        sched.compute(graph)
        np.asarray(enc.out.get())

    t0 = time.perf_counter()
    compute()
    first = time.perf_counter() - t0
    walls = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        compute()
        walls.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    for _ in range(a.reps):
        sched.graph_compute(graph)
    sched.synchronize()
    queued = (time.perf_counter() - t0) * 1e3 / a.reps

    placement = sched.placement()
    on_dev = [n for n, b in placement if b is sched.backends[0]]
    off = sorted({f"{n.op.name}" for n, b in placement if b is not sched.backends[0]})
    backend = sched.backends[0]
    plans = [entry[1] for entry in backend.ctx.plans._plans.values()]
    steps: list[tuple[str, float]] = []
    info = []
    for plan in plans:
        steps += _timeline(plan, cp, a.reps)
        info.append({"steps": len(plan.steps), "cublas": sum(getattr(s, "name", "").startswith("cublas")
                                                             for s in plan.steps),
                     "cuda_graph": plan.cuda_graph is not None, "graph_error": plan.graph_error})  # fmt: skip
    by_kernel: dict[str, list[float]] = defaultdict(list)
    for lab, ms in steps:
        by_kernel[lab].append(ms)
    device_ms = sum(ms for _, ms in steps)
    rows = sorted(((k, len(v), sum(v)) for k, v in by_kernel.items()), key=lambda r: -r[2])
    out = {"preset": a.preset, "batch": a.batch, "seq": a.seq, "first_s": first,
           "wall_ms": statistics.median(walls), "queued_ms": queued, "device_ms_eager_sum": device_ms,
           "nodes": len(graph.nodes), "nodes_on_device": len(on_dev), "ops_off_device": off,
           "plans": info,
           "kernels": [{"kernel": k, "launches": n, "ms": ms} for k, n, ms in rows]}  # fmt: skip
    print(f"{a.preset} batch {a.batch} x {a.seq} on {a.device}: wall {out['wall_ms']:.2f} ms per compute "
          f"(set + compute + get), graph_compute alone {queued:.2f} ms, device sum {device_ms:.2f} ms; "
          f"first compute {first:.1f} s; {len(on_dev)}/{len(graph.nodes)} nodes on the device, off: {off}")
    for i in info:
        print(f"plan: {i}")
    print(f"{'kernel':<40} {'launches':>8} {'ms':>8} {'%':>6}")
    for k, n, ms in rows[: a.top]:
        print(f"{k:<40} {n:>8} {ms:>8.3f} {100 * ms / device_ms:>6.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    sched.free()


if __name__ == "__main__":
    main()
