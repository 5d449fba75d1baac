"""Matrix products: MUL_MAT (tiled mul_mat for more than MUL_MAT_VEC_MAX_COLS columns, else the
mat-vec kernels) and MUL_MAT_ID, with the quantized mat-vec's variants and its int8
activations (quantize_b8)."""

from __future__ import annotations

from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType

from .base import LOCAL_SIZE, MMV_Q, Caps, Dispatch, Scratch, enb, eoffs, pack, workgroups

T = GGMLType
MUL_MAT_VEC_MAX_COLS = 8  # mul_mat_vec handles up to this many columns per workgroup; more: tiled
MUL_MAT_SHADERS = {"mul_mat", "mul_mat_vec", "mul_mat_vec_q", "mul_mat_vec_q_sm", "mul_mat_vec_q8"}

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
    if ta not in MMV_Q or rows == 0:
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


def _quantize_b8(b: Tensor, wtype: GGMLType) -> Dispatch:
    """b's columns as int8 blocks for mul_mat_vec_q8: per column K bytes, then per column K/32
    float scales (one region, laid out by quantize_b8.comp); for Q4_0 and Q8_0 weights the
    scales rounded to f16, as ggml's Q8_0 activation blocks store them."""
    cols = b.ne[1] * b.ne[2] * b.ne[3]
    nbytes = cols * b.ne[0] + cols * (b.ne[0] // 32) * 4
    push = pack(b.ne, enb(b), eoffs(b), 0)  # the region's offset goes into the last word
    scratch = Scratch(b, nbytes, 3, len(push) - 4, True)
    groups = workgroups(cols * b.ne[0] // 8, LOCAL_SIZE["quantize_b8"])  # a thread per 8 values
    f16_scale = int(wtype in (GGMLType.Q4_0, GGMLType.Q8_0))
    return Dispatch("quantize_b8", (int(b.type), f16_scale), (b, None, None, None), push, groups, scratch)


def _mmv_dispatches(q, a: Tensor, b: Tensor, c: Tensor | None, t: Tensor, push: bytes, groups: int):
    shader, spec, _ = q
    if shader != "mul_mat_vec_q8":
        return [Dispatch(shader, spec, (a, b, c, t), push, groups)]
    pre = _quantize_b8(b, a.type)
    reads = Scratch(b, pre.scratch.nbytes, 1, PUSH_OFFB, False)  # type: ignore[union-attr]
    return [pre, Dispatch(shader, spec, (a, None, c, t), push, groups, reads)]


def mul_mat(t: Tensor, caps: Caps) -> list[Dispatch]:
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


def mul_mat_id(t: Tensor, caps: Caps) -> list[Dispatch]:
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
