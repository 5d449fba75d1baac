"""Matrix products (kernels/matvec.cu), and which kernel takes which product.

MUL_MAT of up to ``MAXN`` activation rows, by weight layout (plugins/cuda/README.md has the
table): the register mat-vecs (``k_quant_x`` once per activation vector, then ``k_mmv_ring``,
``k_mmv_row1`` or ``k_mmv_row``) for the layouts in ``REGISTER``; the pipelined kernel
(``k_mmv_pipe``) for the other layouts of large matrices; ``k_mul_mat_vec`` for small float
matrices (attention over a KV cache: kept off cuBLAS so that a decode graph is captured whole)
and rows the others cannot stage. Everything else goes to cuBLAS (gemm.py). MUL_MAT_ID's
row-at-a-time kernel ``k_mul_mat_id`` (moe.py takes the op).

The register mat-vecs read the activations quantized (kernels/common.cuh: quantize4's layout):
by the kernel that produced them where it can write that too (:func:`xq_for`: the norms, the
SWIGLU, the attention), else by a ``k_quant_x`` launch shared by the products of one vector.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from accelplane.core.ops import FLOAT, Op
from accelplane.core.types import GGMLType as T

from . import compiler, gemm, layout, rows
from .args import QUANT, QUANT_IDS, SEGMENT_UNIT, rows_aligned, rows_contig
from .layout import X8Type, type_id

MAXN = 8  # activation rows the mat-vec kernels take (kernels/matvec.cu: MMV_MAXN)
SMALL = 1 << 22  # float weight matrices up to this many elements take k_mul_mat_vec, not cuBLAS
WEIGHT_TYPES = (T.F32, T.F16, T.BF16, *QUANT_IDS)  # k_mul_mat_vec's and k_mul_mat_id's
# the layouts k_mmv_pipe takes: the float types and the GGUF block types without a register kernel
PIPE_TYPES = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q8_0, T.Q6_K, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q5_K,
              T.IQ4_NL, T.IQ4_XS)  # fmt: skip
# k_mmv_pipe's stage bytes and stages per warp (best of 2048,2, 4096,2, 2048,4 and 2048,6 on an
# H200), and the warps per block it tries, most first
PIPE_SEG, PIPE_STAGES, PIPE_WARPS = 4096, 2, (16, 8, 4)
SMEM_DEFAULT = 48 * 1024  # shared memory a block gets without opting in
ROW1_LANES = (32, 64, 128)  # lanes per row k_mmv_row1 is compiled for
ROW1_ID_LANES = (8, 16, *ROW1_LANES)  # and k_mmv_row1_id (short expert rows: several per warp)


@dataclass(frozen=True)
class Row1:
    """k_mmv_row1 (one activation row, one batch): loads per row a thread holds, rows per lane
    group (sharing the activation loads) and blocks per SM it is bounded to."""

    units: int
    rows: int
    blocks: int


@dataclass(frozen=True)
class Ring:
    """k_mmv_ring: slots per warp (S - 1 steps in flight), blocks of 4 warps per SM, units per
    lane per step, the step loop's unrolling; and the K from which it takes a product."""

    slots: int
    blocks: int
    units: int
    unroll: int
    min_k: int = 0

    def args(self) -> tuple[int, ...]:
        return self.slots, self.blocks, self.units, self.unroll


@dataclass(frozen=True)
class Register:
    """A weight layout of the register mat-vecs: k_mmv_row's loads a thread holds in flight,
    32-element units per load (kernels/matvec.cu: unit_regs::W), k_mmv_row1's and k_mmv_ring's
    shapes (None: no ring)."""

    units: int
    per_load: int
    row1: Row1
    ring: Ring | None = None


# best measured on an H200: k_mmv_row holds 4 loads of Q4_0x8's 18 bytes, 2 of Q8_0x8's 34 and
# of Q4_K's 18 in 32, 2 of Q4_Kx8's 36 (two sub-blocks each); k_mmv_row1 fits Q8_0x8's 12 blocks
# per SM in 40 registers, the others' 8 in 64; the ring measured at 4096 x 14336 (S 3 to 6, 6 to
# 12 blocks, 1 or 2 units, unrolled or not), and for Q4_0x8 and Q8_0x8 only from K = 8192: at
# K = 4096 k_mmv_row1, one pass of loads per block there, was as fast or faster (Q4_0 14336 x
# 4096: 9.0 against 9.8 us), while Q4_Kx8 gained at both
REGISTER = {
    X8Type.Q4_0X8: Register(4, 1, Row1(2, 2, 8), Ring(4, 8, 1, 2, min_k=8192)),
    X8Type.Q8_0X8: Register(2, 1, Row1(2, 1, 12), Ring(4, 8, 1, 2, min_k=8192)),
    X8Type.Q4_KX8: Register(2, 2, Row1(2, 1, 8), Ring(3, 8, 2, 1)),
    T.Q4_K: Register(2, 1, Row1(2, 1, 8)),
}


def _row_args(t, nmax: int) -> tuple:
    return t, REGISTER[t].units, nmax


def _row1_args(t, lanes: int, epilogue: bool) -> tuple:
    r = REGISTER[t].row1
    return t, r.units, lanes, r.blocks, r.rows, epilogue


def _ring_args(t) -> tuple:
    return t, *REGISTER[t].ring.args()


FAMILY = compiler.family("matvec", {
    "k_mul_mat_vec": compiler.product(WEIGHT_TYPES),
    "k_mul_mat_id": compiler.product(WEIGHT_TYPES),
    "k_mmv_pipe": compiler.product(PIPE_TYPES),
    "k_quant_x": [()],
    "k_mmv_row": [_row_args(t, nm) for t in REGISTER for nm in (1, MAXN)],
    "k_mmv_row1": [_row1_args(t, lanes, e) for t in REGISTER for lanes in ROW1_LANES for e in (False, True)],
    "k_mmv_row1_id": [_row1_args(t, lanes, False)[:-1] for t in REGISTER for lanes in ROW1_ID_LANES],
    "k_mmv_ring": [_ring_args(t) for t, r in REGISTER.items() if r.ring],
}, defines={"MMV_MAXN": MAXN, "MMVP_SEG": PIPE_SEG, "MMVP_NS": PIPE_STAGES},
   big_smem=("k_mmv_pipe",))  # fmt: skip


def mul_mat(plan, n) -> None:
    a, b = n.src
    if n.nelements == 0:
        return  # nothing to write
    if takes_row(n):
        mmv_row(plan, n)
        return
    small_float = a.type in FLOAT and a.ne[0] * a.ne[1] <= SMALL
    pipe = None if small_float or b.ne[1] > MAXN else _pipe_shape(plan, a, b)
    if pipe is not None:
        _mmv_pipe(plan, n, *pipe)
    elif (a.type in QUANT or (small_float and a.ne[0] % 32 == 0 and rows_contig(a))) and b.ne[1] <= MAXN:
        _mul_mat_vec(plan, n)
    else:
        gemm.gemm(plan, n)


def takes_row(n) -> bool:
    """MUL_MAT node ``n`` runs as a register mat-vec (:func:`mmv_row`)."""
    a, b = n.src
    return (n.nelements > 0 and b.ne[1] <= MAXN and a.ne[0] > 0 and a.ne[0] % 256 == 0
            and type_id(a) in REGISTER and rows_aligned(a))  # fmt: skip


def _lanes(loads: int, u: int) -> int:
    """Lanes per row of the register mat-vecs: enough for a row's loads in one pass of ``u`` per
    lane where that fits, a power of two from 8 to 128."""
    return min(128, max(8, 1 << (-(-loads // u) - 1).bit_length()))


def row1_shape(n, sm_count: int = 0) -> tuple[int, int, int]:
    """(loads per lane, rows per lane group, lanes per row) of k_mmv_row1 for register mat-vec
    ``n``; lanes 0 where it does not apply (several activation rows or batches, short rows).
    Given the device's ``sm_count``: half the lanes (down to 32) where that makes the grid one
    wave of resident blocks instead of more (an 8B's Q/K/V projection, 6144 rows of 4096: 1.5
    waves of 4-row blocks, or one of 8-row blocks; measured 1.5 % faster a decode step on an H100)."""
    a, b = n.src
    reg = REGISTER[type_id(a)]
    lpr = _lanes(a.ne[0] // 32 // reg.per_load, reg.row1.units)
    one = b.ne[1] == 1 and b.ne[2] * b.ne[3] == 1 and lpr >= 32
    if one and sm_count and lpr > 32:
        slots = sm_count * reg.row1.blocks
        blocks = [-(-a.ne[1] // (reg.row1.rows * 128 // lanes)) for lanes in (lpr, lpr // 2)]
        if blocks[0] > slots >= blocks[1]:
            lpr //= 2
    return reg.row1.units, reg.row1.rows, lpr if one else 0


def _ring_fits(n) -> bool:
    """k_mmv_ring for register mat-vec ``n``: one activation row and batch, a layout with a ring,
    K a multiple of a step (1024 or 2048 elements: its units per lane) from its min_k on."""
    a, b = n.src
    ring, k = REGISTER[type_id(a)].ring, a.ne[0]
    return (ring is not None and b.ne[1] == 1 and b.ne[2] * b.ne[3] == 1
            and k % (1024 * ring.units) == 0 and k >= ring.min_k)  # fmt: skip


def mmv_row(plan, n, epilogue: list[int] | None = None) -> None:
    """The register mat-vec: the activations quantized once into scratch memory (k_quant_x,
    unless already done), then blocks of 128 threads stream whole weight rows: k_mmv_ring,
    k_mmv_row1 or k_mmv_row. With ``epilogue`` (the Q/K/V projection's parameters, qkv.py) the
    rows go through k_mmv_row1's epilogue instead of to the result."""
    a, b = n.src
    k, nrow = a.ne[0], b.ne[1]
    xq, xq_bytes = _quantized(plan, n)
    wt = type_id(a)
    u, rt, lpr = row1_shape(n, plan.fns.sm_count)
    ring = epilogue is None and _ring_fits(n)
    smem = 0
    if ring:  # a warp per row: warps x slots x a step's bytes
        name, rt, lpr = compiler.name("k_mmv_ring", *_ring_args(wt)), 1, 32
        r = REGISTER[wt].ring
        smem = 4 * r.slots * 4 * r.units * SEGMENT_UNIT[wt]
    elif lpr:
        name = compiler.name("k_mmv_row1", *_row1_args(wt, lpr, epilogue is not None))
    else:  # more rows per block for short rows, so every thread keeps its loads in flight
        rt = 1
        lpr = _lanes(k // 32 // REGISTER[wt].per_load, REGISTER[wt].units)
        name = compiler.name("k_mmv_row", *_row_args(wt, 1 if nrow == 1 else MAXN))
    P = [a.ne[1], k, nrow, b.ne[2], b.ne[3], b.ne[2] // a.ne[2], b.ne[3] // a.ne[3],
         *a.nb[1:], *n.nb[1:], lpr, xq_bytes, int(id(a.buffer) not in plan.written)]  # fmt: skip
    grid = (-(-a.ne[1] // (rt * 128 // lpr)), b.ne[2] * b.ne[3])
    args = (plan.params(P + (epilogue or [])), plan.ptr(n), plan.ptr(a), xq)
    plan.launch(name, 0, args, block=128, grid=grid, smem=smem)


def _quantized(plan, n) -> tuple[np.uint64, int]:
    """The register mat-vec ``n``'s activations quantized (their address, bytes per batch):
    by the kernel that wrote them or for an earlier product of them (Q, K and V; the gate and
    up projections; repeated products in a benchmark), else by a k_quant_x launch now."""
    a, b = n.src
    k, nrow = a.ne[0], b.ne[1]
    xq_bytes = nrow * k + nrow * (k // 32) * 8  # int8 quants, then a float scale and an int sum per unit
    xq = plan.derived("xq", b, n)
    if xq is None:
        batches = b.ne[2] * b.ne[3]
        xp, xnb = x_f32(plan, b)
        xq = np.uint64(plan.scratch(xq_bytes * batches))
        P = plan.params([k, nrow, b.ne[2], *xnb[1:], xq_bytes])
        plan.launch("k_quant_x", 0, (P, xq, xp), block=256, grid=(-(-nrow * k // 1024), batches))
        plan.remember("xq", b, xq, n)
    return xq, xq_bytes


def xq_for(plan, out, per_row: bool = False):
    """Scratch for ``out`` quantized as k_quant_x writes it, when a register mat-vec reads
    ``out``, directly or through a contiguous view of all of it in the same memory order (the
    attention's permuted, reshaped output), as rows of a multiple of 32 elements with ne2 = ne3
    = 1: a MUL_MAT (flat over its elements), or a decode's MUL_MAT_ID (each activation row on
    its own, as k_mmv_row1_id quantizes them: the flat layout too for one row). The kernel
    writing ``out`` then writes that too, and the products skip k_quant_x. Else a null pointer.

    ``per_row``: the writer can also write each row on its own (k_glu_vec); then the result is
    (pointer, bytes per row, 0 for flat), and rows of MUL_MAT_ID readers of several activation
    rows are served too where no MUL_MAT reads ``out``."""

    def reads_as_is(b) -> bool:
        return b is out or (layout.root(b) is layout.root(out) and b.buffer is out.buffer
                            and b.offs == out.offs and b.nelements == out.nelements
                            and b.is_contiguous() and out.is_contiguous())  # fmt: skip

    def rows_fit(b) -> bool:
        return b.ne[0] % 32 == 0 and b.ne[2] == b.ne[3] == 1

    near = _products_reading(plan).get(id(layout.root(out)), ())
    mm = [c for c in near if c.op is Op.MUL_MAT and reads_as_is(c.src[1]) and rows_fit(c.src[1])
          and takes_row(c)]  # fmt: skip
    ids = [c for c in near if c.op is Op.MUL_MAT_ID and reads_as_is(c.src[1]) and rows_fit(c.src[1])
           and c.src[2].ne[1] == 1 and row1_id_fits(c)]  # fmt: skip
    one = [c for c in ids if c.src[1].ne[1] == 1]
    several = [c for c in ids if c.src[1].ne[1] > 1] if per_row and not mm else []
    none = (np.uint64(0), 0) if per_row else np.uint64(0)
    if not (mm or one or several):
        return none
    total = out.nelements
    xq = np.uint64(plan.scratch(total + total // 32 * 8))
    for c in (*mm, *one):
        plan.remember("xq", c.src[1], xq, out)
    for c in several:
        plan.remember("xq_rows", c.src[1], xq, out)
    if not per_row:
        return xq
    k = out.ne[0]
    return xq, (k + k // 32 * 8 if several else 0)


def _products_reading(plan) -> dict[int, list]:
    """The plan's MUL_MAT and MUL_MAT_ID nodes with weights in a buffer, by the id of the memory
    owner of their activations, in graph order (built once a plan: xq_for asks per writer)."""
    if plan.products is None:
        plan.products = {}
        for c in plan.nodes:
            if c.op in (Op.MUL_MAT, Op.MUL_MAT_ID) and c.src[0].buffer:
                plan.products.setdefault(id(layout.root(c.src[1])), []).append(c)
    return plan.products


def x_f32(plan, b) -> tuple[np.uint64, list[int]]:
    """Activations as F32 rows aligned for float4 loads (a converted copy when needed)."""
    ok = b.type == T.F32 and rows_contig(b) and all(v % 16 == 0 for v in b.nb[1:])
    ok = ok and (b.buffer.ctx.ptr + b.offs) % 16 == 0
    if ok:
        return plan.ptr(b), list(b.nb)
    ptr, nb = rows.contig_copy(plan, b, T.F32)
    return np.uint64(ptr), nb


def _pipe_shape(plan, a, b) -> tuple[int, int] | None:
    """(warps per block, dynamic shared memory bytes) for k_mmv_pipe, or None where it does not
    apply: a layout it does not take, rows not aligned, K not a multiple of 32, or the
    activations too large for shared memory next to the stages."""
    if type_id(a) not in PIPE_TYPES:
        return None
    k, n = a.ne[0], b.ne[1]
    if k % 32 or not rows_aligned(a) or k * n >= 1 << 28:
        return None
    xbytes = n * k * 4 if a.type in FLOAT else n * k + n * (k // 32) * 8
    for warps in PIPE_WARPS:  # the kernel's launch bounds: 512 threads
        smem = warps * PIPE_STAGES * PIPE_SEG + xbytes
        # fewer, larger blocks share the activations' setup; but keep every SM busy
        busy = warps == PIPE_WARPS[-1] or -(-a.ne[1] // warps) >= plan.fns.sm_count
        if smem <= plan.fns.smem_optin and busy:
            return warps, smem
    return None


def _mmv_pipe(plan, n, warps: int, smem: int) -> None:
    """The pipelined mat-vec (k_mmv_pipe) on a persistent grid."""
    from cupy_backends.cuda.api import driver

    a, b = n.src
    xp, xnb = x_f32(plan, b)
    wt = type_id(a)
    unit = SEGMENT_UNIT.get(wt, 16)
    seg = PIPE_SEG // unit * unit
    P = plan.params([a.ne[1], a.ne[0], b.ne[1], b.ne[2], b.ne[3], b.ne[2] // a.ne[2], b.ne[3] // a.ne[3],
                     *a.nb[1:], *n.nb[1:], a.row_bytes, seg, *xnb[1:]])  # fmt: skip
    name = compiler.name("k_mmv_pipe", wt)
    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(plan.fns[name].kernel.ptr, 32 * warps, smem)
    batches = b.ne[2] * b.ne[3]
    resident = max(1, per_sm) * plan.fns.sm_count
    grid = (max(1, min(-(-a.ne[1] // warps), -(-resident // batches))), batches)
    plan.launch(name, 0, (P, plan.ptr(n), plan.ptr(a), xp), block=32 * warps, grid=grid, smem=smem)


def _mul_mat_vec(plan, n) -> None:
    """k_mul_mat_vec: lanes per row enough for its 32-element chunks (up to a warp); several
    activation rows staged in shared memory where they fit the default 48 KiB (one is read
    directly: staging would only add a round trip before the weights' loads); fewer warps per
    block when that leaves SMs idle (a router's 64 rows: 64 blocks, not 16)."""
    a, b = n.src
    xp, xnb = x_f32(plan, b)
    lanes = min(32, 1 << max(0, (a.ne[0] // 32 - 1).bit_length()))
    smem = b.ne[1] * a.ne[0] * 4
    smem = smem if b.ne[1] > 1 and smem <= SMEM_DEFAULT else 0
    P = plan.params([a.ne[1], a.ne[0], b.ne[1], b.ne[2], b.ne[3], b.ne[2] // a.ne[2], b.ne[3] // a.ne[3],
                     *a.nb[1:], *xnb[1:], *n.nb[1:], lanes, int(smem > 0)])  # fmt: skip
    warps, batches = 4, b.ne[2] * b.ne[3]
    while warps > 1 and -(-a.ne[1] // (warps * (32 // lanes))) * batches < plan.fns.sm_count:
        warps //= 2
    rows_per_block = warps * (32 // lanes)
    grid = ((a.ne[1] + rows_per_block - 1) // rows_per_block, batches)
    plan.launch(compiler.name("k_mul_mat_vec", type_id(a)), 0, (P, plan.ptr(n), plan.ptr(a), xp),
                block=32 * warps, grid=grid, smem=smem)  # fmt: skip


def row1_id_fits(n) -> bool:
    """MUL_MAT_ID ``n`` (a row at a time) takes k_mmv_row1_id: a register layout, K a multiple of 256."""
    a = n.src[0]
    return type_id(a) in REGISTER and a.ne[0] % 256 == 0 and rows_aligned(a)


def mul_mat_id_rows(plan, n, pair=None) -> None:
    """MUL_MAT_ID a row at a time (moe.py says when): for the register layouts, k_mmv_row1's
    body per (token, slot) on the activations quantized per row (k_mmv_row1_id; with ``pair``, a
    second MUL_MAT_ID of the same activations, ids, shapes and weight type, both in one launch);
    else a warp per weight row of the expert each (token, slot) names (k_mul_mat_id)."""
    a, b, ids = n.src
    plan.uses_index = True
    if row1_id_fits(n):
        _mmv_row1_id(plan, n, pair)
        return
    xp, xnb = x_f32(plan, b)
    P = plan.params([a.ne[1], a.ne[0], ids.ne[0], ids.ne[1], a.ne[2], b.ne[1], a.nb[1], a.nb[2],
                     xnb[1], xnb[2], n.nb[1], n.nb[2], ids.nb[0], ids.nb[1]])  # fmt: skip
    rows_per_block = 4
    grid = ((a.ne[1] + rows_per_block - 1) // rows_per_block, ids.ne[0] * ids.ne[1])
    plan.launch(compiler.name("k_mul_mat_id", type_id(a)), 0,
                (P, plan.ptr(n), plan.ptr(a), xp, plan.ptr(ids), plan.err), block=32 * rows_per_block,
                grid=grid)  # fmt: skip


def _mmv_row1_id(plan, n, pair=None) -> None:
    a, b, ids = n.src
    k, n_used, n_tok, rows = a.ne[0], ids.ne[0], ids.ne[1], b.ne[1]
    wt = type_id(a)
    reg = REGISTER[wt]
    # each activation row quantized on its own (k_quant_x's batches: B rows per token); one row
    # per token (the gate and up products' shared input) is _quantized's layout too, so the up
    # product reuses the gate's copy
    xq_bytes = k + (k // 32) * 8
    xq = plan.derived("xq" if rows == 1 else "xq_rows", b, n)
    if xq is None:
        xp, xnb = x_f32(plan, b)
        xq = np.uint64(plan.scratch(xq_bytes * rows * n_tok))
        P = plan.params([k, 1, rows, 0, xnb[1], xnb[2], xq_bytes])
        plan.launch("k_quant_x", 0, (P, xq, xp), block=256, grid=(-(-k // 1024), rows * n_tok))
        plan.remember("xq" if rows == 1 else "xq_rows", b, xq, n)
    lpr = _lanes(k // 32 // reg.per_load, reg.row1.units)
    rt = reg.row1.rows
    P = [a.ne[1], k, 1, 1, 1, 1, 1, *a.nb[1:], *n.nb[1:], lpr, xq_bytes, 0,
         int(plan.ptr(ids)), ids.nb[0], ids.nb[1], n_used, rows, a.ne[2], int(plan.err)]  # fmt: skip
    P += [n_used * n_tok, int(plan.ptr(pair.src[0])), int(plan.ptr(pair))] if pair is not None else [0, 0, 0]
    name = compiler.name("k_mmv_row1_id", *_row1_args(wt, lpr, False)[:-1])
    products = 1 + (pair is not None)
    plan.launch(name, 0, (plan.params(P), plan.ptr(n), plan.ptr(a), xq), block=128,
                grid=(-(-a.ne[1] // (rt * 128 // lpr)), n_used * n_tok * products))  # fmt: skip


OPS = {Op.MUL_MAT: mul_mat}
