"""CUDA plugin specifics (the conformance suite covers the op catalog and the contracts):
CUDA-graph replay, the index error flag, one-GPU comm, host→device copies. Skipped, with the
reason, where no CUDA device is present."""

from __future__ import annotations

import accelplane
import gguf
import numpy as np
import pytest
from accelplane.core.graph import Context
from accelplane.core.types import GGMLType, quantize
from accelplane.errors import AccelplaneError
from accelplane.runtime.alloc import alloc_tensors
from accelplane.runtime.backend import Comm, tensor_copy
from accelplane_cuda import compiler

T = GGMLType


def _cuda():
    reg = accelplane.get_registry()
    if "cuda" not in reg.plugins:
        why = [f.reason for f in reg.failures if f.name == "cuda"]
        pytest.skip(f"no device: {why[0] if why else 'the cuda plugin is not installed'}")
    return reg.plugins["cuda"].devices[0]


def _quantized_weights(t, rng, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Random rows quantized into weight tensor ``t`` (the gguf package's quantizer; the SDK's
    for Q4_K, which gguf lacks and which tests/test_types.py checks byte-exact against ggml's):
    the GGUF bytes set, and the float64 values they hold (gguf's dequantizer, the oracle)."""
    m, k = t.ne[1], t.ne[0]
    v = (rng.standard_normal((m, k)) * scale).astype(np.float32)
    qt = gguf.GGMLQuantizationType[t.type.name]
    raw = (quantize(t.type, v) if t.type == T.Q4_K else gguf.quantize(v, qt)).reshape(-1)
    t.set_bytes(raw)
    return raw, gguf.dequantize(raw, qt).reshape(m, k).astype(np.float64)


def _assert_int8_close(got, want: np.ndarray, *why) -> None:
    """A product computed on int8-quantized activations (the register mat-vec) against float64:
    within 2 % of the largest value (one quantization step is ~1 % of a row's scale)."""
    err = np.abs(got.get().reshape(want.shape) - want).max() / np.abs(want).max()
    assert err < 2e-2, (*why, err)


def test_replays_as_cuda_graph():
    dev = _cuda()
    ctx = Context()
    x = ctx.new_tensor(T.F32, (1024,), "x")
    y = x
    for i in range(50):
        y = ctx.scale(y, 1.01, 0.001 * i)
    g = ctx.graph(y)
    buf = alloc_tensors(ctx.tensors + [n for n in g.nodes], dev.buffer_type)
    be = dev.new_backend()
    v = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    want = v.astype(np.float64)
    for i in range(50):
        want = want * 1.01 + 0.001 * i
    for _ in range(4):
        x.set(v)
        be.compute(g)
        np.testing.assert_allclose(y.get(), want, rtol=1e-5, atol=1e-5)
    plan = be.ctx.plans.get(g)
    assert plan.cuda_graph is not None, "an unchanged graph must be replayed as a CUDA graph"
    assert be.ctx.plans.builds == 1
    be.free()
    buf.free()


def test_plans_share_parameter_arrays():
    """Launches with equal parameters read one device array, across plans too; kernel-written
    memory (plan.zeros) stays each plan's own."""
    from accelplane_cuda import plan as cuda_plan

    dev = _cuda()
    ctx = Context()
    x = ctx.new_tensor(T.F32, (4, 256), "x")
    y = x
    for _ in range(8):  # the same shape eight times: equal norm parameters
        y = ctx.rms_norm(ctx.scale(y, 2.0, 0.0), 1e-6)
    g = ctx.graph(y)
    buf = alloc_tensors(ctx.tensors + list(g.nodes), dev.buffer_type)
    v = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    want = v.astype(np.float64)
    for _ in range(8):
        want = want * 2.0
        want = want / np.sqrt((want * want).mean(axis=1, keepdims=True) + 1e-6)
    backends = [dev.new_backend(), dev.new_backend()]
    try:
        plans = []
        for be in backends:
            x.set(v)
            be.compute(g)
            np.testing.assert_allclose(y.get(), want, rtol=1e-5, atol=1e-5)
            plans.append(be.ctx.plans.get(g))
        shared = [[k for k in p.keep if isinstance(k, cuda_plan._Params)] for p in plans]
        assert len({id(k) for k in shared[0]}) < len(shared[0]), "equal parameters must share one array"
        assert [id(k) for k in shared[0]] == [id(k) for k in shared[1]], "a second plan must reuse the arrays"
        assert plans[0].zeros(1) != plans[0].zeros(1), "plan.zeros is never shared"
    finally:
        for be in backends:
            be.free()
        buf.free()


def test_pinned_ranges(monkeypatch):
    """runtime.pinned (which blocking copies skip the wait for): a range inside one registered
    block, against a brute-force check over random blocks, with blocks dropped as they are freed
    (no GPU needed: the registry is plain Python)."""
    import bisect
    import random

    from accelplane_cuda import runtime

    rnd = random.Random(0)
    for _ in range(100):
        blocks, base = [], 4096
        for _ in range(rnd.randint(0, 12)):
            base += rnd.randint(0, 64)
            n = rnd.randint(1, 64)
            blocks.append((base, n))
            base += n
        reg: list[tuple[int, int]] = []
        monkeypatch.setattr(runtime, "_PINNED", reg)
        for b in blocks:
            bisect.insort(reg, b)
        for drop in [None, *blocks[:2]]:
            if drop is not None:
                reg.remove(drop)
                blocks.remove(drop)
            for _ in range(200):
                a, size = rnd.randint(4000, base + 50), rnd.randint(1, 40)
                want = any(p <= a and a + size <= p + n for p, n in blocks)
                assert runtime.pinned(a, size) == want, (blocks, a, size)


@pytest.mark.parametrize("nbytes", [4, 260, 4 << 20])
@pytest.mark.parametrize("pinned", [True, False])
def test_copies_follow_the_stream(nbytes, pinned):
    """Blocking copies (a set from pageable memory, a device→device copy) are complete before
    the stream's next compute reads them (docs/ordering.md rule 4), and an async read right
    behind the compute, into pinned or pageable memory, has the computed bytes once an event
    recorded after it completes."""
    dev = _cuda()
    ctx = Context()
    n = nbytes // 4
    x = ctx.new_tensor(T.F32, (n,), "x")
    x2 = ctx.new_tensor(T.F32, (n,), "x2")
    y = ctx.scale(x2, 2.0, 1.0)
    g = ctx.graph(y)
    buf = alloc_tensors(ctx.tensors + list(g.nodes), dev.buffer_type)
    be = dev.new_backend()
    host = dev.host_buffer_type.alloc(2 * nbytes) if pinned else None
    out = host.host_array[nbytes : 2 * nbytes] if pinned else np.zeros(nbytes, np.uint8)
    ev = dev.new_event()
    rng = np.random.default_rng(nbytes)
    try:
        for _ in range(3):
            v = rng.standard_normal(n).astype(np.float32)
            x.set(v)
            tensor_copy(x, x2)
            be.graph_compute(g)
            be.get_tensor_async(y, out)
            ev.record(be)
            ev.synchronize()
            np.testing.assert_allclose(out.view(np.float32), v.astype(np.float64) * 2 + 1, rtol=1e-6)
    finally:
        ev.free()
        be.free()
        buf.free()
        if host is not None:
            host.free()


def test_bad_row_index_raises():
    dev = _cuda()
    ctx = Context()
    a = ctx.new_tensor(T.F32, (4, 8), "a")
    idx = ctx.new_tensor(T.I32, (3,), "idx")
    r = ctx.get_rows(a, idx)
    g = ctx.graph(r)
    buf = alloc_tensors([a, idx, r], dev.buffer_type)
    a.set(np.zeros((4, 8), np.float32))
    idx.set(np.array([0, 9, 1], np.int32))
    be = dev.new_backend()
    with pytest.raises(AccelplaneError, match="out of range"):
        be.compute(g)
    idx.set(np.array([0, 3, 1], np.int32))
    be.compute(g)  # the flag was reset
    be.free()
    buf.free()


def test_comm_on_one_gpu_is_fallback():
    dev = _cuda()
    if len(dev.plugin.devices) > 1:
        pytest.skip("several GPUs: NCCL serves (covered by the multi-GPU run)")
    bs = [dev.new_backend(), dev.new_backend()]
    assert Comm.init(bs) is None, "NCCL needs distinct GPUs: one GPU must fall back to the SDK"
    for b in bs:
        b.free()


def _two_gpus():
    devs = _cuda().plugin.devices
    if len(devs) < 2:
        pytest.skip("needs 2 GPUs")
    return devs


# (elements, ACCELPLANE_CUDA_ALLREDUCE, path): the peer-memory kernel serves F32 of a multiple of
# 4 elements up to 1 MiB; NCCL the rest, in BF16 from 32768 elements (2 GPUs)
ALLREDUCE_CASES = [(1000, "auto", "p2p"), (1 << 16, "auto", "p2p"), (1 << 18, "auto", "p2p"),
                   (1001, "auto", "nccl-f32"), ((1 << 18) + 4, "auto", "nccl-bf16"),
                   (1000, "nccl", "nccl-f32"), (1 << 16, "nccl", "nccl-bf16")]  # fmt: skip


@pytest.mark.parametrize(("n_el", "mode", "path"), ALLREDUCE_CASES)
def test_allreduce_paths(monkeypatch, n_el, mode, path):
    devs = _two_gpus()
    monkeypatch.setenv("ACCELPLANE_CUDA_ALLREDUCE", mode)
    bs = [d.new_backend() for d in devs]
    comm = Comm.init(bs)
    assert comm is not None
    assert (comm.ctx.p2p is not None) == (mode == "auto"), comm.ctx.p2p_why
    ctx = Context()
    ts = [ctx.new_tensor(T.F32, (n_el,), f"p{i}") for i in range(len(devs))]
    bufs = [alloc_tensors([t], d.buffer_type) for t, d in zip(ts, devs, strict=True)]
    rng = np.random.default_rng(n_el)
    for _ in range(3):  # three times: the peer kernel alternates receive slots by epoch
        vals = [rng.standard_normal(n_el).astype(np.float32) for _ in ts]
        for t, v in zip(ts, vals, strict=True):
            t.set(v)
        assert comm.allreduce(ts)
        for b in bs:
            b.synchronize()
        got = [t.get() for t in ts]
        for g in got[1:]:  # every GPU holds the same bits
            assert g.tobytes() == got[0].tobytes()
        f32 = vals[0].copy()
        for v in vals[1:]:
            f32 += v  # rank order in F32: what the peer kernel and NCCL's F32 sum compute
        if path == "nccl-bf16":  # the wire rounding shows, within BF16's precision
            want = np.sum(vals, axis=0, dtype=np.float64)
            np.testing.assert_allclose(got[0], want, rtol=2e-2, atol=2e-2)
            assert np.abs(got[0] - want).max() > 1e-3
        else:
            np.testing.assert_array_equal(got[0], f32)
    comm.free()
    for b in bs:
        b.free()
    for b in bufs:
        b.free()


def test_tensor_split_records_each_gpu_into_one_graph(tmp_path):
    """A small llama split by tensor over two GPUs, teacher-forced: from the second decode step
    on, each step replays one CUDA graph per GPU (subgraphs and all-reduces recorded by the meta
    device); the logits match one GPU's."""
    from accelplane.models import LlamaModel, make_model
    from accelplane.models.runner import NMSE_TOL
    from accelplane.oracle.compare import nmse

    devs = _two_gpus()
    path = tmp_path / "tiny.gguf"
    make_model(path, n_layers=2, d_model=256, n_head=4, n_head_kv=2, d_ff=512, n_vocab=512, n_ctx=256,
               wtype="q8_0", seed=1)  # fmt: skip
    tokens = np.random.default_rng(7).integers(0, 512, 40)
    cpu = accelplane.get_registry().device("CPU")
    out = {}
    for split, ds in (("none", devs[:1]), ("tensor", devs[:2])):
        m = LlamaModel.from_gguf(path, ds, cpu=cpu, n_ctx=128, kv_pad=64, split=split)
        try:
            logits = [m.eval(tokens[:8], all_logits=True).logits]
            logits += [m.eval([t]).logits for t in tokens[8:]]
            out[split] = np.concatenate(logits)
            if split == "tensor":
                st = m.meta.stats
                assert st.record_error == "" and st.replays == 32 - 1, st
                assert st.algorithms == {"plugin": st.allreduces + st.gathers}, st
        finally:
            m.free()
    # the split sums partial products in another order: within the tolerance of `accelplane run`
    assert nmse(out["tensor"], out["none"]) <= NMSE_TOL
    # the same top-1 wherever one GPU's leads clearly (random weights leave near-ties)
    top2 = np.sort(out["none"], axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.05 * out["none"].std()
    assert clear.sum() >= len(clear) // 2
    assert (out["tensor"].argmax(-1) == out["none"].argmax(-1))[clear].all()


@pytest.mark.parametrize("family", [f.file for f in compiler.families()])
def test_kernels_compile_with_nvrtc(family):
    """kernels/<family>.cu compiles for sm_90 with NVRTC, with every instantiation the plugin
    asks for (compiler.Family: the same source, options and name expressions as on a GPU; no
    GPU needed, only the NVRTC library)."""
    import os

    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy is not installed")
    fam = next(f for f in compiler.families() if f.file == family)
    try:
        prog = nvrtc.createProgram(fam.source(), f"{family}.cu", [], [])
    except Exception as e:  # CuPy without the NVRTC library
        pytest.skip(f"NVRTC library not available: {e}")
    for n in fam.names():
        nvrtc.addNameExpression(prog, n)
    inc = [f"-I{d}" for d in ("/usr/local/cuda/include",) if os.path.isdir(d)]
    try:
        nvrtc.compileProgram(prog, ["-arch=compute_90", *fam.options(), *inc])
    except Exception as e:
        pytest.fail(f"NVRTC: {e}\n{nvrtc.getProgramLog(prog)}")
    for n in fam.names():  # every kernel the plugin looks up has a symbol
        assert nvrtc.getLoweredName(prog, n), n


def test_replays_with_library_calls():
    """A graph with cuBLAS products between kernels is still replayed from captured graphs
    (whole, or kernel runs between eager library calls), with the same results."""
    dev = _cuda()
    ctx = Context()
    w = ctx.new_tensor(T.F32, (64, 96), "w")
    x = ctx.new_tensor(T.F32, (20, 96), "x")
    y = ctx.silu(ctx.mul_mat(w, ctx.scale(x, 0.5)))
    g = ctx.graph(y)
    buf = alloc_tensors(ctx.tensors + list(g.nodes), dev.buffer_type)
    rng = np.random.default_rng(1)
    wv = rng.standard_normal((64, 96)).astype(np.float32)
    w.set(wv)
    be = dev.new_backend()
    for _ in range(4):
        xv = rng.standard_normal((20, 96)).astype(np.float32)
        x.set(xv)
        be.compute(g)
        z = (0.5 * xv.astype(np.float64)) @ wv.T
        np.testing.assert_allclose(y.get(), z / (1 + np.exp(-z)), rtol=1e-4, atol=1e-4)
    plan = be.ctx.plans.get(g)
    assert plan.cuda_graph is not None, plan.graph_error
    be.free()
    buf.free()


@pytest.mark.parametrize("wtype", ["F32", "F16", "BF16", "Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q4_1", "Q5_0",
                                   "Q5_1", "Q2_K", "Q3_K", "Q5_K", "IQ4_NL", "IQ4_XS"])
def test_matvec_kernels(monkeypatch, wtype):
    """The mat-vec kernels against float64 numpy: the register ones (k_quant_x + k_mmv_row or
    k_mmv_row1, for Q4_0x8, Q8_0x8 and Q4_K), the ring (k_mmv_ring: one row of x8 weights,
    K = 14336, and K = 4096 for Q4_K) and the pipelined one (k_mmv_pipe, the other types; rows
    that are not whole 16-byte words, as Q6_K's of 840 bytes, take k_mul_mat_vec): rows over
    several stages or passes, several rows per warp or block, 1..8 activation rows, broadcast
    batches, and M not a multiple of the block's rows."""
    from accelplane_cuda import matvec

    dev = _cuda()
    monkeypatch.setattr(matvec, "SMALL", 0)  # float weights of any size take the kernel too
    wt = T[wtype]
    rng = np.random.default_rng(7)
    # (K, M, N, weight batches, broadcast); K = 16640 takes two passes of the register kernel;
    # one activation row of K = 4096 and 14336 takes k_mmv_row1 with 32-64 and 128 lanes per row
    shapes = ((4096, 3000, 1, 1, 1), (1024, 37, 3, 2, 2), (512, 129, 8, 1, 1), (16640, 40, 2, 1, 1),
              (256, 5, 1, 3, 1), (14336, 70, 1, 1, 1))  # fmt: skip
    for k, m, n, ne2, r2 in shapes:
        ctx = Context()
        a = ctx.new_tensor_ne(wt, k, m, ne2, name="a")
        b = ctx.new_tensor_ne(T.F32, k, n, ne2 * r2, name="b")
        y = ctx.mul_mat(a, b)
        g = ctx.graph(y)
        buf = alloc_tensors(ctx.tensors + list(g.nodes), dev.buffer_type)
        a.set(rng.uniform(-1, 1, a.shape).astype(np.float32))
        bv = rng.uniform(-1, 1, b.shape).astype(np.float32)
        b.set(bv)
        be = dev.new_backend()
        be.compute(g)
        names = be.ctx.plans.get(g).kernel_names
        want_kernel = "k_mmv_pipe" if a.row_bytes % 16 == 0 else "k_mul_mat_vec"  # e.g. Q6_K rows of 840 B
        # Q4_0/Q8_0/Q4_K weights in a weights buffer (alloc_tensors' default) take the x8 layouts
        want_id = {T.Q4_0: 102, T.Q8_0: 108, T.Q4_K: 112}.get(wt, int(wt))
        if want_id in (102, 108, 112):  # the register kernels; the ring for one long row
            ring = n * ne2 * r2 == 1 and k % 2048 == 0 and (k >= 8192 or want_id == 112)
            row = (f"k_mmv_ring<{want_id},",) if ring else (f"k_mmv_row<{want_id},", f"k_mmv_row1<{want_id},")
            assert "k_quant_x" in names and any(s.startswith(row) for s in names), names
            assert ring or not any(s.startswith("k_mmv_ring<") for s in names), names
        else:
            assert f"{want_kernel}<{want_id}>" in names, names
        w = a.get().astype(np.float64)  # the weights as stored (dequantized)
        want = np.einsum("zmk,znk->znm", np.repeat(w, r2, axis=0), bv.astype(np.float64))
        got = y.get()
        # quantized weights multiply int8-quantized activations: ~1% of a row's scale
        tol = 2e-2 if wt.is_quantized else 1e-4
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < tol, (wtype, k, m, n, err)
        be.free()
        buf.free()


@pytest.mark.parametrize("op", ["NORM", "RMS_NORM", "L2_NORM"])
@pytest.mark.parametrize("keep_norm", [False, True])
def test_norm_mul_fused(op, keep_norm):
    """A norm read only by the MUL after it runs as one launch (accelplane.core.fusion), broadcast
    weights included; asked for as an output too, it runs as two. Against float64 numpy."""
    from accelplane.testing.fusion import run_norm_mul

    plan = run_norm_mul(_cuda(), lambda be, g: be.ctx.plans.get(g), op, keep_norm)
    norms = ("k_norm", "k_norm_vec<1>", "k_norm_vec<4>")
    assert sum(n in norms for n in plan.kernel_names) == 1, plan.kernel_names
    assert len(plan.kernel_names) == (2 if keep_norm else 1), plan.kernel_names
    assert plan.fused == ([] if keep_norm else [(op, "MUL")])


@pytest.mark.parametrize("ne0, w_apart", [(2048, False), (2048, True), (2050, False), (8192, True),
                                          (20480, False)])  # fmt: skip
def test_add_norm_mul_fused(ne0, w_apart):
    """A residual ADD, the RMS_NORM of its sum and the MUL by the norm weights run as one
    launch that also writes the sum, which the next residual ADD reads: the vector kernel for
    aligned rows of up to 16384 elements (one float4 per thread up to 4096, four above), the
    general one otherwise. Weights in a buffer of their own (``w_apart``, as a model's) are
    loaded before the kernel waits for its predecessor."""
    from accelplane.runtime.backend import BufferUsage

    dev = _cuda()
    rng = np.random.default_rng(4)
    ctx = Context()
    a = ctx.new_tensor_ne(T.F32, ne0, 2, name="a")
    b = ctx.new_tensor_ne(T.F32, ne0, 2, name="b")
    w = ctx.new_tensor_ne(T.F32, ne0, name="w")
    s = ctx.add(a, b)
    y = ctx.add(ctx.mul(ctx.rms_norm(s, 1e-5), w), s)
    g = ctx.graph(y)
    wbuf = alloc_tensors([w], dev.buffer_type, BufferUsage.WEIGHTS) if w_apart else None
    buf = alloc_tensors([t for t in ctx.tensors + list(g.nodes) if not (w_apart and t is w)], dev.buffer_type)
    vals = {t: rng.standard_normal(t.shape).astype(np.float32) for t in (a, b, w)}
    for t, v in vals.items():
        t.set(v)
    be = dev.new_backend()
    try:
        be.compute(g)
        plan = be.ctx.plans.get(g)
        assert plan.fused == [("ADD", "RMS_NORM", "MUL")]
        kernel = {2048: "k_norm_vec<1>", 8192: "k_norm_vec<4>"}.get(ne0, "k_norm")
        assert plan.kernel_names == [kernel, "k_binary_flat<float,float>"], plan.kernel_names
        sd = vals[a].astype(np.float64) + vals[b]
        want = sd / np.sqrt((sd * sd).mean(-1, keepdims=True) + 1e-5) * vals[w] + sd
        np.testing.assert_allclose(y.get(), want, rtol=1e-4, atol=1e-5)
        assert (id(w.buffer) not in plan.written) == w_apart
    finally:
        be.free()
        buf.free()
        if wbuf is not None:
            wbuf.free()


@pytest.mark.parametrize("n", [1, 3])
def test_norm_quantizes_for_matvec(n):
    """An RMS_NORM + MUL read by register mat-vecs writes their quantized activations itself
    (no k_quant_x launch), and its float result, also read by an ADD, stays exact. Against
    float64 numpy on the gguf package's dequantization."""
    dev = _cuda()
    k, m = 4096, 200
    rng = np.random.default_rng(5)
    ctx = Context()
    x = ctx.new_tensor_ne(T.F32, k, n, name="x")
    g = ctx.new_tensor_ne(T.F32, k, name="g")
    w1 = ctx.new_tensor_ne(T.Q4_0, k, m, name="w1")
    w2 = ctx.new_tensor_ne(T.Q8_0, k, m, name="w2")
    h = ctx.mul(ctx.rms_norm(x, 1e-5), g)
    outs = [ctx.mul_mat(w1, h), ctx.mul_mat(w2, h), ctx.add(h, x)]
    graph = ctx.graph(*outs)
    buf = alloc_tensors(ctx.tensors + list(graph.nodes), dev.buffer_type)
    xv = rng.standard_normal((n, k)).astype(np.float32)
    gv = rng.uniform(0.5, 1.5, k).astype(np.float32)
    x.set(xv)
    g.set(gv)
    wf = {t: _quantized_weights(t, rng)[1] for t in (w1, w2)}
    be = dev.new_backend()
    try:
        be.compute(graph)
        names = be.ctx.plans.get(graph).kernel_names
        assert "k_norm_vec<1>" in names and "k_quant_x" not in names, names
        assert sum(s.startswith(("k_mmv_row<", "k_mmv_row1<")) for s in names) == 2, names
        x64 = xv.astype(np.float64)
        hv = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * gv
        np.testing.assert_allclose(outs[2].get(), hv + x64, rtol=1e-5, atol=1e-5)
        for o, t in zip(outs[:2], (w1, w2), strict=True):
            _assert_int8_close(o, hv @ wf[t].T, t.name)
    finally:
        be.free()
        buf.free()


def _refuses_position_past(be, g, pos, n_ctx: int) -> None:
    """Computing ``g`` with a position past the cache's n_ctx rows is a ComputeError."""
    from accelplane.errors import ComputeError

    pos.set(np.array([1, n_ctx, 2], np.int32))
    with pytest.raises(ComputeError, match="out of range"):
        be.compute(g)


@pytest.mark.parametrize("cache_type", ["F16", "F32"])
@pytest.mark.parametrize("neox", [False, True])
def test_rope_into_cache_fused(cache_type, neox):
    """ROPE → reshape → SET_ROWS (the model's K path) runs as one k_rope launch that writes the
    rotated rows into the cache at the given positions, converted to the cache's type; the rest
    of the cache is untouched; matches the float64 reference; a position past the cache is a
    ComputeError."""
    from accelplane.core.ops import ROPE_TYPE_NEOX, ROPE_TYPE_NORMAL
    from accelplane.oracle import reference

    dev = _cuda()
    rng = np.random.default_rng(21)
    hd, heads, n_tok, n_ctx = 64, 4, 3, 40
    ctx = Context()
    k = ctx.new_tensor_ne(T.F32, hd, heads, n_tok, name="k")
    pos = ctx.new_tensor_ne(T.I32, n_tok, name="pos")
    cache = ctx.new_tensor_ne(T[cache_type], hd * heads, n_ctx, name="cache")
    r = ctx.rope(k, pos, hd, ROPE_TYPE_NEOX if neox else ROPE_TYPE_NORMAL, n_ctx_orig=4096, freq_base=5e5)
    sr = ctx.set_rows(cache, ctx.reshape_ne(r, hd * heads, n_tok), pos)
    g = ctx.graph(sr)
    buf = alloc_tensors(ctx.tensors + list(g.nodes), dev.buffer_type)
    be = dev.new_backend()
    try:
        for rep, where in enumerate(([5, 0, 39], [7, 8, 9])):
            kv = rng.standard_normal((n_tok, heads, hd)).astype(np.float32)
            cv = rng.standard_normal((n_ctx, hd * heads)).astype(np.float32)
            k.set(kv)
            cache.set(cv)
            pos.set(np.array(where, np.int32))
            want = reference.evaluate(g, {k: kv, cache: cv, pos: np.array(where)})[sr].reshape(n_ctx, -1)
            be.compute(g)
            got = cache.get().astype(np.float64)
            tol = 2e-3 if cache_type == "F16" else 1e-5
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"rep {rep}")
        plan = be.ctx.plans.get(g)
        td = "__half" if cache_type == "F16" else "float"
        assert plan.fused == [("ROPE", "SET_ROWS")], plan.fused
        assert plan.kernel_names == [f"k_rope<float,{td}>"], plan.kernel_names
        _refuses_position_past(be, g, pos, n_ctx)
    finally:
        be.free()
        buf.free()


@pytest.mark.parametrize("cache_type", ["F16", "F32", None])
@pytest.mark.parametrize("neox", [False, True])
def test_norm_rope_fused(cache_type, neox):
    """A head norm, its MUL and the ROPE of that (qwen3's Q/K path; with cache_type, on through
    a reshape and SET_ROWS into the cache) run as one k_norm_rope launch on strided heads of a
    wider row (a slice of the Q/K/V product), partial rotation included; against the float64
    reference; a position past the cache is a ComputeError."""
    from accelplane.core.ops import ROPE_TYPE_NEOX, ROPE_TYPE_NORMAL
    from accelplane.oracle import reference

    dev = _cuda()
    rng = np.random.default_rng(22)
    hd, heads, n_tok, n_ctx = 128, 4, 3, 40
    ctx = Context()
    qkv = ctx.new_tensor_ne(T.F32, hd * heads + 64, n_tok, name="qkv")
    w = ctx.new_tensor_ne(T.F32, hd, name="w")
    pos = ctx.new_tensor_ne(T.I32, n_tok, name="pos")
    k = ctx.view(qkv, (hd, heads, n_tok), (4, hd * 4, qkv.nb[1]), 64 * 4)
    mode = ROPE_TYPE_NEOX if neox else ROPE_TYPE_NORMAL
    r = ctx.rope(ctx.mul(ctx.rms_norm(k, 1e-6), w), pos, hd - 32, mode, n_ctx_orig=4096, freq_base=1e6)
    if cache_type is None:
        out = r
    else:
        cache = ctx.new_tensor_ne(T[cache_type], hd * heads, n_ctx, name="cache")
        out = ctx.set_rows(cache, ctx.reshape_ne(r, hd * heads, n_tok), pos)
    g = ctx.graph(out)
    buf = alloc_tensors(ctx.tensors + list(g.nodes), dev.buffer_type)
    be = dev.new_backend()
    try:
        xv = rng.standard_normal(qkv.shape).astype(np.float32)
        wv = rng.uniform(0.5, 1.5, hd).astype(np.float32)
        where = np.array([5, 0, 39], np.int32)
        vals = {qkv: xv, w: wv, pos: where}
        qkv.set(xv)
        w.set(wv)
        pos.set(where)
        if cache_type is not None:
            vals[cache] = rng.standard_normal((n_ctx, hd * heads)).astype(np.float32)
            cache.set(vals[cache])
        want = reference.evaluate(g, vals)[out]
        be.compute(g)
        tol = 2e-3 if cache_type == "F16" else 1e-5
        np.testing.assert_allclose(out.get().astype(np.float64), want.reshape(out.shape), rtol=tol, atol=tol)
        plan = be.ctx.plans.get(g)
        assert plan.fused == [("RMS_NORM", "MUL", "ROPE", *(("SET_ROWS",) if cache_type else ()))], plan.fused
        td = "__half" if cache_type == "F16" else "float"
        assert plan.kernel_names == [f"k_norm_rope<{td}>"], plan.kernel_names
        if cache_type is not None:
            _refuses_position_past(be, g, pos, n_ctx)
    finally:
        be.free()
        buf.free()


@pytest.mark.parametrize("over", [False, True])
def test_norm_rope_declines_writing_over_its_source(over):
    """k_norm_rope's warps read the norm's source rows while others write: a run whose cache
    rows lie over that source (here: both views of one tensor) is declined; apart, it fits.
    (Placement only: no GPU needed.)"""
    from accelplane.core.fusion import Fusion
    from accelplane.core.ops import ROPE_TYPE_NEOX
    from accelplane_cuda import softmax_rope

    hd, heads, n_tok, n_ctx = 64, 2, 3, 8
    ctx = Context()
    mem = ctx.new_tensor_ne(T.F32, 2 * hd * heads * n_ctx, name="mem")
    cache = ctx.view(mem, (hd * heads, n_ctx), (4, 4 * hd * heads), 0 if over else 4 * hd * heads * n_ctx)
    x = ctx.new_tensor_ne(T.F32, hd, heads, n_tok, name="x")
    if over:  # rows read from the bytes the cache rows are written to
        x = ctx.view(mem, (hd, heads, n_tok), (4, 4 * hd, 4 * hd * heads), 4 * hd)
    w = ctx.new_tensor_ne(T.F32, hd, name="w")
    pos = ctx.new_tensor_ne(T.I32, n_tok, name="pos")
    r = ctx.rope(ctx.mul(ctx.rms_norm(x, 1e-6), w), pos, hd, ROPE_TYPE_NEOX)
    g = ctx.graph(ctx.set_rows(cache, ctx.reshape_ne(r, hd * heads, n_tok), pos))
    buf = alloc_tensors(ctx.tensors + list(g.nodes), accelplane.device("CPU").buffer_type)
    try:
        i = next(i for i, n in enumerate(g.nodes) if n.op.name == "RMS_NORM")
        run = Fusion(g).norm_rope(i)
        assert run is not None and run.set_rows is not None
        assert softmax_rope.norm_rope_fits(run, g.nodes[i + 3]) is not over
    finally:
        buf.free()


@pytest.mark.parametrize("wtype, k", [("Q4_0", 2048), ("Q8_0", 4096)])
@pytest.mark.parametrize("cache_type", ["F16", "F32"])
@pytest.mark.parametrize("v_rows", [True, False])
def test_qkv_projection_fused(monkeypatch, wtype, k, cache_type, v_rows):
    """The llama decode's Q/K/V projection → Q rope, K rope into the K cache, V into the V cache
    (both layouts the model writes) runs as one k_mmv_row1 launch with the QKV epilogue; Q and
    the caches match float64 (accelplane.oracle.reference on the gguf package's dequantization), slots
    not written are untouched, a position past the cache is a ComputeError; with
    ACCELPLANE_FUSION=0 separate kernels compute the same."""
    from accelplane.errors import ComputeError
    from accelplane.models.blocks import qkv_block
    from accelplane.oracle import reference
    from accelplane.runtime.backend import BufferUsage

    dev = _cuda()
    rng = np.random.default_rng(8)
    hd, nh, nkv, n_ctx, p = 64, 4, 2, 40, 7
    ctx = Context()
    b = qkv_block(ctx, T[wtype], k, hd, nh, nkv, n_ctx, T[cache_type], v_rows)
    q_out = ctx.scale(b.q_rope, 1.0)
    g = ctx.graph(b.v_set, b.k_set, q_out)
    wbuf = alloc_tensors([b.w], dev.buffer_type, BufferUsage.WEIGHTS)
    buf = alloc_tensors([t for t in ctx.tensors if t is not b.w] + list(g.nodes), dev.buffer_type)
    raw = _quantized_weights(b.w, rng)[0]
    xv = rng.standard_normal(b.x.shape).astype(np.float32)
    kcv = rng.standard_normal(b.k_cache.shape).astype(np.float32)
    vcv = rng.standard_normal(b.v_cache.shape).astype(np.float32)
    nk = hd * nkv
    vi = np.arange(nk, dtype=np.int32) * n_ctx + p
    ins = {b.w: raw, b.x: xv, b.k_cache: kcv, b.v_cache: vcv, b.pos: np.array([p]), b.v_idx: vi}
    ref = reference.evaluate(g, ins)
    want = [ref[t].reshape(-1) for t in (q_out, b.k_set, b.v_set)]  # the caches after the writes
    scale = np.abs(want[0]).max()
    for fused in (True, False):
        monkeypatch.setenv("ACCELPLANE_FUSION", "1" if fused else "0")
        for t, v in ins.items():
            if t is not b.w:
                t.set(v)
        be = dev.new_backend()
        try:
            be.compute(g)
            plan = be.ctx.plans.get(g)
            names = plan.kernel_names
            got = [t.get().astype(np.float64).reshape(-1) for t in (q_out, b.k_cache, b.v_cache)]
            for name, gv, wv in zip(("Q", "K cache", "V cache"), got, want, strict=True):
                err = np.abs(gv - wv).max() / scale
                assert err < 2e-2, (name, fused, err)
            # untouched slots keep their bits: K rows other than p, V columns other than p
            np.testing.assert_array_equal(got[1].reshape(n_ctx, nk)[np.arange(n_ctx) != p],
                                          want[1].reshape(n_ctx, nk)[np.arange(n_ctx) != p])  # fmt: skip
            np.testing.assert_array_equal(got[2].reshape(nk, n_ctx)[:, np.arange(n_ctx) != p],
                                          want[2].reshape(nk, n_ctx)[:, np.arange(n_ctx) != p])  # fmt: skip
            if fused:
                assert plan.fused == [("MUL_MAT", "ROPE", "ROPE", "SET_ROWS", "SET_ROWS")], plan.fused
                assert any(n.startswith("k_mmv_row1<") and n.endswith(",true>") for n in names), names
                assert not any(n.startswith(("k_rope", "k_set_rows")) for n in names), names
                b.pos.set(np.array([n_ctx], np.int32))
                with pytest.raises(ComputeError, match="out of range"):
                    be.compute(g)
            else:
                assert plan.fused == [], plan.fused
                assert "k_rope<float,float>" in names, names
                assert any(n.startswith("k_set_rows<") for n in names), names
        finally:
            be.free()
    buf.free()
    wbuf.free()


@pytest.mark.parametrize("kv, d, rows, nkv, mtype, n_ctx, split", [
    ("F16", 128, 4, 200, "F16", 1032, 8), ("F16", 64, 8, 1, "F32", 1032, 8),
    ("F32", 64, 1, 32, "F16", 1032, 8), ("F16", 128, 2, 1000, None, 1032, 8),
    ("F16", 128, 2, 1000, "F16", 1032, 1), ("F32", 96, 3, 45, "F32", 1032, 8),
    ("F16", 64, 9, 64, "F16", 1032, 8), ("F16", 128, 4, 128, "F16", 128, 8),
    ("F16", 128, 4, 45, "F16", 48, 8), ("F16", 64, 4, 45, None, 45, 8),
    ("F32", 128, 4, 8192, "F32", 8192, 8), ("F16", 128, 4, 256, "F16", 1032, 8),
    ("F16", 128, 1, 512, "F32", 1032, 8), ("F16", 64, 4, 520, "F16", 1032, 8),
    ("F16", 256, 2, 300, "F16", 1032, 8), ("F16", 64, 8, 250, "F32", 256, 8)])  # fmt: skip
def test_attention_fused(monkeypatch, kv, d, rows, nkv, mtype, n_ctx, split):
    """MUL_MAT(K, Q) → SOFT_MAX(scale, mask) → MUL_MAT(V, ·) over a KV cache laid out as the
    llama model's (K rows per position, V transposed, views of longer caches, query heads
    broadcast over KV heads) runs as one k_attention launch (9 query rows: the three kernels),
    replays and matches float64 numpy, masked positions too. A second attention over a shorter
    window in the same graph runs too. A Q4_0 output projection of the first one's result
    (through a reshape, as the model's) reads the activations the attention kernel quantized: no
    k_quant_x launch. The V cache has a buffer of its own, so a cache of n_ctx = n_kv or not a
    multiple of 8 positions ends at the buffer's end (the kernel must not read whole words
    there), and unaligned rows (45 positions) take the element-wise loads. A block takes up to
    attention.POSITION_WORK / (D + Dv) positions of a row (256 at D = 64, 128 at D = 128); longer
    caches several blocks of a cluster per row (on sm_90+), 8192 the most, or with ``split`` 1
    one block looping over tiles of 256 (as on older GPUs); K rows
    of 256 F16 and of 96 F32 take two passes of loads, as do V rows of 96 F32. Masks: the last
    position hidden; a decode window's padding (every position past a fifth hidden: whole tiles
    and blocks of nothing but masked positions); a hole in the middle."""
    from accelplane_cuda import attention

    monkeypatch.setattr(attention, "MAX_SPLIT", split)
    dev = _cuda()
    kt = T[kv]
    hkv, g, dv = 2, 2, d
    nkv2 = max(1, nkv // 3)
    rng = np.random.default_rng(12)
    ctx = Context()
    kc = ctx.new_tensor_ne(kt, d * hkv, n_ctx, name="kc")  # [n_ctx][hkv * d]
    vc = ctx.new_tensor_ne(kt, n_ctx, dv * hkv, name="vc")  # [hkv * dv][n_ctx]
    q = ctx.new_tensor_ne(T.F32, d, rows, hkv * g, name="q")
    es = kt.type_size
    mask = ctx.new_tensor_ne(T[mtype], nkv, rows, name="mask") if mtype else None

    def attend(n: int, m):
        kk = ctx.view(kc, (d, n, hkv), (es, d * hkv * es, d * es))
        vv = ctx.view(vc, (n, dv, hkv), (es, n_ctx * es, dv * n_ctx * es))
        return ctx.mul_mat(vv, ctx.soft_max(ctx.mul_mat(kk, q), m, 0.125, 0.0))

    y, y2 = attend(nkv, mask), attend(nkv2, None)
    ko = dv * rows * hkv * g  # the projection's input: y flattened (a register mat-vec's K)
    wo = ctx.new_tensor_ne(T.Q4_0, ko, 48, name="wo") if ko % 256 == 0 else None
    proj = ctx.mul_mat(wo, ctx.reshape_ne(y, ko, 1)) if wo is not None else None
    graph = ctx.graph(y, y2, *([proj] if proj is not None else []))
    vbuf = alloc_tensors([vc], dev.buffer_type)
    buf = alloc_tensors([t for t in ctx.tensors + list(graph.nodes) if t is not vc], dev.buffer_type)
    if wo is not None:
        wo.set(rng.uniform(-1, 1, wo.shape).astype(np.float32))
    npt = np.float16 if kv == "F16" else np.float32
    kcv = rng.standard_normal((n_ctx, hkv * d)).astype(npt)
    vcv = rng.standard_normal((hkv * dv, n_ctx)).astype(npt)
    kc.set(kcv)
    vc.set(vcv)

    def reference(qv: np.ndarray, n: int, mv) -> np.ndarray:
        k64 = kcv.astype(np.float64)[:n].reshape(n, hkv, d)
        v64 = vcv.astype(np.float64)[:, :n].reshape(hkv, dv, n)
        out = np.empty((hkv * g, rows, dv))
        for h in range(hkv * g):
            sc = qv[h].astype(np.float64) @ k64[:, h // g].T * 0.125
            if mv is not None:
                sc = sc + mv.astype(np.float16 if mtype == "F16" else np.float32)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            out[h] = p / p.sum(-1, keepdims=True) @ v64[h // g].T
        return out

    be = dev.new_backend()
    try:
        for rep in range(3):
            qv = rng.standard_normal((hkv * g, rows, d)).astype(np.float32)
            q.set(qv)
            mv = None
            if mask is not None:
                mv = rng.standard_normal((rows, nkv)).astype(np.float32)
                if rep == 0:
                    mv[:, -1:] = -np.inf
                elif rep == 1:
                    mv[:, max(1, nkv // 5) :] = -np.inf
                else:
                    mv[:, nkv // 4 : 3 * nkv // 4] = -np.inf
                mv[:, 0] = 0.0  # the first position stays visible
                mask.set(mv.astype(np.float16 if mtype == "F16" else np.float32))
            be.compute(graph)
            # nine query rows take cuBLAS, on queries rounded to F16 like the cache
            tol = 1e-4 if rows <= 8 else 5e-3
            for out, n, m in ((y, nkv, mv), (y2, nkv2, None)):
                want = reference(qv, n, m)
                got = out.get().reshape(want.shape)
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"rep {rep}, n_kv {n}")
            if proj is not None:
                want = reference(qv, nkv, mv).reshape(-1) @ wo.get().astype(np.float64).T
                _assert_int8_close(proj, want, rep)
        plan = be.ctx.plans.get(graph)
        names = plan.kernel_names
        if proj is not None:  # its kernels come last
            assert names[-1].startswith(("k_mmv_row<102,", "k_mmv_row1<102,")), names
            names = names[:-2] if names[-2] == "k_quant_x" else names[:-1]
        if rows <= 8:
            assert plan.fused == [("MUL_MAT", "SOFT_MAX", "MUL_MAT")] * 2, plan.fused
            assert all(n.startswith("k_attention<") for n in names) and len(names) == 2, plan.kernel_names
            assert "k_quant_x" not in plan.kernel_names, plan.kernel_names  # the attention quantized
        else:  # the queries converted to F16 once for both products that read them
            assert not plan.fused and len(names) == 5, plan.kernel_names
            assert sum(n.startswith("k_convert") for n in names) == 3, plan.kernel_names
    finally:
        be.free()
        buf.free()
        vbuf.free()


@pytest.mark.parametrize("k, n", [(64, 8), (256, 8), (2048, 8), (128, 1)])
@pytest.mark.parametrize("wtype", ["F16", "F32"])
def test_small_products_stage_activations(k, n, wtype):
    """The KV-cache products of a decode (F16/F32, few rows, batched over heads with
    broadcast) by k_mul_mat_vec, with the activation rows staged in shared memory where they
    fit 48 KiB (2048 x 8 floats do not: read from L2 instead), against float64 numpy."""
    dev = _cuda()
    m, heads, g = 96, 4, 2
    rng = np.random.default_rng(7)
    ctx = Context()
    a = ctx.new_tensor_ne(T[wtype], k, m, heads, name="a")
    b = ctx.new_tensor_ne(T.F32, k, n, heads * g, name="b")  # broadcast: g activation batches per a
    y = ctx.mul_mat(a, b)
    graph = ctx.graph(y)
    buf = alloc_tensors(ctx.tensors + list(graph.nodes), dev.buffer_type)
    av = rng.standard_normal((heads, m, k)).astype(np.float16 if wtype == "F16" else np.float32)
    bv = rng.standard_normal((heads * g, n, k)).astype(np.float32)
    a.set(av)
    b.set(bv)
    be = dev.new_backend()
    try:
        be.compute(graph)
        plan = be.ctx.plans.get(graph)
        assert plan.kernel_names == [f"k_mul_mat_vec<{0 if wtype == 'F32' else 1}>"], plan.kernel_names
        want = np.einsum("hmk,hnk->hnm", np.repeat(av.astype(np.float64), g, axis=0), bv.astype(np.float64))
        np.testing.assert_allclose(y.get().reshape(want.shape), want, rtol=1e-4, atol=1e-3)
    finally:
        be.free()
        buf.free()


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("merged", [True, False])
def test_glu_quantizes_for_matvec(n, merged):
    """A SWIGLU (of a merged gate/up tensor, or of two) read by a register mat-vec runs as the
    vector kernel and writes the quantized activations itself (no k_quant_x launch); its float
    result, read by another node too, stays exact. Rows of 2050 take the general kernel. Against
    float64 numpy on the gguf package's dequantization."""
    dev = _cuda()
    k, m = 1536, 96
    rng = np.random.default_rng(6)
    ctx = Context()
    w = ctx.new_tensor_ne(T.Q4_0, k, m, name="w")
    if merged:
        gu = ctx.new_tensor_ne(T.F32, 2 * k, n, name="gu")
        a = ctx.swiglu(gu)
        ins = [gu]
    else:
        gt, up = ctx.new_tensor_ne(T.F32, k, n, name="g"), ctx.new_tensor_ne(T.F32, k, n, name="u")
        a = ctx.swiglu(gt, up)
        ins = [gt, up]
    odd = ctx.new_tensor_ne(T.F32, 2050, n, name="odd")
    outs = [ctx.mul_mat(w, a), ctx.scale(a, 2.0), ctx.swiglu(odd, odd)]
    graph = ctx.graph(*outs)
    buf = alloc_tensors(ctx.tensors + list(graph.nodes), dev.buffer_type)
    vals = {t: rng.standard_normal(t.shape).astype(np.float32) for t in (*ins, odd)}
    for t, v in vals.items():
        t.set(v)
    wf = _quantized_weights(w, rng)[1]
    be = dev.new_backend()
    try:
        be.compute(graph)
        names = be.ctx.plans.get(graph).kernel_names
        assert names.count("k_glu_vec") == 1 and "k_quant_x" not in names, names
        assert "k_glu<float>" in names, names  # the 2050-element rows

        def swiglu(x, g):
            return x / (1 + np.exp(-x)) * g

        if merged:
            v = vals[gu].astype(np.float64)
            av = swiglu(v[:, :k], v[:, k:])
        else:
            av = swiglu(vals[gt].astype(np.float64), vals[up].astype(np.float64))
        np.testing.assert_allclose(outs[1].get(), 2 * av, rtol=1e-5, atol=1e-5)
        ov = vals[odd].astype(np.float64)
        np.testing.assert_allclose(outs[2].get(), swiglu(ov, ov), rtol=1e-5, atol=1e-5)
        _assert_int8_close(outs[0], av @ wf.T)
    finally:
        be.free()
        buf.free()


def test_activations_quantized_once_per_graph():
    """Register mat-vecs of one activation vector share its quantization (one k_quant_x), until
    a node writes into that vector: the product after a CPY into it quantizes it again and sees
    the new values (against float64 numpy)."""
    dev = _cuda()
    rng = np.random.default_rng(5)
    k, m = 512, 64
    ctx = Context()
    ws = [ctx.new_tensor_ne(T.Q4_0, k, m, name=f"w{i}") for i in range(3)]
    x = ctx.new_tensor_ne(T.F32, k, 1, name="x")
    src = ctx.new_tensor_ne(T.F32, k, 1, name="src")
    y0, y1 = ctx.mul_mat(ws[0], x), ctx.mul_mat(ws[1], x)
    c = ctx.cpy(src, x)
    y2 = ctx.mul_mat(ws[2], x)
    g = ctx.graph(y0, y1, c, y2)
    assert g.nodes.index(c) < g.nodes.index(y2)
    bufs = [alloc_tensors(ws, dev.buffer_type), alloc_tensors([x, src, *g.nodes], dev.buffer_type)]
    for w in ws:
        w.set(rng.uniform(-1, 1, w.shape).astype(np.float32))
    xv, sv = (rng.uniform(-1, 1, (1, k)).astype(np.float32) for _ in range(2))
    x.set(xv)
    src.set(sv)
    be = dev.new_backend()
    try:
        be.compute(g)
        names = be.ctx.plans.get(g).kernel_names
        assert names.count("k_quant_x") == 2, names  # y0 and y1 share one; y2 after the CPY
        for y, w, v in ((y0, ws[0], xv), (y1, ws[1], xv), (y2, ws[2], sv)):
            _assert_int8_close(y, v.astype(np.float64) @ w.get().astype(np.float64).T, y.name)
    finally:
        be.free()
        for b in bufs:
            b.free()


@pytest.mark.parametrize("wtype", ["Q4_0", "Q8_0", "Q4_K"])
def test_x8_weights(wtype):
    """Q4_0/Q8_0/Q4_K weights in a weights buffer are stored regrouped (accelplane_cuda.layout):
    set/get give GGUF bytes back (partial rows too), every kernel that reads or writes them
    (mat-vec for 1 and 3 rows, the dequantize + GEMM path, GET_ROWS, CPY to F32, CPY and
    SET_ROWS into them: Q4_0 and Q8_0) agrees with float64 numpy on the gguf package's
    dequantization, and a copy to a compute buffer holds GGUF bytes."""
    from accelplane.runtime.backend import BufferUsage
    from accelplane_cuda import layout

    dev = _cuda()
    wt = T[wtype]
    qt = gguf.GGMLQuantizationType[wtype]
    k, m = 2048, 72
    rng = np.random.default_rng(3)
    ctx = Context()
    w = ctx.new_tensor_ne(wt, k, m, name="w")
    wq = ctx.new_tensor_ne(wt, k, 8, name="wq")  # written by CPY and SET_ROWS below
    wc = ctx.new_tensor_ne(wt, k, m, name="wc")  # a compute-buffer copy
    wbuf = alloc_tensors([w, wq], dev.buffer_type, BufferUsage.WEIGHTS)
    cbuf = alloc_tensors([wc], dev.buffer_type, BufferUsage.COMPUTE)
    assert layout.region(w) is w and layout.region(wc) is None
    raw = _quantized_weights(w, rng)[0]
    np.testing.assert_array_equal(w.get_bytes(), raw)
    # a write cutting rows 5 and 6: row 7's bytes from the same in-row offset (valid blocks)
    rb = w.row_bytes
    raw[rb * 5 + 40 : rb * 6 + 100] = raw[rb * 7 + 40 : rb * 8 + 100].copy()
    w.set_bytes(raw[rb * 5 + 40 : rb * 6 + 100], offset=rb * 5 + 40)
    np.testing.assert_array_equal(w.get_bytes(), raw)
    tensor_copy(w, wc)
    np.testing.assert_array_equal(wc.get_bytes(), raw)
    wf = gguf.dequantize(raw, qt).reshape(m, k).astype(np.float64)

    x1 = ctx.new_tensor_ne(T.F32, k, 1, name="x1")
    x3 = ctx.new_tensor_ne(T.F32, k, 3, name="x3")
    x64 = ctx.new_tensor_ne(T.F32, k, 64, name="x64")
    idx = ctx.new_tensor_ne(T.I32, 5, name="idx")
    src = ctx.new_tensor_ne(T.F32, k, 8, name="src")
    sidx = ctx.new_tensor_ne(T.I32, 3, name="sidx")
    rows = ctx.view(w, (k, 16), offset=w.row_bytes * 8)  # whole rows of w, as merged Q/K/V views
    outs = [ctx.mul_mat(w, x1), ctx.mul_mat(w, x3), ctx.mul_mat(w, x64), ctx.get_rows(w, idx),
            ctx.cpy(w, ctx.new_tensor_ne(T.F32, k, m, name="wf")), ctx.mul_mat(rows, x1)]  # fmt: skip
    g = ctx.graph(*outs)
    bufs = alloc_tensors(ctx.tensors + list(g.nodes), dev.buffer_type, BufferUsage.COMPUTE)
    xs = {t: rng.standard_normal(t.shape).astype(np.float32) for t in (x1, x3, x64)}
    for t, v in xs.items():
        t.set(v)
    idx.set(np.array([3, 0, 71, 8, 3], np.int32))
    be = dev.new_backend()
    be.compute(g)
    names = be.ctx.plans.get(g).kernel_names
    x8 = layout.X8[wt]
    assert any(n.startswith((f"k_mmv_row<{x8},", f"k_mmv_row1<{x8},")) for n in names), names
    assert any(n.startswith(f"k_mmv_ring<{x8},") for n in names) == (wt == T.Q4_K), names  # one row, K 2048
    assert f"k_get_rows_q<{x8}>" in names, names
    assert f"k_cpy_dq<{x8}>" in names
    assert f"k_dequant_x8<{x8}>" in names, names
    want = [xs[x1] @ wf.T, xs[x3] @ wf.T, xs[x64] @ wf.T, wf[[3, 0, 71, 8, 3]], wf, xs[x1] @ wf[8:24].T]
    for i, (o, wv) in enumerate(zip(outs, want, strict=True)):
        got = o.get().reshape(wv.shape)
        # products round the activations (int8 for mat-vec, F16 for the GEMM): ~1% of a row's
        # scale; GET_ROWS and CPY dequantize exactly
        tol = 2e-2 if i in (0, 1, 2, 5) else 1e-6
        err = np.abs(got - wv).max() / max(np.abs(wv).max(), 1e-30)
        assert err < tol, (wtype, i, err)

    if wt == T.Q4_K:
        return  # no kernel writes Q4_K (supports_op refuses CPY and SET_ROWS into it)

    # kernels writing into x8 weights: CPY (quantizing) and SET_ROWS; against the gguf
    # package's quantization, within one quantization step (rounding of ties may differ)
    def close(got: np.ndarray, v: np.ndarray) -> bool:
        want = gguf.dequantize(gguf.quantize(v, qt).reshape(-1), qt).reshape(v.shape)
        step = np.abs(v).max(axis=1, keepdims=True) / (127 if wt == T.Q8_0 else 7)
        return bool(np.all(np.abs(got - want) <= step * 1.01))

    sv = rng.standard_normal((8, k)).astype(np.float32)
    src.set(sv)
    sidx.set(np.array([6, 1, 4], np.int32))
    ctx2 = Context()

    def run(out) -> None:
        g = ctx2.graph(out)
        alloc_tensors(list(g.nodes), dev.buffer_type, BufferUsage.COMPUTE)  # binds the views
        be.compute(g)

    run(ctx2.cpy(src, wq))
    got_q = gguf.dequantize(wq.get_bytes(), qt).reshape(8, k)
    assert close(got_q, sv), wtype
    sv2 = rng.standard_normal((8, k)).astype(np.float32)
    src.set(sv2)
    run(ctx2.set_rows(wq, ctx2.view(src, (k, 3)), sidx))
    got_s = gguf.dequantize(wq.get_bytes(), qt).reshape(8, k)
    assert close(got_s[[6, 1, 4]], sv2[:3]), wtype
    kept = [0, 2, 3, 5, 7]
    np.testing.assert_array_equal(got_s[kept], got_q[kept])
    be.free()
    for b in (wbuf, cbuf, bufs):
        b.free()


@pytest.mark.parametrize("pdl", ["0", "1"])
def test_programmatic_launch_chain(monkeypatch, pdl):
    """A decode-like chain (norm, mat-vecs on weights, residual adds, a SET_ROWS into a
    cache that a product then reads) gives the float64 answer with and without programmatic
    dependent launch, replayed as a CUDA graph too; the first launch of a graph never carries
    the attribute, and the register mat-vec reads weights before waiting only when no kernel
    of the graph writes their buffer (here: the CPY into a weights-buffer tensor disables it
    for the weights sharing that buffer)."""
    from accelplane.runtime.backend import BufferUsage

    monkeypatch.setenv("ACCELPLANE_CUDA_PDL", pdl)
    dev = _cuda()
    k, layers = 2048, 6
    rng = np.random.default_rng(11)
    ctx = Context()
    ws = [ctx.new_tensor_ne(T.Q4_0, k, k, name=f"w{i}") for i in range(layers)]
    wq = ctx.new_tensor_ne(T.Q8_0, k, 64, name="wq")  # written below, in a weights buffer
    wo = ctx.new_tensor_ne(T.Q8_0, k, 64, name="wo")  # shares wq's buffer: no early reads
    x = ctx.new_tensor_ne(T.F32, k, name="x")
    src = ctx.new_tensor_ne(T.F32, k, 64, name="src")
    wbuf = alloc_tensors(ws, dev.buffer_type, BufferUsage.WEIGHTS)
    wbuf2 = alloc_tensors([wq, wo], dev.buffer_type, BufferUsage.WEIGHTS)
    h = x
    for w in ws:
        h = ctx.add(ctx.mul_mat(w, ctx.rms_norm(h, 1e-5)), h)
    filled = ctx.cpy(src, wq)
    outs = [h, ctx.mul_mat(filled, h), ctx.mul_mat(wo, h)]
    g = ctx.graph(*outs)
    buf = alloc_tensors([x, src, *g.nodes], dev.buffer_type, BufferUsage.COMPUTE)
    wf = [_quantized_weights(w, rng, 0.02)[1] for w in (*ws, wo)]
    be = dev.new_backend()
    try:
        for rep in range(3):  # eager, then captured, then replayed
            xv = rng.standard_normal(k).astype(np.float32)
            sv = rng.standard_normal((64, k)).astype(np.float32)
            x.set(xv)
            src.set(sv)
            be.compute(g)
            hv = xv.astype(np.float64)
            for w in wf[:layers]:
                hv = w @ (hv / np.sqrt((hv * hv).mean() + 1e-5)) + hv
            svq = gguf.dequantize(gguf.quantize(sv, gguf.GGMLQuantizationType.Q8_0).reshape(-1),
                                  gguf.GGMLQuantizationType.Q8_0).reshape(64, k)  # fmt: skip
            for got, want in ((outs[0], hv), (outs[1], svq @ hv), (outs[2], wf[-1] @ hv)):
                _assert_int8_close(got, want, pdl, rep)
        plan = be.ctx.plans.get(g)
        assert plan.cuda_graph is not None, plan.graph_error
        flags = [s.config.n_attrs for s in plan.steps]
        want_pdl = pdl == "1" and plan.fns.cc >= 90
        assert flags == [0] + [int(want_pdl)] * (len(flags) - 1), flags
        # the CPY into wq writes its weights buffer (wo's products wait), ws's is read early
        assert id(wq.buffer) in plan.written and id(ws[0].buffer) not in plan.written
        rows = sum(n.startswith(("k_mmv_row<", "k_mmv_row1<")) for n in plan.kernel_names)
        assert rows == layers + 2, plan.kernel_names
    finally:
        be.free()
        buf.free()
        wbuf.free()
        wbuf2.free()
