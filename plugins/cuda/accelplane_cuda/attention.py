"""The decode attention MUL_MAT(K, Q) → SOFT_MAX → MUL_MAT(V, ·) as one launch
(kernels/attention.cu: k_attention), where accelplane.core.fusion allows it and the shapes fit."""

from __future__ import annotations

import numpy as np
from accelplane.core.types import GGMLType as T

from . import compiler, matvec
from .args import HALF_TYPES, f64

MAX_R, MAX_D, MAX_DV = 8, 256, 256  # query rows, K row length, V rows it takes (Dv <= the block)
# a block's share of a row: cache positions times the K and V row lengths (D + Dv) it takes
# before the row is split over several blocks of a cluster. Decode steps on an H200 at 256 * 128,
# 128 * 128 and 64 * 128: a 1B's (D = Dv = 64) after a 64-token prompt 523, 528, 531 us, after
# 512 tokens 708, 692, 692 us; a qwen3moe's (D = Dv = 128) 1086, 1077, 1105 us. MAX_SPLIT: blocks
# per row at most (a portable cluster)
POSITION_WORK, MAX_SPLIT = 256 * 128, 8
_CTYPE = {T.F16: "__half", T.F32: "float"}

FAMILY = compiler.family("attention", {
    "k_attention": compiler.product(HALF_TYPES, HALF_TYPES, HALF_TYPES),
})  # fmt: skip


def fits(kq, sm, kqv) -> bool:
    """MUL_MAT(K, Q) → SOFT_MAX → MUL_MAT(V, ·) in the shapes k_attention takes: F16/F32
    caches with contiguous rows (K rows 16-byte aligned), D a multiple of 8 up to 256, Dv up
    to 256, at most 8 query rows, F32 queries and result, no ALiBi, the
    softmax over the products it reads."""
    k, q = kq.src
    a, mask = sm.src
    v, p = kqv.src
    elt = (T.F16, T.F32)
    if a is not kq or p is not sm or sm.op_params[1] != 0.0 or kq.type != T.F32 or sm.type != T.F32:
        return False
    if k.type not in elt or v.type not in elt or q.type != T.F32 or kqv.type != T.F32:
        return False
    if k.nb[0] != k.type.type_size or v.nb[0] != v.type.type_size or q.nb[0] != 4 or kqv.nb[0] != 4:
        return False
    if mask is not None and (mask.type not in elt or mask.nb[0] != mask.type.type_size
                             or mask.ne[0] < kq.ne[0] or mask.ne[1] < kq.ne[1]):  # fmt: skip
        return False
    d, dv = k.ne[0], v.ne[1]
    k16 = all(x % 16 == 0 for x in k.nb[1:]) and (k.buffer.ctx.ptr + k.offs) % 16 == 0
    return (d % 8 == 0 and d <= MAX_D and 0 < dv <= MAX_DV and q.ne[1] <= MAX_R and k16
            and kq.ne[0] > 0 and v.ne[0] == kq.ne[0] and kqv.ne[2] == kq.ne[2]
            and kqv.ne[3] == kq.ne[3])  # fmt: skip


def attention(plan, kq, sm, kqv) -> None:
    """Decode attention as one launch: a block per query row and head batch over a run of cache
    positions, a tile of up to 256 at a time; where the device has thread-block clusters
    (sm_90+), a cache longer than POSITION_WORK / (D + Dv) positions is split over up to
    MAX_SPLIT blocks of one cluster per row, combined in distributed shared memory."""
    k, q = kq.src
    mask = sm.src[1]
    v = kqv.src[0]
    nkv, r, ne2, ne3 = kq.ne
    batches, dv = ne2 * ne3, v.ne[1]
    positions = max(8, POSITION_WORK // (k.ne[0] + dv))
    split = min(MAX_SPLIT, -(-nkv // positions)) if plan.fns.cc >= 90 else 1
    per = -(-nkv // split)
    pc = -(-per // 8) * 8  # positions per block, whole 16-byte words of V
    split = -(-nkv // pc)
    threads = min(256, max(64, -(-dv // 32) * 32, -(-pc // 32) * 32))
    # V read 16 bytes at a time: 16-byte aligned rows, and the last row readable up to the first
    # multiple of 8 positions at or after n_kv (what lies past n_kv is zeroed)
    v16 = all(x % 16 == 0 for x in v.nb[1:]) and (v.buffer.ctx.ptr + v.offs) % 16 == 0
    last_row = sum((n - 1) * nb for n, nb in zip(v.ne[1:], v.nb[1:], strict=True))
    vwhole = v16 and v.offs + last_row + -(-nkv // 8) * 8 * v.nb[0] <= v.buffer.size
    mnb = mask.nb[1:] if mask is not None else (0, 0, 0)
    mne = (mask.ne[2], mask.ne[3]) if mask is not None else (1, 1)
    # each head batch's rows in K, V, Q, the mask and the result (broadcasts resolved here)
    r2k, r3k, r2v, r3v = ne2 // k.ne[2], ne3 // k.ne[3], ne2 // v.ne[2], ne3 // v.ne[3]
    offs = []
    for i3 in range(ne3):
        for i2 in range(ne2):
            offs += [i2 // r2k * k.nb[2] + i3 // r3k * k.nb[3], i2 // r2v * v.nb[2] + i3 // r3v * v.nb[3],
                     i2 * q.nb[2] + i3 * q.nb[3], i2 % mne[0] * mnb[1] + i3 % mne[1] * mnb[2],
                     i2 * kqv.nb[2] + i3 * kqv.nb[3]]  # fmt: skip
    P = plan.params([k.ne[0], nkv, r, dv, k.nb[1], q.nb[1], int(mask is not None), mnb[0],
                     f64(sm.op_params[0]), v.nb[1], kqv.nb[1], int(vwhole), kqv.nelements, pc,
                     *offs])  # fmt: skip
    # the output also quantized for the output projection (kernels/common.cuh: quantize1 wants
    # whole warps over 32-element units: Dv a multiple of 32, kqv contiguous)
    xq = matvec.xq_for(plan, kqv) if dv % 32 == 0 and kqv.is_contiguous() else np.uint64(0)
    mt = _CTYPE[mask.type] if mask is not None else "float"
    name = compiler.name("k_attention", _CTYPE[k.type], _CTYPE[v.type], mt)
    mp = plan.ptr(mask) if mask is not None else np.uint64(0)
    args = (P, plan.ptr(kqv), plan.ptr(k), plan.ptr(q), mp, plan.ptr(v), xq)
    plan.launch(name, 0, args, block=threads, grid=(split, r, batches), cluster=split)
