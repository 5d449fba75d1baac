"""Ops → shader dispatches: which shader, its specialization constants, its bindings and push
constants, and how many workgroups. Pure Python (no Vulkan): ``supports`` is the plugin's
exact answer to supports_op, and ``dispatches`` what a plan records for a node.

Conventions shared with shaders/common.glsl: bindings A, B, C, D = 0..3 (sources, then the
destination); offsets and strides are in units of the tensor's element (4 bytes for F32/I32,
2 for F16/BF16, 2-byte words for quantized blocks); element types are specialization
constants holding GGUF type ids.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass

from accelplane.core.ops import ROPE_TYPE_NEOX, VIEW_OPS, GluOp, Op, SortOrder, UnaryOp, rope_yarn_corr_dims
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType

from .tuning import Tuning

T = GGMLType
FLOAT = frozenset({T.F32, T.F16, T.BF16})
QUANT = frozenset({T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K})
NEEDS_16BIT = FLOAT - {T.F32} | QUANT  # read or written through 16-bit storage
NO_MASK = 0xFFFFFFFF
MUL_MAT_VEC_MAX_COLS = 8  # mul_mat_vec handles up to this many columns per workgroup; more: tiled

UNARY_CODES = {
    Op.SCALE: 0,
    Op.SQR: 1,
    Op.SQRT: 2,
    Op.LOG: 3,
    Op.SIN: 4,
    Op.COS: 5,
    Op.CLAMP: 6,
    Op.LEAKY_RELU: 7,
    UnaryOp.ABS: 8,
    UnaryOp.NEG: 9,
    UnaryOp.TANH: 10,
    UnaryOp.RELU: 11,
    UnaryOp.SIGMOID: 12,
    UnaryOp.GELU: 13,
    UnaryOp.GELU_QUICK: 14,
    UnaryOp.SILU: 15,
    UnaryOp.EXP: 16,
}
BINARY_CODES = {Op.ADD: 0, Op.SUB: 1, Op.MUL: 2, Op.DIV: 3}
LOCAL_SIZE = {  # local_size_x of each shader (workgroup size)
    "unary": 256,
    "binary": 256,
    "glu": 256,
    "copy": 256,
    "quantize": 64,
    "quantize_b8": 64,
    "set_rows": 64,
    "get_rows": 256,
    "concat": 256,
    "rope": 256,
    "argsort": 128,
    "im2col": 256,
    "col2im": 256,
}


@dataclass(frozen=True)
class Caps:
    """What the device offers that kernels depend on."""

    storage16: bool = True  # storageBuffer16BitAccess: F16/BF16/quantized tensors
    subgroup: int = 0  # subgroup size where compute shaders have subgroup arithmetic, else 0
    int_dot: bool = False  # shaderIntegerDotProduct: packed int8 dot products (mul_mat_vec_q8)
    mmv_rows: int = 4  # weight rows per workgroup of mul_mat_vec_q (0: mul_mat_vec), tuning.py
    mmv_wg: int = 128  # threads per workgroup of mul_mat_vec_q

    @classmethod
    def of(cls, storage16: bool, subgroup: int, int_dot: bool, t: Tuning) -> Caps:
        """The device's features as the user's settings (``t``) let the kernels use them."""
        return cls(storage16, subgroup if t.mmv_subgroup else 0, int_dot and t.mmv_q8, t.mmv_rows, t.mmv_wg)


@dataclass(frozen=True)
class Scratch:
    """A region of the plan's scratch buffer holding a derived copy of tensor ``src`` (int8
    blocks of mul_mat_vec_q8's activations): bound as binding ``slot`` in place of a tensor,
    its offset in 4-byte words written by the plan into the push constants at byte
    ``push_at``. The writing dispatch (``write``) is recorded only while no region holds that
    copy of ``src`` already (a plan quantizes an activation once for all its products, until
    a node writes the activation's memory); a reading dispatch follows its writer."""

    src: Tensor
    nbytes: int
    slot: int
    push_at: int
    write: bool


@dataclass
class Dispatch:
    """One vkCmdDispatch: ``groups`` workgroups of ``shader`` (spread over x/y/z by the plan)."""

    shader: str
    spec: tuple[int, ...]
    bindings: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]  # A, B, C, D
    push: bytes
    groups: int
    scratch: Scratch | None = None  # takes the place of bindings[scratch.slot]


# --- units --------------------------------------------------------------------------------------
def unit(t: Tensor) -> int:
    """Bytes of one addressing unit of ``t`` in the shaders."""
    return 2 if t.type in QUANT else t.type.type_size


def eoffs(t: Tensor) -> int:
    return t.offs // unit(t)


def enb(t: Tensor) -> tuple[int, int, int, int]:
    u = unit(t)
    return tuple(n // u for n in t.nb)  # type: ignore[return-value]


def _addressable(t: Tensor) -> bool:
    u = unit(t)
    return all(n % u == 0 for n in t.nb) and t.view_offs % u == 0


def pack(*vals) -> bytes:
    """Push constants: 4-tuples become uvec4, ints uint (or int), floats float (std430)."""
    fmt, flat = "<", []
    for v in vals:
        if isinstance(v, tuple):
            fmt += "IIII"
            flat.extend(int(x) for x in v)
        elif isinstance(v, float):
            fmt += "f"
            flat.append(v)
        else:
            fmt += "I" if v >= 0 else "i"
            flat.append(int(v))
    out = struct.pack(fmt, *flat)
    assert len(out) <= 128, f"push constants of {len(out)} bytes exceed 128"
    return out


def _groups(n: int, local: int) -> int:
    return -(-n // local)


# --- builders: node -> dispatches ---------------------------------------------------------------
def _elementwise(shader: str, spec, bindings, push, n: int) -> list[Dispatch]:
    return [Dispatch(shader, tuple(int(x) for x in spec), bindings, push, _groups(n, LOCAL_SIZE[shader]))]


def _unary(t: Tensor) -> list[Dispatch]:
    (a,) = t.src
    code = UNARY_CODES[UnaryOp(t.op_params[0])] if t.op is Op.UNARY else UNARY_CODES[t.op]
    p = [float(x) for x in t.op_params[:2]] if t.op in (Op.SCALE, Op.CLAMP, Op.LEAKY_RELU) else []
    p += [0.0] * (2 - len(p))
    push = pack(t.ne, enb(a), enb(t), eoffs(a), eoffs(t), *p)
    return _elementwise("unary", (code, a.type, t.type), (a, None, None, t), push, t.nelements)


def _binary(t: Tensor) -> list[Dispatch]:
    a, b = t.src
    push = pack(t.ne, enb(a), b.ne, enb(b), enb(t), eoffs(a), eoffs(b), eoffs(t))
    spec = (BINARY_CODES[t.op], a.type, b.type, t.type)
    return _elementwise("binary", spec, (a, b, None, t), push, t.nelements)


def _glu(t: Tensor) -> list[Dispatch]:
    a, b = t.src
    op, swapped = GluOp(t.op_params[0]), bool(t.op_params[1])
    split = b is None
    xo, go = (0, t.ne[0]) if not swapped else (t.ne[0], 0)
    push = pack(
        t.ne,
        enb(a),
        enb(b if b is not None else a),
        enb(t),
        eoffs(a),
        eoffs(b) if b is not None else 0,
        eoffs(t),
        xo if split else 0,
        go if split else 0,
    )
    spec = (0 if op is GluOp.SWIGLU else 1, a.type, (b if b is not None else a).type, int(split))
    return _elementwise("glu", spec, (a, b, None, t), push, t.nelements)


def _rows(t: Tensor, shader: str, spec, push, bindings) -> list[Dispatch]:
    """One workgroup per row of t's source."""
    return [Dispatch(shader, tuple(int(x) for x in spec), bindings, push, t.src[0].nrows)]


def _norm(t: Tensor, mul: Tensor | None = None) -> list[Dispatch]:
    """A row norm; with ``mul`` (the MUL that reads it, fused) times the MUL's other operand,
    written to the MUL's tensor."""
    (a,) = t.src
    code = {Op.NORM: 0, Op.RMS_NORM: 1, Op.L2_NORM: 2}[t.op]
    out, w = (t, None) if mul is None else (mul, mul.src[1])
    wq = (w.ne, enb(w), eoffs(w)) if w is not None else ((1, 1, 1, 1), (0, 0, 0, 0), 0)
    push = pack(a.ne, enb(a), enb(out), wq[0], wq[1], eoffs(a), eoffs(out), wq[2], float(t.op_params[0]))
    return _rows(t, "norm", (code, int(w is not None)), push, (a, w, None, out))


def fused_dispatches(nodes, i: int, fusion) -> tuple[int, list[Dispatch]]:
    """Nodes ``i ..`` as one dispatch where a fused shader exists and accelplane.core.fusion allows
    it: (how many nodes it covers, its dispatches); (0, []) where none applies."""
    m = fusion.norm_mul(i)
    if m is not None:
        return 2, _norm(nodes[i], m)
    return 0, []


def _soft_max(t: Tensor) -> list[Dispatch]:
    a, mask = t.src
    scale, max_bias = float(t.op_params[0]), float(t.op_params[1])
    n_head = a.ne[2]
    nhl2 = 1 << int(math.floor(math.log2(n_head))) if n_head > 0 else 1
    m0 = 2.0 ** (-max_bias / nhl2)
    m1 = 2.0 ** (-(max_bias / 2.0) / nhl2)
    m = mask if mask is not None else a
    push = pack(
        a.ne, enb(a), m.ne, enb(m), enb(t), eoffs(a), eoffs(m), eoffs(t), scale, max_bias, m0, m1, nhl2
    )
    spec = (mask.type if mask is not None else NO_MASK,)
    return _rows(t, "softmax", spec, push, (a, mask, None, t))


def _rope(t: Tensor) -> list[Dispatch]:
    a, pos = t.src
    _, n_dims, mode, n_ctx_orig, base, fscale, ext, attn, bfast, bslow = t.op_params[:10]
    low, high = rope_yarn_corr_dims(n_dims, n_ctx_orig, base, bfast, bslow)
    if not math.isfinite(high):
        high = -1e30  # n_ctx_orig <= 0: an empty ramp, as ggml (the ramp is then 0 or 1)
    mscale = attn * (1.0 + 0.1 * math.log(1.0 / fscale)) if ext != 0.0 else attn
    push = pack(
        a.ne,
        enb(a),
        enb(t),
        eoffs(a),
        eoffs(pos),
        eoffs(t),
        enb(pos)[0],
        int(n_dims),
        -2.0 * math.log2(base) / n_dims,
        float(fscale),
        float(ext),
        float(mscale),
        float(low),
        float(high),
    )
    n = (a.ne[0] + 1) // 2 * a.ne[1] * a.ne[2] * a.ne[3]
    return _elementwise("rope", (a.type, int(mode == ROPE_TYPE_NEOX)), (a, pos, None, t), push, n)


# quantized weights by 1..8 columns (mul_mat_vec_q): rows per workgroup and threads per
# workgroup (Caps.mmv_rows = 0 keeps such products on mul_mat_vec, one row a workgroup).
# With integer dot products the activations are quantized to int8 blocks first (quantize_b8)
# and the products run on packed 4x8-bit dot products (mul_mat_vec_q8; Caps.int_dot off keeps
# the float kernel).
MMV_SHARED_FLOATS = 4096  # shared-memory reduction without subgroups: 16 KiB, Vulkan's minimum
PUSH_OFFB = 72  # byte offset of offb in mul_mat_vec's push constants (4 uvec4, K, offa, offb)


def _mmv_q(a: Tensor, ncols: int, id_mode: int, tb: GGMLType, caps: Caps):
    """(shader, spec, rows per workgroup) of mul_mat_vec_q(8) for weights ``a``, or None for
    mul_mat_vec."""
    ta, k = a.type, a.ne[0]
    rows = caps.mmv_rows
    if ta not in QUANT or rows == 0:
        return None
    sg = caps.subgroup
    q8 = bool(sg) and caps.int_dot
    per = 16 if q8 and ta in (T.Q4_K, T.Q6_K) else 8  # values a thread takes at a time
    wg = caps.mmv_wg
    while wg > 32 and wg // 2 >= k // per:  # short rows: no idle threads
        wg //= 2
    # Q4_K rows that start 4-byte aligned (every block then is): 32-bit loads
    a4 = int(ta == T.Q4_K and eoffs(a) % 2 == 0 and all(n % 2 == 0 for n in enb(a)[1:]))
    if sg:
        shader = "mul_mat_vec_q8" if q8 else "mul_mat_vec_q"
        return shader, (int(ta), int(tb), ncols, id_mode, rows, sg, wg, a4), rows
    while rows > 1 and ncols * rows * wg > MMV_SHARED_FLOATS:
        rows //= 2
    return "mul_mat_vec_q_sm", (int(ta), int(tb), ncols, id_mode, rows, 1, wg, a4), rows


def _quantize_b8(b: Tensor) -> Dispatch:
    """b's columns as int8 blocks for mul_mat_vec_q8: per column K bytes, then per column K/32
    float scales (one region, laid out by quantize_b8.comp)."""
    cols = b.ne[1] * b.ne[2] * b.ne[3]
    nbytes = cols * b.ne[0] + cols * (b.ne[0] // 32) * 4
    push = pack(b.ne, enb(b), eoffs(b), 0)  # the region's offset goes into the last word
    scratch = Scratch(b, nbytes, 3, len(push) - 4, True)
    groups = _groups(cols * b.ne[0] // 8, LOCAL_SIZE["quantize_b8"])  # a thread per 8 values
    return Dispatch("quantize_b8", (int(b.type),), (b, None, None, None), push, groups, scratch)


def _mmv_dispatches(q, a: Tensor, b: Tensor, c: Tensor | None, t: Tensor, push: bytes, groups: int):
    shader, spec, _ = q
    if shader != "mul_mat_vec_q8":
        return [Dispatch(shader, spec, (a, b, c, t), push, groups)]
    pre = _quantize_b8(b)
    reads = Scratch(b, pre.scratch.nbytes, 1, PUSH_OFFB, False)  # type: ignore[union-attr]
    return [pre, Dispatch(shader, spec, (a, None, c, t), push, groups, reads)]


def _mul_mat(t: Tensor, caps: Caps) -> list[Dispatch]:
    a, b = t.src
    K = a.ne[0]
    r2, r3 = b.ne[2] // a.ne[2], b.ne[3] // a.ne[3]
    common = (t.ne, enb(a), enb(b), enb(t), K, eoffs(a), eoffs(b), eoffs(t), r2, r3)
    bind = (a, b, None, t)
    batches = t.ne[2] * t.ne[3]
    if t.ne[1] > MUL_MAT_VEC_MAX_COLS:
        tiles = -(-t.ne[0] // 64) * -(-t.ne[1] // 64) * batches
        return [Dispatch("mul_mat", (int(a.type), int(b.type)), bind, pack(*common), tiles)]
    push = pack(*common, 0, 0, 0, 0)
    q = _mmv_q(a, t.ne[1], 0, b.type, caps)
    if q is not None:  # NCOLS = n: no idle columns
        return _mmv_dispatches(q, a, b, None, t, push, -(-t.ne[0] // q[2]) * batches)
    ncols = 1 if t.ne[1] == 1 else MUL_MAT_VEC_MAX_COLS
    groups = t.ne[0] * -(-t.ne[1] // ncols) * batches
    return [Dispatch("mul_mat_vec", (int(a.type), int(b.type), ncols, 0), bind, push, groups)]


def _mul_mat_id(t: Tensor, caps: Caps) -> list[Dispatch]:
    as_, b, ids = t.src
    nbi = enb(ids)
    push = pack(
        t.ne,
        enb(as_),
        enb(b),
        enb(t),
        as_.ne[0],
        eoffs(as_),
        eoffs(b),
        eoffs(t),
        b.ne[1],
        1,
        eoffs(ids),
        nbi[0],
        nbi[1],
        as_.ne[2],
    )
    q = _mmv_q(as_, 1, 1, b.type, caps)
    if q is not None:
        return _mmv_dispatches(q, as_, b, ids, t, push, -(-t.ne[0] // q[2]) * t.ne[1] * t.ne[2])
    groups = t.ne[0] * t.ne[1] * t.ne[2]
    return [Dispatch("mul_mat_vec", (int(as_.type), int(b.type), 1, 1), (as_, b, ids, t), push, groups)]


def _get_rows(t: Tensor) -> list[Dispatch]:
    a, idx = t.src
    push = pack(t.ne, enb(a), enb(idx), enb(t), eoffs(a), eoffs(idx), eoffs(t), a.ne[1])
    return _elementwise("get_rows", (a.type, t.type), (a, idx, None, t), push, t.nelements)


def _set_rows(t: Tensor) -> list[Dispatch]:
    dst, src, idx = t.src
    push = pack(src.ne, enb(src), idx.ne, enb(idx), enb(t), eoffs(src), eoffs(idx), eoffs(t), dst.ne[1])
    per = 32 if dst.type in QUANT else 1
    return _elementwise("set_rows", (dst.type,), (src, None, idx, t), push, src.nelements // per)


def _cpy(t: Tensor) -> list[Dispatch]:
    a = t.src[0]
    dst = t  # CPY: t is a view of src[1] (same memory and layout); CONT/DUP: t itself
    push = pack(a.ne, enb(a), dst.ne, enb(dst), eoffs(a), eoffs(dst))
    if dst.type in QUANT:
        return _elementwise("quantize", (a.type, dst.type), (a, None, None, dst), push, dst.nelements // 32)
    return _elementwise("copy", (a.type, dst.type), (a, None, None, dst), push, dst.nelements)


def _concat(t: Tensor) -> list[Dispatch]:
    a, b = t.src
    push = pack(t.ne, a.ne, enb(a), enb(b), enb(t), eoffs(a), eoffs(b), eoffs(t), t.op_params[0])
    return _elementwise("concat", (int(t.type.type_size == 4),), (a, b, None, t), push, t.nelements)


def _reduce(t: Tensor) -> list[Dispatch]:
    (a,) = t.src
    code = {Op.SUM_ROWS: 0, Op.MEAN: 1, Op.SUM: 2}[t.op]
    push = pack(a.ne, enb(a), enb(t), eoffs(a), eoffs(t))
    groups = 1 if t.op is Op.SUM else a.nrows
    return [Dispatch("reduce", (code, int(a.type)), (a, None, None, t), push, groups)]


def _argmax(t: Tensor) -> list[Dispatch]:
    (a,) = t.src
    push = pack(a.ne, enb(a), eoffs(a), eoffs(t), enb(t)[0])
    return [Dispatch("argmax", (), (a, None, None, t), push, a.ne[1])]


def _argsort(t: Tensor) -> list[Dispatch]:
    (a,) = t.src
    push = pack(a.ne, enb(a), enb(t), eoffs(a), eoffs(t), int(t.op_params[0] == SortOrder.DESC))
    return _elementwise("argsort", (), (a, None, None, t), push, a.nelements)


def _im2col(t: Tensor) -> list[Dispatch]:
    k, x = t.src
    s0, s1, p0, p1, d0, d1, is_2d, _ = t.op_params
    if is_2d:
        kh, kw, ih, iw = k.ne[1], k.ne[0], x.ne[1], x.ne[0]
    else:
        kh, kw, ih, iw = 1, k.ne[0], 1, x.ne[0]
    push = pack(t.ne, enb(x), enb(t), eoffs(x), eoffs(t), s0, s1, p0, p1, d0, d1, kh, kw, ih, iw)
    return _elementwise("im2col", (t.type, int(bool(is_2d))), (k, x, None, t), push, t.nelements)


def _col2im(t: Tensor) -> list[Dispatch]:
    (a,) = t.src
    s0, oc, p0 = t.op_params
    push = pack(t.ne, enb(a), enb(t), eoffs(a), eoffs(t), s0, p0, a.ne[0] // oc, a.ne[1])
    return _elementwise("col2im", (), (a, None, None, t), push, t.nelements)


BUILDERS: dict[Op, Callable[..., list[Dispatch]]] = {
    Op.ADD: _binary,
    Op.SUB: _binary,
    Op.MUL: _binary,
    Op.DIV: _binary,
    Op.SCALE: _unary,
    Op.SQR: _unary,
    Op.SQRT: _unary,
    Op.LOG: _unary,
    Op.SIN: _unary,
    Op.COS: _unary,
    Op.CLAMP: _unary,
    Op.LEAKY_RELU: _unary,
    Op.UNARY: _unary,
    Op.GLU: _glu,
    Op.NORM: _norm,
    Op.RMS_NORM: _norm,
    Op.L2_NORM: _norm,
    Op.SOFT_MAX: _soft_max,
    Op.ROPE: _rope,
    Op.MUL_MAT: _mul_mat,
    Op.MUL_MAT_ID: _mul_mat_id,
    Op.GET_ROWS: _get_rows,
    Op.SET_ROWS: _set_rows,
    Op.CPY: _cpy,
    Op.CONT: _cpy,
    Op.DUP: _cpy,
    Op.CONCAT: _concat,
    Op.SUM: _reduce,
    Op.SUM_ROWS: _reduce,
    Op.MEAN: _reduce,
    Op.ARGMAX: _argmax,
    Op.ARGSORT: _argsort,
    Op.IM2COL: _im2col,
    Op.COL2IM_1D: _col2im,
}
NEEDS_CAPS = frozenset({Op.MUL_MAT, Op.MUL_MAT_ID})  # builders that take the device's Caps too
MUL_MAT_SHADERS = {"mul_mat", "mul_mat_vec", "mul_mat_vec_q", "mul_mat_vec_q_sm", "mul_mat_vec_q8"}
SHADERS = tuple(sorted({*LOCAL_SIZE, "norm", "softmax", "reduce", "argmax"} | MUL_MAT_SHADERS))


def supports(t: Tensor, caps: Caps) -> bool:
    """Exact supports_op: every node these builders accept computes what the oracle does."""
    if t.op in VIEW_OPS:
        return True
    if t.op not in BUILDERS:
        return False
    tensors = [t, *(s for s in t.src if s is not None)]
    if not caps.storage16 and any(x.type in NEEDS_16BIT for x in tensors):
        return False
    if not all(_addressable(x) for x in tensors):
        return False
    if t.op in (Op.CONT, Op.DUP) and t.type in QUANT:
        return False  # copy.comp writes element types only
    if t.op in (Op.MUL_MAT, Op.MUL_MAT_ID):
        a = t.src[0]
        if a.nb[0] != a.type.type_size:  # the kernels read a's rows as packed
            return False
    return t.nelements < 2**31


def dispatches(t: Tensor, caps: Caps | None = None) -> list[Dispatch]:
    """What to record for node ``t`` on a device with ``caps`` (nothing for empty tensors)."""
    if t.nelements == 0:
        return []
    build = BUILDERS[t.op]
    ds = build(t, caps or Caps()) if t.op in NEEDS_CAPS else build(t)  # type: ignore[call-arg]
    return [d for d in ds if d.groups > 0]
