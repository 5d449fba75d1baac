"""IM2COL and COL2IM_1D (kernels/conv.cu)."""

from __future__ import annotations

from accelplane.core.ops import Op

from . import compiler
from .args import CTYPE, HALF_TYPES, fastdiv

FAMILY = compiler.family("conv", {"k_im2col": compiler.product(HALF_TYPES), "k_col2im_1d": [()]})


def im2col(plan, n) -> None:
    k, x = n.src
    s0, s1, p0, p1, d0, d1, is_2d, _ = n.op_params
    if is_2d:
        kw, kh, w, h = k.ne[0], k.ne[1], x.ne[0], x.ne[1]
        nbx = [x.nb[0], x.nb[1], x.nb[2], x.nb[3]]
        dne, dnb = list(n.ne), list(n.nb)
    else:  # 1-D: x [N, IC, W] and dst [N, OW, IC*KW] as a 2-D case with H = OH = 1
        kw, kh, w, h = k.ne[0], 1, x.ne[0], 1
        nbx = [x.nb[0], 0, x.nb[1], x.nb[2]]
        s1, d1, p1 = 1, 1, 0
        dne = [n.ne[0], n.ne[1], 1, n.ne[2]]
        dnb = [n.nb[0], n.nb[1], n.nb[1] * n.ne[1], n.nb[2]]
    P = plan.params([n.nelements, *dne, *dnb, *nbx, w, h, kw, kh, s0, s1, p0, p1, d0, d1,
                     *fastdiv(dne[0]), *fastdiv(dne[1]), *fastdiv(dne[2]), *fastdiv(kw), *fastdiv(kh)])
    plan.launch(compiler.name("k_im2col", CTYPE[n.type]), n.nelements, (P, plan.ptr(n), plan.ptr(x)))


def col2im_1d(plan, n) -> None:
    a = n.src[0]
    s0, oc, p0 = n.op_params
    k = a.ne[0] // oc
    P = plan.params([n.nelements, n.ne[0], n.ne[1], n.ne[2], *n.nb[:3], *a.nb[:3], k, a.ne[1], s0, p0,
                     *fastdiv(n.ne[0]), *fastdiv(n.ne[1])])  # fmt: skip
    plan.launch("k_col2im_1d", n.nelements, (P, plan.ptr(n), plan.ptr(a)))


OPS = {Op.IM2COL: im2col, Op.COL2IM_1D: col2im_1d}
