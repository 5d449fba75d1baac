"""llama.cpp's ``llama-bench`` as the peer of ``accelplane bench model``: the same pp and tg
tests on the same GGUF file, on the device llama.cpp calls by the same name, with flash attention
on, the same repetitions and CPU threads, and a MoE's ``-ncmoe`` as the config's. Each config's
peer runs right before our run and again right after it (engines alternated, the other engine's
model not loaded), so both see the same machine; the peer's figure is the mean of both runs'
samples, and each run's mean is kept to show drift."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

from accelplane.errors import PeerError
from accelplane.interface import DeviceType
from accelplane.runtime.backend import Device

TIMEOUT_S = 3600.0  # one llama-bench call; a large model's load and its repetitions fit well inside


def record_test(entry: dict) -> str | None:
    """llama-bench's test of a JSON record as ``bench model`` names it (``pp512``, ``tg128``);
    None for a combined or depth test, which ``bench model`` does not run."""
    p, g = int(entry.get("n_prompt", 0)), int(entry.get("n_gen", 0))
    if int(entry.get("n_depth", 0)) or (p > 0) == (g > 0):
        return None
    return f"pp{p}" if p else f"tg{g}"


def peer_args(devs: Sequence[Device], split: str, n_cpu_moe: int, pp: int, tg: int, reps: int,
              threads: int) -> list[str] | None:  # fmt: skip
    """llama-bench's arguments (after ``-m FILE``) for one ``bench model`` config, or None
    where llama.cpp has no like for it: the CPU alone is ``-ngl 0 -dev none``; other devices
    are named as llama.cpp names them (CUDA0, Vulkan0, SYCL0) with every layer on them; a
    device set splits by layer (``-sm layer``); our tensor split has no like there."""
    if len(devs) == 1 and devs[0].type == DeviceType.CPU:
        placement = ["-ngl", "0", "-dev", "none"]
    elif split == "tensor" or any(d.type == DeviceType.CPU for d in devs):
        return None  # llama.cpp offloads to accelerators only, and splits by layer or row
    else:
        placement = ["-ngl", "99", "-dev", "/".join(d.name for d in devs)]
        if len(devs) > 1:
            placement += ["-sm", split]
    return [*placement, "-fa", "1", "-p", str(pp), "-n", str(tg), "-r", str(reps), "-t", str(threads),
            "-ncmoe", str(n_cpu_moe), "-o", "json"]  # fmt: skip


@dataclass
class PeerRun:
    """One llama-bench call's tests: test name → its samples (tokens/s), and its build."""

    samples: dict[str, list[float]] = field(default_factory=dict)
    build: str = ""


def run_llama_bench(exe: str, model: str, args: Sequence[str], timeout_s: float = TIMEOUT_S) -> PeerRun:
    """Run ``exe -m model args`` and read its JSON records. Raises PeerError, with the last
    line llama-bench wrote to stderr, when it cannot start, fails, times out or prints no
    record this module reads."""
    cmd = [exe, "-m", model, *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except OSError as e:
        raise PeerError(f"llama-bench {exe}: cannot run: {e.strerror or e}") from None
    except subprocess.TimeoutExpired:
        raise PeerError(f"llama-bench {exe}: no result within {timeout_s:.0f} s ({' '.join(cmd)})") from None
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    if proc.returncode != 0:
        raise PeerError(f"llama-bench failed (exit status {proc.returncode}): {last or 'no message'} "
                        f"({' '.join(cmd)})")  # fmt: skip
    try:
        records = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise PeerError(f"llama-bench printed no JSON ({' '.join(cmd)}): {last or 'no message'}") from None
    run = PeerRun()
    for r in records if isinstance(records, list) else []:
        name = record_test(r) if isinstance(r, dict) else None
        if name and isinstance(r.get("samples_ts"), list):
            run.samples[name] = [float(x) for x in r["samples_ts"]]
            run.build = str(r.get("build_commit", ""))
    if not run.samples:
        raise PeerError(f"llama-bench gave no pp or tg record ({' '.join(cmd)})")
    return run


def attach(rows: Sequence[dict], runs: Sequence[PeerRun]) -> None:
    """Give each of one config's rows its peer's figures: ``peer`` (llama.cpp and its build),
    ``peer_tokens_per_s`` (the mean of every sample of ``runs``), ``peer_runs_tokens_per_s``
    (each run's mean) and ``vs_peer`` (ours / the peer's). A test the peer did not report
    raises PeerError: a ratio against nothing would read as a result."""
    for row in rows:
        per_run = [r.samples.get(row["test"]) for r in runs]
        if not all(per_run):
            raise PeerError(f"llama-bench reported no {row['test']} for {row['devices']}")
        flat = [x for s in per_run for x in s]
        row["peer"] = f"llama.cpp {runs[0].build}".strip()
        row["peer_tokens_per_s"] = sum(flat) / len(flat)
        row["peer_runs_tokens_per_s"] = [sum(s) / len(s) for s in per_run]
        row["vs_peer"] = row["tokens_per_s"] / row["peer_tokens_per_s"]


def executable(path: str) -> bool:
    """Whether ``path`` is a file this process may execute."""
    return os.path.isfile(path) and os.access(path, os.X_OK)
