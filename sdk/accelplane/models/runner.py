"""``accelplane run`` and ``accelplane bench model``: a llama GGUF model (by default a small
synthetic one, made once and cached) on the devices this machine has, through the scheduler.

``run``: load, show the devices and the split plan, prefill a prompt of random tokens, decode
greedily, print tokens/s, then recompute the same steps (teacher-forced with the generated
tokens) on a CPU-only scheduler and compare the logits: max abs error, NMSE and top-1
agreement; the run fails beyond ``--nmse-tol`` (default :data:`NMSE_TOL`).

``bench model``: llama-bench's pp/tg tests (prompt processing of ``--pp`` tokens in one batch,
text generation of ``--tg`` tokens one at a time, both from an empty context, after one
warm-up run) per device set and split mode: a table, JSON and a PNG plot.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from accelplane.bench import copy_bandwidth
from accelplane.errors import ComputeError, DeviceError, ShapeError
from accelplane.interface import DeviceType
from accelplane.models.gguf import (
    GGUFFile,
    parallel_sources,
    read_gguf,
    synthetic_sources,
    total_bytes,
    write_gguf,
)
from accelplane.models.llama import LlamaModel, check_split
from accelplane.models.progress import Bar
from accelplane.oracle.compare import nmse
from accelplane.runtime.backend import Device
from accelplane.runtime.plancache import cache_dir

# the model `accelplane run` makes when given none: small enough to make in a second and run
# anywhere, big enough that the matrix products dominate (7.3M parameters, 7.4 MiB in Q8_0)
DEFAULT_MODEL = dict(n_layers=4, d_model=256, n_head=8, n_head_kv=4, d_ff=768, n_vocab=8192,
                     n_ctx=2048, wtype="q8_0", seed=0)  # fmt: skip
GENERATOR_VERSION = 1  # bump when the synthetic weights change, so cached files are remade
# `accelplane make-model --preset`; 1b has TinyLlama-1.1B's shapes (the benchmark model), 8b
# Llama-3-8B's (the multi-GPU benchmark model)
PRESETS = {
    "tiny": dict(n_layers=2, d_model=64, n_head=4, n_head_kv=2, d_ff=128, n_vocab=256, n_ctx=512),
    "small": {k: v for k, v in DEFAULT_MODEL.items() if k not in ("wtype", "seed")},
    "1b": dict(n_layers=22, d_model=2048, n_head=32, n_head_kv=4, d_ff=5632, n_vocab=32000,
               n_ctx=2048),
    "8b": dict(n_layers=32, d_model=4096, n_head=32, n_head_kv=8, d_ff=14336, n_vocab=128256,
               n_ctx=8192),
}  # fmt: skip
# logits vs the CPU plugin over every compared step; measured on this machine's plugins
# (Q8_0 model, F16 cache): 1.6e-4 SYCL (CPU OpenCL), ~2e-4 Vulkan (lavapipe), 3e-4 Hexagon (emulated)
NMSE_TOL = 1e-3
_TYPE_RANK = {DeviceType.GPU: 0, DeviceType.IGPU: 1, DeviceType.ACCEL: 2}


def default_model_path(out: TextIO | None = None) -> Path:
    """The default synthetic model, made on first use under cache_dir('models')."""
    out = out or sys.stderr
    m = DEFAULT_MODEL
    name = (f"synthetic-llama-{m['n_layers']}L-{m['d_model']}d-{m['n_vocab']}v-{m['wtype']}"
            f"-s{m['seed']}-g{GENERATOR_VERSION}.gguf")  # fmt: skip
    path = cache_dir("models") / name
    if not path.exists():
        print(f"making the default synthetic model (once): {path}", file=out)
        make_with_bar(path, **m)
    return path


def make_with_bar(path: str | Path, jobs: int | None = None, **kw) -> None:
    """make_model with a progress bar over the bytes written."""
    _, md, srcs = synthetic_sources(**kw)
    with Bar("make", sum(s.nbytes for s in srcs), "MiB", 2**-20) as bar, parallel_sources(srcs, jobs) as srcs:
        write_gguf(path, md, srcs, progress=bar.update)


def describe_model(f: GGUFFile) -> str:
    cfg = f.llama_config()
    types = sorted({t.type.name.lower() for t in f.tensors.values()})
    n_params = sum(int(np.prod(t.shape)) for t in f.tensors.values())
    moe = f", {cfg.n_expert} experts ({cfg.n_expert_used} used)" if cfg.is_moe else ""
    return (f"{f.get('general.name', f.path.name if f.path else '?')}: llama, {cfg.n_layers} layers, "
            f"d_model {cfg.d_model}, {cfg.n_head} heads ({cfg.n_head_kv} kv), d_ff {cfg.d_ff}, vocab "
            f"{cfg.n_vocab}{moe}, {n_params / 1e6:.1f}M params, {total_bytes(f) / 2**20:.1f} MiB "
            f"({'/'.join(types)})")  # fmt: skip


def pick_devices(reg, names: Sequence[str] | None) -> list[Device]:
    """Devices by name (comma lists allowed), else every non-CPU device (GPUs, then integrated
    GPUs, then accelerators, as ggml_backend_init_best ranks them), else the CPU. The
    model's scheduler adds a CPU backend last in any case."""
    if names:
        out = []
        for n in names:
            out += [reg.device(x.strip()) for x in n.split(",") if x.strip()]
        return list(dict.fromkeys(out))
    others = sorted((d for d in reg.devices if d.type != DeviceType.CPU),
                    key=lambda d: _TYPE_RANK.get(d.type, len(_TYPE_RANK)))  # fmt: skip
    if others:
        return others
    return [d for d in reg.devices if d.type == DeviceType.CPU][:1]


def _cpu_of(reg) -> Device:
    for d in reg.devices:
        if d.type == DeviceType.CPU:
            return d
    raise DeviceError("no CPU device registered: the scheduler needs one (the built-in cpu plugin)")


def load(f: GGUFFile, devices: Sequence[Device], cpu: Device, split: str, n_ctx: int,
         show: bool = True, **kw) -> LlamaModel:  # fmt: skip
    """LlamaModel.from_gguf with a progress bar over the bytes loaded."""
    with Bar("load", total_bytes(f), "MiB", 2**-20, enabled=show) as bar:
        return LlamaModel.from_gguf(f, devices, split=split, n_ctx=n_ctx, cpu=cpu,
                                    progress=bar.update, **kw)  # fmt: skip


def context_for(cfg, n_tokens: int, what: str, cache_type_size: int = 2) -> int:
    """The KV cache length for ``n_tokens`` positions (a multiple of 256), or ShapeError when
    they exceed the model's trained context (n_ctx), naming the cache size it would take."""
    n_ctx = -(-(n_tokens + 1) // 256) * 256
    if n_tokens > cfg.n_ctx_train:
        kv = 2 * cfg.n_layers * n_ctx * cfg.n_embd_kv * cache_type_size
        raise ShapeError(
            f"{what} = {n_tokens} tokens exceed the model's context of {cfg.n_ctx_train} tokens "
            f"(n_ctx; a KV cache of {n_ctx} positions would take {kv / 2**20:.1f} MiB)"
        )
    return n_ctx


def check_finite(logits: np.ndarray, step: str) -> None:
    """ComputeError when ``logits`` hold NaN or infinity, naming the step and how to find the
    node that produced them."""
    bad = ~np.isfinite(logits)
    if bad.any():
        kinds = "NaN" if np.isnan(logits).any() else "infinity"
        raise ComputeError(
            f"the logits of {step} hold {kinds} ({int(bad.sum())} of {logits.size} values); "
            "run again with ACCELPLANE_CHECK_RESULTS=1 to find the first node that produces it"
        )


@dataclass
class RunResult:
    prompt: list[int]
    tokens: list[int]  # generated: the prefill's next token, then one per decode step
    logits: list[np.ndarray]  # one row per step (prefill's last row, then each decode)
    pp_s: float
    tg_s: float


def generate(model: LlamaModel, prompt: Sequence[int], n_decode: int, keep_logits: bool,
             show: bool = True) -> RunResult:  # fmt: skip
    """Prefill ``prompt``, then ``n_decode`` greedy decode steps, timed."""
    model.reset()
    t0 = time.perf_counter()
    r = model.eval(prompt, want_logits=keep_logits)
    pp = time.perf_counter() - t0
    toks = [int(r.ids[-1])]
    logits = [r.logits[-1].copy()] if keep_logits else []
    if keep_logits:
        check_finite(logits[0], "the prefill")
    with Bar("generate", n_decode, "tok", enabled=show) as bar:
        t0 = time.perf_counter()
        for _ in range(n_decode):
            r = model.eval([toks[-1]], want_logits=keep_logits)
            toks.append(int(r.ids[-1]))
            if keep_logits:
                logits.append(r.logits[-1].copy())
                check_finite(logits[-1], f"decode step {len(logits) - 1}")
            bar.update(1)
        tg = time.perf_counter() - t0
    return RunResult(list(map(int, prompt)), toks, logits, pp, tg)


def teacher_forced(model: LlamaModel, prompt: Sequence[int], tokens: Sequence[int]) -> list[np.ndarray]:
    """Logits of the same steps as :func:`generate`, feeding ``tokens`` instead of sampling."""
    model.reset()
    out = [model.eval(prompt).logits[-1].copy()]
    for t in tokens:
        out.append(model.eval([t]).logits[-1].copy())
    return out


def cmd_run(args, out: TextIO | None = None) -> int:
    """``accelplane run`` (see the module docstring). Returns the exit status."""
    import accelplane

    out = out or sys.stdout

    check_split(args.split)
    path = Path(args.model) if args.model else default_model_path()
    f = read_gguf(path)  # before the plugins load: a bad file fails at once
    cfg = f.llama_config()
    f.check_llama_tensors(cfg)
    reg = accelplane.get_registry()
    p = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    p(f"model: {path}")
    p(f"  {describe_model(f)}")
    p("devices found:")
    for d in reg.devices:
        p(f"  {d.name:<10} {d.type.value:<5} {d.plugin.name:<10} {d.description}")
    for fl in reg.failures:
        p(f"  (broken plugin {fl.name}: {fl.reason})")
    devs = pick_devices(reg, args.device)
    cpu = _cpu_of(reg)
    n_prompt, n_dec = int(args.prompt_tokens), int(args.tokens)
    n_ctx = context_for(cfg, n_prompt + n_dec, "--prompt-tokens + --tokens")
    model = load(f, devs, cpu, args.split, n_ctx)
    try:
        p(f"split plan (--split {args.split}; devices {', '.join(d.name for d in devs)}, then "
          f"{cpu.name} for inputs and the token embedding):")  # fmt: skip
        for line in model.describe_plan(1):
            p(f"  {line}")
        rng = np.random.default_rng(args.seed)
        prompt = rng.integers(0, cfg.n_vocab, n_prompt).tolist()
        check = not args.no_check
        # warm-up: graphs, scheduler plans and backend plans are built once, outside the timing
        generate(model, prompt, min(n_dec, 1), False, show=False)
        res = generate(model, prompt, n_dec, True)  # logits are checked for NaN even with --no-check
        p(f"prefill: {n_prompt} tokens in {res.pp_s * 1e3:.1f} ms = {n_prompt / res.pp_s:.1f} tokens/s")
        if n_dec:
            p(f"decode:  {n_dec} tokens in {res.tg_s * 1e3:.1f} ms = {n_dec / res.tg_s:.1f} tokens/s")
        shown = " ".join(map(str, res.tokens[:16])) + (" ..." if len(res.tokens) > 16 else "")
        p(f"generated token ids: {shown}")
        p(f"plans: {model.sched.stats.plans} scheduler plans for {len(model._steps)} graphs")
        if model.meta is not None:
            m = meta_summary(model.meta)
            why = m["record_error"]
            rec = f"not recorded ({why})" if why else "recorded: one replay per device"
            p(f"tensor split: {m['segments']} segments and {m['allreduces']} all-reduces "
              f"({', '.join(m['algorithms']) or '-'}) per step; {rec}")  # fmt: skip
    finally:
        model.free()
    if not check:
        return 0
    ref_model = load(f, [cpu], cpu, "none", n_ctx, show=False)
    try:
        ref = teacher_forced(ref_model, prompt, res.tokens[:-1])
    finally:
        ref_model.free()
    a, b = np.stack(res.logits), np.stack(ref)
    err = float(np.max(np.abs(a - b)))
    e = nmse(a, b)
    agree = int(np.sum(a.argmax(-1) == b.argmax(-1)))
    ok = e <= args.nmse_tol
    p(f"logits check vs CPU ({len(ref)} steps, teacher-forced): max abs err {err:.3g}, NMSE {e:.3g}, "
      f"top-1 agree {agree}/{len(ref)} (tolerance NMSE <= {args.nmse_tol:g}): "
      f"{'OK' if ok else 'FAILED'}")  # fmt: skip
    return 0 if ok else 1


# --- bench model ------------------------------------------------------------------------------------
def bench_configs(
    reg, devices: Sequence[str] | None, splits: Sequence[str] | None
) -> list[tuple[list[Device], str]]:
    """(devices, split) pairs: each ``--device`` value (comma list = one multi-device set) ×
    each ``--split`` that fits it (none for one device; layer and tensor for several, default
    layer); by default every device alone with split none, plus all non-CPU devices together
    with split layer when there are two or more."""
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


def meta_summary(meta) -> dict:
    """The meta device's last computed step: segments, all-reduces and how they ran."""
    st = meta.stats
    return {"segments": st.segments, "allreduces": st.allreduces, "algorithms": sorted(st.algorithms),
            "replays": st.replays, "computes": st.computes, "record_error": st.record_error}


def graph_only_rate(model: LlamaModel, n: int) -> float:
    """Tokens/s of the last decode step's graph computed ``n`` times back to back, without the
    host's work between tokens (inputs set, results read, Python): what the devices alone
    allow. (It rewrites the last position's cache rows: call it after the timed runs.)"""
    g = model.step(1, model.window(model.n_past)).graph
    model.sched.alloc_graph(g)
    model.sched.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        model.sched.graph_compute(g)
    model.sched.synchronize()
    return n / (time.perf_counter() - t0)


def bench_model(f: GGUFFile, configs: Sequence[tuple[list[Device], str]], cpu: Device, pp: int, tg: int,
                reps: int = 2, progress: Callable[[str], None] | None = None,
                profiler=None) -> list[dict]:  # fmt: skip
    """llama-bench's pp and tg tests per config; one dict per (config, test). ``profiler``: a
    cProfile.Profile enabled around the timed tg runs (where the host time of a token goes)."""
    rows = []
    n_ctx = context_for(f.llama_config(), max(pp, tg), "--pp/--tg")
    wbytes = total_bytes(f)
    params = sum(int(np.prod(t.shape)) for t in f.tensors.values())
    rng = np.random.default_rng(0)
    cfg = f.llama_config()
    copy_bw: dict[str, float | None] = {}  # device name → its copy bandwidth, measured once
    for devs, split in configs:
        label = ",".join(d.name for d in devs)
        if len(devs) == 1 and label not in copy_bw and tg > 0:
            if progress:
                progress(f"{label}: copy bandwidth")
            copy_bw[label] = copy_bandwidth(devs[0])
        model = load(f, devs, cpu, split, n_ctx, show=False)
        try:
            for test, n in (("pp", pp), ("tg", tg)):
                if n <= 0:
                    continue
                toks = rng.integers(0, cfg.n_vocab, n).tolist()
                times = []
                for rep in range(reps + 1):  # the first run is the warm-up
                    if progress:
                        progress(f"{label} split={split} {test}{n}: run {rep + 1}/{reps + 1}")
                    model.reset()
                    prof = profiler if rep and test == "tg" else None
                    if prof is not None:
                        prof.enable()
                    t0 = time.perf_counter()
                    if test == "pp":
                        model.eval(toks, want_logits=False)
                    else:
                        tok = toks[0]
                        for _ in range(n):
                            tok = int(model.eval([tok], want_logits=False).ids[-1])
                    if prof is not None:
                        prof.disable()
                    if rep:
                        times.append(time.perf_counter() - t0)
                tps = [n / t for t in times]
                row = {"model": f.get("general.name", ""), "size_bytes": wbytes, "params": params,
                       "devices": label, "split": split, "test": f"{test}{n}", "n_tokens": n,
                       "reps": reps, "seconds": times, "tokens_per_s": float(np.mean(tps)),
                       "tokens_per_s_std": float(np.std(tps))}  # fmt: skip
                if model.meta is not None:  # how the tensor split ran (recorded or not, comm)
                    row["meta"] = meta_summary(model.meta)
                else:  # the scheduler's synchronization policy (ACCELPLANE_MODEL_POLICY)
                    row["policy"] = model.sched.policy
                if test == "tg":  # every weight is read once per token
                    row["graph_only_tokens_per_s"] = graph_only_rate(model, n)
                    row["weights_gb_per_s"] = wbytes * row["tokens_per_s"] / 1e9
                    bw = copy_bw.get(label)
                    if bw:  # the same run's device copy (read + written) as the limit
                        row["copy_gb_per_s"] = bw / 1e9
                        row["weights_frac_of_copy"] = row["weights_gb_per_s"] * 1e9 / bw
                rows.append(row)
        finally:
            model.free()
    for r in rows:  # multi-device rows against their first device alone, where that ran too
        first = r["devices"].split(",")[0]
        base = [b for b in rows if b["devices"] == first and b["split"] == "none" and b["test"] == r["test"]]
        if "," in r["devices"] and base:
            r["vs_first_device"] = r["tokens_per_s"] / base[0]["tokens_per_s"]
    return rows


def format_bench(rows: list[dict]) -> str:
    """llama-bench's markdown table (with the weights' read rate for tg, and that rate as a
    fraction of the same run's device copy bandwidth, read + written; tg rows also get the
    decode graph's rate computed back to back, without the host's work between tokens;
    multi-device rows also get their speed-up over their first device alone, when that config
    ran too)."""
    cols = [("model", 28, "<"), ("size", 10, ">"), ("params", 8, ">"), ("devices", 20, "<"),
            ("split", 5, "<"), ("test", 6, ">"), ("t/s", 18, ">"), ("weights GB/s", 12, ">"),
            ("copy GB/s", 10, ">"), ("% of copy", 9, ">"), ("graph only t/s", 14, ">")]  # fmt: skip
    multi = any("vs_first_device" in r for r in rows)
    if multi:
        cols.append(("vs 1 device", 11, ">"))
    rule = "|".join("-" * (w + 1) + (":" if a == ">" else "-") for _, w, a in cols)
    lines = ["| " + " | ".join(f"{c:{a}{w}}" for c, w, a in cols) + " |", f"|{rule}|"]
    for r in rows:
        vals = [r["model"][:28], f"{r['size_bytes'] / 2**20:.1f} MiB", f"{r['params'] / 1e6:.1f} M",
                r["devices"], r["split"], r["test"],
                f"{r['tokens_per_s']:.2f} ± {r['tokens_per_s_std']:.2f}",
                f"{r['weights_gb_per_s']:.2f}" if "weights_gb_per_s" in r else "",
                f"{r['copy_gb_per_s']:.1f}" if "copy_gb_per_s" in r else "",
                f"{100 * r['weights_frac_of_copy']:.1f} %" if "weights_frac_of_copy" in r
                else "",
                f"{r['graph_only_tokens_per_s']:.2f}" if "graph_only_tokens_per_s" in r else ""]  # fmt: skip
        if multi:
            vals.append(f"{r['vs_first_device']:.2f}x" if "vs_first_device" in r else "")
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


def cmd_bench_model(args, out: TextIO | None = None) -> int:
    import accelplane
    from accelplane.bench import machine

    path = Path(args.model) if args.model else default_model_path()
    f = read_gguf(path)
    f.check_llama_tensors(f.llama_config())
    reg = accelplane.get_registry()
    print(f"model: {path}\n  {describe_model(f)}", file=out)
    for sp in args.split or []:
        check_split(sp)
    configs = bench_configs(reg, args.device, args.split)
    tty = sys.stderr.isatty()

    def progress(msg: str) -> None:
        if tty:
            sys.stderr.write(f"\r\033[K{msg}")
            sys.stderr.flush()

    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    rows = bench_model(f, configs, _cpu_of(reg), args.pp, args.tg, args.reps, progress, prof)
    if tty:
        sys.stderr.write("\r\033[K")
    print(format_bench(rows), file=out)
    if prof is not None:
        import pstats

        print(f"host time of the timed tg runs, top {args.profile} functions by own time:", file=out)
        pstats.Stats(prof, stream=out or sys.stdout).sort_stats("tottime").print_stats(args.profile)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "model": str(path),
                                               "results": rows}, indent=1))  # fmt: skip
        print(f"wrote {args.json}", file=out)
    if args.png:
        if plot_bench(rows, args.png):
            print(f"wrote {args.png}", file=out)
        else:
            print("matplotlib is not installed: no plot written (pip install matplotlib)", file=sys.stderr)
    return 0


def cmd_make_model(args, out: TextIO | None = None) -> int:
    """``accelplane make-model``: a synthetic model from a preset and overrides."""
    out = out or sys.stdout
    kw = dict(PRESETS[args.preset])
    for k in ("n_layers", "d_model", "n_head", "n_head_kv", "d_ff", "n_vocab", "n_ctx", "n_expert",
              "n_expert_used", "seed"):  # fmt: skip
        v = getattr(args, k)
        if v is not None:
            kw[k] = v
    kw.update(wtype=args.wtype, rope_neox=args.neox)
    if args.output_type:
        kw["output_type"] = args.output_type
    make_with_bar(args.out, jobs=args.jobs, **kw)
    f = read_gguf(args.out)
    print(f"wrote {args.out}\n  {describe_model(f)}", file=out)
    return 0
