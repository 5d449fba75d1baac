"""DLPack exchange (accelplane.runtime.dlpack, docs/interop.md) with numpy as the independent side:
zero-copy exports and imports share one address (numpy's ``__array_interface__`` against the
buffer's), writes are seen both ways, views keep their strides, capsules follow dlpack.h (read
here with ctypes, not with the code under test), lifetimes outlast the tensor's context, and every
refusal is a typed error. The asynchronous test device stands in for device memory: not host
visible, its streams late."""

from __future__ import annotations

import ctypes
import gc
import weakref

import accelplane as ap
import ml_dtypes
import numpy as np
import pytest
from accelplane.core.graph import Context
from accelplane.core.types import GGMLType
from accelplane.errors import (
    AccelplaneError,
    BufferFreedError,
    DLPackError,
    ShapeError,
    TypeMismatchError,
)
from accelplane.interface import DLDeviceType, hookimpl
from accelplane.runtime.alloc import alloc_tensors
from accelplane.runtime.registry import Registry
from accelplane.testing import asyncdev
from accelplane.testing.plugins import host_plugin
from hypothesis import given, settings
from hypothesis import strategies as st

T = GGMLType
NP = {T.F32: np.float32, T.F16: np.float16, T.I32: np.int32, T.BF16: ml_dtypes.bfloat16}


@pytest.fixture(scope="module")
def cpu():
    return ap.device("CPU")


def _tensor(dev, type_, shape, values=None, name="t"):
    ctx = Context()
    t = ctx.new_tensor(type_, shape, name)
    buf = alloc_tensors([t], dev.buffer_type)
    if values is not None:
        t.set(values)
    return ctx, t, buf


def _addr(t) -> int:
    """The host address of the tensor's byte 0, from the buffer's own host array."""
    return t.buffer.host_array.ctypes.data + t.offs


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _values(rng, type_, shape):
    if type_ == T.I32:
        return rng.integers(-1000, 1000, shape).astype(np.int32)
    return rng.standard_normal(shape).astype(NP[type_])


# --- capsules as dlpack.h lays them out --------------------------------------------------------------
class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]  # fmt: skip


class Versioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", DLTensor)]  # fmt: skip


_name = ctypes.pythonapi.PyCapsule_GetName
_name.restype, _name.argtypes = ctypes.c_char_p, [ctypes.py_object]
_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_pointer.restype, _pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


def _versioned(cap) -> Versioned:
    assert _name(cap) == b"dltensor_versioned"
    return Versioned.from_address(_pointer(cap, b"dltensor_versioned"))


# --- export: Tensor.__dlpack__ -------------------------------------------------------------------------
@pytest.mark.parametrize("type_", [T.F32, T.F16, T.I32], ids=str)
def test_numpy_shares_the_tensor_memory(cpu, type_):
    rng = np.random.default_rng(1)
    v = _values(rng, type_, (3, 5))
    ctx, t, buf = _tensor(cpu, type_, (3, 5), v)
    assert t.__dlpack_device__() == (DLDeviceType.CPU, 0)
    a = np.from_dlpack(t)
    assert _ptr(a) == _addr(t) and a.dtype == NP[type_] and a.shape == (3, 5)
    assert np.array_equal(a, v)
    a[1, 2] = 7  # numpy → accelplane
    assert t.get()[1, 2] == 7
    t.set(np.zeros((3, 5)))  # accelplane → numpy
    assert not a.any()


def test_bf16_travels_as_dlpack_bfloat(cpu):
    """numpy has no DLPack bfloat16: the capsule's type code is read directly, and an accelplane
    import of it shares the memory and holds the values ml_dtypes rounds to."""
    v = np.random.default_rng(2).standard_normal((4, 6))
    ctx, t, buf = _tensor(cpu, T.BF16, (4, 6), v)
    cap = t.__dlpack__(max_version=(1, 0))
    dl = _versioned(cap).dl_tensor
    assert (dl.code, dl.bits, dl.lanes) == (4, 16, 1)  # kDLBfloat
    assert dl.data == _addr(t)
    u = ap.from_dlpack(t, device=cpu)
    assert _addr(u) == _addr(t)
    assert np.array_equal(u.get().astype(np.float64), v.astype(ml_dtypes.bfloat16).astype(np.float64))


def test_views_export_with_their_strides(cpu):
    x = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)
    ctx, t, buf = _tensor(cpu, T.F32, (6, 8), x)
    rows = Context().view(t, (8, 2), t.nb, 3 * t.nb[1])  # rows 3..4
    a = np.from_dlpack(rows)
    assert _ptr(a) == _addr(t) + 3 * 8 * 4 and np.array_equal(a, x[3:5])
    tr = Context().transpose(t)
    b = np.from_dlpack(tr)
    assert _ptr(b) == _addr(t) and b.strides == (4, 32) and np.array_equal(b, x.T)
    cols = Context().view(t, (3, 6), (4, 32, 192, 192), 2 * 4)  # columns 2..4 of every row
    c = np.from_dlpack(cols)
    assert c.strides == (32, 4) and np.array_equal(c, x[:, 2:5])
    c[0, 0] = -1
    assert t.get()[0, 2] == -1


def test_capsule_versions_and_flags(cpu):
    ctx, t, buf = _tensor(cpu, T.F32, (4,), np.arange(4))
    assert _name(t.__dlpack__()) == b"dltensor"  # no max_version: the legacy struct
    assert _name(t.__dlpack__(max_version=(0, 8))) == b"dltensor"
    cap = t.__dlpack__(max_version=(1, 3))
    m = _versioned(cap)
    assert m.major == 1 and m.flags == 0
    assert (m.dl_tensor.device.device_type, m.dl_tensor.ndim) == (1, 1)
    assert [m.dl_tensor.shape[0], m.dl_tensor.strides[0]] == [4, 1]  # strides in elements
    cap2 = t.__dlpack__(max_version=(1, 0), copy=True)
    copied = _versioned(cap2)
    assert copied.flags & 2 and copied.dl_tensor.data != _addr(t)  # DLPACK_FLAG_BITMASK_IS_COPIED


def test_copy_true_gives_independent_memory(cpu):
    ctx, t, buf = _tensor(cpu, T.F32, (2, 3), np.ones((2, 3)))
    a = np.from_dlpack(t, copy=True)
    assert _ptr(a) != _addr(t) and np.array_equal(a, np.ones((2, 3)))
    a[:] = 5
    assert np.array_equal(t.get(), np.ones((2, 3)))
    b = np.from_dlpack(t, copy=False)
    assert _ptr(b) == _addr(t)


def test_scalar_and_empty_tensors(cpu):
    ctx = Context()
    s = ctx.new_tensor(T.F32, (), "s")
    e = ctx.new_tensor(T.F32, (0, 3), "e")
    buf = alloc_tensors([s, e], cpu.buffer_type)
    s.set(np.float32(2.5))
    a = np.from_dlpack(s)
    assert a.shape == () and a == 2.5 and _ptr(a) == _addr(s)
    assert np.from_dlpack(e).shape == (0, 3)
    assert ap.from_dlpack(np.zeros((0, 2), np.float32), device=cpu).shape == (0, 2)
    del buf


@pytest.mark.parametrize("type_", [T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K], ids=str)
def test_quantized_tensors_are_refused(cpu, type_):
    ctx, t, buf = _tensor(cpu, type_, (2, 256))
    with pytest.raises(DLPackError, match=f"{type_.name}, a block-quantized type") as e:
        np.from_dlpack(t)
    assert isinstance(e.value, BufferError)  # what the array API asks of __dlpack__
    with pytest.raises(DLPackError):
        t.__dlpack__(max_version=(1, 0), copy=True)


def test_a_freed_buffer_is_not_exported(cpu):
    ctx, t, buf = _tensor(cpu, T.F32, (4,), np.arange(4))
    buf.free()
    with pytest.raises(BufferFreedError, match="was freed"):
        t.__dlpack__()
    with pytest.raises(BufferFreedError):
        t.__dlpack_device__()


def test_unallocated_tensor_is_refused():
    t = Context().new_tensor(T.F32, (4,), "loose")
    with pytest.raises(AccelplaneError, match="'loose' is not allocated"):
        t.__dlpack__()


def test_export_arguments_are_checked(cpu):
    ctx, t, buf = _tensor(cpu, T.F32, (4,), np.arange(4))
    with pytest.raises(DLPackError, match="stream must be None for CPU"):
        t.__dlpack__(stream=5)
    with pytest.raises(DLPackError, match="cannot be exported to DLPack CUDA:0"):
        t.__dlpack__(dl_device=(DLDeviceType.CUDA, 0))
    with pytest.raises(DLPackError, match="dl_device must be"):
        t.__dlpack__(dl_device="cpu")
    with pytest.raises(TypeMismatchError, match="max_version"):
        t.__dlpack__(max_version=1)
    with pytest.raises(TypeMismatchError, match="copy must be"):
        t.__dlpack__(copy="yes")
    assert _ptr(np.from_dlpack(t, device="cpu")) == _addr(t)  # dl_device=(CPU, 0): its own memory


# --- lifetimes ---------------------------------------------------------------------------------------------
def test_the_array_outlives_the_tensor_and_its_context(cpu):
    ctx, t, buf = _tensor(cpu, T.F32, (1000,), np.arange(1000))
    a = np.from_dlpack(t)
    ref = weakref.ref(buf)
    del ctx, t, buf
    gc.collect()
    assert ref() is not None, "the export keeps the buffer"
    a += 1  # the memory is still the buffer's, and still there
    assert np.array_equal(a, np.arange(1, 1001))
    del a
    gc.collect()
    assert ref() is None, "the buffer goes with the last array over it"


def test_free_waits_for_the_exports(cpu):
    ctx, t, buf = _tensor(cpu, T.F32, (64,), np.arange(64))
    a = np.from_dlpack(t)
    b = np.from_dlpack(t)
    buf.free()
    assert buf.freed and buf.ctx is not None, "the plugin's buffer_free waits for the exports"
    with pytest.raises(BufferFreedError):
        t.get()
    a[0] = 9
    del a
    gc.collect()
    assert buf.ctx is not None and b[0] == 9
    del b
    gc.collect()
    assert buf.ctx is None, "the last export released the memory"


def test_an_unconsumed_capsule_releases_the_buffer(cpu):
    ctx, t, buf = _tensor(cpu, T.F32, (8,), np.arange(8))
    cap = t.__dlpack__(max_version=(1, 0))
    buf.free()
    assert buf.ctx is not None
    del cap
    gc.collect()
    assert buf.ctx is None


# --- memory other libraries cannot address: the asynchronous test device -------------------------------
@pytest.fixture
def adev(monkeypatch):
    monkeypatch.setenv("ACCELPLANE_ASYNCDEV_NDEV", "1")
    monkeypatch.setenv("ACCELPLANE_TEST_DELAY_US", "50000")  # 50 ms before each queued task
    reg = Registry()
    assert reg.register(asyncdev, "asynctest") is not None, reg.failures
    return reg.devices_of("asynctest")[0]


def test_device_memory_exports_a_host_copy(adev):
    v = np.arange(12, dtype=np.float32).reshape(3, 4)
    ctx, t, buf = _tensor(adev, T.F32, (3, 4), v)
    assert t.__dlpack_device__() == (DLDeviceType.CPU, 0)
    a = np.from_dlpack(t)
    assert np.array_equal(a, v)
    a[0, 0] = 100
    assert t.get()[0, 0] == 0, "a copy"
    cap = t.__dlpack__(max_version=(1, 0))
    assert _versioned(cap).flags & 2
    with pytest.raises(DLPackError, match="without a copy") as e:
        np.from_dlpack(t, copy=False)
    assert isinstance(e.value, BufferError)
    v2 = np.from_dlpack(Context().transpose(t))
    assert np.array_equal(v2, v.T) and v2.flags.c_contiguous


def test_cpu_repack_memory_exports_a_host_copy(cpu):
    """The CPU's repack buffer type is not host memory (its bytes are not ggml's layout): an F32
    tensor in it exports as a copy of its values, and a Q4_0 one is refused like any block type."""
    (buft,) = [b for b in cpu.extra_buffer_types if b.name == "CPU_REPACK"]
    v = np.arange(12, dtype=np.float32).reshape(3, 4)
    ctx = Context()
    t = ctx.new_tensor(T.F32, (3, 4), "t")
    q = ctx.new_tensor(T.Q4_0, (8, 32), "q")
    buf = alloc_tensors([t, q], buft)
    t.set(v)
    a = np.from_dlpack(t)
    assert np.array_equal(a, v) and not np.shares_memory(a, buf.ctx)
    with pytest.raises(DLPackError, match="without a copy"):
        np.from_dlpack(t, copy=False)
    with pytest.raises(DLPackError):
        q.__dlpack__()


def test_export_waits_for_queued_work(adev):
    """The array API: host memory is synchronized by the producer. A graph queued on a late
    stream is done before the values are read (without the wait they would be the inputs')."""
    ctx = Context()
    x = ctx.new_tensor(T.F32, (256,), "x")
    y = ctx.scale(x, 2.0, 1.0)
    g = ctx.graph(y)
    buf = alloc_tensors([x, y], adev.buffer_type)
    x.set(np.arange(256))
    be = adev.new_backend()
    be.graph_compute(g)  # queued, 50 ms late
    assert np.array_equal(np.from_dlpack(y), np.arange(256) * 2.0 + 1.0)
    be.free()
    del buf


def test_import_into_device_memory_copies(adev):
    x = np.arange(10, dtype=np.float32)
    t = ap.from_dlpack(x, device=adev)
    assert t.buffer.device is adev and np.array_equal(t.get(), x)
    with pytest.raises(DLPackError, match="cannot be imported into ASYNC0 without a copy"):
        ap.from_dlpack(x, device=adev, copy=False)


def test_hooks_of_a_newer_minor_are_not_called_for_an_older_plugin():
    called = []
    old = host_plugin("OLDHOST", buft_from_dlpack=lambda buft, buffer, memory, size: called.append(1))
    old.api_version = hookimpl(lambda: (1, 1))
    reg = Registry()
    p = reg.register(old, "oldhost")
    assert "buft_from_dlpack" not in p.fn
    t = ap.from_dlpack(np.arange(4, dtype=np.float32), device=reg.device("OLDHOST"))
    assert not called and np.array_equal(t.get(), np.arange(4))


# --- import: from_dlpack ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32], ids=lambda d: np.dtype(d).name)
def test_numpy_arrays_import_without_a_copy(cpu, dtype):
    x = np.arange(24).reshape(2, 3, 4).astype(dtype)
    t = ap.from_dlpack(x, device=cpu, name="x")
    assert t.name == "x" and t.shape == (2, 3, 4) and t.type == {np.float32: T.F32, np.float16: T.F16,
                                                                 np.int32: T.I32}[dtype]  # fmt: skip
    assert _addr(t) == _ptr(x)
    x[1, 2, 3] = 99
    assert t.get()[1, 2, 3] == 99
    t.set(np.zeros((2, 3, 4)))
    assert not x.any()


def test_the_import_keeps_the_producer_alive(cpu):
    x = np.arange(1 << 16, dtype=np.float32)
    t = ap.from_dlpack(x)  # device=None: host memory lands in the CPU device
    assert t.buffer.device is cpu
    ref = weakref.ref(x.base if x.base is not None else x)
    del x
    gc.collect()
    assert ref() is not None
    assert np.array_equal(t.get(), np.arange(1 << 16))
    t.buffer.free()
    del t
    gc.collect()
    assert ref() is None, "the producer's deleter ran once accelplane let go"


def test_strided_imports(cpu):
    x = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)
    t = ap.from_dlpack(x.T)  # positive strides: zero-copy, a transposed tensor
    assert _addr(t) == _ptr(x) and t.is_transposed() and np.array_equal(t.get(), x.T)
    s = ap.from_dlpack(x[1::2, 3:7])
    assert _addr(s) == _ptr(x[1::2, 3:7]) and np.array_equal(s.get(), x[1::2, 3:7])
    r = ap.from_dlpack(x[:, ::-1])  # negative strides: a contiguous copy
    assert _addr(r) != _ptr(x) and r.is_contiguous() and np.array_equal(r.get(), x[:, ::-1])
    with pytest.raises(DLPackError, match="strides are negative or zero"):
        ap.from_dlpack(x[::-1], copy=False)
    b = ap.from_dlpack(np.broadcast_to(np.arange(4, dtype=np.float32), (3, 4)))  # read-only
    assert np.array_equal(b.get(), np.broadcast_to(np.arange(4), (3, 4)))
    ro = np.arange(4, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(DLPackError, match="read-only"):
        ap.from_dlpack(ro, copy=False)


def test_copy_true_imports_a_copy(cpu):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = ap.from_dlpack(x, copy=True)
    assert _addr(t) != _ptr(x) and np.array_equal(t.get(), x)
    x[:] = 0
    assert t.get().any()


def test_accelplane_to_accelplane(cpu, adev):
    v = np.random.default_rng(3).standard_normal((5, 7)).astype(np.float32)
    ctx, t, buf = _tensor(cpu, T.F32, (5, 7), v)
    view = Context().view(t, (7, 2), t.nb, 2 * t.nb[1])
    u = ap.from_dlpack(view)
    assert _addr(u) == _addr(t) + 2 * 7 * 4 and np.array_equal(u.get(), v[2:4])
    w = ap.from_dlpack(t, device=adev)  # CPU memory into the test device: a copy
    assert np.array_equal(w.get(), v)
    back = ap.from_dlpack(w, device=cpu)  # the test device's host copy, imported without another
    assert np.array_equal(back.get(), v)


def test_imported_tensors_compute(cpu):
    """A graph reads a numpy array in place and writes its result into another one."""
    x = np.random.default_rng(4).standard_normal((4, 16)).astype(np.float32)
    out = np.zeros((4, 16), np.float32)
    ctx = Context()
    a = ap.from_dlpack(x, ctx=ctx, name="a")
    y = ap.from_dlpack(out, ctx=ctx, name="y")
    assert a in ctx.tensors and y in ctx.tensors
    g = ctx.graph(ctx.cpy(ctx.scale(a, 3.0, 0.5), y))
    assert ap.alloc_ctx_tensors(ctx, cpu.buffer_type) is None, "both already have memory"
    ap.GraphAllocator(cpu.buffer_type).alloc_graph(g)
    cpu.new_backend().compute(g)
    np.testing.assert_allclose(out, x.astype(np.float64) * 3.0 + 0.5, rtol=1e-6)


@pytest.mark.parametrize(("value", "error", "match"), [
    ([1.0, 2.0], TypeMismatchError, "a list is not a DLPack producer"),
    (np.arange(3, dtype=np.float64), DLPackError, "DLPack type float64 has no accelplane type"),
    (np.arange(3, dtype=np.int64), DLPackError, "DLPack type int64"),
    (np.arange(3, dtype=np.uint8), DLPackError, "DLPack type uint8"),
    (np.zeros(3, dtype=bool), DLPackError, "DLPack type bool8"),
    (np.zeros(3, dtype=np.complex64), DLPackError, "DLPack type complex64"),
    (np.zeros((1, 2, 1, 2, 1), np.float32), ShapeError, "5 dimensions"),
])  # fmt: skip
def test_bad_imports_raise_typed_errors(value, error, match):
    with pytest.raises(error, match=match):
        ap.from_dlpack(value)


def test_import_arguments_are_checked(cpu):
    x = np.arange(3, dtype=np.float32)
    with pytest.raises(TypeMismatchError, match="device must be"):
        ap.from_dlpack(x, device=3)
    with pytest.raises(AccelplaneError, match="no device named 'NOPE'"):
        ap.from_dlpack(x, device="NOPE")
    with pytest.raises(TypeMismatchError, match="copy must be"):
        ap.from_dlpack(x, copy=1)
    with pytest.raises(TypeMismatchError, match="ctx must be a Context"):
        ap.from_dlpack(x, ctx=object())


class _Producer:
    """A producer that hands out a capsule that is not one, or one already consumed."""

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, **kw):
        return self.capsule


def test_malformed_producers_are_refused():
    with pytest.raises(DLPackError, match="returned a int, not a capsule"):
        ap.from_dlpack(_Producer(3))
    cap = np.arange(3, dtype=np.float32).__dlpack__(max_version=(1, 0))
    np.from_dlpack(_Producer(cap))  # numpy consumes it
    with pytest.raises(DLPackError, match="already consumed"):
        ap.from_dlpack(_Producer(cap))


def test_a_capsule_of_another_major_version_is_released_once():
    x = np.arange(5, dtype=np.float32)
    ref = weakref.ref(x)
    cap = x.__dlpack__(max_version=(1, 0))
    _versioned(cap).major = 2
    del x
    with pytest.raises(DLPackError, match="version 2.*reads major version 1"):
        ap.from_dlpack(_Producer(cap))
    gc.collect()
    assert ref() is None, "the producer's deleter ran"
    del cap  # consumed: its own destructor does not run the deleter again
    gc.collect()


class _LegacyProducer:
    """A producer from before the array API's 2023.12 keywords."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self):
        return self.a.__dlpack__()


def test_a_producer_without_max_version_gives_a_legacy_capsule(cpu):
    x = np.arange(6, dtype=np.float32)
    t = ap.from_dlpack(_LegacyProducer(x))
    assert _addr(t) == _ptr(x)
    with pytest.raises(DLPackError, match="does not take the array API's dl_device"):
        ap.from_dlpack(_LegacyProducer(x), copy=False)


# --- any shape and stride ----------------------------------------------------------------------------------
@st.composite
def strided_arrays(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    base = np.arange(int(np.prod(shape)) * 4, dtype=np.float32).reshape(*shape[:-1], shape[-1] * 4)
    steps = tuple(draw(st.sampled_from([1, 2, -1])) for _ in range(ndim))
    x = base[tuple(slice(None, None, s) for s in steps)]
    perm = draw(st.permutations(range(ndim)))
    return np.transpose(x, perm)


@settings(max_examples=60, deadline=None)
@given(strided_arrays())
def test_any_strided_array_round_trips(x):
    t = ap.from_dlpack(x)
    assert t.shape == x.shape and np.array_equal(t.get(), x)
    shared = all(s > 0 or n == 1 for s, n in zip(x.strides, x.shape, strict=True))
    assert (_addr(t) == _ptr(x)) == shared
    a = np.from_dlpack(t)
    assert np.array_equal(a, x) and _ptr(a) == _addr(t)
    if shared:  # the same strides (an extent of one has any)
        assert [s for s, n in zip(a.strides, a.shape, strict=True) if n > 1] == [
            s for s, n in zip(x.strides, x.shape, strict=True) if n > 1]  # fmt: skip


def test_torch_cpu_shares_memory(cpu):
    torch = pytest.importorskip("torch")
    ctx, t, buf = _tensor(cpu, T.F32, (3, 4), np.arange(12).reshape(3, 4))
    tt = torch.from_dlpack(t)
    assert tt.data_ptr() == _addr(t)
    tt[0, 0] = 5
    assert t.get()[0, 0] == 5
    u = ap.from_dlpack(torch.arange(6, dtype=torch.float32))
    assert np.array_equal(u.get(), np.arange(6))
