"""DLPack with the CUDA plugin: device memory crosses to CuPy and torch without a copy, both ways;
a consumer's stream waits for the backends' queued work; pinned host memory is shared as CPU
memory. Skipped, with the reason, where no CUDA device (or CuPy) is present."""

from __future__ import annotations

import accelplane
import numpy as np
import pytest
from accelplane.core.graph import Context
from accelplane.core.types import GGMLType
from accelplane.errors import DLPackError
from accelplane.interface import DLDeviceType
from accelplane.runtime.alloc import alloc_tensors
from accelplane.runtime.backend import BufferUsage

T = GGMLType


@pytest.fixture(scope="module")
def dev():
    reg = accelplane.get_registry()
    if "cuda" not in reg.plugins:
        why = [f.reason for f in reg.failures if f.name == "cuda"]
        pytest.skip(f"no device: {why[0] if why else 'the cuda plugin is not installed'}")
    return reg.plugins["cuda"].devices[0]


@pytest.fixture(scope="module")
def cp(dev):
    return pytest.importorskip("cupy")


def _tensor(buft, shape, values, type_=T.F32, usage=BufferUsage.ANY):
    ctx = Context()
    t = ctx.new_tensor(type_, shape, "t")
    buf = alloc_tensors([t], buft, usage)
    t.set(values)
    return ctx, t, buf


def test_device_memory_goes_to_cupy_without_a_copy(dev, cp):
    v = np.arange(24, dtype=np.float32).reshape(4, 6)
    ctx, t, buf = _tensor(dev.buffer_type, (4, 6), v)
    assert t.__dlpack_device__() == (DLDeviceType.CUDA, dev.ctx.index)
    a = cp.from_dlpack(t)
    assert a.data.ptr == buf.ctx.ptr + t.offs and a.device.id == dev.ctx.index
    assert np.array_equal(cp.asnumpy(a), v)
    a[1, 2] = -5.0  # CuPy → accelplane
    cp.cuda.runtime.deviceSynchronize()
    assert t.get()[1, 2] == -5.0
    t.set(np.zeros((4, 6)))  # accelplane → CuPy
    assert not cp.asnumpy(a).any()
    tr = cp.from_dlpack(Context().transpose(t))
    assert tr.data.ptr == a.data.ptr and tr.strides == (4, 24)
    with pytest.raises((RuntimeError, BufferError), match="Unsupported device"):  # numpy: host memory only
        np.from_dlpack(t)
    assert np.array_equal(np.from_dlpack(t, device="cpu"), np.zeros((4, 6)))  # a host copy


def test_cupy_arrays_import_without_a_copy(dev, cp):
    with cp.cuda.Device(dev.ctx.index):
        x = cp.arange(12, dtype=cp.float32).reshape(3, 4)
    t = accelplane.from_dlpack(x, device=dev)
    assert t.buffer.device is dev and t.buffer.ctx.ptr == x.data.ptr
    assert np.array_equal(t.get(), np.arange(12).reshape(3, 4))
    x[0, 0] = 50.0
    cp.cuda.runtime.deviceSynchronize()
    assert t.get()[0, 0] == 50.0
    assert accelplane.from_dlpack(x).buffer.device is dev, "device=None: the GPU that holds it"
    del x  # the producer's memory stays with the tensor
    ctx = Context()
    ctx.tensors.append(t)
    y = ctx.scale(t, 2.0, 0.0)
    g = ctx.graph(y)
    accelplane.GraphAllocator(dev.buffer_type).alloc_graph(g)
    be = dev.new_backend()
    be.compute(g)
    assert y.get()[0, 0] == 100.0
    be.free()


def test_unaligned_views_and_copies_import_as_copies(dev, cp):
    with cp.cuda.Device(dev.ctx.index):
        x = cp.arange(1000, dtype=cp.float32)
    view = x[3:]  # 12 bytes past the allocation: not the buffer type's 256-byte alignment
    t = accelplane.from_dlpack(view, device=dev)
    assert t.buffer.ctx.ptr != view.data.ptr and np.array_equal(t.get(), np.arange(3, 1000))
    with pytest.raises(DLPackError, match="without a copy"):
        accelplane.from_dlpack(view, device=dev, copy=False)
    c = accelplane.from_dlpack(x, device=dev, copy=True)  # a copy on the GPU
    assert c.buffer.ctx.ptr != x.data.ptr and np.array_equal(c.get(), np.arange(1000))
    h = accelplane.from_dlpack(x, device="CPU")  # asked for host memory from CuPy
    assert np.array_equal(h.get(), np.arange(1000))


def test_the_consumer_stream_waits_for_queued_work(dev, cp):
    """A long graph queued on a backend's non-blocking stream, then read on another non-blocking
    stream of CuPy's: the plugin makes that stream wait (without it, the sum is of zeros)."""
    n = 1 << 24
    ctx = Context()
    x = ctx.new_tensor(T.F32, (n,), "x")
    y = x
    for _ in range(64):
        y = ctx.scale(y, 1.0, 1.0)
    g = ctx.graph(y)
    buf = alloc_tensors([x, *g.nodes], dev.buffer_type)
    x.set(np.zeros(n))
    y.set(np.zeros(n))
    be = dev.new_backend()
    with cp.cuda.Device(dev.ctx.index):
        s = cp.cuda.Stream(non_blocking=True)
        be.graph_compute(g)  # queued; y = 64 at the end
        with s:
            total = float(cp.from_dlpack(y).sum())  # CuPy passes its current stream
    assert total == 64.0 * n
    be.free()
    del buf


def test_stream_values(dev, cp):
    ctx, t, buf = _tensor(dev.buffer_type, (8,), np.arange(8))
    with pytest.raises(DLPackError, match="0 is ambiguous"):
        t.__dlpack__(stream=0)
    for stream in (None, 1, 2, -1):
        assert t.__dlpack__(stream=stream) is not None


def test_pinned_host_memory_is_shared_as_cpu_memory(dev):
    ctx, t, buf = _tensor(dev.host_buffer_type, (8,), np.arange(8))
    assert t.__dlpack_device__() == (DLDeviceType.CPU, 0)
    a = np.from_dlpack(t)
    assert a.__array_interface__["data"][0] == buf.ctx.ptr + t.offs
    a[3] = 30
    assert t.get()[3] == 30


def test_repacked_weights_are_not_shared(dev):
    rng = np.random.default_rng(0)
    ctx = Context()
    w = ctx.new_tensor(T.Q8_0, (64, 256), "w")
    norm = ctx.new_tensor(T.F32, (256,), "norm")
    buf = alloc_tensors([w, norm], dev.buffer_type, BufferUsage.WEIGHTS)
    norm.set(rng.standard_normal(256))
    with pytest.raises(DLPackError, match="block-quantized"):
        w.__dlpack__()
    assert norm.__dlpack_device__() == (DLDeviceType.CUDA, dev.ctx.index)  # F32 keeps ggml's layout
    del buf


def test_torch_shares_device_memory(dev):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    ctx, t, buf = _tensor(dev.buffer_type, (3, 4), np.arange(12).reshape(3, 4))
    tt = torch.from_dlpack(t)
    assert tt.is_cuda and tt.data_ptr() == buf.ctx.ptr + t.offs
    tt[0, 0] = 7
    torch.cuda.synchronize()
    assert t.get()[0, 0] == 7
    src = torch.arange(6, dtype=torch.float32, device=f"cuda:{dev.ctx.index}")
    u = accelplane.from_dlpack(src, device=dev)
    assert u.buffer.ctx.ptr == src.data_ptr() and np.array_equal(u.get(), np.arange(6))


# --- the hooks' checks, which run before CuPy is touched (no GPU needed) -----------------------------
@pytest.mark.parametrize("stream", [0, -2, 1.5, "s", True])
def test_stream_values_that_are_not_cuda_streams(stream):
    from accelplane_cuda.runtime import dlpack_wait

    with pytest.raises(DLPackError, match="not a CUDA stream"):
        dlpack_wait(0, [], stream)


def test_imports_decline_memory_the_buffer_type_cannot_take():
    from accelplane.interface import DLPackMemory
    from accelplane_cuda import plugin

    class Buft:
        def __init__(self, kind):
            self.ctx = (kind, 0)

    others = [(DLDeviceType.CPU, 0, 1024), (DLDeviceType.CUDA, 1, 1024),  # another device
              (DLDeviceType.CUDA, 0, 1028), (DLDeviceType.ONE_API, 0, 1024)]  # unaligned; not CUDA
    for mem in (DLPackMemory(*m) for m in others):
        assert plugin.buft_from_dlpack(Buft("device"), None, mem, 64) is None, mem
    assert plugin.buft_from_dlpack(Buft("host"), None, DLPackMemory(DLDeviceType.CUDA, 0, 1024), 64) is None
