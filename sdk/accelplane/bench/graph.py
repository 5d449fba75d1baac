"""``accelplane bench graph``: a graph built with the public host API (the BERT-style encoder of
:mod:`accelplane.models.bert`) through the Scheduler on each device, beside PyTorch float32 eager
with the same weights and inputs in the same run (engines alternated), with the ratio and the
two results' agreement."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from accelplane.errors import DeviceError, ShapeError
from accelplane.models.bert import PRESETS, build_encoder, random_batch, random_weights, torch_encoder
from accelplane.runtime.alloc import alloc_ctx_tensors
from accelplane.runtime.backend import Device
from accelplane.sched import Scheduler

BATCH, SEQ = 16, 62


def torch_device(dev: Device) -> str | None:
    """The PyTorch device that is this device's peer: the same CUDA GPU, else the CPU; None when
    torch is not installed."""
    try:
        import torch
    except ImportError:
        return None
    if dev.plugin.name == "cuda" and torch.cuda.is_available():
        return f"cuda:{int(dev.name.removeprefix('CUDA') or 0)}"
    return "cpu"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def bench_graph(preset: str, devices: Sequence[Device], reps: int = 10, batch: int = BATCH, seq: int = SEQ,
                progress: Callable[[str], None] | None = None) -> list[dict]:  # fmt: skip
    """One row per device: ms per batch (median of ``reps``, inputs set and the result read
    back included, as for the peer), the first compute's seconds (planning, kernel compilation),
    torch's ms on its peer device, ``speedup`` = torch ms / ours, and the largest difference of
    the pooled outputs relative to the largest value."""
    if preset not in PRESETS:
        raise ShapeError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    cfg = PRESETS[preset]
    weights = random_weights(cfg)
    ids, mask = random_batch(cfg, batch, seq)
    rows = []
    for dev in devices:
        say = progress or (lambda _m: None)
        say(f"{dev.name}: build and load {preset}")
        enc = build_encoder(cfg, batch, seq)
        graph = enc.ctx.graph(enc.out)
        sched = Scheduler.from_devices([dev])
        try:
            alloc_ctx_tensors(enc.ctx, dev.buffer_type)
            for name, t in enc.weights.items():
                t.set(weights[name])

            def ours(enc=enc, sched=sched, graph=graph) -> np.ndarray:
                for t, v in enc.inputs(ids, mask).items():
                    t.set(v)
                sched.compute(graph)
                return enc.out.get().reshape(batch, -1)

            say(f"{dev.name}: first compute")
            t0 = time.perf_counter()
            result = ours()
            first_s = time.perf_counter() - t0
            ours()  # untimed: a plugin may capture the graph on its second run (CUDA graphs)
            on_device = sum(b is sched.backends[0] for _, b in sched.placement())
            tdev = torch_device(dev)
            peer = torch_encoder(cfg, weights, tdev) if tdev else None
            if peer is not None:
                want = peer(ids, mask)
                _sync(tdev)
            t_ours, t_peer = [], []
            for r in range(reps):
                say(f"{dev.name}: rep {r + 1}/{reps}")
                t0 = time.perf_counter()
                ours()
                t_ours.append(time.perf_counter() - t0)
                if peer is not None:
                    t0 = time.perf_counter()
                    peer(ids, mask)
                    _sync(tdev)
                    t_peer.append(time.perf_counter() - t0)
        finally:
            sched.free()
            for b in {id(t.buffer): t.buffer for t in enc.weights.values() if t.buffer}.values():
                b.free()
        ms = statistics.median(t_ours) * 1e3
        row = {"device": dev.name, "preset": preset, "batch": batch, "seq": seq, "ms": ms,
               "spread_pct": 100 * (max(t_ours) - min(t_ours)) / min(t_ours), "first_s": first_s,
               "nodes": len(graph.nodes), "nodes_on_device": on_device,
               "torch_device": tdev, "torch_ms": None, "speedup": None, "max_rel_diff": None}  # fmt: skip
        if peer is not None:
            row["torch_ms"] = statistics.median(t_peer) * 1e3
            row["speedup"] = row["torch_ms"] / ms
            row["max_rel_diff"] = float(np.abs(result - want).max() / np.abs(want).max())
        rows.append(row)
    if not rows:
        raise DeviceError("bench graph: no device to run on")
    return rows


def format_graph(rows: list[dict]) -> str:
    head = (f"{'device':<10} {'preset':<10} {'batch x seq':>11} {'ms':>9} {'first s':>8} {'on device':>10} "
            f"{'torch':>7} {'torch ms':>9} {'vs torch':>9} {'max diff':>9}")  # fmt: skip
    out = [head]
    for r in rows:
        on = f"{r['nodes_on_device']}/{r['nodes']}"
        if r["torch_ms"] is None:
            peer = f"{'-':>7} {'-':>9} {'-':>9} {'-':>9}"
        else:
            peer = (f"{r['torch_device']:>7} {r['torch_ms']:>9.2f} {r['speedup']:>8.2f}x "
                    f"{r['max_rel_diff']:>9.1e}")  # fmt: skip
        out.append(f"{r['device']:<10} {r['preset']:<10} {r['batch']:>5} x {r['seq']:<3} {r['ms']:>9.2f} "
                   f"{r['first_s']:>8.2f} {on:>10} {peer}")  # fmt: skip
    return "\n".join(out)
