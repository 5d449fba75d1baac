"""accelplane.core.fusion: when a run of nodes may be computed as one kernel, including the keep
sets the scheduler hands to each split's plugin."""

from __future__ import annotations

import numpy as np
import pytest
from accelplane.core.fusion import Fusion
from accelplane.core.graph import Context, Graph
from accelplane.core.ops import Op
from accelplane.core.tensor import TensorFlag
from accelplane.core.types import GGMLType
from accelplane.errors import ShapeError
from accelplane.runtime.alloc import alloc_tensors
from accelplane.sched import Scheduler
from accelplane.testing.plugins import cpu_and_async_registry

T = GGMLType
NM = (Op.RMS_NORM, Op.MUL)


def _norm_mul(ctx: Context):
    x = ctx.new_tensor(T.F32, (3, 64), "x")
    w = ctx.new_tensor(T.F32, (64,), "w")
    n = ctx.rms_norm(x, 1e-6)
    return n, ctx.mul(n, w)


def _index(g: Graph, t) -> int:
    return next(i for i, n in enumerate(g.nodes) if n is t)


def test_norm_then_mul_fuses():
    ctx = Context()
    n, y = _norm_mul(ctx)
    g = ctx.graph(ctx.scale(y, 2.0))
    f = Fusion(g)
    assert f.match(_index(g, n), NM)
    assert not f.match(_index(g, n), (Op.RMS_NORM, Op.ADD))  # ops differ
    assert not f.match(_index(g, y), NM)
    assert not f.match(len(g.nodes) - 1, NM)  # runs past the end


@pytest.mark.parametrize("why", ["output", "flagged", "second_reader", "view_reader", "no_keep", "env"])
def test_norm_is_kept(why, monkeypatch):
    ctx = Context()
    n, y = _norm_mul(ctx)
    outs = [y]
    if why == "output":
        outs.append(n)  # the caller asked for the intermediate too
    elif why == "flagged":
        n.set_output()
    elif why == "second_reader":
        outs.append(ctx.scale(n, 3.0))
    elif why == "view_reader":
        outs.append(ctx.cont(ctx.view(n, (32, 3), None, 0)))
    elif why == "env":
        monkeypatch.setenv("ACCELPLANE_FUSION", "0")
    g = Graph(outs)
    if why == "no_keep":
        g = Graph.from_nodes(g.nodes, g.leafs)  # keep unknown
    assert not Fusion(g).match(_index(g, n), NM)


@pytest.mark.parametrize("view", ["reshape", "view_of_view"])
def test_norm_viewed_by_an_output_is_kept(view):
    """An output that is a view (of a view) of the norm keeps the norm's memory written."""
    ctx = Context()
    n, y = _norm_mul(ctx)
    v = ctx.reshape(n, (192,))
    if view == "view_of_view":
        v = ctx.view(v, (32,), None, 64)
    g = ctx.graph(y, v)
    assert id(n) in g.keep
    assert not Fusion(g).match(_index(g, n), NM)


def test_norm_read_twice_by_the_next_node_is_not_fused():
    """MUL(norm, norm): a fused kernel reads the MUL's other operand from memory, which the
    norm would leave unwritten."""
    ctx = Context()
    x = ctx.new_tensor(T.F32, (3, 64), "x")
    n = ctx.rms_norm(x, 1e-6)
    g = ctx.graph(ctx.scale(ctx.mul(n, n), 2.0))
    f = Fusion(g)
    assert not f.match(_index(g, n), NM)
    assert f.norm_mul(_index(g, n)) is None


def test_intermediate_must_feed_the_next_node_directly():
    ctx = Context()
    x = ctx.new_tensor(T.F32, (3, 64), "x")
    w = ctx.new_tensor(T.F32, (64,), "w")
    n = ctx.rms_norm(x, 1e-6)
    other = ctx.mul(ctx.scale(x, 2.0), w)  # a MUL right after the norm, not reading it
    g = Graph.from_nodes([n, other], [x, w], keep=frozenset())
    assert not Fusion(g).match(0, NM)


@pytest.fixture
def sched_norm():
    """x, w on the asynchronous test device, n = rms_norm(x), y = n * w, and a scheduler over
    that device and the CPU: (ctx, x, w, n, y, scheduler, device backend, CPU backend)."""
    reg = cpu_and_async_registry(n_async=1, delay_us=0)
    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    bd, bc = dev.new_backend(), cpu.new_backend()
    ctx = Context()
    x = ctx.new_tensor(T.F32, (3, 64), "x")
    w = ctx.new_tensor(T.F32, (64,), "w")
    buf = alloc_tensors([x, w], dev.buffer_type)  # leaves on the device: no input copies
    n = ctx.rms_norm(x, 1e-6)
    s = Scheduler([bd, bc])
    yield ctx, x, w, n, ctx.mul(n, w), s, bd, bc
    s.free()
    bd.free()
    bc.free()
    buf.free()


def _split_graph(s: Scheduler, n) -> Graph:
    return next(sp for sp in s._allocated.splits if n in sp.nodes).graphs[0]


def test_scheduler_keeps_what_other_splits_read(sched_norm):
    """A norm computed on one backend and read by a node pinned to another is in the first
    split's keep set, so its plugin may not fuse it away; the computed result stays right."""
    ctx, x, w, n, y, s, bd, bc = sched_norm
    z = ctx.scale(n, 3.0)  # the other reader, on the CPU
    out = ctx.add(y, z)
    g = ctx.graph(out)
    for t in (n, y, out):
        s.set_tensor_backend(t, bd)
    s.set_tensor_backend(z, bc)
    s.alloc_graph(g)
    sg = _split_graph(s, n)
    assert id(n) in sg.keep
    assert not Fusion(sg).match(sg.nodes.index(n), NM)
    rng = np.random.default_rng(0)
    xv, wv = rng.standard_normal((3, 64)), rng.standard_normal(64)
    x.set(xv.astype(np.float32))
    w.set(wv.astype(np.float32))
    s.graph_compute(g)
    s.synchronize()
    nv = xv / np.sqrt(np.mean(xv * xv, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(out.get(), nv * wv + 3 * nv, rtol=1e-5, atol=1e-5)


def test_a_split_without_outside_readers_may_fuse(sched_norm):
    ctx, x, w, n, y, s, bd, bc = sched_norm
    g = ctx.graph(ctx.scale(y, 2.0))
    for t in g.nodes:
        s.set_tensor_backend(t, bd)
    s.alloc_graph(g)
    sg = _split_graph(s, n)
    assert Fusion(sg).match(sg.nodes.index(n), NM)


@pytest.fixture
def on_device():
    """Every node of a graph on the asynchronous test device, its leaves where they are
    allocated (CPU leaves are copied into the device's split): ``place(graph, cpu_leaves,
    device_leaves)`` allocates, schedules and returns the device split's graph; then the
    scheduler (``place.sched``) computes it."""
    reg = cpu_and_async_registry(n_async=1, delay_us=0)
    cpu, dev = reg.device("CPU"), reg.device("ASYNC0")
    bd, bc = dev.new_backend(), cpu.new_backend()
    s = Scheduler([bd, bc])
    bufs = []

    def place(g: Graph, cpu_leaves: list, dev_leaves: list) -> Graph:
        bufs.extend([alloc_tensors(cpu_leaves, cpu.buffer_type), alloc_tensors(dev_leaves, dev.buffer_type)])
        for t in g.nodes:
            s.set_tensor_backend(t, bd)
        s.alloc_graph(g)
        return next(sp for sp in s._allocated.splits if sp.backend == 0).graphs[0]

    place.sched = s
    yield place
    s.free()
    bd.free()
    bc.free()
    for b in bufs:
        b.free()


def test_split_reading_copied_inputs_still_fuses(on_device):
    """A split whose nodes descend from an input copied in from another backend computes
    clones of them (views writing the originals' memory); an ADD → RMS_NORM → MUL run among
    them still fuses, as in a model layer after the token embedding computed on the CPU, and
    the result is right."""
    ctx = Context()
    e = ctx.new_tensor(T.F32, (3, 64), "e")  # on the CPU: copied into the device's split
    r = ctx.new_tensor(T.F32, (3, 64), "r")
    w = ctx.new_tensor(T.F32, (64,), "w")
    h = ctx.add(ctx.scale(e, 2.0), r)
    y = ctx.mul(ctx.rms_norm(h, 1e-6), w)
    out = ctx.add(ctx.scale(y, 3.0), h)
    g = ctx.graph(out)
    sg = on_device(g, [e], [r, w])
    add = next(i for i, n in enumerate(sg.nodes) if n.op is Op.ADD)
    assert sg.nodes[add].view_src is h  # a clone, descending from the copy of e
    assert Fusion(sg).match(add, (Op.ADD, Op.RMS_NORM, Op.MUL), written=(0,))
    rng = np.random.default_rng(1)
    ev, rv, wv = rng.standard_normal((3, 64)), rng.standard_normal((3, 64)), rng.standard_normal(64)
    for t, v in ((e, ev), (r, rv), (w, wv)):
        t.set(v.astype(np.float32))
    on_device.sched.graph_compute(g)
    on_device.sched.synchronize()
    hv = 2 * ev + rv
    want = 3 * hv / np.sqrt(np.mean(hv * hv, -1, keepdims=True) + 1e-6) * wv + hv
    np.testing.assert_allclose(out.get(), want, rtol=1e-5, atol=1e-5)


def test_clone_of_an_in_place_op_stays_a_view(on_device):
    """A SET_ROWS (its result a view of the destination it writes) that reads a copied input
    is cloned as a plain view, not as a node owning memory: fusion never skips its write."""
    ctx = Context()
    e = ctx.new_tensor(T.F32, (2, 64), "e")  # on the CPU: copied into the device's split
    dst = ctx.new_tensor(T.F32, (8, 64), "dst")
    idx = ctx.new_tensor(T.I32, (2,), "idx")
    rows = ctx.set_rows(dst, e, idx)
    sg = on_device(ctx.graph(ctx.scale(rows, 2.0)), [e], [dst, idx])
    i = next(i for i, n in enumerate(sg.nodes) if n.op is Op.SET_ROWS)
    clone = sg.nodes[i]
    assert clone is not rows and clone.view_src is dst and not clone.flags & TensorFlag.CLONE
    assert not Fusion(sg).match(i, (Op.SET_ROWS, Op.SCALE))


def test_rope_into_cache_fuses_in_a_split_of_clones(on_device):
    """The llama K path in a device split whose rope reads positions copied in from the host
    (every decode step on a GPU): the scheduler clones the ROPE (owning the original's memory),
    its reshape (a view of the original) and the SET_ROWS, and rope_set_rows still finds the
    run; the result is right."""
    ctx = Context()
    k = ctx.new_tensor_ne(T.F32, 16, 2, 2, name="k")
    pos = ctx.new_tensor_ne(T.I32, 2, name="pos")  # on the CPU: copied into the device's split
    cache = ctx.new_tensor_ne(T.F32, 32, 8, name="cache")
    r = ctx.rope(k, pos, 16)
    sr = ctx.set_rows(cache, ctx.reshape_ne(r, 32, 2), pos)
    g = ctx.graph(ctx.scale(sr, 1.0))
    sg = on_device(g, [pos], [k, cache])
    i = next(i for i, n in enumerate(sg.nodes) if n.op is Op.ROPE)
    assert sg.nodes[i] is not r and sg.nodes[i].flags & TensorFlag.CLONE  # the clone
    assert Fusion(sg).rope_set_rows(i) is sg.nodes[i + 2]
    rng = np.random.default_rng(3)
    kv = rng.standard_normal((2, 2, 16)).astype(np.float32)
    k.set(kv)
    pos.set(np.array([5, 2], np.int32))
    cache.set(np.zeros((8, 32), np.float32))
    on_device.sched.graph_compute(g)
    on_device.sched.synchronize()
    # neox-free rope (mode 0) of 16 dims at positions 5 and 2, against float64
    theta = 10000.0 ** (-np.arange(0, 16, 2) / 16)
    want = np.zeros((8, 32))
    for t, p in enumerate((5, 2)):
        x = kv[t].astype(np.float64)
        c, s_ = np.cos(p * theta), np.sin(p * theta)
        y = np.empty_like(x)
        y[:, 0::2] = x[:, 0::2] * c - x[:, 1::2] * s_
        y[:, 1::2] = x[:, 0::2] * s_ + x[:, 1::2] * c
        want[p] = y.reshape(-1)
    np.testing.assert_allclose(cache.get(), want, rtol=1e-5, atol=1e-5)


def test_written_nodes_may_have_other_readers():
    """ADD → RMS_NORM → MUL with the sum still written (the residual path reads it again)."""
    ctx = Context()
    a = ctx.new_tensor(T.F32, (3, 64), "a")
    b = ctx.new_tensor(T.F32, (3, 64), "b")
    w = ctx.new_tensor(T.F32, (64,), "w")
    s = ctx.add(a, b)
    y = ctx.mul(ctx.rms_norm(s, 1e-6), w)
    g = ctx.graph(ctx.add(ctx.scale(y, 2.0), s))
    f = Fusion(g)
    i = _index(g, s)
    ops = (Op.ADD, Op.RMS_NORM, Op.MUL)
    assert not f.match(i, ops)  # the sum has a second reader
    assert f.match(i, ops, written=(0,))
    assert not f.match(i, ops, written=(1,))


@pytest.mark.parametrize("op", ["NORM", "RMS_NORM", "L2_NORM"])
@pytest.mark.parametrize("keep_norm", [False, True])
def test_cpu_plugin_fuses_norm_and_mul(op, keep_norm):
    """The CPU plugin runs a norm read only by a MUL as one step, against float64 numpy; a
    norm asked for as an output too runs as its own step and is written."""
    import accelplane
    from accelplane.testing.fusion import run_norm_mul

    # the CPU plugin's backend context is its plan cache
    plan = run_norm_mul(accelplane.device("CPU"), lambda be, g: be.ctx.get(g), op, keep_norm, ne0=64)
    assert plan.fused == ([] if keep_norm else [(op, "MUL")])


def _rope_into_cache(ctx: Context, n_tok: int = 2, freq_factors: bool = False):
    """The llama model's K path: ROPE of [head_dim, heads, tokens], reshaped to one row per
    token, SET_ROWS into a [n_ctx, heads * head_dim] cache at the tokens' positions."""
    k = ctx.new_tensor_ne(T.F32, 16, 2, n_tok, name="k")
    pos = ctx.new_tensor_ne(T.I32, n_tok, name="pos")
    cache = ctx.new_tensor_ne(T.F16, 32, 64, name="cache")
    ff = ctx.new_tensor_ne(T.F32, 8, name="ff") if freq_factors else None
    r = ctx.rope(k, pos, 16, freq_factors=ff)
    v = ctx.reshape_ne(r, 32, n_tok)
    return r, v, ctx.set_rows(cache, v, pos)


@pytest.mark.parametrize("why", [None, "rope_read", "view_read", "output", "env", "freq_factors"])
def test_rope_view_set_rows(why, monkeypatch):
    """fusion.rope_set_rows: ROPE → its reshape → SET_ROWS is one run unless the rope's result
    or its view has another reader or is wanted, the rope has frequency factors (the fused
    kernels rotate without them), or fusion is off."""
    if why == "env":
        monkeypatch.setenv("ACCELPLANE_FUSION", "0")
    ctx = Context()
    r, v, sr = _rope_into_cache(ctx, freq_factors=why == "freq_factors")
    outs = [sr]
    if why == "rope_read":
        outs.append(ctx.scale(r, 2.0))
    elif why == "view_read":
        outs.append(ctx.scale(v, 2.0))
    elif why == "output":
        r.set_output()
    g = ctx.graph(*outs)
    i = _index(g, r)
    assert g.nodes[i + 1] is v and g.nodes[i + 2] is sr
    assert Fusion(g).rope_set_rows(i) is (sr if why is None else None)
    assert Fusion(g).rope_set_rows(i + 1) is None  # not at a ROPE


@pytest.mark.parametrize("why", [None, "v_split", "product_read", "product_output", "k_rope_read",
                                 "rope_params", "env"])  # fmt: skip
def test_product_rope_cache(why, monkeypatch):
    """fusion.product_rope_cache: the Q/K/V projection whose result only feeds the Q rope, the
    K rope into its cache and the V cache write is one run covering them and the views between;
    not when the product or the K rope has another reader or is wanted, when the ropes differ,
    or with fusion off. The split V layout (per channel at the position) matches too."""
    from accelplane.models.blocks import qkv_block

    if why == "env":
        monkeypatch.setenv("ACCELPLANE_FUSION", "0")
    ctx = Context()
    b = qkv_block(ctx, T.Q4_0, 64, 16, 4, 2, 32, v_rows=why != "v_split")
    outs = [b.v_set, b.k_set, ctx.scale(b.q_rope, 1.0)]  # the model's order: the attention reads all three
    if why == "product_read":
        outs.append(ctx.scale(b.product, 2.0))
    elif why == "product_output":
        b.product.set_output()
    elif why == "k_rope_read":
        outs.append(ctx.scale(b.k_rope, 2.0))
    elif why == "rope_params":
        b.q_rope.op_params = (*b.q_rope.op_params[:4], 1e4, *b.q_rope.op_params[5:])
    g = ctx.graph(*outs)
    i = _index(g, b.product)
    r = Fusion(g).product_rope_cache(i)
    if why in (None, "v_split"):
        assert r is not None
        assert (r.q_rope, r.k_rope, r.k_set, r.v_set) == (b.q_rope, b.k_rope, b.k_set, b.v_set)
        last = max(_index(g, t) for t in (b.q_rope, b.k_set, b.v_set))
        assert r.covered == last - i + 1
        assert all(n.op in (Op.VIEW, Op.RESHAPE) or n in r for n in g.nodes[i : i + r.covered])
    else:
        assert r is None
    assert Fusion(g).product_rope_cache(_index(g, b.q_rope)) is None  # not at a MUL_MAT


def test_product_rope_cache_in_a_llama_decode():
    """Every layer of a llama decode step with merged Q/K/V weights has the run."""
    from accelplane.models.decoder import DecoderConfig, DecoderModel

    reg = cpu_and_async_registry(n_async=1, delay_us=0)
    cfg = DecoderConfig(n_vocab=64, d_model=64, n_layers=2, n_head=4, n_head_kv=2, d_ff=96)
    m = DecoderModel(cfg, [reg.device("CPU")], types={}, n_ctx=32, kv_pad=16)
    try:
        g = m.step(1, 16).graph
        f = Fusion(g)
        runs = [f.product_rope_cache(i) for i, n in enumerate(g.nodes) if n.op is Op.MUL_MAT]
        assert [r.product.name for r in runs if r is not None] == ["blk.0.QKVcur", "blk.1.QKVcur"]
    finally:
        m.free()


def _moe_block(ctx: Context, k: int = 4, norm: bool = True, n_tok: int = 3):
    from accelplane.models.decoder import moe_gating, moe_weighted_sum

    logits = ctx.new_tensor_ne(T.F32, 16, n_tok, name="logits")
    dn = ctx.new_tensor_ne(T.F32, 32, k, n_tok, name="experts")
    ids, wts = moe_gating(ctx, logits, k, norm=norm)
    return ids, wts, moe_weighted_sum(ctx, dn, wts)


@pytest.mark.parametrize("norm", [True, False])
def test_moe_gating_run(norm):
    """The gating chain the decoder builds is one run from its SOFT_MAX, through the DIV when the
    weights are renormalized, else the GET_ROWS; only at the SOFT_MAX."""
    ctx = Context()
    ids, wts, out = _moe_block(ctx, norm=norm)
    g = ctx.graph(out, expand=[wts])
    i = next(i for i, n in enumerate(g.nodes) if n.op is Op.SOFT_MAX)
    r = Fusion(g).moe_gating(i)
    assert r is not None and r.k == 4 and r.order is ids.view_src
    last = r.normed if norm else r.weights
    assert g.nodes[i + r.covered - 1] is last
    assert (r.total is not None) == norm and (last.op is Op.DIV) == norm
    assert all(Fusion(g).moe_gating(j) is None for j in range(len(g.nodes)) if j != i)


def test_moe_gating_needs_an_unmasked_softmax_and_its_order():
    ctx = Context()
    logits = ctx.new_tensor_ne(T.F32, 16, 3, name="logits")
    mask = ctx.new_tensor_ne(T.F32, 16, 3, name="mask")
    probs = ctx.soft_max(logits, mask)
    order = ctx.argsort(probs, 1)
    ids = ctx.view(order, (2, 3), (order.nb[0], order.nb[1]))
    w = ctx.get_rows(ctx.reshape_ne(probs, 1, 16, 3), ids)
    g = ctx.graph(w)
    assert Fusion(g).moe_gating(_index(g, probs)) is None  # masked
    ctx = Context()
    logits = ctx.new_tensor_ne(T.F32, 16, 3, name="logits")
    probs = ctx.soft_max(logits)
    g = ctx.graph(ctx.scale(probs, 2.0), ctx.argsort(probs, 1))
    assert Fusion(g).moe_gating(_index(g, probs)) is None  # another node inside the window


@pytest.mark.parametrize("why", ["fuses", "partial_kept", "product_read", "slot_order", "output", "no_keep"])
def test_moe_sum_run(why):
    """MUL then the chain of ADDs over its k slices, in slot order, fuses when neither the
    product nor a partial sum is read elsewhere or kept."""
    ctx = Context()
    k = 4
    ids, wts, out = _moe_block(ctx, k=k)
    outs = [out]
    g0 = ctx.graph(*outs)
    mul = next(n for n in g0.nodes if n.op is Op.MUL)
    adds = [n for n in g0.nodes if n.op is Op.ADD]
    if why == "partial_kept":
        outs.append(ctx.scale(adds[0], 2.0))
    elif why == "product_read":
        outs.append(ctx.scale(mul, 2.0))
    elif why == "output":
        adds[1].set_output()
    if why == "slot_order":  # (s0 + s2) + ...: not the slot order the kernel sums in
        ctx = Context()
        from accelplane.models.decoder import moe_gating

        logits = ctx.new_tensor_ne(T.F32, 16, 3, name="logits")
        dn = ctx.new_tensor_ne(T.F32, 32, 3, 3, name="experts")
        _, w = moe_gating(ctx, logits, 3)
        mul = ctx.mul(dn, w)
        v = [ctx.view(mul, (32, 3), (mul.nb[0], mul.nb[2]), j * mul.nb[1]) for j in (0, 2, 1)]
        outs = [ctx.add(ctx.add(v[0], v[1]), v[2])]
    g = Graph(outs)
    if why == "no_keep":
        g = Graph.from_nodes(g.nodes, g.leafs)
    r = Fusion(g).moe_sum(_index(g, mul))
    if why == "fuses":
        assert r is not None and r.k == k and r.out is out and g.nodes[_index(g, mul) + r.covered - 1] is out
    else:
        assert r is None


def test_moe_runs_in_a_qwen3moe_decode():
    """Every layer of a qwen3moe decode step has both runs (the graph orders the gating first)."""
    from accelplane.models.decoder import DecoderConfig, DecoderModel

    reg = cpu_and_async_registry(n_async=1, delay_us=0)
    cfg = DecoderConfig(n_vocab=64, d_model=64, n_layers=2, n_head=4, n_head_kv=2, d_ff=96, n_expert=8,
                        n_expert_used=2, arch="qwen3moe")  # fmt: skip
    m = DecoderModel(cfg, [reg.device("CPU")], types={}, n_ctx=32, kv_pad=16)
    try:
        g = m.step(1, 16).graph
        f = Fusion(g)
        gating = [f.moe_gating(i) for i, n in enumerate(g.nodes) if n.op is Op.SOFT_MAX]
        sums = [f.moe_sum(i) for i, n in enumerate(g.nodes) if n.op is Op.MUL]
        want = [f"blk.{i}.ffn_moe_weights_norm" for i in (0, 1)]
        assert [r.normed.name for r in gating if r is not None] == want
        assert [r.out.name for r in sums if r is not None] == ["blk.0.ffn_moe_out", "blk.1.ffn_moe_out"]
    finally:
        m.free()


def test_graph_expand_orders_chains_first():
    """Context.graph(expand=...): those chains come first, are not outputs; a non-tensor is a
    ShapeError."""
    ctx = Context()
    x = ctx.new_tensor(T.F32, (4,), "x")
    a, b = ctx.scale(x, 2.0), ctx.scale(x, 3.0)
    y = ctx.add(a, b)
    assert ctx.graph(y).nodes == [a, b, y]
    ctx2 = Context()
    x = ctx2.new_tensor(T.F32, (4,), "x")
    a, b = ctx2.scale(x, 2.0), ctx2.scale(x, 3.0)
    y = ctx2.add(a, b)
    g = ctx2.graph(y, expand=[b])
    assert g.nodes == [b, a, y] and not b.flags & TensorFlag.OUTPUT
    with pytest.raises(ShapeError, match="expand take tensors"):
        ctx2.graph(y, expand=[1])


def test_moe_runs_in_a_split_of_clones(tmp_path):
    """Through the scheduler (the split's nodes are clones, its views view the originals): each
    layer's gating and weighted sum are still runs of the device split's graph."""
    from accelplane.models import LlamaModel, make_model

    path = tmp_path / "moe.gguf"
    make_model(path, arch="qwen3moe", n_layers=2, d_model=64, n_head=4, n_head_kv=2, d_ff=96,
               n_vocab=128, n_ctx=256, n_expert=4, n_expert_used=2, d_ff_exp=64, head_dim=32, wtype="f32",
               seed=8)  # fmt: skip
    reg = cpu_and_async_registry(n_async=1, delay_us=0)
    m = LlamaModel.from_gguf(path, [reg.device("ASYNC0")], cpu=reg.device("CPU"), n_ctx=64)
    try:
        m.eval([1, 2, 3])
        m.eval([4])
        graphs = [g for p in m.sched._plans.values() for sp in p.splits if sp.backend == 0 for g in sp.graphs]
        assert len(graphs) == 2 * m.sched.n_copies  # the prefill's and the decode's, per copy slot
        for g in graphs:
            f = Fusion(g)
            assert sum(f.moe_gating(i) is not None for i in range(len(g.nodes))) == 2
            assert sum(f.moe_sum(i) is not None for i in range(len(g.nodes))) == 2
    finally:
        m.free()


@pytest.mark.parametrize("why", ["fuses", "into_cache", "norm_read", "mul_kept", "rope_of_other"])
def test_norm_rope_run(why):
    """A head norm, its MUL and the ROPE of that are one run (with a SET_ROWS into a cache after
    it, five nodes); not when the norm or the product has another reader or is kept, nor when
    the ROPE after them rotates something else."""
    from accelplane.core.ops import ROPE_TYPE_NEOX

    ctx = Context()
    x = ctx.new_tensor_ne(T.F32, 32, 4, 3, name="x")
    w = ctx.new_tensor_ne(T.F32, 32, name="w")
    pos = ctx.new_tensor_ne(T.I32, 3, name="pos")
    n = ctx.rms_norm(x, 1e-6)
    m = ctx.mul(n, w)
    r = ctx.rope(m if why != "rope_of_other" else x, pos, 32, ROPE_TYPE_NEOX)
    outs = [r] if why != "rope_of_other" else [ctx.add(r, m)]
    if why == "into_cache":
        cache = ctx.new_tensor_ne(T.F16, 128, 16, name="cache")
        outs = [ctx.set_rows(cache, ctx.reshape_ne(r, 128, 3), pos)]
    elif why == "norm_read":
        outs.append(ctx.scale(n, 2.0))
    elif why == "mul_kept":
        outs.append(m)
    g = ctx.graph(*outs)
    got = Fusion(g).norm_rope(_index(g, n))
    if why in ("fuses", "into_cache"):
        assert got is not None and (got.norm, got.mul, got.rope) == (n, m, r)
        assert got.covered == (5 if why == "into_cache" else 3)
        assert (got.set_rows is outs[0]) if why == "into_cache" else got.set_rows is None
        assert g.nodes[_index(g, n) + got.covered - 1] is outs[0]
    else:
        assert got is None


def test_norm_rope_runs_in_a_qwen3moe_decode(tmp_path):
    """qwen3's Q/K norms: per layer, the keys' run into the cache and the queries' run."""
    import accelplane
    from accelplane.models import LlamaModel, make_model

    path = tmp_path / "q.gguf"
    make_model(path, arch="qwen3moe", n_layers=2, d_model=64, n_head=4, n_head_kv=2, d_ff=96,
               n_vocab=128, n_ctx=256, n_expert=4, n_expert_used=2, d_ff_exp=64, head_dim=32, wtype="f32",
               seed=8)  # fmt: skip
    m = LlamaModel.from_gguf(path, [accelplane.device("CPU")], n_ctx=64)
    try:
        g = m.step(1, 32).graph
        f = Fusion(g)
        runs = [r for i in range(len(g.nodes)) if (r := f.norm_rope(i)) is not None]
        assert [(r.rope.name, r.covered) for r in runs] == [
            (f"blk.{i}.{q}rope", c) for i in (0, 1) for q, c in (("K", 5), ("Q", 3))]
    finally:
        m.free()


def test_walk_starts_a_step_at_each_compute_node_after_the_last_steps_run():
    """Fusion.walk: a step starts at every node that is not a view and not computed by the last
    step (a fused run covers the nodes after it, views among them); a step that says it computed
    nothing counts as one node."""
    ctx = Context()
    a = ctx.scale(ctx.new_tensor(T.F32, (4, 8), "x"), 2.0)  # 0
    b = ctx.reshape(a, (8, 4))  # 1: a view
    c = ctx.scale(b, 3.0)  # 2
    d = ctx.scale(ctx.reshape(c, (4, 8)), 0.5)  # 3: view, 4
    g = ctx.graph(ctx.scale(d, 1.0))  # 5
    assert [n.op is Op.RESHAPE for n in g.nodes] == [False, True, False, True, False, False]
    cases = (({}, [0, 2, 4, 5]), ({0: 3}, [0, 4, 5]), ({2: 3}, [0, 2, 5]), ({0: 0}, [0, 2, 4, 5]))
    for covers, want in cases:
        seen: list[int] = []

        def step(i: int, covers=covers, seen=seen) -> int:
            seen.append(i)
            return covers.get(i, 1)

        Fusion(g).walk(step)
        assert seen == want, covers
