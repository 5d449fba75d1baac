"""Where a model step's device time goes on CUDA, as the step runs: replayed as one CUDA graph.

Loads a GGUF model on one CUDA device, runs a prompt and a few decode steps, then takes the
plan of the step asked for (``--step decode``: one token at the prompt's end; ``--step
prefill``: the prompt itself) and reports

* the step's device time: its CUDA graph replayed back to back, between two events;
* each kernel family's marginal cost inside that graph: the graph captured again without the
  family's launches and replayed the same way (the difference is what the family adds to the
  step, launch gaps and waits included, which a per-kernel profiler's isolated durations do not
  show; the results of such a graph are garbage, and the model is not used after it);
* each family's eager time: the launches one at a time between events (as a profiler sees them).

    python tools/cuda_step_profile.py MODEL.gguf [-d CUDA0] [--step decode|prefill] [--prompt 64]
        [--reps 200] [--json FILE]

Profiling tooling for GPU machines (scripts/gpu-run runs it); not part of any package.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict


def family(name: str) -> str:
    """A launch's family: its kernel name with the template arguments dropped, except the mat-vecs'
    epilogue flag; library calls by their own label."""
    base = re.sub(r"<.*", "", name)
    if base == "k_mmv_row1" and name.endswith(",true>"):
        return "k_mmv_row1 (qkv epilogue)"
    return base


def _graph_ms(cp, stream, graph, reps: int) -> float:
    """Median device milliseconds of one replay of ``graph``, replayed back to back in batches."""
    times = []
    for _ in range(5):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        for _ in range(reps):
            graph.launch(stream)
        b.record(stream)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / reps)
    return statistics.median(times)


def _eager(cp, stream, steps, reps: int) -> list[float]:
    per: list[list[float]] = [[] for _ in steps]
    for _ in range(reps):
        evs = [cp.cuda.Event() for _ in range(len(steps) + 1)]
        evs[0].record(stream)
        for i, s in enumerate(steps):
            s()
            evs[i + 1].record(stream)
        evs[-1].synchronize()
        for i in range(len(steps)):
            per[i].append(cp.cuda.get_elapsed_time(evs[i], evs[i + 1]))
    return [statistics.median(v) for v in per]


def main() -> None:
    import accelplane
    import cupy as cp
    from accelplane.models.gguf import read_gguf
    from accelplane.models.runner import _cpu_of, load

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("-d", "--device", default="CUDA0")
    p.add_argument("--step", choices=("decode", "prefill"), default="decode")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (the prefill step's size)")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--reps", type=int, default=200, help="graph replays per timing batch")
    p.add_argument("--json", default=None)
    a = p.parse_args()

    reg = accelplane.get_registry()
    dev = reg.device(a.device)
    m = load(read_gguf(a.model), [dev], _cpu_of(reg), "none", a.ctx, show=False)
    be = next(b for b in m.sched.backends if b.device is dev)
    prompt = [1 + i % (m.cfg.n_vocab - 1) for i in range(a.prompt)]
    if a.step == "prefill":
        for _ in range(3):  # eager, recorded, replayed
            m.reset()
            m.eval(prompt, want_logits=False)
    else:
        tok = int(m.eval(prompt, want_logits=False).ids[-1])
        be.ctx.plans.clear()  # only the decode step's plans from here on
        for _ in range(4):
            tok = int(m.eval([tok], want_logits=False).ids[-1])
    m.sched.synchronize()
    plans = [e[1] for e in be.ctx.plans._plans.values() if e[1].cuda_graph is not None]
    plan = max(plans, key=lambda pl: len(pl.steps))
    stream = plan.sctx.stream
    labels = [family(getattr(s, "name", "host step")) for s in plan.steps]
    out = {"model": a.model, "step": a.step, "prompt": a.prompt, "launches": len(plan.steps), "families": []}
    with cp.cuda.Device(plan.sctx.device), stream:
        full = _graph_ms(cp, stream, plan.cuda_graph, a.reps)
        eager = _eager(cp, stream, plan.steps, 20)
        counts: dict[str, int] = defaultdict(int)
        eager_ms: dict[str, float] = defaultdict(float)
        for lab, ms in zip(labels, eager, strict=True):
            counts[lab] += 1
            eager_ms[lab] += ms
        for fam in sorted(counts, key=lambda f: -eager_ms[f]):
            keep = [s for s, lab in zip(plan.steps, labels, strict=True) if lab != fam]
            g = plan._capture(stream, keep) if keep else None
            without = _graph_ms(cp, stream, g, a.reps) if g is not None else 0.0
            out["families"].append({"family": fam, "launches": counts[fam], "eager_ms": eager_ms[fam],
                                    "marginal_ms": full - without})  # fmt: skip
    out["graph_ms"] = full
    out["eager_sum_ms"] = sum(eager)
    print(f"{a.step} step of {a.model} on {a.device}: {len(plan.steps)} launches; replayed as a CUDA graph "
          f"{1e3 * full:.1f} us, eager sum {1e3 * sum(eager):.1f} us")
    print(f"{'family':<34} {'launches':>8} {'eager us':>9} {'in graph us':>11} {'us each':>8}")
    for r in out["families"]:
        print(f"{r['family'][:34]:<34} {r['launches']:>8} {1e3 * r['eager_ms']:>9.1f} "
              f"{1e3 * r['marginal_ms']:>11.1f} {1e3 * r['marginal_ms'] / r['launches']:>8.2f}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    m.sched.free()


if __name__ == "__main__":
    main()
