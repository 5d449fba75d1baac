"""Products through cuBLAS: strided-batched gemmEx over the batch dimensions, F32 results;
quantized weights dequantized to F16 once per run first (kernels/dequant.cu), activations
converted to F16 once per run for every product that reads them."""

from __future__ import annotations

import numpy as np
from accelplane.core.types import GGMLType as T

from . import compiler, rows
from .args import QUANT, QUANT_IDS, SEGMENT_UNIT, rows_aligned, rows_contig
from .layout import X8Type, type_id

STAGED_SEG = 4096  # bytes of a weight row staged at once per warp by k_dequant_staged
STAGED_WARPS = 4  # warps (rows) per block of k_dequant_staged
CUDA_DTYPE = {T.F32: 0, T.F16: 2, T.BF16: 14}  # cudaDataType
CUDA_R_32F = 0
COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F (no TF32: F32 results as F32 inputs give)
GEMM_DEFAULT = -1  # cublasGemmAlgo_t CUBLAS_GEMM_DEFAULT

FAMILY = compiler.family("dequant", {
    "k_dequant_f16": compiler.product(QUANT_IDS),
    "k_dequant_staged": [(t,) for t in SEGMENT_UNIT if t not in X8Type],
    "k_dequant_x8": compiler.product(X8Type),
}, defines={"MMVQ_SEG": STAGED_SEG, "MMVQ_WARPS": STAGED_WARPS})  # fmt: skip


def dequantize(plan, a) -> tuple[int, list[int]]:
    """Every weight matrix of quantized ``a`` as packed F16 in scratch memory: (address, nb).
    x8 weights (whole 16-byte words per unit) eight elements a thread (k_dequant_x8), other rows fit
    for staging through shared memory in 16-byte words (k_dequant_staged), the rest chunk by
    chunk (k_dequant_f16)."""
    m, k = a.ne[1], a.ne[0]
    ap = plan.scratch(m * k * 2 * a.ne[2] * a.ne[3])
    qid = type_id(a)
    x8 = qid in X8Type and rows_aligned(a) and m * (k // 8) < 1 << 31
    staged = qid in SEGMENT_UNIT and qid not in X8Type and rows_aligned(a)
    unit = SEGMENT_UNIT.get(qid, 16)
    for i3 in range(a.ne[3]):
        for i2 in range(a.ne[2]):
            src = np.uint64(int(plan.ptr(a)) + i2 * a.nb[2] + i3 * a.nb[3])
            dst = np.uint64(ap + (i3 * a.ne[2] + i2) * m * k * 2)
            if x8:
                P = plan.params([m, k, a.nb[1]])
                words = m * (k // 8)  # k_dequant_x8: a thread per 8 elements, 4 a step
                grid = max(1, min(-(-words // (256 * 4)), 8 * plan.fns.sm_count))
                plan.launch(compiler.name("k_dequant_x8", qid), 0, (P, dst, src), block=256, grid=(grid,))
            elif staged:
                P = plan.params([m, k, a.nb[1], a.row_bytes, STAGED_SEG // unit * unit])
                plan.launch(compiler.name("k_dequant_staged", qid), 0, (P, dst, src), block=32 * STAGED_WARPS,
                            grid=((m + STAGED_WARPS - 1) // STAGED_WARPS,))  # fmt: skip
            else:
                P = plan.params([m, k, a.nb[1]])
                plan.launch(compiler.name("k_dequant_f16", qid), m * k // 32, (P, dst, src))
    return ap, [2, 2 * k, 2 * k * m, 2 * k * m * a.ne[2]]


def _merged(last: list[int], g: list[int]) -> bool:
    """Extend run ``last`` by run ``g`` when g's matrices continue last's at one stride each (a
    single matrix takes whatever stride fits); C's stride must be positive, A's and B's not
    negative."""
    if last[3] == 1 and g[3] == 1:
        st = [g[i] - last[i] for i in range(3)]
    elif last[3] == 1 or g[3] == 1 or last[4:] == g[4:]:
        st = g[4:] if last[3] == 1 else last[4:]
    else:
        return False
    if st[2] <= 0 or st[0] < 0 or st[1] < 0 or any(g[i] != last[i] + last[3] * st[i] for i in range(3)):
        return False
    last[3] += g[3]
    last[4:] = st
    return True


def batch_groups(an: tuple[int, int], bn: tuple[int, int], strides: tuple[list[int], list[int], list[int]],
                 bases: tuple[int, int, int]) -> list[tuple[int, ...]]:
    """The batch matrices of a product as few strided batches as their layout allows:
    ``(pa, pb, pc, count, sa, sb, sc)`` (addresses; strides in bytes), one per run of batch
    matrices whose A, B and C each lie a constant stride apart. ``an``/``bn`` are A's and B's
    (ne2, ne3); A is broadcast over B as ggml broadcasts (B's extents are multiples of A's);
    ``strides`` are A's, B's and C's nb, ``bases`` their addresses."""
    (a2, a3), (b2, b3) = an, bn
    r2, r3 = b2 // a2, b3 // a3
    anb, bnb, cnb = strides
    pa0, pb0, pc0 = bases
    groups: list[list[int]] = []
    for i3 in range(b3):
        pa3, pb3, pc3 = pa0 + (i3 // r3) * anb[3], pb0 + i3 * bnb[3], pc0 + i3 * cnb[3]
        if r2 == 1 or a2 == 1:  # one run over i2: A steps with B, or stays (broadcast)
            runs = [(0, b2, anb[2] if r2 == 1 else 0)]
        else:  # each A matrix serves r2 consecutive B matrices
            runs = [(j * r2, r2, 0) for j in range(a2)]
        for i2, count, sa in runs:
            g = [pa3 + (i2 // r2) * anb[2], pb3 + i2 * bnb[2], pc3 + i2 * cnb[2], count, sa, bnb[2], cnb[2]]
            if not (groups and _merged(groups[-1], g)):
                groups.append(g)
    return [tuple(g) for g in groups]


def _folded(a, b, bnb: list[int], n) -> bool:
    """A 2-D A over B's batches, with B's and C's rows evenly spaced through them: one GEMM
    over all of B's rows (N = ne1 * ne2 * ne3) instead of a batch."""
    return (a.ne[2] == a.ne[3] == 1 and bnb[2] == bnb[1] * b.ne[1] and bnb[3] == bnb[2] * b.ne[2]
            and n.nb[2] == n.nb[1] * n.ne[1] and n.nb[3] == n.nb[2] * n.ne[2])  # fmt: skip


def gemm(plan, n) -> None:
    """cuBLAS: C[N, M] = B[N, K] · A[M, K]ᵀ (F32 results) as one call: a GEMM for a 2-D weight
    over evenly laid out batches, a strided-batched GEMM where the batch matrices lie at one
    stride, else a batched GEMM over arrays of their addresses."""
    from . import cublas

    lib = cublas.library()
    a, b = n.src
    m, k = a.ne[1], a.ne[0]
    if a.type in QUANT:
        wt = T.F16
        ap, anb = dequantize(plan, a)
    else:
        wt = a.type
        ap, anb = int(plan.ptr(a)), list(a.nb)
    if b.type == wt and rows_contig(b):
        bp, bnb = int(plan.ptr(b)), list(b.nb)
    else:
        bp, bnb = rows.converted(plan, b, wt, n)
    dt = CUDA_DTYPE[wt]
    es = wt.type_size
    alpha = np.ones(1, np.float32)
    beta = np.zeros(1, np.float32)
    plan.keep += [alpha, beta]
    handle = plan.cp.cuda.device.get_cublas_handle()
    stream = plan.sctx.stream.ptr
    nn = b.ne[1]
    if _folded(a, b, bnb, n):
        nn *= b.ne[2] * b.ne[3]
        groups = [(ap, bp, int(plan.ptr(n)), 1, 0, 0, 0)]
    else:
        groups = batch_groups((a.ne[2], a.ne[3]), (b.ne[2], b.ne[3]), (anb, bnb, list(n.nb)),
                              (ap, bp, int(plan.ptr(n))))  # fmt: skip
    lda, ldb, ldc = anb[1] // es, bnb[1] // es, n.nb[1] // 4
    al, be = alpha.ctypes.data, beta.ctypes.data
    head, tail = (handle, 1, 0, m, nn, k, al), (COMPUTE_32F, GEMM_DEFAULT)  # op(A) = Aᵀ, op(B) = B
    if len(groups) == 1 and groups[0][3] == 1:
        pa, pb, pc = groups[0][:3]
        call = (lib.cublasGemmEx, (*head, pa, dt, lda, pb, dt, ldb, be, pc, CUDA_R_32F, ldc, *tail))
    elif len(groups) == 1:
        pa, pb, pc, cnt, sa, sb, sc = groups[0]
        call = (lib.cublasGemmStridedBatchedEx, (*head, pa, dt, lda, sa // es, pb, dt, ldb, sb // es, be, pc,
                                                 CUDA_R_32F, ldc, sc // 4, cnt, *tail))  # fmt: skip
    else:  # no single stride (permuted heads over sequences): the matrices' addresses in device arrays
        mats = [(pa + j * sa, pb + j * sb, pc + j * sc) for pa, pb, pc, cnt, sa, sb, sc in groups
                for j in range(cnt)]  # fmt: skip
        pa, pb, pc = (int(plan.params([x[i] for x in mats])) for i in range(3))
        call = (lib.cublasGemmBatchedEx, (*head, pa, dt, lda, pb, dt, ldb, be, pc, CUDA_R_32F, ldc, len(mats),
                                          *tail))  # fmt: skip
    where = f"GEMM {m}x{nn}x{k} of {n.name or 'MUL_MAT'}"

    def step() -> None:
        cublas.check(lib.cublasSetStream_v2(handle, stream), where)
        cublas.check(call[0](*call[1]), where)

    batch = sum(g[3] for g in groups)
    step.name = f"cublas {m}x{nn}x{k}" + (f" x{batch}" if batch > 1 else "")
    plan.library_call(step)
