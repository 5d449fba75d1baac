"""The op catalog: every op's shape and type rules and its op_params layout, in one place.

``Context`` (graph.py) builds nodes through :func:`make`; each rule validates its sources and
returns the result's type and ne, raising :mod:`accelplane.errors` types with the op named.
op_params tuples follow ggml's layout (position for position), so a ggml kernel ports as is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import NamedTuple

from accelplane.core.types import GGMLType
from accelplane.errors import ShapeError, TypeMismatchError

T = GGMLType
FLOAT = frozenset({T.F32, T.F16, T.BF16})
QUANT = frozenset({T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL,
                   T.IQ4_XS})
ALL_TYPES = FLOAT | QUANT | {T.I32}


class Op(Enum):
    # members are singletons compared by identity: the C-level identity hash (Enum's own hashes
    # the name in Python, and graph planning looks ops up in sets and dicts many thousand times)
    __hash__ = object.__hash__

    NONE = "NONE"
    DUP = "DUP"
    ADD = "ADD"
    SUB = "SUB"
    MUL = "MUL"
    DIV = "DIV"
    SQR = "SQR"
    SQRT = "SQRT"
    LOG = "LOG"
    SIN = "SIN"
    COS = "COS"
    SUM = "SUM"
    SUM_ROWS = "SUM_ROWS"
    MEAN = "MEAN"
    ARGMAX = "ARGMAX"
    CONCAT = "CONCAT"
    NORM = "NORM"
    RMS_NORM = "RMS_NORM"
    L2_NORM = "L2_NORM"
    MUL_MAT = "MUL_MAT"
    MUL_MAT_ID = "MUL_MAT_ID"
    SCALE = "SCALE"
    CPY = "CPY"
    CONT = "CONT"
    RESHAPE = "RESHAPE"
    VIEW = "VIEW"
    PERMUTE = "PERMUTE"
    TRANSPOSE = "TRANSPOSE"
    GET_ROWS = "GET_ROWS"
    SET_ROWS = "SET_ROWS"
    SOFT_MAX = "SOFT_MAX"
    ROPE = "ROPE"
    CLAMP = "CLAMP"
    IM2COL = "IM2COL"
    COL2IM_1D = "COL2IM_1D"
    ARGSORT = "ARGSORT"
    LEAKY_RELU = "LEAKY_RELU"
    UNARY = "UNARY"
    GLU = "GLU"


class UnaryOp(IntEnum):
    """ggml_unary_op ids (op_params[0] of a UNARY node); the gaps are ggml's ops not in the
    catalog (SGN = 1, XIELU = 17)."""

    ABS = 0
    NEG = 2
    STEP = 3
    TANH = 4
    ELU = 5
    RELU = 6
    SIGMOID = 7
    GELU = 8
    GELU_QUICK = 9
    SILU = 10
    HARDSWISH = 11
    HARDSIGMOID = 12
    EXP = 13
    EXPM1 = 14
    SOFTPLUS = 15
    GELU_ERF = 16
    FLOOR = 18
    CEIL = 19
    ROUND = 20
    TRUNC = 21


class GluOp(IntEnum):
    """ggml_glu_op ids (op_params[0] of a GLU node; op_params[1] = swapped)."""

    GEGLU = 1
    SWIGLU = 2


class SortOrder(IntEnum):
    ASC = 0
    DESC = 1


ROPE_TYPE_NORMAL = 0
ROPE_TYPE_NEOX = 2

# ops that compute nothing: their result is a view of a source (ggml_op_is_empty)
VIEW_OPS = frozenset({Op.NONE, Op.RESHAPE, Op.VIEW, Op.PERMUTE, Op.TRANSPOSE})
# ops that write into their destination tensor's memory (result is a view of it)
WRITES_VIEW_SRC = frozenset({Op.CPY, Op.SET_ROWS})
# ops whose result may reuse src[0]'s memory (ggml_op_can_inplace)
INPLACE_OPS = frozenset(
    {Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.SCALE, Op.SQR, Op.SQRT, Op.LOG, Op.SIN, Op.COS,
     Op.UNARY, Op.CLAMP, Op.LEAKY_RELU, Op.RMS_NORM, Op.NORM, Op.SOFT_MAX, Op.ROPE}
)  # fmt: skip


@dataclass(frozen=True)
class Result:
    """What a rule returns: the node's type and ne, and for view-like ops its view source."""

    type: GGMLType
    ne: tuple[int, int, int, int]
    view_of: object | None = None  # the Tensor whose memory the result is
    view_offs: int = 0
    nb: tuple[int, ...] | None = None
    ndim: int | None = None  # host rank of the result (default: the largest source rank)


def _name(t) -> str:
    return t.name or f"#{t.uid}"


def _fail_type(op: Op, t, allowed) -> TypeMismatchError:
    names = ", ".join(sorted(x.name for x in allowed))
    return TypeMismatchError(f"{op.name}: tensor {_name(t)} has type {t.type.name}; allowed: {names}")


def _need_type(op: Op, t, allowed) -> None:
    if t.type not in allowed:
        raise _fail_type(op, t, allowed)


def _shape_err(op: Op, msg: str) -> ShapeError:
    return ShapeError(f"{op.name}: {msg}")


def can_repeat(b, a) -> bool:
    """b broadcasts to a: every a.ne[i] is a multiple of b.ne[i] (ggml_can_repeat)."""
    return all(_divides(bi, ai) for ai, bi in zip(a.ne, b.ne, strict=True))


def _divides(d: int, n: int) -> bool:
    """``n`` is a whole multiple of ``d`` (an empty dimension divides nothing)."""
    return d > 0 and n % d == 0


# --- rules -----------------------------------------------------------------------------------
def _binary(op, src, params):
    a, b = src
    _need_type(op, a, FLOAT)
    _need_type(op, b, FLOAT)
    if not can_repeat(b, a):
        raise _shape_err(op, f"{_name(b)} ne={list(b.ne)} does not broadcast to "
                             f"{_name(a)} ne={list(a.ne)}")  # fmt: skip
    return Result(a.type, a.ne)


def _same(op, src, params):
    (a,) = src
    _need_type(op, a, FLOAT)
    return Result(a.type, a.ne)


def _norm(op, src, params):
    (a,) = src
    _need_type(op, a, {T.F32})
    return Result(a.type, a.ne)


def _glu(op, src, params):
    a, b = src
    _need_type(op, a, FLOAT)
    if b is None:
        if a.ne[0] % 2:
            raise _shape_err(op, f"{_name(a)} ne0={a.ne[0]} must be even to split in halves")
        return Result(a.type, (a.ne[0] // 2, *a.ne[1:]))
    _need_type(op, b, {a.type})
    if a.ne != b.ne:
        raise _shape_err(op, f"gate {list(a.ne)} and up {list(b.ne)} differ in shape")
    return Result(a.type, a.ne)


def _not_empty_reduction(op, a, n: int, what: str) -> None:
    """ShapeError for a reduction over an empty axis (``n`` == 0) whose result is not empty:
    refused when built rather than left to every kernel to write the identity for it."""
    if n == 0:
        raise _shape_err(op, f"{what} of {_name(a)} ne={list(a.ne)} is empty")


def _reduce_rows(op, src, params):
    (a,) = src
    _need_type(op, a, FLOAT)
    if a.nrows:
        _not_empty_reduction(op, a, a.ne[0], "each row")
    return Result(T.F32, (1, *a.ne[1:]))


def _sum(op, src, params):
    (a,) = src
    _need_type(op, a, FLOAT)
    _not_empty_reduction(op, a, a.nelements, "the tensor")
    return Result(T.F32, (1, 1, 1, 1), ndim=1)


def _argmax(op, src, params):
    (a,) = src
    _need_type(op, a, {T.F32})
    if a.ne[2] != 1 or a.ne[3] != 1:
        raise _shape_err(op, f"{_name(a)} must be a matrix, ne={list(a.ne)}")
    if a.ne[0] == 0 and a.ne[1] > 0:
        raise _shape_err(op, f"rows of {_name(a)} are empty: no maximum")
    return Result(T.I32, (a.ne[1], 1, 1, 1), ndim=1)


def _argsort(op, src, params):
    (a,) = src
    _need_type(op, a, {T.F32})
    if params[0] not in (SortOrder.ASC, SortOrder.DESC):
        raise _shape_err(op, f"order must be 0 (asc) or 1 (desc), got {params[0]}")
    return Result(T.I32, a.ne)


def _concat(op, src, params):
    a, b = src
    dim = params[0]
    if not 0 <= dim < 4:
        raise _shape_err(op, f"dim {dim} out of range 0..3")
    _need_type(op, a, FLOAT | {T.I32})
    _need_type(op, b, {a.type})
    for i in range(4):
        if i != dim and a.ne[i] != b.ne[i]:
            raise _shape_err(op, f"ne[{i}] differs: {a.ne[i]} vs {b.ne[i]} (concat along {dim})")
    ne = list(a.ne)
    ne[dim] += b.ne[dim]
    return Result(a.type, tuple(ne))


def _soft_max(op, src, params):
    a, mask = src
    _need_type(op, a, {T.F32})
    if mask is not None:
        _need_type(op, mask, {T.F32, T.F16})
        if mask.ne[0] != a.ne[0] or mask.ne[1] < a.ne[1]:
            raise _shape_err(op, f"mask ne={list(mask.ne)} must have ne0={a.ne[0]} and "
                                 f"ne1>={a.ne[1]}")  # fmt: skip
        if not (_divides(mask.ne[2], a.ne[2]) and _divides(mask.ne[3], a.ne[3])):
            raise _shape_err(op, f"mask ne={list(mask.ne)} does not broadcast over "
                                 f"ne={list(a.ne)}")  # fmt: skip
    return Result(T.F32, a.ne)


def _rope(op, src, params):
    a, pos = src[:2]
    _need_type(op, a, {T.F32, T.F16})
    _need_type(op, pos, {T.I32})
    n_dims, mode = params[1], params[2]
    if mode not in (ROPE_TYPE_NORMAL, ROPE_TYPE_NEOX):
        raise _shape_err(op, f"mode {mode} not supported (0 normal, 2 neox)")
    if n_dims <= 0 or n_dims % 2 or n_dims > a.ne[0]:
        raise _shape_err(op, f"n_dims={n_dims} must be even and <= ne0={a.ne[0]}")
    if pos.ne[0] != a.ne[2] or pos.nelements != pos.ne[0]:
        raise _shape_err(op, f"positions ne={list(pos.ne)} must be a vector of ne2={a.ne[2]}")
    ff = src[2] if len(src) > 2 else None
    if ff is not None:
        _need_type(op, ff, {T.F32})
        if ff.nelements != ff.ne[0] or ff.ne[0] < n_dims // 2 or not ff.is_contiguous():
            raise _shape_err(op, f"freq_factors {_name(ff)} ne={list(ff.ne)} must be a contiguous vector "
                                 f"of at least n_dims/2 = {n_dims // 2} values")  # fmt: skip
    return Result(a.type, a.ne)


def _mul_mat(op, src, params):
    a, b = src
    _need_type(op, a, FLOAT | QUANT)
    _need_type(op, b, FLOAT)
    if a.ne[0] != b.ne[0]:
        raise _shape_err(op, f"inner dimensions differ: {_name(a)} ne0={a.ne[0]}, "
                             f"{_name(b)} ne0={b.ne[0]}")  # fmt: skip
    if not (_divides(a.ne[2], b.ne[2]) and _divides(a.ne[3], b.ne[3])):
        raise _shape_err(op, f"{_name(a)} ne={list(a.ne)} does not broadcast over "
                             f"{_name(b)} ne={list(b.ne)}")  # fmt: skip
    if a.is_transposed():
        raise _shape_err(op, f"{_name(a)} is transposed; make it contiguous first")
    if a.ne[1] * b.nrows:
        _not_empty_reduction(op, a, a.ne[0], "the inner dimension")
    return Result(T.F32, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]))


def _mul_mat_id(op, src, params):
    a, b, ids = src
    _need_type(op, a, FLOAT | QUANT)
    _need_type(op, b, {T.F32})
    _need_type(op, ids, {T.I32})
    if a.ne[3] != 1 or b.ne[3] != 1 or ids.ne[2] != 1 or ids.ne[3] != 1:
        raise _shape_err(op, "experts must be 3-D, b 3-D, ids 2-D")
    if a.ne[0] != b.ne[0]:
        raise _shape_err(op, f"inner dimensions differ: {a.ne[0]} vs {b.ne[0]}")
    if ids.ne[1] != b.ne[2]:
        raise _shape_err(op, f"ids ne1={ids.ne[1]} must equal b ne2={b.ne[2]} (tokens)")
    if not _divides(b.ne[1], ids.ne[0]):
        raise _shape_err(op, f"b ne1={b.ne[1]} must divide ids ne0={ids.ne[0]}")
    if ids.ne[0] > a.ne[2]:
        raise _shape_err(op, f"{ids.ne[0]} experts used per token > {a.ne[2]} experts")
    if a.ne[1] * ids.ne[0] * b.ne[2]:
        _not_empty_reduction(op, a, a.ne[0], "the inner dimension")
    return Result(T.F32, (a.ne[1], ids.ne[0], b.ne[2], 1))


def _get_rows(op, src, params):
    a, idx = src
    _need_type(op, a, ALL_TYPES)
    _need_type(op, idx, {T.I32})
    if a.ne[2] != idx.ne[1] or a.ne[3] != idx.ne[2] or idx.ne[3] != 1:
        raise _shape_err(op, f"rows ne={list(idx.ne)} do not match data ne={list(a.ne)} "
                             "(need idx.ne1 == a.ne2, idx.ne2 == a.ne3)")  # fmt: skip
    out_t = T.I32 if a.type == T.I32 else T.F32
    return Result(out_t, (a.ne[0], idx.ne[0], idx.ne[1], idx.ne[2]))


def _set_rows(op, src, params):
    a, b, idx = src
    _need_type(op, a, FLOAT | {T.Q8_0, T.Q4_0})
    _need_type(op, b, {T.F32})
    _need_type(op, idx, {T.I32})
    if a.ne[0] != b.ne[0]:
        raise _shape_err(op, f"row length differs: dst ne0={a.ne[0]}, src ne0={b.ne[0]}")
    if b.ne[1] != idx.ne[0] or idx.ne[3] != 1:
        raise _shape_err(op, f"rows ne={list(idx.ne)} must list src ne1={b.ne[1]} rows")
    if not (_divides(idx.ne[1], b.ne[2]) and _divides(idx.ne[2], b.ne[3])):
        raise _shape_err(op, f"rows ne={list(idx.ne)} do not broadcast over src ne={list(b.ne)}")
    if a.ne[2] != b.ne[2] or a.ne[3] != b.ne[3]:
        raise _shape_err(op, f"dst ne={list(a.ne)} and src ne={list(b.ne)} differ in ne2/ne3")
    _overlap(op, b, a)
    _overlap(op, idx, a)
    return Result(a.type, a.ne, view_of=a, nb=a.nb, ndim=a.ndim)


def _overlap(op, src, dst) -> None:
    """ShapeError when a write into ``dst`` would overwrite memory it reads from ``src`` (the
    same bytes under another layout): the result would depend on the kernel's order."""
    s_own, d_own = src.view_src or src, dst.view_src or dst
    if s_own is not d_own or src.nbytes == 0 or dst.nbytes == 0:
        return
    s0, d0 = src.view_offs if src.view_src else 0, dst.view_offs if dst.view_src else 0
    same = s0 == d0 and src.ne == dst.ne and src.nb == dst.nb and src.type == dst.type
    if not same and s0 < d0 + dst.nbytes and d0 < s0 + src.nbytes:
        raise _shape_err(op, f"{_name(dst)} overlaps the memory it is written from ({_name(src)})")


def _cpy(op, src, params):
    a, b = src
    if a.nelements != b.nelements:
        raise _shape_err(op, f"{_name(a)} has {a.nelements} elements, {_name(b)} {b.nelements}")
    _overlap(op, a, b)
    if a.type == T.I32 or b.type == T.I32:
        _need_type(op, b, {a.type})
    else:
        _need_type(op, a, FLOAT | QUANT)
        _need_type(op, b, FLOAT | {T.Q8_0, T.Q4_0})
        if a.type in QUANT and b.type != T.F32:
            raise _fail_type(op, b, {T.F32})
    return Result(b.type, b.ne, view_of=b, nb=b.nb, ndim=b.ndim)


def _cont(op, src, params):
    (a,) = src
    return Result(a.type, a.ne)


def _scale(op, src, params):
    if any(math.isnan(p) for p in params):
        raise _shape_err(op, f"parameters {params} must be numbers, not NaN")
    return _same(op, src, params)


def _clamp(op, src, params):
    lo, hi = params
    if math.isnan(lo) or math.isnan(hi) or lo > hi:  # (ggml computes MAX(MIN(x, hi), lo))
        raise _shape_err(op, f"min {lo} and max {hi} must be numbers with min <= max")
    return _same(op, src, params)


def _im2col(op, src, params):
    a, b = src  # kernel, input
    s0, s1, p0, p1, d0, d1, is_2d, dst_type = params
    _need_type(op, b, {T.F32})
    if dst_type not in (T.F32, T.F16):
        raise TypeMismatchError(f"IM2COL: dst type {GGMLType(dst_type).name}; allowed F16, F32")
    if min(s0, d0) < 1 or p0 < 0 or (is_2d and (min(s1, d1) < 1 or p1 < 0)):
        raise _shape_err(op, "strides and dilations must be >= 1, paddings >= 0")
    if not is_2d and p1 != 0:
        raise _shape_err(op, "1-D im2col takes no vertical padding (p1 must be 0)")
    if is_2d:
        if a.ne[2] != b.ne[2]:
            raise _shape_err(op, f"kernel IC={a.ne[2]} != input channels {b.ne[2]}")
        kh, kw = a.ne[1], a.ne[0]
        oh = (b.ne[1] + 2 * p1 - d1 * (kh - 1) - 1) // s1 + 1
        ow = (b.ne[0] + 2 * p0 - d0 * (kw - 1) - 1) // s0 + 1
        if oh <= 0 or ow <= 0:
            raise _shape_err(op, "kernel larger than the padded input")
        return Result(GGMLType(dst_type), (a.ne[2] * kh * kw, ow, oh, b.ne[3]))
    if a.ne[1] != b.ne[1]:
        raise _shape_err(op, f"kernel IC={a.ne[1]} != input channels {b.ne[1]}")
    kw = a.ne[0]
    ow = (b.ne[0] + 2 * p0 - d0 * (kw - 1) - 1) // s0 + 1
    if ow <= 0:
        raise _shape_err(op, "kernel larger than the padded input")
    return Result(GGMLType(dst_type), (a.ne[1] * kw, ow, b.ne[2], 1))


def _col2im_1d(op, src, params):
    (a,) = src
    s0, oc, p0 = params
    _need_type(op, a, {T.F32})
    if oc <= 0 or a.ne[0] % oc:
        raise _shape_err(op, f"ne0={a.ne[0]} is not a multiple of oc={oc}")
    if s0 < 1 or p0 < 0:
        raise _shape_err(op, "stride must be >= 1 and padding >= 0")
    k = a.ne[0] // oc
    t_out = (a.ne[1] - 1) * s0 + k - 2 * p0
    if t_out <= 0:
        raise _shape_err(op, f"output length {t_out} <= 0")
    if a.ne[3] != 1:
        raise _shape_err(op, "input must be at most 3-D")
    return Result(T.F32, (t_out, oc, a.ne[2], 1))


def _view(op, src, params):
    (a,) = src
    ne, nb, offs = params
    return Result(a.type, ne, view_of=a, view_offs=offs, nb=nb)


RULES: dict[Op, Callable] = {
    Op.ADD: _binary, Op.SUB: _binary, Op.MUL: _binary, Op.DIV: _binary,
    Op.SQR: _same, Op.SQRT: _same, Op.LOG: _same, Op.SIN: _same, Op.COS: _same,
    Op.CLAMP: _clamp, Op.LEAKY_RELU: _same, Op.UNARY: _same, Op.SCALE: _scale,
    Op.GLU: _glu, Op.NORM: _norm, Op.RMS_NORM: _norm, Op.L2_NORM: _norm,
    Op.SOFT_MAX: _soft_max, Op.ROPE: _rope, Op.MUL_MAT: _mul_mat, Op.MUL_MAT_ID: _mul_mat_id,
    Op.GET_ROWS: _get_rows, Op.SET_ROWS: _set_rows, Op.CPY: _cpy, Op.CONT: _cont,
    Op.DUP: _cont, Op.CONCAT: _concat, Op.SUM: _sum, Op.SUM_ROWS: _reduce_rows,
    Op.MEAN: _reduce_rows, Op.ARGMAX: _argmax, Op.ARGSORT: _argsort, Op.IM2COL: _im2col,
    Op.COL2IM_1D: _col2im_1d, Op.VIEW: _view, Op.RESHAPE: _view, Op.PERMUTE: _view,
    Op.TRANSPOSE: _view,
}  # fmt: skip


def op_desc(t) -> str:
    """ggml-style op name: the unary/glu sub-op for UNARY and GLU nodes (e.g. 'SILU')."""
    if t.op is Op.UNARY:
        return UnaryOp(t.op_params[0]).name
    if t.op is Op.GLU:
        return GluOp(t.op_params[0]).name
    return t.op.name if t.op is not None else "NONE"


# the batch from which a device takes a product whose weights live in host memory: copying the
# weights then costs less than the host computing it (ggml's GGML_OP_OFFLOAD_MIN_BATCH)
OFFLOAD_MIN_BATCH = 32


def offload_batch(t) -> int:
    """How many activation rows product ``t`` multiplies per weight byte read, for offload_op:
    MUL_MAT's src1 rows (ne1 * ne2 * ne3), MUL_MAT_ID's tokens; 0 for any other op (ggml's
    get_op_batch_size, which never offloads the rest)."""
    if t.op is Op.MUL_MAT:
        b = t.src[1]
        return b.ne[1] * b.ne[2] * b.ne[3]
    if t.op is Op.MUL_MAT_ID:
        return t.src[2].ne[1]
    return 0


def op_flops(t) -> int:
    """Floating-point operations of a node, for perf reports (0 when not meaningful)."""
    if t.op is Op.MUL_MAT:
        a = t.src[0]
        return 2 * a.ne[0] * t.nelements
    if t.op is Op.MUL_MAT_ID:
        return 2 * t.src[0].ne[0] * t.nelements
    return 0


def op_bytes(t) -> int:
    """Bytes the node reads and writes (its output plus all sources): test-backend-ops op_size."""
    n = t.nbytes
    for s in t.src:
        if s is not None:
            n += s.nbytes
    return n


class RopeParams(NamedTuple):
    """A ROPE node's parameters by name. Its op_params are ggml's, position for position: (0,
    n_dims, mode, n_ctx (unused, 0), n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor,
    beta_fast, beta_slow)."""

    n_dims: int
    mode: int
    n_ctx_orig: int
    freq_base: float
    freq_scale: float
    ext_factor: float
    attn_factor: float
    beta_fast: float
    beta_slow: float


def rope_params(t) -> RopeParams:
    """The parameters of ROPE node ``t`` (read from its ggml-laid-out op_params)."""
    p = t.op_params
    return RopeParams(p[1], p[2], p[4], *p[5:11])


def rope_yarn_corr_dims(
    n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float, beta_slow: float
) -> tuple[float, float]:
    """YaRN correction range [start, end] of rotary dimensions (ggml_rope_yarn_corr_dims)."""

    if n_ctx_orig <= 0:  # ggml carries on with an empty range
        return 0.0, -math.inf

    def corr_dim(n_rot: float) -> float:
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(freq_base))

    start = math.floor(corr_dim(beta_fast))
    end = math.ceil(corr_dim(beta_slow))
    return max(0.0, start), min(n_dims - 1.0, end)
