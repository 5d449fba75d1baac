"""``accelplane run``, ``accelplane make-model`` and ``accelplane bench model``.

``run``: load, show the devices and the split plan, prefill a prompt of random tokens, decode
greedily, print tokens/s, then recompute the same steps (teacher-forced with the generated
tokens) on a CPU-only scheduler and compare the logits: max abs error, NMSE and top-1
agreement; the run fails beyond ``--nmse-tol`` (default :data:`~accelplane.models.runner.NMSE_TOL`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

import numpy as np

from accelplane.bench.model import bench_configs, bench_model, format_bench, plot_bench
from accelplane.models.decoder import check_split
from accelplane.models.gguf import read_gguf
from accelplane.models.runner import (
    PRESETS,
    _cpu_of,
    context_for,
    default_model_path,
    describe_model,
    generate,
    load,
    make_with_bar,
    meta_summary,
    pick_devices,
    teacher_forced,
)
from accelplane.oracle.compare import nmse


def cmd_run(args, out: TextIO | None = None) -> int:
    """``accelplane run`` (see the module docstring). Returns the exit status."""
    import accelplane

    out = out or sys.stdout

    check_split(args.split)
    path = Path(args.model) if args.model else default_model_path()
    f = read_gguf(path)  # before the plugins load: a bad file fails at once
    cfg = f.model_config()
    f.check_tensors(cfg)
    reg = accelplane.get_registry()
    p = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    p(f"model: {path}")
    p(f"  {describe_model(f)}")
    p("devices found:")
    for d in reg.devices:
        p(f"  {d.name:<10} {d.type.value:<5} {d.plugin.name:<10} {d.description}")
    for fl in reg.failures:
        p(f"  ({'no device' if fl.no_device else 'broken plugin'} {fl.name}: {fl.reason})")
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


def cmd_bench_model(args, out: TextIO | None = None) -> int:
    import accelplane
    from accelplane.bench import machine

    path = Path(args.model) if args.model else default_model_path()
    f = read_gguf(path)
    f.check_tensors(f.model_config())
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
    rows = bench_model(f, configs, _cpu_of(reg), args.pp, args.tg, args.reps or 2, progress, prof)
    if tty:
        sys.stderr.write("\r\033[K")
    print(format_bench(rows), file=out)
    if prof is not None and not prof.getstats():
        print("--profile: no tg run was timed (--tg 0), so there is no profile", file=out)
    elif prof is not None:
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
              "n_expert_used", "head_dim", "sliding_window", "rope_base", "logit_softcap",
              "seed"):  # fmt: skip
        v = getattr(args, k)
        if v is not None:
            kw[k] = v
    if args.arch == "gemma3" and "sliding_window" not in kw:
        kw["sliding_window"] = min(512, kw["n_ctx"] // 4)  # Gemma 3 1B's window, short contexts a quarter
    kw.update(arch=args.arch, wtype=args.wtype, tied=args.tied, rope_scaling=args.rope_scaling,
              rope_factor=args.rope_factor)  # fmt: skip
    if args.output_type:
        kw["output_type"] = args.output_type
    make_with_bar(args.out, jobs=args.jobs, **kw)
    f = read_gguf(args.out)
    print(f"wrote {args.out}\n  {describe_model(f)}", file=out)
    return 0
