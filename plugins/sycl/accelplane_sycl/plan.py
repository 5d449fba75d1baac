"""A graph turned into a replayable list of queue submissions (built once per graph layout).

Building resolves, for every node, the kernel, its arguments and its range, and writes the
tensor descriptors and op parameters of all nodes into one parameter block that is uploaded to
the device once (kernels/*.cl read it). Replaying submits the prepared steps to the backend's
in-order queue, so a graph costs no Python per node beyond one submit call.

Matrix products: F32/F16/BF16 weights, and quantized weights with at least GEMM_MIN_ROWS
activation rows, go through oneMKL's gemm (dpnp) after a conversion kernel makes both operands
contiguous F32 where needed (dequantize + gemm); the rest, and everything when dpnp is absent,
through the k_mul_mat kernel (own quantized mat-vec).
"""

from __future__ import annotations

import ctypes
import math
import struct
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from accelplane.core.ops import ROPE_TYPE_NEOX, VIEW_OPS, Op, UnaryOp, rope_params, rope_yarn_corr_dims
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType
from accelplane.errors import ComputeError
from accelplane.runtime.progress import phase

from .runtime import DevState, UsmBuffer, usm_view

if TYPE_CHECKING:
    from .stream import Stream

T = GGMLType
GEMM_MIN_ROWS = 16
SUM_WG = 64  # kernels/reduce.cl's SUM_WG

_UNARY_CODE = {
    Op.SQR: 0, Op.SQRT: 1, Op.LOG: 2, Op.SIN: 3, Op.COS: 4, Op.SCALE: 5, Op.CLAMP: 6,
    Op.LEAKY_RELU: 7,
}  # fmt: skip
_UNARY_OP_CODE = {
    UnaryOp.ABS: 8, UnaryOp.NEG: 9, UnaryOp.TANH: 10, UnaryOp.RELU: 11, UnaryOp.SIGMOID: 12,
    UnaryOp.GELU: 13, UnaryOp.GELU_QUICK: 14, UnaryOp.SILU: 15, UnaryOp.EXP: 16, UnaryOp.STEP: 17,
    UnaryOp.ELU: 18, UnaryOp.HARDSWISH: 19, UnaryOp.HARDSIGMOID: 20, UnaryOp.EXPM1: 21,
    UnaryOp.SOFTPLUS: 22, UnaryOp.GELU_ERF: 23, UnaryOp.FLOOR: 24, UnaryOp.CEIL: 25, UnaryOp.ROUND: 26,
    UnaryOp.TRUNC: 27,
}  # fmt: skip
_BINARY_CODE = {Op.ADD: 0, Op.SUB: 1, Op.MUL: 2, Op.DIV: 3}


def f32bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _name(t: Tensor) -> str:
    return t.name or f"#{t.uid}"


Step = Callable[[], Any]


class Plan:
    """``steps`` replay the graph on ``bs.queue``; valid while the graph's layout is unchanged."""

    def __init__(self, graph, bs: Stream) -> None:
        self.bs = bs
        self.dev: DevState = bs.dev
        self.q = bs.queue
        self.words: list[int] = []
        self.launches: list[tuple[str, list, int, int | None] | Step] = []  # kernel launch or call
        self._scratch: UsmBuffer | None = None
        self.uses_index = False  # GET_ROWS, SET_ROWS or MUL_MAT_ID: kernels that report bad indices
        nodes = [n for n in graph.nodes if n.op not in VIEW_OPS]
        for n in graph.nodes:
            self._check(n)
        self._scratch_need = max((self._gemm_scratch(n) for n in nodes), default=0)
        if self._scratch_need:
            self._scratch = self.dev.alloc(self._scratch_need, host=False)
        for n in nodes:
            if n.nelements:
                _BUILDERS[n.op](self, n)
        self._pbuf = self.dev.alloc(max(8, 8 * len(self.words)), host=False)
        # uploaded on the backend's own queue, ahead of the kernels that read it: a blocking copy
        # on another queue could wait behind this device's running kernels
        self._host_words = np.asarray(self.words or [0], np.int64)
        self.q.memcpy_async(self._pbuf.mem, self._host_words, self._host_words.nbytes)
        weakref.finalize(self, bs.retire, [self._pbuf, self._scratch])  # freed after a sync
        self.steps = self._bind()
        self.ends_with_kernel = bool(self.launches) and not callable(self.launches[-1])

    # --- building ---------------------------------------------------------------------------------
    def _check(self, n: Tensor) -> None:
        for s in (n, *n.src):
            if s is None:
                continue
            buf = s.buffer
            if buf is None:
                raise ComputeError(f"{n.op.name} {_name(n)}: tensor {_name(s)} is not allocated")
            u = buf.ctx
            if not isinstance(u, UsmBuffer) or u.dev is not self.dev:
                raise ComputeError(
                    f"{n.op.name} {_name(n)}: tensor {_name(s)} is in buffer {buf.name!r}, not in "
                    f"memory of {self.dev.name}"
                )

    def _put(self, *words: int) -> int:
        i = len(self.words)
        self.words.extend(int(w) for w in words)
        return i

    @staticmethod
    def _desc(t: Tensor) -> tuple[int, ...]:
        return (t.offs, *t.ne, *t.nb, int(t.type))

    def _launch(self, kernel: str, pi: int, mems: list, n: int, wg: int | None = None) -> None:
        self.launches.append((kernel, [pi, *mems], n, wg))

    def _k(self, kernel: str, tensors: list[Tensor], extra: tuple = (), n: int | None = None,
           wg: int | None = None, err: bool = False) -> None:  # fmt: skip
        """Launch ``kernel`` over ``n`` work-items (default: the first tensor's elements); with
        ``err``, the backend's error word is its last argument (kernels that index)."""
        pi = self._put(*[w for t in tensors for w in self._desc(t)], *extra)
        mems = [t.buffer.ctx.mem for t in tensors]
        if err:
            mems.append(self.bs.err_mem())
            self.uses_index = True
        self._launch(kernel, pi, mems, tensors[0].nelements if n is None else n, wg)

    def _bind(self) -> list[Step]:
        """The launches bound to their kernels, building the ones this device has not built yet
        (the OpenCL CPU compiler takes about 0.3 s each: a model's first graph says so on a
        terminal)."""
        new = {item[0] for item in self.launches if not callable(item)} - self.dev.built()
        if new:
            with phase(f"sycl: {self.dev.name}: compiling {len(new)} kernel{'s' * (len(new) != 1)}"):
                for k in sorted(new):
                    self.dev.kernel(k)
        steps: list[Step] = []
        pmem = self._pbuf.mem
        for item in self.launches:
            if callable(item):
                steps.append(item)
                continue
            kernel, (pi, *mems), n, wg = item
            args = [pmem, ctypes.c_uint64(pi), *mems]
            steps.append(_submitter(self.q, self.dev.kernel(kernel), args, n, wg))
        return steps

    def run(self) -> Any:
        """Submit every step; the event of the last one (None when it was a dpnp call)."""
        r = None
        for s in self.steps:
            r = s()
        return r if self.ends_with_kernel else None

    # --- matrix products through oneMKL -------------------------------------------------------------
    def _use_gemm(self, n: Tensor) -> bool:
        if n.op is not Op.MUL_MAT or not n.is_contiguous() or self.dev.onemkl() is None:
            return False
        a, b = n.src
        if a.ne[0] == 1 or (a.ne[1] == 1 and b.ne[1] == 1):
            # dot products or K = 1: dpnp takes its dot or multiply path, whose result is not
            # reliably ordered after the kernels queued before it (wrong values now and then)
            return False
        return a.type in (T.F32, T.F16, T.BF16) or b.ne[1] >= GEMM_MIN_ROWS

    @staticmethod
    def _is_f32c(t: Tensor) -> bool:
        return t.type == T.F32 and t.is_contiguous()

    def _gemm_scratch(self, n: Tensor) -> int:
        if not self._use_gemm(n):
            return 0
        return sum(4 * s.nelements for s in n.src if not self._is_f32c(s))

    def _as_f32(self, t: Tensor, offs: int) -> tuple[UsmBuffer, int, int]:
        """(buffer, byte offset, bytes used of scratch) of a contiguous F32 copy of ``t``."""
        if self._is_f32c(t):
            return t.buffer.ctx, t.offs, 0
        assert self._scratch is not None
        ne = t.ne
        nb = (4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2])
        pi = self._put(offs, *ne, *nb, int(T.F32), *self._desc(t))
        self._launch("k_cpy", pi, [self._scratch.mem, t.buffer.ctx.mem], t.nelements)
        return self._scratch, offs, 4 * t.nelements

    def _gemm(self, n: Tensor) -> None:
        dp = self.dev.onemkl()
        a, b = n.src
        ab, ao, used = self._as_f32(a, 0)
        bb, bo, _ = self._as_f32(b, used)
        k, m, nn = a.ne[0], a.ne[1], b.ne[1]
        a2, a3 = a.ne[2], a.ne[3]
        r2, r3 = b.ne[2] // a2, b.ne[3] // a3

        def arr(buf: UsmBuffer, offs: int, shape: tuple[int, ...]) -> Any:
            nbytes = 4 * math.prod(shape)
            return dp.ndarray(shape, dtype=np.float32, buffer=usm_view(buf.ptr + offs, nbytes, self.q))

        # ggml broadcasts a over b by repetition: b's batch i2 uses a's batch i2 // r2
        wa = dp.swapaxes(arr(ab, ao, (a3, 1, a2, 1, m, k)), -1, -2)
        xb = arr(bb, bo, (a3, r3, a2, r2, nn, k))
        out = arr(n.buffer.ctx, n.offs, (a3, r3, a2, r2, nn, m))
        self.launches.append(lambda: dp.matmul(xb, wa, out=out))

    def _mul_mat(self, n: Tensor) -> None:
        if self._use_gemm(n):
            self._gemm(n)
        else:
            self._k("k_mul_mat", [n, *n.src])

    # --- the rest of the catalog ----------------------------------------------------------------------
    def _unary(self, n: Tensor) -> None:
        p = n.op_params
        code = _UNARY_OP_CODE[UnaryOp(p[0])] if n.op is Op.UNARY else _UNARY_CODE[n.op]
        f0 = f32bits(p[0]) if n.op in (Op.SCALE, Op.CLAMP, Op.LEAKY_RELU) else 0
        f1 = f32bits(p[1]) if n.op in (Op.SCALE, Op.CLAMP) else 0
        self._k("k_unary", [n, n.src[0]], (code, f0, f1))

    def _binary(self, n: Tensor) -> None:
        self._k("k_binary", [n, *n.src], (_BINARY_CODE[n.op],))

    def _glu(self, n: Tensor) -> None:
        a, b = n.src
        self._k("k_glu", [n, a, b if b is not None else a],
                (n.op_params[0], n.op_params[1], int(b is not None)))  # fmt: skip

    def _cpy(self, n: Tensor) -> None:
        src = n.src[0]
        dst = n.src[1] if n.op is Op.CPY else n  # CPY writes its destination (n is a view of it)
        if dst.type.is_quantized and dst.type == src.type:
            self._k("k_copy_blocks", [dst, src], n=dst.nelements // dst.type.blck_size)
        elif dst.type.is_quantized:
            self._k("k_cpy_q", [dst, src], n=dst.nelements // 32)
        else:
            self._k("k_cpy", [dst, src])

    def _concat(self, n: Tensor) -> None:
        self._k("k_concat", [n, *n.src], (n.op_params[0],))

    def _get_rows(self, n: Tensor) -> None:
        self._k("k_get_rows", [n, *n.src], err=True)

    def _set_rows(self, n: Tensor) -> None:
        dst, src, idx = n.src
        per_row = src.ne[0] // dst.type.blck_size
        self._k("k_set_rows", [dst, src, idx], n=per_row * src.ne[2] * src.ne[3], err=True)

    def _norm(self, n: Tensor) -> None:
        op = {Op.NORM: 0, Op.RMS_NORM: 1, Op.L2_NORM: 2}[n.op]
        self._k("k_norm", [n, n.src[0]], (op, f32bits(n.op_params[0])), n=n.nrows)

    def _soft_max(self, n: Tensor) -> None:
        a, mask = n.src
        scale, max_bias = n.op_params[0], n.op_params[1]
        n_head = a.ne[2]
        n_log2 = 1 << int(math.floor(math.log2(n_head))) if n_head > 0 else 1
        m0 = 2.0 ** (-max_bias / n_log2)
        m1 = 2.0 ** (-(max_bias / 2.0) / n_log2)
        extra = (int(mask is not None), f32bits(scale), f32bits(max_bias), n_log2, f32bits(m0), f32bits(m1))
        self._k("k_soft_max", [n, a, mask if mask is not None else a], extra, n=a.nrows)

    def _rope(self, n: Tensor) -> None:
        a, pos = n.src[:2]
        ff = n.src[2] if len(n.src) > 2 else None  # frequency factors (ggml's c)
        (n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor,
         beta_fast, beta_slow) = rope_params(n)  # fmt: skip
        corr = rope_yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
        mscale = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale) if ext_factor != 0 else 1.0)
        extra = (n_dims, int(mode == ROPE_TYPE_NEOX) * 2, f32bits(freq_base), f32bits(freq_scale),
                 f32bits(ext_factor), f32bits(mscale), f32bits(corr[0]), f32bits(corr[1]),
                 int(ff is not None))  # fmt: skip
        self._k("k_rope", [n, a, pos, pos if ff is None else ff], extra, n=(a.ne[0] + 1) // 2 * a.nrows)

    def _mul_mat_id(self, n: Tensor) -> None:
        self._k("k_mul_mat_id", [n, *n.src], err=True)

    def _reduce(self, n: Tensor) -> None:
        a = n.src[0]
        if n.op is Op.SUM:
            self._k("k_sum", [n, a], n=SUM_WG, wg=SUM_WG)
        elif n.op is Op.ARGMAX:
            self._k("k_argmax", [n, a], n=a.ne[1])
        elif n.op is Op.ARGSORT:
            self._k("k_argsort", [n, a], (n.op_params[0],))
        else:
            self._k("k_sum_rows", [n, a], (int(n.op is Op.MEAN),), n=a.nrows)

    def _im2col(self, n: Tensor) -> None:
        k, x = n.src
        s0, s1, p0, p1, d0, d1, is_2d, _ = n.op_params
        kh, kw = (k.ne[1], k.ne[0]) if is_2d else (1, k.ne[0])
        self._k("k_im2col", [n, x], (s0, s1, p0, p1, d0, d1, is_2d, kh, kw))

    def _col2im(self, n: Tensor) -> None:
        self._k("k_col2im_1d", [n, n.src[0]], tuple(n.op_params))


def _submitter(q: Any, k: Any, args: list, n: int, wg: int | None) -> Step:
    rng = [n]
    if wg is None:
        return lambda: q.submit_async(k, args, rng)
    lrng = [wg]
    return lambda: q.submit_async(k, args, rng, lrng)


_BUILDERS: dict[Op, Callable[[Plan, Tensor], None]] = {
    Op.ADD: Plan._binary, Op.SUB: Plan._binary, Op.MUL: Plan._binary, Op.DIV: Plan._binary,
    Op.SQR: Plan._unary, Op.SQRT: Plan._unary, Op.LOG: Plan._unary, Op.SIN: Plan._unary,
    Op.COS: Plan._unary, Op.SCALE: Plan._unary, Op.CLAMP: Plan._unary,
    Op.LEAKY_RELU: Plan._unary, Op.UNARY: Plan._unary, Op.GLU: Plan._glu,
    Op.NORM: Plan._norm, Op.RMS_NORM: Plan._norm, Op.L2_NORM: Plan._norm,
    Op.SOFT_MAX: Plan._soft_max, Op.ROPE: Plan._rope, Op.MUL_MAT: Plan._mul_mat,
    Op.MUL_MAT_ID: Plan._mul_mat_id, Op.GET_ROWS: Plan._get_rows, Op.SET_ROWS: Plan._set_rows,
    Op.CPY: Plan._cpy, Op.CONT: Plan._cpy, Op.DUP: Plan._cpy, Op.CONCAT: Plan._concat,
    Op.SUM: Plan._reduce, Op.SUM_ROWS: Plan._reduce, Op.MEAN: Plan._reduce,
    Op.ARGMAX: Plan._reduce, Op.ARGSORT: Plan._reduce, Op.IM2COL: Plan._im2col,
    Op.COL2IM_1D: Plan._col2im,
}  # fmt: skip
# view ops compute nothing; Op.NONE is left out (without a view source it would be a copy)
SUPPORTED_OPS = frozenset(_BUILDERS) | (VIEW_OPS - {Op.NONE})
# the types kernels/common.cl loads and stores (a block type the catalog gains is declined until here)
TYPES = frozenset({T.F32, T.F16, T.BF16, T.I32, T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K, T.Q4_1, T.Q5_0, T.Q5_1,
                   T.Q2_K, T.Q3_K, T.Q5_K, T.IQ4_NL, T.IQ4_XS})  # fmt: skip


def supports(t: Tensor) -> bool:
    """The op has a kernel here (for UNARY: the ggml unary op has a code in elementwise.cl) and
    its kernel knows every type it reads and writes."""
    if t.op not in VIEW_OPS and any(x is not None and x.type not in TYPES for x in (t, *t.src)):
        return False
    if t.op is Op.UNARY:
        return t.op_params[0] in _UNARY_OP_CODE
    return t.op in SUPPORTED_OPS
