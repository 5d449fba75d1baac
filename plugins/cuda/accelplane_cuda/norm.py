"""Row norms (kernels/norm.cu): NORM, RMS_NORM, L2_NORM, alone or fused with the MUL that
scales them and the residual ADD before them (fuse.py)."""

from __future__ import annotations

import numpy as np
from accelplane.core.ops import Op

from . import compiler, matvec
from .args import f32_rows16, f64

CODE = {Op.NORM: 0, Op.RMS_NORM: 1, Op.L2_NORM: 2}  # kernels/norm.cu's op codes
VEC_MAX = 16384  # row elements the vector kernel holds in registers (4 float4s per thread of 1024)

FAMILY = compiler.family("norm", {"k_norm": [()], "k_norm_vec": compiler.product((1, 4))})


def norm(plan, n, mul=None, add=None) -> None:
    """A row norm; with ``mul`` (the MUL reading it, fused) times its other operand, written to
    the MUL's tensor; with ``add`` (the ADD it reads, fused) of that sum, which is written too."""
    a = n.src[0] if add is None else add.src[0]
    out, w = (n, None) if mul is None else (mul, mul.src[1])
    wp = [0, 1, 1, 1, 1, 0, 0, 0, 0] if w is None else [1, *w.ne, *w.nb]
    ap = [0] * 9 if add is None else [1, *add.src[1].nb, *add.nb]
    # [32]: no kernel of the graph writes the weights (k_norm_vec loads them before its wait)
    early = w is not None and id(w.buffer) not in plan.written
    P = plan.params([*a.ne, *a.nb, *out.nb, CODE[n.op], f64(n.op_params[0]), *wp, *ap, int(early)])
    ptr = [np.uint64(0) if t is None else plan.ptr(t) for t in (w, add and add.src[1], add)]
    args = (P, plan.ptr(out), plan.ptr(a), *ptr)
    # contiguous 16-byte-aligned F32 rows of up to 16384 elements: the vector kernel (one
    # block per row: a decode has a single row)
    ts = [t for t in (a, out, w, add and add.src[1], add) if t is not None]
    vec = a.ne[0] % 4 == 0 and a.ne[0] <= VEC_MAX and (w is None or w.ne[0] == a.ne[0])
    vec = vec and all(map(f32_rows16, ts))
    if vec:  # a float4 per thread where 1024 threads hold the row, else up to four
        nv = 1 if a.ne[0] <= 4096 else 4
        threads = min(1024, max(32, -(-a.ne[0] // (4 * nv) // 32) * 32))
        plan.launch(compiler.name("k_norm_vec", nv), 0, (*args, matvec.xq_for(plan, out)), block=threads,
                    grid=(a.nrows,))  # fmt: skip
    else:
        plan.launch("k_norm", 0, args, block=256, grid=(a.nrows,))


OPS = dict.fromkeys(CODE, norm)
