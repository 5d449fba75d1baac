"""CPU plugin kernels (accelplane.cpu.kernels) against an independent float64 oracle.

Weights are random blocks (random bytes, f16 scale fields overwritten with small finite values),
dequantized for the oracle by gguf.quants.dequantize; the oracle product is float64 numpy.
Every type runs on each code path the CPU has (avx2-vnni, avx2, portable C). The AVX2 paths
quantize activations to int8 as ggml does, so mat-mul is held to ggml's MUL_MAT NMSE threshold
(5e-4); the worst NMSE seen per (path, type) is printed by the last test (pytest -rP shows it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

gguf_quants = pytest.importorskip("gguf.quants")
import gguf  # noqa: E402
from accelplane.core.types import GGMLType  # noqa: E402
from accelplane.cpu import kernels  # noqa: E402
from accelplane.errors import (  # noqa: E402
    ComputeError,
    ConfigError,
    OutOfRangeError,
    ShapeError,
    TypeMismatchError,
)

T = GGMLType
QUANT = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
FLOAT = [T.F32, T.F16, T.BF16]
ALL = QUANT + FLOAT
BLOCK = {t: (t.blck_size, t.type_size) for t in QUANT}  # sizes: tests/test_types.py checks them
NMSE_MAX = 5e-4  # ggml test-backend-ops MUL_MAT threshold
WORST: dict[tuple[str, str], float] = defaultdict(float)


# --- helpers -------------------------------------------------------------------------------


def k_values(t: GGMLType) -> list[int]:
    """One block, and a K that is not a power of two."""
    if t in BLOCK:
        blk = BLOCK[t][0]
        return [blk, blk * 7 if blk == 32 else blk * 3]
    return [1, 37, 224]


def make_weights(
    t: GGMLType, m: int, k: int, rng: np.random.Generator, pad: int = 0, raw: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(w, oracle): w as kernels take it, oracle float64 [m, k] of its values.

    ``pad`` > 0 gives w a row stride of row_bytes + pad, the padding filled with bytes that
    would poison the result (NaN/inf f16 patterns) if a kernel read them.
    """
    if t in BLOCK:
        blk, bsz = BLOCK[t]
        nb = k // blk
        blocks = rng.integers(0, 256, size=(m, nb, bsz), dtype=np.uint8)
        for off in t.traits.f16_fields:
            d = rng.uniform(-0.05, 0.05, size=(m, nb)).astype(np.float16)
            blocks[:, :, off : off + 2] = d.view(np.uint8).reshape(m, nb, 2)
        rows = blocks.reshape(m, nb * bsz)
        oracle = gguf_quants.dequantize(rows, gguf.GGMLQuantizationType(int(t)))
        oracle = oracle.astype(np.float64)
    else:
        f = rng.standard_normal((m, k)).astype(np.float32)
        if t == T.F32:
            elems = f
            oracle = f.astype(np.float64)
        elif t == T.F16:
            elems = f.astype(np.float16)
            oracle = elems.astype(np.float64)
        else:
            elems = (f.view(np.uint32) >> 16).astype(np.uint16)
            oracle = (elems.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        if not raw and not pad:
            return elems, oracle
        rows = elems.view(np.uint8).reshape(m, -1)
    if pad:
        buf = np.full((m, rows.shape[1] + pad), 0xFF, np.uint8)
        buf[:, : rows.shape[1]] = rows
        rows = buf[:, : rows.shape[1]]
        assert rows.strides[0] > rows.shape[1]
    return rows, oracle


def nmse(out: np.ndarray, ref: np.ndarray) -> float:
    den = float(np.sum(ref * ref))
    return float(np.sum((out - ref) ** 2)) / den if den else float(np.sum(out * out))


def check_product(out: np.ndarray, wf: np.ndarray, x: np.ndarray, isa: str, t: GGMLType) -> float:
    ref = x.astype(np.float64) @ wf.T
    assert np.all(np.isfinite(out))
    err = nmse(out.astype(np.float64), ref)
    # NMSE of a handful of outputs is dominated by chance (a small reference value), so for
    # those also bound each error by the Cauchy-Schwarz scale |w_m| |x_n|
    scale = np.outer(np.linalg.norm(x.astype(np.float64), axis=1), np.linalg.norm(wf, axis=1))
    assert np.all(np.abs(out - ref) <= 5e-3 * scale + 1e-30)
    if out.size >= 16:
        WORST[(isa, t.name)] = max(WORST[(isa, t.name)], err)
        assert err <= NMSE_MAX, f"{t.name} NMSE {err:.3g} over {NMSE_MAX}"
    return err


@pytest.fixture(params=["avx512", "avx2-vnni", "avx2", "portable"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "avx2" and not kernels.has_avx2():
        pytest.skip("CPU has no AVX2+FMA+F16C")
    if request.param == "avx2-vnni" and not kernels.has_avx2_vnni():
        pytest.skip("CPU has no AVX-VNNI or AVX512-VNNI")
    if request.param == "avx512" and not kernels.has_avx512():
        pytest.skip("CPU has no AVX-512 F+BW+VL+VNNI+VBMI")
    before = kernels.get_isa()
    assert kernels.set_isa(request.param) == request.param
    yield request.param
    kernels.set_isa(before)


# --- mul_mat -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 64])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("kind", [0, 1])
@pytest.mark.parametrize("t", ALL, ids=str)
def test_mul_mat(t: GGMLType, kind: int, m: int, n: int, isa: str) -> None:
    rng = np.random.default_rng([int(t), kind, m, n])
    k = k_values(t)[kind]
    w, wf = make_weights(t, m, k, rng, raw=bool(kind))
    x = rng.standard_normal((n, k)).astype(np.float32)
    out = np.full((n, m), np.nan, np.float32)
    assert kernels.mul_mat(t, w, x, out) is out
    check_product(out, wf, x, isa, t)


@pytest.mark.parametrize("k", [8, 64, 1024, 1032])
@pytest.mark.parametrize(("m", "n"), [(4, 2), (7, 3), (13, 8), (17, 5)])
@pytest.mark.parametrize("t", [T.F32, T.F16, T.BF16], ids=str)
def test_mul_mat_float_short_rows(t: GGMLType, m: int, n: int, k: int, isa: str) -> None:
    """Float rows of up to 1 KiB elements against a few activation rows (attention's products
    over a KV cache: 4 x 2 tiles, rows past the last tile, an odd last activation row), with
    poisoned padding between the weight rows."""
    rng = np.random.default_rng([int(t), m, n, k])
    w, wf = make_weights(t, m, k, rng, pad=6)
    x = rng.standard_normal((n, k)).astype(np.float32)
    out = np.full((n, m), np.nan, np.float32)
    kernels.mul_mat(t, w, x, out, strategy="direct")
    check_product(out, wf, x, isa, t)


@pytest.mark.parametrize("sizes", [(3, 0, 1), (1, 1, 1, 1), (7, 0, 5, 2, 40)])
@pytest.mark.parametrize("t", [T.Q4_0, T.Q5_1, T.Q8_0, T.Q4_K, T.IQ4_XS, T.F32, T.F16], ids=str)
def test_mul_mat_id_groups(t: GGMLType, sizes: tuple[int, ...], isa: str) -> None:
    """MUL_MAT_ID's grouped products: each group of rows against its own expert (groups of 0
    rows, one row, one big group; experts in any order, one used twice), against the float64
    product of each group with its expert's values."""
    rng = np.random.default_rng([int(t), *sizes])
    n_exp, m, k = 5, 9, k_values(t)[1]
    made = [make_weights(t, m, k, rng) for _ in range(n_exp)]
    w = np.stack([a for a, _ in made])
    experts = rng.integers(0, n_exp, len(sizes)).astype(np.int32)
    experts[-1] = experts[0]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    x = rng.standard_normal((int(starts[-1]), k)).astype(np.float32)
    out = np.full((len(x), m), np.nan, np.float32)
    assert kernels.mul_mat_id(t, w, x, out, experts, starts) is out
    for g, e in enumerate(experts):
        rows = slice(starts[g], starts[g + 1])
        if sizes[g]:
            check_product(out[rows], made[e][1], x[rows], isa, t)


@contextmanager
def cpu_mul_mat_id(
    t: GGMLType, made: list, n_b1: int, n_tok: int, n_used: int, repack: bool = False
) -> Iterator:
    """A MUL_MAT_ID graph on the CPU plugin over the experts ``made`` (make_weights' pairs),
    x of [n_tok, n_b1, K]: yields compute(x, ids) -> y [n_tok, n_used, M], the same plan each call;
    with ``repack`` the experts live in the plugin's repack buffer (the x8 layout)."""
    import accelplane as ap
    from accelplane.core.graph import Context
    from accelplane.runtime.alloc import alloc_tensors

    m, k = made[0][1].shape
    ctx = Context()
    w = ctx.new_tensor_ne(t, k, m, len(made), name="w")
    x = ctx.new_tensor_ne(T.F32, k, n_b1, n_tok, name="x")
    ids = ctx.new_tensor_ne(T.I32, n_used, n_tok, name="ids")
    y = ctx.mul_mat_id(w, x, ids)
    graph = ctx.graph(y)
    dev = ap.get_registry().device("CPU")
    buf = alloc_tensors([x, ids, *graph.nodes], dev.buffer_type)
    wbuf = alloc_tensors([w], dev.extra_buffer_types[0] if repack else dev.buffer_type)
    be = dev.new_backend()

    def compute(xv: np.ndarray, iv: np.ndarray) -> np.ndarray:
        x.set(xv)
        ids.set(iv)
        be.compute(graph)
        return y.get().reshape(n_tok, n_used, m)

    try:
        w.set_bytes(np.stack([a for a, _ in made]).reshape(-1).view(np.uint8))
        yield compute
    finally:
        be.free()
        buf.free()
        wbuf.free()


@pytest.mark.parametrize("repack", [False, True], ids=["plain", "repack"])
@pytest.mark.parametrize("t", [T.Q4_0, T.Q8_0], ids=str)
def test_plugin_mul_mat_id_splits_big_and_small_experts(t: GGMLType, repack: bool) -> None:
    """The CPU plugin's MUL_MAT_ID with one expert used by enough rows for dequantize + BLAS
    and the others by a few: the big one apart, the rest in one grouped call, every (token,
    slot) against the float64 product of its expert."""
    rng = np.random.default_rng([int(t), 5])
    n_exp, m, k, n_tok, n_used = 4, 24, 64, 200, 2
    layout = "x8" if repack else "ggml"
    if not kernels.blas_wins(t, n_tok, layout) or kernels.blas_wins(t, n_tok // 2, layout):
        pytest.skip("this code path's crossover leaves no expert on one side of it")
    made = [make_weights(t, m, k, rng) for _ in range(n_exp)]
    xv = rng.standard_normal((n_tok, n_used, k)).astype(np.float32)
    iv = np.zeros((n_tok, n_used), np.int32)  # slot 0: expert 0 for every token
    iv[:, 1] = rng.integers(1, n_exp, n_tok)
    iv[:3, 1] = 0  # expert 0 twice in no token; a few rows for the others
    iv[:3, 0] = [1, 2, 3]
    with cpu_mul_mat_id(t, made, n_used, n_tok, n_used, repack) as compute:
        got = compute(xv, iv)
    want = np.einsum("tumk,tuk->tum", np.stack([f for _, f in made])[iv], xv.astype(np.float64))
    assert nmse(got, want) < NMSE_MAX


@pytest.mark.parametrize("repack", [False, True], ids=["plain", "repack"])
@pytest.mark.parametrize("n_b1", [1, 3], ids=["shared_x", "x_per_slot"])
def test_plugin_mul_mat_id_decode(n_b1: int, repack: bool, isa: str) -> None:
    """A decode's MUL_MAT_ID (one token: the ids form, grouped in C): three computes of one plan
    with new expert ids (one expert twice in a token among them), each against the float64
    product of every slot's expert, x one row for every slot or its own row per slot; an id out
    of range is a ComputeError, as on the prefill path."""
    rng = np.random.default_rng(n_b1)
    t, n_exp, m, k, n_used = T.Q4_0, 6, 20, 64, 3
    made = [make_weights(t, m, k, rng) for _ in range(n_exp)]
    with cpu_mul_mat_id(t, made, n_b1, 1, n_used, repack) as compute:
        for sel in ([4, 0, 2], [1, 1, 5], [5, 3, 0]):
            xv = rng.standard_normal((1, n_b1, k)).astype(np.float32)
            got = compute(xv, np.array([sel], np.int32))[0]
            for u, e in enumerate(sel):
                check_product(got[u : u + 1], made[e][1], xv[0, u % n_b1][None], isa, t)
        with pytest.raises(ComputeError, match="expert id out of range"):
            compute(xv, np.array([[0, n_exp, 1]], np.int32))


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_mul_mat_id_ids_any_routing(data) -> None:
    """The ids form of MUL_MAT_ID: any ids (repeats within a token, unused experts), x shared by
    the slots or one row per slot, strided x and out; every (token, slot) against the float64
    product of its expert, ids re-read at each call."""
    t = data.draw(st.sampled_from([T.Q4_0, T.Q8_0, T.Q4_K, T.F32]), label="type")
    n_exp = data.draw(st.integers(1, 5), label="experts")
    n_tok, n_used = data.draw(st.integers(1, 4), label="tokens"), data.draw(st.integers(1, 4), label="used")
    n_sl = data.draw(st.sampled_from([1, n_used]), label="x rows per token")
    rng = np.random.default_rng([int(t), n_exp, n_tok, n_used, n_sl])
    m, k = 7, k_values(t)[0]
    made = [make_weights(t, m, k, rng) for _ in range(n_exp)]
    w = np.stack([a for a, _ in made])
    x = rng.standard_normal((n_tok, n_sl, 2 * k)).astype(np.float32)[:, :, :k]  # strided rows
    ids = np.zeros((n_tok, n_used), np.int32)
    out = np.full((n_tok, n_used, m + 3), np.nan, np.float32)[:, :, :m]
    call = kernels.prepare_mul_mat_id_ids(t, w, x, ids, out)
    isa = kernels.get_isa()
    for _ in range(2):
        ids[...] = rng.integers(0, n_exp, ids.shape)
        call()
        for ti in range(n_tok):
            for u in range(n_used):
                check_product(out[ti, u][None], made[ids[ti, u]][1], x[ti, u % n_sl][None], isa, t)


def test_mul_mat_id_ids_checks() -> None:
    rng = np.random.default_rng(0)
    w = np.stack([make_weights(T.Q8_0, 4, 64, rng)[0] for _ in range(3)])
    x = rng.standard_normal((2, 1, 64)).astype(np.float32)
    ids = np.zeros((2, 2), np.int32)
    out = np.full((2, 2, 4), np.nan, np.float32)
    call = kernels.prepare_mul_mat_id_ids(T.Q8_0, w, x, ids, out)
    ids[1, 1] = 3  # expert 3 of 3: nothing written
    with pytest.raises(OutOfRangeError):
        call()
    assert np.all(np.isnan(out))
    ids[1, 1] = -1
    with pytest.raises(OutOfRangeError):
        call()
    with pytest.raises(ShapeError):  # ids for 3 tokens, x for 2
        kernels.prepare_mul_mat_id_ids(T.Q8_0, w, x, np.zeros((3, 2), np.int32),
                                       np.zeros((3, 2, 4), np.float32))
    with pytest.raises(ShapeError):  # out rows of the wrong width
        kernels.prepare_mul_mat_id_ids(T.Q8_0, w, x, ids, np.zeros((2, 2, 5), np.float32))
    with pytest.raises(TypeMismatchError):  # int64 ids
        kernels.prepare_mul_mat_id_ids(T.Q8_0, w, x, ids.astype(np.int64), out)
    with pytest.raises(ShapeError):  # out overlapping x
        xx = np.zeros((2, 2, 64), np.float32)
        kernels.prepare_mul_mat_id_ids(T.F32, np.zeros((2, 64, 64), np.float32), xx, ids, xx)
    with pytest.raises(ShapeError):  # x's elements not contiguous
        kernels.prepare_mul_mat_id_ids(T.Q8_0, w, np.zeros((2, 1, 128), np.float32)[:, :, ::2], ids, out)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_mul_mat_id_any_grouping(data) -> None:
    """Any grouping (empty groups, repeated experts, any order) gives each row its expert's
    product: mul_mat of that row alone, up to the summation order."""
    t = data.draw(st.sampled_from([T.Q4_0, T.Q8_0, T.Q4_K, T.F32]), label="type")
    n_exp = data.draw(st.integers(1, 4), label="experts")
    sizes = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=6), label="group sizes")
    experts = data.draw(st.lists(st.integers(0, n_exp - 1), min_size=len(sizes), max_size=len(sizes)))
    rng = np.random.default_rng(len(sizes) * 31 + n_exp)
    m, k = 5, k_values(t)[0]
    w = np.stack([make_weights(t, m, k, rng)[0] for _ in range(n_exp)])
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    x = rng.standard_normal((int(starts[-1]), k)).astype(np.float32)
    out = np.full((len(x), m), np.nan, np.float32)
    kernels.mul_mat_id(t, w, x, out, np.array(experts, np.int32), starts)
    for g, e in enumerate(experts):
        for n in range(starts[g], starts[g + 1]):
            want = np.empty((1, m), np.float32)
            kernels.mul_mat(t, w[e], x[n : n + 1], want, strategy="direct")
            np.testing.assert_allclose(out[n], want[0], rtol=1e-5, atol=1e-6 * float(np.abs(want).max()))


def test_mul_mat_id_checks_its_groups() -> None:
    rng = np.random.default_rng(0)
    w = np.stack([make_weights(T.Q8_0, 4, 64, rng)[0] for _ in range(3)])
    x = rng.standard_normal((4, 64)).astype(np.float32)
    out = np.empty((4, 4), np.float32)
    with pytest.raises(OutOfRangeError):  # expert 3 of 3
        kernels.mul_mat_id(T.Q8_0, w, x, out, [0, 3], [0, 2, 4])
    with pytest.raises(ShapeError):  # starts not ending at N
        kernels.mul_mat_id(T.Q8_0, w, x, out, [0, 1], [0, 2, 3])
    with pytest.raises(ShapeError):  # decreasing starts
        kernels.mul_mat_id(T.Q8_0, w, x, out, [0, 1, 2], [0, 3, 2, 4])
    with pytest.raises(ShapeError):  # starts of the wrong length
        kernels.mul_mat_id(T.Q8_0, w, x, out, [0, 1], [0, 4])
    with pytest.raises(ShapeError):  # a matrix, not experts of matrices
        kernels.mul_mat_id(T.Q8_0, w[0], x, out, [0], [0, 4])


@pytest.mark.parametrize("layout", ["packed", "strided_x", "f16_x", "strided_out", "many_rows"])
@pytest.mark.parametrize("t", [T.Q4_0, T.Q5_1, T.Q8_0, T.Q3_K, T.Q4_K, T.IQ4_NL, T.IQ4_XS, T.F16], ids=str)
def test_prepared_mul_mat(t: GGMLType, layout: str, isa: str) -> None:
    """A prepared product reads its operands' memory at every call (x rewritten in place between
    calls is seen), on the fast path and on the per-call fallbacks (x strided or not float32,
    out strided, N on the BLAS path)."""
    rng = np.random.default_rng([int(t), len(layout)])
    k = k_values(t)[1]
    m, n = 19, (64 if layout == "many_rows" else 3)
    w, wf = make_weights(t, m, k, rng)
    xbuf = np.zeros((n, 2 * k), np.float32 if layout != "f16_x" else np.float16)
    x = xbuf[:, ::2] if layout == "strided_x" else xbuf[:, :k]
    obuf = np.full((n, 2 * m), np.nan, np.float32)
    out = obuf[:, ::2] if layout == "strided_out" else obuf[:, :m]
    call = kernels.prepare_mul_mat(t, w, x, out)
    for _ in range(2):
        x[...] = rng.standard_normal((n, k))
        call()
        check_product(out, wf, x.astype(np.float32), isa, t)


def test_prepared_mul_mat_checks_once() -> None:
    w, _ = make_weights(T.Q8_0, 4, 64, np.random.default_rng(0))
    with pytest.raises(ShapeError):
        kernels.prepare_mul_mat(T.Q8_0, w, np.zeros((2, 96), np.float32), np.zeros((2, 4), np.float32))
    with pytest.raises(ShapeError):
        kernels.prepare_mul_mat(T.Q8_0, w, np.zeros((2, 64), np.float32), np.zeros((2, 5), np.float32))


@pytest.mark.parametrize("strategy", ["direct", "blas"])
@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize("t", ALL, ids=str)
def test_mul_mat_strided(t: GGMLType, n: int, strategy: str, isa: str) -> None:
    """W rows with padding (row stride > row bytes), x and out as strided views."""
    rng = np.random.default_rng([int(t), n, 99])
    k, m = k_values(t)[1], 17
    w, wf = make_weights(t, m, k, rng, pad=13)
    xbuf = rng.standard_normal((2 * n, k + 8)).astype(np.float32)
    x = xbuf[::2, 3 : 3 + k]
    obuf = np.full((n, m + 7), np.nan, np.float32)
    out = obuf[:, 2 : 2 + m]
    kernels.mul_mat(t, w, x, out, strategy=strategy)  # type: ignore[arg-type]
    check_product(out, wf, x, isa, t)
    assert np.all(np.isnan(obuf[:, :2])) and np.all(np.isnan(obuf[:, 2 + m :]))


@pytest.mark.parametrize("strategy", ["direct", "blas"])
@pytest.mark.parametrize("t", ALL, ids=str)
def test_mul_mat_odd_layouts(t: GGMLType, strategy: str, isa: str) -> None:
    """out transposed (inner stride != 4), x Fortran-ordered, rows of x that are all zero."""
    rng = np.random.default_rng([int(t), 5])
    k, m, n = k_values(t)[1], 5, 3
    w, wf = make_weights(t, m, k, rng)
    x = np.asfortranarray(rng.standard_normal((n, k)).astype(np.float32))
    x[1] = 0.0
    out = np.full((m, n), np.nan, np.float32).T
    kernels.mul_mat(t, w, x, out, strategy=strategy)  # type: ignore[arg-type]
    check_product(out, wf, x, isa, t)
    assert np.all(out[1] == 0.0)


def test_mul_mat_empty() -> None:
    w = make_weights(T.Q8_0, 4, 64, np.random.default_rng(1))[0]
    x = np.ones((0, 64), np.float32)
    assert kernels.mul_mat(T.Q8_0, w, x, np.empty((0, 4), np.float32)).shape == (0, 4)
    out = np.full((2, 4), np.nan, np.float32)
    kernels.mul_mat(T.F32, np.ones((4, 0), np.float32), np.ones((2, 0), np.float32), out)
    assert np.all(out == 0.0)
    kernels.mul_mat(T.Q8_0, w[:0], np.ones((2, 64), np.float32), np.empty((2, 0), np.float32))


def test_bfloat16_dtype() -> None:
    """BF16 weights may come as ml_dtypes.bfloat16 elements, not only uint16 bits."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(3)
    w16, wf = make_weights(T.BF16, 6, 40, rng, raw=False)
    wb = w16.view(ml_dtypes.bfloat16)
    x = rng.standard_normal((2, 40)).astype(np.float32)
    out = kernels.mul_mat(T.BF16, wb, x, np.empty((2, 6), np.float32))
    check_product(out, wf, x, kernels.get_isa(), T.BF16)
    deq = kernels.dequantize(T.BF16, wb, np.empty((6, 40), np.float32))
    np.testing.assert_array_equal(deq, wf.astype(np.float32))


@pytest.mark.parametrize("t", [T.Q4_0, T.Q8_0], ids=str)
def test_activations_quantized_as_ggml(t: GGMLType) -> None:
    """The AVX2 kernel's Q4_0 / Q8_0 products quantize the activations as ggml's
    quantize_row_q8_0 does, scale rounded to f16 (block_q8_0.d): the product equals, up to float
    rounding of the sums, the float64 product of the dequantized weights with the activations
    quantized by the gguf package (an f32 scale is off by ~2e-4)."""
    if not kernels.has_avx2():
        pytest.skip("CPU has no AVX2+FMA+F16C")
    before = kernels.get_isa()
    kernels.set_isa("avx2")
    try:
        rng = np.random.default_rng([int(t), 17])
        k, m, n = 512, 24, 5
        w, wf = make_weights(t, m, k, rng)
        x = rng.standard_normal((n, k)).astype(np.float32) * np.linspace(0.1, 30, k, dtype=np.float32)
        xq = gguf_quants.dequantize(gguf_quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                                    gguf.GGMLQuantizationType.Q8_0).astype(np.float64)  # fmt: skip
        out = kernels.mul_mat(t, w, x, np.empty((n, m), np.float32), 1, strategy="direct")
        ref = xq @ wf.T
        assert nmse(out.astype(np.float64), ref) < 1e-11, nmse(out.astype(np.float64), ref)
    finally:
        kernels.set_isa(before)


@pytest.mark.parametrize("t", ALL, ids=str)
def test_mul_mat_threads_agree(t: GGMLType, isa: str) -> None:
    """Rows are split over threads, each computed whole: any thread count gives the same bits."""
    rng = np.random.default_rng([int(t), 7])
    k, m = k_values(t)[1] * 8, 65  # M * K >= 65536: really threaded
    w, _ = make_weights(t, m, k, rng)
    for n in (1, 3):
        x = rng.standard_normal((n, k)).astype(np.float32)
        outs = [kernels.mul_mat(t, w, x, np.empty((n, m), np.float32), nt) for nt in (1, 2, 3)]
        np.testing.assert_array_equal(outs[0], outs[1])
        np.testing.assert_array_equal(outs[0], outs[2])


@pytest.mark.parametrize("t", ALL, ids=str)
def test_mul_mat_many_rows_threaded(t: GGMLType, isa: str) -> None:
    """Enough activation rows that they are quantized inside the parallel region and W is
    walked in L2-sized row blocks; two threads."""
    rng = np.random.default_rng([int(t), 13])
    k, m, n = 1024, 40, 80
    w, wf = make_weights(t, m, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    out = kernels.mul_mat(t, w, x, np.empty((n, m), np.float32), 2, strategy="direct")
    check_product(out, wf, x, isa, t)


@pytest.mark.parametrize("t", QUANT, ids=str)
def test_avx2_vnni_gives_avx2s_bits(t: GGMLType) -> None:
    """vpdpbusd sums the same u8 x s8 products as vpmaddubsw + vpmaddwd, and the operands never
    reach vpmaddubsw's int16 saturation (Q8_0's -128 quants against |x| = 127 included), so the
    two paths agree bit for bit, on random weights and on all-extreme quants."""
    if not kernels.has_avx2_vnni():
        pytest.skip("CPU has no AVX-VNNI or AVX512-VNNI")
    rng = np.random.default_rng([int(t), 23])
    k, m = k_values(t)[1] * 4, 24
    w, wf = make_weights(t, m, k, rng)
    blk, bsz = BLOCK[t]
    quant = np.ones(bsz, bool)  # the bytes of a block that are not f16 scales
    for off in t.traits.f16_fields:
        quant[off : off + 2] = False
    w = w.copy()
    blocks = w.reshape(m, k // blk, bsz)
    blocks[m // 2 :: 2, :, quant] = 0x80
    blocks[m // 2 + 1 :: 2, :, quant] = 0xFF
    wf = gguf_quants.dequantize(w, gguf.GGMLQuantizationType(int(t))).astype(np.float64)
    before = kernels.get_isa()
    try:
        for n in (1, 2, 5):
            x = rng.standard_normal((n, k)).astype(np.float32)
            x[0] = np.abs(x[0]).max()  # every activation quantized to 127
            outs = {}
            for name in ("avx2", "avx2-vnni"):
                assert kernels.set_isa(name) == name
                out = np.empty((n, m), np.float32)
                outs[name] = kernels.mul_mat(t, w, x, out, 1, strategy="direct")
            np.testing.assert_array_equal(outs["avx2"], outs["avx2-vnni"])
            check_product(outs["avx2-vnni"], wf, x, "avx2-vnni", t)
    finally:
        kernels.set_isa(before)


# --- dequantize / get_rows -----------------------------------------------------------------


@pytest.mark.parametrize("t", ALL, ids=str)
def test_dequantize(t: GGMLType, isa: str) -> None:
    rng = np.random.default_rng([int(t), 11])
    k, m = k_values(t)[1], 9
    w, wf = make_weights(t, m, k, rng, pad=5)
    out = kernels.dequantize(t, w, np.empty((m, k), np.float32))
    tol = 1e-6 * float(np.max(np.abs(wf)))  # FMA vs mul+sub rounding in the last bit
    np.testing.assert_allclose(out, wf, rtol=1e-6, atol=tol)
    rows = np.array([8, 0, 3, 3], np.int32)
    obuf = np.full((len(rows), k + 4), np.nan, np.float32)
    got = kernels.dequantize(t, w, obuf[:, 1 : 1 + k], rows=rows)
    np.testing.assert_allclose(got, wf[rows], rtol=1e-6, atol=tol)
    assert np.all(np.isnan(obuf[:, 0])) and np.all(np.isnan(obuf[:, 1 + k :]))


# --- the x8 layout and the repack buffer ----------------------------------------------------
X8 = [T.Q4_0, T.Q8_0]


def x8_oracle(t: GGMLType, rows: np.ndarray) -> np.ndarray:
    """The x8 bytes of ggml-layout rows [M, row_bytes], as the layout is specified: per group of
    8 rows and block, the 8 f16 scales, then word c (4 quant bytes) of row r at word c * 8 + r;
    the M % 8 last rows unchanged."""
    m, rb = rows.shape
    bsz = t.type_size
    out = rows.copy()
    for g in range(m // 8):
        blocks = rows[8 * g : 8 * g + 8].reshape(8, rb // bsz, bsz)
        packed = np.concatenate([blocks[:, :, :2].transpose(1, 0, 2).reshape(-1, 16),
                                 blocks[:, :, 2:].reshape(8, -1, (bsz - 2) // 4, 4).transpose(1, 2, 0, 3)
                                 .reshape(-1, 8 * (bsz - 2))], axis=1)  # fmt: skip
        out[8 * g : 8 * g + 8] = packed.reshape(8, rb)
    return out


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_x8_convert_is_the_layout_and_exact_both_ways(data) -> None:
    t = data.draw(st.sampled_from(X8))
    m, nb = data.draw(st.integers(1, 27)), data.draw(st.integers(1, 5))
    raw = np.frombuffer(data.draw(st.binary(min_size=m * nb * t.type_size, max_size=m * nb * t.type_size)),
                        np.uint8).reshape(m, -1)  # fmt: skip
    packed = kernels.x8_convert(t, raw, np.empty_like(raw), True)
    np.testing.assert_array_equal(packed, x8_oracle(t, raw))
    np.testing.assert_array_equal(kernels.x8_convert(t, packed, np.empty_like(raw), False), raw)


def test_x8_convert_checks() -> None:
    w = make_weights(T.Q4_0, 16, 64, np.random.default_rng(0))[0]
    with pytest.raises(TypeMismatchError, match="no x8 layout"):
        kernels.x8_convert(T.Q4_K, w, np.empty_like(w), True)
    with pytest.raises(ShapeError):
        kernels.x8_convert(T.Q4_0, w, w, True)  # overlap
    with pytest.raises(ShapeError):
        kernels.x8_convert(T.Q4_0, w, np.empty((15, w.shape[1]), np.uint8), True)
    with pytest.raises(TypeMismatchError, match="no x8 layout"):
        q5 = make_weights(T.Q5_0, 16, 64, np.random.default_rng(1))[0]
        kernels.mul_mat(T.Q5_0, q5, np.zeros((1, 64), np.float32), np.zeros((1, 16), np.float32),
                        layout="x8")
    with pytest.raises(ShapeError, match="contiguous"):
        kernels.mul_mat(T.Q4_0, w[::2], np.zeros((1, 64), np.float32), np.zeros((1, 8), np.float32),
                        layout="x8")
    with pytest.raises(ConfigError):
        kernels.mul_mat(T.Q4_0, w, np.zeros((1, 64), np.float32), np.zeros((1, 16), np.float32),
                        layout="tiles")  # type: ignore[arg-type]  # fmt: skip


@pytest.mark.parametrize("strategy", ["auto", "blas"])
@pytest.mark.parametrize("n", [1, 3, 7, 64])
@pytest.mark.parametrize("m", [8, 21, 64])
@pytest.mark.parametrize("t", X8, ids=str)
def test_mul_mat_x8(t: GGMLType, m: int, n: int, strategy: str, isa: str) -> None:
    """Products from x8 weights (whole groups, a tail of plain rows) against the float64 oracle
    of the ggml-layout rows they were made from, on each code path, the direct kernel and
    dequantize + BLAS; several threads' chunks end on groups."""
    rng = np.random.default_rng([int(t), m, n])
    k = 32 * 7
    w, wf = make_weights(t, m, k, rng)
    p = kernels.x8_convert(t, w, np.empty_like(w), True)
    x = rng.standard_normal((n, k)).astype(np.float32)
    out = np.full((n, m), np.nan, np.float32)
    kernels.mul_mat(t, p, x, out, strategy=strategy, layout="x8")  # type: ignore[arg-type]
    check_product(out, wf, x, isa, t)
    call = kernels.prepare_mul_mat(t, p, x, out2 := np.full((n, m), np.nan, np.float32), 1, layout="x8")
    call()
    check_product(out2, wf, x, isa, t)


@pytest.mark.parametrize("t", X8, ids=str)
def test_dequantize_x8(t: GGMLType, isa: str) -> None:
    """x8 rows dequantize to exactly what their ggml-layout rows do (rows picked and all)."""
    rng = np.random.default_rng([int(t), 3])
    w, _ = make_weights(t, 19, 96, rng)
    p = kernels.x8_convert(t, w, np.empty_like(w), True)
    want = kernels.dequantize(t, w, np.empty((19, 96), np.float32))
    np.testing.assert_array_equal(kernels.dequantize(t, p, np.empty((19, 96), np.float32), layout="x8"), want)
    rows = np.array([18, 0, 7, 8, 16, 3], np.int64)
    got = kernels.dequantize(t, p, np.empty((6, 96), np.float32), rows=rows, layout="x8")
    np.testing.assert_array_equal(got, want[rows])


def _repack_buffer_tensors(t: GGMLType, ne: tuple[int, ...]):
    import accelplane as ap
    from accelplane.core.graph import Context
    from accelplane.runtime.alloc import alloc_tensors

    dev = ap.get_registry().device("CPU")
    ctx = Context()
    w = ctx.new_tensor_ne(t, *ne, name="w")
    (buft,) = dev.extra_buffer_types
    assert buft.name == "CPU_REPACK" and not buft.is_host and dev.supports_buft(buft)
    return dev, ctx, w, alloc_tensors([w], buft)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_repack_buffer_round_trips_any_byte_range(data) -> None:
    """Partial writes and reads of an x8 tensor (2-D, or planes of M % 8 != 0 rows) at any byte
    range, memsets too, read back as ggml's layout: always what a plain array holds."""
    t = data.draw(st.sampled_from(X8))
    ne = data.draw(st.sampled_from([(64, 20), (32, 13, 3), (96, 8, 2)]))
    _, _, w, buf = _repack_buffer_tensors(t, ne)
    try:
        n = w.nbytes
        shadow = np.frombuffer(data.draw(st.binary(min_size=n, max_size=n)), np.uint8).copy()
        w.set_bytes(shadow)
        for _ in range(data.draw(st.integers(1, 4))):
            a = data.draw(st.integers(0, n - 1))
            b = data.draw(st.integers(a + 1, n))
            if data.draw(st.booleans()):
                chunk = np.frombuffer(data.draw(st.binary(min_size=b - a, max_size=b - a)), np.uint8)
                buf.set_tensor(w, chunk, a, b - a)
                shadow[a:b] = chunk
            else:
                v = data.draw(st.integers(0, 255))
                buf.memset_tensor(w, v, a, b - a)
                shadow[a:b] = v
            lo = data.draw(st.integers(0, n - 1))
            part = np.empty(n - lo, np.uint8)
            buf.get_tensor(w, part, lo, n - lo)
            np.testing.assert_array_equal(part, shadow[lo:])
        assert w.extra is not None  # stored as x8: the round trip went through the layout
        np.testing.assert_array_equal(w.get_bytes(), shadow)
    finally:
        buf.free()


@pytest.mark.parametrize("t", X8, ids=str)
def test_repack_buffer_in_graphs(t: GGMLType, isa: str) -> None:
    """Weights in the repack buffer as the CPU plugin computes on them: MUL_MAT of the whole
    matrix and of row views (on groups: the x8 kernel; off them: through a ggml-layout copy),
    GET_ROWS (a copy), each against the float64 oracle of the rows written; a rewrite of the
    weights between computes is seen; a graph op writing into the buffer is refused."""
    from accelplane.runtime.alloc import alloc_tensors

    rng = np.random.default_rng(int(t))
    m, k, n = 29, 64, 3
    wb, wf = make_weights(t, m, k, rng)
    dev, ctx, w, buf = _repack_buffer_tensors(t, (k, m))
    x = ctx.new_tensor_ne(T.F32, k, n, name="x")
    ids = ctx.new_tensor_ne(T.I32, 4, name="ids")
    rb = w.nb[1]
    views = {(0, m): w, (8, 21): ctx.view(w, (k, 13), None, 8 * rb),
             (16, 24): ctx.view(w, (k, 8), None, 16 * rb),
             (3, 11): ctx.view(w, (k, 8), None, 3 * rb)}  # fmt: skip
    outs = {key: ctx.mul_mat(v, x) for key, v in views.items()}
    rows = ctx.get_rows(w, ids)
    graph = ctx.graph(*outs.values(), rows)
    hbuf = alloc_tensors([x, ids, *graph.nodes], dev.buffer_type)
    be = dev.new_backend()
    try:
        for _rewrite in range(2):
            w.set_bytes(wb.reshape(-1))
            xv = rng.standard_normal((n, k)).astype(np.float32)
            x.set(xv)
            idv = np.array([28, 0, 9, 9], np.int32)
            ids.set(idv)
            be.compute(graph)
            for (r0, r1), o in outs.items():
                check_product(o.get().reshape(n, r1 - r0), wf[r0:r1], xv, isa, t)
            np.testing.assert_allclose(rows.get().reshape(4, k), wf[idv], rtol=1e-6, atol=1e-7)
            np.testing.assert_array_equal(w.get_bytes(), wb.reshape(-1))
            wb, wf = make_weights(t, m, k, rng)
        bad = ctx.graph(ctx.set_rows(w, ctx.get_rows(w, ids), ids))
        new = [n for n in bad.nodes if n.buffer is None and n.view_src is None]
        extra = alloc_tensors(new, dev.buffer_type)
        try:
            with pytest.raises(ComputeError, match="CPU_REPACK"):
                be.compute(bad)
        finally:
            if extra is not None:
                extra.free()
    finally:
        be.free()
        hbuf.free()
        buf.free()


# --- configuration -------------------------------------------------------------------------


def test_isa_env_var_selects_portable() -> None:
    src = str(Path(kernels.__file__).resolve().parents[2])
    env = dict(os.environ, ACCELPLANE_CPU_ISA="portable")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    code = "from accelplane.cpu import kernels; print(kernels.get_isa())"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "portable"


def test_set_isa_falls_back_to_the_best_level_below() -> None:
    levels = ["portable", "avx2", "avx2-vnni", "avx512"]
    have = [True, kernels.has_avx2(), kernels.has_avx2_vnni(), kernels.has_avx512()]
    assert have == sorted(have, reverse=True)  # each level needs the ones below it
    best = max(i for i, h in enumerate(have) if h)
    before = kernels.get_isa()
    try:
        assert kernels.set_isa("auto") == levels[best]
        for i, name in enumerate(levels):
            assert kernels.set_isa(name.upper()) == levels[min(i, best)]
            assert kernels.get_isa() == levels[min(i, best)]
    finally:
        kernels.set_isa(before)


def test_set_isa_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="unknown CPU kernel ISA"):
        kernels.set_isa("avx1024")


def test_default_threads_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELPLANE_NTHREADS", "3")
    assert kernels.default_threads() == 3
    for bad in ("zero", "0", "-2", "3.5"):
        monkeypatch.setenv("ACCELPLANE_NTHREADS", bad)
        with pytest.raises(ConfigError, match="ACCELPLANE_NTHREADS"):
            kernels.default_threads()
    monkeypatch.setenv("ACCELPLANE_NTHREADS", "")
    mask = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    assert kernels.default_threads() == len(mask)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity masks here")
def test_default_threads_follow_the_affinity_mask() -> None:
    """A process pinned to one CPU (taskset, a container's cpuset) runs one kernel thread by
    default, and the CPU device says so, whatever the machine's CPU count."""
    cpu = min(os.sched_getaffinity(0))
    code = ("import accelplane; from accelplane.cpu import kernels; print(kernels.default_threads(), "
            "accelplane.get_registry().device('CPU').description)")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "ACCELPLANE_NTHREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, {cpu})).stdout  # fmt: skip
    assert out.split()[0] == "1"
    assert out.rstrip().endswith("(1 threads)"), out


# --- bad input raises typed errors ---------------------------------------------------------


def _q4(m: int = 4, k: int = 64) -> np.ndarray:
    return make_weights(T.Q4_0, m, k, np.random.default_rng(0))[0]


def test_errors_types() -> None:
    w, x, out = _q4(), np.zeros((2, 64), np.float32), np.zeros((2, 4), np.float32)
    with pytest.raises(TypeMismatchError, match="x must be float32"):
        kernels.mul_mat(T.Q4_0, w, x.astype(np.float64), out)
    with pytest.raises(TypeMismatchError, match="out must be float32"):
        kernels.mul_mat(T.Q4_0, w, x, out.astype(np.float16))
    with pytest.raises(TypeMismatchError, match="do not handle"):
        kernels.mul_mat(T.I32, w, x, out)
    with pytest.raises(TypeMismatchError):
        kernels.mul_mat("iq2_xxs", w, x, out)
    with pytest.raises(TypeMismatchError, match="dtype"):
        kernels.mul_mat(T.Q4_0, np.zeros((4, 64), np.float32), x, out)
    with pytest.raises(TypeMismatchError, match="dtype"):
        kernels.mul_mat(T.F16, np.zeros((4, 64), np.float32), x, out)
    with pytest.raises(TypeMismatchError, match="numpy array"):
        kernels.mul_mat(T.Q4_0, w.tolist(), x, out)  # type: ignore[arg-type]


def test_errors_shapes() -> None:
    w, x, out = _q4(), np.zeros((2, 64), np.float32), np.zeros((2, 4), np.float32)
    with pytest.raises(ShapeError, match="whole number"):
        kernels.mul_mat(T.Q4_0, w[:, :35], x, out)
    with pytest.raises(ShapeError, match="hold 64 elements"):
        kernels.mul_mat(T.Q4_0, w, np.zeros((2, 96), np.float32), out)
    with pytest.raises(ShapeError, match="out must have shape"):
        kernels.mul_mat(T.Q4_0, w, x, np.zeros((4, 2), np.float32))
    with pytest.raises(ShapeError, match="2-D"):
        kernels.mul_mat(T.Q4_0, w.reshape(-1), x, out)
    with pytest.raises(ShapeError, match="2-D"):
        kernels.mul_mat(T.Q4_0, w, x[0], out)
    with pytest.raises(ShapeError, match="contiguous rows"):
        kernels.mul_mat(T.F32, np.zeros((4, 128), np.float32)[:, ::2], x, out)
    with pytest.raises(ShapeError, match="contiguous rows"):
        kernels.mul_mat(T.Q4_0, w[::-1], x, out)
    with pytest.raises(ShapeError, match="read-only"):
        out.flags.writeable = False
        kernels.mul_mat(T.Q4_0, w, x, out)
    with pytest.raises(ShapeError, match="whole number"):
        kernels.dequantize(T.Q4_0, np.zeros((2, 10), np.uint8)[:, :9], np.zeros((2, 16)))
    with pytest.raises(TypeMismatchError, match="out must be float32"):
        kernels.dequantize(T.Q4_0, w, np.zeros((4, 64)))


def test_errors_ranges() -> None:
    w = _q4()
    out = np.zeros((2, 64), np.float32)
    with pytest.raises(OutOfRangeError, match="row index 4"):
        kernels.dequantize(T.Q4_0, w, out, rows=[0, 4])
    with pytest.raises(OutOfRangeError, match="row index -1"):
        kernels.dequantize(T.Q4_0, w, out, rows=np.array([-1, 0]))
    with pytest.raises(TypeMismatchError, match="integers"):
        kernels.dequantize(T.Q4_0, w, out, rows=np.array([0.0, 1.0]))
    with pytest.raises(OutOfRangeError, match="nthreads"):
        kernels.dequantize(T.Q4_0, w, np.zeros((4, 64), np.float32), nthreads=0)


def test_c_backstop_checks_extents() -> None:
    """The C entry points refuse sizes that would read or write past the given extents."""
    lib, ffi = kernels._lib, kernels._ffi
    w = np.zeros((4, 36), np.uint8)  # 4 rows of 2 Q4_0 blocks
    x = np.zeros((2, 64), np.float32)
    y = np.zeros((2, 4), np.float32)
    wp = ffi.cast("const void *", w.ctypes.data)
    xp = ffi.cast("const float *", x.ctypes.data)
    yp = ffi.cast("float *", y.ctypes.data)
    args = (wp, 36, w.size, 4, 64, xp, 64, x.size, 2, yp, 4, y.size, 1)
    assert lib.ap_mul_mat(int(T.Q4_0), *args) == 0
    bad_w = (wp, 36, w.size - 1, *args[3:])
    assert lib.ap_mul_mat(int(T.Q4_0), *bad_w) == -4
    bad_x = (*args[:7], x.size - 1, *args[8:])
    assert lib.ap_mul_mat(int(T.Q4_0), *bad_x) == -4
    bad_y = (*args[:11], y.size - 1, 1)
    assert lib.ap_mul_mat(int(T.Q4_0), *bad_y) == -4
    assert lib.ap_mul_mat(int(T.Q4_0), wp, 36, w.size, 4, 48, *args[5:]) == -1  # K % 32
    assert lib.ap_mul_mat(99, *args) == -2
    assert lib.ap_mul_mat(int(T.Q4_0), wp, 36, w.size, 4, 64, xp, 64, x.size, 2, yp, 3,
                          y.size, 1) == -1  # fmt: skip  # rows of y overlap
    big = 1 << 62
    assert lib.ap_mul_mat(int(T.Q4_0), wp, big, w.size, 4, 64, *args[5:]) == -4  # overflow
    idx = np.array([0, 4], np.int64)
    yd = np.zeros((2, 64), np.float32)
    ip = ffi.cast("const int64_t *", idx.ctypes.data)
    ydp = ffi.cast("float *", yd.ctypes.data)
    assert lib.ap_dequantize(int(T.Q4_0), wp, 36, w.size, 4, 64, ip, 2, ydp, 64, yd.size, 1) == -4
    idx[1] = 3
    assert lib.ap_dequantize(int(T.Q4_0), wp, 36, w.size, 4, 64, ip, 2, ydp, 64, yd.size, 1) == 0


def test_report_worst_nmse() -> None:
    """Print the worst mat-mul NMSE seen per (path, type) by the tests above."""
    if not WORST:
        pytest.skip("no mul_mat test ran")
    print("\nworst NMSE vs float64 oracle (threshold 5e-4):")
    for (isa_name, tname), err in sorted(WORST.items()):
        print(f"  {isa_name:8s} {tname:5s} {err:.2e}")
    assert max(WORST.values()) <= NMSE_MAX


# --- row kernels (norm, soft_max, swiglu, rope) -----------------------------------------------


def _padded_rows(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """rows x n float32 with a row stride of n + 5 (evenly spaced, not contiguous)."""
    return rng.standard_normal((rows, n + 5)).astype(np.float32)[:, :n]


@pytest.mark.parametrize("op", [0, 1, 2])
@pytest.mark.parametrize("w_rows", [0, 1, 6])
def test_norm_rows(op: int, w_rows: int) -> None:
    from accelplane.testing.fusion import norm_oracle

    rng = np.random.default_rng([op, w_rows])
    x = _padded_rows(rng, 6, 67)
    y = np.full((6, 67), np.nan, np.float32)
    w = _padded_rows(rng, w_rows, 67) if w_rows else None
    call = kernels.prepare_norm(op, x, y, 1e-6, w)
    assert call is not None
    call()
    want = norm_oracle(["NORM", "RMS_NORM", "L2_NORM"][op], x, 1e-6) * (w if w is not None else 1.0)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m32", [(1, 1), (1, 3), (2, 1), (2, 3)])
def test_soft_max_rows(m32, isa) -> None:
    """Mask planes broadcast over ne2 and ne3 by repetition; a mask with more rows than x uses
    its first ne1; -inf masks whole key ranges; scores up to +-60 stress exp's range."""
    m3, m2 = m32
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((4, 6, 5, 40)) * 30).astype(np.float32)
    mask = rng.standard_normal((m3, m2, 7, 40 + 5)).astype(np.float32)[..., :40]  # padded rows
    mask[..., 30:] = -np.inf
    mask[..., 0, :4] = -np.inf
    y = np.empty_like(x)
    kernels.prepare_soft_max(x, y, 0.5, mask)()
    z = x.astype(np.float64) * 0.5 + np.tile(mask[:, :, :5], (4 // m3, 6 // m2, 1, 1))
    e = np.exp(z - z.max(-1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_exp_in_row_kernels_over_floats_range(isa) -> None:
    """The inline exp of the row kernels, through SWIGLU (x / (1 + exp(-x)) * g): relative error of
    a few ulps over the whole range where the result is a normal float, 0 and inf at the ends,
    NaN kept."""
    x = np.concatenate([np.linspace(-100, 100, 40001), [-np.inf, np.inf, 0.0, -0.0, 87.0, -87.0, 88.5]])
    x = x.astype(np.float32).reshape(1, -1)
    g = np.ones_like(x)
    y = np.empty_like(x)
    kernels.prepare_swiglu(x, g, y)()
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float64) / (1 + np.exp(-x.astype(np.float64)))
    fin = np.isfinite(want) & (x > -88.7)  # below, exp(-x) overflows float32 and the result is -0
    assert np.max(np.abs(y[fin] - want[fin]) / np.maximum(np.abs(want[fin]), 1e-38)) < 5e-7
    assert np.all(y[(x < -88.8) & (x > -np.inf)] == 0) and y[0, -6] == np.inf  # (-inf / inf: NaN)
    xn = np.array([[np.nan, 1.0]], np.float32)
    yn = np.empty_like(xn)
    kernels.prepare_swiglu(xn, np.ones_like(xn), yn)()
    assert np.isnan(yn[0, 0]) and yn[0, 1] == pytest.approx(1 / (1 + np.exp(-1.0)), rel=1e-6)


def test_gelu_erf_over_floats_range(isa) -> None:
    """The exact GELU against float64 math.erfc: relative error under 1e-6 where |x| <= 9 (down to
    results of 1e-18 in the negative tail), exact x for large x, 0 for very negative x, NaN
    kept."""
    import math

    x = np.concatenate([np.linspace(-9, 9, 90001), [0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, 1e30, -1e30]])
    x = x.astype(np.float32)
    y = kernels.gelu_erf(x)
    want = np.array([0.5 * float(v) * math.erfc(-float(v) / math.sqrt(2)) for v in x])
    m = np.abs(want) > 1e-37
    assert np.max(np.abs(y[m] - want[m]) / np.abs(want[m])) < 1e-6
    assert y[-4] == 30.0 and y[-2] == np.float32(1e30) and y[-1] == 0 and y[-3] == 0
    assert np.isnan(kernels.gelu_erf(np.array([np.nan], np.float32))[0])


def test_swiglu_rows() -> None:
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 2 * 33)).astype(np.float32) * 8  # exp(-x) overflows for some
    y = np.empty((4, 33), np.float32)
    kernels.prepare_swiglu(a[:, :33], a[:, 33:], y)()
    x, g = a[:, :33].astype(np.float64), a[:, 33:]
    np.testing.assert_allclose(y, x / (1 + np.exp(-x)) * g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("neox", [False, True])
def test_rope_rows(neox: bool) -> None:
    rng = np.random.default_rng(4)
    ntok, nhead, hd, n_dims = 3, 4, 24, 16
    x = rng.standard_normal((ntok, nhead, hd + 8)).astype(np.float32)[:, :, :hd]  # padded heads
    y = np.empty((ntok, nhead, hd), np.float32)
    th = rng.uniform(0, 6, (ntok, n_dims // 2))
    c, s = np.cos(th).astype(np.float32), np.sin(th).astype(np.float32)
    kernels.prepare_rope(x, y, n_dims, neox)(c, s)
    want = x.astype(np.float64).copy()
    cc, ss = c[:, None, :], s[:, None, :]
    i0, i1 = (
        (slice(0, n_dims // 2), slice(n_dims // 2, n_dims))
        if neox
        else (slice(0, n_dims, 2), slice(1, n_dims, 2))
    )
    a, b = x[..., i0].astype(np.float64), x[..., i1].astype(np.float64)
    want[..., i0], want[..., i1] = a * cc - b * ss, a * ss + b * cc
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ShapeError):
        kernels.prepare_rope(x, y, n_dims, neox)(c[:1], s[:1])  # angles for one token of three


def test_row_kernels_decline_other_layouts() -> None:
    x = np.zeros((4, 8), np.float32)
    assert kernels.rows_view(x[:, ::2]) is None  # inner stride 2
    assert kernels.rows_view(np.zeros((4, 8), np.float64)) is None
    assert kernels.rows_view(np.zeros((3, 4, 8), np.float32)[:, :2]) is None  # uneven rows
    assert kernels.prepare_norm(1, x[:, ::2], np.zeros((4, 4), np.float32), 1e-6) is None
    assert kernels.prepare_swiglu(x, x[:3], np.zeros((4, 8), np.float32)) is None
    assert kernels.prepare_rope(np.zeros((2, 8), np.float32), np.zeros((2, 8), np.float32), 8, False) is None


@pytest.mark.parametrize(("env", "want"), [({"ACCELPLANE_CPU_SPIN": "123", "GOMP_SPINCOUNT": "7"}, "123"),
                                          ({"GOMP_SPINCOUNT": "7"}, "7")])  # fmt: skip
def test_cpu_spin_sets_the_openmp_spin_count(env: dict[str, str], want: str) -> None:
    """ACCELPLANE_CPU_SPIN is what the OpenMP runtime reads when the kernels load; without it a
    GOMP_SPINCOUNT the user set is kept."""
    base = {k: v for k, v in os.environ.items() if k not in ("ACCELPLANE_CPU_SPIN", "GOMP_SPINCOUNT")}
    code = "import os, accelplane.cpu.kernels; print(os.environ['GOMP_SPINCOUNT'])"
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert out.stdout.strip() == want


@pytest.mark.parametrize("n_set", [1, 3], ids=["one-row", "rows"])
@pytest.mark.parametrize("t", [T.F32, T.F16], ids=str)
def test_plugin_set_rows_checks_its_indices(t: GGMLType, n_set: int) -> None:
    """SET_ROWS on the CPU plugin writes each source row at its index (one row: a decode's KV
    cache write) and refuses an index outside the destination, negative ones included, with a
    ComputeError, leaving the destination as it was."""
    import accelplane as ap
    from accelplane.core.graph import Context
    from accelplane.runtime.alloc import alloc_tensors

    dev = ap.device("CPU")
    ctx = Context()
    dst = ctx.new_tensor_ne(t, 16, 6, name="dst")
    src = ctx.new_tensor_ne(T.F32, 16, n_set, name="src")
    idx = ctx.new_tensor_ne(T.I32, n_set, name="idx")
    graph = ctx.graph(ctx.set_rows(dst, src, idx))
    buf = alloc_tensors([dst, src, idx, *graph.nodes], dev.buffer_type)
    be = dev.new_backend()
    dt = np.float32 if t == T.F32 else np.float16
    try:
        before = np.arange(96, dtype=np.float32).reshape(6, 16)
        dst.set(before.astype(dt))
        sv = np.random.default_rng(n_set).standard_normal((n_set, 16)).astype(np.float32)
        src.set(sv)
        rows = np.array([4, 0, 5][:n_set], np.int32)
        idx.set(rows)
        be.compute(graph)
        want = before.astype(dt).astype(np.float32)
        want[rows] = sv.astype(dt).astype(np.float32)
        np.testing.assert_array_equal(dst.get().reshape(6, 16), want)
        for bad in (6, -1):
            dst.set(before.astype(dt))
            idx.set(np.array([bad, 0, 1][:n_set], np.int32))
            with pytest.raises(ComputeError, match="out of range"):
                be.compute(graph)
            np.testing.assert_array_equal(dst.get().reshape(6, 16), before.astype(dt).astype(np.float32))
    finally:
        buf.free()


@pytest.mark.parametrize("idt", [np.int32, np.int64], ids=lambda d: d.__name__)
@pytest.mark.parametrize("dt", [np.float32, np.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("n", [1, 37], ids=["one-element-rows", "rows"])
def test_prepare_set_rows(dt: type, idt: type, n: int, isa: str) -> None:
    """kernels.prepare_set_rows against numpy's assignment (f16: round to nearest even, checked
    on values halfway between two f16), with one-element rows (a transposed V cache's column
    write) and strided destination rows; an index outside the rows writes nothing."""
    rng = np.random.default_rng(n)
    base = np.zeros((40, n + 3), dt)
    dst = base[:, :n]
    src = rng.standard_normal((9, n)).astype(np.float32)
    src[0, 0] = np.float32(1 + 2.0**-11)  # halfway between two f16: rounds to even (1.0)
    idx = rng.permutation(40)[:9].astype(idt)
    call = kernels.prepare_set_rows(dst, src, idx, "t")
    assert call is not None
    call()
    want = np.zeros((40, n + 3), dt)
    want[idx, :n] = src.astype(dt)
    np.testing.assert_array_equal(base, want)
    for bad in (40, -1):
        idx[4] = bad
        before = base.copy()
        with pytest.raises(ComputeError, match="out of range"):
            call()
        np.testing.assert_array_equal(base, before)


@pytest.mark.parametrize("layout", ["apart", "reused", "over_order"])
def test_prepare_moe_topk(layout: str) -> None:
    """kernels.prepare_moe_topk against numpy: the stable descending order with NaN last (as
    np.argsort of -p), the top-k probabilities, their double sum and the renormalized weights;
    "reused" places total and normed in p's memory and normed in w's, "over_order" total in
    order's, as the allocator may (those are dead by then)."""
    rng = np.random.default_rng(5)
    t, e, k = 7, 16, 4
    p = rng.random((t, e)).astype(np.float32)
    p[1, [3, 9, 12]] = p[1].max() + 1  # ties: kept in index order
    p[2, 5] = np.nan
    want_o = np.argsort(-p, axis=1, kind="stable").astype(np.int32)
    want_w = np.take_along_axis(p, want_o[:, :k], 1)
    want_t = want_w.astype(np.float64).sum(1).astype(np.float32)
    want_n = want_w / want_t[:, None]
    order, w = np.empty((t, e), np.int32), np.empty((t, k), np.float32)
    if layout == "apart":
        total, normed = np.empty(t, np.float32), np.empty((t, k), np.float32)
    elif layout == "reused":
        total, normed = p.reshape(-1)[:t], w
    else:
        total, normed = order.reshape(-1)[:t].view(np.float32), np.empty((t, k), np.float32)
    pin = p.copy()
    call = kernels.prepare_moe_topk(p, order, w, total, normed)
    assert call is not None
    call()
    if layout != "over_order":
        np.testing.assert_array_equal(order, want_o)
    np.testing.assert_array_equal(total, want_t)
    np.testing.assert_array_equal(normed, want_n)
    if layout == "apart":
        np.testing.assert_array_equal(w, want_w)
        np.testing.assert_array_equal(p, pin)
    inside = order.reshape(-1)[: t * k].view(np.float32).reshape(t, k)  # contiguous, in order's memory
    assert kernels.prepare_moe_topk(p, order, inside) is None
    assert kernels.prepare_moe_topk(p, order, np.empty((t, e + 1), np.float32)) is None  # k > E
    assert kernels.prepare_moe_topk(p, order[:, :4], w) is None  # order's shape


@pytest.mark.parametrize("k", [128, 224, 2048 + 96])
def test_avx512_q4_0_matvec(k: int) -> None:
    """The avx512 level's Q4_0 mat-vec (four blocks per zmm register, 18-byte blocks gathered at
    any alignment, the last K % 128 one block at a time) over padded rows with poisoned padding,
    random and extreme quants (every nibble 0 or 15, activations quantized to +-127): against the
    float64 oracle, and within float rounding of the avx2-vnni level's products, which sum the
    same integers in another order."""
    if not kernels.has_avx512():
        pytest.skip("CPU has no AVX-512 F+BW+VL+VNNI+VBMI")
    rng = np.random.default_rng(k)
    m = 37
    w, _ = make_weights(T.Q4_0, m, k, rng, pad=5)
    quant = np.flatnonzero(np.arange(w.shape[1]) % 18 >= 2)  # the nibble bytes (not the scales)
    w[::3, quant] = 0x00
    w[1::3, quant] = 0xFF
    wf = gguf_quants.dequantize(np.ascontiguousarray(w), gguf.GGMLQuantizationType.Q4_0)
    x = rng.standard_normal((1, k)).astype(np.float32)
    x[0, ::2] = np.abs(x[0]).max()
    before = kernels.get_isa()
    outs = {}
    try:
        for name in ("avx512", "avx2-vnni"):
            assert kernels.set_isa(name) == name
            out = np.full((1, m), np.nan, np.float32)
            outs[name] = kernels.mul_mat(T.Q4_0, w, x, out, 1, strategy="direct")
    finally:
        kernels.set_isa(before)
    check_product(outs["avx512"], wf.astype(np.float64), x, "avx512", T.Q4_0)
    scale = np.abs(x).astype(np.float64) @ np.abs(wf.astype(np.float64)).T
    assert np.all(np.abs(outs["avx512"] - outs["avx2-vnni"]) <= 1e-6 * scale)
