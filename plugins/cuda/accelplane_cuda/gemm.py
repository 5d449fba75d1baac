"""Products through cuBLAS: gemmEx per batch matrix, F32 results; quantized weights dequantized
to F16 once per run first (kernels/dequant.cu)."""

from __future__ import annotations

import numpy as np
from accelplane.core.types import GGMLType as T

from . import compiler, rows
from .args import QUANT, QUANT_IDS, SEGMENT_UNIT, rows_aligned, rows_contig
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


def gemm(plan, n) -> None:
    """cuBLAS gemmEx per batch matrix: C[N, M] = B[N, K] · A[M, K]ᵀ (F32 results)."""
    from cupy_backends.cuda.libs import cublas

    a, b = n.src
    m, k = a.ne[1], a.ne[0]
    r2, r3 = b.ne[2] // a.ne[2], b.ne[3] // a.ne[3]
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
    calls = []
    for i3 in range(b.ne[3]):
        for i2 in range(b.ne[2]):
            pa = ap + (i2 // r2) * anb[2] + (i3 // r3) * anb[3]
            pb = bp + i2 * bnb[2] + i3 * bnb[3]
            pc = int(plan.ptr(n)) + i2 * n.nb[2] + i3 * n.nb[3]
            calls.append((pa, pb, pc))
    lda, ldb, ldc = anb[1] // es, bnb[1] // es, n.nb[1] // 4
    nn = b.ne[1]

    def step() -> None:
        cublas.setStream(handle, stream.ptr)
        for pa, pb, pc in calls:
            cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, m, nn, k,
                          alpha.ctypes.data, pa, dt, lda, pb, dt, ldb,
                          beta.ctypes.data, pc, CUDA_R_32F, ldc, cublas.CUBLAS_COMPUTE_32F,
                          cublas.CUBLAS_GEMM_DEFAULT)  # fmt: skip

    plan.library_call(step)
