"""The host side: op batches (ACCELPLANE_HEXAGON_OPBATCH), the per-graph cache (an unchanged
graph is not prepared again, counted), and fusion (RMS_NORM+MUL, matmuls sharing their
activations) giving the same results as the ops apart."""

from __future__ import annotations

import numpy as np
import pytest
from accelplane.core.graph import Context
from accelplane.core.types import GGMLType
from accelplane.errors import ConfigError
from accelplane.runtime.alloc import GraphAllocator

from accelplane_hexagon.runtime import Options

T = GGMLType


def _chain(n_ops: int):
    ctx = Context()
    x = ctx.new_tensor(T.F32, (4, 64), "x")
    y = x
    for i in range(n_ops):
        y = ctx.scale(y, 1.0 + i / 8, 0.5) if i % 2 else ctx.silu(y)
    return ctx, x, ctx.graph(y), y


def test_unchanged_graph_is_prepared_once(htp, backend, placed, rng):
    ctx, x, g, y = _chain(6)
    placed.put(htp.buffer_type, x, *g.nodes)
    st = backend.ctx
    before = st.plans.builds
    outs = []
    for _ in range(3):
        x.set(rng.standard_normal((4, 64)))
        backend.compute(g)
        outs.append(y.get())
    assert st.plans.builds == before + 1, "a re-run of an unchanged graph must not re-prepare"
    assert st.batches_sent >= 3
    g.layout_version += 1  # the allocator moved something: prepare again
    backend.compute(g)
    assert st.plans.builds == before + 2


@pytest.mark.parametrize("opbatch,batches", [(1024, 1), (4, 3), (1, 10)])
def test_ops_go_in_batches(htp, placed, rng, opbatch, batches):
    ctx, x, g, y = _chain(10)
    placed.put(htp.buffer_type, x, *g.nodes)
    v = rng.standard_normal((4, 64))
    x.set(v)
    ref = htp.new_backend("opbatch=1024")
    ref.compute(g)
    want = y.get()
    b = htp.new_backend(f"opbatch={opbatch}")
    b.compute(g)
    assert len(b.ctx.plans.get(g).batches) == batches
    assert b.ctx.batches_sent == batches  # one NPU call per batch
    assert np.array_equal(y.get(), want)
    for be in (b, ref):
        be.free()


def test_options_from_env_and_params(monkeypatch):
    assert Options.parse() == Options(1024, True, True)
    monkeypatch.setenv("ACCELPLANE_HEXAGON_OPBATCH", "16")
    monkeypatch.setenv("ACCELPLANE_HEXAGON_OPFUSION", "0")
    monkeypatch.setenv("ACCELPLANE_HEXAGON_ACC", "fp32")
    assert Options.parse() == Options(16, False, False)
    assert Options.parse("opbatch=2, fusion=1, acc=fp16") == Options(2, True, True)
    for bad in ("opbatch=0", "opbatch=x", "acc=bf16", "threads=4", "opbatch", "fusion=maybe"):
        with pytest.raises(ConfigError):
            Options.parse(bad)
    monkeypatch.setenv("ACCELPLANE_HEXAGON_ACC", "bf16")
    with pytest.raises(ConfigError, match="ACCELPLANE_HEXAGON_ACC='bf16': expected one of fp16, fp32"):
        Options.parse()


# --- fusion -------------------------------------------------------------------------------------
def _run(htp, g, outs, fusion: bool):
    b = htp.new_backend(f"fusion={int(fusion)}")
    b.compute(g)
    res = [o.get() for o in outs]
    fused = dict(b.ctx.plans.get(g).fused)
    b.free()
    return res, fused


def test_rms_norm_mul_fusion(htp, placed, rng):
    ctx = Context()
    x = ctx.new_tensor(T.F32, (3, 5, 96), "x")
    w = ctx.new_tensor(T.F32, (96,), "w")
    y = ctx.silu(ctx.mul(ctx.rms_norm(x, 1e-5), w))
    g = ctx.graph(y)
    placed.put(htp.buffer_type, x, w)
    GraphAllocator(htp.buffer_type).alloc_graph(g)
    x.set(rng.standard_normal(x.shape))
    w.set(rng.standard_normal(w.shape))
    (on,), f_on = _run(htp, g, [y], True)
    (off,), f_off = _run(htp, g, [y], False)
    assert f_on == {"rms_norm_mul": 1} and f_off == {}
    assert np.array_equal(on, off)


def test_no_fusion_when_the_norm_is_read_elsewhere(htp, placed, rng):
    ctx = Context()
    x = ctx.new_tensor(T.F32, (4, 64), "x")
    w = ctx.new_tensor(T.F32, (64,), "w")
    n = ctx.rms_norm(x, 1e-6)
    y = ctx.add(ctx.mul(n, w), n)  # the normalized rows are needed again
    g = ctx.graph(y)
    placed.put(htp.buffer_type, x, w, *g.nodes)
    x.set(rng.standard_normal(x.shape))
    w.set(rng.standard_normal(w.shape))
    (on,), fused = _run(htp, g, [y], True)
    (off,), _ = _run(htp, g, [y], False)
    assert fused == {} and np.array_equal(on, off)


@pytest.mark.parametrize("wtype", [T.Q4_0, T.Q8_0, T.F16], ids=str)
def test_qkv_and_ffn_matmul_fusion(htp, repack, placed, rng, wtype):
    """Q/K/V projections of one normalized input (with ops between them, as in a model graph)
    and an FFN's gate and up projections: graph_optimize brings each group together before
    allocation, then they fuse; same bits as apart."""
    d, ff, n_tok = 128, 96, 5
    ctx = Context()
    x = ctx.new_tensor(T.F32, (n_tok, d), "x")
    ws = {k: ctx.new_tensor(wtype, (d if k in "qkvo" else ff, d), f"w{k}") for k in "qkvgu"}
    wd = ctx.new_tensor(wtype, (d, ff), "wd")
    cur = ctx.rms_norm(x, 1e-6)
    q = ctx.reshape(ctx.mul_mat(ws["q"], cur), (n_tok, 4, 32))
    k = ctx.reshape(ctx.mul_mat(ws["k"], cur), (n_tok, 4, 32))
    v = ctx.mul_mat(ws["v"], cur)
    att = ctx.add(ctx.reshape(ctx.mul(q, k), (n_tok, d)), v)
    gate, up = ctx.mul_mat(ws["g"], att), ctx.mul_mat(ws["u"], att)
    y = ctx.mul_mat(wd, ctx.swiglu(gate, up))
    g = ctx.graph(y)
    placed.put(repack if wtype != T.F16 else htp.buffer_type, *ws.values(), wd)
    placed.put(htp.buffer_type, x)
    order = list(g.nodes)
    b = htp.new_backend()
    b.graph_optimize(g)
    b.free()
    assert g.nodes != order and sorted(map(id, g.nodes)) == sorted(map(id, order))
    mms = [i for i, n in enumerate(g.nodes) if n.op.name == "MUL_MAT"]
    assert mms[1] == mms[0] + 1 and mms[2] == mms[0] + 2, "Q, K, V next to each other"
    GraphAllocator(htp.buffer_type).alloc_graph(g)
    for w in (*ws.values(), wd):
        w.set(rng.uniform(-0.2, 0.2, w.shape))
    x.set(rng.standard_normal(x.shape))
    (on,), fused = _run(htp, g, [y], True)
    (off,), _ = _run(htp, g, [y], False)
    assert fused == {"mul_mat_x3": 1, "mul_mat_x2": 1}
    assert np.isfinite(on).all() and np.array_equal(on, off)


def test_matmul_not_hoisted_over_a_reader_of_reused_memory(htp, placed, rng):
    """mm2's output reuses mm1's memory once mm1's reader has run: running mm2 early (fused
    with mm1) would clobber mm1 before it is read, so it must stay unfused."""
    ctx = Context()
    x = ctx.new_tensor(T.F32, (4, 64), "x").set_input()
    w1 = ctx.new_tensor(T.Q8_0, (32, 64), "w1")
    w2 = ctx.new_tensor(T.Q8_0, (32, 64), "w2")
    mm1 = ctx.mul_mat(w1, x)
    c = ctx.cont(mm1)
    mm2 = ctx.mul_mat(w2, x)
    y = ctx.add(c, mm2)
    g = ctx.graph(y)
    placed.put(htp.buffer_type, w1, w2)
    GraphAllocator(htp.buffer_type).alloc_graph(g)
    assert (mm2.buffer, mm2.offs) == (mm1.buffer, mm1.offs), "the allocator reuses mm1's memory"
    for t in (x, w1, w2):
        t.set(rng.uniform(-1, 1, t.shape))
    (on,), fused = _run(htp, g, [y], True)
    (off,), _ = _run(htp, g, [y], False)
    assert fused == {} and np.array_equal(on, off)


def test_fused_weights_of_mixed_quant_types(htp, repack, placed, rng):
    """Q4_0 and Q8_0 weights share the same Q8_0 activations, so they fuse too."""
    ctx = Context()
    x = ctx.new_tensor(T.F32, (3, 64), "x")
    w4 = ctx.new_tensor(T.Q4_0, (40, 64), "w4")
    w8 = ctx.new_tensor(T.Q8_0, (24, 64), "w8")
    y4, y8 = ctx.mul_mat(w4, x), ctx.mul_mat(w8, x)
    g = ctx.graph(y4, y8)
    placed.put(repack, w4)
    placed.put(htp.buffer_type, w8, x, y4, y8)
    for t in (x, w4, w8):
        t.set(rng.uniform(-1, 1, t.shape))
    on, fused = _run(htp, g, [y4, y8], True)
    off, _ = _run(htp, g, [y4, y8], False)
    assert fused == {"mul_mat_x2": 1}
    assert all(np.array_equal(a, b) for a, b in zip(on, off, strict=True))


def test_kernel_params_are_computed_on_the_host(htp, backend, placed):
    """The op descriptors carry what the kernels need, computed once when preparing."""
    ctx = Context()
    a = ctx.new_tensor(T.F32, (3, 4, 64), "a")
    pos = ctx.new_tensor(T.I32, (3,), "pos")
    w = ctx.new_tensor(T.Q8_0, (40, 64), "w")
    r = ctx.rope(a, pos, 64, freq_base=5000.0)
    s = ctx.soft_max(r, None, 0.5)
    y = ctx.mul_mat(w, ctx.reshape(s, (12, 64)))
    g = ctx.graph(y)
    placed.put(htp.buffer_type, *ctx.tensors)
    GraphAllocator(htp.buffer_type).alloc_graph(g)
    (batch,) = backend.ctx.plans.get(g).batches
    ops = batch.req.ops
    rope, sm, mm = ops[0].kp.rope, ops[1].kp.softmax, ops[2].kp.mm
    assert rope.theta_scale == pytest.approx(5000.0 ** (-2 / 64)) and rope.n_dims == 64
    assert sm.scale == 0.5
    assert (mm.n_mm, mm.n_kt, mm.acc_f16) == (1, 2, 1)
    assert ops[2].vtcm_need >= 12 * mm.q_row_bytes and batch.req.vtcm_size >= ops[2].vtcm_need
