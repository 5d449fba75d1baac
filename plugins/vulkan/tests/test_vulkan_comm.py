"""The Vulkan communicator (host-staged all-reduce) on logical devices: results against the
oracle, F32 byte-identical to the SDK's butterfly and ring, chunking, F16 transfer, the off
switch, repeated calls without host synchronization."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from accelplane import Context, GGMLType
from accelplane.parallel.comm import AllReduce
from accelplane.runtime.alloc import alloc_tensors
from accelplane.runtime.backend import tensor_copy_async
from accelplane.runtime.collective import canonical_sum

T = GGMLType
NP = {T.F32: np.float32, T.F16: np.float16, T.BF16: ml_dtypes.bfloat16}


@pytest.fixture
def ranks(vk_devices, monkeypatch):
    monkeypatch.setenv("ACCELPLANE_TEST_DELAY_US", "300")
    devs = vk_devices("0,0")
    made = []

    def make(n: int):
        bks = [devs[i % len(devs)].new_backend() for i in range(n)]
        made.extend(bks)
        return bks

    yield make
    for b in made:
        b.free()


def _tensors(bks, ty, shape, vals):
    ctx = Context()
    ts = [ctx.new_tensor(ty, shape, f"p{i}") for i in range(len(bks))]
    bufs = [alloc_tensors([t], b.device.buffer_type) for t, b in zip(ts, bks, strict=True)]
    for t, v in zip(ts, vals, strict=True):
        t.set(v)
    return ts, bufs


def _run(bks, ty, shape, vals, algorithm):
    ts, bufs = _tensors(bks, ty, shape, vals)
    with AllReduce(bks, algorithm) as ar:
        used = ar(ts)
        for b in bks:
            b.synchronize()
        out = [t.get() for t in ts]
    for b in bufs:
        b.free()
    return used, out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_f32_byte_identical_to_butterfly_and_ring(ranks, monkeypatch, n):
    monkeypatch.setenv("ACCELPLANE_VK_COMM_CHUNK", "4096")  # several chunks in flight
    bks = ranks(n)
    rng = np.random.default_rng(n)
    vals = [rng.standard_normal((37, 101)).astype(np.float32) for _ in range(n)]
    want = canonical_sum(vals)
    results = {}
    for algo in ("plugin", "butterfly", "ring"):
        used, out = _run(bks, T.F32, (37, 101), vals, algo)
        assert used == algo
        for r, o in enumerate(out):
            assert np.array_equal(o, want), f"{algo}: rank {r} differs from the canonical sum"
        results[algo] = out[0]
    exact = np.sum(np.stack(vals).astype(np.float64), axis=0)
    np.testing.assert_allclose(results["plugin"], exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ty", [T.F16, T.BF16])
def test_half_types(ranks, ty):
    bks = ranks(3)
    rng = np.random.default_rng(1)
    vals = [rng.uniform(-1, 1, (64, 9)).astype(NP[ty]) for _ in range(3)]
    used, out = _run(bks, ty, (64, 9), vals, "plugin")
    assert used == "plugin"
    want = canonical_sum(vals)
    for o in out:
        assert np.array_equal(o.astype(np.float32), want.astype(np.float32))


def test_f16_transfer_above_threshold(ranks, monkeypatch):
    monkeypatch.setenv("ACCELPLANE_COMM_COMPRESS_MIN", "1024")
    monkeypatch.setenv("ACCELPLANE_VK_COMM_CHUNK", "8192")
    bks = ranks(3)
    rng = np.random.default_rng(2)
    vals = [rng.uniform(-1, 1, (50, 70)).astype(np.float32) for _ in range(3)]
    used, out = _run(bks, T.F32, (50, 70), vals, "plugin")
    assert used == "plugin"
    # the sum of the F16-rounded partials, rounded to F16 once: every rank the same bits
    want = canonical_sum([v.astype(np.float16).astype(np.float32) for v in vals]).astype(np.float16)
    for o in out:
        assert np.array_equal(o, want.astype(np.float32))
    monkeypatch.setenv("ACCELPLANE_VK_COMM_FP32", "1")
    _, out = _run(bks, T.F32, (50, 70), vals, "plugin")
    assert np.array_equal(out[0], canonical_sum(vals)), "ACCELPLANE_VK_COMM_FP32 keeps F32 on the wire"


def test_off_switch(ranks, monkeypatch):
    bks = ranks(4)
    rng = np.random.default_rng(3)
    vals = [rng.standard_normal(1000).astype(np.float32) for _ in range(4)]
    used, out = _run(bks, T.F32, (1000,), vals, "auto")
    assert used == "plugin" and all(np.array_equal(o, canonical_sum(vals)) for o in out)
    monkeypatch.setenv("ACCELPLANE_VK_COMM_OFF", "1")
    used, out = _run(bks, T.F32, (1000,), vals, "auto")
    assert used == "butterfly", "ACCELPLANE_VK_COMM_OFF leaves the all-reduce to the SDK"
    assert all(np.array_equal(o, canonical_sum(vals)) for o in out)


def test_repeated_calls_without_host_sync(ranks, monkeypatch):
    """Layers of compute + all-reduce queued back to back; one synchronize at the end."""
    monkeypatch.setenv("ACCELPLANE_VK_COMM_CHUNK", "4096")
    bks = ranks(2)
    ctx = Context()
    xs = [ctx.new_tensor(T.F32, (3000,), f"x{i}") for i in range(2)]
    ys = [ctx.scale(x, 0.5, float(i)) for i, x in enumerate(xs)]  # y_i = x_i / 2 + i
    graphs = [ctx.graph(y) for y in ys]
    bufs = [alloc_tensors([x, y], b.device.buffer_type) for x, y, b in zip(xs, ys, bks, strict=True)]
    v = np.arange(3000, dtype=np.float32) / 7
    for x in xs:
        x.set(v)
    want = [v.astype(np.float64)] * 2
    with AllReduce(bks) as ar:
        for _ in range(5):
            for b, g in zip(bks, graphs, strict=True):
                b.graph_compute(g)
            assert ar(ys) == "plugin"
            for b, x, y in zip(bks, xs, ys, strict=True):  # feed the sum back: x <- y
                assert tensor_copy_async(b, b, y, x)
            s = want[0] / 2 + want[1] / 2 + 1
            want = [s, s]
        for b in bks:
            b.synchronize()
        for x in xs:
            np.testing.assert_allclose(x.get(), want[0], rtol=1e-5)
    for b in bufs:
        b.free()
