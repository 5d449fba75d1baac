"""``accelplane bench startup``: what a fresh process pays for ``import accelplane;
accelplane.devices()``, with every installed plugin (and where that time goes, plugin by
plugin) and with each plugin alone, and what ``accelplane devices`` (which opens every
device, compiling nothing) takes. Each figure is the median of several fresh interpreters,
after one run that is not counted (it writes the bytecode of the sources, warms the page cache).

The children run with bytecode caching on, as an installed package has it (they unset
PYTHONDONTWRITEBYTECODE), and without ACCELPLANE_PLUGINS: every installed plugin loads but
those ACCELPLANE_DISABLE_PLUGINS blocks; everything else of the environment is the caller's."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

# in the child: in-process times (wall and CPU) of the import and of the listing, and the
# registry's own per-plugin timings (interpreter start and exit are not in these)
CHILD = """
import json, time
w0, c0 = time.perf_counter(), time.process_time()
import accelplane
w1, c1 = time.perf_counter(), time.process_time()
devices = accelplane.devices()
w2, c2 = time.perf_counter(), time.process_time()
reg = accelplane.get_registry()
print(json.dumps({"import_s": w1 - w0, "list_s": w2 - w1, "cpu_s": c2 - c0,
                  "devices": [d.name for d in devices], "timings": reg.timings,
                  "plugins": {p.name: [d.name for d in p.devices] for p in reg.plugins.values()},
                  "failures": [[f.name, f.reason, f.no_device] for f in reg.failures]}))
"""
IMPORT_ONLY = """
import json, time
w0, c0 = time.perf_counter(), time.process_time()
import MODULE
print(json.dumps({"import_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0}))
"""
TIMING_KEYS = (("import_s", "import_ms"), ("validate_s", "validate_ms"), ("devices_s", "get_devices_ms"))


def _env(plugin: str | None, names: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "ACCELPLANE_PLUGINS")}
    if plugin is not None:  # every other plugin blocked too (an allow list would make failures loud)
        blocked = _blocked() | {n for n in names if n != plugin}
        env["ACCELPLANE_DISABLE_PLUGINS"] = ",".join(sorted(blocked))
    return env


def _blocked() -> set[str]:
    from accelplane import env

    return set(env.DISABLE_PLUGINS.get() or ())


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, dict]:
    """(wall seconds of the whole process, the JSON its last line printed, or {})."""
    t = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} failed (exit {p.returncode}):\n{p.stderr[-2000:]}")
    lines = p.stdout.strip().splitlines()
    try:
        return wall, json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    except ValueError:
        return wall, {}


def _ms(values: list[float]) -> float | None:
    return statistics.median(values) * 1e3 if values else None


def _breakdown(got: list[tuple[float, dict]]) -> list[dict]:
    """Per plugin of the all-plugins processes: the medians of its import, validation and
    get_devices, its devices and how it ended (listed, no device, broken)."""
    last = got[-1][1]
    failures = {n: (r, nd) for n, r, nd in last.get("failures", [])}
    rows = []
    for name in last.get("timings", {}):
        row: dict = {"plugin": name}
        for key, out in TIMING_KEYS:
            row[out] = _ms([t[key] for _, r in got if key in (t := r.get("timings", {}).get(name, {}))])
        row["total_ms"] = sum(row[o] or 0.0 for _, o in TIMING_KEYS)
        row["devices"] = last.get("plugins", {}).get(name, [])
        reason, no_device = failures.get(name, (None, False))
        row["outcome"] = "listed" if reason is None else f"{'no device' if no_device else 'broken'}: {reason}"
        rows.append(row)
    return rows


def bench_startup(runs: int = 7, progress: Callable[[str], None] | None = None) -> dict:
    """{"runs", "results", "plugins"}: ``results``, rows of {what, plugin, import_ms, list_ms,
    total_ms, cpu_ms, process_ms, devices, note}, the medians over ``runs`` fresh processes of
    ``import numpy`` (accelplane imports it: the floor), of ``import accelplane`` alone, of it
    and ``accelplane.devices()`` with every plugin and with each installed plugin alone
    (``list_ms``: devices() after the import; ``total_ms``: both, the figure to hold against a
    budget; ``cpu_ms``: the process's CPU time over both; ``process_ms``: the whole process,
    interpreter start and exit too), and of ``accelplane devices`` (process only);
    ``plugins``, the all-plugins process per plugin (_breakdown)."""
    from accelplane.runtime.registry import installed_names

    names = [n for n in installed_names() if n not in _blocked()]
    py = sys.executable
    # numpy first: accelplane imports it, so its import is a floor no listing goes below
    cases: list[tuple[str, str | None, list[str]]] = [
        ("import numpy (the floor)", None, [py, "-c", IMPORT_ONLY.replace("MODULE", "numpy")]),
        ("import accelplane", None, [py, "-c", IMPORT_ONLY.replace("MODULE", "accelplane")]),
        ("devices(): all plugins", None, [py, "-c", CHILD])]
    cases += [(f"devices(): {n} alone", n, [py, "-c", CHILD]) for n in names]
    cases.append(("accelplane devices (opens each)", None, [py, "-m", "accelplane.cli", "devices"]))
    rows, plugins = [], []
    for what, plugin, argv in cases:
        env = _env(plugin, names)
        if progress:
            progress(f"startup: {what} ({runs + 1} processes)")
        _run(argv, env)  # not counted: writes bytecode, warms the page cache
        got = [_run(argv, env) for _ in range(runs)]
        last = got[-1][1]
        imp = _ms([r["import_s"] for _, r in got if "import_s" in r])
        lst = _ms([r["list_s"] for _, r in got if "list_s" in r])
        total = _ms([r["import_s"] + r["list_s"] for _, r in got if "list_s" in r])
        failures = last.get("failures", [])
        note = "; ".join(f"{n}: {'no device' if nd else 'broken'} ({r})" for n, r, nd in failures
                         if plugin is None or n == plugin)  # fmt: skip
        rows.append({
            "what": what, "plugin": plugin, "import_ms": imp, "list_ms": lst,
            "total_ms": total if lst is not None else imp,
            "cpu_ms": _ms([r["cpu_s"] for _, r in got if "cpu_s" in r]),
            "process_ms": _ms([w for w, _ in got]),
            "devices": last.get("devices"), "note": note,
        })  # fmt: skip
        if what == "devices(): all plugins":
            plugins = _breakdown(got)
    return {"runs": runs, "results": rows, "plugins": plugins}


def format_startup(res: dict) -> str:
    def ms(v: float | None, w: int = 7, digits: int = 0) -> str:
        return f"{'-':>{w}}" if v is None else f"{v:{w}.{digits}f}"

    lines = [f"fresh processes, median of {res['runs']} (bytecode cached), ms: import = `import accelplane`, "
             "devices = accelplane.devices() after it, total = both (cpu: the CPU time of both), "
             "process = the whole process, interpreter start and exit too",
             f"{'what':<32} {'import':>7} {'devices':>7} {'total':>7} {'(cpu)':>7} {'process':>8}  "
             "devices"]  # fmt: skip
    for r in res["results"]:
        devs = ", ".join(r["devices"]) if r["devices"] else ""
        note = f" ({r['note']})" if r["note"] else ""
        lines.append(f"{r['what']:<32} {ms(r['import_ms'])} {ms(r['list_ms'])} {ms(r['total_ms'])} "
                     f"{ms(r['cpu_ms'])} {ms(r['process_ms'], 8)}  {devs}{note}")  # fmt: skip
    if res["plugins"]:
        lines += ["", "where devices() spends it with all plugins, per plugin (ms): its module's import, "
                  "validation (API version, pluggy, dispatch table), get_devices",
                  f"{'plugin':<12} {'import':>7} {'validate':>8} {'get_devices':>11} {'total':>7}  "
                  "outcome"]  # fmt: skip
        for p in res["plugins"]:
            out = ", ".join(p["devices"]) if p["outcome"] == "listed" else p["outcome"]
            lines.append(f"{p['plugin']:<12} {ms(p['import_ms'], 7, 1)} {ms(p['validate_ms'], 8, 1)} "
                         f"{ms(p['get_devices_ms'], 11, 1)} {ms(p['total_ms'], 7, 1)}  {out}")  # fmt: skip
    return "\n".join(lines)
