"""The op cases of the conformance suite: every op × type × shape of the catalog.

A case builds a small graph whose output node is the op under test, says how its leaves are
initialized and what error it may have against the float64 oracle (ggml's test-backend-ops
thresholds: NMSE 1e-7 by default, 5e-4 for matrix products, one quantization step for
quantizing copies). Shapes include non-contiguous sources (permuted and strided views),
sizes that are not multiples of 32 or of a vector width, K tails, broadcasting and long rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from accelplane.core.graph import Context
from accelplane.core.ops import ROPE_TYPE_NEOX, ROPE_TYPE_NORMAL, GluOp, SortOrder, UnaryOp
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType

T = GGMLType
Init = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]
# the block types a weight may have (products, row gathers, dequantizing copies)
QUANT = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS)


@dataclass
class OpCase:
    """One conformance case. ``build(ctx)`` returns the output node; ``inits`` maps a leaf
    name to its initializer (default: uniform in [-1, 1])."""

    op: str
    params: dict
    build: Callable[[Context], Tensor]
    max_nmse: float = 1e-7
    inits: dict[str, Init] = field(default_factory=dict)
    exact: bool = False  # integer results must match exactly
    thorough_only: bool = False

    @property
    def id(self) -> str:
        inner = ",".join(f"{k}={_fmt(v)}" for k, v in self.params.items())
        return f"{self.op}({inner})"


def _fmt(v) -> str:
    if isinstance(v, GGMLType):
        return v.name.lower()
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_fmt(x) for x in v) + "]"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def uniform(lo: float, hi: float) -> Init:
    return lambda rng, shape: rng.uniform(lo, hi, shape)


def ints(lo: int, hi: int) -> Init:
    """Integers in [lo, hi)."""
    return lambda rng, shape: rng.integers(lo, hi, shape)


def perm_rows(n: int) -> Init:
    """Distinct row indices (a permutation prefix of range(n)) along the last axis."""

    def init(rng, shape):
        flat = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        out = np.stack([rng.permutation(n)[: shape[-1]] for _ in range(flat)])
        return out.reshape(shape)

    return init


def leaf(ctx: Context, type_: GGMLType, ne, name: str, perm=None, strided: bool = False) -> Tensor:
    """A source of logical ``ne`` (ggml order). ``perm`` makes it a permuted (non-contiguous)
    view of a leaf; ``strided`` a view whose rows skip elements (nb1 > row bytes)."""
    ne = list(ne) + [1] * (4 - len(ne))
    if perm is not None:
        inv = [0] * 4
        for i, p in enumerate(perm):
            inv[p] = i
        base = ctx.new_tensor_ne(type_, *[ne[inv[i]] for i in range(4)], name=name)
        return ctx.permute(base, *perm)
    if strided:
        pad = type_.blck_size if type_.is_quantized else 3
        base = ctx.new_tensor_ne(type_, ne[0] + pad, *ne[1:], name=name)
        return ctx.view(base, ne, base.nb, 0)
    return ctx.new_tensor_ne(type_, *ne, name=name)


# --- generators, one per op family ---------------------------------------------------------------
def _binary() -> Iterator[OpCase]:
    from accelplane.core.graph import Context as C

    fns = {"ADD": C.add, "SUB": C.sub, "MUL": C.mul, "DIV": C.div}
    shapes = [  # (ne_a, ne_b)
        ((16, 5, 4, 3), (16, 5, 4, 3)),
        ((10, 5, 4, 3), (10, 1, 1, 1)),
        ((10, 5, 4, 3), (1, 5, 1, 1)),
        ((10, 5, 4, 3), (5, 5, 2, 3)),
        ((1, 1, 1, 1), (1, 1, 1, 1)),
        ((33, 7, 1, 1), (33, 7, 1, 1)),
        ((4099, 2, 1, 1), (4099, 1, 1, 1)),
    ]
    for name, fn in fns.items():
        for ta in (T.F32, T.F16, T.BF16):
            for ne_a, ne_b in shapes:
                for perm in (None, (0, 2, 1, 3)):
                    if perm and ne_a[0] == 1:
                        continue

                    def build(ctx, fn=fn, ta=ta, ne_a=ne_a, ne_b=ne_b, perm=perm):
                        a = leaf(ctx, ta, ne_a, "a", perm)
                        b = leaf(ctx, ta, ne_b, "b")
                        return fn(ctx, a, b)

                    inits = {"b": uniform(0.5, 1.5)} if name == "DIV" else {}
                    yield OpCase(name, {"type": ta, "ne_a": ne_a, "ne_b": ne_b, "perm": perm},
                                 build, _float_thr(ta), inits)  # fmt: skip


def _float_thr(t: GGMLType) -> float:
    # the oracle rounds results to the storage type, so only f32-vs-f64 rounding remains;
    # half types can land one ulp apart where the f32 value sits on a rounding boundary
    return {T.F32: 1e-7, T.F16: 1e-6, T.BF16: 5e-5}.get(t, 1e-7)


_UNARIES = {
    "SQR": (lambda c, a: c.sqr(a), None),
    "SQRT": (lambda c, a: c.sqrt(a), uniform(0.01, 2.0)),
    "LOG": (lambda c, a: c.log(a), uniform(0.05, 2.0)),
    "SIN": (lambda c, a: c.sin(a), uniform(-6, 6)),
    "COS": (lambda c, a: c.cos(a), uniform(-6, 6)),
    "SCALE": (lambda c, a: c.scale(a, 1.7, -0.25), None),
    "CLAMP": (lambda c, a: c.clamp(a, -0.5, 0.5), None),
    "LEAKY_RELU": (lambda c, a: c.leaky_relu(a, 0.1), None),
}


def halves(lo: int, hi: int) -> Init:
    """The kinks of the rounding ops, STEP and the hard activations, mixed with uniform values in
    [lo, hi]: multiples of 0.25 (0, the halves, ±3), the halves, and a float32 neighbour of a
    half on either side (F16/BF16 leaves round those back to the half)."""

    def init(rng, shape):
        n = int(np.prod(shape))
        half = (rng.integers(lo, hi, n) + 0.5).astype(np.float32)
        near = np.nextafter(half, np.where(rng.random(n) < 0.5, -np.inf, np.inf).astype(np.float32))
        grid = rng.integers(4 * lo, 4 * hi + 1, n) / 4.0
        pick = rng.integers(0, 4, n)
        return np.choose(pick, [grid, half, near, rng.uniform(lo, hi, n)]).astype(np.float64).reshape(shape)

    return init


def _sort_specials(rng, shape) -> np.ndarray:
    """Few distinct values (ties), both zeros, both infinities and NaN: ARGSORT's total order."""
    pool = np.array([-2.0, -1.0, -0.0, 0.0, 1.0, 2.0, np.inf, -np.inf, np.nan])
    return pool[rng.integers(0, len(pool), int(np.prod(shape)))].reshape(shape)


U = UnaryOp
_ROUNDING = (U.STEP, U.FLOOR, U.CEIL, U.ROUND, U.TRUNC)  # integer results: compared exactly
_UNARY_INIT = {u: halves(-4, 4) for u in (*_ROUNDING, U.HARDSWISH, U.HARDSIGMOID)}
# more inputs per op, as (name, init, types), in cases of their own: where a formula changes
# branch or loses precision (SOFTPLUS: x itself above 20, exp overflowing past 88; expm1 near
# 0, where exp(x) - 1 cancels), the saturated tails, the negative side of GELU_ERF (where the
# tanh GELU is 1e-3 to 10 % off: over [-4, 4] the two are within NMSE 3e-8), and magnitudes
# past int32 for the rounding ops
_FLOAT = (T.F32, T.F16, T.BF16)
_TINY = ("tiny", uniform(-1e-4, 1e-4), _FLOAT)
_UNARY_MORE: dict[UnaryOp, tuple[tuple[str, Init, tuple[GGMLType, ...]], ...]] = {
    U.ELU: (("wide", uniform(-30, 30), _FLOAT), _TINY),
    U.EXPM1: (("wide", uniform(-30, 30), _FLOAT), _TINY),
    U.SOFTPLUS: (("wide", uniform(-100, 100), _FLOAT),),
    U.GELU_ERF: (("neg", uniform(-5, -1), _FLOAT),),
    **{u: (("big", uniform(-3e9, 3e9), (T.F32,)),) for u in (U.FLOOR, U.CEIL, U.ROUND, U.TRUNC)},
}
for _u in UnaryOp:
    _UNARIES[_u.name] = (lambda c, a, u=_u: c.unary(a, u), _UNARY_INIT.get(_u, uniform(-4, 4)))


def _unary_thr(name: str, ta: GGMLType) -> float:
    # exp's results span orders of magnitude: the largest, one BF16 step off, dominate the NMSE
    return 1e-4 if name in ("EXP", "EXPM1") and ta == T.BF16 else _float_thr(ta)


def _unary() -> Iterator[OpCase]:
    shapes = [(16, 5, 2, 1), (7, 3, 1, 1), (1, 1, 1, 1), (1031, 3, 1, 1)]
    exact = {u.name for u in _ROUNDING}
    for name, (fn, init) in _UNARIES.items():
        for ta in _FLOAT:
            for ne in shapes:
                for perm in (None, (1, 0, 2, 3)):
                    if perm and ne[0] == 1:
                        continue

                    def build(ctx, fn=fn, ta=ta, ne=ne, perm=perm):
                        return fn(ctx, leaf(ctx, ta, ne, "a", perm))

                    yield OpCase(name, {"type": ta, "ne": ne, "perm": perm}, build, _unary_thr(name, ta),
                                 {"a": init} if init else {}, exact=name in exact)  # fmt: skip
    for u, more in _UNARY_MORE.items():
        for xname, init, types in more:
            for ta in types:
                for ne in ((16, 5, 2, 1), (1031, 3, 1, 1)):

                    def build(ctx, u=u, ta=ta, ne=ne):
                        return ctx.unary(leaf(ctx, ta, ne, "a"), u)

                    yield OpCase(u.name, {"type": ta, "ne": ne, "x": xname}, build, _unary_thr(u.name, ta),
                                 {"a": init}, exact=u in _ROUNDING)  # fmt: skip


def _glu() -> Iterator[OpCase]:
    for op in GluOp:
        for ta in (T.F32, T.F16):
            for ne in ((32, 4, 2, 1), (22, 3, 1, 1), (2, 1, 1, 1)):
                for split in (False, True):
                    for swapped in ((False,) if split else (False, True)):

                        def build(ctx, op=op, ta=ta, ne=ne, split=split, swapped=swapped):
                            if split:
                                half = (ne[0] // 2, *ne[1:])
                                return ctx.glu(leaf(ctx, ta, half, "a"),
                                               leaf(ctx, ta, half, "b"), op)  # fmt: skip
                            return ctx.glu(leaf(ctx, ta, ne, "a"), None, op, swapped)

                        yield OpCase(op.name, {"type": ta, "ne": ne, "split": split,
                                               "swapped": swapped}, build, _float_thr(ta),
                                     {"a": uniform(-3, 3)})  # fmt: skip


def _norms() -> Iterator[OpCase]:
    for name in ("NORM", "RMS_NORM", "L2_NORM"):
        for ne in ((64, 5, 4, 3), (33, 2, 1, 1), (1, 3, 1, 1), (4097, 2, 1, 1)):
            for variant in (None, "perm", "strided"):
                if variant == "perm" and ne[1] == 1:
                    continue
                for eps in (1e-6,):

                    def build(ctx, name=name, ne=ne, variant=variant, eps=eps):
                        perm = (0, 2, 1, 3) if variant == "perm" else None
                        a = leaf(ctx, T.F32, ne, "a", perm, strided=variant == "strided")
                        f = {"NORM": ctx.norm, "RMS_NORM": ctx.rms_norm, "L2_NORM": ctx.l2_norm}
                        return f[name](a, eps)

                    thr = 1e-6 if ne[0] == 1 and name == "NORM" else 1e-7
                    yield OpCase(name, {"ne": ne, "v": variant, "eps": eps}, build, thr)


def _norm_mul() -> Iterator[OpCase]:
    """A norm read only by a MUL (the norm's own result is not an output): the run plugins
    fuse into one kernel (accelplane.core.fusion), with broadcast and permuted operands."""
    for name in ("NORM", "RMS_NORM", "L2_NORM"):
        for ne, ne_w, perm in (
            ((64, 5, 4, 3), (64, 1, 1, 1), None),
            ((4097, 2, 1, 1), (4097, 2, 1, 1), None),
            ((64, 5, 4, 3), (64, 5, 1, 3), None),
            ((64, 5, 4, 3), (64, 1, 1, 1), (0, 2, 1, 3)),
        ):

            def build(ctx, name=name, ne=ne, ne_w=ne_w, perm=perm):
                a = leaf(ctx, T.F32, ne, "a", perm)
                f = {"NORM": ctx.norm, "RMS_NORM": ctx.rms_norm, "L2_NORM": ctx.l2_norm}
                return ctx.mul(f[name](a, 1e-6), leaf(ctx, T.F32, ne_w, "w"))

            yield OpCase(f"{name}_MUL", {"ne": ne, "ne_w": ne_w, "perm": perm}, build)
    for ne in ((64, 5, 4, 3), (4097, 2, 1, 1)):
        # a residual block: the sum is normed, scaled, and added again (so it has two readers)

        def build_res(ctx, ne=ne):
            s = ctx.add(leaf(ctx, T.F32, ne, "a"), leaf(ctx, T.F32, ne, "b"))
            y = ctx.mul(ctx.rms_norm(s, 1e-6), leaf(ctx, T.F32, (ne[0], 1, 1, 1), "w"))
            return ctx.add(y, s)

        yield OpCase("ADD_RMS_NORM_MUL", {"ne": ne}, build_res)


def _soft_max() -> Iterator[OpCase]:
    for ne in ((16, 5, 4, 1), (33, 7, 2, 3), (1, 1, 1, 1), (1500, 2, 1, 1)):
        for mask in (None, T.F32, T.F16):
            for scale, max_bias in ((1.0, 0.0), (0.125, 0.0), (0.5, 8.0)):
                if max_bias and mask is None:
                    continue

                def build(ctx, ne=ne, mask=mask, scale=scale, max_bias=max_bias):
                    a = leaf(ctx, T.F32, ne, "a")
                    m = None
                    if mask is not None:
                        m = leaf(ctx, mask, (ne[0], ne[1] + 2, 1, ne[3]), "mask")
                    return ctx.soft_max(a, m, scale, max_bias)

                yield OpCase("SOFT_MAX", {"ne": ne, "mask": mask, "scale": scale,
                                          "max_bias": max_bias}, build, 1e-7,
                             {"a": uniform(-5, 5), "mask": uniform(-2, 0)})  # fmt: skip


def _causal(n_used: int) -> Init:
    """A KV mask for rows of queries at the last positions of ``n_used`` cache slots: slot t
    hidden (-inf) from query i when t > n_used - n_queries + i, and every slot >= n_used (a padded
    window's unused tail); queries repeat per head (rows i of a batch are heads x tokens)."""

    def init(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        rows, w = shape[-2], shape[-1]
        m = rng.uniform(-1, 0, shape).astype(np.float32)
        n_tok = min(rows, n_used)
        pos = n_used - n_tok + np.arange(rows) % n_tok
        m[..., np.arange(w)[None, :] > pos[:, None]] = -np.inf
        return m

    return init


def _attention() -> Iterator[OpCase]:
    """Attention as a decoder builds it: KQ of a KV cache's K rows viewed per KV head against
    the queries (grouped-query: batches sharing a head), the masked, scaled SOFT_MAX of it, and
    its product with the transposed V cache: the run plugins fuse into one kernel."""
    for tk in (T.F32, T.F16, T.BF16):
        # (head dim, window, kv heads, query rows per batch, batches, slots in use)
        for d, w, g, r, nb, used in ((64, 96, 4, 8, 4, 70), (32, 37, 2, 5, 4, 37), (16, 40, 1, 24, 2, 24)):
            for masked in (True, False):

                def build(ctx, tk=tk, d=d, w=w, g=g, r=r, nb=nb, masked=masked):
                    k = leaf(ctx, tk, (d, w, g, 1), "k", perm=(0, 2, 1, 3))
                    v = leaf(ctx, tk, (w, d, g, 1), "v", strided=True)
                    q = leaf(ctx, T.F32, (d, r, nb, 1), "q")
                    m = leaf(ctx, T.F32, (w, r + 3, 1, 1), "mask") if masked else None
                    p = ctx.soft_max(ctx.mul_mat(k, q), m, 1.0 / math.sqrt(d))
                    return ctx.mul_mat(v, p)

                yield OpCase("ATTENTION", {"type_kv": tk, "d": d, "w": w, "g": g, "r": r, "nb": nb,
                                           "used": used, "mask": masked}, build, _float_thr(tk),
                             {"mask": _causal(used), "q": uniform(-2, 2)})  # fmt: skip


def _rope() -> Iterator[OpCase]:
    for ta in (T.F32, T.F16):
        for mode in (ROPE_TYPE_NORMAL, ROPE_TYPE_NEOX):
            for ne, n_dims in (((64, 4, 5, 1), 64), ((128, 2, 3, 1), 64), ((10, 3, 7, 1), 10)):
                for fs, ef in ((1.0, 0.0), (0.25, 1.0)):

                    def build(ctx, ta=ta, mode=mode, ne=ne, n_dims=n_dims, fs=fs, ef=ef):
                        a = leaf(ctx, ta, ne, "a")
                        pos = ctx.new_tensor_ne(T.I32, ne[2], name="pos")
                        return ctx.rope(a, pos, n_dims, mode, n_ctx_orig=512, freq_base=10000.0,
                                        freq_scale=fs, ext_factor=ef)  # fmt: skip

                    yield OpCase("ROPE", {"type": ta, "mode": mode, "ne": ne, "n_dims": n_dims,
                                          "fs": fs, "ef": ef}, build,
                                 _float_thr(ta) if ta != T.F32 else 1e-7,
                                 {"pos": ints(0, 200)})  # fmt: skip
            # frequency factors (ggml_rope_ext's c, Llama 3's rope_freqs): each pair's frequency
            # divided by its own factor, with and without YaRN
            for ne, n_dims in (((64, 4, 5, 1), 64), ((128, 2, 3, 1), 32)):
                for fs, ef in ((1.0, 0.0), (0.25, 1.0)):

                    def build(ctx, ta=ta, mode=mode, ne=ne, n_dims=n_dims, fs=fs, ef=ef):
                        a = leaf(ctx, ta, ne, "a")
                        pos = ctx.new_tensor_ne(T.I32, ne[2], name="pos")
                        ff = ctx.new_tensor_ne(T.F32, n_dims // 2, name="ff")
                        return ctx.rope(a, pos, n_dims, mode, n_ctx_orig=512, freq_base=10000.0,
                                        freq_scale=fs, ext_factor=ef, freq_factors=ff)  # fmt: skip

                    yield OpCase("ROPE", {"type": ta, "mode": mode, "ne": ne, "n_dims": n_dims,
                                          "fs": fs, "ef": ef, "ff": True}, build,
                                 _float_thr(ta) if ta != T.F32 else 1e-7,
                                 {"pos": ints(0, 200), "ff": uniform(0.5, 8.0)})  # fmt: skip


def _mul_mat() -> Iterator[OpCase]:
    for ta in (T.F32, T.F16, T.BF16, *QUANT):
        bs = ta.blck_size
        ks = (bs * 8, bs * 3) if bs > 1 else (256, 67, 1)
        for k in ks:
            # (19, 3): a few activation rows (the mat-vec kernels' range), rows not a multiple
            # of a workgroup's, broadcast batches
            for m, n in ((16, 1), (17, 9), (33, 64), (1, 5), (19, 3)):
                # batches: none; a broadcast over b's (ratios 2 and 3); one weight matrix for
                # every batch of b; the same batch dims on both
                for batch in (((1, 1), (1, 1)), ((2, 1), (4, 3)), ((1, 1), (4, 3)), ((4, 3), (4, 3))) \
                        if (m, n) in ((16, 1), (19, 3)) else (((1, 1), (1, 1)),):  # fmt: skip
                    for tb in (T.F32, T.F16, T.BF16) if (m, n) in ((17, 9), (19, 3)) else (T.F32,):

                        def build(ctx, ta=ta, tb=tb, k=k, m=m, n=n, batch=batch):
                            (a2, a3), (b2, b3) = batch
                            a = leaf(ctx, ta, (k, m, a2, a3), "a")
                            b = leaf(ctx, tb, (k, n, b2, b3), "b")
                            return ctx.mul_mat(a, b)

                        yield OpCase("MUL_MAT", {"type_a": ta, "type_b": tb, "m": m, "n": n,
                                                 "k": k, "bs": batch}, build, 5e-4)  # fmt: skip
    # non-contiguous activations and strided weight rows
    for ta in (T.F32, T.F16, *QUANT):
        k = 256 if ta.blck_size == 256 else 64

        def build_nc(ctx, ta=ta, k=k):
            a = leaf(ctx, ta, (k, 12, 1, 1), "a", strided=True)
            b = leaf(ctx, T.F32, (k, 5, 3, 1), "b", perm=(0, 2, 1, 3))
            return ctx.mul_mat(a, b)

        yield OpCase("MUL_MAT", {"type_a": ta, "k": k, "v": "noncont"}, build_nc, 5e-4)
    # attention's products: both operands permuted views [.., heads, tokens, dim], batch dims equal
    for ta in (T.F32, T.F16):

        def build_att(ctx, ta=ta):
            k_ = leaf(ctx, ta, (32, 7, 3, 2), "a", perm=(0, 2, 1, 3))
            q_ = leaf(ctx, T.F32, (32, 5, 3, 2), "b", perm=(0, 2, 1, 3))
            return ctx.mul_mat(k_, q_)

        yield OpCase("MUL_MAT", {"type_a": ta, "v": "heads-permuted"}, build_att, 5e-4)
    # grouped-query attention over a KV cache: K rows [tokens, kv heads * dim] viewed per kv
    # head (the heads closer together than the rows), each kv head shared by 4 query heads
    for ta in (T.F32, T.F16, T.BF16):
        for n in (1, 3):

            def build_gqa(ctx, ta=ta, n=n):
                k_ = leaf(ctx, ta, (32, 7, 2, 1), "a", perm=(0, 2, 1, 3))
                q_ = leaf(ctx, T.F32, (32, n, 8, 1), "b")
                return ctx.mul_mat(k_, q_)

            yield OpCase("MUL_MAT", {"type_a": ta, "n": n, "v": "gqa-cache"}, build_gqa, 5e-4)


def _mul_mat_id() -> Iterator[OpCase]:
    # decode-sized batches (a row at a time), then prefill-sized ones that plugins group by
    # expert: rows of one expert past a 64-row tile, weight rows past a 64-row tile, and K of
    # an odd number of 32-element chunks
    shapes = ((4, 2, 5, 1, 9), (8, 3, 2, 3, 9), (4, 1, 1, 1, 9),
              (8, 2, 40, 1, 70), (2, 2, 80, 2, 33), (16, 4, 12, 4, 9))  # fmt: skip
    for ta in (T.F32, T.F16, *QUANT):
        for n_exp, n_used, n_tok, b1, m in shapes:
            k = 256 if ta.blck_size == 256 else 64 if n_tok < 9 else 96

            def build(ctx, ta=ta, k=k, n_exp=n_exp, n_used=n_used, n_tok=n_tok, b1=b1, m=m):
                a = leaf(ctx, ta, (k, m, n_exp), "as")
                b = leaf(ctx, T.F32, (k, b1, n_tok), "b")
                ids = ctx.new_tensor_ne(T.I32, n_used, n_tok, name="ids")
                return ctx.mul_mat_id(a, b, ids)

            params = {"type_a": ta, "n_exp": n_exp, "n_used": n_used, "n_tok": n_tok, "b1": b1, "k": k}
            if m != 9:
                params["m"] = m
            yield OpCase("MUL_MAT_ID", params, build, 5e-4, {"ids": perm_rows(n_exp)})


def _get_set_rows() -> Iterator[OpCase]:
    for ta in (T.F32, T.F16, T.BF16, T.I32, *QUANT):
        ne0 = ta.blck_size * 2 if ta.is_quantized else 10
        for nr, nidx, b in ((5, 3, 1), (7, 7, 2)):

            def build(ctx, ta=ta, ne0=ne0, nr=nr, nidx=nidx, b=b):
                a = leaf(ctx, ta, (ne0, nr, b, 1), "a")
                idx = ctx.new_tensor_ne(T.I32, nidx, b, name="idx")
                return ctx.get_rows(a, idx)

            inits = {"idx": ints(0, nr)}
            if ta == T.I32:
                inits["a"] = ints(-1000, 1000)
            yield OpCase("GET_ROWS", {"type": ta, "ne0": ne0, "nr": nr, "n": nidx, "b": b},
                         build, 1e-7, inits, exact=ta == T.I32)  # fmt: skip
    for td in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0):
        ne0 = 64 if td.is_quantized else 17
        for nr, nset, b in ((8, 3, 1), (6, 6, 2)):

            def build(ctx, td=td, ne0=ne0, nr=nr, nset=nset, b=b):
                dst = leaf(ctx, td, (ne0, nr, b, 1), "dst")
                src = leaf(ctx, T.F32, (ne0, nset, b, 1), "src")
                idx = ctx.new_tensor_ne(T.I32, nset, b, name="idx")
                return ctx.set_rows(dst, src, idx)

            yield OpCase("SET_ROWS", {"type": td, "ne0": ne0, "nr": nr, "n": nset, "b": b},
                         build, _quant_thr(td), {"idx": perm_rows(nr)})  # fmt: skip


def _quant_thr(t: GGMLType) -> float:
    """NMSE of one quantization step on uniform data (×2 margin), else the float threshold."""
    levels = {T.Q8_0: 127, T.Q4_0: 8}.get(t)
    if levels is None:
        return _float_thr(t)
    return 2.0 / (4.0 * levels * levels)


def _copies() -> Iterator[OpCase]:
    float_types = (T.F32, T.F16, T.BF16)
    for ts in float_types + QUANT:
        for td in float_types + (T.Q8_0, T.Q4_0):
            if ts.is_quantized and td != T.F32:
                continue
            ne0 = 256 if ts.blck_size == 256 else 64
            for variant in (None, "perm") if not ts.is_quantized else (None,):
                if variant and td.is_quantized:
                    continue

                def build(ctx, ts=ts, td=td, ne0=ne0, variant=variant):
                    perm = (1, 0, 2, 3) if variant == "perm" else None
                    ne = (ne0, 3, 2, 1) if perm is None else (3, ne0, 2, 1)
                    a = leaf(ctx, ts, ne, "a", perm)
                    b = ctx.new_tensor_ne(td, *ne, name="dst")
                    return ctx.cpy(a, b)

                thr = max(_quant_thr(td), _float_thr(ts))
                yield OpCase("CPY", {"src": ts, "dst": td, "ne0": ne0, "v": variant}, build, thr)
    for ta in float_types + (T.I32,):
        for perm in ((1, 0, 2, 3), (0, 2, 1, 3), (2, 1, 0, 3)):

            def build_cont(ctx, ta=ta, perm=perm):
                return ctx.cont(leaf(ctx, ta, (10, 7, 3, 2), "a", perm))

            yield OpCase("CONT", {"type": ta, "perm": perm}, build_cont, 1e-7,
                         {"a": ints(-99, 99)} if ta == T.I32 else {},
                         exact=ta == T.I32)  # fmt: skip

        def build_dup(ctx, ta=ta):
            return ctx.dup(leaf(ctx, ta, (10, 7, 3, 2), "a"))

        yield OpCase("DUP", {"type": ta}, build_dup, 1e-7,
                     {"a": ints(-99, 99)} if ta == T.I32 else {}, exact=ta == T.I32)  # fmt: skip


def _concat() -> Iterator[OpCase]:
    for ta in (T.F32, T.F16, T.I32):
        for dim in range(4):
            for perm in (None, (0, 2, 1, 3)):

                def build(ctx, ta=ta, dim=dim, perm=perm):
                    ne_a = [11, 5, 4, 3]
                    ne_b = list(ne_a)
                    ne_b[dim] = 2
                    return ctx.concat(leaf(ctx, ta, ne_a, "a", perm), leaf(ctx, ta, ne_b, "b"), dim)

                inits = {"a": ints(-50, 50), "b": ints(-50, 50)} if ta == T.I32 else {}
                yield OpCase("CONCAT", {"type": ta, "dim": dim, "perm": perm}, build, 1e-7,
                             inits, exact=ta == T.I32)  # fmt: skip


def _reductions() -> Iterator[OpCase]:
    for name in ("SUM", "SUM_ROWS", "MEAN"):
        for ta in (T.F32, T.F16):
            for ne in ((10, 5, 4, 3), (33, 1, 1, 1), (4099, 3, 1, 1)):
                for perm in (None, (0, 2, 1, 3)):

                    def build(ctx, name=name, ta=ta, ne=ne, perm=perm):
                        a = leaf(ctx, ta, ne, "a", perm)
                        return {"SUM": ctx.sum, "SUM_ROWS": ctx.sum_rows, "MEAN": ctx.mean}[name](a)

                    yield OpCase(name, {"type": ta, "ne": ne, "perm": perm}, build, 1e-7)
    for ne in ((32, 10, 1, 1), (1025, 3, 1, 1), (5, 1, 1, 1)):

        def build_am(ctx, ne=ne):
            return ctx.argmax(leaf(ctx, T.F32, ne, "a"))

        yield OpCase("ARGMAX", {"ne": ne}, build_am, exact=True)
    for order in SortOrder:
        for ne in ((16, 10, 1, 1), (60, 3, 2, 1), (1, 4, 1, 1), (1023, 2, 1, 1)):

            def build_as(ctx, ne=ne, order=order):
                return ctx.argsort(leaf(ctx, T.F32, ne, "a"), order)

            yield OpCase("ARGSORT", {"ne": ne, "order": order.name}, build_as, exact=True)
        for ne in ((60, 3, 2, 1), (17, 4, 1, 1)):  # ties, signed zeros, infinities and NaN

            def build_ts(ctx, ne=ne, order=order):
                return ctx.argsort(leaf(ctx, T.F32, ne, "a"), order)

            yield OpCase("ARGSORT", {"ne": ne, "order": order.name, "data": "ties,inf,nan"}, build_ts,
                         inits={"a": _sort_specials}, exact=True)  # fmt: skip


def _im2col() -> Iterator[OpCase]:
    for dst in (T.F32, T.F16):
        # 2-D: kernel [OC, IC, KH, KW], input [N, IC, H, W]
        for (ic, kh, kw, h, w, n), (s0, s1, p0, p1, d0, d1) in (
            ((3, 3, 3, 10, 9, 2), (1, 1, 1, 1, 1, 1)),
            ((2, 2, 3, 7, 8, 1), (2, 1, 0, 2, 1, 2)),
        ):

            def build(ctx, dst=dst, ic=ic, kh=kh, kw=kw, h=h, w=w, n=n, s=(s0, s1, p0, p1, d0, d1)):
                k = leaf(ctx, T.F16, (kw, kh, ic, 4), "kernel")
                x = leaf(ctx, T.F32, (w, h, ic, n), "x")
                return ctx.im2col(k, x, *s, is_2d=True, dst_type=dst)

            yield OpCase("IM2COL", {"dst": dst, "ic": ic, "k": (kh, kw), "in": (h, w), "n": n,
                                    "s": (s0, s1), "p": (p0, p1), "d": (d0, d1)}, build,
                         _float_thr(dst))  # fmt: skip
        for (ic, kw, w, n), (s0, p0, d0) in (((3, 3, 17, 2), (1, 1, 1)), ((2, 5, 40, 1), (3, 2, 2))):

            def build1(ctx, dst=dst, ic=ic, kw=kw, w=w, n=n, s=(s0, p0, d0)):
                k = leaf(ctx, T.F16, (kw, ic, 4), "kernel")
                x = leaf(ctx, T.F32, (w, ic, n), "x")
                return ctx.im2col(k, x, s[0], 1, s[1], 0, s[2], 1, is_2d=False, dst_type=dst)

            yield OpCase("IM2COL", {"dst": dst, "1d": True, "ic": ic, "k": kw, "in": w, "n": n,
                                    "s": s0, "p": p0, "d": d0}, build1,
                         _float_thr(dst))  # fmt: skip


def _col2im() -> Iterator[OpCase]:
    for k, oc, t_in, b, s0, p0 in ((3, 4, 10, 1, 1, 0), (4, 2, 7, 2, 2, 1), (5, 3, 9, 1, 3, 2)):

        def build(ctx, k=k, oc=oc, t_in=t_in, b=b, s0=s0, p0=p0):
            return ctx.col2im_1d(leaf(ctx, T.F32, (k * oc, t_in, b), "a"), s0, oc, p0)

        yield OpCase("COL2IM_1D", {"k": k, "oc": oc, "t_in": t_in, "b": b, "s0": s0, "p0": p0},
                     build, 1e-7)  # fmt: skip


# views with extreme but legal strides, whose last element is their owner's last: kernels may
# trust the strides they are given and must reach exactly those bytes (the guards right after
# the owner catch any other)
EXTREME_VIEWS = {  # name: (ne, nb in elements, offset in elements)
    "sparse": ((4, 3, 2, 2), (7, 7 * 5, 7 * 5 * 3, 7 * 5 * 3 * 2 * 2), 6),
    "reversed": ((5, 3, 4, 2), (24, 8, 2, 1), 9),  # the innermost stride the largest
    "row-broadcast": ((16, 5, 1, 1), (1, 0, 16, 16), 48),  # every row the same memory
    "tail": ((3, 2, 2, 1), (1, 3, 6, 12), 988),
    "one-element": ((1, 1, 1, 1), (1, 1, 1, 1), 36),
}


def _extreme_view(ctx: Context, ta: GGMLType, kind: str, name: str) -> Tensor:
    ne, nb, offs = EXTREME_VIEWS[kind]
    last = offs + sum((n - 1) * s for n, s in zip(ne, nb, strict=True))
    es = ta.type_size
    base = ctx.new_tensor_ne(ta, last + 1, name=name)
    return ctx.view(base, ne, tuple(x * es for x in nb), offs * es)


def _views() -> Iterator[OpCase]:
    for kind in EXTREME_VIEWS:
        for ta in (T.F32, T.F16, T.I32):

            def build_cont(ctx, ta=ta, kind=kind):
                return ctx.cont(_extreme_view(ctx, ta, kind, "a"))

            yield OpCase("CONT", {"type": ta, "view": kind}, build_cont, 1e-7,
                         {"a": ints(-99, 99)} if ta == T.I32 else {}, exact=ta == T.I32)  # fmt: skip
        for ta in (T.F32, T.F16):

            def build_add(ctx, ta=ta, kind=kind):
                v = _extreme_view(ctx, ta, kind, "a")
                return ctx.add(v, ctx.new_tensor_ne(ta, *v.ne, name="b"))

            def build_unary(ctx, ta=ta, kind=kind):
                return ctx.scale(_extreme_view(ctx, ta, kind, "a"), 1.5, 0.25)

            yield OpCase("ADD", {"type": ta, "view": kind}, build_add, _float_thr(ta))
            yield OpCase("SCALE", {"type": ta, "view": kind}, build_unary, _float_thr(ta))
    for ta in (T.F32, T.F16, T.Q8_0, T.Q4_0):
        # weight rows 3 rows apart in a bigger matrix, starting at its 2nd row
        def build_mm(ctx, ta=ta):
            k, m, n = 64, 5, 3
            w = ctx.new_tensor_ne(ta, k, 3 * m + 1, name="w")
            rows = ctx.view(w, (k, m), (w.nb[0], 3 * w.nb[1]), w.nb[1])
            return ctx.mul_mat(rows, ctx.new_tensor_ne(T.F32, k, n, name="x"))

        yield OpCase("MUL_MAT", {"a": ta, "view": "rows-3-apart"}, build_mm, 5e-4)


GENERATORS = (
    _binary, _unary, _glu, _norms, _norm_mul, _soft_max, _attention, _rope, _mul_mat, _mul_mat_id,
    _get_set_rows, _copies, _concat, _reductions, _im2col, _col2im, _views,
)  # fmt: skip


def all_cases() -> list[OpCase]:
    """Every op case, ids unique."""
    cases = [c for g in GENERATORS for c in g()]
    seen: dict[str, OpCase] = {}
    for c in cases:
        if c.id in seen:
            raise AssertionError(f"duplicate conformance case id {c.id}")
        seen[c.id] = c
    return cases
