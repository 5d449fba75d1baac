"""Interface cases: buffers, set/get, async copies, cpy_tensor_async, events, repeated graphs,
comm, and typed errors — the contracts of docs/ordering.md, checked on the plugin under test.

Ordering cases repeat (more with --thorough) so that races show up; plugins that honour
ACCELPLANE_TEST_DELAY_US add random delays to their queues while these run.
"""

from __future__ import annotations

import numpy as np
import pytest

import accelplane
from accelplane.core.graph import Context
from accelplane.core.types import GGMLType
from accelplane.errors import AccelplaneError, BufferFreedError, DeviceError, OutOfRangeError
from accelplane.interface import DLDeviceType
from accelplane.runtime.alloc import alloc_tensors
from accelplane.runtime.backend import Event, MultiBuffer, tensor_copy, tensor_copy_async

T = GGMLType
pytestmark = pytest.mark.conformance


@pytest.fixture(autouse=True)
def _kind(record_property):
    record_property("accelplane_kind", "interface")


def repeats(suite, n: int = 12) -> int:
    return n * 10 if suite.thorough else n


def affine(ctx: Context, x, s: float = 2.0, b: float = 1.0):
    return ctx.scale(x, s, b)


def _alloc(dev, *tensors):
    buf = alloc_tensors(tensors, dev.buffer_type, accelplane.runtime.backend.BufferUsage.ANY)
    return buf


def _graph_xy(dev, n=4096, s=2.0, b=1.0):
    ctx = Context()
    x = ctx.new_tensor(T.F32, (n,), "x").set_input()
    y = affine(ctx, x, s, b)
    g = ctx.graph(y)
    buf = _alloc(dev, x, y)
    return x, y, g, buf


# --- buffers ---------------------------------------------------------------------------------------
def test_buffer_type_facts(ap_device):
    buft = ap_device.buffer_type
    a = buft.alignment
    assert a >= 1 and a & (a - 1) == 0, f"alignment {a} is not a power of two"
    assert buft.max_size > 0
    t = Context().new_tensor(T.F32, (100,))
    assert buft.alloc_size(t) >= t.nbytes


@pytest.mark.parametrize("type_", list(T), ids=str)
def test_set_get_roundtrip(ap_device, ap_rng, type_):
    ctx = Context()
    t = ctx.new_tensor_ne(type_, 512, 3, 2)
    buf = _alloc(ap_device, t)
    try:
        data = ap_rng.integers(0, 256, t.nbytes, dtype=np.uint8)
        if type_.is_quantized:  # keep block scales finite
            data = data.reshape(t.nrows, -1, type_.type_size)
            data[..., :2] = np.array([0.01], np.float16).view(np.uint8)[None, None, :]
            data = data.reshape(-1)
        t.set_bytes(data)
        assert np.array_equal(t.get_bytes(), data)
        # partial ranges at the edges
        t.set_bytes(np.array([7], np.uint8), t.nbytes - 1)
        assert t.get_bytes(t.nbytes - 1, 1)[0] == 7
        assert t.get_bytes(0, 0).size == 0
        mid = t.nbytes // 3
        assert np.array_equal(t.get_bytes(mid, 5), data[mid : mid + 5])
    finally:
        buf.free()


def test_set_get_out_of_range_raises(ap_device):
    t = Context().new_tensor(T.F32, (16,))
    buf = _alloc(ap_device, t)
    try:
        for off, size in ((64, 1), (60, 8), (-1, 1)):
            with pytest.raises(OutOfRangeError):
                t.set_bytes(np.zeros(size, np.uint8), off)
            with pytest.raises(OutOfRangeError):
                t.get_bytes(off, size)
    finally:
        buf.free()


def test_memset_and_clear(ap_device):
    t = Context().new_tensor(T.I32, (64,))
    buf = _alloc(ap_device, t)
    try:
        buf.clear(0)
        buf.memset_tensor(t, 0x11, 8, 16)
        got = t.get_bytes()
        assert np.all(got[8:24] == 0x11) and np.all(got[:8] == 0) and np.all(got[24:] == 0)
    finally:
        buf.free()


def test_freed_buffer_raises(ap_device):
    t = Context().new_tensor(T.F32, (8,))
    buf = _alloc(ap_device, t)
    buf.free()
    with pytest.raises(BufferFreedError):
        t.set(np.zeros(8, np.float32))
    with pytest.raises(BufferFreedError):
        t.get()


def test_views_share_memory(ap_device, ap_rng):
    ctx = Context()
    a = ctx.new_tensor(T.F32, (6, 8), "a")
    v = ctx.view(a, (8, 2), a.nb, 2 * a.nb[1])  # rows 2..3
    tr = ctx.transpose(a)
    buf = _alloc(ap_device, a)
    try:
        buf.init_view(v)
        buf.init_view(tr)
        assert v.buffer is a.buffer and tr.buffer is a.buffer, "a view's buffer is its source's"
        vals = ap_rng.standard_normal((6, 8)).astype(np.float32)
        a.set(vals)
        assert np.array_equal(v.get(), vals[2:4])
        assert np.array_equal(tr.get(), vals.T)
        v.set(np.ones((2, 8), np.float32))
        assert np.array_equal(a.get()[2:4], np.ones((2, 8)))
    finally:
        buf.free()


def test_multibuffer(ap_device):
    buft = ap_device.buffer_type
    if buft.max_size > 64 << 20:
        pytest.skip(f"max buffer size {buft.max_size} too large to split in a quick test")
    n = max(1, buft.max_size // 4 // 3)
    ctx = Context()
    ts = [ctx.new_tensor(T.F32, (n,), f"t{i}") for i in range(5)]
    buf = alloc_tensors(ts, buft)
    try:
        assert isinstance(buf, MultiBuffer)
        for t in ts:
            assert t.buffer in buf.parts, "tensors must point at a real part, not the multi-buffer"
            t.set(np.full(n, float(ts.index(t)), np.float32))
        for i, t in enumerate(ts):
            assert np.all(t.get() == i)
    finally:
        buf.free()


# --- DLPack (docs/interop.md) ---------------------------------------------------------------------
class _AsHost:
    """Asks an accelplane tensor for host memory (``dl_device=(CPU, 0)``) whatever numpy asks."""

    def __init__(self, t) -> None:
        self.t = t

    def __dlpack__(self, **kw):
        return self.t.__dlpack__(max_version=kw.get("max_version"), dl_device=(DLDeviceType.CPU, 0))

    def __dlpack_device__(self):
        return (DLDeviceType.CPU, 0)


def _shared(a, b) -> bool:
    ma, mb = a.buffer.dlpack_memory(a), b.buffer.dlpack_memory(b)
    return ma is not None and mb is not None and (ma.device_type, ma.device_id, ma.ptr) == (
        mb.device_type, mb.device_id, mb.ptr)  # fmt: skip


@pytest.mark.parametrize("type_", [T.F32, T.F16, T.I32], ids=str)
def test_dlpack_roundtrip(ap_device, ap_rng, type_):
    """A tensor and a view of it leave through __dlpack__ with their values: as host memory, and
    back into the device through from_dlpack; where that import shares the memory (the plugin's
    buffer_dlpack and buft_from_dlpack agree on it), a write through one is seen by the other."""
    ctx = Context()
    t = ctx.new_tensor(type_, (6, 64), "t")
    view = ctx.view(t, (64, 2), t.nb, 2 * t.nb[1])  # rows 2..3
    buf = _alloc(ap_device, t)
    try:
        buf.init_view(view)
        v = ap_rng.integers(-1000, 1000, (6, 64)).astype({T.F32: np.float32, T.F16: np.float16,
                                                          T.I32: np.int32}[type_])  # fmt: skip
        t.set(v)
        for x, want in ((t, v), (view, v[2:4])):
            assert np.array_equal(np.from_dlpack(_AsHost(x)), want), x.name or "view"
            back = accelplane.from_dlpack(x, device=ap_device)
            assert np.array_equal(back.get(), want)
            if _shared(back, x):
                back.set(np.full(want.shape, 3))
                assert np.all(x.get() == 3), "a zero-copy import writes the exported memory"
                x.set(want)
            back.buffer.free()
    finally:
        buf.free()


def test_dlpack_export_orders_after_queued_work(ap_suite, ap_device, ap_backend, ap_rng):
    """A graph queued and not synchronized, then exported and imported back into the device
    (DLPack's default stream, None): the values read are the graph's result (the host waits for
    host memory; the plugin's device_dlpack_wait orders device memory)."""
    for _ in range(repeats(ap_suite, 3)):
        x, y, g, buf = _graph_xy(ap_device)
        try:
            v = ap_rng.standard_normal(x.shape).astype(np.float32)
            x.set(v)
            y.set(np.zeros(y.shape, np.float32))
            ap_backend.graph_compute(g)
            back = accelplane.from_dlpack(y, device=ap_device)
            np.testing.assert_allclose(back.get(), v * 2.0 + 1.0, rtol=1e-6)
            back.buffer.free()
        finally:
            ap_backend.synchronize()
            buf.free()


# --- compute and async ordering ---------------------------------------------------------------------
def test_graph_compute_twice_and_realloc(ap_device, ap_backend, ap_rng):
    x, y, g, buf = _graph_xy(ap_device)
    try:
        for _ in range(3):
            v = ap_rng.standard_normal(4096).astype(np.float32)
            x.set(v)
            ap_backend.compute(g)
            np.testing.assert_allclose(y.get(), v * 2 + 1, rtol=1e-6)
        # move every tensor to a new buffer: the backend must not replay a stale plan
        ctx = Context()
        x2 = ctx.new_tensor(T.F32, (4096,), "x2")
        buf3 = _alloc(ap_device, x2)
        x.buffer, x.offs = x2.buffer, x2.offs
        g.layout_version += 1
        v = ap_rng.standard_normal(4096).astype(np.float32)
        x.set(v)
        ap_backend.compute(g)
        np.testing.assert_allclose(y.get(), v * 2 + 1, rtol=1e-6)
        buf3.free()
    finally:
        buf.free()


def test_async_set_compute_get_ordering(ap_suite, ap_device, ap_backend, ap_rng):
    x, y, g, buf = _graph_xy(ap_device)
    try:
        for i in range(repeats(ap_suite)):
            v = ap_rng.standard_normal(4096).astype(np.float32)
            out = np.empty(y.nbytes, np.uint8)
            ap_backend.set_tensor_async(x, v.view(np.uint8))
            ap_backend.graph_compute(g)
            ap_backend.get_tensor_async(y, out)
            ap_backend.synchronize()
            np.testing.assert_allclose(out.view(np.float32), v * 2 + 1, rtol=1e-6,
                                       err_msg=f"repeat {i}")  # fmt: skip
    finally:
        buf.free()


def _two_stage(dev_a, dev_b):
    ctx = Context()
    x = ctx.new_tensor(T.F32, (2048,), "x")
    y = affine(ctx, x, 2.0, 1.0)
    z = ctx.new_tensor(T.F32, (2048,), "z")
    w = affine(ctx, z, 3.0, 0.0)
    ga, gb = ctx.graph(y), ctx.graph(w)
    bufs = [_alloc(dev_a, x, y), _alloc(dev_b, z, w)]
    return x, y, z, w, ga, gb, bufs


def _check_copy_chain(suite, dev_a, dev_b, rng):
    ba, bb = dev_a.new_backend(), dev_b.new_backend()
    x, y, z, w, ga, gb, bufs = _two_stage(dev_a, dev_b)
    try:
        for i in range(repeats(suite)):
            v = rng.standard_normal(2048).astype(np.float32)
            ba.set_tensor_async(x, v.view(np.uint8))
            ba.graph_compute(ga)
            tensor_copy_async(ba, bb, y, z)  # after ga on ba, before gb on bb
            bb.graph_compute(gb)
            bb.synchronize()
            np.testing.assert_allclose(w.get(), (v * 2 + 1) * 3, rtol=1e-6,
                                       err_msg=f"cpy_tensor_async ordering, repeat {i}")  # fmt: skip
            ba.synchronize()
    finally:
        ba.free()
        bb.free()
        for b in bufs:
            b.free()


def test_cpy_tensor_async_two_streams(ap_suite, ap_device, ap_rng):
    _check_copy_chain(ap_suite, ap_device, ap_device, ap_rng)


def test_cpy_tensor_async_two_devices(ap_suite, ap_devices, ap_rng):
    if len(ap_devices) < 2:
        pytest.skip("plugin has one device")
    _check_copy_chain(ap_suite, ap_devices[0], ap_devices[1], ap_rng)


def test_cpy_from_host_buffer(ap_suite, ap_device, ap_backend, ap_rng):
    """A CPU split's output (host buffer) copied to the device (llama.cpp #17795's path)."""
    host = next((d for d in accelplane.devices() if d.buffer_type.is_host), None)
    if host is None:
        pytest.skip("no host-memory device registered")
    hb = host.new_backend()
    ctx = Context()
    src = ctx.new_tensor(T.F32, (2048,), "src")
    dst = ctx.new_tensor(T.F32, (2048,), "dst")
    w = affine(ctx, dst, 3.0, 0.0)
    g = ctx.graph(w)
    bufs = [_alloc(host, src), _alloc(ap_device, dst, w)]
    try:
        for i in range(repeats(ap_suite)):
            v = ap_rng.standard_normal(2048).astype(np.float32)
            src.set(v)
            tensor_copy_async(hb, ap_backend, src, dst)
            ap_backend.graph_compute(g)
            ap_backend.synchronize()
            np.testing.assert_allclose(w.get(), v * 3, rtol=1e-6, err_msg=f"repeat {i}")
    finally:
        hb.free()
        for b in bufs:
            b.free()


def test_host_reads_experts_in_place(ap_suite, ap_device, ap_backend, ap_rng):
    """caps.host_reads: MUL_MAT_ID reads experts in the device's own host buffer type where they
    are (accelplane.sched.experts), each compute seeing the host values and ids set before it."""
    if not ap_device.caps.host_reads:
        pytest.skip("the device does not read its host buffers in place (caps.host_reads)")
    ctx = Context()
    k, m, n_exp, n_used = 256, 96, 8, 2
    w = ctx.new_tensor_ne(T.F32, k, m, n_exp, name="experts")
    x = ctx.new_tensor_ne(T.F32, k, 1, 1, name="x")
    ids = ctx.new_tensor_ne(T.I32, n_used, 1, name="ids")
    y = ctx.mul_mat_id(w, x, ids)
    if not ap_device.supports_op(y):
        pytest.skip("the device does not run MUL_MAT_ID on F32 experts")
    g = ctx.graph(y)
    wbuf = alloc_tensors([w], ap_device.host_buffer_type, accelplane.runtime.backend.BufferUsage.WEIGHTS)
    bufs = [wbuf, _alloc(ap_device, x, ids, y)]
    try:
        assert wbuf.is_host
        for i in range(repeats(ap_suite, 4)):
            wv = ap_rng.standard_normal((n_exp, m, k)).astype(np.float32)
            xv = ap_rng.standard_normal(k).astype(np.float32)
            sel = ap_rng.permutation(n_exp)[:n_used].astype(np.int32)
            w.set(wv)
            x.set(xv.reshape(1, 1, k))
            ids.set(sel.reshape(1, n_used))
            ap_backend.graph_compute(g)
            ap_backend.synchronize()
            want = wv[sel].astype(np.float64) @ xv.astype(np.float64)
            got = y.get().reshape(n_used, m)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"repeat {i}")
    finally:
        for b in bufs:
            b.free()


def test_host_reads_activations_in_place(ap_suite, ap_device, ap_backend, ap_rng):
    """caps.host_reads: nodes read activations in the device's own host buffer type where they
    are (the scheduler's small CPU split outputs: accelplane.sched.scheduler): a broadcast MUL
    (a MoE's weighting of its expert outputs) and a MUL_MAT whose activations are host memory,
    each compute seeing the host values set before it."""
    if not ap_device.caps.host_reads:
        pytest.skip("the device does not read its host buffers in place (caps.host_reads)")
    ctx = Context()
    a = ctx.new_tensor(T.F32, (8, 64), "expert_out")
    x = ctx.new_tensor(T.F32, (1, 64), "x")
    p = ctx.new_tensor(T.F32, (8, 1), "weights")
    w = ctx.new_tensor(T.F32, (32, 64), "w")
    y1, y2 = ctx.mul(a, p), ctx.mul_mat(w, x)
    for t in (y1, y2):
        if not ap_device.supports_op(t):
            pytest.skip(f"the device does not run {t.op.name} on F32")
    g = ctx.graph(y1, y2)
    hbuf = alloc_tensors([a, x], ap_device.host_buffer_type, accelplane.runtime.backend.BufferUsage.COMPUTE)
    bufs = [hbuf, _alloc(ap_device, p, w, y1, y2)]
    try:
        assert hbuf.is_host
        for i in range(repeats(ap_suite, 4)):
            vals = {t: ap_rng.standard_normal(t.shape).astype(np.float32) for t in (a, x, p, w)}
            for t, v in vals.items():
                t.set(v)
            av, xv, pv, wv = (vals[t].astype(np.float64) for t in (a, x, p, w))
            ap_backend.graph_compute(g)
            ap_backend.synchronize()
            np.testing.assert_allclose(y1.get(), av * pv, rtol=1e-6, err_msg=f"repeat {i}")
            np.testing.assert_allclose(y2.get(), xv @ wv.T, rtol=1e-4, atol=1e-4, err_msg=f"repeat {i}")
    finally:
        for b in bufs:
            b.free()


def test_blocking_tensor_copy(ap_device, ap_rng):
    ctx = Context()
    a = ctx.new_tensor(T.F32, (300,))
    b = ctx.new_tensor(T.F32, (300,))
    bufs = [_alloc(ap_device, a), _alloc(ap_device, b)]
    try:
        v = ap_rng.standard_normal(300).astype(np.float32)
        a.set(v)
        tensor_copy(a, b)
        assert np.array_equal(b.get(), v)
    finally:
        for x in bufs:
            x.free()


# --- events ---------------------------------------------------------------------------------------
def _two_stream_chain(device, n: int):
    """Two backends of ``device`` and a chain x → y = 2x + 1 (g1) → z = 3y (g2) in one buffer."""
    b1, b2 = device.new_backend(), device.new_backend()
    ctx = Context()
    x = ctx.new_tensor(T.F32, (n,), "x")
    y = affine(ctx, x, 2.0, 1.0)
    z = affine(ctx, y, 3.0, 0.0)
    return b1, b2, x, z, ctx.graph(y), accelplane.Graph.from_nodes([z], [y]), _alloc(device, x, y, z)


def test_event_record_wait_two_streams(ap_suite, ap_device, ap_rng):
    """b1 computes y; event recorded on b1; b2 waits for it, then computes from y."""
    b1, b2, x, z, g1, g2, buf = _two_stream_chain(ap_device, 2048)
    ev = ap_device.new_event()
    try:
        for i in range(repeats(ap_suite)):
            v = ap_rng.standard_normal(2048).astype(np.float32)
            b1.set_tensor_async(x, v.view(np.uint8))
            b1.graph_compute(g1)
            ev.record(b1)
            ev.wait(b2)
            b2.graph_compute(g2)
            b2.synchronize()
            np.testing.assert_allclose(z.get(), (v * 2 + 1) * 3, rtol=1e-6,
                                       err_msg=f"event_wait did not order, repeat {i}")  # fmt: skip
            b1.synchronize()
    finally:
        ev.free()
        b1.free()
        b2.free()
        buf.free()


def test_timeline_notes_copies_and_computes(ap_suite, ap_device, ap_rng):
    """Where the plugin keeps a timeline (API 1.3): a copy then a compute on one stream, and a
    compute on a second stream that waited for the first's, come back as noted, each ending no
    earlier than it starts, in stream order, and the waiting compute after the one it waited for
    on the shared clock. Repeated, as the event cases are: one run of an unordered wait may
    happen to start late enough."""
    b1, b2, x, z, g1, g2, buf = _two_stream_chain(ap_device, 4096)
    ev = ap_device.new_event() if ap_device.has_events else None
    try:
        for i in range(repeats(ap_suite)):
            if not b1.timeline_begin():
                pytest.skip("the plugin keeps no timeline (timeline_begin)")
            assert b2.timeline_begin(), "timeline_begin answered True for one backend of the device only"
            v = ap_rng.standard_normal(4096).astype(np.float32)
            b1.set_tensor_async(x, v.view(np.uint8))
            b1.graph_compute(g1)
            if ev is not None:
                ev.record(b1)
                ev.wait(b2)
            else:
                b1.synchronize()
            b2.graph_compute(g2)
            t1, t2 = b1.timeline_end(), b2.timeline_end()
            np.testing.assert_allclose(z.get(), (v * 2 + 1) * 3, rtol=1e-6, err_msg=f"repeat {i}")
            assert [k for k, _, _ in t1] == ["copy", "compute"], t1
            assert [k for k, _, _ in t2] == ["compute"], t2
            assert all(s0 <= e0 for _, s0, e0 in t1 + t2), (t1, t2)
            assert t1[0][2] <= t1[1][1] + 1e-6, f"the compute started before the copy ended: {t1}"
            assert t1[1][2] <= t2[0][1] + 1e-6, (
                f"the waiting compute started before the other ended: {t1} {t2}")
            assert b1.timeline_end() == [], "a second timeline_end returned work again"
    finally:
        if ev is not None:
            ev.free()
        b1.free()
        b2.free()
        buf.free()


def test_event_synchronize_blocks_host(ap_suite, ap_device, ap_backend, ap_rng):
    x, y, g, buf = _graph_xy(ap_device, n=1 << 16)
    ev = ap_device.new_event()
    try:
        for i in range(repeats(ap_suite, 6)):
            v = ap_rng.standard_normal(1 << 16).astype(np.float32)
            out = np.empty(y.nbytes, np.uint8)
            ap_backend.set_tensor_async(x, v.view(np.uint8))
            ap_backend.graph_compute(g)
            ap_backend.get_tensor_async(y, out)
            ev.record(ap_backend)
            ev.synchronize()
            np.testing.assert_allclose(out.view(np.float32), v * 2 + 1, rtol=1e-6,
                                       err_msg=f"event_synchronize returned early, repeat {i}")  # fmt: skip
    finally:
        ap_backend.synchronize()
        ev.free()
        buf.free()


def test_event_across_devices(ap_suite, ap_devices, ap_rng):
    """After synchronize(b1), work that b1 waited for (an event of device 0) is complete."""
    if len(ap_devices) < 2:
        pytest.skip("plugin has one device")
    d0, d1 = ap_devices[:2]
    b0, b1 = d0.new_backend(), d1.new_backend()
    x, y, g, buf = _graph_xy(d0)
    ev = d0.new_event()
    try:
        for i in range(repeats(ap_suite)):
            v = ap_rng.standard_normal(4096).astype(np.float32)
            x.set(v)
            b0.graph_compute(g)
            ev.record(b0)
            ev.wait(b1)
            b1.synchronize()
            np.testing.assert_allclose(y.get(), v * 2 + 1, rtol=1e-6, err_msg=f"repeat {i}")
    finally:
        b0.synchronize()
        ev.free()
        b0.free()
        b1.free()
        buf.free()


def test_event_of_other_device_raises(ap_device, ap_backend):
    others = [d for d in accelplane.devices() if d is not ap_device]
    if not others:
        pytest.skip("only one device registered")
    ev = Event(others[0])
    with pytest.raises(DeviceError):
        ev.record(ap_backend)
    ev.free()


# --- comm ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["auto", "butterfly", "ring"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_comm_allreduce(ap_device, ap_devices, ap_rng, n, algorithm):
    """All-reduce over n backends of the plugin equals the oracle sum: through the plugin's
    comm where it has one ("auto"), and through the SDK's butterfly and ring, which are built
    from the plugin's own cpy_tensor_async and ADD graphs (so they test the plugin too)."""
    from accelplane.parallel import comm as sdk_comm

    devs = [ap_devices[i % len(ap_devices)] for i in range(n)]
    backends = [d.new_backend() for d in devs]
    ctx = Context()
    ts = [ctx.new_tensor(T.F32, (1000, 3), f"p{i}") for i in range(n)]
    bufs = [_alloc(d, t) for d, t in zip(devs, ts, strict=True)]
    try:
        vals = [ap_rng.standard_normal((1000, 3)).astype(np.float32) for _ in range(n)]
        for t, v in zip(ts, vals, strict=True):
            t.set(v)
        with sdk_comm.AllReduce(backends, algorithm=algorithm) as ar:
            ar(ts)
            for b in backends:
                b.synchronize()
            want = np.sum(np.stack(vals).astype(np.float64), axis=0)
            for i, t in enumerate(ts):
                np.testing.assert_allclose(t.get(), want, rtol=1e-5, atol=1e-5,
                                           err_msg=f"{algorithm} ({ar.last_algorithm}) all-reduce "
                                                   f"result on device {i} of {n}")  # fmt: skip
    finally:
        for b in bufs:
            b.free()
        for b in backends:
            b.free()


# --- errors ----------------------------------------------------------------------------------------
def test_compute_unallocated_graph_raises(ap_device, ap_backend):
    ctx = Context()
    x = ctx.new_tensor(T.F32, (16,))
    g = ctx.graph(ctx.scale(x, 2.0))
    with pytest.raises(AccelplaneError):
        ap_backend.compute(g)


def test_compute_after_free_raises(ap_device, ap_backend):
    x, y, g, buf = _graph_xy(ap_device)
    ap_backend.compute(g)
    buf.free()
    with pytest.raises(BufferFreedError):
        ap_backend.compute(g)
