"""Fuzzing the public host API: random sequences of builder calls (every Context op, with
random types, shapes, views and parameters, legal or not), random set/get ranges and values,
then a compute on a random device (the CPU plugin, the asynchronous test device, every
installed plugin, or the Scheduler over one of them and the CPU).

Each case must end in results equal to the float64 oracle, or in a typed accelplane error;
never an untyped exception, a crash (it would take the test process down) or a hang (each
case has a deadline). ACCELPLANE_FUZZ=long runs the long count (tests/fuzzing.py).
"""

from __future__ import annotations

import signal
from contextlib import contextmanager, suppress

import accelplane
import numpy as np
import pytest
from accelplane.core.graph import Context
from accelplane.core.ops import QUANT, VIEW_OPS, WRITES_VIEW_SRC, GluOp, Op, SortOrder, UnaryOp
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType
from accelplane.errors import AccelplaneError
from accelplane.oracle import reference
from accelplane.oracle.compare import compare
from accelplane.runtime.alloc import GraphAllocator, alloc_ctx_tensors
from accelplane.sched import Scheduler
from accelplane.testing.plugins import cpu_and_async_registry
from fuzzing import TALLY, examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

T = GGMLType
TYPES = [T.F32, T.F16, T.BF16, T.I32, *sorted(QUANT)]  # every block type of the catalog
CASE_DEADLINE_S = 120  # a case that takes longer is a hang
MAX_ABS = 1e4  # results past this are not a meaningful comparison (overflowing chains)


def _devices():
    """Every device, each with the CPU device of its registry (the Scheduler's fallback)."""
    pairs = {}
    for reg in (accelplane.get_registry(), cpu_and_async_registry(1, 0)):
        cpu = next(d for d in reg.devices if d.name == "CPU")
        for d in reg.devices:
            pairs.setdefault(d.name, (d, cpu))
    return list(pairs.values())


DEVICES = _devices()
BACKENDS: dict[str, object] = {}  # one stream per device, reused across cases


def _backend(dev):
    b = BACKENDS.get(dev.name)
    if b is None:
        b = BACKENDS[dev.name] = dev.new_backend()
    return b


@contextmanager
def deadline(seconds: int):
    def hang(signum, frame):
        raise TimeoutError(f"the case took more than {seconds} s (a hang)")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# --- random builder calls -----------------------------------------------------------------------
def _shape(draw, ty: GGMLType) -> tuple[int, ...]:
    nd = draw(st.integers(1, 4))
    dims = [draw(st.sampled_from([0, 1, 2, 3, 4, 5, 7, 8])) for _ in range(nd)]
    if ty.is_quantized and draw(st.booleans()):
        dims[-1] = ty.blck_size * draw(st.integers(1, 2))  # usually a whole block
    elif draw(st.integers(0, 9)) == 0:
        dims[-1] = draw(st.sampled_from([31, 33, 64, 256]))
    return tuple(dims)


def _pick(draw, pool: list[Tensor]) -> Tensor | int:
    if draw(st.integers(0, 30)) == 0:
        return 7  # not a tensor at all
    return pool[draw(st.integers(0, len(pool) - 1))]


def _call(draw, ctx: Context, pool: list[Tensor]) -> Tensor:
    """One builder call on random operands from ``pool`` with random parameters."""
    a, b = _pick(draw, pool), _pick(draw, pool)
    k = draw(st.sampled_from(OPS))
    f = st.floats(-3, 3, allow_nan=False)
    if k == "binary":
        return draw(st.sampled_from([ctx.add, ctx.sub, ctx.mul, ctx.div]))(a, b)
    if k == "unary":
        op = draw(st.sampled_from([*UnaryOp, 99]))
        return ctx.unary(a, op)
    if k == "math":
        return draw(st.sampled_from([ctx.sqr, ctx.sqrt, ctx.log, ctx.sin, ctx.cos]))(a)
    if k == "scale":
        return ctx.scale(a, draw(f), draw(f))
    if k == "clamp":
        return ctx.clamp(a, draw(f), draw(f))
    if k == "leaky_relu":
        return ctx.leaky_relu(a, draw(f))
    if k == "glu":
        return ctx.glu(a, draw(st.sampled_from([b, None])), draw(st.sampled_from([*GluOp, -1])),
                       draw(st.booleans()))  # fmt: skip
    if k == "norm":
        fn = draw(st.sampled_from([ctx.norm, ctx.rms_norm, ctx.l2_norm]))
        return fn(a, draw(st.sampled_from([1e-5, 0.0])))
    if k == "soft_max":
        return ctx.soft_max(a, draw(st.sampled_from([b, None])), draw(f), draw(st.sampled_from([0.0, 8.0])))
    if k == "rope":
        return ctx.rope(a, b, draw(st.sampled_from([0, 2, 4, 7, 8])), draw(st.sampled_from([0, 2, 5])))
    if k == "mul_mat":
        return ctx.mul_mat(a, b)
    if k == "mul_mat_id":
        return ctx.mul_mat_id(a, b, _pick(draw, pool))
    if k == "get_rows":
        return ctx.get_rows(a, b)
    if k == "set_rows":
        return ctx.set_rows(a, b, _pick(draw, pool))
    if k == "cpy":
        return ctx.cpy(a, b)
    if k == "cont":
        return draw(st.sampled_from([ctx.cont, ctx.dup]))(a)
    if k == "concat":
        return ctx.concat(a, b, draw(st.integers(-1, 4)))
    if k == "reduce":
        return draw(st.sampled_from([ctx.sum, ctx.sum_rows, ctx.mean, ctx.argmax]))(a)
    if k == "argsort":
        return ctx.argsort(a, draw(st.sampled_from([*SortOrder, 5])))
    if k == "view":
        ne = [draw(st.integers(0, 6)) for _ in range(draw(st.integers(1, 4)))]
        nb = [draw(st.sampled_from([-4, 0, 1, 2, 4, 8, 16, 34, 64, 1 << 40])) for _ in range(4)]
        offs = draw(st.sampled_from([0, 2, 4, 8, -4, 1 << 30]))
        return ctx.view(a, ne, nb if draw(st.booleans()) else None, offs)
    if k == "reshape":
        return ctx.reshape(a, [draw(st.integers(0, 8)) for _ in range(draw(st.integers(1, 4)))])
    if k == "permute":
        axes = draw(st.permutations([0, 1, 2, 3])) if draw(st.integers(0, 5)) else (0, 0, 1, 2)
        return ctx.permute(a, *axes)
    if k == "transpose":
        return ctx.transpose(a)
    raise AssertionError(k)


OPS = ["binary", "unary", "math", "scale", "clamp", "leaky_relu", "glu", "norm", "soft_max", "rope",
       "mul_mat", "mul_mat_id", "get_rows", "set_rows", "cpy", "cont", "concat", "reduce", "argsort",
       "view", "reshape", "permute", "transpose"]  # fmt: skip


def _values(draw, t: Tensor, rng: np.random.Generator) -> np.ndarray:
    if t.type == T.I32:  # indices, mostly in range (rows of a small tensor), sometimes not
        hi = draw(st.sampled_from([2, 3, 8, 1 << 20]))
        return rng.integers(-1 if hi > 8 else 0, hi, t.shape)
    vals = rng.uniform(-1, 1, t.shape)
    if t.type.is_quantized and draw(st.integers(0, 20)) == 0 and vals.size:
        vals.flat[0] = np.nan  # refused with DataError
    return vals


def _threshold(n: Tensor) -> float:
    if n.op in (Op.MUL_MAT, Op.MUL_MAT_ID):
        return 5e-4
    if n.type.is_quantized:  # a quantizing copy or row write: one quantization step
        return 2e-2
    return {T.F16: 1e-6, T.BF16: 5e-5}.get(n.type, 1e-7)


def _describe(g) -> str:
    """The graph, one node a line (to rebuild a failing case by hand)."""
    name = {id(t): f"{t.name or '#' + str(t.uid)}" for t in (*g.leafs, *g.nodes)}
    lines = [f"  {name[id(t)]} = leaf {t.type.name} ne={list(t.ne)} nb={list(t.nb)}" for t in g.leafs]
    for n in g.nodes:
        srcs = ", ".join(name.get(id(s), "?") for s in n.src if s is not None)
        lines.append(f"  {name[id(n)]} = {n.op.name}({srcs}) {n.type.name} ne={list(n.ne)} nb={list(n.nb)} "
                     f"params={n.op_params} view_offs={n.view_offs}")  # fmt: skip
    return "\n".join(lines)


def _scale(o: Tensor, values: dict) -> float:
    """The largest magnitude among the values ``o`` is computed from (at least 1)."""
    m, seen, stack = 1.0, set(), [s for s in o.src if s is not None]
    while stack:
        t = stack.pop()
        if id(t) not in seen:
            seen.add(id(t))
            v = np.asarray(values.get(t, 0.0), np.float64)
            m = max(m, float(np.abs(v[np.isfinite(v)]).max(initial=0)))
            stack += [s for s in t.src if s is not None]
    return m


def _upstream_not_finite(o: Tensor, values: dict) -> bool:
    """Whether a node that ``o`` depends on (not ``o`` itself) holds NaN or infinity in the
    oracle: ops given those (sqrt of a negative feeding a leaky ReLU) differ between ggml's
    formulas, numpy's and the plugins', so such results are not compared."""
    seen, stack = set(), [s for s in o.src if s is not None]
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        v = values.get(t)
        v = np.asarray(v) if v is not None else None
        if t.op is not None and v is not None and v.dtype.kind == "f" and not np.isfinite(v).all():
            return True
        stack += [s for s in t.src if s is not None]
        if t.view_src is not None:
            stack.append(t.view_src)
    return False


# --- one case ------------------------------------------------------------------------------------
def _build(draw):
    """A context with 1-3 leaves and the nodes of 1-6 random builder calls (refused calls
    add nothing), and the last node or two as outputs; None when nothing was built. Half the
    cases draw leaves of one float shape, so that more calls are legal and more graphs run."""
    ctx = Context("fuzz")
    pool: list[Tensor] = []
    common = _shape(draw, T.F32) if draw(st.integers(0, 2)) else None
    for i in range(draw(st.integers(1, 3))):
        ty = draw(st.sampled_from([T.F32, T.F16] if common else TYPES))
        with suppress(AccelplaneError):  # a shape the type refuses: one leaf fewer
            pool.append(ctx.new_tensor(ty, common or _shape(draw, ty), f"x{i}"))
    if not pool:
        return None
    nodes = []
    for _ in range(draw(st.integers(1, 6))):
        try:
            t = _call(draw, ctx, pool)
        except AccelplaneError:
            TALLY.add("host builder calls", "refused (typed error)")
            continue
        assert isinstance(t, Tensor)
        TALLY.add("host builder calls", "built")
        pool.append(t)
        if t.op not in VIEW_OPS or t.op is Op.VIEW:
            nodes.append(t)
    outs = [t for t in nodes if t.op is not None]
    if not outs:
        return None
    k = draw(st.integers(1, min(2, len(outs))))
    return ctx, outs[-k:]


def _data_edges(draw, ctx: Context, rng) -> None:
    """set_bytes/get_bytes over random ranges of a random leaf: in range they round-trip,
    outside they raise OutOfRangeError."""
    t = draw(st.sampled_from(ctx.tensors))
    n = t.nbytes
    off = draw(st.sampled_from([0, 1, n // 2, n, n + 1, -1]))
    size = draw(st.sampled_from([0, 1, n, n - off, n + 1]))
    if off >= 0 and size >= 0 and off + size <= n:
        data = rng.integers(0, 256, size, dtype=np.uint8)
        t.set_bytes(data, off)
        assert np.array_equal(t.get_bytes(off, size), data)
    else:
        with pytest.raises(AccelplaneError):
            t.set_bytes(np.zeros(max(size, 0), np.uint8), off)
        TALLY.add("host data ranges", "refused (typed error)")


@given(st.data())
@settings(max_examples=examples(600, 10000), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])  # fmt: skip
def test_host_api_ends_in_the_oracle_or_a_typed_error(data):
    draw = data.draw
    with deadline(CASE_DEADLINE_S):
        built = _build(draw)
        if built is None:
            TALLY.add("host", "nothing built")
            return
        ctx, outs = built
        g = ctx.graph(*outs)
        dev, cpu = draw(st.sampled_from(DEVICES))
        sched_cpu = cpu if dev is not cpu and draw(st.booleans()) else None
        rng = np.random.default_rng(draw(st.integers(0, 2**31)))
        try:
            TALLY.add("host", _run(draw, ctx, g, outs, dev, sched_cpu, rng))
        except AccelplaneError as e:
            TALLY.add("host", f"typed error at run ({type(e).__name__})")


def _run(draw, ctx, g, outs, dev, sched_cpu, rng) -> str:
    """Allocate on ``dev``, set the leaves, compute (through a Scheduler over ``dev`` and
    ``sched_cpu`` when given, else on one backend of ``dev``) and compare with the oracle;
    the outcome."""
    bufs = [alloc_ctx_tensors(ctx, dev.buffer_type)]
    sched = Scheduler([dev.new_backend(), sched_cpu.new_backend()]) if sched_cpu is not None else None
    try:
        if draw(st.integers(0, 4)) == 0:
            _data_edges(draw, ctx, rng)  # random bytes: then overwritten with meaningful values
        values = {}
        for t in ctx.tensors:
            t.set(_values(draw, t, rng))
            values[t] = t.get()
        if sched is not None:
            sched.alloc_graph(g)
            sched.graph_compute(g)
            sched.synchronize()
        else:
            ga = GraphAllocator(dev.buffer_type)
            bufs.append(ga)
            ga.alloc_graph(g)
            _backend(dev).compute(g)
        want = reference.evaluate(g, values)
        where = f"{dev.name}{' (scheduler)' if sched else ''}"
        compared = 0
        order = {id(n): i for i, n in enumerate(g.nodes)}
        for o in outs:
            exp = np.asarray(want[o])
            owner = o.view_src or o
            if any(n.op in WRITES_VIEW_SRC and n.view_src is owner and order[id(n)] > order[id(o)]
                   for n in g.nodes):  # fmt: skip
                continue  # a later node writes its memory: the oracle's value is of its own time
            if _upstream_not_finite(o, want):
                continue  # NaN/inf upstream: ggml, numpy and the plugins leave such results open
            if exp.dtype.kind == "f" and np.abs(exp[np.isfinite(exp)]).max(initial=0) > MAX_ABS:
                continue  # values past 1e4: not a meaningful comparison
            got = o.get().reshape(exp.shape)
            thr = 10 * sum(_threshold(n) for n in g.nodes if n.op not in VIEW_OPS)
            ok, err, msg = compare(exp, got, max(thr, 1e-6), o.type == T.I32)
            if not ok and o.type != T.I32 and np.isfinite(got).all() and np.isfinite(exp).all():
                # a result near zero from larger values (a sum of a normed row): relative error
                # means nothing there; the absolute error against the values it came from does
                ok = float(np.max(np.abs(got - exp), initial=0)) <= 1e-4 * _scale(o, want)
            assert ok, f"{where}: output {o} differs from the oracle: {msg}\n{_describe(g)}"
            compared += 1
        return "computed = oracle" if compared else "computed, not compared (NaN/inf upstream)"
    finally:
        if sched is not None:
            sched.free()
            for b in sched.backends:
                b.free()
        for b in bufs:
            if b is not None:
                b.free()
