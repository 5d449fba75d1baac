"""The SYCL plugin's own tests: the semantics of llama.cpp's per-instance-queue SYCL work
(per-backend queues, device-side event_wait, the 4-argument cpy_tensor_async), expert-prefetch
overlap, the two-device all-reduce, and errors. The conformance suite covers the op catalog."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import accelplane_sycl.plugin as plugin
import ml_dtypes
import numpy as np
import pytest
from accelplane.core.graph import Context, Graph
from accelplane.core.types import GGMLType
from accelplane.errors import AllocationError, ComputeError, ConfigError, DeviceError
from accelplane.runtime.alloc import alloc_tensors
from accelplane.runtime.backend import Comm, tensor_copy_async
from accelplane_sycl import program, runtime

T = GGMLType
COMPLETE = "complete"


def done(ev) -> bool:
    return ev.execution_status.name == COMPLETE


def affine(dev, n=4096, s=2.0, b=1.0):
    ctx = Context()
    x = ctx.new_tensor(T.F32, (n,), "x")
    y = ctx.scale(x, s, b)
    g = ctx.graph(y)
    return x, y, g, alloc_tensors([x, y], dev.buffer_type)


# --- queues ----------------------------------------------------------------------------------------
def test_each_backend_owns_an_in_order_queue(d0):
    b1, b2 = d0.new_backend(), d0.new_backend()
    q1, q2 = b1.ctx.queue, b2.ctx.queue
    assert q1 != q2 and q1 is not q2
    assert q1 != d0.runtime.queue and q2 != d0.runtime.queue, "a backend must not use the device's queue"
    assert q1.is_in_order and q2.is_in_order
    b1.free()
    b2.free()


def test_logical_devices_have_their_own_contexts(d0, d1):
    assert d0.ctx.phys_index == d1.ctx.phys_index
    assert d0.runtime.ctx != d1.runtime.ctx
    assert "logical device" in d0.description


def test_entry_point_imports_nothing_heavy():
    code = "import sys, accelplane_sycl.plugin; sys.exit('dpctl' in sys.modules or 'dpnp' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_graph_is_planned_once(d0):
    b = d0.new_backend()
    x, y, g, buf = affine(d0)
    for i in range(3):
        x.set(np.full(4096, i, np.float32))
        b.compute(g)
        assert np.all(y.get() == 2 * i + 1)
    assert b.ctx.plans.builds == 1
    b.free()
    buf.free()


# --- events ------------------------------------------------------------------------------------------
def test_event_wait_does_not_block_the_host(d0, spin):
    b1, b2 = d0.new_backend(), d0.new_backend()
    x, y, g, buf = affine(d0)
    ev = d0.new_event()
    v = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    x.set(v)
    b1.compute(g)  # plan (and kernel build) outside the timed part
    long = spin(b1, 400)
    b1.graph_compute(g)
    ev.record(b1)
    t = time.perf_counter()
    ev.wait(b2)
    waited = time.perf_counter() - t
    out = np.empty(y.nbytes, np.uint8)
    b2.get_tensor_async(y, out)
    assert waited < 0.1, f"event_wait blocked the host for {waited:.3f} s"
    assert not done(long), "the long kernel finished before the test could observe the wait"
    b2.synchronize()  # b2 waited for b1 device-side: its read sees b1's result
    assert np.array_equal(out.view(np.float32), v * 2 + 1)
    ev.free()
    b1.free()
    b2.free()
    buf.free()


# --- cpy_tensor_async ---------------------------------------------------------------------------------
def test_cpy_tensor_async_refuses_foreign_buffers_and_backends(d0, d1, cpu):
    ctx = Context()
    s_cpu = ctx.new_tensor(T.F32, (64,), "s_cpu")
    s0, t0, t1 = (ctx.new_tensor(T.F32, (64,), n) for n in ("s0", "t0", "t1"))
    bufs = [alloc_tensors([s_cpu], cpu.buffer_type), alloc_tensors([s0, t0], d0.buffer_type),
            alloc_tensors([t1], d1.buffer_type)]  # fmt: skip
    bc, b0, b1 = cpu.new_backend(), d0.new_backend(), d1.new_backend()
    assert plugin.cpy_tensor_async(bc, b0, s_cpu, t0) is False  # CPU plugin buffer and backend
    assert plugin.cpy_tensor_async(b0, b0, s_cpu, t0) is False  # CPU plugin buffer
    assert plugin.cpy_tensor_async(b0, b0, s0, t1) is False  # dst on SYCL1, backend on SYCL0
    assert plugin.cpy_tensor_async(b1, b0, s0, t0) is False  # src on SYCL0, backend on SYCL1
    # logical devices have separate contexts: no ordering across them on the device, so the
    # plugin says no and the SDK copies through the host
    assert plugin.cpy_tensor_async(b0, b1, s0, t1) is False
    assert plugin.cpy_tensor_async(b0, b0, s0, t0) is True
    b0.synchronize()
    for b in (bc, b0, b1):
        b.free()
    for b in bufs:
        b.free()


@pytest.mark.parametrize("where", ["one device", "two devices"])
def test_cpy_tensor_async_orders_across_backends(d0, d1, spin, where):
    """src backend: a long kernel, then y = 2x + 1; the copy y -> z returns at once; dst backend
    computes w = 3z right after: w must see the copy, which must see y."""
    dst_dev = d0 if where == "one device" else d1
    ctx = Context()
    x = ctx.new_tensor(T.F32, (2048,), "x")
    y = ctx.scale(x, 2.0, 1.0)
    z = ctx.new_tensor(T.F32, (2048,), "z")
    w = ctx.scale(z, 3.0, 0.0)
    ga, gb = ctx.graph(y), ctx.graph(w)
    bufs = [alloc_tensors([x, y], d0.buffer_type), alloc_tensors([z, w], dst_dev.buffer_type)]
    ba, bb = d0.new_backend(), dst_dev.new_backend()
    v = np.random.default_rng(1).standard_normal(2048).astype(np.float32)
    x.set(v)
    z.set(np.zeros(2048, np.float32))
    ba.compute(ga)  # plans (and kernel builds) happen outside the timed part
    bb.compute(gb)
    if where == "one device":
        long = spin(ba, 300)
        ba.graph_compute(ga)
        t = time.perf_counter()
        assert tensor_copy_async(ba, bb, y, z) is True, "the plugin must copy asynchronously"
        bb.graph_compute(gb)
        assert time.perf_counter() - t < 0.1, "cpy_tensor_async blocked the host"
        assert not done(long)
    else:  # separate contexts: the plugin declines, the SDK's fallback keeps the order
        ba.graph_compute(ga)
        assert tensor_copy_async(ba, bb, y, z) is False
        bb.graph_compute(gb)
    bb.synchronize()
    np.testing.assert_array_equal(w.get(), (v * 2 + 1) * 3)
    ba.free()
    bb.free()
    for b in bufs:
        b.free()


@pytest.mark.parametrize("where", ["same backend", "two devices"])
def test_cpy_tensor_async_copies_views_at_their_offsets(d0, d1, where):
    ctx = Context()
    a = ctx.new_tensor(T.F32, (6, 8), "a")
    c = ctx.new_tensor(T.F32, (6, 8), "c")
    src = ctx.view(a, (8, 2), a.nb, 2 * a.nb[1])  # rows 2..3 of a
    dst = ctx.view(c, (8, 2), c.nb, 4 * c.nb[1])  # rows 4..5 of c
    dd = d0 if where == "same backend" else d1
    bufs = [alloc_tensors([a], d0.buffer_type), alloc_tensors([c], dd.buffer_type)]
    bufs[0].init_view(src)
    bufs[1].init_view(dst)
    va = np.arange(48, dtype=np.float32).reshape(6, 8)
    a.set(va)
    c.set(np.full((6, 8), -1, np.float32))
    bs = d0.new_backend()
    bd = d1.new_backend() if dd is d1 else bs
    # True on one backend; two logical devices take the SDK's copy through the host
    assert tensor_copy_async(bs, bd, src, dst) is (dd is d0)
    bd.synchronize()
    want = np.full((6, 8), -1, np.float32)
    want[4:6] = va[2:4]
    np.testing.assert_array_equal(c.get(), want)
    for b in {bs, bd}:
        b.free()
    for b in bufs:
        b.free()


def test_expert_prefetch_overlaps_compute(d0, spin):
    """MoE expert prefetch on two backends of one device (llama.cpp's SYCL prefetch pipeline):
    the copy backend uploads the next expert from host memory while the compute backend is busy;
    the compute backend joins it with event_wait and then uses the expert."""
    m, k, n = 64, 256, 4
    rng = np.random.default_rng(2)
    ctx = Context()
    host_experts = [ctx.new_tensor(T.F32, (m, k), f"e{i}") for i in range(2)]
    w_cur = ctx.new_tensor(T.F32, (m, k), "w_cur")
    w_next = ctx.new_tensor(T.F32, (m, k), "w_next")
    x = ctx.new_tensor(T.F32, (n, k), "x")
    y_cur, y_next = ctx.mul_mat(w_cur, x), ctx.mul_mat(w_next, x)
    g_cur, g_next = ctx.graph(y_cur), ctx.graph(y_next)
    hbuf = alloc_tensors(host_experts, d0.host_buffer_type)  # USM host: the experts' home
    dbuf = alloc_tensors([w_cur, w_next, x, y_cur, y_next], d0.buffer_type)
    vals = [rng.standard_normal((m, k)).astype(np.float32) for _ in range(2)]
    for t, v in zip(host_experts, vals, strict=True):
        t.set(v)
    vx = rng.standard_normal((n, k)).astype(np.float32)
    x.set(vx)
    w_cur.set(vals[0])
    compute, copy = d0.new_backend(), d0.new_backend()
    ev = d0.new_event()
    compute.compute(g_cur)  # plans, kernel builds and dpnp's import outside the timed part
    compute.compute(g_next)

    long = spin(compute, 500)  # stands in for a long layer
    compute.graph_compute(g_cur)
    # let the layer start: the OpenCL CPU runtime may hand work submitted in the same instant to
    # the worker thread that then runs the long kernel (a scheduling effect, not an ordering one)
    time.sleep(0.02)
    assert tensor_copy_async(copy, copy, host_experts[1], w_next)
    ev.record(copy)
    ev.synchronize()  # the upload is complete ...
    assert not done(long), "the upload waited for the compute backend: no overlap"  # ... compute is not
    ev.wait(compute)
    compute.graph_compute(g_next)
    compute.synchronize()
    np.testing.assert_allclose(y_cur.get(), vx @ vals[0].T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(y_next.get(), vx @ vals[1].T, rtol=1e-4, atol=1e-4)
    ev.free()
    compute.free()
    copy.free()
    hbuf.free()
    dbuf.free()


def test_host_buffer_is_host_memory(d0):
    hb = d0.host_buffer_type
    assert hb.is_host and not d0.buffer_type.is_host
    assert d0.supports_buft(hb)
    t = Context().new_tensor(T.F32, (100,))
    buf = alloc_tensors([t], hb)
    t.set(np.arange(100, dtype=np.float32))
    arr = buf.host_array[t.offs : t.offs + t.nbytes].view(np.float32)
    assert np.array_equal(arr, np.arange(100, dtype=np.float32))
    buf.free()


# --- matrix products: oneMKL and own kernels agree ------------------------------------------------
@pytest.mark.parametrize("type_", [T.F16, T.Q8_0, T.Q4_K, T.Q6_K], ids=str)
def test_mul_mat_paths_agree(d0, type_):
    if d0.runtime.onemkl() is None:
        pytest.skip("dpnp (oneMKL) is not installed: only the own kernels run")
    rng = np.random.default_rng(3)
    k = 512
    ctx = Context()
    a = ctx.new_tensor(type_, (40, k), "a")
    b = ctx.new_tensor(T.F32, (32, k), "b")  # 32 rows: dequantize + gemm
    g = ctx.graph(ctx.mul_mat(a, b))
    buf = alloc_tensors([a, b, g.nodes[-1]], d0.buffer_type)
    a.set(rng.uniform(-1, 1, (40, k)))
    b.set(rng.uniform(-1, 1, (32, k)))
    results = []
    for onemkl in (True, False):
        saved = d0.runtime._onemkl
        if not onemkl:
            d0.runtime._onemkl = False
        try:
            be = d0.new_backend()
            be.compute(g)
            results.append(g.nodes[-1].get())
            be.free()
        finally:
            d0.runtime._onemkl = saved
    want = b.get().astype(np.float64) @ a.get().astype(np.float64).T
    for r in results:
        np.testing.assert_allclose(r, want, rtol=1e-3, atol=1e-3)
    buf.free()


# --- comm ---------------------------------------------------------------------------------------------
def test_comm_init_only_for_two_sycl_devices(d0, d1):
    b0, b0b, b1 = d0.new_backend(), d0.new_backend(), d1.new_backend()
    assert Comm.init([b0, b1]) is not None
    assert Comm.init([b0, b0b]) is None  # one device
    assert Comm.init([b0, b1, b0b]) is None  # three ranks: the SDK's butterfly
    for b in (b0, b0b, b1):
        b.free()


@pytest.mark.parametrize("n", [3000, 32768, 50000, 1000])
def test_comm_allreduce(d0, d1, n):
    """F32 below 32768 elements (exact), BF16 on the wire from there (within BF16 rounding and
    bit-identical on both devices); the last size reuses the grown scratch."""
    rng = np.random.default_rng(n)
    b0, b1 = d0.new_backend(), d1.new_backend()
    comm = Comm.init([b0, b1])
    ctx = Context()
    ts = [ctx.new_tensor(T.F32, (n,), f"p{i}") for i in range(2)]
    bufs = [alloc_tensors([ts[0]], d0.buffer_type), alloc_tensors([ts[1]], d1.buffer_type)]
    for _ in range(2):  # twice: the second call reuses scratch and staging
        vals = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
        for t, v in zip(ts, vals, strict=True):
            t.set(v)
        assert comm.allreduce(ts)
        b0.synchronize()
        b1.synchronize()
        got = [t.get() for t in ts]
        if n < 32768:
            assert comm.ctx.wire_bytes == 4 * n
            np.testing.assert_array_equal(got[0], vals[0] + vals[1])
        else:
            assert comm.ctx.wire_bytes == 2 * n, "the BF16 path moves half the bytes"
            bf = [v.astype(ml_dtypes.bfloat16).astype(np.float32) for v in vals]
            np.testing.assert_array_equal(got[0], bf[0] + bf[1])
            exact = vals[0].astype(np.float64) + vals[1]
            assert np.all(np.abs(got[0] - exact) <= 2**-8 * (np.abs(vals[0]) + np.abs(vals[1])))
        np.testing.assert_array_equal(got[0], got[1])
    comm.free()
    for b in (b0, b1):
        b.free()
    for b in bufs:
        b.free()


def test_comm_declines_what_it_does_not_serve(d0, d1):
    b0, b1 = d0.new_backend(), d1.new_backend()
    comm = Comm.init([b0, b1])
    ctx = Context()
    ts = [ctx.new_tensor(T.F16, (64,), f"h{i}") for i in range(2)]
    bufs = [alloc_tensors([ts[0]], d0.buffer_type), alloc_tensors([ts[1]], d1.buffer_type)]
    assert comm.allreduce(ts) is False  # F16: the SDK's fallback takes the call
    comm.free()
    for b in (b0, b1):
        b.free()
    for b in bufs:
        b.free()


# --- errors -------------------------------------------------------------------------------------------
def test_every_kernel_source_is_package_data_and_defined_once():
    """kernels/*.cl ship with the package (pyproject's package-data globs match every file), and
    every kernel the plugin launches is defined in them (kernel_sources raises on a duplicate)."""
    pkg = Path(program.__file__).parent
    setuptools = tomllib.loads((pkg.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = setuptools["package-data"]["accelplane_sycl"]
    files = set((pkg / program.KERNEL_DIR).iterdir())
    shipped = {f for g in globs for f in pkg.glob(g)}  # setuptools globs package-data this way
    assert files and files <= shipped, (sorted(f.name for f in files - shipped), globs)
    launched = {k for f in pkg.glob("*.py") for k in re.findall(r'"(k_\w+)"', f.read_text())}
    assert {"k_mul_mat", "k_spin", "k_add_bf16"} <= launched
    assert launched <= set(program.kernel_sources()), launched - set(program.kernel_sources())
    for name, src in program.kernel_sources().items():
        assert src.startswith((pkg / program.KERNEL_DIR / program.COMMON).read_text())
        assert src.count("__kernel void ") == 1 and f"__kernel void {name}(" in src


def test_kernel_build_failure_names_device_and_has_log(d0, monkeypatch):
    bad = "__kernel void k_broken(__global int* a) { a[0] = no_such_name; }\n"
    monkeypatch.setattr(program, "_sources", {"k_broken": bad})
    with pytest.raises(ComputeError) as e:
        d0.runtime.kernel("k_broken")
    msg = str(e.value)
    assert "SYCL0" in msg and "k_broken" in msg
    assert "no_such_name" in msg, f"no build log in {msg!r}"


def test_allocation_failure_names_device(d0):
    with pytest.raises(AllocationError, match="SYCL0"):
        d0.runtime.alloc(1 << 52, host=False)


@pytest.mark.parametrize("path", ["c", "dpctl"])
def test_no_device_is_a_clear_error(monkeypatch, path):
    import dpctl

    if path == "c":  # dpctl's C interface lists none
        monkeypatch.setattr(runtime, "list_devices_c", lambda lib: [])
    else:
        monkeypatch.setattr(runtime, "_dpctl_c", lambda: None)
        monkeypatch.setattr(dpctl, "get_devices", lambda *a, **k: [])
    with pytest.raises(DeviceError, match="^no SYCL device: dpctl .* lists none"):
        runtime.discover()


# --- listing through dpctl's C interface ----------------------------------------------------------------
def test_listing_through_the_c_interface_is_dpctls(monkeypatch):
    """What the C interface lists (each field) is what dpctl's Python API says of its devices,
    in its order; without the library, listing goes through dpctl and says the same."""
    import dpctl

    lib = runtime._dpctl_c()
    assert lib is not None, "dpctl's C interface did not load"
    ours = runtime.list_devices_c(lib)
    theirs = [runtime.SyclDeviceInfo.of(d) for d in dpctl.get_devices()]
    assert [d._key() for d in ours] == [d._key() for d in theirs] and ours
    monkeypatch.setattr(runtime, "_dpctl_c", lambda: None)
    assert runtime.list_devices() == theirs


def test_listing_does_not_import_dpctl_and_first_use_does():
    code = ("import sys, accelplane; d = [d for d in accelplane.devices() if d.plugin.name == 'sycl'];"
            "print(len(d), 'dpctl' in sys.modules); d[0].runtime; print('dpctl' in sys.modules)")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    n, listed, used = r.stdout.split()
    assert int(n) >= 1 and (listed, used) == ("False", "True"), r.stdout


def test_a_device_list_that_changed_does_not_open(monkeypatch):
    """Opening takes the listed device's dpctl device by its index and checks it is the same."""
    import dpctl

    probe = runtime.discover()[0]
    other = runtime.SyclDeviceInfo("Another", "opencl:gpu:0", "1", 1 << 30, 1 << 28, False)
    monkeypatch.setattr(runtime, "_dpctl_devices", None)
    monkeypatch.setattr(dpctl, "get_devices", lambda *a, **k: [])
    with pytest.raises(DeviceError, match="SYCL0: dpctl lists .* now, not the"):
        runtime.DevState(probe)
    moved = runtime.Probe(probe.index, other, probe.phys_index, probe.shared, probe.settings)
    monkeypatch.undo()
    monkeypatch.setattr(runtime, "_dpctl_devices", None)
    with pytest.raises(DeviceError, match="'Another'"):
        runtime.DevState(moved)


@pytest.mark.parametrize("bad", ["0,99", "a", "0,,1", "-1"])
def test_bad_device_list_is_a_config_error(monkeypatch, bad):
    monkeypatch.setenv("ACCELPLANE_SYCL_DEVICES", bad)
    with pytest.raises(ConfigError, match="ACCELPLANE_SYCL_DEVICES"):
        runtime.discover()


def test_compute_on_foreign_memory_raises(d0, d1):
    ctx = Context()
    x = ctx.new_tensor(T.F32, (16,), "x")
    y = ctx.scale(x, 2.0)
    g = Graph([y])
    bufs = [alloc_tensors([x], d1.buffer_type), alloc_tensors([y], d0.buffer_type)]
    b = d0.new_backend()
    with pytest.raises(ComputeError, match="not in memory of SYCL0"):
        b.compute(g)
    b.free()
    for buf in bufs:
        buf.free()


# --- bad indices: a typed error at synchronize, never silently wrong data -------------------------------
def _index_graphs(ctx):
    """GET_ROWS, SET_ROWS and MUL_MAT_ID graphs with their index tensors (all I32)."""
    table = ctx.new_tensor(T.F32, (4, 8), "table")
    rows = ctx.new_tensor(T.I32, (3,), "rows")
    dst = ctx.new_tensor(T.F32, (4, 8), "dst")
    src = ctx.new_tensor(T.F32, (2, 8), "src")
    where = ctx.new_tensor(T.I32, (2,), "where")
    experts = ctx.new_tensor(T.F32, (3, 4, 8), "experts")
    x = ctx.new_tensor(T.F32, (2, 1, 8), "x")
    ids = ctx.new_tensor(T.I32, (2, 1), "ids")
    g = {
        "GET_ROWS": ctx.graph(ctx.get_rows(table, rows)),
        "SET_ROWS": ctx.graph(ctx.set_rows(dst, src, where)),
        "MUL_MAT_ID": ctx.graph(ctx.mul_mat_id(experts, x, ids)),
    }
    good = {"GET_ROWS": (rows, [0, 3, 1]), "SET_ROWS": (where, [3, 0]), "MUL_MAT_ID": (ids, [[2], [0]])}
    bad = {"GET_ROWS": (rows, [0, 4, 1]), "SET_ROWS": (where, [3, -1]), "MUL_MAT_ID": (ids, [[3], [0]])}
    return g, good, bad


_WHAT = {
    "GET_ROWS": "GET_ROWS: a row index was out of range",
    "SET_ROWS": "SET_ROWS: a row index was out of range",
    "MUL_MAT_ID": "MUL_MAT_ID: an expert id was out of range",
}


@pytest.mark.parametrize("op", ["GET_ROWS", "SET_ROWS", "MUL_MAT_ID"])
@pytest.mark.parametrize("which", [0, 1], ids=["SYCL0", "SYCL1"])
def test_bad_index_raises_at_synchronize(devs, op, which):
    dev = devs[which]
    ctx = Context()
    graphs, good, bad = _index_graphs(ctx)
    g = graphs[op]
    buf = alloc_tensors([*ctx.tensors, *g.nodes], dev.buffer_type)
    rng = np.random.default_rng(7)
    for t in g.leafs:
        if t.type == T.F32:
            t.set(rng.standard_normal(t.shape).astype(np.float32))
    b = dev.new_backend()
    idx, vals = bad[op]
    idx.set(np.array(vals, np.int32))
    before = {t: t.get().copy() for t in g.leafs}
    b.graph_compute(g)  # queued: the error shows when the host waits for the queue
    with pytest.raises(ComputeError, match=f"^SYCL{which}: {_WHAT[op]}$"):
        b.synchronize()
    b.synchronize()  # read once and reset
    if op == "SET_ROWS":  # the good row was written, the bad one nothing (no stray write)
        dst = g.nodes[-1].view_src
        want = before[dst].copy()
        want[3] = before[g.nodes[-1].src[1]][0]
        np.testing.assert_array_equal(dst.get(), want)
    for t in g.leafs:
        if t.type == T.I32 or op != "SET_ROWS" or t is not g.nodes[-1].view_src:
            np.testing.assert_array_equal(t.get(), before[t], err_msg=f"input {t.name} changed")
    # afterwards a good compute works and is right
    idx, vals = good[op]
    idx.set(np.array(vals, np.int32))
    b.compute(g)
    out = g.nodes[-1]
    if op == "GET_ROWS":
        np.testing.assert_array_equal(out.get(), before[out.src[0]][[0, 3, 1]])
    elif op == "SET_ROWS":
        got = out.view_src.get()
        np.testing.assert_array_equal(got[[3, 0]], before[out.src[1]])
    else:
        e, xv = before[out.src[0]], before[out.src[1]]
        want = np.stack([e[2] @ xv[0, 0], e[0] @ xv[1, 0]])[:, None, :]
        np.testing.assert_allclose(out.get(), want, rtol=1e-5, atol=1e-5)
    b.free()
    buf.free()


def test_bad_index_error_is_per_backend_and_names_every_op(d0):
    """Two bad ops in one graph: one error naming both; another backend of the device stays clean."""
    ctx = Context()
    graphs, _, bad = _index_graphs(ctx)
    g = Graph([graphs["GET_ROWS"].nodes[-1], graphs["MUL_MAT_ID"].nodes[-1]])
    buf = alloc_tensors([*ctx.tensors, *g.nodes], d0.buffer_type)
    for t in g.leafs:
        t.set(np.ones(t.shape, np.float32) if t.type == T.F32 else np.zeros(t.shape, np.int32))
    b, other = d0.new_backend(), d0.new_backend()
    other.compute(g)  # good indices (zeros)
    for op in ("GET_ROWS", "MUL_MAT_ID"):
        idx, vals = bad[op]
        idx.set(np.array(vals, np.int32))
    with pytest.raises(ComputeError) as e:
        b.compute(g)
    assert str(e.value) == f"SYCL0: {_WHAT['GET_ROWS']}; {_WHAT['MUL_MAT_ID']}"
    other.synchronize()  # the other stream has no error of its own
    b.graph_compute(g)
    b.free()  # freeing never raises; the error goes with the backend
    buf.free()


# --- the benchmark tool runs (small sizes; the numbers are in docs/performance.md) -----------------------
def _tool(name: str):
    """A module of the source checkout's tools/ (not part of the plugin), imported by path."""
    path = Path(__file__).resolve().parents[3] / "tools" / f"{name}.py"
    if not path.exists():
        pytest.skip(f"tools/{name}.py is part of the source checkout only")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)  # as an import would
    spec.loader.exec_module(mod)
    return mod


def test_bench_smoke(d0, d1):
    bench = _tool("sycl_bench")

    rows = [bench.bench_overlap(d0, "kernel", "d2d", reps=1, mkn=(64, 256, 4), copy_mb=1)]
    assert rows[0]["two_queues_ms"] > 0 and rows[0]["copy_bytes"] == 1 << 20
    ar = bench.bench_allreduce(d0, d1, sizes=(1000, 32768), reps=1)
    assert [(r["elements"], r["wire"], r["bytes_per_rank"]) for r in ar] == [
        (1000, "F32", 4000), (32768, "BF16", 65536), (32768, "F32", 131072)
    ]  # fmt: skip
    assert "two queues" in bench.format_overlap(rows) and "BF16" in bench.format_allreduce(ar)
