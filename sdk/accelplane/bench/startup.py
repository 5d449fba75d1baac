"""``accelplane bench startup``: what a fresh process pays to import accelplane and list the
devices, with every installed plugin and with each plugin alone, and what ``accelplane
devices`` (which opens every device) takes. Each figure is the median of several fresh
interpreters, after one run that is not counted (it writes the bytecode of the sources).

The children run with bytecode caching on, as an installed package has it (they unset
PYTHONDONTWRITEBYTECODE); everything else of the environment (ACCELPLANE_*) is the caller's."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

# in the child: in-process times of the import and of the listing (interpreter start excluded)
CHILD = """
import json, time
t0 = time.perf_counter()
import accelplane
t1 = time.perf_counter()
reg = accelplane.get_registry()
devices = reg.devices
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "list_s": t2 - t1, "devices": [d.name for d in devices],
                  "failures": [[f.name, f.reason] for f in reg.failures]}))
"""
IMPORT_ONLY = "import time; t0 = time.perf_counter(); import accelplane; " \
              "print('{\"import_s\": %r}' % (time.perf_counter() - t0))"  # fmt: skip


def _env(plugin: str | None, names: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.pop("ACCELPLANE_PLUGINS", None)
    if plugin is not None:  # every other plugin blocked (an allow list would make failures loud)
        env["ACCELPLANE_DISABLE_PLUGINS"] = ",".join(n for n in names if n != plugin)
    return env


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, dict]:
    """(wall seconds of the process, the JSON its last line printed, or {})."""
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


def _median(runs: list[tuple[float, dict]], key: str | None) -> float | None:
    vals = [r[1][key] for r in runs if key in r[1]] if key else [r[0] for r in runs]
    return statistics.median(vals) if vals else None


def bench_startup(runs: int = 7, progress: Callable[[str], None] | None = None) -> list[dict]:
    """Rows of {what, plugin, import_ms, list_ms, total_ms, process_ms, devices, note}: the
    medians over ``runs`` fresh processes of ``import accelplane`` alone, of importing and
    listing the devices (``accelplane.get_registry().devices``) with every plugin and with each
    installed plugin alone, and of ``accelplane devices`` (process time only)."""
    from accelplane.runtime.registry import installed_names

    names = installed_names()
    py = sys.executable
    cases: list[tuple[str, str | None, list[str]]] = [("import accelplane", None, [py, "-c", IMPORT_ONLY]),
                                                      ("list devices: all plugins", None, [py, "-c", CHILD])]
    cases += [(f"list devices: {n} alone", n, [py, "-c", CHILD]) for n in names]
    cases.append(("accelplane devices", None, [py, "-m", "accelplane.cli", "devices"]))
    rows = []
    for what, plugin, argv in cases:
        env = _env(plugin, names)
        if progress:
            progress(f"startup: {what}")
        _run(argv, env)  # not counted: writes bytecode, warms the page cache
        got = [_run(argv, env) for _ in range(runs)]
        last = got[-1][1]
        imp, lst = _median(got, "import_s"), _median(got, "list_s")
        failures = last.get("failures", [])
        note = "; ".join(f"{n}: {r}" for n, r in failures if plugin is None or n == plugin)
        rows.append({
            "what": what, "plugin": plugin,
            "import_ms": None if imp is None else imp * 1e3,
            "list_ms": None if lst is None else lst * 1e3,
            "total_ms": None if lst is None or imp is None else (imp + lst) * 1e3,
            "process_ms": _median(got, None) * 1e3,  # type: ignore[operator]
            "devices": last.get("devices"), "note": note,
        })  # fmt: skip
    return rows


def format_startup(rows: list[dict], runs: int) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    lines = [f"median of {runs} fresh processes (bytecode cached); ms: import = `import accelplane`, "
             "list = get_registry().devices after it, total = both, process = the whole process "
             "(interpreter start and exit too)",
             f"{'what':<34} {'import':>7} {'list':>7} {'total':>7} {'process':>8}  devices"]  # fmt: skip
    for r in rows:
        devs = ", ".join(r["devices"]) if r["devices"] else ""
        note = f" ({r['note']})" if r["note"] else ""
        lines.append(f"{r['what']:<34} {ms(r['import_ms']):>7} {ms(r['list_ms']):>7} {ms(r['total_ms']):>7} "
                     f"{ms(r['process_ms']):>8}  {devs}{note}")  # fmt: skip
    return "\n".join(lines)
