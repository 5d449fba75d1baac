"""``accelplane bench model``: llama-bench's tests on a GGUF model, per device set and split
mode: prompt processing of ``pp`` tokens in one batch and text generation of ``tg`` tokens one
at a time, both from an empty context, after two warm-up runs (a device may run a graph eagerly
once and record it the second time: CUDA's plugin does), each timed run without garbage
collector pauses (:func:`~accelplane.models.runner.no_gc_pauses`); for tg also the decode graph's
rate without the host's work between tokens, and the weights' read rate (of a MoE's experts, the
used share) against the same run's device copy bandwidth. With a ``llama-bench`` executable,
each config also runs llama.cpp's tests on the same file beside ours
(:mod:`accelplane.bench.llama_peer`), and its rows carry the ratio."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from accelplane.bench import copy_bandwidth
from accelplane.bench.llama_peer import PeerRun, attach, peer_args, run_llama_bench
from accelplane.errors import DeviceError, PeerError
from accelplane.interface import DeviceType
from accelplane.models.decoder import DecoderModel
from accelplane.models.gguf import GGUFFile, total_bytes
from accelplane.models.runner import context_for, load, meta_summary, no_gc_pauses, pick_devices
from accelplane.runtime.backend import Device
from accelplane.runtime.progress import phase


def bench_configs(
    reg, devices: Sequence[str] | None, splits: Sequence[str] | None
) -> list[tuple[list[Device], str]]:
    """(devices, split) pairs: each ``--device`` value (comma list = one multi-device set) ×
    each ``--split`` that fits it (none for one device; layer and tensor for several, default
    layer); by default every device alone with split none, plus all non-CPU devices together
    with split layer when there are two or more (the accelerators that
    ``pick_devices`` takes by default: emulated ones are left out)."""
    if devices:
        sets = [pick_devices(reg, [d]) for d in devices]
        out = []
        for s in sets:
            fits = ["none"] if len(s) == 1 else ["layer", "tensor"]
            out += [(s, sp) for sp in (splits or fits[:1]) if sp in fits]
        if not out:
            raise DeviceError(f"no device set fits --split {' '.join(splits or [])}: split none takes one "
                             "device, layer and tensor a comma list of several (-d CUDA0,CUDA1)")  # fmt: skip
        return out
    sets = [[d] for d in reg.devices]
    out = [(s, sp) for s in sets for sp in (splits or ["none"]) if not (sp == "layer" and len(s) < 2)]
    others = pick_devices(reg, None)
    if len(others) >= 2 and others[0].type != DeviceType.CPU and (not splits or "layer" in splits):
        out.append((others, "layer"))
    return out


WARMUP = 2  # untimed runs of each test before the timed ones


def _step(show: bool, what: str) -> phase:
    """A benchmark step: its line at once (``what ...``, then its time and note) when ``show``."""
    return phase(what, after_s=0.0, enabled=show)


def graph_only_rate(model: DecoderModel, n: int) -> float:
    """Tokens/s of the last decode step's graph computed ``n`` times back to back, without the
    host's work between tokens (inputs set, results read, Python): what the devices alone
    allow. (It rewrites the last position's cache rows: call it after the timed runs.)"""
    g = model.step(1, model.window(model.n_past), chain=True).graph  # the graph decode() ran
    model.sched.alloc_graph(g)
    model.sched.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        model.sched.graph_compute(g)
    model.sched.synchronize()
    return n / (time.perf_counter() - t0)


def threads() -> int:
    """The CPU plugin's thread count, which the peer is given too."""
    from accelplane.cpu.kernels import default_threads

    return default_threads()


def _peer(show: bool, label: str, exe: str, f: GGUFFile, args: list[str], when: str) -> PeerRun:
    with _step(show, f"{label}: llama-bench {when} ours") as ph:
        run = run_llama_bench(exe, str(f.path), args)
        ph.note(", ".join(f"{t} {sum(s) / len(s):.1f} tokens/s" for t, s in run.samples.items()))
    return run


def bench_model(f: GGUFFile, configs: Sequence[tuple[list[Device], str]], cpu: Device, pp: int, tg: int,
                reps: int = 2, profiler=None, show: bool = False,
                cpu_moe: int | Sequence[int] = 0, llama_bench: str | None = None) -> list[dict]:  # fmt: skip
    """llama-bench's pp and tg tests per config; one dict per (config, test). pp: one eval of
    the tokens; tg: DecoderModel.decode, greedy, from position 0 (each step queued before the
    last one's pick is read, as a generation runs; llama-bench waits for every token). ``profiler``: a
    cProfile.Profile enabled around the timed tg runs (where the host time of a token goes).
    ``show``: progress on stderr (accelplane.runtime.progress: on a terminal, not quiet): each
    model load's bar, then a line per step, the copy bandwidth, the warm-up and each timed
    run with its tokens/s. ``cpu_moe``: the layers whose experts live in host memory
    (DecoderModel's), or a list of values, each config run with each; a MoE model's rows record
    it as ``n_cpu_moe``. ``llama_bench``: llama.cpp's llama-bench, run on ``f``'s file right
    before and right after each config that llama.cpp can run alike
    (:func:`~accelplane.bench.llama_peer.peer_args`); those rows gain the peer's figures and
    ``vs_peer`` (:func:`~accelplane.bench.llama_peer.attach`); PeerError when it fails."""
    if llama_bench and f.path is None:
        raise PeerError("llama-bench reads a model file: this model has none")
    rows = []
    cfg = f.model_config()
    n_ctx = context_for(cfg, max(pp, tg), "--pp/--tg")
    wbytes = total_bytes(f)
    # bytes a decode step reads: every weight once, of a MoE's experts only the used share
    read = sum(t.nbytes * (cfg.n_expert_used / cfg.n_expert if name.endswith("_exps.weight") else 1)
               for name, t in f.tensors.items())  # fmt: skip
    params = sum(int(np.prod(t.shape)) for t in f.tensors.values())
    rng = np.random.default_rng(0)
    copy_bw: dict[str, float | None] = {}  # device name → its copy bandwidth, measured once
    moes = [cpu_moe] if isinstance(cpu_moe, int) else list(cpu_moe)
    for devs, split, cm in [(d, s, c) for d, s in configs for c in moes]:
        label = ",".join(d.name for d in devs)
        if len(devs) == 1 and label not in copy_bw and tg > 0:
            with _step(show, f"{label}: copy bandwidth") as ph:
                copy_bw[label] = bw = copy_bandwidth(devs[0])
                ph.note(f"{bw / 1e9:.1f} GB/s" if bw else "not measured")
        largs = peer_args(devs, split, cm, pp, tg, reps, threads()) if llama_bench else None
        peer_runs: list[PeerRun] = []
        if largs is not None:  # the peer first, then ours, then the peer again: drift shows in both
            peer_runs.append(_peer(show, label, llama_bench, f, largs, "before"))
        start = len(rows)  # this config's rows begin here
        model = load(f, devs, cpu, split, n_ctx, show=show, cpu_moe=cm)
        try:
            for test, n in (("pp", pp), ("tg", tg)):
                if n <= 0:
                    continue
                toks = rng.integers(0, cfg.n_vocab, n).tolist()
                times = []
                for rep in range(1 - WARMUP, reps + 1):  # rep < 1: a warm-up
                    what = f"timed run {rep}/{reps}" if rep > 0 else f"warm-up {rep + WARMUP}/{WARMUP}"
                    moe = f" n_cpu_moe={cm}" if cfg.is_moe else ""
                    with _step(show, f"{label} split={split}{moe} {test}{n}: {what}") as ph:
                        model.reset()
                        prof = profiler if rep > 0 and test == "tg" else None
                        if prof is not None:
                            prof.enable()
                        with no_gc_pauses():
                            t0 = time.perf_counter()
                            if test == "pp":
                                model.eval(toks, want_logits=False)
                            else:  # greedy, each pick fed back on the device (decode)
                                model.decode(toks[0], n)
                            dt = time.perf_counter() - t0
                        if prof is not None:
                            prof.disable()
                        ph.note(f"{n / dt:.1f} tokens/s")
                    if rep > 0:
                        times.append(dt)
                tps = [n / t for t in times]
                row = {"model": f.get("general.name", ""), "size_bytes": wbytes, "params": params,
                       "devices": label, "split": split, "test": f"{test}{n}", "n_tokens": n,
                       "reps": reps, "load_s": model.load_s, "seconds": times,
                       "tokens_per_s": float(np.mean(tps)),
                       "tokens_per_s_std": float(np.std(tps))}  # fmt: skip
                if cfg.is_moe:
                    row["n_cpu_moe"] = cm
                if model.meta is not None:  # how the tensor split ran (recorded or not, comm)
                    row["meta"] = meta_summary(model.meta)
                else:  # the scheduler's synchronization policy (ACCELPLANE_MODEL_POLICY)
                    row["policy"] = model.sched.policy
                if test == "tg":  # every weight read once per token (of experts, the used ones)
                    row["graph_only_tokens_per_s"] = graph_only_rate(model, n)
                    row["weights_gb_per_s"] = read * row["tokens_per_s"] / 1e9
                    bw = copy_bw.get(label)
                    if bw:  # the same run's device copy (read + written) as the limit
                        row["copy_gb_per_s"] = bw / 1e9
                        row["weights_frac_of_copy"] = row["weights_gb_per_s"] * 1e9 / bw
                rows.append(row)
        finally:
            model.free()
        if largs is not None:
            peer_runs.append(_peer(show, label, llama_bench, f, largs, "after"))
            attach(rows[start:], peer_runs)
    for r in rows:  # multi-device rows against their first device alone, where that ran too
        first = r["devices"].split(",")[0]
        base = [b for b in rows if b["devices"] == first and b["split"] == "none" and b["test"] == r["test"]
                and b.get("n_cpu_moe") == r.get("n_cpu_moe")]
        if "," in r["devices"] and base:
            r["vs_first_device"] = r["tokens_per_s"] / base[0]["tokens_per_s"]
    return rows


def format_bench(rows: list[dict]) -> str:
    """llama-bench's markdown table (with each config's model load time, a MoE's n_cpu_moe, the
    weights' read rate for tg, and that rate as a fraction of the same run's device copy
    bandwidth, read + written; tg rows also get the decode graph's rate computed back to back,
    without the host's work between tokens; multi-device rows also get their speed-up over
    their first device alone, when that config ran too; rows with a peer get llama.cpp's
    tokens/s and our ratio to it)."""
    cols = [("model", 28, "<"), ("size", 10, ">"), ("params", 8, ">"), ("devices", 20, "<"),
            ("split", 5, "<"), ("load s", 6, ">"), ("test", 6, ">"), ("t/s", 18, ">"),
            ("weights GB/s", 12, ">"),
            ("copy GB/s", 10, ">"), ("% of copy", 9, ">"), ("graph only t/s", 14, ">")]  # fmt: skip
    multi = any("vs_first_device" in r for r in rows)
    if multi:
        cols.append(("vs 1 device", 11, ">"))
    peer = any("vs_peer" in r for r in rows)
    if peer:
        cols += [("llama.cpp t/s", 13, ">"), ("vs llama.cpp", 12, ">")]
    moe = any("n_cpu_moe" in r for r in rows)
    if moe:  # llama-bench's n_cpu_moe column
        cols.insert(5, ("ncmoe", 5, ">"))
    rule = "|".join("-" * (w + 1) + (":" if a == ">" else "-") for _, w, a in cols)
    lines = ["| " + " | ".join(f"{c:{a}{w}}" for c, w, a in cols) + " |", f"|{rule}|"]
    for r in rows:
        vals = [r["model"][:28], f"{r['size_bytes'] / 2**20:.1f} MiB", f"{r['params'] / 1e6:.1f} M",
                r["devices"], r["split"], f"{r['load_s']:.2f}" if "load_s" in r else "", r["test"],
                f"{r['tokens_per_s']:.2f} ± {r['tokens_per_s_std']:.2f}",
                f"{r['weights_gb_per_s']:.2f}" if "weights_gb_per_s" in r else "",
                f"{r['copy_gb_per_s']:.1f}" if "copy_gb_per_s" in r else "",
                f"{100 * r['weights_frac_of_copy']:.1f} %" if "weights_frac_of_copy" in r
                else "",
                f"{r['graph_only_tokens_per_s']:.2f}" if "graph_only_tokens_per_s" in r else ""]  # fmt: skip
        if multi:
            vals.append(f"{r['vs_first_device']:.2f}x" if "vs_first_device" in r else "")
        if peer:
            has = "vs_peer" in r
            vals += [f"{r['peer_tokens_per_s']:.2f}", f"{r['vs_peer']:.2f}x"] if has else ["", ""]
        if moe:
            vals.insert(5, str(r.get("n_cpu_moe", "")))
        lines.append("| " + " | ".join(f"{v:{a}{w}}" for v, (_, w, a) in zip(vals, cols, strict=True)) + " |")
    return "\n".join(lines)


def plot_bench(rows: list[dict], path: str) -> bool:
    """A bar chart of tokens/s per (devices, split), one panel per test. False when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    tests = list(dict.fromkeys(r["test"] for r in rows))
    fig, axes = plt.subplots(1, len(tests), figsize=(5 * len(tests), 3.5), squeeze=False)
    for ax, test in zip(axes[0], tests, strict=True):
        rs = [r for r in rows if r["test"] == test]
        labels = [f"{r['devices']}\n{r['split']}" for r in rs]
        ax.bar(labels, [r["tokens_per_s"] for r in rs], yerr=[r["tokens_per_s_std"] for r in rs])
        ax.set_title(test)
        ax.set_ylabel("tokens/s")
    fig.suptitle(rows[0]["model"] if rows else "")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
