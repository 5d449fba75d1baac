"""``accelplane run``, ``accelplane make-model`` and ``accelplane bench model``.

``run``: load, show the devices and the split plan, prefill a prompt of random tokens, decode
greedily, print tokens/s, then recompute the same steps (teacher-forced with the generated
tokens) on a CPU-only scheduler and compare the logits: max abs error, NMSE and top-1
agreement; the run fails beyond ``--nmse-tol`` (default :data:`~accelplane.models.runner.NMSE_TOL`).
A MoE model's replay uses this run's experts, and each choice that differs from the CPU's own
top k must be a near tie (:data:`~accelplane.models.runner.ROUTE_TIE`), else the run fails.

``run --prompt TEXT``: tokenize the text with the model's vocabulary, generate (greedy, or
sampled with ``--temp``/``--top-k``/``--top-p``/``--seed``) until an end-of-generation token or
``--tokens``, streaming the text to stdout; the model, devices and tokens/s go to stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

import numpy as np

from accelplane.bench.model import bench_configs, bench_model, format_bench, plot_bench
from accelplane.errors import TokenizerError
from accelplane.models.decoder import check_split
from accelplane.models.gguf import read_gguf, total_bytes
from accelplane.models.runner import (
    MAKE_ARCHS,
    _cpu_of,
    context_for,
    default_model_path,
    describe_model,
    generate,
    generate_text,
    load,
    make_with_bar,
    meta_summary,
    pick_devices,
    routing_agreement,
    teacher_forced,
    teacher_forced_routing,
)
from accelplane.models.sampling import Sampler
from accelplane.models.tokenizer import Tokenizer
from accelplane.oracle.compare import nmse


def _open_model(args, p) -> tuple:
    """The model file (checked before the plugins load: a bad file fails at once), its config
    and tokenizer (with --prompt), the registry, its devices listed with ``p``."""
    import accelplane

    check_split(args.split)
    path = Path(args.model) if args.model else default_model_path()
    f = read_gguf(path)
    cfg = f.model_config()
    tok = None
    if args.prompt is not None:
        try:
            tok = Tokenizer.from_gguf(f)
        except TokenizerError as e:
            raise TokenizerError(f"--prompt: {e} (without --prompt, run feeds random token ids)") from None
        if tok.n_vocab > cfg.n_vocab:
            raise TokenizerError(f"{path}: the vocabulary has {tok.n_vocab} tokens, the model's embedding "
                                 f"{cfg.n_vocab} rows")  # fmt: skip
    f.check_tensors(cfg)
    reg = accelplane.get_registry()
    p(f"model: {path}")
    p(f"  {describe_model(f)}")
    p("devices found:")
    for d in reg.devices:
        p(f"  {d.name:<10} {d.type.value:<5} {d.plugin.name:<10} {d.description}")
    for fl in reg.failures:
        p(f"  ({'no device' if fl.no_device else 'broken plugin'} {fl.name}: {fl.reason})")
    return f, cfg, tok, reg


def loaded_line(f, model) -> str:
    """``loaded 4.3 GiB in 2.1 s (2.2 GB/s)``."""
    n, s = total_bytes(f), model.load_s
    return f"loaded {n / 2**30:.2f} GiB in {s:.2f} s ({n / max(s, 1e-9) / 1e9:.1f} GB/s)"


def cpu_moe_values(args, cfg) -> list[int]:
    """The layers whose experts live in host memory, one value per run, from --experts /
    --n-cpu-moe (bench model's may be a list)."""
    from accelplane.cli import UsageError

    experts, n = getattr(args, "experts", None), getattr(args, "n_cpu_moe", None)
    vals = [cfg.n_layers] if experts == "cpu" else [n] if isinstance(n, int) else list(n or [0])
    if any(vals) and not cfg.is_moe:
        flag = "--experts cpu" if experts == "cpu" else "--n-cpu-moe"
        raise UsageError(f"{flag}: the model ({cfg.arch}) has no experts")
    return vals


def cpu_moe_of(args, cfg) -> int:
    """`run`'s one value of :func:`cpu_moe_values`."""
    return cpu_moe_values(args, cfg)[0]


def cmd_run_text(args, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """``accelplane run --prompt TEXT``: the generated text to ``out`` as it is made, the rest
    (model, devices, timings) to ``err``. Returns the exit status."""
    out, err = out or sys.stdout, err or sys.stderr
    p = lambda *a: print(*a, file=err, flush=True)  # noqa: E731
    f, cfg, tok, reg = _open_model(args, p)
    ids = tok.encode(args.prompt, add_special=True, parse_special=args.special)
    if not ids:
        raise TokenizerError("--prompt: the text gives no tokens (and the model adds no BOS)")
    n = int(args.tokens)
    n_ctx = context_for(cfg, len(ids) + n, "the prompt's tokens + --tokens")
    top_k = 40 if args.top_k is None else args.top_k
    sampler = Sampler(args.temp, top_k, 0.95 if args.top_p is None else args.top_p, args.seed)
    devs, cpu = pick_devices(reg, args.device), _cpu_of(reg)
    model = load(f, devs, cpu, args.split, n_ctx, cpu_moe=cpu_moe_of(args, cfg))
    p(loaded_line(f, model))
    how = "greedy" if sampler.greedy else f"temp {sampler.temp:g}, top-k {top_k}, top-p {sampler.top_p:g}"
    how += f", seed {args.seed}" if not sampler.greedy else ""
    p(f"prompt: {len(ids)} tokens ({tok!r}); generating up to {n} tokens, {how}")
    try:
        if n:  # warm-up: graphs, scheduler plans and backend plans are built once, outside the timing
            generate(model, ids, 1, False, show=False)

        def write(s: str) -> None:
            out.write(s)
            out.flush()

        res = generate_text(model, tok, ids, n, sampler, write)
    finally:
        model.free()
    out.write("\n")
    out.flush()
    if res.pp_s:
        p(f"prefill: {len(ids)} tokens in {res.pp_s * 1e3:.1f} ms = {len(ids) / res.pp_s:.1f} tokens/s")
    if res.steps:
        p(f"decode:  {res.steps} tokens in {res.tg_s * 1e3:.1f} ms = {res.steps / res.tg_s:.1f} tokens/s")
    why = (f"end-of-generation token {res.eog} {tok.tokens[res.eog]!r}" if res.eog is not None
           else f"--tokens {n}")  # fmt: skip
    p(f"generated {len(res.tokens)} tokens; stopped at {why}")
    return 0


def cmd_run(args, out: TextIO | None = None) -> int:
    """``accelplane run`` (see the module docstring). Returns the exit status."""
    if getattr(args, "prompt", None) is not None:
        return cmd_run_text(args, out)
    out = out or sys.stdout
    p = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    f, cfg, _, reg = _open_model(args, p)
    devs = pick_devices(reg, args.device)
    for d in reg.devices:
        if d.open_error is not None:  # passed over by the default choice
            p(f"  ({d.name} left out: {d.open_error})")
    cpu = _cpu_of(reg)
    n_prompt, n_dec = int(args.prompt_tokens or 32), int(args.tokens)
    n_ctx = context_for(cfg, n_prompt + n_dec, "--prompt-tokens + --tokens")
    model = load(f, devs, cpu, args.split, n_ctx, cpu_moe=cpu_moe_of(args, cfg))
    p(loaded_line(f, model))
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
        # a MoE: this run's routing, which the CPU's replay then follows (see below)
        routed = teacher_forced_routing(model, prompt, res.tokens[:-1]) if check and cfg.is_moe else None
    finally:
        model.free()
    if not check:
        return 0
    ref_model = load(f, [cpu], cpu, "none", n_ctx, show=False)
    try:
        if routed is None:
            ref = teacher_forced(ref_model, prompt, res.tokens[:-1])
        else:
            ref, ref_routes = teacher_forced_routing(ref_model, prompt, res.tokens[:-1], forced=routed[1])
    finally:
        ref_model.free()
    route_ok = True
    if routed is not None:
        # near-tied experts may rank differently under another device's rounding, and one swap
        # changes everything after it; so the CPU ran this run's experts (its logits then differ
        # by arithmetic alone), and the experts are checked apart: each differing choice must
        # be a near tie of the CPU's own probabilities
        ag = routing_agreement(routed[1], ref_routes)
        route_ok = ag.ok
        verdict = "OK" if ag.ok else "FAILED"
        off = f"; {ag.not_top} not a top {cfg.n_expert_used} of this run's own router" if ag.not_top else ""
        p(f"routing check vs CPU ({ag.choices} expert choices, replayed on the CPU): {ag.differ} differ "
          f"from the CPU's own top {cfg.n_expert_used}, the widest swap a log-probability ratio of "
          f"{ag.worst:.3g} (tolerance {ag.tie:g}){off}: {verdict}")  # fmt: skip
        res_logits = routed[0]
    else:
        res_logits = res.logits
    a, b = np.stack(res_logits), np.stack(ref)
    err = float(np.max(np.abs(a - b)))
    e = nmse(a, b)
    agree = int(np.sum(a.argmax(-1) == b.argmax(-1)))
    ok = e <= args.nmse_tol
    p(f"logits check vs CPU ({len(ref)} steps, teacher-forced): max abs err {err:.3g}, NMSE {e:.3g}, "
      f"top-1 agree {agree}/{len(ref)} (tolerance NMSE <= {args.nmse_tol:g}): "
      f"{'OK' if ok else 'FAILED'}")  # fmt: skip
    return 0 if ok and route_ok else 1


def cmd_bench_model(args, out: TextIO | None = None) -> int:
    import accelplane
    from accelplane.bench import machine

    path = Path(args.model) if args.model else default_model_path()
    f = read_gguf(path)
    f.check_tensors(f.model_config())
    reg = accelplane.get_registry()
    for sp in args.split or []:
        check_split(sp)
    configs = bench_configs(reg, args.device, args.split)  # a bad -d/--split fails before any output
    print(f"model: {path}\n  {describe_model(f)}", file=out)
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    # progress (on a terminal, without -q): each model load's bar, a line per run, kernel builds
    rows = bench_model(f, configs, _cpu_of(reg), args.pp, args.tg, args.reps or 2, prof, show=True,
                       cpu_moe=cpu_moe_values(args, f.model_config()),
                       llama_bench=args.llama_bench)  # fmt: skip
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
    """``accelplane make-model``: a synthetic model of ``--arch`` from a preset and overrides."""
    from accelplane.cli import MAKE_FLAGS, UsageError

    out = out or sys.stdout
    presets, default, settable = MAKE_ARCHS[args.arch]
    preset = args.preset or default
    if preset not in presets:
        raise UsageError(f"make-model: --preset {preset} is not a {args.arch} preset ({', '.join(presets)})")
    kw = dict(presets[preset], arch=args.arch, wtype=args.wtype)
    for flag, dest in MAKE_FLAGS:
        v = getattr(args, dest, None)
        if v is None:
            continue
        if dest not in settable:
            raise UsageError(f"make-model: {flag} does not apply to --arch {args.arch}")
        kw[dest] = v
    if args.arch == "gemma3" and "sliding_window" not in kw:
        kw["sliding_window"] = min(512, kw["n_ctx"] // 4)  # Gemma 3 1B's window, short contexts a quarter
    make_with_bar(args.out, jobs=args.jobs, **kw)
    f = read_gguf(args.out)
    print(f"wrote {args.out}\n  {describe_model(f)}", file=out)
    return 0

