"""The graph allocator keeps what a graph's outputs are, views included: random graphs (chains
of unary, binary, MUL_MAT, SOFT_MAX, NORM and CONT nodes with reshape, permute, transpose and
offset/strided views, views of views) whose outputs are several tensors, views of
intermediates and views of inputs among them, computed on the CPU plugin, on the asynchronous
test device, through the Scheduler (CPU + the test device, nodes pinned at random so the graph
splits and copies), on a tensor-parallel meta device, and on every installed plugin — every
output against the float64 oracle; plus the reproductions of a view output losing its memory
and fixed corners (including what the random graphs found elsewhere: MUL(norm, norm) fused
away, SYCL's dot-shaped products read too early, a meta-device VIEW of a gathered strided view).

ACCELPLANE_FUZZ=long runs many more examples (tests/fuzzing.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import accelplane
import numpy as np
import pytest
from accelplane.conformance.runner import graph_supported
from accelplane.core.graph import Context, Graph
from accelplane.core.ops import VIEW_OPS, Op, can_repeat
from accelplane.core.tensor import Tensor, TensorFlag
from accelplane.core.types import GGMLType
from accelplane.interface import DeviceType
from accelplane.oracle import reference
from accelplane.oracle.compare import compare, nmse
from accelplane.parallel.meta import MetaDevice, SplitState
from accelplane.runtime.alloc import GraphAllocator, alloc_ctx_tensors
from accelplane.runtime.backend import Backend, Device
from accelplane.sched import Scheduler
from accelplane.testing.plugins import cpu_and_async_registry
from fuzzing import examples
from hypothesis import HealthCheck, assume, currently_in_test_context, given, settings
from hypothesis import strategies as st

F32 = GGMLType.F32
# NMSE per node against the float64 oracle, as the conformance suite's cases; an output's
# tolerance adds those of the nodes it depends on (each node's error feeds the next)
OP_NMSE = {Op.MUL_MAT: 5e-4}
DEFAULT_NMSE = 1e-7
MAX_ABS = 1e4  # programs whose values grow past this are not numerically meaningful checks

UNARY = {
    "tanh": lambda c, a: c.tanh(a),
    "sigmoid": lambda c, a: c.sigmoid(a),
    "silu": lambda c, a: c.silu(a),
    "gelu": lambda c, a: c.gelu(a),
    "neg": lambda c, a: c.neg(a),
    "abs": lambda c, a: c.abs(a),
    "sqr": lambda c, a: c.sqr(a),
    "scale": lambda c, a: c.scale(a, 0.5, 0.25),
    "double": lambda c, a: c.scale(a, 2.0),
    "scale_neg": lambda c, a: c.scale(a, -1.5),
    "clamp": lambda c, a: c.clamp(a, -0.5, 0.5),
    "leaky_relu": lambda c, a: c.leaky_relu(a, 0.1),
}
BINARY = {"add": Context.add, "sub": Context.sub, "mul": Context.mul}


# --- programs: a graph as data, replayed on a fresh Context for every target ------------------------
@dataclass(frozen=True)
class Program:
    """Inputs x0, x1 [B, R, C], a row [C] and a matrix [M, C] (pool entries 0..3), then
    ``steps`` (each appends one tensor to the pool), then the pool entries that are outputs.
    ``pins``: per step, 0 = leave to the scheduler, 1 = the accelerator, 2 = the CPU."""

    dims: tuple[int, int, int, int]
    steps: tuple[tuple, ...]
    outputs: tuple[int, ...]
    pins: tuple[int, ...]
    inputs_preallocated: bool


@dataclass
class Built:
    ctx: Context
    graph: Graph
    inputs: list[Tensor]
    pool: list[Tensor]
    outputs: list[Tensor]
    nmse: dict[int, float]  # id(tensor) -> its tolerance


def _inputs(ctx: Context, dims: tuple[int, int, int, int]) -> list[Tensor]:
    b, r, c, m = dims
    shapes = {"x0": (b, r, c), "x1": (b, r, c), "row": (c,), "mat": (m, c)}
    return [ctx.new_tensor(F32, shape, name).set_input() for name, shape in shapes.items()]


def _apply(ctx: Context, pool: list[Tensor], step: tuple) -> Tensor:
    kind, *args = step
    if kind == "unary":
        i, name = args
        return UNARY[name](ctx, pool[i])
    if kind == "binary":
        name, i, j = args
        return BINARY[name](ctx, pool[i], pool[j])
    if kind == "mul_mat":
        i, j = args
        return ctx.mul_mat(pool[i], pool[j])
    if kind == "soft_max":
        i, scale = args
        return ctx.soft_max(pool[i], None, scale)
    if kind == "norm":
        return ctx.norm(pool[args[0]], 1e-5)
    if kind == "rms_norm":
        return ctx.rms_norm(pool[args[0]], 1e-5)
    if kind == "cont":
        return ctx.cont(pool[args[0]])
    if kind == "reshape":
        i, ne = args
        return ctx.reshape_ne(pool[i], *ne)
    if kind == "transpose":
        return ctx.transpose(pool[args[0]])
    if kind == "permute":
        i, axes = args
        return ctx.permute(pool[i], *axes)
    if kind == "view":
        i, ne, nb, offs = args
        return ctx.view(pool[i], ne, nb, offs)
    raise AssertionError(kind)


def build(p: Program) -> Built:
    ctx = Context("alloc-views")
    pool = _inputs(ctx, p.dims)
    inputs = list(pool)
    for s in p.steps:
        pool.append(_apply(ctx, pool, s))
    outs = [pool[i] for i in p.outputs]
    g = ctx.graph(*outs)
    nmse: dict[int, float] = {id(t): 0.0 for t in inputs}
    for n in g.nodes:
        own = 0.0 if n.op in VIEW_OPS else OP_NMSE.get(n.op, DEFAULT_NMSE)
        nmse[id(n)] = own + sum(nmse[id(s)] for s in n.src if s is not None)
    return Built(ctx, g, inputs, pool, outs, nmse)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _view_of(draw, a: Tensor, i: int) -> tuple:
    """A view step of pool entry ``i``: a reshape (contiguous ``a`` only), a transpose, a
    permute, or a view with an offset and explicit strides: every first or second row from r0,
    columns [c0, c0 + nc) of each."""
    kind = draw(st.sampled_from(["reshape", "transpose", "permute", "view"] if a.is_contiguous()
                                else ["transpose", "permute", "view"]))  # fmt: skip
    if kind == "transpose":
        return ("transpose", i)
    if kind == "permute":
        return ("permute", i, tuple(draw(st.permutations(range(4)))))
    if kind == "reshape":
        total = a.nelements
        d0 = draw(st.sampled_from(_divisors(total)))
        d1 = draw(st.sampled_from(_divisors(total // d0)))
        return ("reshape", i, (d0, d1, total // d0 // d1))
    ne, nb = list(a.ne), list(a.nb)
    c0 = draw(st.integers(0, ne[0] - 1))
    nc = draw(st.integers(1, ne[0] - c0))
    r0 = draw(st.integers(0, ne[1] - 1))
    stride = draw(st.integers(1, 2))
    nr = draw(st.integers(1, (ne[1] - 1 - r0) // stride + 1))
    return ("view", i, (nc, nr, ne[2], ne[3]), (nb[0], nb[1] * stride, nb[2], nb[3]), c0 * nb[0] + r0 * nb[1])


def _step(draw, pool: list[Tensor]) -> tuple:
    n = len(pool)
    i = draw(st.integers(0, n - 1))
    a = pool[i]
    kind = draw(st.sampled_from(["unary", "binary", "mul_mat", "soft_max", "norm", "rms_norm", "cont",
                                 "view"]))  # fmt: skip
    if kind == "unary":
        return ("unary", i, draw(st.sampled_from(sorted(UNARY))))
    if kind == "binary":
        js = [j for j in range(n) if can_repeat(pool[j], a)]
        return ("binary", draw(st.sampled_from(sorted(BINARY))), i, draw(st.sampled_from(js)))
    if kind == "mul_mat":
        # a is the weight side [.., M, K]: a second operand [.., N, K] over which a's outer axes repeat
        js = [j for j in range(n) if pool[j].ne[0] == a.ne[0] and not a.is_transposed()
              and pool[j].ne[2] % a.ne[2] == 0 and pool[j].ne[3] % a.ne[3] == 0]  # fmt: skip
        return ("mul_mat", i, draw(st.sampled_from(js))) if js else ("cont", i)
    if kind == "soft_max":
        return ("soft_max", i, draw(st.sampled_from([1.0, 0.5])))
    if kind in ("norm", "rms_norm", "cont"):
        return (kind, i)
    return _view_of(draw, a, i)


@st.composite
def programs(draw, max_steps: int = 8) -> Program:
    """Random steps; then a chain of one to three views of an intermediate, its end an output
    and read by a CONT; then more random steps (which may reuse memory the allocator freed, and
    read the views). Outputs: the view chain's end, the newest node and up to three more pool
    entries (inputs and views of inputs among them)."""
    dims = tuple(draw(st.integers(1, hi)) for hi in (2, 5, 9, 6))  # B, R, C, M
    ctx = Context("draft")
    pool = _inputs(ctx, dims)
    steps: list[tuple] = []

    def add(s: tuple) -> int:
        pool.append(_apply(ctx, pool, s))
        steps.append(s)
        return len(pool) - 1

    def is_node(k: int) -> bool:
        return pool[k].op is not None and pool[k].op not in VIEW_OPS

    for _ in range(draw(st.integers(0, max_steps // 2))):
        add(_step(draw, pool))
    nodes = [k for k in range(len(pool)) if is_node(k)]
    owner = draw(st.sampled_from(nodes)) if nodes else add(("unary", draw(st.integers(0, 3)), "tanh"))
    view = owner
    for _ in range(draw(st.integers(1, 3))):
        view = add(_view_of(draw, pool[view], view))
    add(("cont", view))  # a reader of the chain: its owner is dead after it, unless kept
    for _ in range(draw(st.integers(1, max_steps - max_steps // 2))):
        add(_step(draw, pool))
    newest = max(k for k in range(len(pool)) if is_node(k))
    outputs = {view, newest} | set(draw(st.lists(st.integers(0, len(pool) - 1), max_size=3)))
    pins = tuple(draw(st.lists(st.integers(0, 2), min_size=len(steps), max_size=len(steps))))
    return Program(dims, tuple(steps), tuple(sorted(outputs)), pins, draw(st.booleans()))


# --- running and checking ---------------------------------------------------------------------------
def _input_values(b: Built, seed: int) -> dict[Tensor, np.ndarray]:
    """Values of the inputs the graph reads (the others are not in it)."""
    rng = np.random.default_rng(seed)
    leafs = {id(t) for t in b.graph.leafs}
    return {t: rng.uniform(-1, 1, t.shape).astype(np.float32) for t in b.inputs if id(t) in leafs}


def _oracle(b: Built, values: dict[Tensor, np.ndarray]) -> dict[Tensor, np.ndarray]:
    want = reference.evaluate(b.graph, values)
    tame = all(np.all(np.isfinite(want[o])) and np.max(np.abs(want[o]), initial=0) < MAX_ABS
               for o in b.outputs)  # fmt: skip
    if currently_in_test_context():
        assume(tame)
    else:
        assert tame, "a fixed program must have tame values"
    return want


def _f32_sensitivity(b: Built, want: dict[Tensor, np.ndarray],
                     values: dict[Tensor, np.ndarray]) -> dict[int, float]:
    """id(output) → the output's NMSE against ``want`` (the oracle) when every node's value is off
    by a few F32 units in the last place (relative 2^-22, random signs), carried through the rest
    of the program in float64: the program's own conditioning, which no F32 device can beat
    (x − norm(x) of a normed row is a million times smaller than x: the norm's last bits are the
    whole result)."""
    rng = np.random.default_rng(0)
    vals: dict[Tensor, np.ndarray] = dict(values)
    for n in b.graph.nodes:
        v = np.asarray(reference.compute_node(n, vals), np.float64)
        vals[n] = v if n.op in VIEW_OPS else v * (1 + 2.0**-22 * rng.choice([-1.0, 1.0], v.shape))
    return {id(o): nmse(want[o], vals[o]) for o in b.outputs}


def _check(b: Built, want: dict[Tensor, np.ndarray], values: dict[Tensor, np.ndarray], where: str) -> None:
    """Every output (and every input, unchanged) against the oracle, within the output's
    tolerance, or 10 times the program's own F32 sensitivity where that is larger."""
    own = _f32_sensitivity(b, want, values)
    for k, o in enumerate(b.outputs):
        got = o.get()
        exp = want[o].reshape(got.shape)
        thr = max(b.nmse[id(o)], 10 * own[id(o)])
        ok, _, msg = compare(exp, got, thr, False)
        what = f"{o.op.name if o.op else 'input'} {o.name or o.uid}"
        assert ok, f"{where}: output {k} ({what}, ne={list(o.ne)}): {msg}"
    for t, v in values.items():
        np.testing.assert_array_equal(t.get(), v, err_msg=f"{where}: input {t.name} changed")


def _check_layout(b: Built, buft) -> None:
    """No node computed after a kept tensor (an output's or input's memory owner) is placed over
    it: the layout itself, independent of whether the kernels happened to expose an overlap."""
    def owner(t: Tensor) -> Tensor:
        while t.view_src is not None:
            t = t.view_src
        return t

    flags = TensorFlag.INPUT | TensorFlag.OUTPUT
    keep = {id(owner(t)) for t in itertools.chain(b.graph.leafs, b.graph.nodes) if t.flags & flags}
    order = {id(t): k for k, t in enumerate(itertools.chain(b.graph.leafs, b.graph.nodes))}
    owners = [t for t in itertools.chain(b.graph.leafs, b.graph.nodes) if t.view_src is None]
    for o in owners:
        if id(o) not in keep or o.buffer is None:
            continue
        lo, hi = o.offs, o.offs + buft.alloc_size(o)
        for t in owners:
            if t is o or t.buffer is not o.buffer or order[id(t)] < order[id(o)]:
                continue
            t_lo, t_hi = t.offs, t.offs + buft.alloc_size(t)
            assert t_hi <= lo or t_lo >= hi, (
                f"{t.op.name if t.op else 'leaf'} {t.uid} is placed over kept {o.name or o.uid}")


def run_direct(device: Device, backend: Backend, p: Program, seed: int = 0) -> None:
    """The program's graph on one backend with a GraphAllocator."""
    b = build(p)
    values = _input_values(b, seed)
    want = _oracle(b, values)
    ok, what = graph_supported(device, b.graph)
    if not ok:
        pytest.skip(f"{device.name} does not support {what}")  # only from the deterministic tests
    bufs = [alloc_ctx_tensors(b.ctx, device.buffer_type)] if p.inputs_preallocated else []
    galloc = GraphAllocator(device.buffer_type)
    try:
        galloc.alloc_graph(b.graph)
        _check_layout(b, device.buffer_type)
        for t, v in values.items():
            t.set(v)
        backend.compute(b.graph)
        _check(b, want, values, device.name)
    finally:
        galloc.free()
        for buf in bufs:
            if buf is not None:
                buf.free()


def run_sched(accel: Backend, cpu: Backend, p: Program, seed: int = 0, **sched_kw) -> None:
    """The program's graph through a Scheduler over ``accel`` and ``cpu``, nodes pinned as
    ``p.pins`` says (to the accelerator only where it supports the node)."""
    b = build(p)
    values = _input_values(b, seed)
    want = _oracle(b, values)
    s = Scheduler([accel, cpu], **sched_kw)
    bufs = [alloc_ctx_tensors(b.ctx, cpu.device.buffer_type)] if p.inputs_preallocated else []
    try:
        for t, pin in zip(b.pool[4:], p.pins, strict=True):
            if t.op in VIEW_OPS:
                continue  # a view lives where its memory does
            if pin == 1 and accel.device.supports_op(t):
                s.set_tensor_backend(t, accel)
            elif pin == 2:
                s.set_tensor_backend(t, cpu)
        for _ in range(2):  # twice: the second run reuses the plan and the placements
            s.alloc_graph(b.graph)
            for t, v in values.items():
                t.set(v)
            s.graph_compute(b.graph)
            s.synchronize()
            _check(b, want, values, f"scheduler over {accel.device.name} + {cpu.device.name}")
    finally:
        s.free()
        for buf in bufs:
            if buf is not None:
                buf.free()


def run_meta(devices: list[Device], p: Program, seed: int = 0) -> None:
    """The program's graph on a meta device: x0 and x1 split by rows (ggml axis 1) where they
    have two, the rest mirrored; the split states of every node follow from the op rules."""
    b = build(p)
    values = _input_values(b, seed)
    want = _oracle(b, values)
    meta = MetaDevice(devices)

    def split(t: Tensor) -> SplitState | None:
        if t.name in ("x0", "x1") and t.ne[1] >= len(devices):
            return meta.split(t, 1)
        return None

    meta.split_state = split
    try:
        meta.alloc_graph(b.graph)
        for t, v in values.items():
            t.set(v)
        meta.compute(b.graph)
        _check(b, want, values, meta.name)
    finally:
        meta.free()


# --- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reg():
    return cpu_and_async_registry(n_async=1, delay_us=30)


@pytest.fixture(scope="module")
def cpu_pair(reg):
    dev = reg.device("CPU")
    be = dev.new_backend()
    yield dev, be
    be.free()


@pytest.fixture(scope="module")
def async_pair(reg):
    dev = reg.device("ASYNC0")
    be = dev.new_backend()
    yield dev, be
    be.free()


def _installed() -> list[str]:
    try:
        return [d.name for d in accelplane.get_registry().devices if d.type != DeviceType.CPU]
    except Exception:  # a broken plugin setup must not break collection
        return []


@pytest.fixture(scope="module", params=_installed())
def plugin(request):
    """(device, backend, a CPU backend of the same registry) of one installed plugin."""
    reg = accelplane.get_registry()
    dev = reg.device(request.param)
    be, cpu = dev.new_backend(), reg.device("CPU").new_backend()
    yield dev, be, cpu
    be.free()
    cpu.free()


PROPERTY = settings(max_examples=examples(60, 2000), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large])  # fmt: skip
PLUGIN_PROPERTY = settings(PROPERTY, max_examples=examples(10, 300))


# --- the property tests -------------------------------------------------------------------------------
@PROPERTY
@given(p=programs())
def test_random_graphs_cpu(cpu_pair, p):
    run_direct(*cpu_pair, p)


@PROPERTY
@given(p=programs())
def test_random_graphs_async_device(async_pair, p):
    run_direct(*async_pair, p)


@PROPERTY
@given(p=programs(), n_copies=st.sampled_from([1, 2]), policy=st.sampled_from(["strict", "relaxed"]))
def test_random_graphs_scheduler(async_pair, cpu_pair, p, n_copies, policy):
    run_sched(async_pair[1], cpu_pair[1], p, n_copies=n_copies, policy=policy)


@PROPERTY
@given(p=programs(), n_dev=st.sampled_from([1, 2]))
def test_random_graphs_meta(reg, p, n_dev):
    run_meta([reg.device("CPU"), reg.device("ASYNC0")][:n_dev], p)


@PLUGIN_PROPERTY
@given(p=programs(max_steps=6))
def test_random_graphs_installed_plugin(plugin, p):
    """On the plugin alone where it supports every node, and through the scheduler with the
    CPU plugin (which takes the nodes the plugin does not support) always."""
    dev, be, cpu = plugin
    if graph_supported(dev, build(p).graph)[0]:
        run_direct(dev, be, p)
    run_sched(be, cpu, p)


# --- the reproductions --------------------------------------------------------------------------------
# y = 2x; v = reshape(y) is an output; c = cont(transpose(reshape(v))) reads y through views and
# w = c + c is computed after y's last reader: w's memory must not be y's
REPRO = Program(
    dims=(1, 1, 32, 1),
    steps=(("unary", 0, "double"), ("reshape", 4, (32, 1, 1)), ("reshape", 5, (8, 4, 1)),
           ("transpose", 6), ("cont", 7), ("binary", "add", 8, 8)),  # fmt: skip
    outputs=(5, 9), pins=(0,) * 6, inputs_preallocated=True)


def _repro(ctx: Context):
    x = ctx.new_tensor("f32", (32,), "x").set_input()
    y = ctx.scale(x, 2)
    v = ctx.reshape(y, (32,))
    c = ctx.cont(ctx.transpose(ctx.reshape(v, (4, 8))))
    w = ctx.add(c, c)
    return x, v, w, ctx.graph(v, w)


def _repro_check(x: Tensor, v: Tensor, w: Tensor) -> None:
    xv = np.arange(32, dtype=np.float64)
    np.testing.assert_array_equal(v.get(), 2 * xv)
    np.testing.assert_array_equal(w.get(), 4 * xv.reshape(4, 8).T)


def test_repro_cpu(cpu_pair):
    """The report's reproduction: the view output keeps its values (2x), not w's."""
    dev, be = cpu_pair
    ctx = Context()
    x, v, w, g = _repro(ctx)
    buf = alloc_ctx_tensors(ctx, dev.buffer_type)
    galloc = GraphAllocator(dev.buffer_type)
    galloc.alloc_graph(g)
    x.set(np.arange(32))
    be.compute(g)
    _repro_check(x, v, w)
    assert v.view_src.offs + v.view_src.nbytes <= w.offs or w.offs + w.nbytes <= v.view_src.offs
    galloc.free()
    buf.free()


@pytest.mark.parametrize("where", ["cpu", "async", "split", "view_elsewhere"])
def test_repro_scheduler(cpu_pair, async_pair, where):
    """The reproduction through the scheduler: the CPU alone, everything on the test device,
    y on the device and its readers on the CPU, and the view output assigned to another
    backend than the tensor it views (that backend's allocator never sees y)."""
    cpu, dev = cpu_pair[1], async_pair[1]
    ctx = Context()
    x, v, w, g = _repro(ctx)
    y = v.view_src
    s = Scheduler([cpu] if where == "cpu" else [dev, cpu])
    if where == "async":
        for n in g.nodes:
            s.set_tensor_backend(n, dev)
    elif where == "split":
        s.set_tensor_backend(y, dev)
    elif where == "view_elsewhere":
        for n in g.nodes:
            s.set_tensor_backend(n, cpu if n is v else dev)
    try:
        for _ in range(2):
            s.alloc_graph(g)
            x.set(np.arange(32))
            s.graph_compute(g)
            s.synchronize()
            _repro_check(x, v, w)
    finally:
        s.free()


@pytest.mark.parametrize("reader", ["in_place", "later"])
def test_view_output_on_another_backend(cpu_pair, async_pair, reader):
    """y on the test device; its view v, an output, assigned to the CPU, so the device's
    allocator never sees v; y's other reader is computed in place over it, or later nodes want
    memory after it: y must stay."""
    cpu, dev = cpu_pair[1], async_pair[1]
    ctx = Context()
    x = ctx.new_tensor(F32, (4, 8), "x").set_input()
    y = ctx.scale(x, 2.0)
    v = ctx.transpose(y)
    z = ctx.sqr(y)
    if reader == "later":
        z = ctx.add(ctx.tanh(z), z)
    g = ctx.graph(v, z)
    s = Scheduler([dev, cpu])
    for n in g.nodes:
        s.set_tensor_backend(n, cpu if n is v else dev)
    xv = np.random.default_rng(3).uniform(-1, 1, (4, 8)).astype(np.float32)
    try:
        s.alloc_graph(g)
        x.set(xv)
        s.graph_compute(g)
        s.synchronize()
        y64 = 2.0 * xv.astype(np.float64)
        np.testing.assert_allclose(v.get(), y64.T, rtol=1e-6)
        z64 = y64**2 if reader == "in_place" else np.tanh(y64**2) + y64**2
        np.testing.assert_allclose(z.get(), z64, rtol=1e-5)
    finally:
        s.free()


@pytest.mark.parametrize("through_view", [False, True])
def test_read_in_place_by_another_backend(cpu_pair, through_view):
    """Two backends of one buffer type (two CPU streams): a node of the second reads y where it
    lives, with no copy, so the first one's allocator does not see that reader; y's reader
    there must not be computed over it in place."""
    dev, _ = cpu_pair
    b0, b1 = dev.new_backend(), dev.new_backend()
    ctx = Context()
    x = ctx.new_tensor(F32, (4, 8), "x").set_input()
    y = ctx.scale(x, 2.0)
    z = ctx.sqr(y)
    w = ctx.tanh(ctx.transpose(y) if through_view else y)
    g = ctx.graph(z, w)
    s = Scheduler([b0, b1])
    for n in (y, z):
        s.set_tensor_backend(n, b0)
    s.set_tensor_backend(w, b1)
    xv = np.random.default_rng(4).uniform(-1, 1, (4, 8)).astype(np.float32)
    try:
        s.alloc_graph(g)
        assert s.stats.copies == 0 and s.stats.splits == 2
        x.set(xv)
        s.compute(g)
        y64 = 2.0 * xv.astype(np.float64)
        np.testing.assert_allclose(z.get(), y64**2, rtol=1e-6)
        np.testing.assert_allclose(w.get(), np.tanh(y64.T if through_view else y64), rtol=1e-6)
    finally:
        s.free()
        b0.free()
        b1.free()


def test_repro_installed_plugin(plugin):
    dev, be, cpu = plugin
    run_direct(dev, be, REPRO, seed=1)
    run_sched(be, cpu, REPRO, seed=1)


@pytest.mark.parametrize("n_dev,split", [(1, False), (2, False), (2, True)])
def test_repro_meta(reg, n_dev, split):
    """The reproduction on a meta device: mirrored on one and two devices, and with x split in
    halves over two (the views and the CONT follow the split or gather it)."""
    devs = [reg.device("CPU"), reg.device("ASYNC0")][:n_dev]
    meta = MetaDevice(devs)
    if split:
        meta.split_state = lambda t: meta.split(t, 0) if t.name == "x" else None
    ctx = Context()
    x, v, w, g = _repro(ctx)
    try:
        meta.alloc_graph(g)
        x.set(np.arange(32))
        meta.compute(g)
        _repro_check(x, v, w)
    finally:
        meta.free()


def test_repro_program_is_the_reproduction(cpu_pair):
    """REPRO (the program the plugins run) fails the same way: its view output's owner is a
    node read only through views before w is computed."""
    b = build(REPRO)
    v, w = b.outputs
    assert v.op is Op.RESHAPE and v.view_src.op is Op.SCALE and w.op is Op.ADD
    run_direct(*cpu_pair, REPRO)


def test_single_dot_product_after_a_kernel(plugin):
    """A 1x1 MUL_MAT (one dot product) reading the result of the kernel before it, ten times
    (the SYCL plugin's oneMKL path once read it before it was written, now and then)."""
    dev, be, cpu = plugin
    p = Program((1, 1, 2, 1), (("unary", 3, "tanh"), ("mul_mat", 4, 0)), (5,), (1, 1), False)
    for seed in range(10):
        run_direct(dev, be, p, seed=seed)


# --- the other direction, and the corners -------------------------------------------------------------
def _corner_programs() -> dict[str, Program]:
    d = (2, 4, 6, 3)
    return {
        # an in-place node over a source that has a view output: the source must stay
        "in_place_over_owner_of_output": Program(d, (("unary", 0, "tanh"), ("transpose", 4),
                                                     ("unary", 4, "sqr")), (5, 6), (0,) * 3, False),
        # a view of a view (with an offset) of an intermediate as the only output of its chain
        "view_of_view_offset": Program(d, (("unary", 0, "silu"), ("transpose", 4),
                                           ("view", 5, (2, 3, 2, 1), (24, 4, 96, 192), 4),
                                           ("unary", 4, "neg"), ("binary", "mul", 7, 7)),
                                       (6, 8), (0,) * 5, False),  # fmt: skip
        # a view of an input as an output, the input otherwise read and then dead
        "view_of_input": Program(d, (("transpose", 0), ("unary", 0, "gelu"), ("unary", 5, "sqr"),
                                     ("binary", "add", 6, 1)), (4, 7), (0,) * 4, False),
        # an output view whose owner is an in-place result (softmax over a norm)
        "view_of_in_place_result": Program(d, (("norm", 0), ("soft_max", 4, 1.0), ("reshape", 5, (48, 1, 1)),
                                               ("unary", 5, "sigmoid"), ("unary", 7, "tanh")),
                                           (6, 8), (0,) * 5, True),  # fmt: skip
        # a product's view output, the product's other reader computed in place after it
        "mul_mat_view": Program(d, (("mul_mat", 3, 0), ("permute", 4, (2, 0, 1, 3)),
                                    ("unary", 4, "scale"), ("unary", 6, "abs")), (5, 7), (1, 2, 1, 0), False),
        # the repro's shape with an offset view: the view output is read (cont), then the owner
        # is dead and later nodes want memory
        "view_offset_output_read": Program(d, (("unary", 0, "sqr"),
                                               ("view", 4, (3, 2, 2, 1), (4, 48, 96, 192), 8),
                                               ("cont", 5), ("unary", 6, "tanh"), ("binary", "add", 7, 7),
                                               ("unary", 8, "silu")), (5, 9), (1, 2, 0, 1, 1, 2), False),
        # a view of a view output, read through the inner view
        "view_of_view_output_read": Program(d, (("unary", 0, "silu"), ("transpose", 4),
                                                ("view", 5, (2, 3, 2, 1), (24, 4, 96, 192), 4), ("cont", 6),
                                                ("unary", 7, "neg"), ("binary", "mul", 8, 8)),
                                            (6, 9), (2, 0, 0, 1, 1, 0), True),
        # a norm read twice by the MUL after it: no plugin may fuse the pair (the fused kernel
        # would read the norm's unwritten memory as the MUL's other operand)
        "norm_read_twice": Program(d, (("norm", 0), ("binary", "mul", 4, 4), ("unary", 5, "double")),
                                   (6,), (1, 1, 1), False),
        "rms_norm_read_twice": Program(d, (("rms_norm", 0), ("binary", "mul", 4, 4), ("unary", 5, "double")),
                                       (6,), (1, 1, 1), False),
        # x − norm(x) of a normed row: a result a million times smaller than x, whose error is
        # the norm's F32 rounding (the tolerance follows the program's own F32 sensitivity)
        "cancelling_difference": Program((1, 2, 3, 2), (("norm", 2), ("norm", 2), ("norm", 4),
                                                        ("reshape", 4, (1, 1, 3)), ("cont", 7),
                                                        ("binary", "sub", 4, 6)), (7, 9), (0,) * 6, False),
        # a view of a strided view of a tensor split over the meta device's devices, which the
        # meta device gathers first (the gathered copy is packed: the view must not read it with
        # the strided view's strides)
        "view_of_gathered_strided_view": Program((1, 2, 4, 1), (("unary", 0, "abs"),
                                                               ("reshape", 4, (1, 4, 2)),
                                                               ("view", 5, (1, 2, 2, 1), (4, 4, 16, 32), 0),
                                                               ("view", 6, (1, 1, 2, 1), (4, 4, 16, 32), 0)),
                                                 (7,), (0,) * 4, False),
    }


CORNERS = _corner_programs()


@pytest.mark.parametrize("name", sorted(CORNERS))
def test_corner_cpu(cpu_pair, name):
    run_direct(*cpu_pair, CORNERS[name])


@pytest.mark.parametrize("name", sorted(CORNERS))
def test_corner_async_and_scheduler(cpu_pair, async_pair, name):
    run_direct(*async_pair, CORNERS[name])
    run_sched(async_pair[1], cpu_pair[1], CORNERS[name])


@pytest.mark.parametrize("n_dev", [1, 2])
@pytest.mark.parametrize("name", sorted(CORNERS))
def test_corner_meta(reg, name, n_dev):
    run_meta([reg.device("CPU"), reg.device("ASYNC0")][:n_dev], CORNERS[name])


@pytest.mark.parametrize("name", sorted(CORNERS))
def test_corner_installed_plugin(plugin, name):
    dev, be, cpu = plugin
    if graph_supported(dev, build(CORNERS[name]).graph)[0]:
        run_direct(dev, be, CORNERS[name])
    run_sched(be, cpu, CORNERS[name])


def test_kept_owners_are_the_ends_of_view_chains():
    """owners_to_keep: a flagged view (of a view) names the tensor whose memory it is."""
    from accelplane.core.tensor import memory_owner, owners_to_keep

    ctx = Context()
    x = ctx.new_tensor(F32, (4, 6), "x")
    y = ctx.scale(x, 2.0)
    vv = ctx.view(ctx.transpose(y), (2, 3), (24, 4), 4)
    vv.set_output()
    assert memory_owner(vv) is y
    assert owners_to_keep([vv, y]) == frozenset({id(y)})
    assert owners_to_keep([], [vv]) == frozenset({id(y)})
    assert owners_to_keep([y]) == frozenset()
    x.set_input()
    assert owners_to_keep([x, vv]) == frozenset({id(x), id(y)})
    g = Graph([ctx.sqr(y), vv])
    assert id(y) in g.keep and id(x) in g.keep
    assert vv.flags & TensorFlag.OUTPUT
