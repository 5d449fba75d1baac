"""Convolution helpers: IM2COL (1-D and 2-D) and COL2IM_1D."""

from __future__ import annotations

from accelplane.core.tensor import Tensor

from .base import Dispatch, elementwise, enb, eoffs, pack


def im2col(t: Tensor) -> list[Dispatch]:
    k, x = t.src
    s0, s1, p0, p1, d0, d1, is_2d, _ = t.op_params
    if is_2d:
        kh, kw, ih, iw = k.ne[1], k.ne[0], x.ne[1], x.ne[0]
    else:
        kh, kw, ih, iw = 1, k.ne[0], 1, x.ne[0]
    push = pack(t.ne, enb(x), enb(t), eoffs(x), eoffs(t), s0, s1, p0, p1, d0, d1, kh, kw, ih, iw)
    return elementwise("im2col", (t.type, int(bool(is_2d))), (k, x, None, t), push, t.nelements)


def col2im(t: Tensor) -> list[Dispatch]:
    (a,) = t.src
    s0, oc, p0 = t.op_params
    push = pack(t.ne, enb(a), enb(t), eoffs(a), eoffs(t), s0, p0, a.ne[0] // oc, a.ne[1])
    return elementwise("col2im", (), (a, None, None, t), push, t.nelements)
