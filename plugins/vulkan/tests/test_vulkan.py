"""Vulkan plugin specifics (the conformance suite covers the op catalog and the contracts):
device discovery and logical devices, buffer types, plans recorded once, asynchrony, shader
build failures, a missing loader or driver, exact quantization. Skipped, with the reason,
where no Vulkan device is present."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import accelplane
import numpy as np
import pytest
from accelplane.core.graph import Context
from accelplane.core.types import GGMLType, quantize
from accelplane.errors import AccelplaneError, ConfigError, KernelCompileError
from accelplane.runtime.alloc import alloc_tensors
from accelplane.runtime.backend import tensor_copy_async
from accelplane.runtime.registry import reset_registry
from accelplane_vulkan import kernels, shaders, tuning

T = GGMLType


def _affine_graph(dev, n=1000):
    ctx = Context()
    x = ctx.new_tensor(T.F32, (n,), "x")
    y = ctx.scale(ctx.add(ctx.scale(x, 2.0, 1.0), x), 0.5)  # (3x + 1) / 2
    g = ctx.graph(y)
    buf = alloc_tensors([x, *g.nodes], dev.buffer_type)
    return x, y, g, buf


# --- devices ----------------------------------------------------------------------------------------
def test_one_device_per_physical_device_and_memory(vk_devices):
    from accelplane_vulkan import probe

    devs = vk_devices()
    phys = probe.instance().physical
    usable = [p for p in phys if not p.usable]
    gpus = [p for p in usable if p.type != 4]
    assert len(devs) == len(gpus or usable)
    assert [d.name for d in devs] == [f"Vulkan{i}" for i in range(len(devs))]
    dev = devs[0]
    free0, total = dev.memory()
    assert total > 0 and 0 < free0 <= total
    t = Context().new_tensor(T.F32, (16 << 20,))  # 64 MiB
    buf = alloc_tensors([t], dev.buffer_type)
    assert dev.memory()[0] <= free0 - t.nbytes
    buf.free()
    assert dev.memory()[0] == free0


def test_logical_devices_from_env(vk_devices, monkeypatch):
    monkeypatch.setenv("ACCELPLANE_TEST_DELAY_US", "2000")  # device work lags the host
    d0, d1 = vk_devices("0,0")
    assert "logical device 1 of 2" in d0.description and "logical device 2 of 2" in d1.description
    assert not d1.supports_buft(d0.buffer_type), "a logical device cannot compute on another's memory"
    ctx = Context()
    a = ctx.new_tensor(T.F32, (3000,), "a")
    b = ctx.new_tensor(T.F32, (3000,), "b")
    y = ctx.scale(a, 2.0)
    z = ctx.scale(b, 3.0)
    ga, gb = ctx.graph(y), ctx.graph(z)
    bufs = [alloc_tensors([a, y], d0.buffer_type), alloc_tensors([b, z], d1.buffer_type)]
    b0, b1 = d0.new_backend(), d1.new_backend()
    assert b0.ctx.dev is not b1.ctx.dev and b0.ctx.dev.phys is b1.ctx.dev.phys
    v = np.arange(3000, dtype=np.float32)
    for i in range(3):
        b0.set_tensor_async(a, (v + i).view(np.uint8))
        b0.graph_compute(ga)
        assert tensor_copy_async(b0, b1, y, b), "a copy between logical devices must stay asynchronous"
        b1.graph_compute(gb)
        b1.synchronize()
        np.testing.assert_array_equal(z.get(), (v + i) * 6)
    b0.free()
    b1.free()
    for x in bufs:
        x.free()


@pytest.mark.parametrize("bad", ["0,99", "0,x", "-1"])
def test_bad_device_list_is_a_config_error(monkeypatch, bad):
    """A bad ACCELPLANE_VK_DEVICES stops every use of the registry with the variable named
    (no quiet fall-back to the other devices)."""
    monkeypatch.setenv("ACCELPLANE_VK_DEVICES", bad)
    reset_registry()
    try:
        reg = accelplane.get_registry()
        try:
            _ = reg.devices
        except ConfigError as e:
            assert "ACCELPLANE_VK_DEVICES" in str(e) and ("99" in str(e) or bad in str(e)), e
        else:  # the index is checked against the driver's devices: none, no error
            pytest.skip(f"no Vulkan device: {[f.reason for f in reg.failures]}")
        with pytest.raises(ConfigError):  # again, not only the first time
            _ = reg.devices
    finally:
        reset_registry()


# --- buffers ------------------------------------------------------------------------------------------
def test_buffer_types(vk_devices):
    dev = vk_devices()[0]
    assert not dev.buffer_type.is_host, "device memory is reached only through the hooks"
    hb = dev.host_buffer_type
    assert hb is not None and hb.is_host and not dev.supports_buft(hb)
    assert dev.supports_buft(dev.buffer_type)
    t = Context().new_tensor(T.F32, (100,))
    buf = alloc_tensors([t], hb)
    arr = buf.host_array
    assert arr.dtype == np.uint8 and arr.size >= t.nbytes and arr.flags.writeable
    t.set(np.arange(100, dtype=np.float32))
    assert np.array_equal(arr[t.offs : t.offs + 400].view(np.float32), np.arange(100))
    arr[t.offs : t.offs + 4] = np.array([7], np.float32).view(np.uint8)
    assert t.get()[0] == 7
    buf.free()


def test_host_buffer_to_device_copy(vk_devices):
    dev = vk_devices()[0]
    ctx = Context()
    h = ctx.new_tensor(T.F32, (500,), "h")
    d = ctx.new_tensor(T.F32, (500,), "d")
    bufs = [alloc_tensors([h], dev.host_buffer_type), alloc_tensors([d], dev.buffer_type)]
    be = dev.new_backend()
    h.set(np.linspace(0, 1, 500, dtype=np.float32))
    assert tensor_copy_async(be, be, h, d)
    be.synchronize()
    np.testing.assert_array_equal(d.get(), h.get())
    be.free()
    for b in bufs:
        b.free()


# --- streams ------------------------------------------------------------------------------------------
def test_plan_recorded_once_and_replayed(vk_devices):
    dev = vk_devices()[0]
    x, y, g, buf = _affine_graph(dev)
    be = dev.new_backend()
    stream = be.ctx
    for i in range(5):
        x.set(np.full(1000, float(i), np.float32))
        be.compute(g)
        np.testing.assert_allclose(y.get(), (3 * i + 1) / 2)
    assert stream.plans.builds == 1
    assert stream.stats["plans_recorded"] == 1, "a repeated graph must be replayed, not recorded again"
    assert stream.stats["dispatches_recorded"] == 3
    g.layout_version += 1  # the allocator moved tensors: the plan is rebuilt
    be.compute(g)
    assert stream.stats["plans_recorded"] == 2
    be.free()
    buf.free()


def test_work_is_asynchronous(vk_devices, monkeypatch):
    monkeypatch.setenv("ACCELPLANE_TEST_DELAY_US", "100000")  # every submission waits 0..0.1 s
    dev = vk_devices()[0]
    x, y, g, buf = _affine_graph(dev)
    be = dev.new_backend()
    out = np.zeros(y.nbytes, np.uint8)
    be.set_tensor_async(x, np.ones(1000, np.float32).view(np.uint8))
    be.graph_compute(g)
    be.get_tensor_async(y, out)
    stream = be.ctx
    assert stream.completed() < stream.submitted, "the calls returned before the work completed"
    be.synchronize()
    np.testing.assert_array_equal(out.view(np.float32), 2.0)
    be.free()
    buf.free()


@pytest.mark.parametrize("xfer", [False, True])
def test_copies_on_the_transfer_queue(vk_devices, monkeypatch, xfer):
    """A device with a transfer-only queue family runs every stream's copies (uploads,
    downloads, copies between tensors) on that family's queue, recorded from a pool of its own;
    the stream's semaphore keeps them in order with its kernels, and another stream's copy
    waits for what it reads. Lavapipe has one family: ``xfer`` stands its compute family in
    (the copies then go to its last queue, through the same pools and submissions);
    ACCELPLANE_VK_TRANSFER_QUEUE=0 keeps copies on the streams' own queues."""
    from accelplane_vulkan.runtime import device as vkdev

    monkeypatch.setenv("ACCELPLANE_TEST_DELAY_US", "3000")  # device work lags the host
    if xfer:
        monkeypatch.setattr(vkdev, "transfer_family", lambda h: 0)
    else:
        monkeypatch.setenv("ACCELPLANE_VK_TRANSFER_QUEUE", "0")
    dev = vk_devices()[0]
    x, y, g, buf = _affine_graph(dev)
    ctx = Context()
    z = ctx.new_tensor(T.F32, (1000,), "z")
    zbuf = alloc_tensors([z], dev.buffer_type)
    be, pf = dev.new_backend(), dev.new_backend()
    s = be.ctx
    if xfer and s.dev.family != 0:
        pytest.skip("the compute family is not family 0")
    assert (s.xqueue is not None) == xfer and (s.dev.xfer_family is not None) == xfer
    out = np.zeros(y.nbytes, np.uint8)
    for i in range(4):
        be.set_tensor_async(x, np.full(1000, float(i), np.float32).view(np.uint8))
        be.graph_compute(g)
        ev = dev.new_event()
        ev.record(be)
        ev.wait(pf)  # the other stream copies y only once it is computed
        assert tensor_copy_async(pf, pf, y, z)
        be.get_tensor_async(y, out)
        be.synchronize()
        pf.synchronize()
        ev.free()
        np.testing.assert_allclose(out.view(np.float32), (3 * i + 1) / 2)
        np.testing.assert_allclose(z.get(), (3 * i + 1) / 2)
    assert s.stats["xfer_submits"] == (8 if xfer else 0), s.stats  # an upload and a download a round
    assert pf.ctx.stats["xfer_submits"] == (4 if xfer else 0), pf.ctx.stats
    assert s.stats["dispatches_recorded"] == 3, s.stats  # the kernels stay on the compute queue
    be.free()
    pf.free()
    buf.free()
    zbuf.free()


def test_free_while_queued_does_not_fault(vk_devices, monkeypatch):
    monkeypatch.setenv("ACCELPLANE_TEST_DELAY_US", "20000")
    dev = vk_devices()[0]
    x, y, g, buf = _affine_graph(dev)
    be = dev.new_backend()
    be.graph_compute(g)
    buf.free()  # a caller error (ordering.md rule 8); the memory dies after the queued work
    be.synchronize()
    assert not be.ctx.dev.garbage
    be.free()


# --- kernels --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0])
def test_quantizing_copy_is_byte_exact(vk_devices, qtype):
    dev = vk_devices()[0]
    rng = np.random.default_rng(5)
    vals = rng.uniform(-1, 1, (16, 256)).astype(np.float32)
    vals[3] = 0.0  # an all-zero block row
    vals[4, :32] = np.linspace(-2, 2, 32)  # ties at .5 steps
    ctx = Context()
    a = ctx.new_tensor(T.F32, vals.shape, "a")
    q = ctx.new_tensor(qtype, vals.shape, "q")
    g = ctx.graph(ctx.cpy(a, q))
    buf = alloc_tensors([a, q, *g.nodes], dev.buffer_type)
    be = dev.new_backend()
    a.set(vals)
    be.compute(g)
    assert np.array_equal(q.get_bytes(), quantize(qtype, vals).reshape(-1)), "bytes differ from ggml's"
    be.free()
    buf.free()


def test_supports_op_without_16bit_storage():
    ctx = Context()
    for ty, want in ((T.F32, True), (T.F16, False), (T.Q4_0, False)):
        a = ctx.new_tensor(ty, (4, 64), "a")
        b = ctx.new_tensor(T.F32, (4, 64), "b")
        node = ctx.mul_mat(a, b)
        assert kernels.supports(node, kernels.Caps(storage16=False)) is want
        assert kernels.supports(node, kernels.Caps(storage16=True))


def _mm_case(ta, k, m, n, batch=((1, 1), (1, 1)), tb=T.F32, noncont=False):
    from accelplane.conformance.cases import OpCase, leaf

    def build(ctx):
        (a2, a3), (b2, b3) = batch
        a = leaf(ctx, ta, (k, m, a2, a3), "a", strided=noncont)
        b = leaf(ctx, tb, (k, n, b2, b3), "b", perm=(0, 2, 1, 3) if noncont else None)
        return ctx.mul_mat(a, b)

    params = {"type_a": ta, "type_b": tb, "k": k, "m": m, "n": n, "bs": batch, "nc": noncont}
    return OpCase("MUL_MAT", params, build, 5e-4)


def _mm_id_case(ta, k, m, n_exp, n_used, n_tok, b1):
    from accelplane.conformance.cases import OpCase, leaf, perm_rows

    def build(ctx):
        a = leaf(ctx, ta, (k, m, n_exp), "as")
        b = leaf(ctx, T.F32, (k, b1, n_tok), "b")
        ids = ctx.new_tensor_ne(T.I32, n_used, n_tok, name="ids")
        return ctx.mul_mat_id(a, b, ids)

    params = {"type_a": ta, "k": k, "m": m, "n_exp": n_exp, "n_used": n_used, "n_tok": n_tok, "b1": b1}
    return OpCase("MUL_MAT_ID", params, build, 5e-4, {"ids": perm_rows(n_exp)})


def _mmv_q_cases(types, all_n=()):
    """Shapes of mul_mat_vec_q that the conformance cases leave out: M not a multiple of the
    rows per workgroup, n in 2..8 (every n for the types in ``all_n``: each n is a pipeline of
    its own), rows that take several loop iterations (and the odd one out), batch broadcast
    with n > 1, F16 and permuted activations with strided weight rows, and MUL_MAT_ID with
    several rows per workgroup."""
    for ta in types:
        bs = ta.blck_size
        long_k = 4096 if bs == 32 else 2816  # 2 slices a thread and a tail at 128 threads
        yield _mm_case(ta, long_k, 17, 1)
        yield _mm_case(ta, bs * 8, 19, 3)
        for m, n in ((13, 2), (6, 4), (9, 5), (3, 6), (11, 7), (10, 8)) if ta in all_n else ((13, 3),):
            yield _mm_case(ta, bs * 3, m, n)
        yield _mm_case(ta, bs * 4, 7, 3, ((2, 1), (4, 3)))
        yield _mm_case(ta, bs * 2, 11, 3, tb=T.F16)
        yield _mm_case(ta, bs * 2, 12, 3, noncont=True)
        yield _mm_id_case(ta, bs * 2 if bs > 32 else 64, 18, 8, 3, 2, 3)


MMV_SETTINGS = {  # ACCELPLANE_VK_MMV_* knobs: the defaults, and the other kernel shapes
    "defaults": {},  # int8 activations and integer dot products where the device has them
    "float": {"Q8": "0"},
    "float-rows1-wg64": {"Q8": "0", "ROWS": "1", "WG": "64"},
    "rows2-wg32": {"ROWS": "2", "WG": "32"},
    "rows8-wg256": {"ROWS": "8", "WG": "256"},
    "shared-memory": {"SUBGROUP": "0", "ROWS": "8"},
    "legacy": {"ROWS": "0"},
}


@pytest.mark.parametrize("setting", list(MMV_SETTINGS))
def test_quantized_mul_mat_vec_settings(vk_devices, monkeypatch, setting):
    """mul_mat_vec_q against the float64 oracle under each knob setting (guards around every
    tensor catch stray writes, NaN-filled outputs unwritten elements)."""
    from accelplane.conformance.runner import PASSED, run_op_case

    for k, v in MMV_SETTINGS[setting].items():
        monkeypatch.setenv(f"ACCELPLANE_VK_MMV_{k}", v)
    dev = vk_devices()[0]
    be = dev.new_backend()
    rng = np.random.default_rng(11)
    full = setting in ("defaults", "float")
    types = (T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K) if full else (T.Q4_0, T.Q4_K)
    failed = []
    try:
        for case in _mmv_q_cases(types, all_n=(T.Q4_0,) if full else ()):
            r = run_op_case(case, dev, be, rng)
            if r.status != PASSED:
                failed.append(f"{case.id}: {r.status} {r.message}")
    finally:
        be.free()
    assert not failed, "\n".join(failed)


def test_mul_mat_vec_q_dispatch(monkeypatch):
    """Which kernel a few-column product gets, with how many workgroups, under the knobs."""
    ctx = Context()
    b = ctx.new_tensor_ne(T.F32, 4096, 3)
    sg = kernels.Caps(subgroup=32)
    q = ctx.mul_mat(ctx.new_tensor_ne(T.Q4_0, 4096, 17), b)
    (d,) = kernels.dispatches(q, sg)
    assert (d.shader, d.spec, d.groups) == ("mul_mat_vec_q", (T.Q4_0, T.F32, 3, 0, 4, 32, 128, 0), 5)
    pre, d = kernels.dispatches(q, kernels.Caps(subgroup=32, int_dot=True))
    assert (pre.shader, pre.groups, pre.scratch.write) == ("quantize_b8", 3 * 4096 // 512, True)
    assert pre.scratch.nbytes == 3 * 4096 + 3 * 128 * 4 == d.scratch.nbytes and not d.scratch.write
    assert (d.shader, d.spec, d.bindings[1]) == ("mul_mat_vec_q8", (T.Q4_0, T.F32, 3, 0, 4, 32, 128, 0), None)

    def caps(subgroup: int, int_dot: bool) -> kernels.Caps:  # the device's, as the settings allow
        return kernels.Caps.of(True, subgroup, int_dot, tuning.read())

    monkeypatch.setenv("ACCELPLANE_VK_MMV_Q8", "0")
    (d,) = kernels.dispatches(q, caps(32, True))
    assert d.shader == "mul_mat_vec_q"
    monkeypatch.delenv("ACCELPLANE_VK_MMV_Q8")
    monkeypatch.setenv("ACCELPLANE_VK_MMV_SUBGROUP", "0")
    (d,) = kernels.dispatches(q, caps(32, True))  # no subgroup arithmetic: shared memory
    assert (d.shader, d.spec[4:]) == ("mul_mat_vec_q_sm", (4, 1, 128, 0))
    monkeypatch.setenv("ACCELPLANE_VK_MMV_ROWS", "8")
    (d,) = kernels.dispatches(q, caps(0, False))  # 8 rows x 3 columns x 128 threads: 12 KiB
    assert d.spec[4] == 8 and d.groups == 3
    monkeypatch.setenv("ACCELPLANE_VK_MMV_WG", "256")
    (d,) = kernels.dispatches(q, caps(0, False))  # 24 KiB would exceed 16: fewer rows
    assert d.spec[4:] == (4, 1, 256, 0) and d.groups == 5
    monkeypatch.setenv("ACCELPLANE_VK_MMV_WG", "100")
    with pytest.raises(ConfigError, match="ACCELPLANE_VK_MMV_WG='100': expected one of 32, 64, 128, 256"):
        tuning.read()
    monkeypatch.delenv("ACCELPLANE_VK_MMV_WG")
    b512 = ctx.new_tensor_ne(T.F32, 512, 1)
    q4k = ctx.mul_mat(ctx.new_tensor_ne(T.Q4_K, 512, 16), b512)
    (d,) = kernels.dispatches(q4k, sg)
    assert d.spec[6:] == (64, 1), "64 slices of 8 values: 64 threads; aligned rows: 32-bit loads"
    _, d = kernels.dispatches(q4k, kernels.Caps(subgroup=32, int_dot=True))
    assert d.spec[6] == 32, "int8 K-quant slices take 16 values"
    (d,) = kernels.dispatches(ctx.mul_mat(ctx.new_tensor_ne(T.F16, 4096, 16), b), sg)
    assert d.shader == "mul_mat_vec", "float weights keep their kernel"
    monkeypatch.setenv("ACCELPLANE_VK_MMV_ROWS", "0")
    (d,) = kernels.dispatches(q, caps(32, False))
    assert d.shader == "mul_mat_vec" and d.groups == 17
    monkeypatch.setenv("ACCELPLANE_VK_MMV_ROWS", "3")
    with pytest.raises(ConfigError, match="ACCELPLANE_VK_MMV_ROWS"):
        caps(32, False)


def test_mul_mat_vec_q8_quantizes_each_activation_once(vk_devices):
    """Products of one activation share its int8 copy (one quantize_b8 in the plan); a node
    that overwrites the activation in between makes the next product quantize it again."""
    from accelplane.core.types import dequantize

    dev = vk_devices()[0]
    if not (dev.ctx.caps.int_dot and dev.ctx.caps.subgroup):
        pytest.skip("no integer dot products or subgroup arithmetic: no mul_mat_vec_q8")
    ctx = Context()
    k, m = 256, 20
    w = [ctx.new_tensor_ne(T.Q4_0, k, m, name=f"w{i}") for i in range(3)]
    x = ctx.new_tensor_ne(T.F32, k, 2, name="x")
    x2 = ctx.new_tensor_ne(T.F32, k, 2, name="x2")
    y0, y1 = ctx.mul_mat(w[0], x), ctx.mul_mat(w[1], x)
    over = ctx.cpy(x2, x)  # x's memory rewritten after y0 and y1 read it
    y2 = ctx.mul_mat(w[2], over)
    g = ctx.graph(y0, y1, y2)
    buf = alloc_tensors([*ctx.tensors, *g.nodes], dev.buffer_type)
    rng = np.random.default_rng(3)
    vals = [rng.uniform(-1, 1, (m, k)).astype(np.float32) for _ in w]
    for t, v in zip(w, vals, strict=True):
        t.set_bytes(quantize(T.Q4_0, v).reshape(-1))
    xv, x2v = rng.uniform(-1, 1, (2, 2, k)).astype(np.float32)
    x.set(xv)
    x2.set(x2v)
    be = dev.new_backend()
    be.compute(g)
    assert be.ctx.plans.get(g).n_dispatches == 6  # quantize, y0, y1, copy, quantize, y2
    for y, t, xin in ((y0, w[0], xv), (y1, w[1], xv), (y2, w[2], x2v)):
        wd = dequantize(T.Q4_0, t.get_bytes(), k).reshape(m, k)
        want = xin.astype(np.float64) @ wd.T.astype(np.float64)
        got = y.get().reshape(2, m)
        assert np.sum((got - want) ** 2) / np.sum(want**2) < 5e-4
    be.free()
    buf.free()


@pytest.mark.parametrize("wtype", [T.Q4_0, T.Q8_0])
def test_mul_mat_vec_q8_quantizes_activations_as_ggml(vk_devices, wtype):
    """Q4_0 / Q8_0 weights by int8 activations: the activation blocks' scales are f16, as ggml's
    Q8_0 blocks (the product equals the float64 one of the activations quantized by the gguf
    package, up to float rounding; an f32 scale is ~2e-4 off)."""
    import gguf
    from accelplane.core.types import dequantize

    dev = vk_devices()[0]
    if not (dev.ctx.caps.int_dot and dev.ctx.caps.subgroup):
        pytest.skip("no integer dot products or subgroup arithmetic: no mul_mat_vec_q8")
    ctx = Context()
    k, m, n = 512, 24, 3
    w = ctx.new_tensor_ne(wtype, k, m, name="w")
    x = ctx.new_tensor_ne(T.F32, k, n, name="x")
    y = ctx.mul_mat(w, x)
    g = ctx.graph(y)
    buf = alloc_tensors([*ctx.tensors, *g.nodes], dev.buffer_type)
    rng = np.random.default_rng(4)
    w.set_bytes(quantize(wtype, rng.uniform(-1, 1, (m, k)).astype(np.float32)).reshape(-1))
    xv = (rng.standard_normal((n, k)) * np.linspace(0.1, 30, k)).astype(np.float32)
    x.set(xv)
    be = dev.new_backend()
    try:
        be.compute(g)
        assert "quantize_b8" in [d.shader for d in kernels.dispatches(y, dev.ctx.caps)]
        q8 = gguf.GGMLQuantizationType.Q8_0
        xq = gguf.quants.dequantize(gguf.quants.quantize(xv, q8), q8).astype(np.float64)
        want = xq @ dequantize(wtype, w.get_bytes(), k).reshape(m, k).T.astype(np.float64)
        got = y.get().reshape(n, m)
        assert np.sum((got - want) ** 2) / np.sum(want**2) < 1e-11
    finally:
        be.free()
        buf.free()


@pytest.mark.parametrize("keep_norm", [False, True])
def test_norm_mul_fused(vk_devices, keep_norm):
    """An RMS_NORM read only by the MUL after it is one dispatch (accelplane.core.fusion), the
    weights broadcast over rows and batches; asked for as an output too, it is two."""
    from accelplane.testing.fusion import run_norm_mul

    plan = run_norm_mul(vk_devices()[0], lambda be, g: be.ctx.plans.get(g), keep_norm=keep_norm, ne0=300)
    assert plan.n_dispatches == (2 if keep_norm else 1)
    assert plan.fused == ([] if keep_norm else [("RMS_NORM", "MUL")])


# --- failures are loud, and isolated ----------------------------------------------------------------------
needs_glslc = pytest.mark.skipif(shaders.glslc() is None, reason="glslc is not installed")


@needs_glslc
def test_shader_compile_failure_is_loud(tmp_path, monkeypatch):
    sdir = tmp_path / "shaders"
    shutil.copytree(shaders.SHADER_DIR, sdir)
    with open(sdir / "unary.comp", "a") as f:
        f.write("\nvoid broken() { undefined_symbol = 1; }\n")
    monkeypatch.setenv("ACCELPLANE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(shaders.ShaderCompileError) as e:
        shaders.spirv("unary", sdir)
    msg = str(e.value)
    assert "glslc failed on unary.comp" in msg and "undefined_symbol" in msg and "exit status" in msg
    assert not any((tmp_path / "cache").rglob("unary-*.spv")), "no SPIR-V may be cached for a failed build"


@needs_glslc
def test_broken_shader_fails_before_any_backend(tmp_path, monkeypatch, vk_devices):
    vk_devices()  # skips without a device
    sdir = tmp_path / "shaders"
    shutil.copytree(shaders.SHADER_DIR, sdir)
    (sdir / "norm.comp").write_text(
        (sdir / "norm.comp").read_text().replace("void main() {", "void main() {(")
    )
    monkeypatch.setenv("ACCELPLANE_VK_SHADER_DIR", str(sdir))
    monkeypatch.setenv("ACCELPLANE_CACHE_DIR", str(tmp_path / "cache"))
    dev = vk_devices()[0]
    with pytest.raises(KernelCompileError, match="norm.comp"):
        dev.new_backend()


def _devices_output(env: dict, pythonpath: str | None = None) -> str:
    env = {**os.environ, **env, "ACCELPLANE_DISABLE_PLUGINS": "sycl,hexagon,cuda"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run(
        [sys.executable, "-m", "accelplane.cli", "devices"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_missing_driver_is_a_clear_line():
    # the loader finds no driver when pointed at a manifest that does not exist
    out = _devices_output(
        {"VK_ICD_FILENAMES": "/nonexistent/icd.json", "VK_DRIVER_FILES": "/nonexistent/icd.json"}
    )
    # an installed plugin whose driver is absent is listed as having no device, not as broken
    line = next((x for x in out.splitlines() if x.startswith("plugin vulkan: no device")), None)
    if line is None and "Vulkan0" in out:
        pytest.skip("this loader ignores VK_ICD_FILENAMES / VK_DRIVER_FILES")
    assert line is not None and "no Vulkan driver found" in line, out
    assert "CPU" in out, "the other plugins carry on"


def test_missing_loader_is_a_clear_line(tmp_path):
    out = _devices_output({"ACCELPLANE_VK_LOADER": str(tmp_path / "libvulkan.so.1")})
    line = next((x for x in out.splitlines() if x.startswith("plugin vulkan: no device")), "")
    assert "no Vulkan driver found: ACCELPLANE_VK_LOADER" in line and "libvulkan.so.1" in line, out
    assert "CPU" in out


def test_missing_loader_on_the_library_path_is_no_device(monkeypatch):
    import ctypes

    from accelplane.errors import DeviceError
    from accelplane_vulkan import probe

    def no_library(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.delenv("ACCELPLANE_VK_LOADER", raising=False)
    monkeypatch.setattr(ctypes, "CDLL", no_library)
    with pytest.raises(DeviceError, match="^no Vulkan driver found: the Vulkan loader libvulkan.so.1 is not"):
        probe.load_loader()


def test_a_runtime_that_does_not_open_is_listed_failing(tmp_path):
    """The probe (ctypes) finds the device, but the ``vulkan`` package does not load (as
    without libvulkan.so.1: OSError at its import): listing still names the device; its first
    use raises DeviceOpenError naming the plugin and the cause, and `accelplane devices` shows
    it failing and leaves it out of the default order."""
    stub = tmp_path / "vulkan"
    stub.mkdir()
    (stub / "__init__.py").write_text(
        textwrap.dedent("""
        raise OSError("Cannot find Vulkan SDK version. Please ensure that it is installed and "
                      "that the <sdk_root>/<version>/lib/ folder is in the library path")
    """)
    )
    out = _devices_output({}, str(tmp_path))
    if "plugin vulkan: no device" in out:
        pytest.skip(f"no Vulkan device: {out}")
    lines = out.splitlines()
    i = next(i for i, x in enumerate(lines) if x.strip().startswith("Vulkan0"))
    assert lines[i + 1].strip().startswith("did not open: plugin 'vulkan': device Vulkan0"), out
    assert "no Vulkan driver found" in lines[i + 1] and "libvulkan.so.1" in lines[i + 1], out
    assert "vulkan/Vulkan0" not in next(x for x in lines if x.startswith("default order")), out
    code = textwrap.dedent("""
        import accelplane
        from accelplane.errors import DeviceOpenError
        dev = accelplane.device("Vulkan0")
        assert not dev.is_open
        for attempt in range(2):  # the failure is kept: the same error every time
            try:
                dev.new_backend()
            except DeviceOpenError as e:
                print(type(e.__cause__).__name__, e)
        """)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "ACCELPLANE_DISABLE_PLUGINS": "sycl,hexagon,cuda"}  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    got = p.stdout.splitlines()
    assert len(got) == 2 and got[0] == got[1], (p.stdout, p.stderr)
    want = "DeviceError plugin 'vulkan': device Vulkan0 did not open: DeviceError: no Vulkan driver found"
    assert got[0].startswith(want), got


def test_plugin_module_imports_nothing_heavy():
    code = (
        "import sys, accelplane_vulkan.plugin; "
        "print(any(m in sys.modules for m in ('vulkan', 'accelplane_vulkan.runtime', 'cffi')))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "False", p.stderr


def test_errors_are_typed(vk_devices):
    dev = vk_devices()[0]
    ctx = Context()
    x = ctx.new_tensor(T.F32, (8,), "x")
    g = ctx.graph(ctx.scale(x, 2.0))
    be = dev.new_backend()
    with pytest.raises(AccelplaneError, match="not allocated"):
        be.compute(g)
    be.free()


def test_prebuilt_spirv_lookup(tmp_path, monkeypatch):
    """SPIR-V built into the package is used when the cache is empty (machines without glslc)."""
    monkeypatch.setenv("ACCELPLANE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(shaders, "PREBUILT_DIR", tmp_path / "prebuilt")
    (tmp_path / "prebuilt").mkdir()
    key = shaders.source_key("unary")
    fake = b"\x03\x02\x23\x07" + b"\0" * 16
    (tmp_path / "prebuilt" / f"unary-{key}.spv").write_bytes(fake)
    monkeypatch.setenv("ACCELPLANE_GLSLC", str(Path("/nonexistent/glslc")))
    assert shaders.spirv("unary") == fake
    with pytest.raises(shaders.ShaderCompileError, match="glslc not found"):
        shaders.spirv("norm")


def test_bad_indices_raise_at_synchronize(vk_devices):
    """Kernels never read or write out of bounds on a bad index; they set the stream's error
    word, and synchronize raises ComputeError naming the op (as the CPU plugin raises)."""
    from accelplane.errors import ComputeError

    dev = vk_devices()[0]
    ctx = Context()
    a = ctx.new_tensor(T.F32, (4, 8), "a")
    idx = ctx.new_tensor(T.I32, (3,), "idx")
    experts = ctx.new_tensor(T.F32, (3, 5, 8), "experts")
    b = ctx.new_tensor(T.F32, (2, 1, 8), "b")
    ids = ctx.new_tensor(T.I32, (2, 1), "ids")
    g1 = ctx.graph(ctx.get_rows(a, idx))
    g2 = ctx.graph(ctx.mul_mat_id(experts, b, ids))
    g3 = ctx.graph(ctx.set_rows(a, ctx.new_tensor(T.F32, (3, 8), "src"), idx))
    buf = alloc_tensors([*ctx.tensors, *g1.nodes, *g2.nodes, *g3.nodes], dev.buffer_type)
    for t in ctx.tensors:
        t.set(np.zeros(t.shape))
    be = dev.new_backend()
    idx.set(np.array([0, 4, 1]))
    ids.set(np.array([[1], [3]]))
    for g, op in ((g1, "GET_ROWS"), (g2, "MUL_MAT_ID"), (g3, "SET_ROWS")):
        be.graph_compute(g)
        with pytest.raises(ComputeError, match=op):
            be.synchronize()
        be.synchronize()  # reported once
    idx.set(np.array([0, 3, 1]))
    be.compute(g1)  # good indices: no error
    be.free()
    buf.free()


def test_every_shader_is_used_and_present():
    assert set(kernels.SHADERS) == set(shaders.shader_names())
