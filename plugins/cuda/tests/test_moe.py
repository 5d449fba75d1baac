"""MUL_MAT_ID on the GPU (accelplane_cuda.moe): a row at a time for a decode's few tokens (the
register mat-vec's body per (token, slot) for its layouts, else a warp per weight row), and
grouped by expert on the tensor cores for a prefill's many, against float64 numpy on the gguf
package's dequantization."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from accelplane.core.graph import Context
from accelplane.core.types import GGMLType, quantize
from accelplane.errors import ComputeError
from accelplane.runtime.alloc import alloc_tensors
from accelplane.runtime.backend import BufferUsage
from accelplane_cuda.moe import GROUPED_MIN_TOKENS
from test_cuda import _cuda

T = GGMLType
SDK_QUANTIZED = (T.Q4_K, T.Q6_K, T.IQ4_XS)  # gguf cannot quantize these; tests/test_types.py: ggml's bytes
REGISTER_LAYOUTS = (T.Q4_0, T.Q8_0, T.Q4_K)  # in a weights buffer: the register mat-vecs' (matvec.REGISTER)


def _experts(t, rng) -> np.ndarray:
    """Random experts quantized into ``t`` [k, m, n_exp] (gguf's quantizer, else the SDK's); their
    float64 values [n_exp, m, k] (gguf's dequantization)."""
    k, m, e = t.ne[0], t.ne[1], t.ne[2]
    v = rng.standard_normal((e * m, k)).astype(np.float32)
    if t.type in (T.F32, T.F16):
        arr = v.astype(np.float16 if t.type == T.F16 else np.float32)
        t.set(arr.reshape(e, m, k))
        return arr.astype(np.float64).reshape(e, m, k)
    qt = gguf.GGMLQuantizationType[t.type.name]
    raw = (quantize(t.type, v) if t.type in SDK_QUANTIZED else gguf.quantize(v, qt)).reshape(-1)
    t.set_bytes(raw)
    return gguf.dequantize(raw, qt).reshape(e, m, k).astype(np.float64)


def _run(dev, wtype, n_tok, b1, ids_v=None, m=200, k=512, n_exp=16, n_used=4, host=False):
    rng = np.random.default_rng(n_tok)
    ctx = Context()
    w = ctx.new_tensor_ne(wtype, k, m, n_exp, name="experts")
    x = ctx.new_tensor_ne(T.F32, k, b1, n_tok, name="x")
    ids = ctx.new_tensor_ne(T.I32, n_used, n_tok, name="ids")
    y = ctx.mul_mat_id(w, x, ids)
    graph = ctx.graph(y)
    # Q4_0/Q8_0/Q4_K: the x8 layouts in device memory; host: the pinned host buffer, GGUF's layout
    wbuf = alloc_tensors([w], dev.host_buffer_type if host else dev.buffer_type, BufferUsage.WEIGHTS)
    buf = alloc_tensors([x, ids, *graph.nodes], dev.buffer_type)
    be = dev.new_backend()
    try:
        wv = _experts(w, rng)
        xv = rng.standard_normal((n_tok, b1, k)).astype(np.float32)
        if ids_v is None:
            ids_v = np.stack([rng.permutation(n_exp)[:n_used] for _ in range(n_tok)]).astype(np.int32)
        x.set(xv)
        ids.set(ids_v)
        be.compute(graph)
        names = be.ctx.plans.get(graph).kernel_names
        got = y.get().reshape(n_tok, n_used, m)
    finally:
        be.free()
        buf.free()
        wbuf.free()
    want = np.einsum("tumk,tuk->tum", wv[ids_v], xv.astype(np.float64)[:, np.arange(n_used) % b1])
    return names, got, want


SIZES = [(GROUPED_MIN_TOKENS - 1, 1), (GROUPED_MIN_TOKENS, 4), (64, 1), (300, 4)]  # (tokens, activation rows)


@pytest.mark.parametrize("wtype", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K, T.IQ4_XS, T.F16, T.F32])
@pytest.mark.parametrize("n_tok, b1", SIZES)
def test_mul_mat_id_equals_float64(wtype, n_tok, b1):
    """Experts of every layout family (the x8 ones in a weights buffer, generic block types,
    floats), 200 weight rows (not a whole number of tiles), the activations shared by the
    slots (b1 = 1, gate/up) or one per slot (down): within F16 rounding of the products."""
    names, got, want = _run(_cuda(), wtype, n_tok, b1)
    if n_tok >= GROUPED_MIN_TOKENS:
        kernel, tol = "k_moe_gemm<", 3e-3  # F16 products
    elif wtype in REGISTER_LAYOUTS:
        kernel, tol = "k_mmv_row1_id<", 2e-2  # int8 activations: ~1 % of a row's scale a step
    else:
        kernel, tol = "k_mul_mat_id<", 1e-4
    assert [n for n in names if n.startswith(("k_moe_gemm<", "k_mmv_row1_id<", "k_mul_mat_id<"))] == [
        n for n in names if n.startswith(kernel)] and any(n.startswith(kernel) for n in names), names
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < tol, (wtype, n_tok, err)


@pytest.mark.parametrize("wtype", REGISTER_LAYOUTS)
@pytest.mark.parametrize("k", [256, 768, 1536, 4096])
def test_expert_rows_of_every_length_equal_float64(wtype, k):
    """k_mmv_row1_id's lanes per row follow the row's loads (8 or 16 lanes, several rows a warp,
    for short rows such as a MoE's down products; 32 to 128 for long ones): 200 rows (a partial
    last block), one token and three, the activations shared or one per slot."""
    for n_tok, b1 in ((1, 1), (3, 4)):
        names, got, want = _run(_cuda(), wtype, n_tok, b1, k=k)
        assert any(n.startswith("k_mmv_row1_id<") for n in names), names
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 2e-2, (wtype, k, n_tok, err)


@pytest.mark.parametrize("wtype", [T.Q4_0, T.Q8_0, T.F16])
@pytest.mark.parametrize("n_tok, b1", [(1, 1), (2, 4)])
def test_experts_read_in_place_from_pinned_host_memory_equal_float64(wtype, n_tok, b1):
    """Experts in the device's pinned host buffer (a decode's share the scheduler leaves where
    it is): the warp-per-row kernel reads them through unified addressing."""
    names, got, want = _run(_cuda(), wtype, n_tok, b1, host=True)
    assert any(n.startswith("k_mul_mat_id<") for n in names), names
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4, (wtype, n_tok)


def test_expert_index_out_of_range_in_pinned_host_memory_raises():
    ids_v = np.zeros((1, 4), np.int32)
    ids_v[0, 3] = 16  # n_exp is 16
    with pytest.raises(ComputeError, match="out of range"):
        _run(_cuda(), T.Q4_0, 1, 1, ids_v=ids_v, host=True)


@pytest.mark.parametrize("wtype, b1", [(T.Q4_0, 1), (T.Q8_0, 4), (T.F16, 1)])
def test_grouped_odd_last_chunk_equals_float64(wtype, b1):
    """K of 17 32-element chunks (a stage's second chunk missing at the end) on 200 weight rows
    (a partial tile); 544 is no multiple of 256, so Q4_0 and Q8_0 keep GGUF's layout (the x8
    loaders, K a multiple of 256, never see an odd chunk)."""
    names, got, want = _run(_cuda(), wtype, 300, b1, k=544)
    assert f"k_moe_gemm<{int(wtype)}>" in names, names
    assert np.abs(got - want).max() / np.abs(want).max() < 3e-3


def test_grouped_tiles_span_experts_with_many_rows():
    """Every token choosing the same two experts: each has 300 rows, five 64-row tiles."""
    ids_v = np.tile(np.array([[3, 11]], np.int32), (300, 1))
    _, got, want = _run(_cuda(), T.Q4_0, 300, 1, ids_v=ids_v, n_used=2)
    assert np.abs(got - want).max() / np.abs(want).max() < 3e-3


@pytest.mark.parametrize("wtype, n_tok", [(T.Q4_0, 64), (T.Q4_0, 2), (T.IQ4_XS, 2)])
def test_expert_index_out_of_range_raises(wtype, n_tok):
    """Each kernel (grouped, register, warp per row) flags an id past the experts."""
    ids_v = np.zeros((n_tok, 4), np.int32)
    ids_v[1, 2] = 16  # n_exp is 16
    with pytest.raises(ComputeError, match="out of range"):
        _run(_cuda(), wtype, n_tok, 1, ids_v=ids_v)


def _gating_graph(n_exp, k, n_tok, d, norm, fusion, monkeypatch, logits_v=None):
    """The decoder's MoE gating and weighted sum (accelplane.models.decoder) of given router
    logits and expert outputs, on the GPU: the plan's fused runs and every result."""
    from accelplane.models.decoder import moe_gating, moe_weighted_sum

    monkeypatch.setenv("ACCELPLANE_FUSION", "1" if fusion else "0")
    rng = np.random.default_rng(n_tok * 7 + k)
    ctx = Context()
    logits = ctx.new_tensor_ne(T.F32, n_exp, n_tok, name="logits")
    dn = ctx.new_tensor_ne(T.F32, d, k, n_tok, name="experts")
    ids, wts = moe_gating(ctx, logits, k, norm=norm)
    out = moe_weighted_sum(ctx, dn, wts)
    graph = ctx.graph(out, wts, ids.view_src)
    dev = _cuda()
    buf = alloc_tensors([logits, dn, *graph.nodes], dev.buffer_type)
    be = dev.new_backend()
    try:
        lv = rng.standard_normal((n_tok, n_exp)).astype(np.float32) if logits_v is None else logits_v
        dv = rng.standard_normal((n_tok, k, d)).astype(np.float32)
        logits.set(lv)
        dn.set(dv)
        be.compute(graph)
        fused = be.ctx.plans.get(graph).fused
        got = (ids.view_src.get().reshape(n_tok, n_exp), wts.get().reshape(n_tok, k),
               out.get().reshape(n_tok, d))
    finally:
        be.free()
        buf.free()
    return fused, lv, dv, got


@pytest.mark.parametrize("n_exp, k, n_tok, norm", [(64, 8, 1, True), (64, 8, 13, True), (128, 4, 3, False),
                                                   (8, 2, 40, True), (1000, 32, 2, True)])  # fmt: skip
def test_gating_and_weighted_sum_fused(monkeypatch, n_exp, k, n_tok, norm):
    """The gating run (softmax → argsort → top-k → renormalized) and the weighted sum over the
    slots, each one kernel: the experts of highest float64 probability, in order, their
    weights and the sum within F32 rounding; the unfused launches give the same bytes."""
    d = 96
    fused, lv, dv, (order, w, y) = _gating_graph(n_exp, k, n_tok, d, norm, True, monkeypatch)
    gate = ("SOFT_MAX", "ARGSORT", "GET_ROWS", *(("SUM_ROWS", "DIV") if norm else ()))
    assert fused == [gate, ("MUL", *("ADD",) * (k - 1))], fused
    p = np.exp(lv.astype(np.float64) - lv.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    want_order = np.argsort(-p, axis=1, kind="stable")
    assert (order == want_order).all()
    want_w = np.take_along_axis(p, want_order[:, :k], 1)
    if norm:
        want_w /= want_w.sum(1, keepdims=True)
    assert np.abs(w - want_w).max() < 1e-6
    want_y = np.einsum("tkd,tk->td", dv.astype(np.float64), want_w)
    assert np.abs(y - want_y).max() / np.abs(want_y).max() < 1e-5
    unfused, _, _, plain = _gating_graph(n_exp, k, n_tok, d, norm, False, monkeypatch)
    assert unfused == []
    for a, b in zip((order, w, y), plain, strict=True):
        assert np.array_equal(a, b)


def test_gating_ties_keep_the_lower_expert_first(monkeypatch):
    """Equal router logits: the lower expert index ranks first (stable), as ARGSORT orders."""
    lv = np.zeros((2, 16), np.float32)
    lv[0, [3, 9]] = 1.0
    _, _, _, (order, w, _) = _gating_graph(16, 4, 2, 32, True, True, monkeypatch, logits_v=lv)
    assert order[0, :4].tolist() == [3, 9, 0, 1] and order[1, :4].tolist() == [0, 1, 2, 3]
    assert np.allclose(w[1], 0.25)


def _router_graph(n_exp, k, kdim, fusion, monkeypatch, seed):
    """A decode's router product (F32 weights in a weights buffer) and the gating after it, on
    the GPU, computed twice (the second a replay): the plan's fused runs, both computes' logits,
    order and weights, and the inputs."""
    from accelplane.models.decoder import moe_gating

    monkeypatch.setenv("ACCELPLANE_FUSION", "1" if fusion else "0")
    rng = np.random.default_rng(seed)
    ctx = Context()
    wr = ctx.new_tensor_ne(T.F32, kdim, n_exp, name="router")
    x = ctx.new_tensor_ne(T.F32, kdim, 1, name="x")
    logits = ctx.mul_mat(wr, x)
    ids, wts = moe_gating(ctx, logits, k, norm=True)
    graph = ctx.graph(wts, ids.view_src, logits)
    dev = _cuda()
    wbuf = alloc_tensors([wr], dev.buffer_type, BufferUsage.WEIGHTS)
    buf = alloc_tensors([x, *graph.nodes], dev.buffer_type)
    be = dev.new_backend()
    wv = rng.standard_normal((n_exp, kdim)).astype(np.float32) / np.sqrt(kdim)
    xv = rng.standard_normal((1, kdim)).astype(np.float32)
    try:
        wr.set(wv)
        x.set(xv)
        runs = []
        for _ in range(2):
            be.compute(graph)
            runs.append((logits.get().reshape(-1), ids.view_src.get().reshape(-1), wts.get().reshape(-1)))
        fused = be.ctx.plans.get(graph).fused
    finally:
        be.free()
        buf.free()
        wbuf.free()
    return fused, runs, wv, xv


@pytest.mark.parametrize("n_exp, k, kdim", [(64, 8, 2048), (128, 8, 4096), (256, 8, 1000), (8, 2, 64)])
def test_router_and_gating_fused(monkeypatch, n_exp, k, kdim):
    """A decode's router product and its gating as one k_moe_router launch (its last block
    gates, on a counter it zeroes again, so a replay gives the same results): the logits within
    F32 rounding of float64, the experts ranked as float64 ranks them, the renormalized top-k
    weights; the unfused launches pick the same experts with the same weights."""
    fused, runs, wv, xv = _router_graph(n_exp, k, kdim, True, monkeypatch, n_exp + k)
    assert fused == [("MUL_MAT", "SOFT_MAX", "ARGSORT", "GET_ROWS", "SUM_ROWS", "DIV")], fused
    lw = wv.astype(np.float64) @ xv[0].astype(np.float64)
    p = np.exp(lw - lw.max())
    p /= p.sum()
    want_order = np.argsort(-p, kind="stable")
    want_w = p[want_order[:k]] / p[want_order[:k]].sum()
    for lg, order, w in runs:
        assert np.abs(lg - lw).max() < 1e-5 * np.abs(lw).max() + 1e-6
        assert (order[:k] == want_order[:k]).all()
        assert np.abs(w - want_w).max() < 1e-5
    assert all(np.array_equal(a, b) for a, b in zip(runs[0], runs[1], strict=True))
    unfused, plain, _, _ = _router_graph(n_exp, k, kdim, False, monkeypatch, n_exp + k)
    assert unfused == []
    assert (plain[0][1][:k] == runs[0][1][:k]).all() and np.abs(plain[0][2] - runs[0][2]).max() < 1e-6


@pytest.mark.parametrize("fusion", [True, False])
def test_gate_and_up_share_the_quantized_activations(monkeypatch, fusion):
    """Two decode products of the same activations (a MoE layer's gate and up): one k_quant_x
    launch, one k_mmv_row1_id for both (two with ACCELPLANE_FUSION=0), and each product equals
    float64 numpy."""
    monkeypatch.setenv("ACCELPLANE_FUSION", "1" if fusion else "0")
    rng = np.random.default_rng(5)
    dev = _cuda()
    ctx = Context()
    k, m, n_exp, n_used, n_tok = 512, 128, 8, 2, 2
    wg = ctx.new_tensor_ne(T.Q4_0, k, m, n_exp, name="gate")
    wu = ctx.new_tensor_ne(T.Q4_0, k, m, n_exp, name="up")
    x = ctx.new_tensor_ne(T.F32, k, 1, n_tok, name="x")
    ids = ctx.new_tensor_ne(T.I32, n_used, n_tok, name="ids")
    g, u = ctx.mul_mat_id(wg, x, ids), ctx.mul_mat_id(wu, x, ids)
    graph = ctx.graph(g, u)
    wbuf = alloc_tensors([wg, wu], dev.buffer_type, BufferUsage.WEIGHTS)
    buf = alloc_tensors([x, ids, *graph.nodes], dev.buffer_type)
    be = dev.new_backend()
    try:
        wv = [_experts(w, rng) for w in (wg, wu)]
        xv = rng.standard_normal((n_tok, 1, k)).astype(np.float32)
        ids_v = np.array([[1, 6], [6, 3]], np.int32)
        x.set(xv)
        ids.set(ids_v)
        be.compute(graph)
        plan = be.ctx.plans.get(graph)
        got = [t.get().reshape(n_tok, n_used, m) for t in (g, u)]
    finally:
        be.free()
        buf.free()
        wbuf.free()
    names = plan.kernel_names
    assert names.count("k_quant_x") == 1, names
    assert sum(n.startswith("k_mmv_row1_id<") for n in names) == (1 if fusion else 2), names
    assert plan.fused == ([("MUL_MAT_ID", "MUL_MAT_ID")] if fusion else [])
    for w, y in zip(wv, got, strict=True):
        want = np.einsum("tumk,tk->tum", w[ids_v], xv[:, 0].astype(np.float64))
        assert np.abs(y - want).max() / np.abs(want).max() < 2e-2


def test_prefill_products_share_the_route_and_f16_activations():
    """A prefill's gate and up products of the same activations and ids, and a down product of
    the same ids on other activations: one k_moe_route for the three, one F16 conversion for
    gate and up (one more for down), and each product equals float64 numpy."""
    rng = np.random.default_rng(9)
    dev = _cuda()
    ctx = Context()
    k, m, n_exp, n_used, n_tok = 256, 160, 8, 2, 40
    wg, wu = (ctx.new_tensor_ne(T.Q4_0, k, m, n_exp, name=s) for s in ("gate", "up"))
    wd = ctx.new_tensor_ne(T.Q8_0, m, k, n_exp, name="down")
    x = ctx.new_tensor_ne(T.F32, k, 1, n_tok, name="x")
    ids = ctx.new_tensor_ne(T.I32, n_used, n_tok, name="ids")
    g, u = ctx.mul_mat_id(wg, x, ids), ctx.mul_mat_id(wu, x, ids)
    h = ctx.mul(g, u)
    d = ctx.mul_mat_id(wd, h, ids)
    graph = ctx.graph(d, g, u)
    wbuf = alloc_tensors([wg, wu, wd], dev.buffer_type, BufferUsage.WEIGHTS)
    buf = alloc_tensors([x, ids, *graph.nodes], dev.buffer_type)
    be = dev.new_backend()
    try:
        wv = [_experts(w, rng) for w in (wg, wu, wd)]
        xv = rng.standard_normal((n_tok, 1, k)).astype(np.float32)
        ids_v = np.stack([rng.permutation(n_exp)[:n_used] for _ in range(n_tok)]).astype(np.int32)
        x.set(xv)
        ids.set(ids_v)
        be.compute(graph)
        names = be.ctx.plans.get(graph).kernel_names
        got = [t.get().reshape(n_tok, n_used, -1) for t in (g, u, d)]
    finally:
        be.free()
        buf.free()
        wbuf.free()
    assert names.count("k_moe_route") == 1, names
    assert sum(n.startswith("k_moe_gemm<") for n in names) == 3, names
    assert sum(n.startswith("k_convert<") for n in names) == 2, names
    x64 = xv[:, 0].astype(np.float64)
    gw, uw = (np.einsum("tumk,tk->tum", w[ids_v], x64) for w in wv[:2])
    dw = np.einsum("tumk,tuk->tum", wv[2][ids_v], got[0].astype(np.float64) * got[1])
    for y, want in zip(got, (gw, uw, dw), strict=True):
        assert np.abs(y - want).max() / np.abs(want).max() < 3e-3


def test_decode_layer_quantizes_in_the_norm_and_the_glu():
    """A decode's MoE products (gate and up of the normed activations, down of their SWIGLU):
    the norm writes the quantized copy gate and up read, the SWIGLU writes each slot's row
    quantized for down, so no k_quant_x runs; each product within int8 rounding of float64."""
    rng = np.random.default_rng(11)
    dev = _cuda()
    ctx = Context()
    k, m, n_exp, n_used = 512, 256, 8, 4
    wg, wu = (ctx.new_tensor_ne(T.Q4_0, k, m, n_exp, name=s) for s in ("gate", "up"))
    wd = ctx.new_tensor_ne(T.Q8_0, m, k, n_exp, name="down")
    x = ctx.new_tensor_ne(T.F32, k, 1, name="x")
    nw = ctx.new_tensor_ne(T.F32, k, name="norm")
    ids = ctx.new_tensor_ne(T.I32, n_used, 1, name="ids")
    h = ctx.mul(ctx.rms_norm(x, 1e-6), nw)
    xb = ctx.reshape_ne(h, k, 1, 1)
    g, u = ctx.mul_mat_id(wg, xb, ids), ctx.mul_mat_id(wu, xb, ids)
    a = ctx.swiglu(g, u)
    d = ctx.mul_mat_id(wd, a, ids)
    graph = ctx.graph(d, h, g, u, a)
    wbuf = alloc_tensors([wg, wu, wd], dev.buffer_type, BufferUsage.WEIGHTS)
    buf = alloc_tensors([x, nw, ids, *graph.nodes], dev.buffer_type)
    be = dev.new_backend()
    try:
        wv = [_experts(w, rng) for w in (wg, wu, wd)]
        x.set(rng.standard_normal((1, k)).astype(np.float32))
        nw.set(rng.uniform(0.5, 1.5, k).astype(np.float32))
        ids_v = np.array([[5, 0, 7, 2]], np.int32)
        ids.set(ids_v)
        be.compute(graph)
        names = be.ctx.plans.get(graph).kernel_names
        hv, gv, uv, av, dv = (t.get().astype(np.float64).reshape(n_used if t is not h else 1, -1)
                              for t in (h, g, u, a, d))  # fmt: skip
    finally:
        be.free()
        buf.free()
        wbuf.free()
    assert "k_quant_x" not in names and "k_glu_vec" in names, names
    assert sum(n.startswith("k_mmv_row1_id<") for n in names) == 2, names  # gate and up paired, down
    for y, w, xin in ((gv, wv[0], hv[[0] * n_used]), (uv, wv[1], hv[[0] * n_used]), (dv, wv[2], av)):
        want = np.einsum("umk,uk->um", w[ids_v[0]], xin)
        assert np.abs(y - want).max() / np.abs(want).max() < 2e-2


@pytest.mark.parametrize("n_tok", [1, 3])
def test_fused_moe_runs_decline_memory_shared_across_tokens(tmp_path, n_tok):
    """Where the allocator placed a later result of a MoE run over an input dead after an earlier
    node of it (in a prefill, the gating's sum and renormalized weights over the probabilities),
    k_moe_gating's blocks would race: gating_fits declines such a run; a decode's runs, one
    token, fit. (Placement by the scheduler on the CPU: the allocator is the SDK's; no GPU
    needed.)"""
    import accelplane
    from accelplane.core.fusion import Fusion, overlap
    from accelplane.models import LlamaModel, make_model
    from accelplane_cuda import moe

    path = tmp_path / "moe.gguf"
    make_model(path, arch="qwen3moe", n_layers=1, d_model=64, n_head=4, n_head_kv=2, d_ff=96,
               n_vocab=128, n_ctx=256, n_expert=4, n_expert_used=2, d_ff_exp=64, head_dim=32, wtype="f32",
               seed=8)  # fmt: skip
    m = LlamaModel.from_gguf(path, [accelplane.device("CPU")], n_ctx=64)
    try:
        m.eval(list(range(1, n_tok + 1)))
        graphs = [g for p in m.sched._plans.values() for sp in p.splits for g in sp.graphs]
        g = next(g for g in graphs if any(n.op.name == "SOFT_MAX" and n.ne[1] == n_tok for n in g.nodes))
        f = Fusion(g)
        gating = next(r for i in range(len(g.nodes)) if (r := f.moe_gating(i)) is not None)
        runs = [gating.probs.src[0], gating.probs, gating.order, gating.weights, gating.total, gating.normed]
        shared = any(overlap(a, b) for i, a in enumerate(runs) for b in runs[i + 1 :])
        assert moe.gating_fits(gating) == (n_tok == 1 or not shared)
        if n_tok > 1:  # the allocator does put the sum over the probabilities here
            assert overlap(gating.total, gating.probs)
    finally:
        m.free()
