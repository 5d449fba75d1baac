"""Products through cuBLAS: strided-batched gemmEx over the batch dimensions, F32 results;
quantized weights dequantized to F16 once per run first (kernels/dequant.cu)."""

from __future__ import annotations

import numpy as np
from accelplane.core.ops import QUANT
from accelplane.core.types import GGMLType as T

from . import compiler, rows
from .args import QUANT_IDS, SEGMENT_UNIT, rows_aligned, rows_contig
from .layout import type_id

STAGED_SEG = 4096  # bytes of a weight row staged at once per warp by k_dequant_staged
STAGED_WARPS = 4  # warps (rows) per block of k_dequant_staged
CUDA_DTYPE = {T.F32: 0, T.F16: 2, T.BF16: 14}  # cudaDataType
CUDA_R_32F = 0

FAMILY = compiler.family("dequant", {
    "k_dequant_f16": compiler.product(QUANT_IDS),
    "k_dequant_staged": compiler.product(SEGMENT_UNIT),
}, defines={"MMVQ_SEG": STAGED_SEG, "MMVQ_WARPS": STAGED_WARPS})  # fmt: skip


def dequantize(plan, a) -> tuple[int, list[int]]:
    """Every weight matrix of quantized ``a`` as packed F16 in scratch memory: (address, nb).
    Rows fit for staging go through shared memory in 16-byte words (k_dequant_staged), the
    rest chunk by chunk (k_dequant_f16)."""
    m, k = a.ne[1], a.ne[0]
    ap = plan.scratch(m * k * 2 * a.ne[2] * a.ne[3])
    qid = type_id(a)
    staged = qid in SEGMENT_UNIT and rows_aligned(a)
    unit = SEGMENT_UNIT.get(qid, 16)
    for i3 in range(a.ne[3]):
        for i2 in range(a.ne[2]):
            src = np.uint64(int(plan.ptr(a)) + i2 * a.nb[2] + i3 * a.nb[3])
            dst = np.uint64(ap + (i3 * a.ne[2] + i2) * m * k * 2)
            if staged:
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


def gemm(plan, n) -> None:
    """cuBLAS: C[N, M] = B[N, K] · A[M, K]ᵀ (F32 results) over the batch dimensions as few
    strided-batched calls as the layout allows (one for a contiguous or broadcast batch)."""
    from cupy_backends.cuda.libs import cublas

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
        bp, bnb = rows.contig_copy(plan, b, wt)
    dt = CUDA_DTYPE[wt]
    es = wt.type_size
    alpha = np.ones(1, np.float32)
    beta = np.zeros(1, np.float32)
    plan.keep += [alpha, beta]
    handle = plan.cp.cuda.device.get_cublas_handle()
    stream = plan.sctx.stream
    groups = batch_groups((a.ne[2], a.ne[3]), (b.ne[2], b.ne[3]), (anb, bnb, list(n.nb)),
                          (ap, bp, int(plan.ptr(n))))  # fmt: skip
    calls = [(pa, pb, pc, cnt, sa // es, sb // es, sc // 4) for pa, pb, pc, cnt, sa, sb, sc in groups]
    lda, ldb, ldc = anb[1] // es, bnb[1] // es, n.nb[1] // 4
    nn = b.ne[1]
    op_t, op_n, compute, algo = (cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, cublas.CUBLAS_COMPUTE_32F,
                                 cublas.CUBLAS_GEMM_DEFAULT)  # fmt: skip

    def step() -> None:
        cublas.setStream(handle, stream.ptr)
        for pa, pb, pc, cnt, sa, sb, sc in calls:
            if cnt == 1:
                cublas.gemmEx(handle, op_t, op_n, m, nn, k, alpha.ctypes.data, pa, dt, lda, pb, dt, ldb,
                              beta.ctypes.data, pc, CUDA_R_32F, ldc, compute, algo)  # fmt: skip
            else:
                cublas.gemmStridedBatchedEx(handle, op_t, op_n, m, nn, k, alpha.ctypes.data, pa, dt, lda, sa,
                                            pb, dt, ldb, sb, beta.ctypes.data, pc, CUDA_R_32F, ldc, sc, cnt,
                                            compute, algo)  # fmt: skip

    plan.library_call(step)
