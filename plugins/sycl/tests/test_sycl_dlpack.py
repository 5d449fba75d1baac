"""DLPack with the SYCL plugin: USM device memory crosses to dpctl/dpnp arrays (dpnp.tensor, the
home of dpctl.tensor since dpctl 0.21) without a copy, both ways, when the logical device uses the
platform's default context; host USM is shared as CPU memory; logical devices with contexts of
their own export copies. Skipped, with the reason, where dpnp or a SYCL device is absent."""

from __future__ import annotations

import ctypes
import time

import accelplane
import accelplane.cpu.plugin as cpu_plugin
import accelplane_sycl.plugin as sycl_plugin
import numpy as np
import pytest
from accelplane.core.graph import Context
from accelplane.core.types import GGMLType
from accelplane.errors import DLPackError
from accelplane.interface import DLDeviceType
from accelplane.runtime.alloc import alloc_tensors
from accelplane.runtime.registry import Registry

T = GGMLType
dpt = pytest.importorskip("dpnp.tensor", reason="dpnp (dpctl's tensor) is not installed")


def _registry(monkeypatch, devices: str | None) -> Registry:
    if devices is None:
        monkeypatch.delenv("ACCELPLANE_SYCL_DEVICES", raising=False)
    else:
        monkeypatch.setenv("ACCELPLANE_SYCL_DEVICES", devices)
    r = Registry()
    r.register(sycl_plugin, "sycl")
    r.register(cpu_plugin, "cpu")
    if "sycl" not in r.plugins:
        why = [f.reason for f in r.failures if f.name == "sycl"]
        pytest.skip(f"no SYCL device: {why[0] if why else 'plugin not registered'}")
    return r


@pytest.fixture
def dev(monkeypatch):
    d = _registry(monkeypatch, None).devices_of("sycl")[0]
    if d.runtime.dlpack_id is None:
        pytest.skip(f"{d.name}: the platform's default context is not this device's alone")
    return d


def _usm(a) -> int:
    return a.__sycl_usm_array_interface__["data"][0]


def _tensor(buft, shape, values):
    ctx = Context()
    t = ctx.new_tensor(T.F32, shape, "t")
    buf = alloc_tensors([t], buft)
    t.set(values)
    return ctx, t, buf


def test_usm_device_memory_goes_to_dpnp_without_a_copy(dev):
    v = np.arange(24, dtype=np.float32).reshape(4, 6)
    ctx, t, buf = _tensor(dev.buffer_type, (4, 6), v)
    assert t.__dlpack_device__() == (DLDeviceType.ONE_API, dev.runtime.dev.get_device_id())
    a = dpt.from_dlpack(t)
    assert _usm(a) == buf.ctx.ptr + t.offs and a.usm_type == "device"
    assert np.array_equal(dpt.asnumpy(a), v)
    a[1, 2] = -5.0  # dpnp → accelplane
    assert t.get()[1, 2] == -5.0
    t.set(np.zeros((4, 6)))  # accelplane → dpnp
    assert not dpt.asnumpy(a).any()
    rows = Context().view(t, (6, 2), t.nb, t.nb[1])
    r = dpt.from_dlpack(rows)
    assert _usm(r) == buf.ctx.ptr + t.nb[1] and r.shape == (2, 6)
    with pytest.raises(RuntimeError, match="Unsupported device"):  # numpy reads host memory only
        np.from_dlpack(t)
    assert np.array_equal(np.from_dlpack(t, device="cpu"), np.zeros((4, 6)))  # a host copy


def test_dpnp_arrays_import_without_a_copy(dev):
    q = dev.runtime.queue
    x = dpt.reshape(dpt.arange(12, dtype="f4", sycl_queue=q), (3, 4))
    t = accelplane.from_dlpack(x, device=dev)
    assert t.buffer.device is dev and t.buffer.ctx.ptr == _usm(x)
    assert np.array_equal(t.get(), np.arange(12).reshape(3, 4))
    x[0, 0] = 50.0
    assert t.get()[0, 0] == 50.0
    ptr = _usm(x)
    del x  # the producer's memory stays with the tensor
    be = dev.new_backend()
    ctx = Context()
    ctx.tensors.append(t)
    y = ctx.scale(t, 2.0, 0.0)
    g = ctx.graph(y)
    accelplane.GraphAllocator(dev.buffer_type).alloc_graph(g)
    be.compute(g)
    assert t.buffer.ctx.ptr == ptr and y.get()[0, 0] == 100.0
    be.free()
    c = accelplane.from_dlpack(dpt.arange(4, dtype="f4", sycl_queue=q), device="CPU")  # via the host
    assert np.array_equal(c.get(), np.arange(4))


def _spin(backend, ms: float) -> None:
    """Queue a busy kernel of about ``ms`` ms on the backend's queue."""
    bs = backend.ctx
    k = bs.dev.kernel("k_spin")
    n = 200_000
    t0 = time.perf_counter()
    bs.queue.submit_async(k, [bs.dev.spin_mem(), ctypes.c_uint64(n)], [1]).wait()
    per_ms = n / max((time.perf_counter() - t0) * 1e3, 1e-3)
    bs.last = bs.queue.submit_async(k, [bs.dev.spin_mem(), ctypes.c_uint64(int(ms * per_ms))], [1])


def test_export_waits_for_queued_work(dev):
    ctx = Context()
    x = ctx.new_tensor(T.F32, (4096,), "x")
    y = ctx.scale(x, 2.0, 1.0)
    g = ctx.graph(y)
    buf = alloc_tensors([x, y], dev.buffer_type)
    be = dev.new_backend()
    x.set(np.ones(4096))
    be.compute(g)  # its kernels built
    x.set(np.arange(4096))
    _spin(be, 300)  # the graph runs after ~300 ms of other work on the queue
    be.graph_compute(g)
    a = dpt.from_dlpack(y)
    assert np.array_equal(dpt.asnumpy(a), np.arange(4096) * 2.0 + 1.0)
    be.free()
    del buf


def test_host_usm_is_shared_as_cpu_memory(dev):
    buft = dev.host_buffer_type
    ctx, t, buf = _tensor(buft, (8,), np.arange(8))
    assert t.__dlpack_device__() == (DLDeviceType.CPU, 0)
    a = np.from_dlpack(t)
    assert a.__array_interface__["data"][0] == buf.ctx.ptr + t.offs
    a[3] = 30
    assert t.get()[3] == 30


def test_logical_devices_with_own_contexts_export_copies(monkeypatch):
    d0 = _registry(monkeypatch, "0,0").devices_of("sycl")[0]
    assert d0.runtime.dlpack_id is None
    ctx, t, buf = _tensor(d0.buffer_type, (5,), np.arange(5))
    assert t.__dlpack_device__() == (DLDeviceType.CPU, 0)
    assert np.array_equal(np.from_dlpack(t), np.arange(5))
    with pytest.raises(DLPackError, match="without a copy"):
        np.from_dlpack(t, copy=False)
    x = dpt.arange(5, dtype="f4")
    u = accelplane.from_dlpack(x, device=d0)  # not this context's pointer: a copy
    assert u.buffer.ctx.ptr != _usm(x) and np.array_equal(u.get(), np.arange(5))
