"""MUL_MAT / MUL_MAT_ID on the emulated HTP: the tile kernel against an independent numpy
model of its arithmetic, repacked weights against plain ones (bit for bit), both against the
float64 oracle, and the error that fp16 per-tile accumulation costs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from accelplane.conformance.cases import all_cases
from accelplane.conformance.runner import graph_supported, init_leaf
from accelplane.core.graph import Context
from accelplane.core.types import GGMLType
from accelplane.errors import ComputeError
from accelplane.oracle import reference
from accelplane.oracle.compare import compare, nmse
from accelplane.runtime.alloc import GraphAllocator

from accelplane_hexagon.isa import hvx

T = GGMLType
MM_NMSE = 5e-4  # the conformance suite's threshold for matrix products


# --- the tile kernel, modelled in numpy ---------------------------------------------------------
def _tile_weights(tile: np.ndarray, q4: bool) -> np.ndarray:
    """[32 rows, 32 K] int8 values of one tile, decoded from the byte map in htp-tile.h."""
    if q4:
        b = tile[:512].reshape(4, 32, 4)  # [v, r, j]
        lo, hi = (b & 15).astype(np.int64) - 8, (b >> 4).astype(np.int64) - 8
        lo, hi = lo.transpose(1, 0, 2).reshape(32, 16), hi.transpose(1, 0, 2).reshape(32, 16)
        return np.concatenate([lo, hi], axis=1)
    return tile[:1024].view(np.int8).reshape(8, 32, 4).transpose(1, 0, 2).reshape(32, 32).astype(np.int64)


def _model(case: hvx.TileCase) -> hvx.TileResult:
    tb, qb = (576, 512) if case.q4 else (1088, 1024)
    tiles = case.tiles.reshape(case.n_kt, tb)
    isum = np.zeros((case.n_x, case.n_kt, 32), np.int32)
    out16 = np.zeros((case.n_x, 32), np.float32)
    out32 = np.zeros((case.n_x, 32), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for n in range(case.n_x):
            a16 = np.zeros(32, np.float16)
            a32 = np.zeros(32, np.float32)
            for kt in range(case.n_kt):
                x = case.xq[n, kt * 32 : kt * 32 + 32].astype(np.int64)
                s = (_tile_weights(tiles[kt], case.q4) @ x).astype(np.int32)
                isum[n, kt] = s
                dw = tiles[kt, qb:].copy().view(np.float16).astype(np.float32)
                dx = np.float32(case.xd[n, kt : kt + 1].view(np.float16)[0])
                v = s.astype(np.float32) * (dw * dx)
                a16 = (a16.astype(np.float32) + v.astype(np.float16).astype(np.float32)).astype(np.float16)
                a32 = a32 + v
            out16[n], out32[n] = a16.astype(np.float32), a32
    return hvx.TileResult(isum, out16.view(np.uint32), out32.view(np.uint32))


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-equal float32 words, NaN matching any NaN (numpy keeps NaN payloads, the C code
    makes them canonical)."""
    fa, fb = a.view(np.float32), b.view(np.float32)
    return bool(np.all((a == b) | (np.isnan(fa) & np.isnan(fb))))


@pytest.mark.parametrize("q4", [False, True], ids=["q8_0", "q4_0"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tile_kernel_matches_numpy_model(q4, seed):
    case = hvx.fixed_case(q4, n_kt=4 + seed, n_x=3, seed=seed)
    got, want = hvx.run_host(case), _model(case)
    assert np.array_equal(got.isum, want.isum)
    assert _same(got.out16, want.out16)
    assert _same(got.out32, want.out32)
    over = ~np.isfinite(got.out16.view(np.float32)) & np.isfinite(got.out32.view(np.float32))
    assert over.any(), "the fixed inputs are meant to overflow some fp16 accumulators"


# --- whole ops: repacked vs plain vs oracle ------------------------------------------------------
def _mul_mat(ctx, ty, k, m, n, a_batch=(1, 1), b_batch=(1, 1), tb=T.F32):
    w = ctx.new_tensor_ne(ty, k, m, *a_batch, name="w")
    x = ctx.new_tensor_ne(tb, k, n, *b_batch, name="x")
    return w, x, ctx.mul_mat(w, x)


MM_SHAPES = [  # k, m, n, a batch, b batch, activation type
    (256, 70, 5, (1, 1), (1, 1), T.F32),
    (96, 33, 130, (1, 1), (1, 1), T.F32),  # more activation rows than one pass holds (64)
    (64, 16, 3, (2, 1), (4, 3), T.F16),  # broadcast weights over activation batches
    (32, 1, 1, (1, 1), (1, 1), T.F32),
]


@pytest.mark.parametrize("ty", [T.Q4_0, T.Q8_0], ids=str)
@pytest.mark.parametrize("shape", MM_SHAPES, ids=lambda s: f"k{s[0]}m{s[1]}n{s[2]}")
def test_mul_mat_repacked_equals_plain(htp, repack, backend, placed, rng, ty, shape):
    k, m, n, ab, bb, tb = shape
    ctx = Context()
    w_t, x_t, y_t = _mul_mat(ctx, ty, k, m, n, ab, bb, tb)
    w_p, x_p, y_p = _mul_mat(ctx, ty, k, m, n, ab, bb, tb)
    placed.put(repack, w_t)
    placed.put(htp.buffer_type, w_p, x_t, y_t, x_p, y_p)
    assert htp.supports_op(y_t) and htp.supports_op(y_p)
    w = rng.uniform(-1, 1, w_t.shape)
    x = rng.uniform(-1, 1, x_t.shape)
    for wt, xt in ((w_t, x_t), (w_p, x_p)):
        wt.set(w)
        xt.set(x)
    g_t, g_p = ctx.graph(y_t), ctx.graph(y_p)
    backend.compute(g_t)
    backend.compute(g_p)
    assert np.array_equal(y_t.get(), y_p.get()), "tiled and plain weights must give the same bits"
    want = reference.evaluate(g_t)[y_t].reshape(y_t.shape)
    assert nmse(want, y_t.get()) < MM_NMSE


@pytest.mark.parametrize("ty", [T.Q4_0, T.Q8_0, T.F16, T.F32], ids=str)
@pytest.mark.parametrize("b1", [1, 3])
def test_mul_mat_id(htp, repack, backend, placed, rng, ty, b1):
    n_exp, n_used, n_tok, k, m = 6, 3, 7, 128, 40
    ctx = Context()
    outs = []
    for buft in (repack, htp.buffer_type):
        a = ctx.new_tensor_ne(ty, k, m, n_exp, name="as")
        b = ctx.new_tensor_ne(T.F32, k, b1, n_tok, name="b")
        ids = ctx.new_tensor_ne(T.I32, n_used, n_tok, name="ids")
        y = ctx.mul_mat_id(a, b, ids)
        placed.put(buft, a)
        placed.put(htp.buffer_type, b, ids, y)
        assert htp.supports_op(y)
        outs.append((a, b, ids, y))
    w = rng.uniform(-1, 1, outs[0][0].shape)
    x = rng.uniform(-1, 1, outs[0][1].shape)
    sel = np.stack([rng.permutation(n_exp)[:n_used] for _ in range(n_tok)]).astype(np.int32)
    for a, b, ids, _ in outs:
        a.set(w)
        b.set(x)
        ids.set(sel)
    got = []
    for *_, y in outs:
        g = ctx.graph(y)
        backend.compute(g)
        got.append(y.get())
        assert nmse(reference.evaluate(g)[y].reshape(y.shape), got[-1]) < MM_NMSE
    assert np.array_equal(got[0], got[1])


# BF16 activations are declined (support.py: activations F32/F16), as the real backend does
QUANT_CASES = [c for c in all_cases() if c.op in ("MUL_MAT", "MUL_MAT_ID")
               and ("type_a=q4_0" in c.id or "type_a=q8_0" in c.id)
               and "type_b=bf16" not in c.id]  # fmt: skip


@pytest.mark.parametrize("case", QUANT_CASES, ids=[c.id for c in QUANT_CASES])
def test_conformance_cases_on_repacked_weights(htp, repack, backend, placed, rng, case):
    """The suite places every tensor in the device's default buffer type; these are its
    quantized matmul cases again with the weights in the repack buffer (the tiled path)."""
    ctx = Context(case.id)
    out = case.build(ctx)
    g = ctx.graph(out)
    weights = [t for t in g.leafs if t.name in ("a", "as")]
    placed.put(repack, *weights)
    placed.put(htp.buffer_type, *[t for t in g.leafs if t not in weights])
    GraphAllocator(htp.buffer_type).alloc_graph(g)
    ok, what = graph_supported(htp, g)
    if not ok:
        assert out.src[0].view_src is not None, what  # only sub-views of tiles are refused
        pytest.skip(f"not supported: {what} (a strided view of repacked weights)")
    values = {}
    for t in g.leafs:
        t.set(init_leaf(case, t, rng).reshape(t.shape))
        values[t] = t.get().reshape(tuple(reversed(t.ne)))
    backend.compute(g)
    want = reference.evaluate(g, values)[out]
    ok, err, msg = compare(want, out.get().reshape(tuple(reversed(out.ne))), case.max_nmse, case.exact)
    assert ok, msg


def test_expert_and_row_indices_are_checked(htp, backend, placed):
    ctx = Context()
    a = ctx.new_tensor_ne(T.Q8_0, 32, 4, 2, name="as")
    b = ctx.new_tensor_ne(T.F32, 32, 1, 1, name="b")
    ids = ctx.new_tensor_ne(T.I32, 1, 1, name="ids")
    y = ctx.mul_mat_id(a, b, ids)
    rows = ctx.new_tensor_ne(T.I32, 2, name="rows")
    r = ctx.get_rows(ctx.new_tensor_ne(T.F32, 8, 3, name="table"), rows)
    placed.put(htp.buffer_type, *ctx.tensors, y, r)
    a.set(np.zeros(a.shape))
    b.set(np.zeros(b.shape))
    ids.set(np.array([[2]], np.int32))
    with pytest.raises(ComputeError, match="out of range"):
        backend.compute(ctx.graph(y))
    rows.set(np.array([0, 3], np.int32))
    with pytest.raises(ComputeError, match="out of range"):
        backend.compute(ctx.graph(r))


# --- fp16 accumulation: the measured cost -----------------------------------------------------
def test_fp16_accumulation_error(record_property, capsys):
    """fp16 per-tile accumulators against fp32 ones (same quantized activations), against the
    oracle: the fp16 error grows with K and stays under the suite's 5e-4 for every K the
    plugin claims (support.MAX_MM_K_QUANT). The table is in README.md (tools/hexagon_accuracy.py,
    in a source checkout, measures it)."""
    path = Path(__file__).resolve().parents[3] / "tools" / "hexagon_accuracy.py"
    if not path.exists():
        pytest.skip("tools/hexagon_accuracy.py is part of the source checkout only")
    spec = importlib.util.spec_from_file_location("hexagon_accuracy", path)
    accuracy = sys.modules["hexagon_accuracy"] = importlib.util.module_from_spec(spec)  # for its dataclass
    spec.loader.exec_module(accuracy)
    rows = accuracy.measure(ks=(256, 4096, 14336), m=64, n=4)
    with capsys.disabled():
        print("\n" + accuracy.table(rows))
    for r in rows:
        record_property(f"nmse_fp16[{r.type},k={r.k},{r.dist}]", r.nmse_fp16)
        assert r.nmse_fp16 < MM_NMSE and r.nmse_fp32 < MM_NMSE
        assert r.nmse_fp16 != r.nmse_fp32, "fp16 and fp32 accumulation should differ"
    big = [r for r in rows if r.k == 14336]
    assert all(r.nmse_fp16 > r.nmse_fp32 for r in big), "at long K fp16 accumulation must cost"
