"""The float64 oracle (accelplane.oracle.reference) against hand-computed values, identities and naive
loops written independently of it. No backend is needed: leaf values go in as leaf_values."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from accelplane import Context, GGMLType, Graph, Op, SortOrder
from accelplane.core.ops import RULES, VIEW_OPS
from accelplane.core.types import dequantize
from accelplane.errors import DeviceError, OutOfRangeError
from accelplane.oracle.reference import compute_node, evaluate

RNG = np.random.default_rng(1234)


def f32(*shape) -> np.ndarray:
    """Random values exactly representable in float32 (so F32 leaves hold them unrounded)."""
    return RNG.standard_normal(shape).astype(np.float32).astype(np.float64)


def run(ctx: Context, outputs, leaf_values) -> dict:
    """Evaluate the graph of ``outputs``; values reshaped to each tensor's numpy shape."""
    outputs = outputs if isinstance(outputs, list | tuple) else [outputs]
    res = evaluate(ctx.graph(*outputs), leaf_values)
    for t, v in res.items():
        assert v.shape == tuple(reversed(t.ne))
        assert v.dtype == (np.int64 if t.type == GGMLType.I32 else np.float64)
    return {t: v.reshape(t.shape) for t, v in res.items()}


def one(ctx: Context, out, leaf_values) -> np.ndarray:
    return run(ctx, out, leaf_values)[out]


def q8_0_rows(d: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Raw Q8_0 rows built by hand: d [rows, nblk] scales, q [rows, nblk, 32] int8.
    Returns (uint8 [rows, nblk*34], the values d*q as float64 [rows, nblk*32])."""
    rows, nblk = d.shape
    raw = np.empty((rows, nblk, 34), np.uint8)
    raw[..., :2] = d.astype("<f2").view(np.uint8).reshape(rows, nblk, 2)
    raw[..., 2:] = q.astype(np.int8).view(np.uint8)
    vals = d.astype(np.float16).astype(np.float64)[..., None] * q.astype(np.float64)
    return raw.reshape(rows, nblk * 34), vals.reshape(rows, nblk * 32)


def random_q8_0(rows: int, ne0: int) -> tuple[np.ndarray, np.ndarray]:
    nblk = ne0 // 32
    d = RNG.uniform(0.01, 0.1, (rows, nblk)).astype(np.float16)
    q = RNG.integers(-127, 128, (rows, nblk, 32))
    return q8_0_rows(d, q)


# --- coverage --------------------------------------------------------------------------------
def test_every_op_has_an_oracle():
    from accelplane.oracle import reference

    missing = set(RULES) - set(reference._OPS) - VIEW_OPS
    assert not missing


# --- elementwise -----------------------------------------------------------------------------
def test_binary_broadcast_hand():
    ctx = Context()
    a = ctx.new_tensor("f32", (2, 3))
    b = ctx.new_tensor("f32", (3,))
    c = ctx.new_tensor("f32", (2, 1))
    outs = [ctx.add(a, b), ctx.sub(a, b), ctx.mul(a, c), ctx.div(a, c)]
    va = np.array([[1.0, 2, 3], [4, 5, 6]])
    r = run(ctx, outs, {a: va, b: np.array([10.0, 20, 30]), c: np.array([[2.0], [4.0]])})
    np.testing.assert_array_equal(r[outs[0]], [[11, 22, 33], [14, 25, 36]])
    np.testing.assert_array_equal(r[outs[1]], [[-9, -18, -27], [-6, -15, -24]])
    np.testing.assert_array_equal(r[outs[2]], [[2, 4, 6], [16, 20, 24]])
    np.testing.assert_array_equal(r[outs[3]], [[0.5, 1, 1.5], [1, 1.25, 1.5]])


def test_binary_tiles_not_stretches():
    # b of ne0=2 repeats to ne0=4 as [b0, b1, b0, b1] (ggml_repeat), along every axis
    ctx = Context()
    a = ctx.new_tensor("f32", (2, 2, 4))
    b = ctx.new_tensor("f32", (1, 2, 2))
    out = ctx.add(a, b)
    vb = np.array([[[1.0, 2.0], [3.0, 4.0]]])
    got = one(ctx, out, {a: np.zeros((2, 2, 4)), b: vb})
    np.testing.assert_array_equal(got[1, 0], [1, 2, 1, 2])
    np.testing.assert_array_equal(got[0, 1], [3, 4, 3, 4])


def test_elementwise_hand():
    ctx = Context()
    a = ctx.new_tensor("f32", (5,))
    x = np.array([-2.0, -0.5, 0.0, 0.25, 4.0])
    outs = {
        "scale": ctx.scale(a, 2.0, 1.0),
        "sqr": ctx.sqr(a),
        "clamp": ctx.clamp(a, -1.0, 1.0),
        "leaky": ctx.leaky_relu(a, 0.1),
        "abs": ctx.abs(a),
        "neg": ctx.neg(a),
        "relu": ctx.relu(a),
        "exp": ctx.exp(a),
    }
    r = run(ctx, list(outs.values()), {a: x})
    g = {k: r[t] for k, t in outs.items()}
    np.testing.assert_array_equal(g["scale"], [-3, 0, 1, 1.5, 9])
    np.testing.assert_array_equal(g["sqr"], [4, 0.25, 0, 0.0625, 16])
    np.testing.assert_array_equal(g["clamp"], [-1, -0.5, 0, 0.25, 1])
    np.testing.assert_allclose(g["leaky"], [-0.2, -0.05, 0, 0.25, 4], rtol=1e-7)
    np.testing.assert_array_equal(g["abs"], [2, 0.5, 0, 0.25, 4])
    np.testing.assert_array_equal(g["neg"], [2, 0.5, 0, -0.25, -4])
    np.testing.assert_array_equal(g["relu"], [0, 0, 0, 0.25, 4])
    np.testing.assert_allclose(g["exp"], [math.exp(v) for v in x], rtol=1e-7)


def test_math_functions_hand():
    ctx = Context()
    a = ctx.new_tensor("f32", (3,))
    x = np.array([0.25, 1.0, 4.0])
    outs = [ctx.sqrt(a), ctx.log(a), ctx.sin(a), ctx.cos(a), ctx.tanh(a)]
    r = run(ctx, outs, {a: x})
    np.testing.assert_array_equal(r[outs[0]], [0.5, 1, 2])
    for t, fn in zip(outs[1:], (math.log, math.sin, math.cos, math.tanh), strict=True):
        np.testing.assert_allclose(r[t], [fn(v) for v in x], rtol=1e-7)


def test_activation_values():
    ctx = Context()
    a = ctx.new_tensor("f32", (4,))
    x = np.array([-3.0, -1.0, 1.0, 2.0])
    outs = [ctx.sigmoid(a), ctx.silu(a), ctx.gelu(a), ctx.gelu_quick(a)]
    r = run(ctx, outs, {a: x})
    sig = [1 / (1 + math.exp(-v)) for v in x]
    np.testing.assert_allclose(r[outs[0]], sig, rtol=1e-7)
    np.testing.assert_allclose(r[outs[1]], [v * s for v, s in zip(x, sig, strict=True)], rtol=1e-7)
    # tanh GELU with ggml's constants: gelu(1) = 0.8411919906082768
    gelu = [0.5 * v * (1 + math.tanh(0.7978845608028654 * (v + 0.044715 * v**3))) for v in x]
    np.testing.assert_allclose(r[outs[2]], gelu, rtol=1e-7)
    assert abs(r[outs[2]][2] - 0.8411919906082768) < 1e-7
    np.testing.assert_allclose(r[outs[3]], [v / (1 + math.exp(-1.702 * v)) for v in x], rtol=1e-7)


# ggml's definitions (ggml-cpu/unary-ops.cpp, vec.h), one scalar at a time with the standard library
_GGML_SCALAR = {
    "gelu_erf": lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2))),
    "elu": lambda v: v if v > 0 else math.expm1(v),
    "hardswish": lambda v: v * min(1.0, max(0.0, (v + 3) / 6)),
    "hardsigmoid": lambda v: min(1.0, max(0.0, (v + 3) / 6)),
    "expm1": math.expm1,
    "softplus": lambda v: v if v > 20 else math.log(1 + math.exp(v)),
    "step": lambda v: 1.0 if v > 0 else 0.0,
    "floor": math.floor,
    "ceil": math.ceil,
    "round": lambda v: math.copysign(math.floor(abs(v) + 0.5), v),  # C's roundf
    "trunc": math.trunc,
}


@pytest.mark.parametrize("name", sorted(_GGML_SCALAR))
def test_new_unary_ops_match_ggml_scalar(name):
    x = np.array([-40, -6.5, -3, -2.5, -1.5, -0.5, -1e-6, 0, 1e-6, 0.25, 0.5, 1.5, 2.5, 3, 19.5, 25])
    ctx = Context()
    a = ctx.new_tensor("f32", (x.size,))
    out = getattr(ctx, name)(a)
    got = one(ctx, out, {a: x})
    want = np.array([_GGML_SCALAR[name](v) for v in x], np.float64).astype(np.float32)
    # atol: the literal formulas cancel to 0 in float64 where the oracle keeps e.g. exp(-40)
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=1e-15)


def _unaries(names: tuple[str, ...], x) -> list[np.ndarray]:
    ctx = Context()
    a = ctx.new_tensor("f32", (len(x),))
    outs = [getattr(ctx, n)(a) for n in names]
    r = run(ctx, outs, {a: np.asarray(x, np.float64)})
    return [r[t] for t in outs]


def test_rounding_ops_hand():
    x = [-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.49999997, -0.49999997]
    rnd, flo, cei, tru = _unaries(("round", "floor", "ceil", "trunc"), x)
    np.testing.assert_array_equal(rnd, [-3, -2, -1, 1, 2, 3, 0, 0])  # halves away from zero, not to even
    assert np.signbit(rnd[7]) and np.signbit(tru[2])  # roundf(-0.49...) = truncf(-0.5) = -0
    np.testing.assert_array_equal(flo, [-3, -2, -1, 0, 1, 2, 0, -1])
    np.testing.assert_array_equal(cei, [-2, -1, 0, 1, 2, 3, 1, 0])


def test_new_activations_hand():
    x = [-50, 0, 20, 20.5, 1]
    sp, st, hs, ge, el = _unaries(("softplus", "step", "hardsigmoid", "gelu_erf", "elu"), x)
    want = [math.exp(-50), math.log(2), math.log1p(math.exp(20)), 20.5, math.log1p(math.e)]
    np.testing.assert_allclose(sp, want, rtol=1e-7)  # x itself above 20
    np.testing.assert_array_equal(st, [0, 0, 1, 1, 1])  # 0 at 0
    np.testing.assert_array_equal(hs, np.float32([0, 0.5, 1, 1, 2 / 3]))
    # the exact GELU, not the tanh one: gelu_erf(1) = 0.8413447460685429, gelu(1) = 0.8411919906082768
    assert ge[0] == 0 and abs(ge[4] - 0.8413447460685429) < 1e-7
    assert el[0] == np.float32(math.expm1(-50)) and el[4] == 1
    # ggml's fminf/fmaxf: a NaN input gives hardsigmoid 0 (fmaxf(0, NaN) = 0), hardswish NaN * 0
    hs, hw, st = _unaries(("hardsigmoid", "hardswish", "step"), [np.nan])
    assert hs[0] == 0 and np.isnan(hw[0]) and st[0] == 0


def test_glu_forms():
    ctx = Context()
    a = ctx.new_tensor("f32", (2, 6))
    b = ctx.new_tensor("f32", (2, 6))
    va, vb = f32(2, 6), f32(2, 6)
    outs = [ctx.swiglu(a, b), ctx.swiglu(a), ctx.swiglu(a, swapped=True), ctx.geglu(a),
            ctx.geglu(a, b)]  # fmt: skip
    r = run(ctx, outs, {a: va, b: vb})

    def silu(v):
        return v / (1 + np.exp(-v))

    def gelu(v):
        return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))

    np.testing.assert_allclose(r[outs[0]], silu(va) * vb, rtol=1e-6)
    np.testing.assert_allclose(r[outs[1]], silu(va[:, :3]) * va[:, 3:], rtol=1e-6)
    np.testing.assert_allclose(r[outs[2]], silu(va[:, 3:]) * va[:, :3], rtol=1e-6)
    np.testing.assert_allclose(r[outs[3]], gelu(va[:, :3]) * va[:, 3:], rtol=1e-6)
    np.testing.assert_allclose(r[outs[4]], gelu(va) * vb, rtol=1e-6)
    assert outs[1].shape == (2, 3)


# --- row-wise --------------------------------------------------------------------------------
def test_norms():
    ctx = Context()
    a = ctx.new_tensor("f32", (3, 4, 16))
    z = ctx.new_tensor("f32", (2, 4))
    va = f32(3, 4, 16) * 3 + 1
    outs = [ctx.norm(a, 0.0), ctx.rms_norm(a, 0.0), ctx.l2_norm(a, 0.0), ctx.rms_norm(a, 1e-5)]
    zl2 = ctx.l2_norm(z, 1e-3)
    r = run(ctx, [*outs, zl2], {a: va, z: np.array([[0.0, 0, 0, 0], [3e-4, 4e-4, 0, 0]])})
    n, rms, l2, rms_eps = (r[t] for t in outs)
    np.testing.assert_allclose(n.mean(-1), 0, atol=1e-6)
    np.testing.assert_allclose(n.var(-1), 1, rtol=1e-5)
    np.testing.assert_allclose(np.sqrt((rms**2).mean(-1)), 1, rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(l2, axis=-1), 1, rtol=1e-6)
    ms = (va**2).mean(-1, keepdims=True)
    np.testing.assert_allclose(rms_eps, va / np.sqrt(ms + 1e-5), rtol=1e-6)
    # l2: x / max(||x||, eps): a zero row stays zero, a tiny row divides by eps
    np.testing.assert_allclose(r[zl2], [[0, 0, 0, 0], [0.3, 0.4, 0, 0]], rtol=1e-6)


def test_rms_norm_hand():
    ctx = Context()
    a = ctx.new_tensor("f32", (2,))
    out = ctx.rms_norm(a, 0.0)
    s = math.sqrt(12.5)
    np.testing.assert_allclose(one(ctx, out, {a: np.array([3.0, 4.0])}), [3 / s, 4 / s], rtol=1e-7)


def test_soft_max_rows_sum_to_one_and_mask():
    ctx = Context()
    a = ctx.new_tensor("f32", (2, 4, 3, 8))
    mask = ctx.new_tensor("f16", (1, 2, 5, 8))  # 5 rows >= 3; broadcast over ne3
    va = f32(2, 4, 3, 8)
    vm = np.zeros((1, 2, 5, 8))
    vm[:, :, :, 6:] = -np.inf
    vm[:, 1, 0, 0] = -np.inf
    vm[:, :, 3:, :] = 1e4  # rows beyond a's rows are ignored
    out = ctx.soft_max(a, mask, scale=0.5)
    got = one(ctx, out, {a: va, mask: vm})
    np.testing.assert_allclose(got.sum(-1), 1, rtol=1e-6)
    assert np.all(got[..., 6:] == 0)
    assert np.all(got[:, 1::2, 0, 0] == 0) and np.all(got[:, 0::2, 0, 0] > 0)  # head % 2
    x = va * 0.5 + np.tile(vm[:, :, :3], (2, 2, 1, 1))
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(-1, keepdims=True), rtol=1e-6)


def test_soft_max_alibi_slopes_hand():
    # 3 heads: n_head_log2 = 2, m0 = 2**(-8/2), m1 = 2**(-4/2);
    # slopes: h0 = m0, h1 = m0**2, h2 = m1**1
    ctx = Context()
    a = ctx.new_tensor("f32", (3, 1, 2))
    mask = ctx.new_tensor("f32", (1, 2))
    out = ctx.soft_max(a, mask, scale=1.0, max_bias=8.0)
    got = one(ctx, out, {a: np.zeros((3, 1, 2)), mask: np.array([[0.0, 1.0]])})
    for h, slope in enumerate((1 / 16, 1 / 256, 1 / 4)):
        p1 = 1 / (1 + math.exp(-slope))
        np.testing.assert_allclose(got[h, 0], [1 - p1, p1], rtol=1e-6)


# --- rope ------------------------------------------------------------------------------------
def _rope_graph(mode, n_dims, shape=(3, 2, 10), type_="f32", **kw):
    ctx = Context()
    a = ctx.new_tensor(type_, shape)
    pos = ctx.new_tensor("i32", (shape[0],))
    out = ctx.rope(a, pos, n_dims, mode, **kw)
    return ctx, a, pos, out


def _pairs(x: np.ndarray, mode: int, n_dims: int) -> tuple[np.ndarray, np.ndarray]:
    if mode == 2:
        return x[..., : n_dims // 2], x[..., n_dims // 2 : n_dims]
    return x[..., 0:n_dims:2], x[..., 1:n_dims:2]


@pytest.mark.parametrize("mode", [0, 2])
def test_rope_identities(mode):
    ctx, a, pos, out = _rope_graph(mode, 8)
    va = f32(3, 2, 10)
    got = one(ctx, out, {a: va, pos: np.array([0, 5, 123])})
    np.testing.assert_allclose(got[0], va[0], rtol=1e-6)  # position 0: identity
    np.testing.assert_array_equal(got[..., 8:], va[..., 8:])  # dims beyond n_dims: copied
    g0, g1 = _pairs(got, mode, 8)
    x0, x1 = _pairs(va, mode, 8)
    np.testing.assert_allclose(np.hypot(g0, g1), np.hypot(x0, x1), rtol=1e-5)


@pytest.mark.parametrize("mode", [0, 2])
def test_rope_angles_hand(mode):
    # unit vectors (1, 0) in every pair: the result is (cos theta_i, sin theta_i)
    n_dims, base, p = 6, 100.0, 3
    ctx, a, pos, out = _rope_graph(mode, n_dims, shape=(1, 1, n_dims), freq_base=base,
                                   freq_scale=0.5)  # fmt: skip
    x = np.zeros((1, 1, n_dims))
    if mode == 2:
        x[..., : n_dims // 2] = 1
    else:
        x[..., 0::2] = 1
    got = one(ctx, out, {a: x, pos: np.array([p])})
    g0, g1 = _pairs(got, mode, n_dims)
    for i in range(n_dims // 2):
        theta = 0.5 * p * base ** (-2 * i / n_dims)
        assert abs(g0[0, 0, i] - math.cos(theta)) < 1e-6
        assert abs(g1[0, 0, i] - math.sin(theta)) < 1e-6


@pytest.mark.parametrize("mode", [0, 2])
def test_rope_freq_factors_hand(mode):
    # unit vectors (1, 0) in every pair: pair i turns by pos * base**(-2i/n) / ff[i]
    n_dims, base, p = 6, 100.0, 7
    ff = np.array([1.0, 2.5, 8.0])
    ctx = Context()
    a = ctx.new_tensor("f32", (1, 1, n_dims))
    pos = ctx.new_tensor("i32", (1,))
    fv = ctx.new_tensor("f32", (n_dims // 2,))
    out = ctx.rope(a, pos, n_dims, mode, freq_base=base, freq_factors=fv)
    assert out.src[2] is fv
    x = np.zeros((1, 1, n_dims))
    if mode == 2:
        x[..., : n_dims // 2] = 1
    else:
        x[..., 0::2] = 1
    g0, g1 = _pairs(one(ctx, out, {a: x, pos: np.array([p]), fv: ff}), mode, n_dims)
    for i in range(n_dims // 2):
        theta = p * base ** (-2 * i / n_dims) / ff[i]
        assert abs(g0[0, 0, i] - math.cos(theta)) < 1e-6 and abs(g1[0, 0, i] - math.sin(theta)) < 1e-6


def test_rope_freq_factors_must_fit():
    from accelplane.errors import ShapeError, TypeMismatchError

    ctx = Context()
    a, pos = ctx.new_tensor("f32", (2, 1, 8)), ctx.new_tensor("i32", (2,))
    cases = ((ShapeError, ctx.new_tensor("f32", (3,))), (TypeMismatchError, ctx.new_tensor("f16", (4,))),
             (ShapeError, ctx.new_tensor("f32", (2, 4))))  # too short, not F32, not a vector
    for err, bad in cases:
        with pytest.raises(err, match="ROPE"):
            ctx.rope(a, pos, 8, freq_factors=bad)


def test_rope_neox_is_normal_on_interleaved_dims():
    n = 8
    perm = np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])  # neox slot <- normal dim
    va = f32(3, 2, n)
    vp = np.array([1, 7, 40])
    ctx, a, pos, out = _rope_graph(0, n, shape=(3, 2, n))
    normal = one(ctx, out, {a: va, pos: vp})
    ctx, a, pos, out = _rope_graph(2, n, shape=(3, 2, n))
    neox = one(ctx, out, {a: va[..., perm], pos: vp})
    np.testing.assert_allclose(neox, normal[..., perm], rtol=1e-6, atol=1e-6)


def test_rope_yarn():
    # n_dims 64, n_ctx_orig 4096, base 1e4: corr dims = [10, 23] (floor / ceil of
    # 64*ln(4096/(2*pi*beta))/(2*ln 1e4) for beta 32 and 1)
    n_dims, n_ctx, base, fs, p = 64, 4096, 10000.0, 0.25, 1000
    lo = math.floor(n_dims * math.log(n_ctx / (32 * 2 * math.pi)) / (2 * math.log(base)))
    hi = math.ceil(n_dims * math.log(n_ctx / (1 * 2 * math.pi)) / (2 * math.log(base)))
    assert (lo, hi) == (10, 23)
    ctx, a, pos, out = _rope_graph(0, n_dims, shape=(1, 1, n_dims), n_ctx_orig=n_ctx,
                                   freq_base=base, freq_scale=fs, ext_factor=1.0,
                                   attn_factor=1.0)  # fmt: skip
    x = np.zeros((1, 1, n_dims))
    x[..., 0::2] = 1
    got = one(ctx, out, {a: x, pos: np.array([p])})
    g0, g1 = got[0, 0, 0::2], got[0, 0, 1::2]
    mscale = 1 + 0.1 * math.log(1 / fs)
    np.testing.assert_allclose(np.hypot(g0, g1), mscale, rtol=1e-6)
    for i in range(n_dims // 2):
        extrap = p * base ** (-2 * i / n_dims)
        interp = fs * extrap
        ramp = 1 - min(1.0, max(0.0, (i - lo) / (hi - lo)))  # 1 below lo, 0 above hi
        theta = interp * (1 - ramp) + extrap * ramp
        if i <= lo:
            assert theta == extrap
        if i >= hi:
            assert theta == interp
        np.testing.assert_allclose(
            [g0[i], g1[i]], [mscale * math.cos(theta), mscale * math.sin(theta)], atol=2e-6
        )


def test_rope_attn_factor_and_no_ctx():
    # attn_factor scales the rotated dims only; ext_factor with n_ctx_orig=0 must not fail
    ctx, a, pos, out = _rope_graph(0, 4, shape=(2, 1, 6), attn_factor=2.0)
    va = f32(2, 1, 6)
    got = one(ctx, out, {a: va, pos: np.array([0, 0])})
    np.testing.assert_allclose(got[..., :4], 2 * va[..., :4], rtol=1e-6)
    np.testing.assert_array_equal(got[..., 4:], va[..., 4:])
    ctx, a, pos, out = _rope_graph(0, 4, shape=(2, 1, 6), ext_factor=1.0, n_ctx_orig=0)
    assert np.isfinite(one(ctx, out, {a: va, pos: np.array([3, 4])})).all()


def test_rope_f16_result_is_rounded():
    ctx, a, pos, out = _rope_graph(2, 4, shape=(2, 3, 4), type_="f16")
    got = one(ctx, out, {a: f32(2, 3, 4), pos: np.array([1, 2])})
    np.testing.assert_array_equal(got, got.astype(np.float16).astype(np.float64))


# --- matrix products -------------------------------------------------------------------------
def test_mul_mat_broadcast_loops():
    ctx = Context()
    a = ctx.new_tensor("f32", (1, 2, 5, 7))  # [a3, a2, M, K]
    b = ctx.new_tensor("f32", (3, 4, 6, 7))  # [b3, b2, N, K]
    out = ctx.mul_mat(a, b)
    va, vb = f32(1, 2, 5, 7), f32(3, 4, 6, 7)
    got = one(ctx, out, {a: va, b: vb})
    assert got.shape == (3, 4, 6, 5)
    exp = np.zeros((3, 4, 6, 5))
    for i3 in range(3):
        for i2 in range(4):
            for n in range(6):
                for m in range(5):
                    exp[i3, i2, n, m] = sum(
                        vb[i3, i2, n, k] * va[i3 // 3, i2 // 2, m, k] for k in range(7)
                    )
    np.testing.assert_allclose(got, exp, rtol=1e-6, atol=1e-6)


def test_mul_mat_quantized_f16_and_strided_b():
    ctx = Context()
    wq = ctx.new_tensor("q8_0", (3, 64))
    wh = ctx.new_tensor("f16", (3, 64))
    x = ctx.new_tensor("f32", (64, 2))  # used transposed: b = x.T, a non-contiguous view
    xt = ctx.transpose(x)
    outs = [ctx.mul_mat(wq, xt), ctx.mul_mat(wh, xt)]
    raw, wvals = random_q8_0(3, 64)
    vh = f32(3, 64)
    vx = f32(64, 2)
    r = run(ctx, outs, {wq: raw, wh: vh, x: vx})
    np.testing.assert_allclose(r[outs[0]], vx.T @ wvals.T, rtol=1e-6)
    vh16 = vh.astype(np.float16).astype(np.float64)  # an F16 leaf holds f16 values
    np.testing.assert_allclose(r[outs[1]], vx.T @ vh16.T, rtol=1e-6)


def test_mul_mat_id_per_token_loop():
    ctx = Context()
    n_exp, m, k, n_tok, n_used = 4, 3, 5, 6, 2
    w = ctx.new_tensor("f32", (n_exp, m, k))
    b1 = ctx.new_tensor("f32", (n_tok, 1, k))  # one activation row shared by all experts
    b2 = ctx.new_tensor("f32", (n_tok, n_used, k))  # one row per used expert
    ids = ctx.new_tensor("i32", (n_tok, n_used))
    outs = [ctx.mul_mat_id(w, b1, ids), ctx.mul_mat_id(w, b2, ids)]
    vw, v1, v2 = f32(n_exp, m, k), f32(n_tok, 1, k), f32(n_tok, n_used, k)
    vid = RNG.integers(0, n_exp, (n_tok, n_used))
    r = run(ctx, outs, {w: vw, b1: v1, b2: v2, ids: vid})
    for out, vb in zip(outs, (v1, v2), strict=True):
        assert r[out].shape == (n_tok, n_used, m)
        for t in range(n_tok):
            for u in range(n_used):
                row = vb[t, u % vb.shape[1]]
                np.testing.assert_allclose(r[out][t, u], vw[vid[t, u]] @ row, rtol=1e-6)
    with pytest.raises(OutOfRangeError):
        run(ctx, outs, {w: vw, b1: v1, b2: v2, ids: np.full((n_tok, n_used), n_exp)})


# --- rows ------------------------------------------------------------------------------------
def test_get_rows_batched_and_int():
    ctx = Context()
    a = ctx.new_tensor("f32", (2, 5, 3))  # [a2=2, R=5, K=3]
    ai = ctx.new_tensor("i32", (5, 3))
    rows = ctx.new_tensor("i32", (2, 4))  # per batch 4 rows
    rows1 = ctx.new_tensor("i32", (2,))
    outs = [ctx.get_rows(a, rows), ctx.get_rows(ai, rows1)]
    va = f32(2, 5, 3)
    vr = np.array([[4, 0, 0, 2], [1, 1, 3, 4]])
    vi = np.arange(15).reshape(5, 3) * 1000003
    r = run(ctx, outs, {a: va, rows: vr, ai: vi, rows1: np.array([4, 1])})
    for i in range(2):
        np.testing.assert_array_equal(r[outs[0]][i], va[i][vr[i]])
    assert r[outs[1]].dtype == np.int64
    np.testing.assert_array_equal(r[outs[1]], vi[[4, 1]])
    with pytest.raises(OutOfRangeError):
        run(ctx, outs, {a: va, rows: vr + 1, ai: vi, rows1: np.array([4, 1])})


def test_get_rows_quantized_matches_dequantize():
    ctx = Context()
    q = ctx.new_tensor("q8_0", (6, 64))
    rows = ctx.new_tensor("i32", (3,))
    out = ctx.get_rows(q, rows)
    raw, vals = random_q8_0(6, 64)
    vr = np.array([5, 0, 5])
    got = one(ctx, out, {q: raw, rows: vr})
    assert out.type == GGMLType.F32
    np.testing.assert_array_equal(got, dequantize(GGMLType.Q8_0, raw[vr], 64))
    np.testing.assert_array_equal(got, vals[vr])  # d * q by hand


def test_set_rows_and_later_reader():
    ctx = Context()
    dst = ctx.new_tensor("f32", (2, 5, 4))
    src = ctx.new_tensor("f32", (2, 3, 4))
    rows = ctx.new_tensor("i32", (1, 3))  # broadcast over ne2 (i2 % 1)
    sr = ctx.set_rows(dst, src, rows)
    reader = ctx.cont(ctx.view(dst, (4, 5, 2)))  # reads dst's memory after the write
    after = ctx.cont(sr)
    vd, vs = f32(2, 5, 4), f32(2, 3, 4)
    vr = np.array([[3, 0, 3]])  # row 3 written twice: the last write wins
    r = run(ctx, [sr, reader, after], {dst: vd, src: vs, rows: vr})
    exp = vd.copy()
    exp[:, 0] = vs[:, 1]
    exp[:, 3] = vs[:, 2]
    np.testing.assert_array_equal(r[sr], exp)
    np.testing.assert_array_equal(r[reader], exp)
    np.testing.assert_array_equal(r[after], exp)
    np.testing.assert_array_equal(r[dst], vd)  # leaves report their input


def test_set_rows_f16_rounds_and_q8_0_keeps_exact():
    ctx = Context()
    dh = ctx.new_tensor("f16", (3, 32))
    dq = ctx.new_tensor("q8_0", (3, 32))
    src = ctx.new_tensor("f32", (1, 32))
    rows = ctx.new_tensor("i32", (1,))
    outs = [ctx.set_rows(dh, src, rows), ctx.set_rows(dq, src, rows)]
    vs = (f32(1, 32) / 3).astype(np.float32).astype(np.float64)
    raw, vals = random_q8_0(3, 32)
    r = run(ctx, outs, {dh: np.zeros((3, 32)), dq: raw, src: vs, rows: np.array([2])})
    np.testing.assert_array_equal(r[outs[0]][2], vs[0].astype(np.float16))
    np.testing.assert_array_equal(r[outs[0]][:2], 0)
    np.testing.assert_array_equal(r[outs[1]][2], vs[0])
    np.testing.assert_array_equal(r[outs[1]][:2], vals[:2])


# --- copies and views ------------------------------------------------------------------------
def test_cpy_into_view_of_bigger_tensor():
    ctx = Context()
    big = ctx.new_tensor("f32", (4, 6))
    src = ctx.new_tensor("f32", (2, 3))
    # rows 1..2, columns 2..4 of big
    region = ctx.view(big, (3, 2), (4, 24), offset=1 * 24 + 2 * 4)
    c = ctx.cpy(src, region)
    reader = ctx.cont(ctx.reshape(big, (24,)))  # reads big after the copy
    through = ctx.cont(c)
    vbig = f32(4, 6)
    vsrc = f32(2, 3)
    r = run(ctx, [c, reader, through], {big: vbig, src: vsrc})
    exp = vbig.copy()
    exp[1:3, 2:5] = vsrc
    np.testing.assert_array_equal(r[reader].reshape(4, 6), exp)
    np.testing.assert_array_equal(r[c], vsrc)
    np.testing.assert_array_equal(r[through], vsrc)
    np.testing.assert_array_equal(r[big], vbig)


def test_cpy_order_and_conversion():
    ctx = Context()
    a = ctx.new_tensor("f32", (3, 4))
    b16 = ctx.new_tensor("f16", (4, 3))
    bbf = ctx.new_tensor("bf16", (12,))
    bq = ctx.new_tensor("q8_0", (32,))
    s = ctx.new_tensor("f32", (32,))
    outs = [ctx.cpy(ctx.transpose(a), b16), ctx.cpy(a, bbf), ctx.cpy(s, bq)]
    va, vs = f32(3, 4) / 7, (f32(32) / 7).astype(np.float32).astype(np.float64)
    r = run(ctx, outs, {a: va, b16: np.zeros((4, 3)), bbf: np.zeros(12), bq: np.zeros(32),
                        s: vs})  # fmt: skip
    # transposed source: elements in row-major order of its own (logical) shape
    np.testing.assert_array_equal(r[outs[0]], va.T.astype(np.float16))
    np.testing.assert_array_equal(r[outs[1]].reshape(-1), va.reshape(-1).astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(r[outs[2]], vs)  # quantized destination: exact values


def test_cpy_from_quantized_row_view():
    ctx = Context()
    q = ctx.new_tensor("q8_0", (4, 64))
    rows12 = ctx.view(q, (64, 2), offset=q.nb[1])
    dst = ctx.new_tensor("f32", (2, 64))
    c = ctx.cpy(rows12, dst)
    raw, vals = random_q8_0(4, 64)
    np.testing.assert_array_equal(one(ctx, c, {q: raw, dst: np.zeros((2, 64))}), vals[1:3])


def test_views_match_numpy():
    ctx = Context()
    a = ctx.new_tensor("f32", (2, 3, 4, 5))
    va = f32(2, 3, 4, 5)
    perm = ctx.permute(a, 2, 0, 3, 1)  # ggml axis i of a moves to position ax_i
    tr = ctx.transpose(a)
    outs = {
        "perm": ctx.cont(perm),
        "perm_view": perm,
        "tr": ctx.cont(tr),
        "tr_reshape": ctx.reshape(ctx.cont(tr), (6, 20)),
        "every_other_row": ctx.cont(ctx.view(a, (5, 2, 6), (4, 40, 80))),
        "offset_view": ctx.view(a, (5, 3), offset=3 * 20),
        "view_of_view": ctx.cont(  # 4 rows of 2 from element 7 (row 1, column 2)
            ctx.view(ctx.view(a, (5, 4, 5), offset=4), (2, 4), (4, 20), offset=20 + 4)
        ),
        "dup": ctx.dup(tr),
    }
    r = run(ctx, list(outs.values()), {a: va})
    g = {k: r[t] for k, t in outs.items()}
    # ggml dim d = numpy axis 3-d; result numpy axis 3-ax_i takes a's numpy axis 3-i
    axes = [0] * 4
    for i, ax in enumerate((2, 0, 3, 1)):
        axes[3 - ax] = 3 - i
    np.testing.assert_array_equal(g["perm"], np.transpose(va, axes))
    np.testing.assert_array_equal(g["perm_view"].reshape(perm.shape), np.transpose(va, axes))
    np.testing.assert_array_equal(g["tr"], va.swapaxes(-1, -2))
    np.testing.assert_array_equal(g["tr_reshape"], va.swapaxes(-1, -2).reshape(6, 20))
    np.testing.assert_array_equal(g["every_other_row"], va.reshape(6, 4, 5)[:, ::2])
    np.testing.assert_array_equal(g["offset_view"], va.reshape(-1, 5)[3:6])
    np.testing.assert_array_equal(g["view_of_view"], va.reshape(-1, 5)[1:5, 2:4])
    np.testing.assert_array_equal(g["dup"], va.swapaxes(-1, -2))


def test_concat_every_dim():
    ctx = Context()
    a = ctx.new_tensor("f32", (2, 3, 4, 5))
    ai = ctx.new_tensor("i32", (2, 3))
    va = f32(2, 3, 4, 5)
    vi = np.arange(6).reshape(2, 3)
    outs = [ctx.concat(a, a, d) for d in range(4)] + [ctx.concat(ai, ai, 0)]
    r = run(ctx, outs, {a: va, ai: vi})
    for d in range(4):
        np.testing.assert_array_equal(r[outs[d]], np.concatenate([va, va], axis=3 - d))
    assert r[outs[4]].dtype == np.int64
    np.testing.assert_array_equal(r[outs[4]], np.concatenate([vi, vi], axis=1))


# --- reductions and sorting ------------------------------------------------------------------
def test_reductions_and_argmax_argsort():
    ctx = Context()
    a = ctx.new_tensor("f32", (2, 4))
    outs = [ctx.sum(a), ctx.sum_rows(a), ctx.mean(a), ctx.argmax(a),
            ctx.argsort(a, SortOrder.ASC), ctx.argsort(a, SortOrder.DESC)]  # fmt: skip
    va = np.array([[1.0, 3.0, 3.0, -1.0], [2.0, 0.0, 2.0, 2.0]])
    r = run(ctx, outs, {a: va})
    assert r[outs[0]].reshape(-1)[0] == 12
    np.testing.assert_array_equal(r[outs[1]], [[6], [6]])
    np.testing.assert_array_equal(r[outs[2]], [[1.5], [1.5]])
    np.testing.assert_array_equal(r[outs[3]].reshape(-1), [1, 0])  # first of equal maxima
    np.testing.assert_array_equal(r[outs[4]], [[3, 0, 1, 2], [1, 0, 2, 3]])  # ties: index order
    np.testing.assert_array_equal(r[outs[5]], [[1, 2, 0, 3], [0, 2, 3, 1]])
    assert all(r[t].dtype == np.int64 for t in outs[3:])


# --- convolution helpers ---------------------------------------------------------------------
def _conv2d_naive(x, k, s0, s1, p0, p1, d0, d1):
    n, c, h, w = x.shape
    oc, _, kh, kw = k.shape
    oh = (h + 2 * p1 - d1 * (kh - 1) - 1) // s1 + 1
    ow = (w + 2 * p0 - d0 * (kw - 1) - 1) // s0 + 1
    out = np.zeros((n, oc, oh, ow))
    for b in range(n):
        for o in range(oc):
            for y in range(oh):
                for xo in range(ow):
                    acc = 0.0
                    for ci in range(c):
                        for i in range(kh):
                            for j in range(kw):
                                yy, xx = y * s1 + i * d1 - p1, xo * s0 + j * d0 - p0
                                if 0 <= yy < h and 0 <= xx < w:
                                    acc += x[b, ci, yy, xx] * k[o, ci, i, j]
                    out[b, o, y, xo] = acc
    return out


def test_im2col_2d_matmul_is_convolution():
    n, c, h, w, oc, kh, kw = 2, 3, 6, 7, 4, 3, 2
    s0, s1, p0, p1, d0, d1 = 2, 1, 1, 2, 1, 2
    ctx = Context()
    kern = ctx.new_tensor("f32", (oc, c, kh, kw))
    x = ctx.new_tensor("f32", (n, c, h, w))
    col = ctx.im2col(kern, x, s0, s1, p0, p1, d0, d1, is_2d=True, dst_type="f32")
    _, oh, ow, ckk = col.shape
    # ggml_conv_2d: mul_mat(im2col [N*OH*OW, C*KH*KW], kernel [OC, C*KH*KW]) -> [OC, N*OH*OW]
    y = ctx.mul_mat(ctx.reshape(col, (n * oh * ow, ckk)), ctx.reshape(kern, (oc, ckk)))
    col16 = ctx.im2col(kern, x, s0, s1, p0, p1, d0, d1, is_2d=True, dst_type="f16")
    vk, vx = f32(oc, c, kh, kw), f32(n, c, h, w)
    r = run(ctx, [y, col16, col], {kern: vk, x: vx})
    exp = _conv2d_naive(vx, vk, s0, s1, p0, p1, d0, d1)
    np.testing.assert_allclose(r[y], exp.transpose(1, 0, 2, 3).reshape(oc, -1), atol=1e-5)
    # the layout itself: [N, OH, OW, C, KH, KW], zero outside the input
    patch = r[col][1, 2, 1].reshape(c, kh, kw)
    for ci in range(c):
        for i in range(kh):
            for j in range(kw):
                yy, xx = 2 * s1 + i * d1 - p1, 1 * s0 + j * d0 - p0
                inside = 0 <= yy < h and 0 <= xx < w
                assert patch[ci, i, j] == (vx[1, ci, yy, xx] if inside else 0.0)
    np.testing.assert_array_equal(r[col16], r[col].astype(np.float16))


def test_im2col_1d_matmul_is_convolution():
    n, c, w, oc, kw, s0, p0, d0 = 2, 3, 9, 2, 3, 2, 1, 2
    ctx = Context()
    kern = ctx.new_tensor("f32", (oc, c, kw))
    x = ctx.new_tensor("f32", (n, c, w))
    col = ctx.im2col(kern, x, s0, 1, p0, 0, d0, 1, is_2d=False, dst_type="f32")
    _, ow, ck = col.shape
    y = ctx.mul_mat(ctx.reshape(col, (n * ow, ck)), ctx.reshape(kern, (oc, ck)))
    vk, vx = f32(oc, c, kw), f32(n, c, w)
    got = one(ctx, y, {kern: vk, x: vx})
    exp = _conv2d_naive(vx[:, :, None, :], vk[:, :, None, :], s0, 1, p0, 0, d0, 1)[:, :, 0]
    np.testing.assert_allclose(got, exp.transpose(1, 0, 2).reshape(oc, -1), atol=1e-5)


def test_col2im_1d_naive():
    b, t_in, oc, k, s0, p0 = 2, 5, 3, 4, 2, 1
    ctx = Context()
    a = ctx.new_tensor("f32", (b, t_in, oc * k))
    out = ctx.col2im_1d(a, s0, oc, p0)
    va = f32(b, t_in, oc * k)
    got = one(ctx, out, {a: va})
    t_out = (t_in - 1) * s0 + k - 2 * p0
    assert got.shape == (b, oc, t_out)
    exp = np.zeros((b, oc, t_out))
    for bi in range(b):
        for ci in range(oc):
            for t in range(t_out):
                for ti in range(t_in):
                    for kk in range(k):
                        if t + p0 == ti * s0 + kk:
                            exp[bi, ci, t] += va[bi, ti, ci * k + kk]
    np.testing.assert_allclose(got, exp, rtol=1e-6, atol=1e-7)


def test_col2im_1d_hand():
    # one channel, K=2, stride 1: overlapping taps add up
    ctx = Context()
    a = ctx.new_tensor("f32", (1, 3, 2))
    out = ctx.col2im_1d(a, 1, 1, 0)
    va = np.array([[[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]]])
    np.testing.assert_array_equal(one(ctx, out, {a: va}), [[[1, 12, 120, 200]]])


# --- leaves, rounding, compute_node ----------------------------------------------------------
def test_leaf_forms_and_rounding():
    ctx = Context()
    h = ctx.new_tensor("f16", (2, 3))
    f = ctx.new_tensor("f32", (2, 3))
    out = ctx.add(f, f)
    v = np.array([[1 / 3, 2 / 3, 1.0], [1e-8, 70000.0, -2.5]])
    r = run(ctx, [ctx.scale(h, 1.0), out], {h: v, f: v.reshape(-1)})
    with np.errstate(over="ignore"):  # 70000 overflows f16 to inf
        np.testing.assert_array_equal(r[h], v.astype(np.float16))
    np.testing.assert_array_equal(r[f], v.astype(np.float32))
    np.testing.assert_array_equal(r[out], (2 * v.astype(np.float32)).astype(np.float32))
    r2 = evaluate(ctx.graph(out), {f: v.reshape(1, 1, 2, 3)})  # reversed(ne) also accepted
    np.testing.assert_array_equal(r2[out].reshape(2, 3), r[out])


class _FakeBuffer:
    """Just enough of a Buffer for Tensor.get(): bytes in a numpy array."""

    name = "fake"
    freed = False

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def get_tensor(self, t, out, offset, size):
        out[:] = self.data[offset : offset + size]


def test_leaf_from_tensor_get():
    ctx = Context()
    q = ctx.new_tensor("q8_0", (2, 32))
    out = ctx.scale(ctx.get_rows(q, ctx.new_tensor("i32", (1,))), 2.0)
    rows = ctx.tensors[-1]
    raw, vals = random_q8_0(2, 32)
    q.buffer = _FakeBuffer(raw.reshape(-1))
    np.testing.assert_array_equal(one(ctx, out, {rows: np.array([1])})[0], 2 * vals[1])
    with pytest.raises(DeviceError, match="leaf_values"):
        evaluate(ctx.graph(out), {q: raw})  # rows has no value and no buffer


def test_compute_node_matches_evaluate():
    ctx = Context()
    a = ctx.new_tensor("f32", (3, 4))
    w = ctx.new_tensor("f16", (5, 4))
    cache = ctx.new_tensor("f32", (6, 5))
    pos = ctx.new_tensor("i32", (3,))
    m = ctx.mul_mat(w, a)  # [3, 5]
    sm = ctx.soft_max(ctx.scale(m, 0.5))
    rows4 = ctx.cont(ctx.view(sm, (4, 3), (sm.nb[0], sm.nb[1])))  # first 4 columns
    rp = ctx.rope(ctx.reshape(rows4, (3, 1, 4)), pos, 4)
    c = ctx.cpy(sm, ctx.view(cache, (5, 3), offset=2 * cache.nb[1]))
    g = ctx.graph(rp, c)
    vals = {a: f32(3, 4), w: f32(5, 4), cache: f32(6, 5), pos: np.array([0, 1, 2])}
    res = evaluate(g, vals)
    for node in g.nodes:
        np.testing.assert_array_equal(compute_node(node, res), res[node], err_msg=str(node))
    assert {n.op for n in g.nodes} >= {Op.MUL_MAT, Op.SOFT_MAX, Op.ROPE, Op.CPY, Op.VIEW}


def test_split_graph_inputs_from_leaf_values():
    # a Graph.from_nodes split: its input is a node of another graph, given in leaf_values
    ctx = Context()
    a = ctx.new_tensor("f32", (2, 3))
    s = ctx.sqr(a)
    t = ctx.cont(ctx.transpose(s))
    part = Graph.from_nodes([n for n in ctx.graph(t).nodes if n is not s])
    vs = f32(2, 3)
    res = evaluate(part, {s: vs})
    np.testing.assert_array_equal(res[t].reshape(3, 2), vs.T)
    np.testing.assert_array_equal(res[s].reshape(2, 3), vs)
