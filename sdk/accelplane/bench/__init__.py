"""Benchmarks (``accelplane bench …``): op perf in the manner of test-backend-ops' perf mode,
and the per-node host overhead of replaying a plan. Results are tables and JSON; ``bench model``
and ``bench graph`` run their peers (llama.cpp's llama-bench, PyTorch) in the same call and print
the ratios; the op tables' peers are run beside them (see docs/performance.md)."""

from __future__ import annotations

import json
import platform
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from accelplane.core.graph import Context
from accelplane.core.ops import VIEW_OPS, Op, op_bytes, op_flops
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType
from accelplane.errors import DeviceError
from accelplane.runtime.backend import Device

T = GGMLType


@dataclass
class PerfCase:
    name: str
    build: Callable[[Context], Tensor]
    nodes_per_graph: int = 1  # nodes the graph repeats (per-node figures divide by it)
    repeatable: bool = True  # the op may be repeated in one graph (test-backend-ops does)


@dataclass
class PerfResult:
    device: str
    case: str
    runs: int  # 0: the device does not support the case
    us_per_run: float | None
    gflops: float | None
    gbps: float | None


def random_rows(t: Tensor, rng: np.random.Generator, bound: int | None = None) -> None:
    """Fill a tensor with random data fast: random bytes with finite, small block scales for
    quantized types (quantizing gigabytes of floats would dominate a benchmark's setup); an
    index tensor (``bound``: the indexed extent) distinct indices along each row where the
    row is no longer than ``bound``, as a router's choice of experts is."""
    if bound is not None:
        rows, n = t.nelements // t.ne[0], t.ne[0]
        idx = (np.argsort(rng.random((rows, bound)), axis=1)[:, :n] if n <= bound
               else rng.integers(0, bound, (rows, n)))  # fmt: skip
        t.set(idx.astype(np.int32).reshape(t.shape))
        return
    if not t.type.is_quantized:
        t.set(rng.uniform(-1, 1, t.shape).astype(np.float32))
        return
    raw = rng.integers(0, 256, (t.nrows, t.row_bytes), dtype=np.uint8)
    bs = t.type.type_size
    blocks = raw.reshape(t.nrows, -1, bs)
    scale = rng.uniform(1e-3, 2e-2, blocks.shape[:2]).astype(np.float16).view(np.uint8)
    scale = scale.reshape(*blocks.shape[:2], 2)
    for off in t.type.traits.f16_fields:
        blocks[:, :, off : off + 2] = scale
    t.set_bytes(raw.reshape(-1))


def matmul_case(ta: GGMLType, m: int, n: int, k: int, tb: GGMLType = T.F32) -> PerfCase:
    def build(ctx: Context) -> Tensor:
        a = ctx.new_tensor_ne(ta, k, m, name="a")
        b = ctx.new_tensor_ne(tb, k, n, name="b")
        return ctx.mul_mat(a, b)

    tbs = "" if tb == T.F32 else f",type_b={tb.name.lower()}"
    return PerfCase(f"MUL_MAT(type_a={ta.name.lower()}{tbs},m={m},n={n},k={k})", build)


def mul_mat_id_case(ta: GGMLType, m: int, k: int, n_exp: int, n_used: int, n: int, b1: int = 1) -> PerfCase:
    """MUL_MAT_ID of ``n`` tokens, each through ``n_used`` of ``n_exp`` experts [k, m]; ``b1``
    activation rows per token (1: gate/up, shared by the slots; n_used: down)."""

    def build(ctx: Context) -> Tensor:
        a = ctx.new_tensor_ne(ta, k, m, n_exp, name="a")
        b = ctx.new_tensor_ne(T.F32, k, b1, n, name="b")
        ids = ctx.new_tensor_ne(T.I32, n_used, n, name="ids")
        return ctx.mul_mat_id(a, b, ids)

    return PerfCase(f"MUL_MAT_ID(type_a={ta.name.lower()},m={m},k={k},n_exp={n_exp},n_used={n_used},"
                    f"b1={b1},n={n})", build)  # fmt: skip


def _index_bounds(graph) -> dict[int, int]:
    """id(index tensor) → the extent it indexes, for the graph's MUL_MAT_ID and GET_ROWS."""
    out = {}
    for nd in graph.nodes:
        if nd.op is Op.MUL_MAT_ID:
            out[id(nd.src[2])] = nd.src[0].ne[2]
        elif nd.op is Op.GET_ROWS:
            out[id(nd.src[1])] = nd.src[0].ne[1]
    return out


def overhead_case(n_nodes: int = 1000, ne0: int = 16) -> PerfCase:
    """A chain of ``n_nodes`` tiny elementwise ops: measures per-node host cost."""

    def build(ctx: Context) -> Tensor:
        x = ctx.new_tensor_ne(T.F32, ne0, name="x")
        y = ctx.new_tensor_ne(T.F32, ne0, name="y")
        t = x
        for i in range(n_nodes):
            t = (ctx.add, ctx.mul, ctx.sub)[i % 3](t, y) if i % 4 else ctx.scale(t, 0.999)
        return t

    return PerfCase(f"CHAIN(n_nodes={n_nodes},ne0={ne0})", build, n_nodes, repeatable=False)


# weight types of published GGUF files beside those above (the matmul set's second part)
MORE_QUANT = (T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS)
SETS: dict[str, Callable[[], list[PerfCase]]] = {
    "matmul": lambda: [matmul_case(t, 4096, n, 14336)
                       for n in (1, 512) for t in (T.F32, T.F16, T.Q8_0, T.Q4_0, T.Q4_K)]
                      + [matmul_case(t, 4096, n, 14336) for n in (1, 512) for t in MORE_QUANT],
    "small": lambda: [matmul_case(t, 4096, n, 4096) for n in (1, 32)
                      for t in (T.F32, T.Q8_0, T.Q4_0)] + [overhead_case()],
    "overhead": lambda: [overhead_case()],
    # the F16 and BF16 GEMMs as cuBLAS sees them (activations already in the weights' type: no
    # conversion)
    "gemm": lambda: [matmul_case(t, 4096, 512, 14336, t) for t in (T.F16, T.BF16)],
    # experts of FFN 768 at d_model 2048, 8 used, 128 of them (qwen3-30b-a3b's; ggml's
    # test-backend-ops perf has the gate/up case): gate/up and down, a decode's token and a
    # prefill's 512
    "moe": lambda: [mul_mat_id_case(t, m, k, 128, 8, n, b1) for t in (T.Q4_0, T.Q4_K) for n in (1, 512)
                    for m, k, b1 in ((768, 2048, 1), (2048, 768, 8))],
}  # fmt: skip
SETS["default"] = lambda: SETS["matmul"]() + [overhead_case()]


def run_case(
    dev: Device, case: PerfCase, min_time: float = 1.0, seed: int = 0, repeat: int = 1
) -> PerfResult:
    """Warm up once, then repeat graph_compute until ``min_time`` seconds have passed. With
    ``repeat`` > 1 the op is built that many times into one graph, as test-backend-ops does, so
    launch costs don't hide a fast kernel; figures are per op. Each copy gets its own first
    source (the weights), so repeats read memory rather than a cache that one copy warmed."""
    from accelplane.runtime.alloc import GraphAllocator, alloc_ctx_tensors

    ctx = Context(case.name)
    out = case.build(ctx)
    outs = [out]
    if repeat > 1 and case.repeatable:
        for i in range(repeat - 1):
            srcs = list(out.src)
            if srcs and srcs[0] is not None and srcs[0].op is None:
                w = srcs[0]
                srcs[0] = ctx.new_tensor_ne(w.type, *w.ne, name=f"{w.name}#{i + 1}")
            outs.append(ctx._op(out.op, tuple(srcs), out.op_params))
    else:
        repeat = 1
    graph = ctx.graph(*outs)
    if not all(dev.supports_op(n) for n in graph.nodes if n.op not in VIEW_OPS):
        return PerfResult(dev.name, case.name, 0, None, None, None)
    wbuf = alloc_ctx_tensors(ctx, dev.buffer_type)
    galloc = GraphAllocator(dev.buffer_type)
    be = dev.new_backend()
    try:
        galloc.alloc_graph(graph)
        rng = np.random.default_rng(seed)
        bounds = _index_bounds(graph)
        for t in graph.leafs:
            random_rows(t, rng, bounds.get(id(t)))
        be.compute(graph)  # warm-up (plans, caches)
        # batches of runs ended by one synchronize, doubling: on an asynchronous device the host
        # queues a whole batch while the device works, so a fast kernel is not timed as the
        # host's cost of a launch plus a synchronize
        runs, batch, t0 = 0, 1, time.perf_counter()
        while True:
            for _ in range(batch):
                be.graph_compute(graph)
            be.synchronize()
            runs += batch
            el = time.perf_counter() - t0
            if el >= min_time:
                break
            batch = min(2 * batch, 256)
    finally:
        be.free()
        galloc.free()
        if wbuf is not None:
            wbuf.free()
    us = el / runs * 1e6 / case.nodes_per_graph / repeat
    flops = sum(op_flops(n) for n in graph.nodes)
    nbytes = sum(op_bytes(n) for n in graph.nodes)
    gflops = flops * runs / el / 1e9 if flops else None
    gbps = None if flops else nbytes * runs / el / 1e9
    return PerfResult(dev.name, case.name, runs, us, gflops, gbps)


def copy_bandwidth(device: Device, nbytes: int = 256 << 20, min_time_s: float = 0.3) -> float | None:
    """Bytes per second read plus written (STREAM's convention: copying N bytes moves 2N) by
    copies of ``nbytes`` between two tensors in ``device``'s memory, queued back to back on one
    of its backends (the plugin's cpy_tensor_async, as a graph's copies run; else the SDK's
    fallback, a blocking copy). The peer that memory-bound results (a decode's weight reads)
    are held against in the same run. Best of five batches of copies, each batch ended by a
    synchronize. None when the device cannot hold the two tensors."""
    from accelplane.errors import AccelplaneError
    from accelplane.runtime.alloc import alloc_tensors
    from accelplane.runtime.backend import tensor_copy_async

    free, _ = device.memory()
    nbytes = min(nbytes, max(free // 4, 0)) // 4 * 4
    if nbytes < 1 << 20:
        return None
    ctx = Context("copy-bandwidth")
    src = ctx.new_tensor(T.F32, (nbytes // 4,), "src")
    dst = ctx.new_tensor(T.F32, (nbytes // 4,), "dst")
    try:
        buf = alloc_tensors([src, dst], device.buffer_type)
    except AccelplaneError:
        return None
    backend = None
    try:
        backend = device.new_backend()
        src.set_bytes(np.full(nbytes, 1, np.uint8))
        tensor_copy_async(backend, backend, src, dst)  # warm-up
        backend.synchronize()
        k, best = 1, float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(k):
                tensor_copy_async(backend, backend, src, dst)
            backend.synchronize()
            dt = time.perf_counter() - t0
            best = min(best, dt / k)
            k = max(k, int(min_time_s / max(dt / k, 1e-9)))
        return 2 * nbytes / best
    finally:
        if backend is not None:
            backend.free()
        buf.free()


def machine() -> dict:
    from accelplane.cpu.host import cpu_name
    from accelplane.cpu.kernels import default_threads

    return {"cpu": cpu_name(), "threads": default_threads(), "python": platform.python_version(),
            "numpy": np.__version__, "date": time.strftime("%Y-%m-%d")}  # fmt: skip


def bench_ops(
    devices: Iterable[Device], set_name: str = "default", pattern: str | None = None,
    min_time: float = 1.0, progress: Callable[[str], None] | None = None, repeat: int | None = None,
) -> list[PerfResult]:  # fmt: skip
    """Every case of the set on every device. ``repeat``: ops per graph (default: 1 on CPU
    devices, 16 elsewhere, where a launch costs more than a small kernel)."""
    cases = SETS[set_name]()
    if pattern:
        rx = re.compile(pattern)
        cases = [c for c in cases if rx.search(c.name)]
    out = []
    for dev in devices:
        for c in cases:
            if progress:
                progress(f"{dev.name}: {c.name}")
            r = repeat if repeat is not None else (1 if dev.type.value == "CPU" else 16)
            out.append(run_case(dev, c, min_time, repeat=r))
    return out


def format_table(results: list[PerfResult]) -> str:
    lines = [f"{'device':<10} {'case':<50} {'runs':>6} {'us/run':>12} {'GFLOPS':>9} {'GB/s':>8}"]
    for r in results:
        if r.us_per_run is None:
            lines.append(f"{r.device:<10} {r.case:<50} {'not supported':>20}")
            continue
        gf = f"{r.gflops:9.1f}" if r.gflops is not None else f"{'':>9}"
        gb = f"{r.gbps:8.2f}" if r.gbps is not None else f"{'':>8}"
        lines.append(f"{r.device:<10} {r.case:<50} {r.runs:>6} {r.us_per_run:>12.2f} {gf} {gb}")
    return "\n".join(lines)


def to_json(results: list[PerfResult]) -> str:
    return json.dumps({"machine": machine(), "results": [asdict(r) for r in results]}, indent=1)


def bench_dispatch(n: int = 200_000) -> list[tuple[str, float]]:
    """Cost of one hook call three ways (µs): through pluggy's pm.hook (what the hot path
    avoids), through a handle's dispatch table (what the SDK does), and a direct call. A
    private registry holds only the CPU plugin, so pm.hook calls one implementation."""
    from accelplane.cpu import plugin as cpu_plugin
    from accelplane.runtime.registry import Registry

    reg = Registry()
    reg.register(cpu_plugin, "cpu")
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
        ("pm.hook.supports_op (pluggy, one plugin)", timeit(lambda: hook(device=dev, op=t))),
        ("Device.supports_op (dispatch table)", timeit(lambda: dev.supports_op(t))),
        ("plugin function called directly", timeit(lambda: fn(dev, t))),
    ]


def device_and_cpu(device: str | None) -> tuple[Device, Device]:
    """The device named ``device`` (default: the first device that is not a CPU) and the CPU
    device, from the registry. The asynchronous test device joins the registry with
    ``ACCELPLANE_EXTRA_PLUGINS=asynctest=accelplane.testing.asyncdev``."""
    from accelplane.interface import DeviceType
    from accelplane.runtime.registry import get_registry

    reg = get_registry()
    cpu = next((d for d in reg.devices if d.type == DeviceType.CPU), None)
    if cpu is None:
        raise DeviceError("no CPU device: the scheduler needs the built-in cpu plugin")
    if device is not None:
        return reg.device(device), cpu
    others = [d for d in reg.devices if d.type != DeviceType.CPU]
    if not others:
        raise DeviceError("this benchmark needs a device besides the CPU; none is installed (the "
                          "asynchronous test device: ACCELPLANE_EXTRA_PLUGINS=asynctest="
                          "accelplane.testing.asyncdev)")  # fmt: skip
    return others[0], cpu


def bench_sched(n_layers: int = 4, n_tokens: int = 32, runs: int = 20, device: str | None = None,
                progress: Callable[[str], None] | None = None) -> list[dict]:  # fmt: skip
    """Both sync policies on a llama-like layer graph split CPU/device (even layers' weights on
    the device, odd layers' on the CPU; user inputs on the CPU): host syncs per compute and
    wall time."""
    from accelplane.models.blocks import llama_layer
    from accelplane.runtime.alloc import alloc_tensors
    from accelplane.sched import Scheduler

    dev, cpu = device_and_cpu(device)
    out = []
    for policy in ("strict", "relaxed"):
        lg = llama_layer(d_model=256, n_head=8, n_kv_head=4, d_ff=512, n_tokens=n_tokens,
                         n_layers=n_layers)  # fmt: skip
        g = lg.ctx.graph(lg.out)
        rng = np.random.default_rng(0)
        on_dev = [w for w in lg.weights if int(w.name[1:].split(".")[0]) % 2 == 0]
        on_cpu = [w for w in lg.weights if w not in on_dev]
        wbufs = [alloc_tensors(on_dev, dev.buffer_type), alloc_tensors(on_cpu, cpu.buffer_type)]
        for t, v in lg.weight_values(rng).items():
            t.set(v)
        bd, bc = dev.new_backend(), cpu.new_backend()
        s = Scheduler([bd, bc], policy=policy)
        inputs = lg.inputs(rng)
        times, syncs = [], []
        for i in range(runs + 2):
            if progress:
                progress(f"sched {policy}: run {i + 1}/{runs + 2}")
            t0 = time.perf_counter()
            s.alloc_graph(g)
            for t, v in inputs.items():
                t.set(v)
            s.graph_compute(g)
            s.synchronize()
            if i >= 2:  # warm-up: planning, kernel plans
                times.append(time.perf_counter() - t0)
                syncs.append(s.stats.host_syncs)
        out.append({"policy": policy, "device": dev.name, "splits": s.stats.splits,
                    "copies": s.stats.copies, "syncs_per_compute": float(np.mean(syncs)),
                    "ms_per_compute": float(np.median(times) * 1e3)})  # fmt: skip
        s.free()
        bd.free()
        bc.free()
        for b in wbufs:
            if b is not None:
                b.free()
    return out


def _overlap(a: list[tuple[str, float, float]], b: list[tuple[str, float, float]]) -> float:
    """Seconds during which some interval of ``a`` and some interval of ``b`` both run."""
    tot = 0.0
    for _, s0, e0 in a:
        for _, s1, e1 in b:
            tot += max(0.0, min(e0, e1) - max(s0, s1))
    return tot


# bench moe's layer shapes: (d_model, expert FFN, experts, used, weight type)
MOE_SIZES = {"small": (512, 1024, 16, 4, T.F32), "a1b": (2048, 768, 64, 8, T.Q4_0)}  # a1b: qwen3moe 8b-a1b's


def bench_moe_prefetch(n_layers: int = 4, n_tokens: int = 64, runs: int = 5, prefetch: int = 3,
                       device: str | None = None, size: str = "small",
                       progress: Callable[[str], None] | None = None) -> list[dict]:  # fmt: skip
    """MoE layers (``size``: :data:`MOE_SIZES`) with experts in host memory computed on
    ``device`` (default: the first that is not a CPU), with and without expert prefetch on a
    second stream: wall time per compute and, where the device keeps a timeline of its work
    (Backend.timeline_begin: CUDA's timing events), the copies' time and how much of it ran
    while a compute did."""
    from accelplane.models.blocks import moe_layers
    from accelplane.runtime.alloc import alloc_tensors
    from accelplane.runtime.backend import BufferUsage
    from accelplane.sched import Scheduler

    d_model, d_ff, n_exp, n_used, wtype = MOE_SIZES[size]
    dev, cpu = device_and_cpu(device)
    out = []
    for pf in (0, prefetch):
        m = moe_layers(d_model=d_model, d_ff=d_ff, n_expert=n_exp, n_used=n_used, n_tokens=n_tokens,
                       n_layers=n_layers, wtype=wtype)  # fmt: skip
        g = m.ctx.graph(m.out)
        rng = np.random.default_rng(0)
        routers = [t for t in m.ctx.tensors if t.name.endswith("router")]
        b1 = alloc_tensors(routers, dev.buffer_type)
        # in the device's pinned host memory where it has some, as the models keep such experts
        b2 = alloc_tensors(m.experts, dev.host_buffer_type or cpu.buffer_type, BufferUsage.WEIGHTS)
        for t in routers:
            t.set((rng.standard_normal(t.shape) / np.sqrt(t.shape[-1])).astype(np.float32))
        for t in m.experts:
            random_rows(t, rng)
        bd, bc = dev.new_backend(), cpu.new_backend()
        s = Scheduler([bd, bc], prefetch_experts=pf)
        for n in m.mul_mat_ids:
            s.set_tensor_backend(n, bd)
        x = rng.standard_normal(m.x.shape).astype(np.float32)
        times = []
        overlap = copy_s = 0.0
        timed = True
        for i in range(runs + 1):
            if progress:
                progress(f"moe prefetch={pf}: run {i + 1}/{runs + 1}")
            streams = [bd, *s.prefetch_backends] if i else []  # (the prefetch streams exist after a run)
            began = [b for b in streams if b.timeline_begin()]
            timed = timed and len(began) == len(streams)
            t0 = time.perf_counter()
            s.alloc_graph(g)
            m.x.set(x)
            s.graph_compute(g)
            s.synchronize()
            el = time.perf_counter() - t0
            if i == 0:
                continue  # warm-up
            times.append(el)
            tl = [b.timeline_end() for b in began]
            if not timed:
                continue
            comp = [iv for iv in tl[0] if iv[0] == "compute"]
            copies = [iv for t in tl for iv in t if iv[0] == "copy"]
            overlap += _overlap(copies, comp)
            copy_s += sum(e - b for _, b, e in copies)
        out.append({"prefetch": pf, "device": dev.name, "ms_per_compute": float(np.median(times) * 1e3),
                    "copy_ms": copy_s / runs * 1e3 if timed else None,
                    "overlap_ms": overlap / runs * 1e3 if timed else None,
                    "prefetched": s.stats.prefetched,
                    "expert_MiB": s.stats.expert_bytes / 2**20,
                    "expert_MiB_all": s.stats.expert_bytes_total / 2**20})  # fmt: skip
        s.free()
        bd.free()
        bc.free()
        b1.free()
        b2.free()
    return out


# --- tensor parallelism ------------------------------------------------------------------------------
def parse_sizes(text: str) -> list[int]:
    """'4K,1M,1G' → sizes in bytes (K, M, G: powers of 1024; a trailing B is allowed)."""
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    out = []
    for part in text.split(","):
        p = part.strip().upper().removesuffix("B")
        try:
            out.append(int(p[:-1]) * mult[p[-1]] if p and p[-1] in mult else int(p))
        except ValueError:
            raise ValueError(f"bad size {part!r} (want e.g. 4K, 64M, 1G or bytes)") from None
        if out[-1] <= 0:
            raise ValueError(f"bad size {part!r}: must be positive")
    return out



def _tp_defaults(devices: Sequence[Device] | None) -> tuple[list[Device], list[int]]:
    """(devices, device counts): the devices of the first plugin with two or more non-CPU
    devices (counts 2..n), else the CPU device as 2 and 4 backends (a functional run, not a
    speed-up)."""
    from accelplane.interface import DeviceType
    from accelplane.runtime.registry import get_registry

    if devices:
        devs = list(devices)
        return devs, list(range(2, len(devs) + 1)) or [1]
    by_plugin: dict[str, list[Device]] = {}
    for d in get_registry().devices:
        if d.type != DeviceType.CPU:
            by_plugin.setdefault(d.plugin.name, []).append(d)
    for devs in by_plugin.values():
        if len(devs) >= 2:
            return devs, list(range(2, len(devs) + 1))
    cpu = get_registry().device("CPU")
    return [cpu] * 4, [2, 4]


def bench_tp(devices: Sequence[Device] | None = None, counts: Sequence[int] | None = None,
             sizes: Sequence[int] = (1 << 16, 1 << 20, 1 << 24),
             algorithms: Sequence[str] = ("butterfly", "ring", "plugin"), min_time: float = 0.2,
             layer=None, runs: int = 5, progress: Callable[[str], None] | None = None,
             peer: Sequence[dict] | None = None) -> dict[str, list[dict]]:  # fmt: skip
    """``accelplane bench tp``: per device count and all-reduce algorithm, the bus bandwidth
    (nccl-tests' 2(n-1)/n × bytes / time) beside a host memcpy of the same bytes in the same run
    (:func:`accelplane.parallel.comm.bench_allreduce`); and the tokens/s of a llama-like layer stack
    (:func:`~accelplane.models.blocks.llama_layer`) on the first device (split none) and
    tensor-split over the first n devices (``MetaDevice``). Devices and counts: see
    :func:`_tp_defaults`; ``layer``: a :class:`~accelplane.bench.tp.LayerParams` (default
    small on CPU devices, larger on others). ``peer``: another all-reduce's rows (``n``,
    ``bytes``, ``busbw_gbps``, ``dtype``; e.g. torch.distributed's, measured in the same run by
    ``python tools/cuda_peers.py --allreduce N``): each row of ours with the same device
    count and bytes gets ``vs_peer``, its bus bandwidth over the peer's (F32 peer rows only)."""
    from accelplane.bench.tp import LayerParams, layer_values, single, tensor_parallel
    from accelplane.interface import DeviceType
    from accelplane.parallel.comm import bench_allreduce

    devs, default_counts = _tp_defaults(devices)
    counts = list(counts or default_counts)
    on_cpu = devs[0].type == DeviceType.CPU
    if layer is None:
        small = dict(d_model=256, n_head=8, n_kv_head=4, d_ff=768, n_tokens=32, n_layers=4)
        big = dict(d_model=2048, n_head=16, n_kv_head=8, d_ff=5632, n_tokens=128, n_layers=4)
        layer = LayerParams(**(small if on_cpu else big))
    ar_rows: list[dict] = []
    for n in counts:
        if n < 2:
            continue
        backends = [devs[i % len(devs)].new_backend() for i in range(n)]
        if progress:
            progress(f"tp: all-reduce over {n} backends")
        try:
            for r in bench_allreduce(backends, sizes, algorithms, min_time_s=min_time):
                row = asdict(r)
                row["devices"] = ",".join(b.device.name for b in backends)
                row["vs_memcpy"] = r.busbw_gbps / r.memcpy_gbps if r.used else float("nan")
                match = [p for p in peer or () if p["n"] == n and p["bytes"] == r.bytes
                         and p.get("dtype", "float32") in ("float32", "F32")]  # fmt: skip
                if match and r.used:
                    row["peer_busbw_gbps"] = match[0]["busbw_gbps"]
                    row["vs_peer"] = r.busbw_gbps / match[0]["busbw_gbps"]
                ar_rows.append(row)
        finally:
            for b in backends:
                b.free()
    weights, inputs = layer_values(layer.build(), seed=0)

    def timed(run, label: str) -> float:
        """Median seconds of a forward (the first run, which plans and allocates, not counted)."""
        times = []
        for i in range(runs + 1):
            if progress:
                progress(f"tp: {label} run {i + 1}/{runs + 1}")
            t0 = time.perf_counter()
            run(inputs)
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))

    layer_rows: list[dict] = []
    base = single(devs[0], layer, weights)
    sec = timed(base, "split none")
    base.free()
    ref_tps = layer.n_tokens / sec
    desc = f"{layer.n_layers} layers, d_model {layer.d_model}, {layer.n_tokens} tokens, {layer.wtype.name}"
    layer_rows.append({"devices": devs[0].name, "n": 1, "split": "none", "layers": desc,
                       "ms_per_forward": sec * 1e3, "tokens_per_s": ref_tps, "speedup": 1.0})  # fmt: skip
    for n in counts:
        run = tensor_parallel([devs[i % len(devs)] for i in range(n)], layer, weights)
        sec = timed(run, f"split tensor x{n}")
        names = ",".join(d.name for d in run.meta.devices)
        layer_rows.append({"devices": names, "n": n, "split": "tensor", "layers": desc,
                           "ms_per_forward": sec * 1e3, "tokens_per_s": layer.n_tokens / sec,
                           "speedup": layer.n_tokens / sec / ref_tps,
                           "allreduces": run.meta.stats.allreduces,
                           "comm": ",".join(sorted(run.meta.stats.algorithms))})  # fmt: skip
        run.meta.free()
    return {"allreduce": ar_rows, "layers": layer_rows, "peer": list(peer or [])}


def format_tp(res: dict[str, list[dict]]) -> str:
    has_peer = any("vs_peer" in r for r in res["allreduce"])
    lines = ["all-reduce: bus bandwidth and a host memcpy of the same bytes, same run"
             + (" (vs peer: over the peer's bus bandwidth at the same bytes)" if has_peer else ""),
             f"{'n':>2} {'algorithm':<10} {'used':<10} {'bytes':>10} {'us/call':>10} {'busbw GB/s':>11} "
             f"{'memcpy GB/s':>12} {'ratio':>7}" + (f" {'vs peer':>8}" if has_peer else "")
             + "  devices"]  # fmt: skip
    for r in res["allreduce"]:
        if not r["used"]:
            lines.append(f"{r['n']:>2} {r['algorithm']:<10} {'-':<10} {r['bytes']:>10} {'n/a':>10}"
                         f"{'':>13}{r['memcpy_gbps']:>13.2f} {'':>7}  {r['note'][:60]}")  # fmt: skip
            continue
        vs = (f" {r['vs_peer']:>8.3f}" if "vs_peer" in r else f" {'':>8}") if has_peer else ""
        lines.append(f"{r['n']:>2} {r['algorithm']:<10} {r['used']:<10} {r['bytes']:>10} "
                     f"{r['us_per_call']:>10.1f} {r['busbw_gbps']:>11.2f} {r['memcpy_gbps']:>12.2f} "
                     f"{r['vs_memcpy']:>7.3f}{vs}  {r['devices']}")  # fmt: skip
    if res.get("peer"):
        lines += ["", "peer all-reduce (same run)", f"{'n':>2} {'peer':<18} {'dtype':<9} {'bytes':>10} "
                  f"{'us/call':>10} {'busbw GB/s':>11}"]  # fmt: skip
        for p in res["peer"]:
            lines.append(f"{p['n']:>2} {p.get('algorithm', 'peer')[:18]:<18} {p.get('dtype', ''):<9} "
                         f"{p['bytes']:>10} {p['us_per_call']:>10.1f} {p['busbw_gbps']:>11.2f}")  # fmt: skip
    lines += ["", f"llama-like layer stack ({res['layers'][0]['layers']})",
              f"{'split':<7} {'n':>2} {'ms/forward':>11} {'tokens/s':>10} {'speedup':>8}  "
              "devices"]  # fmt: skip
    for r in res["layers"]:
        lines.append(f"{r['split']:<7} {r['n']:>2} {r['ms_per_forward']:>11.2f} {r['tokens_per_s']:>10.1f} "
                     f"{r['speedup']:>8.2f}  {r['devices']}")  # fmt: skip
    return "\n".join(lines)
