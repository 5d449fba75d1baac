"""The decode attention MUL_MAT(K, Q) → SOFT_MAX → MUL_MAT(V, ·) as one launch
(kernels/attention.cu: k_attention), where accelplane.core.fusion allows it and the shapes fit."""

from __future__ import annotations

import numpy as np
from accelplane.core.types import GGMLType as T

from . import compiler, matvec
from .args import HALF_TYPES, f64

GROUPS = 4  # chunks of 32 positions per k_attention block at most (kernels/attention.cu: ATT_G)
ROWS = (1, 2, 4, 8)  # query rows k_attention is compiled for (a launch takes the next power of two)
MAX_D, MAX_DV, MAX_KV = 256, 128, 8192  # K row length, V rows, cache positions it takes
_CTYPE = {T.F16: "__half", T.F32: "float"}

FAMILY = compiler.family("attention", {
    "k_attention": compiler.product(HALF_TYPES, HALF_TYPES, HALF_TYPES, ROWS),
}, defines={"ATT_G": GROUPS, "ATT_MAXKV": MAX_KV})  # fmt: skip


def fits(kq, sm, kqv) -> bool:
    """MUL_MAT(K, Q) → SOFT_MAX → MUL_MAT(V, ·) in the shapes k_attention takes: F16/F32
    caches with contiguous rows (K rows 16-byte aligned), D a multiple of 8 up to 256, Dv up
    to 128, at most 8 query rows and 8192 positions, F32 queries and result, no ALiBi, the
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
    return (d % 8 == 0 and d <= MAX_D and 0 < dv <= MAX_DV and q.ne[1] <= ROWS[-1] and k16
            and 0 < kq.ne[0] <= MAX_KV and v.ne[0] == kq.ne[0] and kqv.ne[2] == kq.ne[2]
            and kqv.ne[3] == kq.ne[3])  # fmt: skip


def attention(plan, kq, sm, kqv) -> None:
    """Decode attention as one launch: chunks of 32 positions, up to GROUPS of them per block
    (merged in shared memory: a short cache is one block per head), the blocks of a head
    combined through scratch by the last one to finish."""
    k, q = kq.src
    mask = sm.src[1]
    v = kqv.src[0]
    nkv, r, ne2, ne3 = kq.ne
    chunks, batches = -(-nkv // 32), ne2 * ne3
    groups = min(GROUPS, chunks)
    blocks = -(-chunks // groups)
    dv = v.ne[1]
    # V read a whole chunk at a time: 16-byte aligned rows, and the last row's last chunk
    # inside the buffer (positions past n_kv are read, then zeroed)
    v16 = all(x % 16 == 0 for x in v.nb[1:]) and (v.buffer.ctx.ptr + v.offs) % 16 == 0
    last_row = sum((n - 1) * nb for n, nb in zip(v.ne[1:], v.nb[1:], strict=True))
    end = v.offs + last_row + chunks * 32 * v.nb[0]
    vwhole = v16 and end <= v.buffer.size
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
    P = plan.params([k.ne[0], nkv, r, ne2, ne3, r2k, r3k, *k.nb[1:], *q.nb[1:],
                     int(mask is not None), *mnb, *mne, f64(sm.op_params[0]), dv, r2v,
                     r3v, *v.nb[1:], *kqv.nb[1:], int(vwhole), kqv.nelements, *offs])  # fmt: skip
    part, count = _scratch(plan, batches * blocks * 8 * (dv + 2) * 4, batches)
    # the output also quantized for the output projection (kernels/common.cuh: quantize1 wants
    # whole warps over 32-element units: Dv a multiple of 32, kqv contiguous)
    xq = matvec.xq_for(plan, kqv) if dv % 32 == 0 and kqv.is_contiguous() else np.uint64(0)
    rm = 1 << (r - 1).bit_length()  # query rows compiled for: the next power of two
    mt = _CTYPE[mask.type] if mask is not None else "float"
    name = compiler.name("k_attention", _CTYPE[k.type], _CTYPE[v.type], mt, rm)
    mp = plan.ptr(mask) if mask is not None else np.uint64(0)
    args = (P, plan.ptr(kqv), plan.ptr(k), plan.ptr(q), mp, plan.ptr(v), part, count, xq)
    plan.launch(name, 0, args, block=128 * groups, grid=(blocks, batches))


def _scratch(plan, part_bytes: int, batches: int) -> tuple[np.uint64, np.uint64]:
    """k_attention's partials and per-batch counts, shared by the plan's attention launches:
    they run one after another on the stream (each waits for its predecessor, kernels/common.cuh:
    pdl_enter) and each leaves the counts at zero. Grown, not resized, when a launch needs more
    (earlier launches keep their smaller scratch)."""
    cur = plan.attn_scratch
    if cur is None or cur[1] < part_bytes or cur[2].size < batches:
        part_bytes = max(part_bytes, cur[1] if cur else 0)
        count = plan.cp.zeros(max(batches, cur[2].size if cur else 0), np.int32)
        plan.keep.append(count)
        cur = plan.attn_scratch = (plan.scratch(part_bytes), part_bytes, count)
    return np.uint64(cur[0]), np.uint64(cur[2].data.ptr)
