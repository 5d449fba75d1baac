"""Handle semantics (backend.py, alloc.py, tensor.py) on the CPU plugin: data movement and
range checks, use after free, events across devices, the view invariant, multi-buffers, the
graph allocator, copies between buffers, and typed build-time errors."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from accelplane import Context, GGMLType
from accelplane.cpu import plugin as cpu_plugin
from accelplane.errors import (
    AccelplaneError,
    AllocationError,
    BufferFreedError,
    DeviceError,
    OutOfRangeError,
    ShapeError,
    TypeMismatchError,
)
from accelplane.runtime.alloc import GraphAllocator, alloc_ctx_tensors, alloc_tensors
from accelplane.runtime.backend import (
    Buffer,
    BufferUsage,
    Device,
    MultiBuffer,
    tensor_copy,
    tensor_copy_async,
)
from accelplane.runtime.registry import Registry
from accelplane.testing.plugins import host_plugin

F32 = GGMLType.F32


MAX = 4096


@pytest.fixture(scope="module")
def reg() -> Registry:
    r = Registry()
    for plugin, name in [
        (cpu_plugin, "cpu"),
        (host_plugin("CPU2"), "cpu2"),
        (host_plugin("SMALL", buft_max_size=lambda buft: MAX), "small"),
        (host_plugin("NOHOST", buft_is_host=lambda buft: False), "nohost"),
    ]:
        assert r.register(plugin, name) is not None, r.failures
    return r


@pytest.fixture(scope="module")
def cpu(reg) -> Device:
    return reg.device("CPU")


@pytest.fixture(scope="module")
def backend(cpu):
    return cpu.new_backend()


def alloc(dev: Device, *tensors):
    return alloc_tensors(tensors, dev.buffer_type)


# --- set/get --------------------------------------------------------------------------------------
def _values(t: GGMLType, shape, rng) -> np.ndarray:
    if t == GGMLType.I32:
        return rng.integers(-(2**31), 2**31 - 1, shape, dtype=np.int32)
    x = rng.standard_normal(shape).astype(np.float32) * 100
    if t == GGMLType.F16:
        return x.astype(np.float16)
    if t == GGMLType.BF16:
        return x.astype(ml_dtypes.bfloat16)
    return x


NON_QUANT = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.I32]
SHAPES = [(1,), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 17)]


@pytest.mark.parametrize("ty", NON_QUANT, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_set_get_round_trip(cpu, ty, shape):
    rng = np.random.default_rng(0)
    ctx = Context()
    t = ctx.new_tensor(ty, shape)
    alloc(cpu, t)
    x = _values(ty, shape, rng)
    t.set(x)
    got = t.get()
    assert got.shape == shape and got.dtype == x.dtype
    np.testing.assert_array_equal(got.view(np.uint8), x.view(np.uint8))  # bit-exact
    np.testing.assert_array_equal(np.asarray(t).view(np.uint8), x.view(np.uint8))
    assert t.shape == shape and t.strides == x.strides


@pytest.mark.parametrize("ty", NON_QUANT, ids=str)
def test_bytes_at_the_edges(cpu, ty):
    ctx = Context()
    before, t, after = (ctx.new_tensor(ty, (3, 5)) for _ in range(3))
    buf = alloc(cpu, before, t, after)
    buf.clear(0xAB)
    n = t.nbytes
    assert n == 15 * t.nb[0]
    # whole, first byte, last byte, empty at both ends
    t.set_bytes(np.arange(n, dtype=np.uint8))
    np.testing.assert_array_equal(t.get_bytes(), np.arange(n, dtype=np.uint8))
    t.set_bytes(b"\x01", 0)
    t.set_bytes(b"\x02", n - 1)
    assert t.get_bytes(0, 1)[0] == 1 and t.get_bytes(n - 1, 1)[0] == 2
    assert t.get_bytes(n - 1)[0] == 2  # size defaults to the rest
    assert t.get_bytes(n, 0).size == 0 and t.get_bytes(0, 0).size == 0
    t.set_bytes(b"", n)
    np.testing.assert_array_equal(t.get_bytes(1, n - 2), np.arange(1, n - 1, dtype=np.uint8))
    # the neighbours were never touched
    for nb in (before, after):
        assert (nb.get_bytes() == 0xAB).all()
    # memset inside the range
    buf.memset_tensor(t, 7, 2, 3)
    np.testing.assert_array_equal(t.get_bytes(1, 5), [1, 7, 7, 7, 5])
    for nb in (before, after):
        assert (nb.get_bytes() == 0xAB).all()


def test_out_of_range_raises(cpu, backend):
    ctx = Context()
    t = ctx.new_tensor("f32", (4, 4), name="w")
    alloc(cpu, t)
    n = t.nbytes
    bad = [(n - 1, 2), (n, 1), (-1, 1), (0, n + 1), (3, -1)]
    for offset, size in bad:
        if size >= 0:
            with pytest.raises(OutOfRangeError, match="'w'"):
                t.set_bytes(np.zeros(size, np.uint8), offset)
        with pytest.raises(OutOfRangeError, match="'w'"):
            t.get_bytes(offset, size)
        with pytest.raises(OutOfRangeError):
            backend.get_tensor_async(t, np.empty(max(size, 0), np.uint8), offset, size)
        with pytest.raises(OutOfRangeError):
            backend.set_tensor_async(t, np.zeros(max(size, 0), np.uint8), offset, size)
    with pytest.raises(DeviceError):
        cpu.buffer_type.alloc(8).memset_tensor(t, 0)  # t is not in that buffer
    with pytest.raises(OutOfRangeError):
        t.buffer.memset_tensor(t, 0, n - 2, 4)
    with pytest.raises(OutOfRangeError):
        backend.get_tensor_async(t, np.empty(4, np.uint8), 0, 8)  # out too small
    with pytest.raises(ShapeError, match="'w'"):
        t.set(np.zeros((4, 5), np.float32))
    # nothing was written by any of the failed calls
    assert t.get_bytes().size == n


def test_async_fallbacks_round_trip(cpu, backend):
    ctx = Context()
    t = ctx.new_tensor("f32", (8,))
    alloc(cpu, t)
    x = np.arange(8, dtype=np.float32)
    backend.set_tensor_async(t, x)
    out = np.empty(t.nbytes, np.uint8)
    backend.get_tensor_async(t, out)
    backend.synchronize()
    np.testing.assert_array_equal(out.view(np.float32), x)
    backend.set_tensor_async(t, np.full(2, 9, np.float32), offset=8)
    np.testing.assert_array_equal(t.get(), [0, 1, 9, 9, 4, 5, 6, 7])


def test_unallocated_tensor(cpu):
    t = Context().new_tensor("f32", (3,), name="loose")
    with pytest.raises(DeviceError, match="loose"):
        t.get()


# --- use after free -------------------------------------------------------------------------------
def test_use_after_free(cpu, backend):
    ctx = Context()
    a = ctx.new_tensor("f32", (4, 4), name="a")
    b = ctx.new_tensor("f32", (4, 4), name="b")
    buf = alloc(cpu, a)
    alloc(cpu, b)
    v = ctx.transpose(a)
    a.set(np.ones((4, 4)))
    buf.free()
    assert buf.freed
    buf.free()  # idempotent
    calls = [
        lambda: a.get(),
        lambda: a.set(np.zeros((4, 4))),
        lambda: a.get_bytes(0, 4),
        lambda: a.set_bytes(b"1234"),
        lambda: v.get(),
        lambda: buf.clear(),
        lambda: buf.host_array,
        lambda: buf.memset_tensor(a, 0),
        lambda: buf.place(Context().new_tensor("f32", (1,)), 0),
        lambda: tensor_copy(a, b),
        lambda: tensor_copy(b, a),
        lambda: backend.set_tensor_async(a, np.zeros(4, np.float32)),
        lambda: backend.get_tensor_async(a, np.zeros(4, np.uint8)),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(BufferFreedError):
            call()
            pytest.fail(f"call {i} did not raise")
    with pytest.raises(BufferFreedError, match="'a'"):
        a.get()


def test_freed_backend_and_event(cpu):
    be = cpu.new_backend()
    ev = cpu.new_event()
    be.free()
    with pytest.raises(DeviceError):
        be.synchronize()
    with pytest.raises(DeviceError):
        be.graph_compute(Context().graph(Context().new_tensor("f32", (1,))))
    ev.free()
    with pytest.raises(DeviceError):
        ev.record(cpu.new_backend())


# --- events ---------------------------------------------------------------------------------------
def test_event_of_other_device(reg):
    cpu, cpu2 = reg.device("CPU"), reg.device("CPU2")
    assert cpu is not cpu2 and cpu.plugin is not cpu2.plugin
    ev = cpu.new_event()
    with pytest.raises(DeviceError, match="CPU2"):
        ev.record(cpu2.new_backend())
    be = cpu.new_backend()
    ev.record(be)  # no event hooks: recording synchronizes, then the event is complete
    assert be.n_syncs == 1
    ev.synchronize()
    ev.wait(cpu2.new_backend())


# --- the view invariant ---------------------------------------------------------------------------
def _views(ctx: Context, a):
    r = ctx.reshape(a, (4, 6))
    return {
        "view": ctx.view(a, (3, 2), (4, 24), offset=24),  # ne=(3,2), rows 24 bytes apart
        "reshape": r,
        "permute": ctx.permute(ctx.reshape(a, (2, 3, 4)), 2, 0, 1, 3),
        "transpose": ctx.transpose(a),
        "transpose_of_reshape": ctx.transpose(r),
    }


def _check_invariant(v, a):
    assert v.view_src is a, "a view's view_src is the memory owner"
    assert v.buffer is a.buffer, "a view's buffer IS its view_src's buffer"
    assert v.offs == a.offs + v.view_offs


@pytest.mark.parametrize("when", ["after_alloc", "in_alloc_list", "by_graph_allocator"])
def test_views_share_memory(cpu, when):
    ctx = Context()
    a = ctx.new_tensor("f32", (6, 4), name="a")  # numpy shape (6, 4): ne = (4, 6)
    if when == "after_alloc":
        alloc(cpu, a)
        views = _views(ctx, a)
    elif when == "in_alloc_list":
        views = _views(ctx, a)
        alloc_tensors([a, *views.values()], cpu.buffer_type)
    else:
        a.set_input()
        views = _views(ctx, a)
        g = ctx.graph(*views.values())
        GraphAllocator(cpu.buffer_type).alloc_graph(g)
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    a.set(x)
    expect = {
        "view": x.reshape(-1)[6:18].reshape(2, 6)[:, :3],  # 3 floats per 24-byte row
        "reshape": x.reshape(4, 6),
        "permute": np.transpose(x.reshape(2, 3, 4), (2, 0, 1)),
        "transpose": x.T,
        "transpose_of_reshape": x.reshape(4, 6).T,
    }
    for name, v in views.items():
        _check_invariant(v, a)
        np.testing.assert_array_equal(v.get(), expect[name], err_msg=name)
        # numpy-equivalent through the tensor's own strides: same bytes as a's memory
        raw = np.lib.stride_tricks.as_strided(
            a.buffer.host_array[v.offs :].view(np.float32), v.shape, v.strides
        )
        np.testing.assert_array_equal(v.get(), raw, err_msg=name)
    # writing through a (non-contiguous) view writes a's memory
    t = views["transpose"]
    t.set(-x.T)
    np.testing.assert_array_equal(a.get(), -x)
    views["view"].set(np.full((2, 3), 100, np.float32))
    got = a.get().reshape(-1)
    assert (got[6:9] == 100).all() and (got[12:15] == 100).all()
    assert (got[9:12] == -x.reshape(-1)[9:12]).all()


def test_permute_matches_numpy(cpu):
    ctx = Context()
    a = ctx.new_tensor("f32", (2, 3, 4, 5))
    alloc(cpu, a)
    x = np.arange(120, dtype=np.float32).reshape(2, 3, 4, 5)
    a.set(x)
    # ggml axis i (numpy axis 3 - i) moves to ggml position ax_i
    p = ctx.permute(a, 1, 2, 0, 3)
    ref = np.empty(p.shape, np.float32)
    for src_np in np.ndindex(x.shape):
        src_g = src_np[::-1]
        dst_g = [0] * 4
        for i, ax in enumerate((1, 2, 0, 3)):
            dst_g[ax] = src_g[i]
        ref[tuple(dst_g[::-1])] = x[src_np]
    np.testing.assert_array_equal(p.get(), ref)
    _check_invariant(p, a)


# --- multi-buffers (buffer type max size) ---------------------------------------------------------
def test_multibuffer_parts(reg):
    small = reg.device("SMALL")
    buft = small.buffer_type
    assert buft.max_size == MAX
    ctx = Context()
    ts = [ctx.new_tensor("f32", (250,), name=f"t{i}") for i in range(10)]  # 1000 bytes each
    mb = alloc_ctx_tensors(ctx, buft)
    assert isinstance(mb, MultiBuffer)
    assert len(mb.parts) == 3  # 4 + 4 + 2 tensors (64-byte aligned slots of 1024)
    assert all(p.size <= MAX for p in mb.parts)
    assert mb.size == sum(p.size for p in mb.parts)
    seen = {}
    for i, t in enumerate(ts):
        assert type(t.buffer) is Buffer and t.buffer in mb.parts, "tensor points at a real part"
        assert t.buffer is not mb
        assert t.offs % buft.alignment == 0 and t.offs + t.nbytes <= t.buffer.size
        seen.setdefault(t.buffer.uid, []).append(i)
        t.set(np.full(250, i, np.float32))
    assert sorted(len(v) for v in seen.values()) == [2, 4, 4]
    for i, t in enumerate(ts):
        assert (t.get() == i).all(), "each part holds its tensors' data"
    # views point at their src's part, never the multi-buffer
    for t in ts:
        v = ctx.view(t, (10,), offset=40)
        assert v.buffer is t.buffer and v.buffer is not mb
        assert (v.get() == t.get()[10:20]).all()
    with pytest.raises(DeviceError):
        mb.place(ctx.new_tensor("f32", (1,)), 0)
    mb.set_usage(BufferUsage.COMPUTE)
    assert all(p.usage == BufferUsage.COMPUTE for p in mb.parts)
    mb.clear(0)
    assert all((t.get() == 0).all() for t in ts)
    mb.free()
    assert all(p.freed for p in mb.parts)
    with pytest.raises(BufferFreedError):
        ts[-1].get()


def test_tensor_bigger_than_max_size(reg):
    buft = reg.device("SMALL").buffer_type
    ctx = Context()
    ctx.new_tensor("f32", (10,))
    ctx.new_tensor("f32", (MAX // 4 + 1,), name="huge")
    with pytest.raises(AllocationError, match="huge"):
        alloc_ctx_tensors(ctx, buft)
    with pytest.raises(AllocationError):
        buft.alloc(MAX + 1)
    ctx = Context()
    ctx.new_tensor("f32", (MAX // 4,), name="exactly_max")
    assert type(alloc_ctx_tensors(ctx, buft)) is Buffer  # fits exactly: one buffer
    g = Context()
    x = g.new_tensor("f32", (MAX // 4 + 16,)).set_input()
    with pytest.raises(AllocationError):
        GraphAllocator(buft).alloc_graph(g.graph(g.sqr(x)))


def test_graph_allocator_respects_max_size(reg):
    small = reg.device("SMALL")
    ctx = Context()
    x = ctx.new_tensor("f32", (512,)).set_input()  # 2048 bytes: two fit a 4096-byte chunk
    y = x
    for _ in range(6):
        y = ctx.add(ctx.sqr(y), x)
    g = ctx.graph(y)
    ga = GraphAllocator(small.buffer_type)
    ga.alloc_graph(g)
    assert all(b.size <= MAX for b in ga.buffers)
    for t in g.nodes:
        assert t.buffer in ga.buffers
    xv = np.linspace(-1, 1, 512, dtype=np.float32)
    x.set(xv)
    small.new_backend().compute(g)
    ref = xv
    for _ in range(6):
        ref = ref * ref + xv
    np.testing.assert_allclose(y.get(), ref, rtol=1e-6)


# --- graph allocator ------------------------------------------------------------------------------
N_CHAIN = 50
MIB_F32 = 1 << 18  # elements of a 1 MiB f32 tensor


def _chain(ctx: Context, x, w):
    y = x
    for i in range(N_CHAIN):
        match i % 5:
            case 0:
                y = ctx.scale(y, 0.5, 0.25)
            case 1:
                y = ctx.add(y, w)
            case 2:
                y = ctx.tanh(y)
            case 3:
                y = ctx.mul(y, w)
            case 4:
                y = ctx.sin(y)
    return y


def _chain_ref(x, w):
    steps = [lambda y: y * 0.5 + 0.25, lambda y: y + w, np.tanh, lambda y: y * w, np.sin]
    y = x.astype(np.float64)
    for i in range(N_CHAIN):
        y = steps[i % 5](y)
    return y


def test_graph_allocator_reuses_and_computes_in_place(cpu):
    ctx = Context()
    x = ctx.new_tensor("f32", (MIB_F32,), name="x").set_input()
    w = ctx.new_tensor("f32", (MIB_F32,), name="w")
    wbuf = alloc(cpu, w)  # a weight, already in its own buffer: left alone
    out = _chain(ctx, x, w)
    g = ctx.graph(out)
    assert g.n_nodes == N_CHAIN
    ga = GraphAllocator(cpu.buffer_type)
    ga.alloc_graph(g)
    total = sum(b.size for b in ga.buffers)
    print(f"\n{N_CHAIN} ops on 1 MiB: compute buffer {total / 2**20:.2f} MiB, {ga.n_inplace} in place")
    assert total <= 3 << 20, f"compute buffer of {total} bytes: memory is not reused"
    assert ga.n_inplace > 0
    assert w.buffer is wbuf
    assert x.buffer is not out.buffer or x.offs != out.offs, "an input is never overwritten"
    rng = np.random.default_rng(1)
    xv = rng.standard_normal(MIB_F32).astype(np.float32)
    wv = rng.uniform(0.5, 1.5, MIB_F32).astype(np.float32)
    x.set(xv)
    w.set(wv)
    be = cpu.new_backend()
    be.compute(g)
    np.testing.assert_allclose(out.get(), _chain_ref(xv, wv), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(x.get(), xv)  # the input survived
    be.compute(g)  # replay
    np.testing.assert_allclose(out.get(), _chain_ref(xv, wv), rtol=1e-4, atol=1e-5)


def test_no_reuse_across_live_tensors(cpu):
    """A diamond: both branches stay live until the join; the allocator must not overlap them."""
    ctx = Context()
    x = ctx.new_tensor("f32", (1000,)).set_input()
    a = ctx.sqr(x)
    b = ctx.scale(x, 3.0)
    c = ctx.sin(a)
    d = ctx.add(c, b)
    e = ctx.mul(d, a)  # a still live here
    g = ctx.graph(e)
    GraphAllocator(cpu.buffer_type).alloc_graph(g)
    xv = np.linspace(-2, 2, 1000, dtype=np.float32)
    x.set(xv)
    cpu.new_backend().compute(g)
    ref = (np.sin(xv * xv) + 3 * xv) * (xv * xv)
    np.testing.assert_allclose(e.get(), ref, rtol=1e-5, atol=1e-6)


def test_alloc_graph_twice_keeps_layout_version(cpu):
    ctx = Context()
    x = ctx.new_tensor("f32", (64, 64)).set_input()
    g = ctx.graph(ctx.soft_max(ctx.sqr(x)))
    ga = GraphAllocator(cpu.buffer_type)
    ga.alloc_graph(g)
    v = g.layout_version
    assert v >= 1
    placements = [(t.buffer, t.offs) for t in g.nodes]
    ga.alloc_graph(g)
    assert g.layout_version == v
    ga.reset(g)  # re-planned, but to the same places: still no change
    ga.alloc_graph(g)
    assert g.layout_version == v
    assert [(t.buffer, t.offs) for t in g.nodes] == placements
    # a bigger graph grows the buffers; the first graph is re-placed on its next alloc
    ctx2 = Context()
    y = ctx2.new_tensor("f32", (512, 512)).set_input()
    ga.alloc_graph(ctx2.graph(ctx2.sqr(y)))
    ga.alloc_graph(g)
    assert g.layout_version == v + 1
    assert all(t.buffer in ga.buffers and not t.buffer.freed for t in g.nodes)


# --- copies between buffers -----------------------------------------------------------------------
@pytest.mark.parametrize("src_dev", ["CPU", "NOHOST"])
@pytest.mark.parametrize("dst_dev", ["CPU", "CPU2", "NOHOST"])
def test_tensor_copy(reg, src_dev, dst_dev):
    ctx = Context()
    s = ctx.new_tensor("f16", (5, 7))
    d = ctx.new_tensor("f16", (5, 7))
    alloc(reg.device(src_dev), s)
    alloc(reg.device(dst_dev), d)
    assert s.buffer is not d.buffer
    assert s.buffer.is_host == (src_dev != "NOHOST")
    x = np.arange(35, dtype=np.float16).reshape(5, 7)
    s.set(x)
    tensor_copy(s, d)
    np.testing.assert_array_equal(d.get(), x)
    s.set(-x)
    sb, db = reg.device(src_dev).new_backend(), reg.device(dst_dev).new_backend()
    assert tensor_copy_async(sb, db, s, d) is False  # no cpy_tensor_async: the sync fallback
    np.testing.assert_array_equal(d.get(), -x)


def test_tensor_copy_layout_mismatch(cpu):
    ctx = Context()
    a = ctx.new_tensor("f32", (4, 6), name="src")
    b = ctx.new_tensor("f32", (6, 4), name="dst")
    c = ctx.new_tensor("f16", (4, 6))
    alloc(cpu, a, b, c)
    with pytest.raises(ShapeError, match="src"):
        tensor_copy(a, b)
    with pytest.raises(ShapeError):
        tensor_copy(a, c)
    with pytest.raises(ShapeError):
        tensor_copy(a, ctx.transpose(b))  # same ne, different strides


# --- typed build-time errors ----------------------------------------------------------------------
def _leaves():
    ctx = Context()

    def t(ty, *shape, name=""):
        return ctx.new_tensor(ty, shape, name=name)

    return ctx, t


BAD_BUILDS = {
    "ADD shape": (ShapeError, "ADD", lambda c, t: c.add(t("f32", 4, 3), t("f32", 4, 2))),
    "ADD type": (TypeMismatchError, "ADD", lambda c, t: c.add(t("i32", 4), t("f32", 4))),
    "MUL_MAT inner": (
        ShapeError,
        "MUL_MAT",
        lambda c, t: c.mul_mat(t("f32", 8, 32, name="wq"), t("f32", 3, 16)),
    ),
    "MUL_MAT b quant": (
        TypeMismatchError,
        "MUL_MAT",
        lambda c, t: c.mul_mat(t("f32", 8, 32), t("q8_0", 2, 32)),
    ),
    "MUL_MAT broadcast": (
        ShapeError,
        "MUL_MAT",
        lambda c, t: c.mul_mat(t("f32", 3, 8, 32), t("f32", 2, 4, 32)),
    ),
    "RMS_NORM type": (TypeMismatchError, "RMS_NORM", lambda c, t: c.rms_norm(t("f16", 4, 8))),
    "SOFT_MAX mask": (ShapeError, "SOFT_MAX", lambda c, t: c.soft_max(t("f32", 4, 8), t("f32", 4, 7))),
    "ROPE pos type": (TypeMismatchError, "ROPE", lambda c, t: c.rope(t("f32", 5, 2, 8), t("f32", 5), 8)),
    "ROPE odd n_dims": (ShapeError, "ROPE", lambda c, t: c.rope(t("f32", 5, 2, 8), t("i32", 5), 7)),
    "GET_ROWS idx type": (
        TypeMismatchError,
        "GET_ROWS",
        lambda c, t: c.get_rows(t("f32", 10, 4), t("f32", 3)),
    ),
    "SET_ROWS row length": (
        ShapeError,
        "SET_ROWS",
        lambda c, t: c.set_rows(t("f32", 10, 4), t("f32", 3, 5), t("i32", 3)),
    ),
    "CONCAT shape": (ShapeError, "CONCAT", lambda c, t: c.concat(t("f32", 2, 3), t("f32", 3, 4), 0)),
    "CONCAT dim": (ShapeError, "CONCAT", lambda c, t: c.concat(t("f32", 2), t("f32", 2), 5)),
    "CPY count": (ShapeError, "CPY", lambda c, t: c.cpy(t("f32", 2, 3), t("f32", 7))),
    "CPY quant dst": (TypeMismatchError, "CPY", lambda c, t: c.cpy(t("q4_0", 2, 32), t("f16", 2, 32))),
    "GLU odd": (ShapeError, "GLU", lambda c, t: c.swiglu(t("f32", 2, 7))),
    "GLU up type": (TypeMismatchError, "GLU", lambda c, t: c.swiglu(t("f32", 6), t("f16", 6))),
    "ARGMAX 3-D": (ShapeError, "ARGMAX", lambda c, t: c.argmax(t("f32", 2, 3, 4))),
    "ARGSORT order": (ShapeError, "ARGSORT", lambda c, t: c.argsort(t("f32", 4), 7)),
    "UNARY op": (ShapeError, "UNARY", lambda c, t: c.unary(t("f32", 4), 99)),
    "GLU op": (ShapeError, "GLU", lambda c, t: c.glu(t("f32", 4), None, 5)),
    "MUL_MAT_ID ids": (
        ShapeError,
        "MUL_MAT_ID",
        lambda c, t: c.mul_mat_id(t("f32", 4, 8, 16), t("f32", 3, 1, 16), t("i32", 2, 2)),
    ),
    "IM2COL dst type": (
        TypeMismatchError,
        "IM2COL",
        lambda c, t: c.im2col(t("f16", 1, 1, 3, 3), t("f32", 1, 1, 8, 8), 1, 1, 0, 0, 1, 1, dst_type="i32"),
    ),
    "COL2IM_1D oc": (ShapeError, "COL2IM_1D", lambda c, t: c.col2im_1d(t("f32", 1, 4, 10), 1, 3)),
    "RESHAPE count": (ShapeError, "RESHAPE", lambda c, t: c.reshape(t("f32", 4, 6), (5, 5))),
    "RESHAPE strided": (ShapeError, "RESHAPE", lambda c, t: c.reshape(c.transpose(t("f32", 4, 6)), (24,))),
    "PERMUTE axes": (ShapeError, "PERMUTE", lambda c, t: c.permute(t("f32", 4, 6), 0, 0, 1, 2)),
    "VIEW bounds": (ShapeError, "VIEW", lambda c, t: c.view(t("f32", 4, 6), (6, 4), offset=4)),
}


@pytest.mark.parametrize("case", sorted(BAD_BUILDS))
def test_bad_build_raises_typed_error(case):
    exc, op_name, build = BAD_BUILDS[case]
    ctx, t = _leaves()
    with pytest.raises(exc) as info:
        build(ctx, t)
    assert isinstance(info.value, AccelplaneError)
    msg = str(info.value)
    assert op_name in msg, f"{case}: op name {op_name!r} not in {msg!r}"
    if case == "MUL_MAT inner":
        assert "wq" in msg, "the message names the tensor at fault"


def test_bad_type_names():
    ctx = Context()
    with pytest.raises(TypeMismatchError, match="q3_x"):
        ctx.new_tensor("q3_x", (4,))
    with pytest.raises(ShapeError, match="block"):
        ctx.new_tensor("q4_0", (2, 31))  # not a multiple of the 32-element block
    with pytest.raises(ShapeError, match="4 axes"):
        ctx.new_tensor("f32", (1, 2, 3, 4, 5))
