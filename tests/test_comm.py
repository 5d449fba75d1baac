"""All-reduce (accelplane.parallel.comm): the canonical order, results against the float64 oracle,
butterfly and ring byte-identical in F32, compression, the plugin path and its fallback,
ordering under random delays, typed errors, and the benchmark.

Devices: several backends of the one CPU device (synchronous, no events, no async copies:
every SDK fallback), the asynchronous test device (worker-thread streams, random delays,
events, push-style copies that run on the source stream, its own comm), and a wrapper of it
("pull") whose copies run on the destination stream after waiting for the source — the
style that exposes a missing barrier — and whose comm declines every call.
"""

from __future__ import annotations

import types

import ml_dtypes
import numpy as np
import pytest
from accelplane import Context, GGMLType
from accelplane.cpu import plugin as cpu_plugin
from accelplane.errors import (
    AccelplaneError,
    BufferFreedError,
    DeviceError,
    ShapeError,
    TypeMismatchError,
    UnsupportedOpError,
)
from accelplane.interface import HOOK_NAMES, hookimpl
from accelplane.parallel import comm as comm_mod
from accelplane.parallel.comm import (
    AllReduce,
    allreduce,
    bench_allreduce,
    canonical_sum,
    free_shared,
    merge_order,
)
from accelplane.runtime.alloc import alloc_tensors
from accelplane.runtime.backend import Backend, Device
from accelplane.runtime.registry import Registry
from accelplane.testing import asyncdev

T = GGMLType
NS = [2, 3, 4, 5]
SHAPE = (37, 29)
REPS = 20
UNIT = {T.F32: 2.0**-24, T.F16: 2.0**-11, T.BF16: 2.0**-8}  # unit roundoff
NP = {T.F32: np.float32, T.F16: np.float16, T.BF16: ml_dtypes.bfloat16}
WIRE = {"f16": T.F16, "bf16": T.BF16}


# --- devices ---------------------------------------------------------------------------------------
def pull_plugin(declined: list) -> types.ModuleType:
    """asyncdev with pull-style copies (wait for the source's prior work, then copy on the
    destination stream, as separate tasks) and a comm that declines every call."""
    m = types.ModuleType("asyncdev_pull")
    for h in HOOK_NAMES:
        if hasattr(asyncdev, h):
            setattr(m, h, getattr(asyncdev, h))

    def cpy_tensor_async(backend_src, backend_dst, src, dst):
        if not (asyncdev._is_ours(src.buffer) and asyncdev._is_ours(dst.buffer)):
            return False
        s, d = asyncdev._bytes(src), asyncdev._bytes(dst)
        done = asyncdev.EventState()
        backend_src.ctx.stream.submit(lambda: done.complete(1), "mark")
        backend_dst.ctx.stream.submit(lambda: done.wait(1), "wait-src")
        backend_dst.ctx.stream.submit(lambda: d.__setitem__(Ellipsis, s), "pull")
        return True

    def comm_allreduce_tensor(comm, tensors):
        declined.append(len(tensors))
        return False

    m.cpy_tensor_async = hookimpl(cpy_tensor_async)
    m.comm_allreduce_tensor = hookimpl(comm_allreduce_tensor)
    return m


@pytest.fixture(scope="module")
def cpu() -> Device:
    reg = Registry()
    assert reg.register(cpu_plugin, "cpu") is not None, reg.failures
    return reg.device("CPU")


DECLINED: list = []


@pytest.fixture(scope="module", params=["asynctest", "pull"])
def adevs(request) -> list[Device]:
    """5 asynchronous devices (the env is read at registration and at backend creation)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ACCELPLANE_ASYNCDEV_NDEV", "5")
        mp.setenv("ACCELPLANE_TEST_DELAY_US", "200")
        mp.delenv("ACCELPLANE_ASYNCDEV_SEED", raising=False)
        reg = Registry()
        mod = asyncdev if request.param == "asynctest" else pull_plugin(DECLINED)
        assert reg.register(mod, request.param) is not None, reg.failures
        yield reg.devices_of(request.param)


def _backends(devs: list[Device], n: int) -> list[Backend]:
    return [devs[i % len(devs)].new_backend() for i in range(n)]


def _free(*things) -> None:
    for group in things:
        for x in group:
            if x is not None:
                x.free()


def _tensors(devs: list[Device], n: int, ty: GGMLType = T.F32, shape=SHAPE, name: str = "p"):
    """n tensors, tensor i in its own buffer of devs[i % len(devs)]."""
    ctx = Context()
    ts = [ctx.new_tensor(ty, shape, f"{name}{i}") for i in range(n)]
    bufs = [alloc_tensors([t], devs[i % len(devs)].buffer_type) for i, t in enumerate(ts)]
    return ts, bufs


def _values(rng, n: int, ty: GGMLType, shape=SHAPE, spread: float = 0.0) -> list[np.ndarray]:
    """Random parts in the tensor type; ``spread`` decades of magnitude make association
    visible in the low bits."""
    out = []
    for _ in range(n):
        x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-spread, spread, shape)
        out.append(x.astype(NP[ty]))
    return out


def _oracle_check(got: np.ndarray, parts: list[np.ndarray], unit: float, depth: int, what: str) -> None:
    """|got - exact sum| <= (depth + 1) * unit * sum |x_i|, elementwise."""
    p64 = np.stack([np.asarray(p, np.float64) for p in parts])
    err = np.abs(np.asarray(got, np.float64) - p64.sum(0))
    bound = (depth + 1) * unit * np.abs(p64).sum(0) + 1e-30
    worst = float((err / bound).max())
    assert worst <= 1.0, f"{what}: error {worst:.2f}x over the rounding bound"


def _depth(n: int) -> int:
    """Additions on the longest path of the canonical tree."""
    p = 1 << (n.bit_length() - 1)
    return (p.bit_length() - 1) + (n > p)


def _same_on_every_rank(raw: list[np.ndarray], what: str) -> None:
    for i, r in enumerate(raw[1:], 1):
        assert np.array_equal(r, raw[0]), f"{what}: rank {i} differs from rank 0"


# --- the canonical order -----------------------------------------------------------------------
def test_merge_order_is_documented_tree():
    assert merge_order(1) == []
    assert merge_order(2) == [(0, 1)]
    assert merge_order(3) == [(0, 2), (0, 1)]
    assert merge_order(5) == [(0, 4), (0, 1), (2, 3), (0, 2)]
    assert merge_order(8) == [(0, 1), (2, 3), (4, 5), (6, 7), (0, 2), (4, 6), (0, 4)]
    x = [np.float32(v) for v in (1e8, 1.0, -1e8, 3.0, 0.5)]
    want = ((x[0] + x[4]) + x[1]) + (x[2] + x[3])
    assert canonical_sum(x).tobytes() == np.float32(want).tobytes()


def _tree(n: int) -> object:
    """The canonical tree as nested unordered pairs (addition is commutative only)."""
    vals: list[object] = list(range(n))
    for a, b in merge_order(n):
        vals[a] = frozenset({vals[a], vals[b]})
    return vals[0]


@pytest.mark.parametrize("n", range(2, 12))
@pytest.mark.parametrize("writable", [True, False], ids=["plain", "compressed"])
def test_ring_owner_program_evaluates_the_canonical_tree(n, writable):
    for own in range(n):
        prog, n_acc = comm_mod._owner_program(n, own, slots_writable=writable)
        val = {("x",): own, **{("s", i): i for i in range(n) if i != own}}
        for kind, dst, src in prog:
            if kind == "load":
                assert not writable and src[0] == "s"
                val[dst] = val[src]
            else:
                assert dst[0] != "s" or writable, "an F32 sum written into a wire-type slot"
                val[dst] = frozenset({val[dst], val[src]})
        assert val[("x",)] == _tree(n), f"owner {own} of {n}"
        assert n_acc == 0 or not writable


# --- CPU: every SDK fallback path --------------------------------------------------------------
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("ty", [T.F32, T.F16, T.BF16], ids=str)
def test_cpu_results_and_identity(cpu, n, ty):
    parts = _values(np.random.default_rng(n), n, ty, spread=3)
    bks = _backends([cpu], n)
    results = {}
    try:
        for algo in ("butterfly", "ring"):
            ts, bufs = _tensors([cpu], n, ty)
            for t, v in zip(ts, parts, strict=True):
                t.set(v)
            with AllReduce(bks, algo) as ar:
                assert ar(ts) == algo
            raw = [t.get_bytes() for t in ts]
            _same_on_every_rank(raw, f"{algo} n={n} {ty.name}")
            _oracle_check(ts[0].get(), parts, UNIT[ty], _depth(n), f"{algo} n={n} {ty.name}")
            results[algo] = raw[0]
            _free(bufs)
        rb, rr = results["butterfly"], results["ring"]
        assert np.array_equal(rb, rr), f"butterfly and ring differ in {ty.name} for n={n}"
        if ty == T.F32:
            assert np.array_equal(rb, canonical_sum(parts).reshape(-1).view(np.uint8))
    finally:
        _free(bks)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("shape", [(7,), (3, 4, 65), (2, 1, 3, 129)], ids=str)
def test_cpu_f32_byte_identical_odd_shapes(cpu, n, shape):
    """Sizes below one chunk per rank (empty ring chunks) and not multiples of the chunk
    alignment; wide magnitudes so that a different association shows in the bits."""
    rng = np.random.default_rng(100 + n)
    parts = _values(rng, n, T.F32, shape, spread=4)
    bks = _backends([cpu], n)
    try:
        raw = {}
        for algo in ("butterfly", "ring"):
            ts, bufs = _tensors([cpu], n, T.F32, shape)
            for t, v in zip(ts, parts, strict=True):
                t.set(v)
            allreduce(bks, ts, algo)
            got = [t.get_bytes() for t in ts]
            _same_on_every_rank(got, algo)
            raw[algo] = got[0]
            _free(bufs)
        canon = canonical_sum(parts).reshape(-1).view(np.uint8)
        assert np.array_equal(raw["butterfly"], raw["ring"])
        assert np.array_equal(raw["ring"], canon)
        if n >= 3 and np.prod(shape) > 100:  # the test can tell association apart
            seq = parts[0].copy()
            for p in parts[1:]:
                seq = seq + p
            assert not np.array_equal(seq.reshape(-1).view(np.uint8), canon)
    finally:
        free_shared(bks)
        _free(bks)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("algo", ["butterfly", "ring"])
@pytest.mark.parametrize("wire", ["f16", "bf16"])
def test_cpu_compressed(cpu, n, algo, wire):
    rng = np.random.default_rng(7 * n)
    parts = _values(rng, n, T.F32)
    bks = _backends([cpu], n)
    ts, bufs = _tensors([cpu], n)
    try:
        nbytes = ts[0].nbytes
        # below the threshold: not compressed, the canonical F32 bits
        for t, v in zip(ts, parts, strict=True):
            t.set(v)
        with AllReduce(bks, algo, compress=wire, compress_threshold=nbytes + 1) as ar:
            ar(ts)
            plain_sent = list(ar.last_sent)
        assert np.array_equal(ts[0].get_bytes(), canonical_sum(parts).reshape(-1).view(np.uint8))
        # at the threshold: compressed
        for t, v in zip(ts, parts, strict=True):
            t.set(v)
        with AllReduce(bks, algo, compress=wire, compress_threshold=nbytes) as ar:
            ar(ts)
            assert sum(ar.last_sent) < sum(plain_sent)
        _same_on_every_rank([t.get_bytes() for t in ts], f"{algo}/{wire}")
        # every operand rounded once per level, and the result once more
        _oracle_check(ts[0].get(), parts, UNIT[WIRE[wire]], _depth(n) + 2, f"{algo}/{wire} n={n}")
    finally:
        _free(bufs, bks)


@pytest.mark.parametrize("n", NS)
def test_traffic(cpu, n):
    """Ring: 2(n-1)/n of the tensor per device; butterfly: the whole tensor per level."""
    nel = 32 * 16 * n  # chunks of equal, aligned size
    bks = _backends([cpu], n)
    ts, bufs = _tensors([cpu], n, shape=(nel,))
    try:
        for t in ts:
            t.set(np.ones(nel, np.float32))
        nbytes = ts[0].nbytes
        with AllReduce(bks, "ring") as ar:
            ar(ts)
            assert ar.last_sent == [2 * (n - 1) * nbytes // n] * n
        with AllReduce(bks, "ring", compress="bf16", compress_threshold=0) as ar:
            ar(ts)
            assert ar.last_sent == [(n - 1) * nbytes // n] * n
        p = 1 << (n.bit_length() - 1)
        levels = p.bit_length() - 1
        with AllReduce(bks, "butterfly") as ar:
            ar(ts)
            want = [levels * nbytes + (nbytes if i < n - p else 0) for i in range(p)]
            want += [nbytes] * (n - p)  # the folded ranks send once
            assert ar.last_sent == want
    finally:
        _free(bufs, bks)


def test_cpu_plugin_algorithm_and_auto(cpu):
    bks = _backends([cpu], 3)
    ts, bufs = _tensors([cpu], 3)
    try:
        for t in ts:
            t.set(np.ones(SHAPE, np.float32))
        with AllReduce(bks, "plugin") as ar, pytest.raises(UnsupportedOpError, match="no communicator"):
            ar(ts)
        with AllReduce(bks, "auto") as ar:
            assert ar(ts) == "butterfly" and ar.comm is None
        np.testing.assert_array_equal(ts[2].get(), np.full(SHAPE, 3, np.float32))
    finally:
        _free(bufs, bks)


# --- the asynchronous devices: ordering under random delays ------------------------------------------
CASES = [("butterfly", None), ("ring", None), ("ring", "f16"), ("butterfly", "bf16")]


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("algo,wire", CASES, ids=[f"{a}-{w}" for a, w in CASES])
def test_async_repeated_no_host_sync(adevs, n, algo, wire):
    """REPS rounds × 2 tensor sets, all queued with no host synchronization: upload, all-reduce,
    then at once a copy-out graph and an overwrite of the tensors with NaN on every backend
    (later work sees the sum; a peer still copying from a tensor would see the NaN)."""
    rng = np.random.default_rng(n)
    bks = _backends(adevs, n)
    sets, bufs, outs, out_bufs, graphs = [], [], [], [], []
    for s in range(2):
        ts, b = _tensors(adevs, n, name=f"s{s}.")
        os_, ob = _tensors(adevs, n, name=f"o{s}.")
        gctx = Context()
        graphs.append([gctx.graph(gctx.cpy(t, o)) for t, o in zip(ts, os_, strict=True)])
        sets.append(ts)
        outs.append(os_)
        bufs += b
        out_bufs += ob
    nan = np.full(SHAPE, np.nan, np.float32)
    ar = AllReduce(bks, algo, compress=wire, compress_threshold=0)
    try:
        syncs = [b.n_syncs for b in bks]
        pending = []  # (parts, host arrays of every rank's copy-out)
        for _ in range(REPS):
            for s, ts in enumerate(sets):
                parts = _values(rng, n, T.F32)
                for b, t, v in zip(bks, ts, parts, strict=True):
                    b.set_tensor_async(t, v)
                assert ar(ts) == algo
                got = [np.empty(t.nbytes, np.uint8) for t in ts]
                for b, g, o, h, t in zip(bks, graphs[s], outs[s], got, ts, strict=True):
                    b.graph_compute(g)
                    b.get_tensor_async(o, h)
                    b.set_tensor_async(t, nan)
                pending.append((parts, got))
        assert [b.n_syncs for b in bks] == syncs, "the all-reduce blocked the host"
        for b in bks:
            b.synchronize()
        wrong = 0
        for parts, got in pending:
            try:
                _same_on_every_rank(got, "")
                res = got[0].view(np.float32).reshape(SHAPE)
                if wire is None:
                    assert np.array_equal(got[0], canonical_sum(parts).reshape(-1).view(np.uint8))
                else:
                    _oracle_check(res, parts, UNIT[WIRE[wire]], _depth(n) + 2, "")
            except AssertionError:
                wrong += 1
        assert wrong == 0, f"{wrong} of {len(pending)} all-reduces were wrong"
    finally:
        ar.free()
        _free(bks, bufs, out_bufs)


@pytest.mark.parametrize("n", [3, 5])
def test_async_butterfly_and_ring_byte_identical(adevs, n):
    rng = np.random.default_rng(50 + n)
    parts = _values(rng, n, T.F32, spread=4)
    bks = _backends(adevs, n)
    (ta, ba), (tb, bb) = _tensors(adevs, n, name="a"), _tensors(adevs, n, name="b")
    try:
        for x, y, v in zip(ta, tb, parts, strict=True):
            x.set(v)
            y.set(v)
        with AllReduce(bks, "butterfly") as bf, AllReduce(bks, "ring") as rg:
            bf(ta)
            rg(tb)
            for b in bks:
                b.synchronize()
        raw_a = [t.get_bytes() for t in ta]
        raw_b = [t.get_bytes() for t in tb]
        _same_on_every_rank(raw_a + raw_b, "butterfly vs ring")
        _oracle_check(ta[0].get(), parts, UNIT[T.F32], _depth(n), "async")
    finally:
        _free(ba, bb, bks)


def test_async_plugin_comm_or_fallback(adevs):
    """asynctest: "plugin" and "auto" use its own comm. pull: its comm declines every call, so
    "auto" falls back to the butterfly and "plugin" raises."""
    declining = adevs[0].plugin.name == "pull"
    n = 4
    bks = _backends(adevs, n)
    ts, bufs = _tensors(adevs, n)
    parts = _values(np.random.default_rng(3), n, T.F32)
    try:
        for algo in ("auto", "plugin"):
            for t, v in zip(ts, parts, strict=True):
                t.set(v)
            before = len(DECLINED)
            with AllReduce(bks, algo) as ar:
                assert ar.comm is not None
                if declining and algo == "plugin":
                    with pytest.raises(UnsupportedOpError, match="declined"):
                        ar(ts)
                    continue
                used = ar(ts)
                for b in bks:
                    b.synchronize()
            assert used == ("butterfly" if declining else "plugin")
            assert len(DECLINED) - before == (1 if declining else 0)
            _oracle_check(ts[n - 1].get(), parts, UNIT[T.F32], n, algo)
    finally:
        _free(bufs, bks)


def test_free_returns_scratch(adevs):
    dev = adevs[0]
    bks = _backends(adevs, 3)
    ts, bufs = _tensors(adevs, 3)
    try:
        for t in ts:
            t.set(np.ones(SHAPE, np.float32))
        free0 = dev.memory()[0]
        ar = AllReduce(bks, "ring", compress="f16", compress_threshold=0)
        ar(ts)
        assert dev.memory()[0] < free0  # slots, the wire image, accumulators
        ar.free()
        assert dev.memory()[0] == free0
        ar.free()  # idempotent
        with pytest.raises(DeviceError, match="after free"):
            ar(ts)
    finally:
        _free(bufs, bks)


# --- function form, errors ----------------------------------------------------------------------------
def test_function_form_caches_and_frees(cpu):
    bks = _backends([cpu], 2)
    ts, bufs = _tensors([cpu], 2)
    try:
        for t in ts:
            t.set(np.full(SHAPE, 2, np.float32))
        free_shared()
        assert allreduce(bks, ts, "ring") == "ring"
        assert allreduce(bks, ts, "ring") == "ring"
        assert len(comm_mod._shared) == 1
        np.testing.assert_array_equal(ts[1].get(), np.full(SHAPE, 8, np.float32))
        free_shared(bks)
        assert not comm_mod._shared
    finally:
        _free(bufs, bks)


def test_bad_input_raises_typed_errors(cpu, adevs):
    cb = _backends([cpu], 2)
    ab = _backends(adevs, 2)
    ctx = Context()
    good = [ctx.new_tensor(T.F32, SHAPE, f"g{i}") for i in range(2)]
    other_shape = ctx.new_tensor(T.F32, (29, 37), "other_shape")
    f16 = ctx.new_tensor(T.F16, SHAPE, "f16")
    i32 = [ctx.new_tensor(T.I32, SHAPE, f"i{i}") for i in range(2)]
    base = ctx.new_tensor(T.F32, SHAPE[::-1], "base")
    transposed = ctx.transpose(base)  # SHAPE, not contiguous
    unallocated = ctx.new_tensor(T.F32, SHAPE, "unallocated")
    cbufs = [alloc_tensors([t], cpu.buffer_type) for t in [*good, other_shape, f16, *i32, base, transposed]]
    a_ts, a_bufs = _tensors(adevs, 2)
    dead, dead_buf = _tensors([cpu], 1, name="dead")
    dead_buf[0].free()
    shared = ctx.new_tensor(T.F32, (2, *SHAPE), "shared")
    sbuf = alloc_tensors([shared], cpu.buffer_type)
    half = [ctx.view(shared, (SHAPE[1], SHAPE[0]), offset=k * shared.nb[2]) for k in range(2)]
    overl = ctx.view(shared, (SHAPE[1], SHAPE[0]), offset=shared.nb[1])
    for v in (*half, overl):
        sbuf.init_view(v)
    try:
        cases = [
            (DeviceError, "at least 2 backends", lambda: AllReduce(cb[:1])),
            (DeviceError, "at least 2 backends", lambda: AllReduce([])),
            (UnsupportedOpError, "unknown", lambda: AllReduce(cb, "tree")),
            (TypeMismatchError, "compress", lambda: AllReduce(cb, compress="fp8")),
            (ShapeError, "got 1 tensors", lambda: allreduce(cb, good[:1])),
            (ShapeError, "ne=", lambda: allreduce(cb, [good[0], other_shape])),
            (TypeMismatchError, "rank 0's is F32", lambda: allreduce(cb, [good[0], f16])),
            (TypeMismatchError, "allowed", lambda: allreduce(cb, i32)),
            (ShapeError, "not contiguous", lambda: allreduce(cb, [good[0], transposed])),
            (DeviceError, "not allocated", lambda: allreduce(cb, [good[0], unallocated])),
            (BufferFreedError, "freed", lambda: allreduce(cb, [good[0], dead[0]])),
            (DeviceError, "overlaps", lambda: allreduce(cb, [good[0], good[0]])),
            (DeviceError, "overlaps", lambda: allreduce(cb, [half[0], overl])),
            (DeviceError, "backend's device", lambda: allreduce(ab, good)),  # CPU tensors, async backends
            (DeviceError, "backend's device", lambda: allreduce(cb, a_ts)),  # and the other way round
            (DeviceError, "backend's device", lambda: allreduce(ab[::-1], a_ts)),  # on each other's device
        ]
        for err, match, call in cases:
            with pytest.raises(err, match=match) as info:
                call()
            assert isinstance(info.value, AccelplaneError)
        # two halves of one buffer are fine
        for v, x in zip(half, (1.0, 2.0), strict=True):
            v.set(np.full(SHAPE, x, np.float32))
        assert allreduce(cb, half, "ring") == "ring"
        np.testing.assert_array_equal(half[0].get(), np.full(SHAPE, 3, np.float32))
        # one AllReduce validates a repeated tensor list once, but still sees a freed buffer
        with AllReduce(cb, "ring") as ar:
            assert ar(half) == "ring" and ar(half) == "ring" and len(ar._valid) == 1
            with pytest.raises(DeviceError, match="overlaps"):
                ar([half[0], overl])
            sbuf.free()
            with pytest.raises(BufferFreedError, match="freed"):
                ar(half)
    finally:
        free_shared()
        _free(cbufs, a_bufs, [sbuf], cb, ab)


# --- benchmark -----------------------------------------------------------------------------------
def test_bench_allreduce(cpu):
    bks = _backends([cpu], 3)
    try:
        rows = bench_allreduce(bks, [4096, 1 << 16], ("butterfly", "ring", "plugin"), min_time_s=0.005)
        assert [(r.bytes, r.algorithm) for r in rows] == [
            (b, a) for b in (4096, 1 << 16) for a in ("butterfly", "ring", "plugin")
        ]
        for r in rows:
            assert r.memcpy_gbps > 0 and r.n == 3 and r.type == "F32"
            if r.algorithm == "plugin":
                assert r.used == "" and "no communicator" in r.note
            else:
                assert r.used == r.algorithm and r.runs >= 1 and r.busbw_gbps > 0
                assert r.busbw_gbps == pytest.approx(4 / 3 * r.bytes / (r.us_per_call * 1e-6) / 1e9)
    finally:
        _free(bks)
