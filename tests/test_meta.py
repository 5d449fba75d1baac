"""Tensor parallelism (accelplane.parallel.meta): split states, scatter/gather, the llama layer split over
2, 3 and 4 devices (CPU backends, the asynchronous test device, a mix) against the same graph
on one device, butterfly and ring byte for byte, compressed all-reduce, uneven and empty
slices, fused QKV, quantized weights, a KV-cache attention, MoE's delayed all-reduce, PARTIAL
inputs set from the host and read by linear and non-linear ops (a property test), typed
errors, and the same layer over 2 and 4 MPI ranks (mpirun), including a rank that hangs or dies.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import accelplane.cpu.plugin as cpu_plugin
import numpy as np
import pytest
from accelplane.bench.tp import LayerParams, layer_values, megatron_split, single, tensor_parallel
from accelplane.core.graph import Context
from accelplane.core.types import GGMLType
from accelplane.errors import DeviceError, ShapeError, UnsupportedOpError
from accelplane.models.blocks import moe_layers
from accelplane.oracle import reference
from accelplane.parallel.meta import MetaDevice, Segment, SplitAxis, SplitState, split_sizes
from accelplane.runtime.alloc import GraphAllocator, alloc_tensors
from accelplane.runtime.backend import Device
from accelplane.runtime.registry import Registry
from accelplane.testing import asyncdev
from fuzzing import examples
from hypothesis import assume, given, settings
from hypothesis import strategies as st

T = GGMLType
U32 = 2.0**-24
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def cpu() -> Device:
    reg = Registry()
    assert reg.register(cpu_plugin, "cpu") is not None, reg.failures
    return reg.device("CPU")


@pytest.fixture(scope="module")
def adevs() -> list[Device]:
    """4 asynchronous test devices (random delays, events, their own comm)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ACCELPLANE_ASYNCDEV_NDEV", "4")
        mp.setenv("ACCELPLANE_TEST_DELAY_US", "30")
        reg = Registry()
        assert reg.register(asyncdev, "asynctest") is not None, reg.failures
        yield reg.devices_of("asynctest")


def _devices(kind: str, n: int, cpu: Device, adevs: list[Device]) -> list[Device]:
    if kind == "cpu":
        return [cpu] * n
    if kind == "async":
        return adevs[:n]
    return [adevs[0], cpu, adevs[1], cpu][:n]  # mixed plugins: the SDK's comm fallback


def _close(got: np.ndarray, want: np.ndarray, what: str, rel: float = 64 * U32) -> None:
    """Within F32 rounding: |got - want| <= rel * max|want| (a few dozen ulps of the scale)."""
    err = float(np.abs(got - want).max())
    assert err <= rel * float(np.abs(want).max()), f"{what}: max error {err:.3g}"


# --- split states --------------------------------------------------------------------------------------
def test_split_sizes():
    assert split_sizes(4, 3) == (2, 1, 1)
    assert split_sizes(2, 3) == (1, 1, 0)
    assert split_sizes(128, 3) == (43, 43, 42)
    assert split_sizes(64, 2, 16) == (32, 32)
    assert split_sizes(96, 2, 32, weights=[1, 2]) == (32, 64)
    with pytest.raises(ShapeError, match="granules"):
        split_sizes(10, 2, 4)


def test_split_state_canonical_and_blocks():
    qkv = SplitState.segmented(1, [((4, 4), 1), ((2, 2), 2)])
    assert qkv.length == 16 and qkv.local(0) == 8
    assert qkv.blocks() == [(0, 4), (1, 4), (0, 2), (1, 2), (0, 2), (1, 2)]
    assert qkv.local_blocks(1) == [(4, 0, 4), (10, 4, 2), (14, 6, 2)]
    # equal rounds merge: the same layout compares equal however it was written
    two = SplitState.segmented(0, [((3, 3), 1), ((3, 3), 1)])
    assert two == SplitState(SplitAxis.AXIS_0, (Segment((3, 3), 2),))
    assert str(qkv) == "AXIS_1[4,4 | 2,2x2]"
    with pytest.raises(ShapeError):
        SplitState(SplitAxis.MIRRORED, (Segment((1, 1)),))
    with pytest.raises(ShapeError):
        SplitState.segmented(0, [((1, 1), 1), ((1, 1, 1), 1)])


# --- scatter / gather ---------------------------------------------------------------------------------
def test_set_get_every_state(cpu):
    n = 3
    meta = MetaDevice([cpu] * n)
    ctx = Context()
    states = {
        "a0": lambda t: meta.split(t, 0),
        "a1": lambda t: meta.split(t, 1, 2),
        "a2": lambda t: meta.split(t, 2),
        "seg": lambda t: meta.split(t, 1, 1, segments=[(6, 1), (3, 2)]),
        "mir": lambda t: None,
        "part": lambda t: SplitState.partial(),
        "q8": lambda t: meta.split(t, 0),
    }
    shapes = {"a0": (2, 5, 9), "a1": (3, 12, 4), "a2": (7, 3, 2), "seg": (2, 12, 5), "mir": (4, 4),
              "part": (3, 5), "q8": (4, 96)}  # fmt: skip
    ts = {k: ctx.new_tensor(T.Q8_0 if k == "q8" else T.F32, s, k) for k, s in shapes.items()}
    buf = meta.alloc_weights(ctx, lambda t: states[t.name](t))
    rng = np.random.default_rng(0)
    for k, t in ts.items():
        v = rng.standard_normal(shapes[k]).astype(np.float32)
        t.set(v)
        if k == "q8":  # quantized: the shards hold exactly the bytes of the whole tensor
            ref = Context().new_tensor(T.Q8_0, shapes[k], "ref")
            rb = alloc_tensors([ref], cpu.buffer_type)
            ref.set(v)
            assert np.array_equal(t.get_bytes(), ref.get_bytes())
            assert meta.state_of(t).local(0) == 32  # whole blocks
            rb.free()
        else:
            assert np.array_equal(t.get(), v), k
    # a mirrored tensor's every copy holds the whole value
    assert all(np.array_equal(sh.get(), ts["mir"].get()) for sh in meta.shards(ts["mir"]))
    # a shard is the device's slice: AXIS_1 split [6, 4, 2] of 12 rows in granules of 2
    sh = meta.shards(ts["a1"])
    assert [s.ne[1] for s in sh] == [4, 4, 4]
    assert np.array_equal(sh[1].get(), ts["a1"].get()[:, 4:8])
    # a PARTIAL tensor reads back as the sum of its shards
    before = ts["part"].get()
    meta.shards(ts["part"])[2].set(np.ones((3, 5), np.float32))
    assert np.allclose(ts["part"].get(), before + 1)
    # partial writes through a view of a split tensor (read-modify-write of the owner)
    v = ctx.view(ts["a0"], (3, 5), (4, 36), 4 * 2)
    v.set(np.full((5, 3), 7, np.float32))
    assert (ts["a0"].get()[0, :, 2:5] == 7).all()
    buf.free()
    meta.free()


# --- the llama layer ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("kind", ["cpu", "async", "mixed"])
def test_layer_matches_single_device(cpu, adevs, kind, n):
    p = LayerParams(n_layers=2)
    weights, inputs = layer_values(p.build(), seed=n)
    want = single(cpu, p, weights)(inputs)
    run = tensor_parallel(_devices(kind, n, cpu, adevs), p, weights)
    for rep in range(3):  # repeated runs reuse the plan and must not race
        _close(run(inputs), want, f"{kind} x{n} run {rep}")
    st = run.meta.stats
    assert st.plans == 1 and st.allreduces == 2 * p.n_layers and st.gathers == 0, st
    lines = "\n".join(run.meta.describe(run.graph))
    assert "PARTIAL -> all-reduce" in lines and "AXIS_2" in lines
    g = run.graph
    oracle = reference.evaluate(g, {**{w: weights[w.name] for w in run.lg.weights},
                                    **{t: inputs[t.name] for t in (run.lg.x, run.lg.pos, run.lg.mask)}})
    _close(run.lg.out.get(), oracle[run.lg.out].reshape(run.lg.out.shape), "vs oracle", rel=1e-5)
    run.meta.free()


@pytest.mark.parametrize(("kind", "env", "why"), [
    ("async", None, ""),
    ("async", "0", "ACCELPLANE_META_RECORD=0"),
    ("cpu", None, "all-reduces ran through butterfly"),  # the CPU plugin has no comm
    ("mixed", None, "all-reduces ran through butterfly"),
])  # fmt: skip
def test_recorded_steps_replay_with_new_inputs(cpu, adevs, monkeypatch, kind, env, why):
    """From the second compute on, backends that can record replay the steps with one call
    each, reading the inputs set since; where they cannot, the steps run as before."""
    if env is not None:
        monkeypatch.setenv("ACCELPLANE_META_RECORD", env)
    p = LayerParams(n_layers=2)
    weights, _ = layer_values(p.build(), seed=5)
    ref = single(cpu, p, weights)
    run = tensor_parallel(_devices(kind, 2, cpu, adevs), p, weights)
    for rep in range(4):
        _, inputs = layer_values(p.build(), seed=100 + rep)  # new inputs every compute
        _close(run(inputs), ref(inputs), f"{kind} rep {rep}")
    st = run.meta.stats
    assert st.computes == 4 and st.record_error == why, st
    assert st.replays == (3 if not why else 0), st
    run.meta.free()


def test_weights_allocated_again_replan(cpu, adevs):
    """The same graph after its weights were freed and allocated again with another split:
    the next compute plans anew (and drops the old recording) and gives the same results."""
    p = LayerParams(n_layers=1)
    weights, inputs = layer_values(p.build(), seed=8)
    want = single(cpu, p, weights)(inputs)
    run = tensor_parallel(adevs[:2], p, weights)
    for _ in range(3):  # the third compute replays the recording
        _close(run(inputs), want, "first weights")
    assert run.meta.stats.plans == 1 and run.meta.stats.replays == 2
    for buf in run.meta._weights:
        buf.free()
    for w in run.lg.weights:
        w.buffer, w.extra = None, None
    run.meta.alloc_weights(run.lg.weights, lambda t: None)  # every weight mirrored now
    for w in run.lg.weights:
        w.set(weights[w.name])
    _close(run(inputs), want, "weights mirrored")
    st = run.meta.stats
    assert st.plans == 2 and st.replays == 2 and st.allreduces == 0, st
    run.meta.free()


def test_recording_that_fails_runs_the_steps(adevs, cpu, monkeypatch):
    """A backend whose record_end fails: the plan runs unrecorded, with the same results."""
    p = LayerParams(n_layers=1)
    weights, _ = layer_values(p.build(), seed=6)
    ref = single(cpu, p, weights)
    run = tensor_parallel(adevs[:2], p, weights)
    bad = run.meta.backends[1]
    end = type(bad).record_end

    def failing_end(self):  # stops recording as usual, then reports a failure for one backend
        rec = end(self)
        return None if self is bad else rec

    monkeypatch.setattr(type(bad), "record_end", failing_end)
    for rep in range(3):
        _, inputs = layer_values(p.build(), seed=200 + rep)
        _close(run(inputs), ref(inputs), f"rep {rep}")
    st = run.meta.stats
    assert st.replays == 0 and st.record_error == "a backend's recording failed", st
    run.meta.free()


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("kind", ["cpu", "async"])
def test_butterfly_and_ring_agree_byte_for_byte(cpu, adevs, kind, n):
    p = LayerParams(n_layers=2, d_model=96, n_head=6, n_kv_head=3, d_ff=160)
    weights, inputs = layer_values(p.build(), seed=10 + n)
    outs = {}
    for algo in ("butterfly", "ring"):
        run = tensor_parallel(_devices(kind, n, cpu, adevs), p, weights, algorithm=algo)
        outs[algo] = run(inputs)
        assert run.meta.stats.algorithms == {algo: 2 * p.n_layers}
        run.meta.free()
    assert outs["butterfly"].tobytes() == outs["ring"].tobytes()


@pytest.mark.parametrize("algo", ["butterfly", "ring"])
@pytest.mark.parametrize("wire", ["bf16", "f16"])
def test_compressed_allreduce_within_wire_rounding(cpu, wire, algo):
    p = LayerParams(n_layers=1)
    weights, inputs = layer_values(p.build(), seed=3)
    n = 4
    plain = single(cpu, p, weights)(inputs)
    run = tensor_parallel([cpu] * n, p, weights, algorithm=algo, compress=wire, compress_threshold=0)
    got = run(inputs)
    lg = run.lg
    oracle = reference.evaluate(run.graph, {**{w: weights[w.name] for w in lg.weights},
                                            **{t: inputs[t.name] for t in (lg.x, lg.pos, lg.mask)}})
    u = {"bf16": 2.0**-8, "f16": 2.0**-11}[wire]
    _close(got, oracle[lg.out].reshape(lg.out.shape), f"compressed {wire} vs oracle", rel=n * u)
    assert not np.array_equal(got, plain), "the partials were not compressed"
    run.meta.free()


def test_uneven_and_empty_slices(cpu, adevs):
    # 3 devices over 4 kv heads: (2, 1, 1) heads; FFN 96 columns: (32, 32, 32)
    p = LayerParams(d_model=64, n_head=8, n_kv_head=4, d_ff=96, n_layers=1)
    weights, inputs = layer_values(p.build(), seed=5)
    want = single(cpu, p, weights)(inputs)
    run = tensor_parallel([adevs[0], adevs[1], cpu], p, weights)
    _close(run(inputs), want, "3 over 4 kv heads")
    assert str(run.meta.state_of(run.lg.weights[2])) == "AXIS_1[16,8,8]"  # wk
    run.meta.free()
    # 4 devices over 2 kv heads: two devices hold no attention at all (their wo term is 0)
    p = LayerParams(n_layers=2)
    weights, inputs = layer_values(p.build(), seed=6)
    want = single(cpu, p, weights)(inputs)
    run = tensor_parallel([cpu] * 4, p, weights)
    _close(run(inputs), want, "empty attention slices")
    assert [s.nelements for s in run.meta.shards(run.lg.weights[4])].count(0) == 2  # wo: (1,0,1,0) heads
    run.meta.free()
    # query heads split without regard to the kv groups: correct, through a gather
    p = LayerParams(n_layers=1)
    weights, inputs = layer_values(p.build(), seed=6)
    want = single(cpu, p, weights)(inputs)
    run = tensor_parallel([cpu] * 3, p, weights, split=lambda m, q: megatron_split(m, q, q_granularity=16))
    _close(run(inputs), want, "misaligned query heads")
    assert run.meta.stats.gathers > 0
    run.meta.free()


def test_quantized_weights(cpu):
    p = LayerParams(d_model=64, n_head=4, n_kv_head=2, d_ff=96, wtype=T.Q8_0)
    weights, inputs = layer_values(p.build(), seed=8)
    want = single(cpu, p, weights)(inputs)
    run = tensor_parallel([cpu] * 3, p, weights)
    wd = next(w for w in run.lg.weights if w.name.endswith("w_down"))
    assert str(run.meta.state_of(wd)) == "AXIS_0[32,32,32]"  # whole Q8_0 blocks
    _close(run(inputs), want, "Q8_0 weights")
    run.meta.free()


def test_fused_qkv_segments(cpu, adevs):
    """wqkv rows [q | k | v] split per segment; q, k, v are views of the fused product."""
    d, hd, nh, nkv, nt = 64, 16, 4, 2, 5
    ekv = nkv * hd

    def build(ctx: Context):
        x = ctx.new_tensor(T.F32, (nt, d), "x").set_input()
        wqkv = ctx.new_tensor(T.F32, (d + 2 * ekv, d), "wqkv").set_param()
        wo = ctx.new_tensor(T.F32, (d, d), "wo").set_param()
        qkv = ctx.mul_mat(wqkv, x)  # [nt, d + 2 ekv]
        q = ctx.view(qkv, (hd, nh, nt), (4, hd * 4, qkv.nb[1]), 0)
        k = ctx.view(qkv, (hd, nkv, nt), (4, hd * 4, qkv.nb[1]), d * 4)
        v = ctx.view(qkv, (hd, nkv, nt), (4, hd * 4, qkv.nb[1]), (d + ekv) * 4)
        qh, kh = ctx.permute(q, 0, 2, 1, 3), ctx.cont(ctx.permute(k, 0, 2, 1, 3))
        vt = ctx.cont(ctx.permute(v, 1, 2, 0, 3))
        att = ctx.mul_mat(vt, ctx.soft_max(ctx.mul_mat(kh, qh), None, 0.25))
        o = ctx.reshape(ctx.cont(ctx.permute(att, 0, 2, 1, 3)), (nt, d))
        return x, wqkv, wo, ctx.mul_mat(wo, o)

    rng = np.random.default_rng(2)
    xv = rng.standard_normal((nt, d)).astype(np.float32)
    wv = {"wqkv": (rng.standard_normal((d + 2 * ekv, d)) / 8).astype(np.float32),
          "wo": (rng.standard_normal((d, d)) / 8).astype(np.float32)}  # fmt: skip
    c1 = Context()
    x1, q1, o1, out1 = build(c1)
    g1 = c1.graph(out1)
    buf = alloc_tensors([q1, o1], cpu.buffer_type)
    q1.set(wv["wqkv"])
    o1.set(wv["wo"])
    GraphAllocator(cpu.buffer_type).alloc_graph(g1)
    x1.set(xv)
    cpu.new_backend().compute(g1)
    want = out1.get()
    for devs in ([cpu, cpu], [adevs[0], adevs[1]]):
        meta = MetaDevice(devs)
        c2 = Context()
        x2, q2, o2, out2 = build(c2)
        meta.alloc_weights([q2], lambda t, m=meta: m.split(t, 1, hd, [(d, 1), (ekv, 2)]))
        meta.alloc_weights([o2], lambda t, m=meta: m.split(t, 0, 2 * hd))
        q2.set(wv["wqkv"])
        o2.set(wv["wo"])
        assert np.array_equal(meta.shards(q2)[1].get()[:32], wv["wqkv"][32:64])  # device 1's q
        g2 = c2.graph(out2)
        meta.alloc_graph(g2)
        x2.set(xv)
        meta.compute(g2)
        _close(out2.get(), want, "fused QKV")
        assert meta.stats.gathers == 0 and meta.stats.allreduces == 1
        meta.free()
    buf.free()


def _kv_attention(ctx: Context, n_ctx: int, nt: int, n_kv: int, caches=None):
    """One attention step over a KV cache: K and V rows per position written with SET_ROWS,
    the attended window read back as per-head views (V transposed by a CONT)."""
    d, hd, nh, nkv = 32, 8, 4, 2
    ekv = nkv * hd
    x = ctx.new_tensor(T.F32, (nt, d), "x").set_input()
    pos = ctx.new_tensor(T.I32, (nt,), "pos").set_input()
    mask = ctx.new_tensor(T.F32, (nt * 2, n_kv), "mask").set_input()
    if caches is None:
        w = {k: ctx.new_tensor(T.F32, s, k).set_param() for k, s in
             (("wq", (d, d)), ("wk", (ekv, d)), ("wv", (ekv, d)), ("wo", (d, d)))}  # fmt: skip
        kc = ctx.new_tensor(T.F32, (n_ctx, ekv), "cache_k")
        vc = ctx.new_tensor(T.F32, (n_ctx, ekv), "cache_v")
        caches = (w, kc, vc)
    w, kc, vc = caches
    q = ctx.reshape_ne(ctx.mul_mat(w["wq"], x), hd, nh, nt)
    k = ctx.mul_mat(w["wk"], x)
    v = ctx.mul_mat(w["wv"], x)
    ks = ctx.set_rows(kc, k, pos)
    vs = ctx.set_rows(vc, v, pos)
    kk = ctx.view(ks, (hd, n_kv, nkv), (4, ekv * 4, hd * 4))
    vv = ctx.cont(ctx.permute(ctx.view(vs, (hd, n_kv, nkv), (4, ekv * 4, hd * 4)), 1, 0, 2, 3))
    qg = ctx.reshape_ne(ctx.cont(ctx.permute(ctx.reshape_ne(q, hd, 2, nkv, nt), 0, 1, 3, 2)), hd, 2 * nt, nkv)
    kq = ctx.soft_max(ctx.mul_mat(kk, qg), mask, hd**-0.5)
    o = ctx.cont(ctx.permute(ctx.reshape_ne(ctx.mul_mat(vv, kq), hd, 2, nt, nkv), 0, 1, 3, 2))
    out = ctx.mul_mat(w["wo"], ctx.reshape_ne(o, d, nt))
    return x, pos, mask, out, caches


def test_kv_cache_attention(cpu, adevs):
    n_ctx, hd = 16, 8
    rng = np.random.default_rng(4)
    wvals = {"wq": rng.standard_normal((32, 32)), "wk": rng.standard_normal((16, 32)),
             "wv": rng.standard_normal((16, 32)), "wo": rng.standard_normal((32, 32))}  # fmt: skip
    steps = [(0, 3), (3, 1), (4, 1)]  # (first position, tokens): a prefill, then decode steps
    xs = [rng.standard_normal((nt, 32)).astype(np.float32) for _, nt in steps]

    def run(meta: MetaDevice | None) -> list[np.ndarray]:
        outs, caches, bufs, ga, be = [], None, [], GraphAllocator(cpu.buffer_type), cpu.new_backend()
        for (p0, nt), xv in zip(steps, xs, strict=True):
            n_kv = 8
            ctx = Context()
            x, pos, mask, out, caches = _kv_attention(ctx, n_ctx, nt, n_kv, caches)
            if p0 == 0:
                ws = [*caches[0].values(), caches[1], caches[2]]
                if meta is None:
                    bufs.append(alloc_tensors(ws, cpu.buffer_type))
                else:
                    role = {"wq": (1, 2 * hd), "wk": (1, hd), "wv": (1, hd), "wo": (0, 2 * hd),
                            "cache_k": (0, hd), "cache_v": (0, hd)}  # fmt: skip
                    bufs.append(meta.alloc_weights(ws, lambda t, r=role: meta.split(t, *r[t.name])))
                bufs[-1].clear(0)
                for k, v in wvals.items():
                    caches[0][k].set((v / 6).astype(np.float32))
            g = ctx.graph(out)
            (ga if meta is None else meta).alloc_graph(g)
            x.set(xv)
            pos.set(np.arange(p0, p0 + nt, dtype=np.int32))
            slots = np.arange(n_kv)
            m = np.where(slots[None, :] <= np.arange(p0, p0 + nt)[:, None], 0.0, -np.inf)
            mask.set(np.repeat(m, 2, axis=0).astype(np.float32))
            if meta is None:
                be.compute(g)
            else:
                meta.compute(g)
            outs.append(out.get())
        if meta is not None:
            # the caches hold the whole sequence, split by kv head
            assert meta.state_of(caches[1]).axis == SplitAxis.AXIS_0
            assert caches[1].get()[:5].any() and not caches[1].get()[5:].any()
        return outs

    want = run(None)
    for devs in ([cpu, cpu], adevs[:2], [adevs[0], cpu]):
        meta = MetaDevice(devs)
        for a, b in zip(run(meta), want, strict=True):
            _close(a, b, "kv-cache attention")
        assert meta.stats.gathers == 0
        meta.free()


def test_moe_all_reduce_is_delayed(cpu, adevs):
    """Experts' gate/up column-parallel, down row-parallel: one all-reduce per layer, after
    the router-weighted sum of the experts (ggml's delayed cut), not one per expert."""
    mg = moe_layers(n_layers=2)
    g = mg.ctx.graph(mg.out)
    ws = [t for t in mg.ctx.tensors if t is not mg.x]
    rng = np.random.default_rng(9)
    wv = {t: (rng.standard_normal(t.shape) / np.sqrt(t.shape[-1])).astype(np.float32) for t in ws}
    xv = rng.standard_normal(mg.x.shape).astype(np.float32)
    want = reference.evaluate(g, {**wv, mg.x: xv})[mg.out].reshape(mg.out.shape)
    meta = MetaDevice(adevs[:3])
    meta.alloc_weights(ws, lambda t: meta.split(t, 0 if t.name.endswith("down") else 1)
                       if t.name.endswith(("gate", "up", "down")) else None)  # fmt: skip
    for t, v in wv.items():
        t.set(v)
    meta.alloc_graph(g)
    mg.x.set(xv)
    meta.compute(g)
    _close(mg.out.get(), want.astype(np.float32), "moe", rel=1e-5)
    assert meta.stats.allreduces == 2 and meta.stats.gathers == 0
    assert meta.stats.reduce_bytes == 2 * mg.out.nbytes  # the summed output, not per expert
    meta.free()


# --- per-op rules against the oracle ----------------------------------------------------------------
def _case_fused_gate_up(ctx, meta):
    """gate|up fused in one weight (segments), the split form of SWIGLU pairs each device's halves."""
    x = ctx.new_tensor(T.F32, (5, 16), "x")
    wgu = ctx.new_tensor(T.F32, (2 * 24, 16), "wgu")
    wd = ctx.new_tensor(T.F32, (16, 24), "wd")
    gu = ctx.mul_mat(wgu, x).set_name("gu")
    act = ctx.swiglu(gu).set_name("act")
    return ctx.mul_mat(wd, act).set_name("out"), {
        "wgu": lambda t: meta.split(t, 1, 1, [(24, 2)]), "wd": lambda t: meta.split(t, 0)}, {
        "gu": "AXIS_0[8,8,8x2]", "act": "AXIS_0[8,8,8]", "out": "PARTIAL"}  # fmt: skip


def _case_tokens(ctx, meta):
    """Tokens split (the input's outer axis): norms, products and rope per device."""
    x = ctx.new_tensor(T.F32, (6, 16), "x")
    pos = ctx.new_tensor(T.I32, (6,), "pos")
    w = ctx.new_tensor(T.F32, (16, 16), "w")
    h = ctx.mul_mat(w, ctx.rms_norm(x)).set_name("h")
    r = ctx.rope_neox(ctx.reshape(h, (6, 2, 8)), pos, 8).set_name("r")
    return ctx.scale(r, 0.5).set_name("out"), {"x": lambda t: meta.split(t, 1)}, {
        "h": "AXIS_1[2,2,2]", "r": "AXIS_2[2,2,2]"}  # fmt: skip


def _case_reductions(ctx, meta):
    """Sums over a split axis are terms of a sum; argmax of split rows keeps the split."""
    a = ctx.new_tensor(T.F32, (4, 9), "a")
    s_all = ctx.sum(a).set_name("s_all")
    s_rows = ctx.sum_rows(a).set_name("s_rows")
    am = ctx.argmax(ctx.transpose(ctx.cont(ctx.transpose(a)))).set_name("am")
    r = ctx.reshape(s_rows, (4,))
    both = ctx.add(ctx.scale(r, 2.0), r).set_name("both")  # linear: still a term of the sum
    return [s_all, both, am], {"a": lambda t: meta.split(t, 0)}, {
        "s_all": "PARTIAL", "s_rows": "PARTIAL", "both": "PARTIAL", "am": "MIRRORED"}  # fmt: skip


def _case_rows_and_cache(ctx, meta):
    """GET_ROWS of a column-split table, CPY into a cache with the same split, CONCAT."""
    table = ctx.new_tensor(T.F32, (10, 12), "table")
    ids = ctx.new_tensor(T.I32, (4,), "ids")
    cache = ctx.new_tensor(T.F32, (4, 12), "cache")
    e = ctx.get_rows(table, ids).set_name("e")
    c = ctx.cpy(ctx.scale(e, 3.0), cache).set_name("c")
    cat = ctx.concat(e, c, 1).set_name("cat")
    return ctx.sqr(cat).set_name("out"), {
        "table": lambda t: meta.split(t, 0, 2), "cache": lambda t: meta.split(t, 0, 2)}, {
        "e": "AXIS_0[4,4,4]", "c": "AXIS_0[4,4,4]", "cat": "AXIS_0[4,4,4]"}  # fmt: skip


def _case_vocab_argmax(ctx, meta):
    """An output head split by vocabulary: the logits stay split, their argmax gathers them."""
    x = ctx.new_tensor(T.F32, (3, 8), "x")
    head = ctx.new_tensor(T.F32, (30, 8), "head")
    logits = ctx.mul_mat(head, x).set_name("logits")
    return [logits, ctx.argmax(logits).set_name("ids")], {"head": lambda t: meta.split(t, 1)}, {
        "logits": "AXIS_0[10,10,10]", "ids": "MIRRORED"}  # fmt: skip


RULE_CASES = {"fused_gate_up": (_case_fused_gate_up, 0), "tokens": (_case_tokens, 0),
              "reductions": (_case_reductions, 1), "rows_and_cache": (_case_rows_and_cache, 0),
              "vocab_argmax": (_case_vocab_argmax, 1)}  # fmt: skip


@pytest.mark.parametrize("case", list(RULE_CASES))
def test_op_rules(cpu, adevs, case):
    build, gathers = RULE_CASES[case]
    meta = MetaDevice([adevs[0], cpu, adevs[1]])
    ctx = Context()
    outs, states, want_states = build(ctx, meta)
    outs = outs if isinstance(outs, list) else [outs]
    meta.split_state = lambda t: states[t.name](t) if t.name in states else None
    g = ctx.graph(*outs)
    rng = np.random.default_rng(1)
    vals = {}
    for t in g.leafs:
        if t.type == T.I32:
            vals[t] = rng.integers(0, t.ne[0] if t.name == "pos" else 10, t.shape).astype(np.int32)
        else:
            vals[t] = rng.standard_normal(t.shape).astype(np.float32)
    weights = [t for t in g.leafs if t.name in states and t.name != "x"]
    meta.alloc_weights(weights)
    meta.alloc_graph(g)
    for t, v in vals.items():
        t.set(v)
    meta.compute(g)
    oracle = reference.evaluate(g, vals)
    for o in outs:
        want = oracle[o].reshape(o.shape)
        if o.type == T.I32:
            assert np.array_equal(o.get(), want), o.name
        else:
            _close(o.get(), want.astype(np.float32), f"{case}: {o.name}", rel=1e-5)
    lines = {ln.split()[1]: ln.split()[-1] if "->" not in ln else ln.split()[-3]
             for ln in meta.describe(g)[1:]}  # fmt: skip
    for name, state in want_states.items():
        assert lines[name] == state, (name, lines[name])
    assert meta.stats.gathers == gathers, meta.stats
    meta.free()


# --- PARTIAL inputs ------------------------------------------------------------------------------------
# readers of a PARTIAL x (y: another PARTIAL tensor, w: a mirrored weight): linear ones keep the
# state PARTIAL (the flag), the others read the all-reduced sum
PARTIAL_READERS = {
    "silu": (False, lambda ctx, x, y, w: ctx.silu(x)),
    "rms_norm": (False, lambda ctx, x, y, w: ctx.rms_norm(x)),
    "soft_max": (False, lambda ctx, x, y, w: ctx.soft_max(x)),
    "mul_partial": (False, lambda ctx, x, y, w: ctx.mul(x, y)),
    "sqr_of_transpose": (False, lambda ctx, x, y, w: ctx.sqr(ctx.transpose(x))),
    "transposed_twice": (False, lambda ctx, x, y, w: _transposed_twice(ctx, x, w)),
    "scale": (True, lambda ctx, x, y, w: ctx.scale(x, 0.5)),
    "add_partial": (True, lambda ctx, x, y, w: ctx.add(x, y)),
    "mul_mat": (True, lambda ctx, x, y, w: ctx.mul_mat(w, x)),
}


def _transposed_twice(ctx: Context, x, w):
    """x transposed, squared (the sum of the strided view is a packed copy), and transposed back
    for a product (the view must be laid out as x again: a product's weight is never transposed)."""
    t = ctx.transpose(x)
    return ctx.add(ctx.sqr(t), ctx.mul_mat(ctx.transpose(t), w))


def _partial_graph(meta: MetaDevice, readers: list[str], x_out: bool, where: str):
    """x and y PARTIAL (graph inputs, or weights), read by ``readers`` in that order."""
    ctx = Context()
    x = ctx.new_tensor(T.F32, (3, 8), "x")
    y = ctx.new_tensor(T.F32, (3, 8), "y")
    w = ctx.new_tensor(T.F32, (8, 8), "w")
    meta.split_state = lambda t: SplitState.partial() if t.name in ("x", "y") else None
    meta.alloc_weights([w, x, y] if where == "weight" else [w])
    outs = [PARTIAL_READERS[r][1](ctx, x, y, w).set_name(r) for r in readers]
    return x, y, w, outs, ctx.graph(*outs, *([x] if x_out else []))


def _check_partial(g, outs, vals: dict, what: str) -> None:
    oracle = reference.evaluate(g, vals)
    for o in outs:
        _close(o.get(), oracle[o].reshape(o.shape).astype(np.float32), f"{what}: {o.name}", rel=1e-5)


@settings(max_examples=examples(30, 500), deadline=None)
@given(kind=st.sampled_from(["cpu", "async", "mixed"]), n=st.sampled_from([2, 3]),
       readers=st.lists(st.sampled_from(sorted(PARTIAL_READERS)), min_size=1, max_size=4, unique=True),
       x_out=st.booleans(), where=st.sampled_from(["input", "input", "weight"]),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_partial_inputs_set_from_the_host(cpu, adevs, kind, n, readers, x_out, where, seed):
    """A PARTIAL x set from the host holds the value set (device 0 the value, the others
    zeros), whatever reads it: the graph computes from it after every set (after alloc_graph,
    between computes, before alloc_graph), get() reads it back, and setting the shards one by one
    gives each device a term of the sum."""
    assume(any(not PARTIAL_READERS[r][0] for r in readers))  # at least one reader needs the sum
    meta = MetaDevice(_devices(kind, n, cpu, adevs))
    try:
        x, y, w, outs, g = _partial_graph(meta, readers, x_out, where)
        rng = np.random.default_rng(seed)
        w.set(wv := rng.standard_normal(w.shape).astype(np.float32))
        inputs = [t for t in (x, y) if t in g.leafs]  # y only where a reader takes it
        for step in ("after alloc", "between computes", "before alloc"):
            vals = {t: rng.standard_normal(t.shape).astype(np.float32) for t in inputs}
            if step == "after alloc":
                meta.alloc_graph(g)
            for t, v in vals.items():
                t.set(v)
            if step == "before alloc":
                meta.alloc_graph(g)
            meta.compute(g)
            _check_partial(g, outs, {**vals, w: wv}, f"{readers} {step}")
            for t, v in vals.items():  # the shards still sum to the value set, exactly
                assert np.array_equal(t.get(), v), (step, t.name)
        assert meta.state_of(x) == SplitState.partial()
        shards = meta.shards(x)
        assert len(shards) == n and all(s.shape == x.shape for s in shards)
        terms = [rng.standard_normal(x.shape).astype(np.float32) for _ in range(n)]
        for s, v in zip(shards, terms, strict=True):
            s.set(v)
        meta.compute(g)
        xv = np.sum(terms, axis=0, dtype=np.float64).astype(np.float32)
        _close(x.get(), xv, "x from terms")
        _check_partial(g, outs, {**{t: t.get() for t in inputs}, w: wv}, f"{readers} terms")
    finally:
        meta.free()


@pytest.mark.parametrize("where", ["input", "weight"])
def test_write_into_a_summed_partial_raises(cpu, where):
    """A CPY into a PARTIAL tensor, before or after a reader needed its sum, raises: the write
    would land in the all-reduce's copy (or terms), not in the tensor the host reads."""
    for order in ("read first", "write first"):
        meta = MetaDevice([cpu, cpu], lambda t: SplitState.partial() if t.name == "c" else None)
        ctx = Context()
        c = ctx.new_tensor(T.F32, (4,), "c")
        src = ctx.new_tensor(T.F32, (4,), "src")
        if where == "weight":
            meta.alloc_weights([c])
        y = ctx.silu(c) if order == "read first" else None
        out = ctx.cpy(src, c)
        g = ctx.graph(*([y] if y is not None else []), out)
        with pytest.raises(UnsupportedOpError, match="writes into .*c"):
            meta.alloc_graph(g)
        meta.free()


# --- errors ------------------------------------------------------------------------------------------
def test_typed_errors(cpu):
    meta = MetaDevice([cpu, cpu])
    ctx = Context()
    w = ctx.new_tensor(T.F32, (6, 4), "w")
    with pytest.raises(ShapeError, match="covers 5"):
        meta.alloc_weights([w], lambda t: SplitState.split(1, (2, 3)))
    with pytest.raises(ShapeError, match="3 devices"):
        meta.alloc_weights([w], lambda t: SplitState.split(1, (2, 2, 2)))
    with pytest.raises(ShapeError, match="granules"):
        meta.alloc_weights([w], lambda t: meta.split(t, 1, 4))
    q = ctx.new_tensor(T.Q8_0, (2, 64), "q")
    with pytest.raises(ShapeError, match="blocks"):
        meta.alloc_weights([q], lambda t: SplitState.split(0, (16, 48)))
    assert w.buffer is None and q.buffer is None  # nothing allocated on error
    # a write into a destination split along its rows, addressed by global row indices
    c = ctx.new_tensor(T.F32, (8, 4), "cache")
    meta.alloc_weights([c], lambda t: meta.split(t, 1))
    rows = ctx.new_tensor(T.I32, (2,), "rows")
    src = ctx.new_tensor(T.F32, (2, 4), "src")
    with pytest.raises(UnsupportedOpError, match="rows"):
        meta.alloc_graph(ctx.graph(ctx.set_rows(c, src, rows)))
    # an I32 value split across devices cannot be gathered for a mirrored consumer
    m2 = MetaDevice([cpu, cpu], lambda t: m2.split(t, 0) if t.name == "ids" else None)
    table = ctx.new_tensor(T.F32, (5, 4), "table")
    m2.alloc_weights([table])
    ids = ctx.new_tensor(T.I32, (4,), "ids")
    with pytest.raises(UnsupportedOpError, match="I32"):
        m2.alloc_graph(ctx.graph(ctx.get_rows(table, ids)))
    # a leaf in a plain buffer is not the meta device's
    plain = ctx.new_tensor(T.F32, (4,), "plain")
    pb = alloc_tensors([plain], cpu.buffer_type)
    with pytest.raises(DeviceError, match="outside"):
        meta.alloc_graph(ctx.graph(ctx.sqr(plain)))
    with pytest.raises(DeviceError, match="Device nor a Backend"):
        MetaDevice([cpu, "CPU"])
    pb.free()
    m2.free()
    meta.free()
    with pytest.raises(DeviceError, match="after free"):
        meta.alloc_weights([ctx.new_tensor(T.F32, (2,), "late")])


# --- MPI ---------------------------------------------------------------------------------------------
def _mpi_missing() -> str | None:
    if shutil.which("mpirun") is None:
        return "mpirun not found (scripts/system-deps-mpi installs Debian's OpenMPI)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py not installed (scripts/system-deps-mpi installs it)"
    return None


mpi = pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))


def _mpirun(n: int, *args: str, timeout_s: float = 2.0, limit: float = 90) -> tuple[int, str, float]:
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(n), sys.executable,
           str(HERE / "mpi_worker.py"), *args]  # fmt: skip
    # (vader's single-copy mechanism needs ptrace rights that containers often lack)
    env = {**os.environ, "ACCELPLANE_MPI_TIMEOUT": str(timeout_s),
           "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}  # fmt: skip
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env, cwd=HERE)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


@mpi
@pytest.mark.parametrize("ranks,local", [(2, 2), (4, 1)])
def test_mpi_ranks_match_single_process(ranks, local):
    rc, out, _ = _mpirun(ranks, "--local", str(local), timeout_s=60)
    assert rc == 0, out
    assert out.count("-> ok") == ranks, out
    assert f"devices {ranks * local}" in out and "'mpi': 4" in out


@mpi
def test_mpi_hung_rank_fails_the_others_in_bounded_time():
    rc, out, dt = _mpirun(2, "--mode", "hang", timeout_s=2)
    assert rc != 0
    assert "CommTimeoutError" in out and "waited 2 s" in out, out
    assert dt < 30, f"took {dt:.1f} s"


@mpi
def test_mpi_dead_rank_ends_the_job():
    rc, out, dt = _mpirun(4, "--mode", "die", timeout_s=5)
    assert rc != 0 and "-> ok" not in out, out
    assert dt < 30, f"took {dt:.1f} s"


# --- bench -------------------------------------------------------------------------------------------
def test_bench_tp_reports_bandwidth_and_tokens(cpu, adevs):
    from accelplane.bench import bench_tp, format_tp

    res = bench_tp([cpu, adevs[0], adevs[1]], counts=[2, 3], sizes=[4096], min_time=0.01, runs=1,
                   layer=LayerParams(n_tokens=4))  # fmt: skip
    ar = {(r["n"], r["algorithm"]): r for r in res["allreduce"]}
    assert ar[(2, "ring")]["used"] == "ring" and ar[(3, "butterfly")]["busbw_gbps"] > 0
    assert ar[(2, "plugin")]["used"] == "" and "comm" in ar[(2, "plugin")]["note"]  # mixed plugins
    assert all(r["memcpy_gbps"] > 0 for r in res["allreduce"])
    splits = [(r["split"], r["n"]) for r in res["layers"]]
    assert splits == [("none", 1), ("tensor", 2), ("tensor", 3)]
    assert all(r["tokens_per_s"] > 0 for r in res["layers"])
    text = format_tp(res)
    assert "busbw GB/s" in text and "tokens/s" in text and "vs peer" not in text


def test_bench_tp_peer_rows_give_ratios(cpu, adevs):
    """A peer's rows (same device count and bytes, F32) give each of our rows its ratio."""
    from accelplane.bench import bench_tp, format_tp, parse_sizes

    assert parse_sizes("4K, 1m,1GB,512") == [4096, 1 << 20, 1 << 30, 512]
    for bad in ("", "1X", "-4K", "0"):
        with pytest.raises(ValueError, match="bad size"):
            parse_sizes(bad)
    peer = [{"algorithm": "torch.distributed", "n": 2, "dtype": "float32", "bytes": 4096,
             "us_per_call": 10.0, "busbw_gbps": 0.4096},
            {"algorithm": "torch.distributed", "n": 2, "dtype": "bfloat16", "bytes": 4096,
             "us_per_call": 5.0, "busbw_gbps": 0.8192}]  # fmt: skip
    res = bench_tp([adevs[0], adevs[1]], counts=[2], sizes=[4096, 8192], min_time=0.01, runs=1,
                   layer=LayerParams(n_tokens=4), peer=peer)  # fmt: skip
    rows = {(r["algorithm"], r["bytes"]): r for r in res["allreduce"]}
    ring = rows[("ring", 4096)]
    assert ring["vs_peer"] == pytest.approx(ring["busbw_gbps"] / 0.4096)  # the F32 row, not BF16
    assert "vs_peer" not in rows[("ring", 8192)]  # no peer row of that size
    text = format_tp(res)
    assert "vs peer" in text and "torch.distributed" in text
