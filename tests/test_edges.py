"""The SDK's edges: what it refuses before a plugin sees it, on every installed device (the
built-in CPU plugin, the asynchronous test device and whatever plugins this machine has)."""

from __future__ import annotations

import accelplane
import numpy as np
import pytest
from accelplane.core.graph import Context
from accelplane.core.ops import Op, UnaryOp
from accelplane.core.types import GGMLType
from accelplane.errors import (
    BufferFreedError,
    ComputeError,
    DataError,
    DeviceError,
    ShapeError,
    TypeMismatchError,
    UnsupportedOpError,
)
from accelplane.runtime.alloc import GraphAllocator, alloc_ctx_tensors
from accelplane.runtime.registry import Registry
from accelplane.testing.plugins import cpu_and_async_registry, host_plugin
from hypothesis import given, settings
from hypothesis import strategies as st

T = GGMLType


def _devices():
    devs = list(accelplane.get_registry().devices)
    devs += [d for d in cpu_and_async_registry(1, 0).devices if d.name.startswith("ASYNC")]
    return devs


DEVICES = _devices()
IDS = [d.name for d in DEVICES]


@pytest.fixture(params=DEVICES, ids=IDS)
def dev(request):
    return request.param


# --- views ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("nb", "why"), [
    ((4, -16), "negative stride"),
    ((4, -(1 << 40)), "negative stride"),
    ((4, 1 << 40), "outside the 64 bytes"),
    ((2, 16), "not whole F32 elements"),
])  # fmt: skip
def test_a_view_outside_its_owner_is_refused_when_made(dev, nb, why):
    """The view reproductions (one read heap memory, one crashed the process) never reach a
    plugin: the view is refused when it is built."""
    ctx = Context()
    x = ctx.new_tensor("f32", (16,), "x")
    with pytest.raises(ShapeError, match=why):
        ctx.cont(ctx.view(x, (4, 4), nb))
    alloc_ctx_tensors(ctx, dev.buffer_type)  # the context is still usable
    x.set(np.arange(16))
    y = ctx.cont(ctx.view(x, (4, 2), (4, 32), 12))  # the last legal row: x[3::8] pairs
    g = ctx.graph(y)
    GraphAllocator(dev.buffer_type).alloc_graph(g)
    b = dev.new_backend()
    try:
        b.compute(g)
        np.testing.assert_array_equal(y.get(), [[3, 4, 5, 6], [11, 12, 13, 14]])
    finally:
        b.free()


@given(ne=st.lists(st.integers(1, 5), min_size=1, max_size=4),
       nb=st.lists(st.integers(-3, 40), min_size=4, max_size=4), offs=st.integers(-2, 70))  # fmt: skip
@settings(max_examples=300, deadline=None)
def test_view_validation_matches_the_byte_extent(ne, nb, offs):
    """A view is accepted exactly when every element it addresses lies inside its owner and
    its strides and offset are whole, non-negative elements (independent arithmetic)."""
    ctx = Context()
    x = ctx.new_tensor_ne("f32", 64, name="x")
    ne4 = tuple(ne) + (1,) * (4 - len(ne))
    nbb, off_b = tuple(4 * s for s in nb), 4 * offs
    last = off_b + sum((n - 1) * s for n, s in zip(ne4, nbb, strict=True))
    legal = min(nb) >= 0 and offs >= 0 and last + 4 <= 256
    try:
        v = ctx.view(x, ne4, nbb, off_b)
    except ShapeError:
        assert not legal
    else:
        assert legal and v.view_src is x and v.view_offs == off_b


def test_views_of_views_are_checked_against_the_owner():
    ctx = Context()
    x = ctx.new_tensor_ne("f32", 16, name="x")
    v = ctx.view(x, (8,), (4, 32, 32, 32), 32)
    with pytest.raises(ShapeError):
        ctx.view(v, (4,), (4, 16, 16, 16), 20)  # 32 + 20 + 16 > 64
    w = ctx.view(v, (4,), (4, 16, 16, 16), 16)
    assert w.view_src is x and w.view_offs == 48


# --- Backend.compute -----------------------------------------------------------------------------
def test_compute_after_the_buffer_was_freed_raises_buffer_freed(dev):
    ctx = Context()
    x = ctx.new_tensor("f32", (64,), "x")
    y = ctx.scale(x, 2.0)
    g = ctx.graph(y)
    w = alloc_ctx_tensors(ctx, dev.buffer_type)
    ga = GraphAllocator(dev.buffer_type)
    ga.alloc_graph(g)
    x.set(np.ones(64))
    b = dev.new_backend()
    try:
        b.compute(g)
        w.free()
        with pytest.raises(BufferFreedError, match="was freed"):
            b.compute(g)
    finally:
        b.free()
        ga.free()


def test_compute_of_unallocated_tensors_is_a_device_error(dev):
    ctx = Context()
    y = ctx.scale(ctx.new_tensor("f32", (8,), "x"), 2.0)
    b = dev.new_backend()
    try:
        with pytest.raises(DeviceError, match="not allocated"):
            b.compute(ctx.graph(y))
    finally:
        b.free()


def test_allocators_refuse_what_is_not_a_buffer_type():
    dev = accelplane.device("CPU")
    ctx = Context()
    ctx.new_tensor("f32", (8,), "x")
    b = dev.new_backend()
    for wrong in (b, dev, "CPU", None):  # a backend or device where its buffer type belongs
        with pytest.raises(TypeMismatchError, match="expected a BufferType"):
            alloc_ctx_tensors(ctx, wrong)
        with pytest.raises(TypeMismatchError, match="expected a BufferType"):
            GraphAllocator(wrong)
    with pytest.raises(TypeMismatchError, match="usage must be a BufferUsage"):
        alloc_ctx_tensors(ctx, dev.buffer_type, "weights")
    with pytest.raises(TypeMismatchError, match="takes a Context"):
        alloc_ctx_tensors([ctx], dev.buffer_type)
    with pytest.raises(TypeMismatchError, match="takes Tensors"):
        accelplane.alloc_tensors([ctx], dev.buffer_type)
    assert ctx.tensors[0].buffer is None, "nothing was placed"
    b.free()


def test_compute_refuses_a_node_the_device_declines(dev):
    """Backend.compute honours supports_op (the Scheduler is the route that falls back)."""
    ctx = Context()
    x = ctx.new_tensor("f32", (8, 64), "x")
    nodes = [ctx.unary(x, u) for u in UnaryOp] + [ctx.mul_mat(ctx.new_tensor("q4_0", (4, 64), "w"), x)]
    declined = [n for n in nodes if not dev.supports_op(n)]
    if not declined:
        pytest.skip(f"{dev.name} supports every unary op and q4_0 MUL_MAT")
    n = declined[0]
    g = ctx.graph(n)
    alloc_ctx_tensors(ctx, dev.buffer_type)
    GraphAllocator(dev.buffer_type).alloc_graph(g)
    b = dev.new_backend()
    try:
        with pytest.raises(UnsupportedOpError, match=rf"{dev.name} does not support .*Scheduler"):
            b.compute(g)
    finally:
        b.free()


def _plugin_registry(**hooks) -> Registry:
    r = Registry()
    assert r.register(host_plugin("EDGE", **hooks), "edge") is not None, r.failures
    return r


def test_a_declined_quantized_product_never_reaches_the_plugin():
    seen = []

    def supports_op(device, op):
        return not (op.op is Op.MUL_MAT and op.src[0].type.is_quantized)

    def graph_compute(backend, graph):
        seen.append(graph)

    dev = _plugin_registry(supports_op=supports_op, graph_compute=graph_compute).device("EDGE")
    ctx = Context()
    y = ctx.mul_mat(ctx.new_tensor("q4_0", (4, 64), "w"), ctx.new_tensor("f32", (2, 64), "x"))
    g = ctx.graph(y)
    alloc_ctx_tensors(ctx, dev.buffer_type)
    GraphAllocator(dev.buffer_type).alloc_graph(g)
    b = dev.new_backend()
    with pytest.raises(UnsupportedOpError, match=r"MUL_MAT of Q4_0, F32 -> F32 ne=\[4, 2, 1, 1\]"):
        b.compute(g)
    assert not seen


def test_a_raw_exception_inside_a_plugin_becomes_compute_error():
    def graph_compute(backend, graph):
        raise KeyError("RELU")

    dev = _plugin_registry(graph_compute=graph_compute).device("EDGE")
    ctx = Context()
    y = ctx.relu(ctx.new_tensor("f32", (4,), "x"))
    g = ctx.graph(y)
    alloc_ctx_tensors(ctx, dev.buffer_type)
    GraphAllocator(dev.buffer_type).alloc_graph(g)
    with pytest.raises(ComputeError, match=r"'edge' failed on graph #\d+ \(1 nodes\): KeyError: 'RELU'"):
        dev.new_backend().compute(g)


# --- Tensor.set ----------------------------------------------------------------------------------
def _tensors(*specs):
    ctx = Context()
    ts = [ctx.new_tensor(t, shape, name) for t, shape, name in specs]
    alloc_ctx_tensors(ctx, accelplane.device("CPU").buffer_type)
    return ts


@pytest.mark.parametrize("qt", ["q4_0", "q8_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_set_refuses_non_finite_values_for_quantized_types(qt, bad):
    (q,) = _tensors((qt, (2, 256), "w"))
    q.set(np.ones((2, 256)))
    before = q.get_bytes()
    v = np.ones((2, 256), np.float32)
    v[1, 37] = bad
    with pytest.raises(DataError, match=r"'w' .*at ggml index \[37, 1, 0, 0\] cannot be quantized"):
        q.set(v)
    np.testing.assert_array_equal(q.get_bytes(), before)  # nothing was written


@given(st.lists(st.one_of(st.integers(-(2**40), 2**40), st.floats(allow_nan=True, allow_infinity=True)),
                min_size=4, max_size=4))  # fmt: skip
@settings(max_examples=200, deadline=None)
def test_set_of_int32_stores_exactly_or_refuses(values):
    (t,) = _tensors(("i32", (4,), "ids"))
    exact = all(
        isinstance(v, int) or (np.isfinite(v) and float(v).is_integer()) for v in values
    ) and all(-(2**31) <= v <= 2**31 - 1 for v in values)
    big = any(isinstance(v, int) and abs(v) > 2**53 for v in values)  # keep them exact
    try:
        t.set(np.array(values, dtype=object if big else None))
    except DataError:
        assert not exact
    else:
        assert exact
        assert t.get().tolist() == [int(v) for v in values]


@pytest.mark.parametrize("value", [["a", "b", "c"], [1 + 2j, 0, 0], [[1, 2], [3]], [object()] * 3])
def test_set_of_non_numbers_is_a_type_error(value):
    (t,) = _tensors(("f32", (3,), "f"))
    with pytest.raises(TypeMismatchError, match="'f'"):
        t.set(value)
    assert isinstance(TypeMismatchError("x"), TypeError)


def test_set_of_floats_follows_numpy_conversion():
    f32, f16 = _tensors(("f32", (3,), "a"), ("f16", (3,), "b"))
    f16.set([1e6, -1e6, 0.1])
    assert f16.get().tolist() == [np.inf, -np.inf, np.float16(0.1)]
    f32.set([np.nan, np.inf, True])
    got = f32.get()
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == 1.0
