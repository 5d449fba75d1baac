"""Command line: ``accelplane devices | ops | conformance | bench | run | embed | make-model | new-plugin``.

Contract: a user error (a bad argument, an unwritable output path, a bad ACCELPLANE_*
value, a malformed model file, an unknown device) prints one line ``accelplane: error: ...``
and exits with status 2 before any long work starts; a failed computation or check, or a
file system error during the work, exits 1; Ctrl-C exits 130 with one line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``accelplane: error: run: argument --tokens: ...``."""

    def error(self, message: str):  # type: ignore[override]
        cmd = " ".join(self.prog.split()[1:])
        where, hint = (f"{cmd}: ", f"accelplane {cmd} --help") if cmd else ("", "accelplane --help")
        self.exit(EXIT_USAGE, f"accelplane: error: {where}{message} (see {hint})\n")


def _int(lo: int, hi: int | None = None):
    """argparse type: an integer in [lo, hi]."""

    def parse(s: str) -> int:
        try:
            v = int(s, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo or (hi is not None and v > hi):
            rng = f"from {lo} to {hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"expected an integer {rng}, got {v}")
        return v

    return parse


def _number(s: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None


def _positive(s: str) -> float:
    """argparse type: a finite number > 0."""
    v = _number(s)
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {s}")
    return v


def _nonneg(s: str) -> float:
    """argparse type: a finite number >= 0."""
    v = _number(s)
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {s}")
    return v


def _unit(s: str) -> float:
    """argparse type: a number in (0, 1]."""
    v = _number(s)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {s}")
    return v


def _regex(s: str) -> str:
    try:
        re.compile(s)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression ({e}): {s!r}") from None
    return s


class UsageError(Exception):
    """A user error the CLI reports in one line with status 2."""


def check_output(path: str | None, what: str) -> None:
    """UsageError unless ``path`` (an output file; None or '-': none) can be written now, so a
    bad path fails before the work that would fill it. Creates nothing that was not there."""
    if path is None or path == "-":
        return
    p = Path(path)
    if "\0" in path:
        raise UsageError(f"{what} {path!r}: a path cannot hold a NUL byte")
    try:  # is_dir and exists raise, not answer False, for a name too long for the file system
        if p.is_dir():
            raise UsageError(f"{what} {path}: is a directory")
        if not p.parent.is_dir():
            raise UsageError(f"{what} {path}: directory {p.parent} does not exist")
        existed = p.exists()
        with open(p, "ab"):
            pass
        if not existed:
            os.unlink(p)
    except OSError as e:
        raise UsageError(f"{what} {path}: cannot be written ({e.strerror or e})") from None


def _progress(msg: str) -> None:
    """Which case a benchmark is at: a transient line on a terminal (accelplane.runtime.progress)."""
    from accelplane.runtime.progress import status

    status(msg)


def cmd_env() -> int:
    """``accelplane devices --env``: the ACCELPLANE_* variables that are set, with their meaning
    (and any that does not parse or that nothing installed reads), then the others known.
    Exit status 2 when a set value does not parse."""
    import accelplane
    from accelplane import env

    accelplane.get_registry()  # discovery imports the plugins, which declare their variables
    rows = env.report()
    bad = 0
    print("ACCELPLANE_* variables set:" if rows else "no ACCELPLANE_* variable is set")
    for r in rows:
        owner = f" [{r['owner']}]" if r["owner"] else ""
        print(f"  {r['name']}={r['value']}{owner}: {r['meaning'] or '?'}")
        if r["problem"]:
            bad += bool(r["owner"])  # a value that does not parse (an unknown name only warns)
            print(f"    problem: {r['problem']}")
    rest = [v for n, v in env.declared().items() if n not in {r["name"] for r in rows}]
    print(f"other variables ({len(rest)}; unset):")
    for v in rest:
        default = f", default {v.default_text()}" if v.default_text() else ""
        print(f"  {v.name} [{v.owner}] ({v.accepts}{default}): {v.help}")
    return EXIT_USAGE if bad else 0


def cmd_devices(args) -> int:
    import accelplane

    if args.env:
        return cmd_env()
    # opening every device (no kernel is compiled) is what makes the listing honest: a device
    # whose runtime fails is shown failing; --no-open lists what the probes say, as devices() does
    info = accelplane.get_registry().info(open=not args.no_open)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"accelplane {info['accelplane']} (backend API {info['api_version'][0]}."
          f"{info['api_version'][1]})")  # fmt: skip
    for p in info["plugins"]:
        print(f"plugin {p['name']} {p['version']} (API {p['api_version'][0]}."
              f"{p['api_version'][1]})")  # fmt: skip
        for d in p["devices"]:
            mem = ("memory: on open" if d["memory_total"] is None else
                   f"{d['memory_free'] / 2**30:.1f}/{d['memory_total'] / 2**30:.1f} GiB free"
                   if d["memory_total"] else "memory: n/a")  # fmt: skip
            caps = ",".join(k for k, v in d["caps"].items() if v) or "sync"
            print(f"  {d['name']:<10} {d['type']:<5} {mem:<24} [{caps}] {d['description']}")
            if d["open_error"]:
                print(f"    did not open: {d['open_error']}")
    for f in info["failures"]:
        if f["no_device"]:  # installed, but its hardware or runtime is not here: not broken
            print(f"plugin {f['name']}: no device ({f['reason']})")
        else:
            print(f"broken plugin {f['name']} (at {f['stage']}): {f['reason']}")
    if info["default_order"]:
        # the order `run` and best_device() place work in when no device is named
        print("default order: " + ", ".join(f"{r['device']} ({r['why']})"
                                            for r in info["default_order"]))  # fmt: skip
    if args.no_open:
        print("(listed from each plugin's probe; runtimes open on first use: without --no-open, "
              "every device is opened and any that fails is shown)")  # fmt: skip
    return 0


Matrix = dict[str, dict[str, tuple[int, int]]]  # row → {device column: (supported, cases)}


def support_matrix() -> tuple[list[str], Matrix, Matrix]:
    """(device columns, by op, by block type) over the conformance cases: a case counts in the
    row of its op and in the row of each block type among its parameters."""
    import accelplane
    from accelplane.conformance.cases import all_cases
    from accelplane.conformance.runner import graph_supported
    from accelplane.core.graph import Context
    from accelplane.core.types import GGMLType

    devs = accelplane.get_registry().devices
    cols = [f"{d.plugin.name}/{d.name}" for d in devs]
    by_op: Matrix = {}
    by_type: Matrix = {}
    for case in all_cases():
        ctx = Context()
        g = ctx.graph(case.build(ctx))
        oks = [graph_supported(d, g)[0] for d in devs]
        types = {v.name for v in case.params.values() if isinstance(v, GGMLType) and v.is_quantized}
        for matrix, key in [(by_op, case.op), *((by_type, t) for t in types)]:
            row = matrix.setdefault(key, dict.fromkeys(cols, (0, 0)))
            for c, ok in zip(cols, oks, strict=True):
                s, n = row[c]
                row[c] = (s + ok, n + 1)
    order = {t.name: int(t) for t in GGMLType}
    return cols, dict(sorted(by_op.items())), dict(sorted(by_type.items(), key=lambda kv: order[kv[0]]))


def _cell(s: int, n: int) -> str:
    return "yes" if s == n else "no" if s == 0 else f"partial ({s}/{n})"


def _md_table(first: str, cols: list[str], matrix: Matrix) -> list[str]:
    lines = [f"| {first} | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    return lines + [f"| {k} | " + " | ".join(_cell(*r[c]) for c in cols) + " |" for k, r in matrix.items()]


def cmd_ops(args) -> int:
    cols, matrix, by_type = support_matrix()
    if args.json:
        print(json.dumps({op: {c: {"supported": s, "cases": n} for c, (s, n) in row.items()}
                          for op, row in matrix.items()}, indent=1))  # fmt: skip
        return 0
    if args.markdown is not None:
        lines = ["# Op support matrix", "",
                 "Generated by `accelplane ops --markdown` from the conformance cases: `yes` = every "
                 "case of the op is supported, `partial (s/n)` = s of n cases (types, shapes), "
                 "`no` = none. Support is what each plugin's `supports_op` answers; the "
                 "conformance suite proves every `yes`.", "",
                 *_md_table("op", cols, matrix), "", "## Block types", "",
                 "The cases that read or write each block type (MUL_MAT, MUL_MAT_ID, GET_ROWS, "
                 "SET_ROWS, CPY), counted as above.", "",
                 *_md_table("type", cols, by_type)]  # fmt: skip
        import accelplane

        missing = accelplane.get_registry().failures
        if missing:
            lines += ["", "Installed plugins without a usable device where this was generated "
                      "(no column):", ""]  # fmt: skip
            lines += [f"- {f.name}: {f.reason}" for f in missing]
        text = "\n".join(lines) + "\n"
        if args.markdown == "-":
            print(text)
        else:
            Path(args.markdown).write_text(text)
            print(f"wrote {args.markdown}")
        return 0
    w = max(len(c) for c in cols) + 2 if cols else 10
    print(f"{'op':<14}" + "".join(f"{c:>{w}}" for c in cols))
    for op, row in matrix.items():
        print(f"{op:<14}" + "".join(f"{_cell(*row[c]):>{w}}" for c in cols))
    return 0


def cmd_conformance(args, extra: list[str]) -> int:
    from accelplane import conformance

    try:
        import pytest
    except ImportError as e:  # the suite is a pytest plugin: say what to install, in one line
        print(conformance.pytest_missing(e))
        return conformance.UNTESTABLE

    from accelplane.conformance import pytest_plugin

    # accelplane is imported already, so pytest would warn that it cannot rewrite the asserts of
    # the suite's plugin; the suite does not use hypothesis, whose pytest plugin takes a second
    argv = [str(pytest_plugin.SUITE_DIR), "--accelplane-plugin", args.plugin, "-p", "no:cacheprovider",
            "-p", "no:hypothesispytest", "-q", "--rootdir", str(pytest_plugin.SUITE_DIR),
            "-W", "ignore::pytest.PytestAssertRewriteWarning"]  # fmt: skip
    if args.device:
        argv += ["--accelplane-device", args.device]
    if args.json:
        argv += ["--accelplane-json", args.json]
    if args.k:
        argv += ["-k", args.k]
    if args.thorough:
        argv.append("--thorough")
    if args.allow_no_device:
        argv.append("--accelplane-allow-no-device")
    for x in args.xfails or []:
        argv += ["--accelplane-xfails", x]
    return int(pytest.main(argv + extra))


def cmd_bench(args) -> int:
    import accelplane
    from accelplane import bench

    if args.what == "model":
        from accelplane.cli.run import cmd_bench_model

        return cmd_bench_model(args)
    if args.what == "startup":  # fresh processes measure it: this one lists nothing
        from accelplane.bench.startup import bench_startup, format_startup

        res = bench_startup(args.runs, _progress)
        _progress("")
        print(format_startup(res))
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": bench.machine(), **res}, indent=1))
            print(f"wrote {args.json}")
        return 0
    reg = accelplane.get_registry()
    if args.what == "graph":
        from accelplane.bench.graph import bench_graph, format_graph

        cpu = [d for d, _ in reg.ranked() if d.type.value == "CPU"][:1]
        devs = [reg.device(n) for n in args.device] if args.device else reg.accelerators() or cpu
        rows = bench_graph(args.preset, devs, args.reps or 10, args.batch, args.seq, _progress)
        _progress("")
        print(format_graph(rows))
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": bench.machine(), "results": rows}, indent=1))
        return 0
    if args.what == "dispatch":
        for label, us in bench.bench_dispatch():
            print(f"{label:<45} {us:8.3f} us/call")
        return 0
    if args.what == "tp":
        devs = [reg.device(n) for n in args.device] if args.device else None
        kw = {}
        if args.sizes:
            kw["sizes"] = args.sizes
        if args.peer_json:
            kw["peer"] = _peer_rows(args.peer_json)
        res = bench.bench_tp(devs, progress=_progress, **kw)
        _progress("")
        print(bench.format_tp(res))
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": bench.machine(), **res}, indent=1))
        return 0
    if args.what in ("sched", "moe"):
        dev = args.device[0] if args.device else None
        rows = (bench.bench_sched(device=dev, progress=_progress) if args.what == "sched"
                else bench.bench_moe_prefetch(device=dev, size=args.moe_size, n_tokens=args.moe_tokens,
                                              progress=_progress))  # fmt: skip
        _progress("")
        keys = list(rows[0])
        print("  ".join(f"{k:>17}" for k in keys))
        for r in rows:
            print("  ".join(f"{v:>17.2f}" if isinstance(v, float) else f"{v!s:>17}" for v in r.values()))
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": bench.machine(), "results": rows}, indent=1))
        return 0
    devs = [reg.device(n) for n in args.device] if args.device else reg.devices
    results = bench.bench_ops(devs, args.set, args.pattern, args.time, _progress, args.repeat)
    _progress("")
    print(bench.format_table(results))
    if args.json:
        Path(args.json).write_text(bench.to_json(results))
        print(f"wrote {args.json}")
    return 0


def _peer_rows(path: str) -> list:
    try:
        rows = json.loads(Path(path).read_text())["rows"]
    except OSError as e:
        raise UsageError(f"--peer-json {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"--peer-json {path}: not a JSON object with 'rows'") from None
    if not isinstance(rows, list):
        raise UsageError(f"--peer-json {path}: 'rows' is not a list")
    return rows


def _sizes(s: str) -> list[int]:
    from accelplane.bench import parse_sizes

    try:
        return parse_sizes(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _quiet_parent() -> argparse.ArgumentParser:
    """-q/--quiet of the commands that show progress (on stderr, on a terminal only)."""
    q = argparse.ArgumentParser(add_help=False)
    q.add_argument("-q", "--quiet", action="store_true",
                   help="no progress on stderr (shown on a terminal only: model bars, kernel "
                        "builds over a second, benchmark runs)")  # fmt: skip
    return q


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="accelplane", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("devices", help="plugins, devices, memory; plugins with no device or broken, and why")
    d.add_argument("--json", action="store_true")
    d.add_argument("--no-open", action="store_true",
                   help="list what each plugin's probe says, opening no device's runtime (the "
                        "default opens each, compiling no kernel, and shows any that fails)")  # fmt: skip
    d.add_argument("--env", action="store_true",
                   help="the ACCELPLANE_* variables that are set, with their meaning, and the others known")
    o = sub.add_parser("ops", help="op support matrix of every installed plugin")
    o.add_argument("--json", action="store_true")
    o.add_argument("--markdown", nargs="?", const="docs/ops.md", default=None,
                   help="write a markdown table (default docs/ops.md; '-' for stdout)")  # fmt: skip
    c = sub.add_parser("conformance", help="run the conformance suite against a plugin",
                       epilog="exit status: 0 passed (or skipped: no device, with --allow-no-device); "
                       "1 a case failed or an expected failure passed; 4 the plugin is not installed, "
                       "did not load or has no device, or an expected-failures entry matches no case; "
                       "5 no case ran. The last line says why.")  # fmt: skip
    c.add_argument("plugin")
    c.add_argument("--device")
    c.add_argument("--json", help="write per-op counts and every case to this file")
    c.add_argument("-k", help="pytest -k expression selecting cases")
    c.add_argument("--thorough", action="store_true")
    c.add_argument("--xfails", action="append", help="extra expected-failures file")
    c.add_argument("--allow-no-device", action="store_true",
                   help="a plugin that is installed but has no device (hardware or runtime absent) "
                        "prints 'skipped: no device: <reason>' and exits 0")  # fmt: skip
    b = sub.add_parser("bench", help="benchmarks", parents=[_quiet_parent()])
    b.add_argument("what", choices=["ops", "dispatch", "sched", "moe", "model", "graph", "tp", "startup"],
                   help="ops: op perf; dispatch: hook call cost; sched: sync policies; "
                        "moe: expert prefetch; model: llama-bench pp/tg tokens/s; graph: a host-API "
                        "graph (--preset) beside PyTorch; tp: tensor "
                        "parallelism (all-reduce bus bandwidth, layer tokens/s; -d repeats a "
                        "device to give it several backends); startup: import accelplane and "
                        "list the devices in fresh processes, every plugin and each alone")  # fmt: skip
    b.add_argument("--moe-size", default="small", choices=["small", "a1b"],
                   help="moe: the layers' shapes (small: d 512, 16 experts of FFN 1024, 4 used, F32; a1b: "
                        "qwen3moe 8b-a1b's, d 2048, 64 experts of FFN 768, 8 used, Q4_0)")  # fmt: skip
    b.add_argument("--moe-tokens", type=_int(1, 65536), default=64, help="moe: tokens per batch (default 64)")
    b.add_argument("--preset", default="bert-mini", choices=["bert-mini", "bert-tiny"],
                   help="graph: the encoder's shapes (default bert-mini: 6 layers, d 384, 12 heads)")
    b.add_argument("--batch", type=_int(1, 4096), default=16, help="graph: sequences per batch (default 16)")
    b.add_argument("--seq", type=_int(1, 512), default=62, help="graph: tokens per sequence (default 62)")
    b.add_argument("--set", default="default",
                   choices=["default", "matmul", "gemm", "small", "overhead", "moe"],
                   help="ops: case set (default: default; moe: a MoE model's MUL_MAT_IDs)")  # fmt: skip
    b.add_argument("-p", "--pattern", type=_regex, help="regex on case names")
    b.add_argument("-d", "--device", action="append", help="device name (repeatable)")
    b.add_argument("--time", type=_positive, default=1.0, help="seconds per case (default 1)")
    b.add_argument("--repeat", type=_int(1, 1 << 16), default=None,
                   help="ops per graph (default: 1 on CPU devices, 16 on others)")  # fmt: skip
    b.add_argument("--json", help="write results as JSON")
    b.add_argument("--runs", type=_int(1, 1000), default=7,
                   help="startup: fresh processes per figure, the median shown (default 7)")  # fmt: skip
    b.add_argument("--sizes", type=_sizes,
                   help="tp: all-reduce sizes in bytes, e.g. 4K,1M,64M,1G (default 64K,1M,16M)")
    b.add_argument("--peer-json", help="tp: a peer's all-reduce rows from the same run (JSON with 'rows', "
                   "e.g. from python tools/cuda_peers.py --allreduce N --json FILE)")  # fmt: skip
    _model_args(sub, b)
    from accelplane.cli import newplugin

    newplugin.add_parser(sub)
    return p


# make-model: the architectures (the keys of accelplane.models.runner.MAKE_ARCHS, named here so
# that parsing imports no model code), and its options that set a make_model keyword: (flag,
# keyword), the integer ones first
MAKE_ARCH_NAMES = ["llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "bert"]
_MAKE_INTS = (("--layers", "n_layers"), ("--d-model", "d_model"), ("--heads", "n_head"),
              ("--kv-heads", "n_head_kv"), ("--ff", "d_ff"), ("--ff-exp", "d_ff_exp"), ("--vocab", "n_vocab"),
              ("--ctx", "n_ctx"),
              ("--experts", "n_expert"), ("--experts-used", "n_expert_used"), ("--head-dim", "head_dim"),
              ("--sliding-window", "sliding_window"), ("--seed", "seed"))  # fmt: skip
MAKE_FLAGS = _MAKE_INTS + (("--output-type", "output_type"), ("--tied", "tied"), ("--rope-base", "rope_base"),
                           ("--rope-scaling", "rope_scaling"), ("--rope-factor", "rope_factor"),
                           ("--logit-softcap", "logit_softcap"), ("--pooling", "pooling"))  # fmt: skip


def _int_list(lo: int):
    """argparse type: a comma list of integers >= lo."""
    one = _int(lo)
    return lambda s: [one(x.strip()) for x in s.split(",")]


def _moe_args(p, prefix: str, many: bool = False) -> None:
    """Where a MoE model's experts live (llama.cpp's --cpu-moe and --n-cpu-moe; ``many``: a
    comma list of values for --n-cpu-moe, one run each, as llama-bench's -ncmoe)."""
    p.add_argument("--experts", choices=["device", "cpu"], default=None,
                   help=f"{prefix}a MoE model's expert tensors on the layers' devices (default) or all in "
                        "host memory (llama.cpp's --cpu-moe)")  # fmt: skip
    p.add_argument("--n-cpu-moe", type=_int_list(0) if many else _int(0), default=None,
                   metavar="N[,N...]" if many else "N",
                   help=f"{prefix}the expert tensors of the first N layers in host memory (llama.cpp's "
                        f"--n-cpu-moe){'; a comma list runs each' if many else ''}")  # fmt: skip


def _model_args(sub, b) -> None:
    """`bench model` options, and the `run` and `make-model` commands (accelplane.models)."""
    b.add_argument("--model", help="model: GGUF file (default: the synthetic model of `run`)")
    b.add_argument("--pp", type=_int(0), default=512, help="model: prompt tokens (default 512; 0 skips)")
    b.add_argument("--tg", type=_int(0), default=128, help="model: generated tokens (default 128; 0 skips)")
    b.add_argument("--reps", type=_int(1, 1 << 16), default=None,
                   help="model, graph: timed runs after a warm-up (default: model 2, graph 10)")  # fmt: skip
    b.add_argument("--split", action="append", choices=["none", "layer", "tensor"],
                   help="model: split mode (repeatable; default none, plus layer over all "
                        "non-CPU devices when there are several); model: -d takes a comma list "
                        "as one device set")  # fmt: skip
    _moe_args(b, "model: ", many=True)
    b.add_argument("--llama-bench", metavar="PATH",
                   help="model: llama.cpp's llama-bench, run on the same file right before and "
                        "after each config (-fa 1, the same -p/-n/-r, threads, -ncmoe); "
                        "prints the ratio")  # fmt: skip
    b.add_argument("--png", help="model: write a bar chart (needs matplotlib)")
    b.add_argument("--profile", type=_int(0), default=0, metavar="N",
                   help="model: profile the host side of the timed tg runs, print the top N")  # fmt: skip
    r = sub.add_parser("run", help="run a GGUF model (llama, qwen2, qwen3, qwen3moe, gemma3; default: a "
                       "small synthetic llama) on the best devices, print tokens/s and check the logits "
                       "against the CPU plugin",
                       parents=[_quiet_parent()])  # fmt: skip
    r.add_argument("--model", help="GGUF file (default: a synthetic model, made once and cached)")
    r.add_argument("-d", "--device", action="append",
                   help="device(s) for the weights (comma list or repeat; default: every non-CPU "
                        "device, else the CPU)")  # fmt: skip
    r.add_argument("--split", default="none", choices=["none", "layer", "tensor"],
                   help="none: all layers on the first device; layer: layers spread over the "
                        "devices; tensor: needs the meta device")  # fmt: skip
    _moe_args(r, "")
    r.add_argument("--tokens", type=_int(0), default=32,
                   help="decode steps (default 32); with --prompt, the most tokens generated")  # fmt: skip
    r.add_argument("--prompt", help="text to continue: tokenized with the model's vocabulary, the "
                   "generated text streams to stdout (everything else goes to stderr); generation "
                   "stops at an end-of-generation token or after --tokens; no logits check")  # fmt: skip
    r.add_argument("--special", action="store_true",
                   help="--prompt: control tokens written in it (<|im_start|>, ...) are parsed as such")
    r.add_argument("--temp", type=_nonneg, default=0.0,
                   help="--prompt: sampling temperature (default 0: greedy)")  # fmt: skip
    r.add_argument("--top-k", type=_int(0), default=None,
                   help="--prompt with --temp > 0: keep the k most likely tokens (default 40; 0: all)")
    r.add_argument("--top-p", type=_unit, default=None,
                   help="--prompt with --temp > 0: keep the most likely tokens up to this probability "
                        "(default 0.95; 1: all)")  # fmt: skip
    r.add_argument("--prompt-tokens", type=_int(1), default=None,
                   help="length of the random prompt without --prompt (default 32)")  # fmt: skip
    r.add_argument("--seed", type=_int(0), default=0,
                   help="seed of the random prompt, or of the sampling with --prompt --temp > 0")
    r.add_argument("--nmse-tol", type=_positive, default=None,
                   help="logits check tolerance (NMSE vs the CPU plugin; default 1e-3)")  # fmt: skip
    r.add_argument("--no-check", action="store_true", help="skip the logits check")
    e = sub.add_parser("embed", help="embeddings of texts (or token ids) by a bert GGUF model, as "
                       "llama.cpp's embedding tool computes them", parents=[_quiet_parent()])  # fmt: skip
    e.add_argument("text", nargs="*", help="texts to embed (tokenized by the model's vocabulary)")
    e.add_argument("--model", required=True, help="bert GGUF file")
    e.add_argument("--ids", action="append", metavar="IDS",
                   help="token ids of one sequence, comma or space separated, special tokens included "
                        "(repeatable; instead of TEXT)")  # fmt: skip
    e.add_argument("-d", "--device", action="append",
                   help="device for the weights (default: as for run, the first accelerator not emulated on "
                        "the host's cores, else the CPU)")  # fmt: skip
    e.add_argument("--pooling", choices=["none", "mean", "cls", "last"],
                   help="override the file's bert.pooling_type (none: one vector per token)")
    e.add_argument("--normalize", type=_int(-1, 1 << 16), default=2, metavar="P",
                   help="as llama.cpp's --embd-normalize: -1 none, 0 max absolute (int16 range), 1 taxicab, "
                        "2 Euclidean (default), >2 p-norm")  # fmt: skip
    e.add_argument("--out", help="write the embeddings to this .npy file (float32, one row per text; "
                   "with --pooling none one row per token) instead of printing them")  # fmt: skip
    m = sub.add_parser("make-model", help="write a synthetic GGUF model (random weights), as llama.cpp's "
                       "converter would write a checkpoint of the architecture",
                       parents=[_quiet_parent()])  # fmt: skip
    m.add_argument("out", help="output .gguf file")
    m.add_argument("--arch", default="llama", choices=MAKE_ARCH_NAMES,
                   help="architecture (default llama; bert: an embedding model for `embed`)")
    m.add_argument("--preset", choices=["tiny", "small", "1b", "8b", "8b-a1b", "mini"],
                   help="shapes: decoders tiny, small (the default: the model of `run`), 1b (TinyLlama-1.1B "
                        "shapes), 8b (Llama-3-8B shapes); qwen3moe tiny, small, 8b-a1b (7.6B parameters, "
                        "1.2B active); bert tiny, mini (the default: all-MiniLM-L6-v2 shapes)")  # fmt: skip
    m.add_argument("--jobs", type=_int(1, 1024), default=None,
                   help="worker processes making the weights (default: one per CPU; same file for any)")
    for flag, dest in _MAKE_INTS:
        lo = 0 if dest in ("n_expert", "n_expert_used", "d_ff_exp", "seed", "sliding_window") else 1
        m.add_argument(flag, dest=dest, type=_int(lo, 1 << 24), help="overrides the preset")
    from accelplane.core.types import GGMLType

    wtypes = [t.name.lower() for t in GGMLType if t != GGMLType.I32]  # what make_model writes
    m.add_argument("--wtype", default="q8_0", type=str.lower, choices=wtypes, help="matrix type")
    m.add_argument("--output-type", type=str.lower, choices=wtypes,
                   help="output head type (default: --wtype)")  # fmt: skip
    m.add_argument("--tied", action="store_true", default=None,
                   help="no output.weight: the head is the token embedding (gemma3 always)")
    m.add_argument("--rope-base", type=_positive,
                   help="rope frequency base (default: the architecture's usual one)")  # fmt: skip
    m.add_argument("--rope-scaling", choices=["none", "linear", "llama3"],
                   help="rope scaling (default none): linear (rope.scaling.* keys), llama3 (llama: the "
                        "rope_freqs tensor)")  # fmt: skip
    m.add_argument("--rope-factor", type=_positive, help="rope scaling factor (default 8)")
    m.add_argument("--logit-softcap", type=_positive, help="gemma3: final logit soft-capping")
    m.add_argument("--pooling", choices=["none", "mean", "cls", "last"],
                   help="bert: bert.pooling_type (default mean)")


def _check_inputs(args) -> None:
    """Everything about the arguments that can be checked before the work starts."""
    for attr, what in (("json", "--json"), ("png", "--png"), ("markdown", "--markdown"), ("out", "output")):
        v = getattr(args, attr, None)
        if isinstance(v, str):
            check_output(v, what)
    model = getattr(args, "model", None)
    if model is not None:
        try:
            found = Path(model).is_file()
        except OSError as e:  # a name too long for the file system, say
            raise UsageError(f"--model {model}: {e.strerror or e}") from None
        if not found:
            raise UsageError(f"--model {model}: no such file")
    if getattr(args, "experts", None) is not None and getattr(args, "n_cpu_moe", None) is not None:
        raise UsageError("--experts and --n-cpu-moe both say where the experts live: give one")
    if args.cmd == "bench" and args.what == "model" and args.pp == 0 and args.tg == 0:
        raise UsageError("bench model: --pp 0 and --tg 0 leave nothing to measure")
    if args.cmd == "bench" and args.llama_bench is not None:
        from accelplane.bench.llama_peer import executable

        if args.what != "model":
            raise UsageError("--llama-bench is a peer of bench model only")
        if not executable(args.llama_bench):
            raise UsageError(f"--llama-bench {args.llama_bench}: not an executable file")
    if args.cmd == "run":
        _check_run(args)


def _check_run(args) -> None:
    """`run`: the text-mode options go with --prompt, sampling options with --temp > 0."""
    text_only = [o for o, v in (("--special", args.special), ("--temp", args.temp), ("--top-k", args.top_k),
                                ("--top-p", args.top_p)) if v]  # fmt: skip
    if args.prompt is None and text_only:
        need = "needs" if len(text_only) == 1 else "need"
        raise UsageError(f"run: {', '.join(text_only)} {need} --prompt (text generation)")
    if args.prompt is not None and args.prompt_tokens is not None:
        raise UsageError("run: --prompt-tokens is the length of a random prompt; it cannot go with --prompt")
    if args.prompt is not None and not args.temp and (args.top_k is not None or args.top_p is not None):
        raise UsageError("run: --top-k and --top-p need --temp > 0 (--temp 0 is greedy)")


def _dispatch(args, extra: list[str]) -> int:
    if args.cmd == "devices":
        return cmd_devices(args)
    if args.cmd == "ops":
        return cmd_ops(args)
    if args.cmd == "conformance":
        return cmd_conformance(args, extra)
    if args.cmd == "run":
        from accelplane.cli.run import cmd_run
        from accelplane.models.runner import NMSE_TOL

        if args.nmse_tol is None:
            args.nmse_tol = NMSE_TOL
        return cmd_run(args)
    if args.cmd == "embed":
        from accelplane.cli.embed import cmd_embed

        return cmd_embed(args)
    if args.cmd == "make-model":
        from accelplane.cli.run import cmd_make_model

        return cmd_make_model(args)
    if args.cmd == "new-plugin":
        from accelplane.cli.newplugin import cmd_new_plugin

        return cmd_new_plugin(args)
    return cmd_bench(args)


def main(argv: list[str] | None = None) -> int:
    """The ``accelplane`` command; returns the exit status (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and args.cmd != "conformance":
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # --help, or a usage error argparse has printed
        return int(e.code or 0)
    from accelplane import env
    from accelplane.errors import AccelplaneError, AllocationError, ComputeError, PeerError
    from accelplane.runtime import progress

    def fail(status: int, msg: object) -> int:
        progress.end_line()
        print(f"accelplane: error: {msg}", file=sys.stderr)
        return status

    quiet = progress.set_quiet(getattr(args, "quiet", False) or progress.is_quiet())
    try:
        env.check()  # the SDK's settings (a plugin's are checked when its devices open)
        _check_inputs(args)
        return _dispatch(args, extra)
    except UsageError as e:
        return fail(EXIT_USAGE, e)
    except (ComputeError, AllocationError, PeerError) as e:  # the work itself, or its peer, failed
        return fail(EXIT_FAILED, e)
    except AccelplaneError as e:  # bad input: a setting, a file, a device name, a shape
        return fail(EXIT_USAGE, e)
    except KeyboardInterrupt:
        progress.end_line()
        print("accelplane: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (| head): say nothing more
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - flushing at exit must not fail again
        return EXIT_FAILED
    except OSError as e:  # the file system refused mid-run (disk full, a file gone): say which
        return fail(EXIT_FAILED, f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}")
    finally:
        progress.set_quiet(quiet)


if __name__ == "__main__":
    sys.exit(main())
