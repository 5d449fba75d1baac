"""MUL_MAT_ID on the GPU (accelplane_cuda.moe): a row at a time for a decode's few tokens (the
register mat-vec's body per (token, slot) for its layouts, else a warp per weight row), and
grouped by expert on the tensor cores for a prefill's many, against float64 numpy on the gguf
package's dequantization."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from accelplane.core.graph import Context
from accelplane.core.types import GGMLType, quantize
from accelplane.errors import ComputeError
from accelplane.runtime.alloc import alloc_tensors
from accelplane.runtime.backend import BufferUsage
from accelplane_cuda.moe import GROUPED_MIN_TOKENS
from test_cuda import _cuda

T = GGMLType
SDK_QUANTIZED = (T.Q4_K, T.Q6_K, T.IQ4_XS)  # gguf cannot quantize these; tests/test_types.py: ggml's bytes
REGISTER_LAYOUTS = (T.Q4_0, T.Q8_0, T.Q4_K)  # in a weights buffer: the register mat-vecs' (matvec.REGISTER)


def _experts(t, rng) -> np.ndarray:
    """Random experts quantized into ``t`` [k, m, n_exp] (gguf's quantizer, else the SDK's); their
    float64 values [n_exp, m, k] (gguf's dequantization)."""
    k, m, e = t.ne[0], t.ne[1], t.ne[2]
    v = rng.standard_normal((e * m, k)).astype(np.float32)
    if t.type in (T.F32, T.F16):
        arr = v.astype(np.float16 if t.type == T.F16 else np.float32)
        t.set(arr.reshape(e, m, k))
        return arr.astype(np.float64).reshape(e, m, k)
    qt = gguf.GGMLQuantizationType[t.type.name]
    raw = (quantize(t.type, v) if t.type in SDK_QUANTIZED else gguf.quantize(v, qt)).reshape(-1)
    t.set_bytes(raw)
    return gguf.dequantize(raw, qt).reshape(e, m, k).astype(np.float64)


def _run(dev, wtype, n_tok, b1, ids_v=None, m=200, k=512, n_exp=16, n_used=4):
    rng = np.random.default_rng(n_tok)
    ctx = Context()
    w = ctx.new_tensor_ne(wtype, k, m, n_exp, name="experts")
    x = ctx.new_tensor_ne(T.F32, k, b1, n_tok, name="x")
    ids = ctx.new_tensor_ne(T.I32, n_used, n_tok, name="ids")
    y = ctx.mul_mat_id(w, x, ids)
    graph = ctx.graph(y)
    wbuf = alloc_tensors([w], dev.buffer_type, BufferUsage.WEIGHTS)  # Q4_0/Q8_0/Q4_K: the x8 layouts
    buf = alloc_tensors([x, ids, *graph.nodes], dev.buffer_type)
    be = dev.new_backend()
    try:
        wv = _experts(w, rng)
        xv = rng.standard_normal((n_tok, b1, k)).astype(np.float32)
        if ids_v is None:
            ids_v = np.stack([rng.permutation(n_exp)[:n_used] for _ in range(n_tok)]).astype(np.int32)
        x.set(xv)
        ids.set(ids_v)
        be.compute(graph)
        names = be.ctx.plans.get(graph).kernel_names
        got = y.get().reshape(n_tok, n_used, m)
    finally:
        be.free()
        buf.free()
        wbuf.free()
    want = np.einsum("tumk,tuk->tum", wv[ids_v], xv.astype(np.float64)[:, np.arange(n_used) % b1])
    return names, got, want


SIZES = [(GROUPED_MIN_TOKENS - 1, 1), (GROUPED_MIN_TOKENS, 4), (64, 1), (300, 4)]  # (tokens, activation rows)


@pytest.mark.parametrize("wtype", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K, T.IQ4_XS, T.F16, T.F32])
@pytest.mark.parametrize("n_tok, b1", SIZES)
def test_mul_mat_id_equals_float64(wtype, n_tok, b1):
    """Experts of every layout family (the x8 ones in a weights buffer, generic block types,
    floats), 200 weight rows (not a whole number of 64-row tiles), the activations shared by the
    slots (b1 = 1, gate/up) or one per slot (down): within F16 rounding of the products."""
    names, got, want = _run(_cuda(), wtype, n_tok, b1)
    if n_tok >= GROUPED_MIN_TOKENS:
        kernel, tol = "k_moe_gemm<", 3e-3  # F16 products
    elif wtype in REGISTER_LAYOUTS:
        kernel, tol = "k_mmv_row1_id<", 2e-2  # int8 activations: ~1 % of a row's scale a step
    else:
        kernel, tol = "k_mul_mat_id<", 1e-4
    assert [n for n in names if n.startswith(("k_moe_gemm<", "k_mmv_row1_id<", "k_mul_mat_id<"))] == [
        n for n in names if n.startswith(kernel)] and any(n.startswith(kernel) for n in names), names
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < tol, (wtype, n_tok, err)


def test_grouped_tiles_span_experts_with_many_rows():
    """Every token choosing the same two experts: each has 300 rows, five 64-row tiles."""
    ids_v = np.tile(np.array([[3, 11]], np.int32), (300, 1))
    _, got, want = _run(_cuda(), T.Q4_0, 300, 1, ids_v=ids_v, n_used=2)
    assert np.abs(got - want).max() / np.abs(want).max() < 3e-3


@pytest.mark.parametrize("wtype, n_tok", [(T.Q4_0, 64), (T.Q4_0, 2), (T.IQ4_XS, 2)])
def test_expert_index_out_of_range_raises(wtype, n_tok):
    """Each kernel (grouped, register, warp per row) flags an id past the experts."""
    ids_v = np.zeros((n_tok, 4), np.int32)
    ids_v[1, 2] = 16  # n_exp is 16
    with pytest.raises(ComputeError, match="out of range"):
        _run(_cuda(), wtype, n_tok, 1, ids_v=ids_v)
