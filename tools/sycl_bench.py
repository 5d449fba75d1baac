#!/usr/bin/env python3
"""The SYCL plugin's benchmarks: copy/compute overlap with two queues against one shared queue,
and the two-device all-reduce's bytes and time per call, F32 against BF16 on the wire.

    python tools/sycl_bench.py [--json FILE] [--reps N] [--quick]

Overlap: backend A computes a MUL_MAT graph (oneMKL through dpnp, or the plugin's own k_mul_mat
kernel) while a large tensor is copied (USM host → device, or device → device). "two queues":
the copy runs on backend B, a second Backend of the same device (its own in-order queue), and A
joins it with event_record(B) + event_wait(A) (a device-side barrier); "one queue": compute and
copy on A, one after the other. Each row's time is the wall time from the first submission to
A.synchronize() returning (the median of ``reps`` runs, the two pipelines interleaved); "serial"
is compute alone + copy alone, "ideal" the longer of the two.

All-reduce: two logical devices of the one SYCL device (ACCELPLANE_SYCL_DEVICES=0,0 unless set),
one comm; the bytes each rank sends per call (the comm's own count, checked against 4 or 2 bytes
per element) and the wall time of one call until both backends are synchronized. Sizes at and
above the BF16 threshold also run with the threshold raised, so F32 and BF16 compare at one size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import numpy as np

# MUL_MAT shapes (m weight rows, k, n activation rows), sized so that compute and copy take times
# of one order on the 2-core development machine: oneMKL 2.1 GFLOP, the own kernel 0.27 GFLOP
DEFAULT_MATMUL = {"onemkl": (4096, 4096, 64), "kernel": (1024, 4096, 32)}
DEFAULT_COPY_MB = 256
DEFAULT_SIZES = (32767, 32768, 1 << 20, 1 << 22)


def open_devices() -> list[Any]:
    """The SYCL plugin's devices in a registry of their own (main() asks for two logical
    devices, ACCELPLANE_SYCL_DEVICES=0,0, unless the variable says otherwise)."""
    import accelplane_sycl.plugin as plugin
    from accelplane.runtime.registry import Registry

    reg = Registry()
    reg.register(plugin, "sycl")
    devs = reg.devices_of("sycl")
    if not devs:
        why = [f.reason for f in reg.failures if f.name == "sycl"]
        raise SystemExit(f"no SYCL device: {why[0] if why else 'plugin not registered'}")
    return devs


def machine(dev: Any) -> dict:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        up = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        up = ""
    import dpctl

    try:
        import dpnp

        dpnp_v = dpnp.__version__
    except Exception:
        dpnp_v = None
    d = dev.ctx.dev
    return {"cpu": cpu, "cores": os.cpu_count(), "uptime": up, "loadavg": list(os.getloadavg()),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
            "dpctl": dpctl.__version__, "dpnp": dpnp_v,
            "sycl_device": f"{d.name} ({d.filter_string}, driver {d.driver_version})"}  # fmt: skip


@contextmanager
def _onemkl(dev: Any, on: bool):
    """Plans built inside use oneMKL (dpnp) for MUL_MAT when ``on``, the own kernel otherwise."""
    saved = dev.runtime._onemkl
    if not on:
        dev.runtime._onemkl = False
    try:
        yield
    finally:
        dev.runtime._onemkl = saved


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


# --- copy / compute overlap ----------------------------------------------------------------------
def bench_overlap(
    dev: Any, gemm: str = "onemkl", copy: str = "h2d", reps: int = 5,
    mkn: tuple[int, int, int] | None = None, copy_mb: int = DEFAULT_COPY_MB,
) -> dict:  # fmt: skip
    """One row: compute alone, copy alone, and the copy + compute pipeline on one queue and on
    two queues (medians over ``reps``, in ms)."""
    from accelplane.runtime.backend import tensor_copy_async

    if gemm == "onemkl" and dev.runtime.onemkl() is None:
        return {"gemm": gemm, "copy": copy, "skipped": "dpnp (oneMKL) is not installed"}
    m, k, n = mkn or DEFAULT_MATMUL[gemm]
    nel = copy_mb * (1 << 20) // 4
    a, b, y, g, src, dst, sv, bufs = _overlap_tensors(dev, copy, m, k, n, nel)
    ba, bb = dev.new_backend(), dev.new_backend()
    ev = dev.new_event()

    def copy_on(be: Any) -> None:
        if not tensor_copy_async(be, be, src, dst):
            raise RuntimeError("cpy_tensor_async refused the copy: the benchmark needs the async path")

    def compute_alone() -> float:
        t0 = time.perf_counter()
        ba.graph_compute(g)
        ba.synchronize()
        return _ms(t0)

    def copy_alone() -> float:
        t0 = time.perf_counter()
        copy_on(bb)
        bb.synchronize()
        return _ms(t0)

    def one_queue() -> float:
        t0 = time.perf_counter()
        ba.graph_compute(g)
        copy_on(ba)
        ba.synchronize()
        return _ms(t0)

    def two_queues() -> float:
        t0 = time.perf_counter()
        ba.graph_compute(g)
        copy_on(bb)
        ev.record(bb)
        ev.wait(ba)  # device-side join: A's later work waits for B's copy
        ev.synchronize()  # the host only watches when the copy is done; the device work is the same
        copy_done.append(_ms(t0))
        ba.synchronize()  # after it, the copy is complete too (ordering rule 7)
        return _ms(t0)

    with _onemkl(dev, gemm == "onemkl"):
        ba.compute(g)  # the plan (kernel build, dpnp import) outside the timed runs
    want = b.get().astype(np.float64) @ a.get().astype(np.float64).T
    np.testing.assert_allclose(y.get(), want, rtol=2e-3, atol=2e-3)
    copy_alone()  # first touch of the destination pages
    copy_done: list[float] = []
    fns = {"compute": compute_alone, "copy": copy_alone, "one_queue": one_queue, "two_queues": two_queues}

    def check(name: str) -> None:
        if name in ("one_queue", "two_queues") and not np.array_equal(dst.get(), sv):
            raise AssertionError(f"{name}: the copy was not complete when synchronize returned")

    runs = _interleaved(fns, reps, lambda: dst.buffer.memset_tensor(dst, 0), check)
    row = _overlap_row(gemm, copy, (m, k, n), 4 * nel, reps, runs, copy_done)
    ev.free()
    ba.free()
    bb.free()
    for buf in bufs:
        buf.free()
    return row


def _overlap_tensors(dev: Any, copy: str, m: int, k: int, n: int, nel: int) -> tuple:
    """(a, b, y = mul_mat(a, b), its graph, src, dst, src's values, buffers): the MUL_MAT's
    operands set, src in host memory (h2d) or device memory (d2d)."""
    from accelplane.core.graph import Context
    from accelplane.core.types import GGMLType as T
    from accelplane.runtime.alloc import alloc_tensors

    rng = np.random.default_rng(0)
    ctx = Context()
    a = ctx.new_tensor(T.F32, (m, k), "a")
    b = ctx.new_tensor(T.F32, (n, k), "b")
    y = ctx.mul_mat(a, b)
    g = ctx.graph(y)
    src = ctx.new_tensor(T.F32, (nel,), "src")
    dst = ctx.new_tensor(T.F32, (nel,), "dst")
    bufs = [alloc_tensors([a, b, y, dst], dev.buffer_type),
            alloc_tensors([src], dev.host_buffer_type if copy == "h2d" else dev.buffer_type)]  # fmt: skip
    a.set(rng.standard_normal((m, k), np.float32))
    b.set(rng.standard_normal((n, k), np.float32))
    sv = rng.standard_normal(nel, np.float32)
    src.set(sv)
    return a, b, y, g, src, dst, sv, bufs


def _interleaved(fns: dict[str, Callable[[], float]], reps: int, before: Callable[[], None],
                 after: Callable[[str], None]) -> dict[str, list[float]]:  # fmt: skip
    """``reps`` times of each of ``fns``: all back to back, the order flipped every rep (the load
    of other jobs drifts slowly, so the ratio of a rep's one-queue and two-queue runs is steadier
    than either time); ``before`` runs ahead of each, ``after(name)`` checks its result."""
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(reps):
        for name in list(fns) if i % 2 == 0 else list(reversed(fns)):
            before()
            runs[name].append(fns[name]())
            after(name)
    return runs


def _overlap_row(gemm: str, copy: str, mkn: tuple[int, int, int], copy_bytes: int, reps: int,
                 runs: dict[str, list[float]], copy_done: list[float]) -> dict:  # fmt: skip
    """The medians, serial and ideal times and the one/two-queue speedup of ``runs`` (ms)."""
    m, k, n = mkn
    med = {name: statistics.median(v) for name, v in runs.items()}
    ratios = [o / t for o, t in zip(runs["one_queue"], runs["two_queues"], strict=True)]
    row = {"gemm": gemm, "copy": copy, "m": m, "k": k, "n": n, "copy_bytes": copy_bytes, "reps": reps,
           **{f"{name}_ms": round(v, 2) for name, v in med.items()},
           "copy_done_two_queues_ms": round(statistics.median(copy_done), 2),
           "runs_ms": {name: [round(x, 2) for x in v] for name, v in runs.items()},
           "copy_done_runs_ms": [round(x, 2) for x in copy_done]}  # fmt: skip
    row["serial_ms"] = round(med["compute"] + med["copy"], 2)
    row["ideal_ms"] = round(max(med["compute"], med["copy"]), 2)
    row["speedup"] = round(statistics.median(ratios), 3)  # median of the per-rep ratios one / two
    row["speedup_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    return row


# --- the two-device all-reduce --------------------------------------------------------------------
def bench_allreduce(d0: Any, d1: Any, sizes: tuple[int, ...] = DEFAULT_SIZES, reps: int = 5) -> list[dict]:
    """Per size and path: bytes each rank sends per call, and the median wall time of one call
    until both backends are synchronized."""
    import ml_dtypes
    from accelplane.core.graph import Context
    from accelplane.core.types import GGMLType as T
    from accelplane.runtime.alloc import alloc_tensors
    from accelplane.runtime.backend import Comm
    from accelplane_sycl import comm as sycl_comm

    b0, b1 = d0.new_backend(), d1.new_backend()
    comm = Comm.init([b0, b1])
    if comm is None:
        raise RuntimeError("comm_init returned None: the plugin's all-reduce needs two SYCL devices")
    rng = np.random.default_rng(1)
    rows = []
    threshold = sycl_comm.BF16_MIN_ELEMENTS
    for n in sizes:
        ctx = Context()
        ts = [ctx.new_tensor(T.F32, (n,), f"x{r}") for r in range(2)]
        bufs = [alloc_tensors([ts[0]], d0.buffer_type), alloc_tensors([ts[1]], d1.buffer_type)]
        vals = [rng.standard_normal(n, np.float32) for _ in range(2)]
        paths = ["default"] + (["forced F32"] if n >= threshold else [])
        for path in paths:
            if path == "forced F32":
                sycl_comm.BF16_MIN_ELEMENTS = n + 1
            try:
                times = []
                for i in range(reps + 1):  # the first call warms up (scratch growth, kernel builds)
                    for t, v in zip(ts, vals, strict=True):
                        t.set(v)
                    t0 = time.perf_counter()
                    assert comm.allreduce(ts)
                    b0.synchronize()
                    b1.synchronize()
                    if i:
                        times.append(_ms(t0))
                wire = comm.ctx.wire_bytes
            finally:
                sycl_comm.BF16_MIN_ELEMENTS = threshold
            got = ts[0].get()
            bf16 = wire == 2 * n
            if bf16:
                want = sum(v.astype(ml_dtypes.bfloat16).astype(np.float32) for v in vals)
            else:
                want = vals[0] + vals[1]
            if not np.array_equal(got, want) or not np.array_equal(got, ts[1].get()):
                raise AssertionError(f"all-reduce of {n} elements ({path}) gave a wrong sum")
            assert wire in (2 * n, 4 * n), f"unexpected wire bytes {wire} for {n} elements"
            ms = statistics.median(times)
            rows.append({"elements": n, "path": path, "wire": "BF16" if bf16 else "F32",
                         "bytes_per_rank": wire, "bytes_per_element": wire / n, "ms": round(ms, 3),
                         "tensor_gb_s": round(4 * n / (ms * 1e-3) / 1e9, 3),
                         "runs_ms": [round(x, 3) for x in times]})  # fmt: skip
        for buf in bufs:
            buf.free()
    comm.free()
    b0.free()
    b1.free()
    return rows


# --- output ------------------------------------------------------------------------------------------
def format_overlap(rows: list[dict]) -> str:
    out = ["| MUL_MAT F32 (m×k, n rows) | copy | compute alone | copy alone | one queue | two queues | "
           "copy done (two queues) | speedup one/two (min–max) |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['gemm']} | {r['copy']} | skipped: {r['skipped']} ||||||")
            continue
        lo, hi = r["speedup_range"]
        out.append(f"| {r['gemm']} {r['m']}×{r['k']}, {r['n']} | {r['copy']} {r['copy_bytes'] >> 20} MiB | "
                   f"{r['compute_ms']:.1f} ms | {r['copy_ms']:.1f} ms | {r['one_queue_ms']:.1f} ms | "
                   f"{r['two_queues_ms']:.1f} ms | {r['copy_done_two_queues_ms']:.1f} ms | "
                   f"{r['speedup']:.2f}× ({lo:.2f}–{hi:.2f}) |")  # fmt: skip
    return "\n".join(out)


def format_allreduce(rows: list[dict]) -> str:
    out = ["| elements | path | on the wire | bytes sent per rank | bytes/element | ms per call | "
           "tensor GB/s |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r['elements']} | {r['path']} | {r['wire']} | {r['bytes_per_rank']} | "
                   f"{r['bytes_per_element']:g} | {r['ms']:.3f} | {r['tensor_gb_s']:.2f} |")  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/sycl_bench.py", description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the machine, the rows and every run's time to this file")
    ap.add_argument("--reps", type=int, default=9, help="timed runs per row (default 9; medians)")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test, not a measurement)")
    args = ap.parse_args(argv)
    os.environ.setdefault("ACCELPLANE_SYCL_DEVICES", "0,0")  # this process's own default
    devs = open_devices()
    d0 = devs[0]
    mkn, copy_mb, sizes = None, DEFAULT_COPY_MB, DEFAULT_SIZES
    if args.quick:
        mkn, copy_mb, sizes = (128, 512, 8), 4, (1000, 32768)
    info = machine(d0)
    print(f"# {info['sycl_device']}\n# {info['cpu']}, {info['cores']} cores; {info['uptime']}")
    overlap = [bench_overlap(d0, gemm, copy, args.reps, mkn, copy_mb)
               for gemm in ("onemkl", "kernel") for copy in ("h2d", "d2d")]  # fmt: skip
    print(f"\ncopy/compute overlap, F32 MUL_MAT, medians of {args.reps}:")
    print(format_overlap(overlap))
    allreduce: list[dict] = []
    if len(devs) >= 2:
        allreduce = bench_allreduce(devs[0], devs[1], sizes, args.reps)
        print(f"\nall-reduce over {devs[0].name} + {devs[1].name}, medians of {args.reps}:")
        print(format_allreduce(allreduce))
    else:
        print("\nall-reduce: skipped (one SYCL device; ACCELPLANE_SYCL_DEVICES=0,0 opens it as two)")
    info["uptime_after"] = machine(d0)["uptime"]
    print(f"\n# after: {info['uptime_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "overlap": overlap, "allreduce": allreduce}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
