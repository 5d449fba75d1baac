"""The scheduler over the CPU plugin and the asynchronous test device: assignment, splits,
copies, both sync policies, pipeline copies, MoE expert uploads and prefetch, eval callback,
check-results mode and planning errors — every result against the float64 oracle."""

from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np
import pytest
from accelplane.core.graph import Context
from accelplane.core.ops import Op
from accelplane.core.types import GGMLType
from accelplane.errors import CheckResultsError, DeviceError, TypeMismatchError, UnsupportedOpError
from accelplane.models.blocks import llama_layer, moe_layers
from accelplane.oracle import reference
from accelplane.runtime.alloc import alloc_tensors
from accelplane.sched import Scheduler
from accelplane.testing.plugins import cpu_and_async_registry
from fuzzing import examples

SCHEDULES = examples(1000, 10000)  # randomized delay schedules in total (tests/fuzzing.py)


@pytest.fixture(scope="module")
def reg():
    os.environ.setdefault("ACCELPLANE_TEST_DELAY_US", "30")
    return cpu_and_async_registry(n_async=2)


def test_a_test_registry_keeps_its_device_count_to_itself(monkeypatch):
    """cpu_and_async_registry(n_async=N) has N asynchronous devices and leaves the environment
    as it was: later registries and child processes find their own count."""
    monkeypatch.delenv("ACCELPLANE_ASYNCDEV_NDEV", raising=False)
    one = cpu_and_async_registry(n_async=1)
    assert [d.name for d in one.devices_of("asynctest")] == ["ASYNC0"]
    assert "ACCELPLANE_ASYNCDEV_NDEV" not in os.environ
    monkeypatch.setenv("ACCELPLANE_ASYNCDEV_NDEV", "3")
    assert len(cpu_and_async_registry(n_async=2).devices_of("asynctest")) == 2
    assert os.environ["ACCELPLANE_ASYNCDEV_NDEV"] == "3"


def _layer_setup(reg, devices, n_layers=1, seed=0, **kw):
    """A llama layer with its weights spread over ``devices`` round-robin."""
    lg = llama_layer(n_layers=n_layers, **kw)
    g = lg.ctx.graph(lg.out)
    rng = np.random.default_rng(seed)
    bufs = []
    for k, dev in enumerate(devices):
        ws = [w for i, w in enumerate(lg.weights) if i % len(devices) == k]
        bufs.append(alloc_tensors(ws, dev.buffer_type))
    wv = lg.weight_values(rng)
    for t, v in wv.items():
        t.set(v)
    return lg, g, wv, rng, bufs


def _run_and_check(s, lg, g, wv, rng, n, tol=1e-4):
    wrong = 0
    for _ in range(n):
        s.alloc_graph(g)
        iv = lg.inputs(rng)
        for t, v in iv.items():
            t.set(v)
        s.compute(g)
        want = reference.evaluate(g, {**wv, **iv})[lg.out].reshape(lg.out.shape)
        wrong += not np.allclose(lg.out.get(), want, atol=tol, rtol=tol)
    return wrong


@pytest.mark.parametrize("policy", ["strict", "relaxed"])
@pytest.mark.parametrize("n_copies", [1, 4])
def test_cpu_and_async_device_randomized(reg, policy, n_copies):
    """Zero wrong results over many randomized delay schedules (SCHEDULES in total)."""
    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    lg, g, wv, rng, _ = _layer_setup(reg, [dev, cpu], n_layers=2)
    s = Scheduler([dev.new_backend(), cpu.new_backend()], n_copies=n_copies, policy=policy)
    n = max(10, SCHEDULES // 8)
    assert _run_and_check(s, lg, g, wv, rng, n) == 0
    assert s.stats.splits > 1 and s.stats.copies > 0
    assert s.stats.plans == 1, "a repeated graph must not be planned again"


@pytest.mark.parametrize("policy", ["strict", "relaxed"])
def test_two_async_devices(reg, policy):
    d0, d1, cpu = reg.device("ASYNC0"), reg.device("ASYNC1"), reg.device("CPU")
    lg, g, wv, rng, _ = _layer_setup(reg, [d0, d1], n_layers=2, seed=1)
    s = Scheduler([d0.new_backend(), d1.new_backend(), cpu.new_backend()], policy=policy,
                  n_copies=2)  # fmt: skip
    assert _run_and_check(s, lg, g, wv, rng, max(10, SCHEDULES // 8)) == 0
    used = {sp.backend for sp in s._plans[next(iter(s._plans))].splits}
    assert {0, 1} <= used


@contextmanager
def _device_and_cpu(reg, *, on_device=(), on_cpu=(), device_leafs=(), cpu_leafs=(), **kw):
    """A scheduler over ASYNC0 and the CPU with those nodes pinned and those leafs allocated on
    each; yields (scheduler, the device's backend) and frees it all."""
    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    bufs = [alloc_tensors(list(ts), d.buffer_type) for ts, d in ((device_leafs, dev), (cpu_leafs, cpu)) if ts]
    db, cb = dev.new_backend(), cpu.new_backend()
    s = Scheduler([db, cb], **kw)
    for n in on_device:
        s.set_tensor_backend(n, db)
    for n in on_cpu:
        s.set_tensor_backend(n, cb)
    try:
        yield s, db
    finally:
        s.free()
        db.free()
        cb.free()
        for b in bufs:
            b.free()


@pytest.mark.parametrize("policy", ["strict", "relaxed"])
def test_computes_queued_behind_each_other(reg, policy):
    """Computes queued back to back without a synchronize (two copy slots), each one's result
    read by a copy queued behind it: a host split at the start of a graph (pinned to the CPU)
    feeding the device must not overwrite its output while the last compute still copies it
    to the device, nor the inputs be overwritten under a queued copy. Every result against the
    float64 oracle; each compute after the first counts as queued behind."""
    ctx = Context()
    x = ctx.new_tensor(GGMLType.F32, (16, 64), "x").set_input()
    w = ctx.new_tensor(GGMLType.F32, (16, 64), "w")
    h = ctx.scale(x, 2.0)
    y = ctx.mul(h, w)
    g = ctx.graph(y)
    rng = np.random.default_rng(5)
    wv = rng.standard_normal((16, 64)).astype(np.float32)
    with _device_and_cpu(reg, on_cpu=[h], device_leafs=[w], cpu_leafs=[x], n_copies=2,
                         policy=policy) as (s, db):  # fmt: skip
        w.set(wv)
        for _ in range(max(4, SCHEDULES // 100)):
            xs = [rng.standard_normal((16, 64)).astype(np.float32) for _ in range(6)]
            outs = [np.zeros(y.nbytes, np.uint8) for _ in xs]
            before = s.stats.queued_behind
            for xv, out in zip(xs, outs, strict=True):
                s.alloc_graph(g)
                x.set(xv)
                s.graph_compute(g)
                db.get_tensor_async(y, out)
            s.synchronize()
            assert s.stats.queued_behind - before == len(xs) - 1
            for xv, out in zip(xs, outs, strict=True):
                want = reference.evaluate(g, {x: xv, w: wv})[y].reshape(16, 64)
                np.testing.assert_allclose(out.view(np.float32).reshape(16, 64), want, rtol=1e-6)


@pytest.mark.parametrize("rows", [16, 2048])
def test_relaxed_read_of_a_cpu_output_is_waited_for_by_the_next_allocation(reg, monkeypatch, capsys, rows):
    """Relaxed: graph_compute returns before the device has read a CPU split's output (16 rows:
    in place, caps.host_reads; 2048 rows, over HOST_READ_BYTES: through a copy), and the
    scheduler does not wait for that read; the next allocation of another plan does, so that
    plan's input, taking that memory and written right away, cannot change what the device reads.
    ACCELPLANE_SCHED_DEBUG=1 shows which splits read in place."""
    monkeypatch.setenv("ACCELPLANE_TEST_DELAY_US", "20000")  # read by the backends made below
    monkeypatch.setenv("ACCELPLANE_SCHED_DEBUG", "1")
    ca, cb_ = Context(), Context()
    xa = ca.new_tensor(GGMLType.F32, (rows, 64), "xa").set_input()
    w = ca.new_tensor(GGMLType.F32, (rows, 64), "w")
    h = ca.scale(xa, 2.0)
    ya = ca.mul(h, w)
    ga = ca.graph(ya)
    xb = cb_.new_tensor(GGMLType.F32, (4 * rows, 64), "xb").set_input()  # over xa's and h's memory
    yb = cb_.scale(xb, 3.0)
    gb = cb_.graph(yb)
    rng = np.random.default_rng(9)
    wv = rng.standard_normal((rows, 64)).astype(np.float32)
    with _device_and_cpu(reg, on_cpu=[h, yb], device_leafs=[w], policy="relaxed") as (s, db):
        w.set(wv)
        for _ in range(3):
            xv = rng.standard_normal((rows, 64)).astype(np.float32)
            s.alloc_graph(ga)
            xa.set(xv)
            s.graph_compute(ga)
            assert s._host_reads, "the device's read of h was waited for before graph_compute returned"
            assert s.stats.copies == (rows > 16)
            s.alloc_graph(gb)
            xb.set(np.full((4 * rows, 64), np.nan, np.float32))
            s.graph_compute(gb)
            s.synchronize()
            want = reference.evaluate(ga, {xa: xv, w: wv})[ya].reshape(rows, 64)
            np.testing.assert_allclose(ya.get(), want, rtol=1e-6)
    assert ("reads CPU outputs in place" in capsys.readouterr().err) is (rows <= 16)


def test_relaxed_syncs_fewer(reg):
    """Weights on the device, inputs on the CPU: relaxed does at most 2 host syncs per split
    with inputs, and fewer than strict."""
    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    counts = {}
    for policy in ("strict", "relaxed"):
        lg, g, wv, rng, _ = _layer_setup(reg, [dev], seed=2)
        s = Scheduler([dev.new_backend(), cpu.new_backend()], policy=policy)
        assert _run_and_check(s, lg, g, wv, rng, 3) == 0
        plan = s._plans[next(iter(s._plans))]
        with_inputs = sum(1 for sp in plan.splits if sp.inputs)
        counts[policy] = s.stats.host_syncs
        if policy == "relaxed":
            assert s.stats.host_syncs <= 2 * with_inputs
    assert counts["relaxed"] < counts["strict"], counts


@pytest.mark.parametrize("policy", ["strict", "relaxed"])
@pytest.mark.parametrize("n_copies", [1, 2])
def test_graph_input_copied_once_per_backend(reg, policy, n_copies):
    """A graph input read by two device splits (a host split between them) is copied to the
    device once per compute, by the first split; the second reads that copy (``reused``) and,
    relaxed with one copy slot, the host split's output where it is (caps.host_reads). The
    results, over randomized delay schedules, are the float64 oracle's. An input a node writes
    into is copied again by every split that reads it (its value changes within the compute)."""
    ctx = Context()
    x = ctx.new_tensor(GGMLType.F32, (16, 64), "x").set_input()
    w = ctx.new_tensor(GGMLType.F32, (16, 64), "w")
    m0 = ctx.mul(x, w)
    h = ctx.scale(m0, 0.5)  # on the host
    m1 = ctx.mul(h, w)
    y = ctx.add(m1, x)  # the device again, reading x again
    g = ctx.graph(y)
    rng = np.random.default_rng(6)
    wv = rng.standard_normal((16, 64)).astype(np.float32)
    with _device_and_cpu(reg, on_device=[m0, m1, y], on_cpu=[h], device_leafs=[w], cpu_leafs=[x],
                         n_copies=n_copies, policy=policy) as (s, _):  # fmt: skip
        w.set(wv)
        for _ in range(max(4, SCHEDULES // 100)):
            s.alloc_graph(g)
            xv = rng.standard_normal((16, 64)).astype(np.float32)
            x.set(xv)
            s.compute(g)
            want = reference.evaluate(g, {x: xv, w: wv})[y].reshape(16, 64)
            np.testing.assert_allclose(y.get(), want, rtol=1e-5, atol=1e-6)
        splits = s._plans[next(iter(s._plans))].splits
        assert [sp.backend for sp in splits] == [0, 1, 0]
        assert [i.src for i in splits[0].inputs] == [x] and not splits[0].reused
        assert [i.src for i in splits[2].reused] == [x] and x not in [i.src for i in splits[2].inputs]
        # the host split's output: read where it is by a device that reaches host memory
        # (relaxed, one copy slot), else copied
        in_place = policy == "relaxed" and n_copies == 1
        assert splits[2].host_reads is in_place
        assert s.stats.copies == 3 - in_place, "x to the device once, the host split's input (and output)"
    # an input written in place by a node: each device split copies it itself
    ctx = Context()
    x = ctx.new_tensor(GGMLType.F32, (16, 64), "x").set_input()
    d0 = ctx.scale(x, 2.0)
    h = ctx.scale(d0, 0.5)
    c = ctx.cpy(h, x)
    d1 = ctx.scale(c, 3.0)
    y = ctx.add(d1, x)
    g = ctx.graph(y)
    with _device_and_cpu(reg, on_device=[d0, d1, y], on_cpu=[h, c], cpu_leafs=[x], n_copies=n_copies,
                         policy=policy) as (s, _):  # fmt: skip
        s.alloc_graph(g)
        dev_splits = [sp for sp in s._plans[next(iter(s._plans))].splits if sp.backend == 0]
        assert len(dev_splits) == 2 and all(not sp.reused for sp in dev_splits)
        assert all(x in [i.src for i in sp.inputs] for sp in dev_splits)


def test_cpu_buffer_type_is_the_accelerators_host_memory(reg, monkeypatch):
    """A scheduler's default buffer types: with one accelerator whose host buffer type it reaches
    only through copies (the asynchronous test device's, as a GPU's pinned memory), the CPU's is
    that type; with two accelerators, or one that computes on its host memory, the CPU's own."""
    cpu, d0, d1 = reg.device("CPU"), reg.device("ASYNC0"), reg.device("ASYNC1")
    cases = [([d0], d0.host_buffer_type), ([d0, d0], d0.host_buffer_type), ([d0, d1], cpu.buffer_type)]
    for devs, want in cases:
        backends = [d.new_backend() for d in (*devs, cpu)]
        try:
            s = Scheduler(backends)
            assert want is not None and s.bufts[-1] is want, [d.name for d in devs]
            s.free()
        finally:
            for b in backends:
                b.free()
    monkeypatch.setitem(d0._fn, "supports_buft", lambda device, buft: buft.device is device)
    backends = [d0.new_backend(), cpu.new_backend()]
    try:
        s = Scheduler(backends)
        assert s.bufts[-1] is cpu.buffer_type
        s.free()
    finally:
        for b in backends:
            b.free()


def test_inputs_released(reg):
    """Scheduler.inputs_released: after graph_compute, True when every graph input was copied
    to its split's device (so the caller may write the next step's while the device runs);
    False before any compute and when the asynchronous device reads an input in place."""
    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    for on_device in (False, True):
        ctx = Context()
        x = ctx.new_tensor(GGMLType.F32, (4, 8), "x").set_input()
        w = ctx.new_tensor(GGMLType.F32, (4, 8), "w")
        y = ctx.mul(x, w)
        g = ctx.graph(y)
        bufs = [alloc_tensors([w, *([x] if on_device else [])], dev.buffer_type)]
        if not on_device:
            bufs.append(alloc_tensors([x], cpu.buffer_type))
        s = Scheduler([dev.new_backend(), cpu.new_backend()])
        try:
            assert not s.inputs_released()
            xv, wv = np.arange(32, dtype=np.float32).reshape(4, 8), np.full((4, 8), 2.0, np.float32)
            w.set(wv)
            s.alloc_graph(g)
            x.set(xv)
            s.graph_compute(g)
            assert s.inputs_released() is (not on_device)
            if not on_device:
                x.set(-xv)  # the next step's input, written while the device may still run
            s.synchronize()
            np.testing.assert_array_equal(y.get(), xv * wv)
        finally:
            s.free()
            for b in bufs:
                b.free()


def test_plan_cache_and_rereservation(reg):
    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    lg, g, wv, rng, bufs = _layer_setup(reg, [dev])
    s = Scheduler([dev.new_backend(), cpu.new_backend()])
    _run_and_check(s, lg, g, wv, rng, 3)
    assert s.stats.plans == 1
    # weights move to the CPU: the graph is planned again and now runs on the CPU
    for b in bufs:
        b.free()
    for w in lg.weights:
        w.buffer = None
    alloc_tensors(lg.weights, cpu.buffer_type)
    for t, v in wv.items():
        t.set(v)
    assert _run_and_check(s, lg, g, wv, rng, 2) == 0
    assert s.stats.plans == 2


def test_unsupported_node_fails_at_planning(reg, monkeypatch):
    cpu = reg.device("CPU")
    ctx = Context()
    x = ctx.new_tensor(GGMLType.F32, (4, 8), "x").set_input()
    y = ctx.sin(x)
    g = ctx.graph(y)
    monkeypatch.setitem(cpu._fn, "supports_op", lambda device, op: op.op.name != "SIN")
    s = Scheduler([cpu.new_backend()])
    with pytest.raises(UnsupportedOpError, match="SIN"):
        s.alloc_graph(g)


def test_pinned_backend_that_cannot_run_fails(reg, monkeypatch):
    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    ctx = Context()
    x = ctx.new_tensor(GGMLType.F32, (4, 8), "x").set_input()
    y = ctx.cos(x)
    g = ctx.graph(y)
    bd = dev.new_backend()
    monkeypatch.setitem(dev._fn, "supports_op", lambda device, op: op.op.name != "COS")
    s = Scheduler([bd, cpu.new_backend()])
    s.set_tensor_backend(y, bd)
    with pytest.raises(UnsupportedOpError, match="pinned"):
        s.alloc_graph(g)


def test_last_backend_must_be_cpu(reg):
    with pytest.raises(DeviceError):
        Scheduler([reg.device("ASYNC0").new_backend()])


def test_from_devices_falls_back_and_reports_placement(reg, monkeypatch):
    """The host API's front door: Scheduler.from_devices puts the CPU last, a node the first
    device declines runs on the CPU, placement() and get_tensor_backend() say where each node
    ran after compute, and the result is the oracle's."""
    import accelplane.runtime.registry as registry

    monkeypatch.setattr(registry, "get_registry", lambda: reg)
    dev = reg.device("ASYNC0")
    monkeypatch.setitem(dev._fn, "supports_op", lambda device, op: op.op.name != "SIN")
    default = Scheduler.from_devices()  # the test devices stand for accelerators
    assert [b.device.name for b in default.backends] == ["ASYNC0", "ASYNC1", "CPU"]
    default.free()
    s = Scheduler.from_devices(["ASYNC0"])
    assert [b.device.name for b in s.backends] == ["ASYNC0", "CPU"]
    ctx = Context()
    x = ctx.new_tensor(GGMLType.F32, (4, 8), "x").set_input()
    y = ctx.scale(ctx.sin(ctx.scale(x, 2.0)), 3.0)
    g = ctx.graph(y)
    alloc_tensors([x], dev.buffer_type)  # inputs set before the scheduler allocates
    v = np.random.default_rng(0).standard_normal((4, 8))
    x.set(v)
    s.compute(g)
    placed = [(n.op.name, b.device.name) for n, b in s.placement()]
    assert placed == [("SCALE", "ASYNC0"), ("SIN", "CPU"), ("SCALE", "ASYNC0")]
    assert s.get_tensor_backend(y).device.name == "ASYNC0", "readable after compute"
    np.testing.assert_allclose(y.get(), 3.0 * np.sin(2.0 * v.astype(np.float32)), rtol=1e-6)
    owned = list(s.backends)
    s.free()
    assert all(b.freed for b in owned), "from_devices' backends are the scheduler's to free"
    with pytest.raises(TypeMismatchError):
        Scheduler.from_devices("ASYNC0")


def test_eval_callback(reg):
    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    lg, g, wv, rng, _ = _layer_setup(reg, [dev])
    s = Scheduler([dev.new_backend(), cpu.new_backend()])
    seen = []

    def cb(t, ask):
        if ask:
            return t.op is not None and t.op.name == "RMS_NORM"
        seen.append(t.get().copy())
        return True

    s.set_eval_callback(cb)
    assert _run_and_check(s, lg, g, wv, rng, 1) == 0
    assert len(seen) == 2  # attention and FFN norms, observed with their values
    rms = np.sqrt(np.mean(seen[0].astype(np.float64) ** 2, axis=-1))
    np.testing.assert_allclose(rms, 1.0, rtol=1e-3)
    # returning False stops the compute
    s.set_eval_callback(lambda t, ask: bool(ask))
    s.compute(g)


def test_check_results_mode(reg, monkeypatch):
    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    monkeypatch.setenv("ACCELPLANE_CHECK_RESULTS", "1")
    lg, g, wv, rng, _ = _layer_setup(reg, [dev])
    s = Scheduler([dev.new_backend(), cpu.new_backend()])
    assert _run_and_check(s, lg, g, wv, rng, 1) == 0
    # a device whose SOFT_MAX is wrong: check-results names the node, op and backend
    from accelplane.cpu import plan as cpu_plan

    real = cpu_plan.BUILDERS[cpu_plan.Op.SOFT_MAX]

    def bad_softmax(t, view):
        step = real(t, view)
        out = view(t)
        return lambda: (step(), out.__setitem__((Ellipsis, 0), out[..., 0] + 0.5))

    monkeypatch.setitem(cpu_plan.BUILDERS, cpu_plan.Op.SOFT_MAX, bad_softmax)
    lg, g, wv, rng, _ = _layer_setup(reg, [dev], seed=5)
    s = Scheduler([dev.new_backend(), cpu.new_backend()])
    s.alloc_graph(g)
    for t, v in lg.inputs(rng).items():
        t.set(v)
    with pytest.raises(CheckResultsError, match=r"SOFT_MAX.*ASYNC0"):
        s.compute(g)


def _moe_setup(reg, seed=0, n_layers=3, n_tokens=3):
    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    m = moe_layers(n_expert=16, n_used=2, n_tokens=n_tokens, n_layers=n_layers)
    g = m.ctx.graph(m.out)
    rng = np.random.default_rng(seed)
    routers = [t for t in m.ctx.tensors if t.name.endswith("router")]
    alloc_tensors(routers, dev.buffer_type)
    alloc_tensors(m.experts, cpu.buffer_type)  # experts stay in host memory
    vals = {}
    for t in routers + m.experts:
        v = (rng.standard_normal(t.shape) / np.sqrt(t.shape[-1])).astype(np.float32)
        t.set(v)
        vals[t] = v
    return m, g, vals, rng, cpu, dev


def _moe_scheduler(m, cpu, dev, **kw) -> Scheduler:
    """A scheduler over a new backend of ``dev`` and the CPU with every MUL_MAT_ID on ``dev``."""
    bd = dev.new_backend()
    s = Scheduler([bd, cpu.new_backend()], **kw)
    for n in m.mul_mat_ids:
        s.set_tensor_backend(n, bd)
    return s


def _moe_compute_exact(s, m, g, vals, rng) -> None:
    """One compute on new inputs, checked against the float64 oracle."""
    s.alloc_graph(g)
    xv = rng.standard_normal(m.x.shape).astype(np.float32)
    m.x.set(xv)
    s.compute(g)
    want = reference.evaluate(g, {**vals, m.x: xv})[m.out].reshape(m.out.shape)
    np.testing.assert_allclose(m.out.get(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prefetch", [0, 3])  # 3: a whole layer's inputs, so no upload syncs the host
@pytest.mark.parametrize("policy", ["strict", "relaxed"])
def test_moe_expert_upload(reg, prefetch, policy):
    """Experts in host memory computed on the asynchronous test device (random delays on its
    streams): decode-sized batches upload only the selected experts; prefill-sized ones are
    prefetched on a second stream. Either way the copies share a few slots that later layers
    reuse, and every result equals the float64 oracle's."""
    m, g, vals, rng, cpu, dev = _moe_setup(reg, n_tokens=48 if prefetch else 3)
    s = _moe_scheduler(m, cpu, dev, prefetch_experts=prefetch, policy=policy)
    for _ in range(max(5, SCHEDULES // 40)):
        _moe_compute_exact(s, m, g, vals, rng)
    if prefetch:
        assert s.stats.prefetched > 0
    else:
        # only the selected experts travel: 3 tokens × 2 of 16 experts
        assert 0 < s.stats.expert_bytes <= s.stats.expert_bytes_total * 6 / 16
        # the host waits once per layer, to read the ids its three uploads share; the copies
        # queue on the reading split's stream with no wait (20 / 26 host syncs when each upload
        # read the ids and waited for its slot)
        assert s.stats.host_syncs <= 3 * 3, s.stats.host_syncs
    # the slots: one split's three expert inputs plus the prefetch depth, not all nine
    one = m.experts[0].nbytes
    assert 0 < s.expert_pool_bytes < (3 + prefetch + 1) * one < len(m.experts) * one, s.expert_pool_bytes


def test_moe_compute_after_a_stopped_one_is_exact(reg):
    """An eval callback that stops a compute leaves prefetched experts unread: the computes
    after it are still exact (the next compute waits for those copies before it reuses their
    slots, and synchronize waits for the prefetch streams too)."""
    m, g, vals, rng, cpu, dev = _moe_setup(reg, n_tokens=48)
    s = _moe_scheduler(m, cpu, dev, prefetch_experts=3)
    for _ in range(5):
        s.alloc_graph(g)
        m.x.set(rng.standard_normal(m.x.shape).astype(np.float32))
        s.set_eval_callback(lambda t, ask: t.op is Op.MUL_MAT_ID if ask else False)
        s.compute(g)  # stops after the first MUL_MAT_ID
        assert s.stats.prefetched > 0
        s.set_eval_callback(None)
        _moe_compute_exact(s, m, g, vals, rng)


def test_moe_prefetch_skips_batches_that_use_few_experts(reg):
    """A decode's batch selects a few experts: uploading those beats prefetching whole tensors."""
    m, g, vals, rng, cpu, dev = _moe_setup(reg, n_tokens=2)
    s = _moe_scheduler(m, cpu, dev, prefetch_experts=2)
    _moe_compute_exact(s, m, g, vals, rng)
    assert s.stats.prefetched == 0 and s.stats.expert_bytes <= s.stats.expert_bytes_total * 4 / 16


def test_views_placed_once_while_nothing_moves(reg, monkeypatch):
    """A repeated graph (a decode step) places no views again; once another graph grows the
    allocator's buffers, its tensors move, their views are placed again and results stay right."""
    from accelplane.runtime.backend import Buffer

    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    lg, g, wv, rng, _ = _layer_setup(reg, [dev], seed=3)
    s = Scheduler([dev.new_backend(), cpu.new_backend()])
    assert _run_and_check(s, lg, g, wv, rng, 2) == 0
    assert any(p.clones for p in s._plans.values()), "the case needs split-input views"
    calls: list = []
    orig = Buffer.init_view
    monkeypatch.setattr(Buffer, "init_view", lambda self, t: (calls.append(t), orig(self, t))[1])
    assert _run_and_check(s, lg, g, wv, rng, 3) == 0
    assert calls == []
    lg2, g2, wv2, rng2, _ = _layer_setup(reg, [dev], seed=4, n_tokens=40)  # 6x the activations
    assert _run_and_check(s, lg2, g2, wv2, rng2, 1) == 0
    calls.clear()
    assert _run_and_check(s, lg, g, wv, rng, 2) == 0
    assert calls, "moved tensors must have their views placed again"
