"""Benchmarks (``accelplane bench …``): op perf in the manner of test-backend-ops' perf mode,
and the per-node host overhead of replaying a plan. Results are tables and JSON; ratios
against peers are computed by whoever runs both (see docs/benchmarks.md)."""

from __future__ import annotations

import json
import platform
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import numpy as np

from .backend import Device
from .graph import Context
from .ops import op_bytes, op_flops
from .tensor import Tensor
from .types import GGMLType

T = GGMLType


@dataclass
class PerfCase:
    name: str
    build: Callable[[Context], Tensor]
    nodes_per_graph: int = 1  # nodes the graph repeats (per-node figures divide by it)


@dataclass
class PerfResult:
    device: str
    case: str
    runs: int
    us_per_run: float
    gflops: float | None
    gbps: float | None


def random_rows(t: Tensor, rng: np.random.Generator) -> None:
    """Fill a tensor with random data fast: random bytes with finite, small block scales for
    quantized types (quantizing gigabytes of floats would dominate a benchmark's setup)."""
    if not t.type.is_quantized:
        t.set(rng.uniform(-1, 1, t.shape).astype(np.float32))
        return
    raw = rng.integers(0, 256, (t.nrows, t.row_bytes), dtype=np.uint8)
    bs = t.type.type_size
    blocks = raw.reshape(t.nrows, -1, bs)
    scale = rng.uniform(1e-3, 2e-2, blocks.shape[:2]).astype(np.float16).view(np.uint8)
    scale = scale.reshape(*blocks.shape[:2], 2)
    if t.type in (T.Q8_0, T.Q4_0):
        blocks[:, :, 0:2] = scale
    elif t.type == T.Q4_K:
        blocks[:, :, 0:2] = scale
        blocks[:, :, 2:4] = scale
    elif t.type == T.Q6_K:
        blocks[:, :, 208:210] = scale
    t.set_bytes(raw.reshape(-1))


def matmul_case(ta: GGMLType, m: int, n: int, k: int) -> PerfCase:
    def build(ctx: Context) -> Tensor:
        a = ctx.new_tensor_ne(ta, k, m, name="a")
        b = ctx.new_tensor_ne(T.F32, k, n, name="b")
        return ctx.mul_mat(a, b)

    return PerfCase(f"MUL_MAT(type_a={ta.name.lower()},m={m},n={n},k={k})", build)


def overhead_case(n_nodes: int = 1000, ne0: int = 16) -> PerfCase:
    """A chain of ``n_nodes`` tiny elementwise ops: measures per-node host cost."""

    def build(ctx: Context) -> Tensor:
        x = ctx.new_tensor_ne(T.F32, ne0, name="x")
        y = ctx.new_tensor_ne(T.F32, ne0, name="y")
        t = x
        for i in range(n_nodes):
            t = (ctx.add, ctx.mul, ctx.sub)[i % 3](t, y) if i % 4 else ctx.scale(t, 0.999)
        return t

    return PerfCase(f"CHAIN(n_nodes={n_nodes},ne0={ne0})", build, n_nodes)


SETS: dict[str, Callable[[], list[PerfCase]]] = {
    "matmul": lambda: [matmul_case(t, 4096, n, 14336)
                       for n in (1, 512) for t in (T.F32, T.F16, T.Q8_0, T.Q4_0, T.Q4_K)],
    "small": lambda: [matmul_case(t, 4096, n, 4096) for n in (1, 32)
                      for t in (T.F32, T.Q8_0, T.Q4_0)] + [overhead_case()],
    "overhead": lambda: [overhead_case()],
}  # fmt: skip
SETS["default"] = lambda: SETS["matmul"]() + [overhead_case()]


def run_case(dev: Device, case: PerfCase, min_time: float = 1.0, seed: int = 0) -> PerfResult:
    """Warm up once, then repeat graph_compute until ``min_time`` seconds have passed."""
    from .alloc import GraphAllocator, alloc_ctx_tensors

    ctx = Context(case.name)
    out = case.build(ctx)
    graph = ctx.graph(out)
    for n in graph.nodes:
        if not dev.supports_op(n):
            raise RuntimeError(f"{dev.name} does not support {case.name}")
    wbuf = alloc_ctx_tensors(ctx, dev.buffer_type)
    galloc = GraphAllocator(dev.buffer_type)
    be = dev.new_backend()
    try:
        galloc.alloc_graph(graph)
        rng = np.random.default_rng(seed)
        for t in graph.leafs:
            random_rows(t, rng)
        be.compute(graph)  # warm-up (plans, caches)
        runs, t0 = 0, time.perf_counter()
        while True:
            be.graph_compute(graph)
            runs += 1
            if runs % 4 == 0 or runs < 4:
                be.synchronize()
                el = time.perf_counter() - t0
                if el >= min_time:
                    break
        be.synchronize()
        el = time.perf_counter() - t0
    finally:
        be.free()
        galloc.free()
        if wbuf is not None:
            wbuf.free()
    us = el / runs * 1e6 / case.nodes_per_graph
    flops = sum(op_flops(n) for n in graph.nodes)
    nbytes = sum(op_bytes(n) for n in graph.nodes)
    gflops = flops * runs / el / 1e9 if flops else None
    gbps = None if flops else nbytes * runs / el / 1e9
    return PerfResult(dev.name, case.name, runs, us, gflops, gbps)


def machine() -> dict:
    import os

    from .cpu.plugin import _cpu_name

    return {"cpu": _cpu_name(), "threads": os.cpu_count(), "python": platform.python_version(),
            "numpy": np.__version__, "date": time.strftime("%Y-%m-%d")}  # fmt: skip


def bench_ops(
    devices: Iterable[Device], set_name: str = "default", pattern: str | None = None,
    min_time: float = 1.0, progress: Callable[[str], None] | None = None,
) -> list[PerfResult]:  # fmt: skip
    cases = SETS[set_name]()
    if pattern:
        rx = re.compile(pattern)
        cases = [c for c in cases if rx.search(c.name)]
    out = []
    for dev in devices:
        for c in cases:
            if progress:
                progress(f"{dev.name}: {c.name}")
            out.append(run_case(dev, c, min_time))
    return out


def format_table(results: list[PerfResult]) -> str:
    lines = [f"{'device':<10} {'case':<50} {'runs':>6} {'us/run':>12} {'GFLOPS':>9} {'GB/s':>8}"]
    for r in results:
        gf = f"{r.gflops:9.1f}" if r.gflops is not None else f"{'':>9}"
        gb = f"{r.gbps:8.2f}" if r.gbps is not None else f"{'':>8}"
        lines.append(f"{r.device:<10} {r.case:<50} {r.runs:>6} {r.us_per_run:>12.2f} {gf} {gb}")
    return "\n".join(lines)


def to_json(results: list[PerfResult]) -> str:
    return json.dumps({"machine": machine(), "results": [asdict(r) for r in results]}, indent=1)


def bench_dispatch(n: int = 200_000) -> list[tuple[str, float]]:
    """Cost of one hook call three ways (µs): through pluggy's pm.hook (what the hot path
    avoids), through a handle's dispatch table (what the SDK does), and a direct call."""
    from .registry import get_registry

    reg = get_registry()
    dev = reg.device("CPU")
    ctx = Context()
    t = ctx.scale(ctx.new_tensor_ne(T.F32, 4), 2.0)
    fn = dev._fn["supports_op"]
    hook = reg.pm.hook.supports_op

    def timeit(f: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t0) / n * 1e6

    return [
        ("pm.hook.supports_op (all plugins, pluggy)", timeit(lambda: hook(device=dev, op=t))),
        ("Device.supports_op (dispatch table)", timeit(lambda: dev.supports_op(t))),
        ("plugin function called directly", timeit(lambda: fn(dev, t))),
    ]
