"""Graph plans of the CUDA plugin: each node becomes one or a few launches whose arguments
(a small device array of shapes, strides and op parameters, and the tensors' addresses) are
built once; ``CudaPlan.run`` replays them on the backend's stream, and from the second run
of an unchanged graph on replays a captured CUDA graph instead (ACCELPLANE_CUDA_GRAPHS=0
turns that off), so the per-token host cost does not grow with the node count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
from accelplane.core.fusion import NORMS, Fusion, RopeCache, scales_rows
from accelplane.core.ops import (
    FLOAT,
    QUANT,
    ROPE_TYPE_NEOX,
    ROPE_TYPE_NORMAL,
    VIEW_OPS,
    GluOp,
    Op,
    SortOrder,
    UnaryOp,
    rope_yarn_corr_dims,
)
from accelplane.core.types import GGMLType
from accelplane.errors import BufferFreedError, ComputeError, UnsupportedOpError

from . import layout, tuning
from .launch import Launch, pdl_wanted
from .layout import X8, type_id

T = GGMLType
CTYPE = {T.F32: "float", T.F16: "__half", T.BF16: "__nv_bfloat16"}
THREADS = 256
MMV_MAXN = 8  # batches up to this many activation rows use the mat-vec kernels
P2P_MAX_RANKS = 8  # the peer-memory all-reduce kernel is built for 2 to this many GPUs (p2p.py)
MMV_SMALL = 1 << 22  # float weight matrices up to this many elements use them too
MMVQ_SEG = 4096  # bytes of a weight row staged at once per warp by k_dequant_staged
# segments are multiples of these (and of 16)
MMVQ_UNIT = {2: 144, 8: 272, 12: 144, 14: 1680, 102: 144, 108: 272, 112: 144}


MMVP_SEG, MMVP_NS = tuning.MMVP.get()  # k_mmv_pipe's stage bytes and stages per warp


def _mmv_mode() -> str:
    """ACCELPLANE_CUDA_MMV: which mat-vec kernels may run (a tuning knob, see below)."""
    return tuning.MMV.get()


def _attn_fused() -> bool:
    """ACCELPLANE_CUDA_ATTN: decode attention as one kernel (fused, default) or three (split)."""
    return tuning.ATTN.get() == "fused"


def _qkv_fused() -> bool:
    """ACCELPLANE_CUDA_QKV: the Q/K/V projection's register mat-vec also ropes Q and K and
    writes the KV caches (fusion.product_rope_cache; 1, default) or leaves that to k_rope and
    k_set_rows (0)."""
    return tuning.QKV.get()


def _ring_on() -> bool:
    """ACCELPLANE_CUDA_RING: one-row products of x8 weights whose rows suit it stream through
    per-warp shared-memory rings (k_mmv_ring; 1, default) or take the register kernel (0)."""
    return tuning.RING.get()


# tuning knobs, for measuring the alternatives side by side:
#   ACCELPLANE_CUDA_MMV=row|pipe|f32  mat-vec by the register kernel where it applies (Q4_0x8,
#     Q8_0x8, Q4_Kx8, Q4_K; default) else the pipelined one; by the pipelined one; or by the plain one
#   ACCELPLANE_CUDA_MMV_WARPS=16|8|4  warps per block of the pipelined kernel (default: most that fit)
#   ACCELPLANE_CUDA_MMVP=SEG,NS  its stage bytes and stages per warp (default 4096,2: best of 2048,2,
#     4096,2, 2048,4 and 2048,6 on an H200)
#   ACCELPLANE_CUDA_GEMM_OUT=f32|f16   cuBLAS writes F32 directly (default) or F16 then widened
#   ACCELPLANE_CUDA_XQ=1|0  kernels producing a register mat-vec's activations quantize them too
#     (default), or k_quant_x does
#   ACCELPLANE_CUDA_QKV=1|0  the decode's Q/K/V projection ropes Q and K and writes the caches
#     (default), or k_rope and k_set_rows do (_qkv_fused)
#   ACCELPLANE_CUDA_RING=1|0  one-row products of x8 weights through k_mmv_ring where _ring_fits
#     says so (default), or through k_mmv_row1
_SCALAR = {Op.SQR: 100, Op.SQRT: 101, Op.LOG: 102, Op.SIN: 103, Op.COS: 104, Op.SCALE: 105,
           Op.CLAMP: 106, Op.LEAKY_RELU: 107}  # fmt: skip
_BIN = {Op.ADD: 0, Op.SUB: 1, Op.MUL: 2, Op.DIV: 3}
_XT = (102, 108, 112)  # Q4_0, Q8_0 and Q4_K in the x8 layouts of weights buffers (layout.py)
_QT = (2, 8, 12, 14) + _XT  # quant type ids the kernels dequantize (Q4_0, Q8_0, Q4_K, Q6_K, x8)
_WT = (0, 1, 30) + _QT  # weight types of the mat-vec kernels
_QW = (2, 8, 102, 108)  # quant type ids the kernels write (CPY and SET_ROWS into Q4_0/Q8_0)
# the register mat-vec (k_mmv_row): weight types and the loads a thread holds in flight (more
# registers per load, fewer loads: 4 for Q4_0x8's 18 bytes, 2 for Q8_0x8's 34 and Q4_K's 18 in
# 32, 2 for Q4_Kx8's 36, two sub-blocks per load), and the 32-element units of a load
_ROW_U = {102: 4, 108: 2, 12: 2, 112: 2}
_ROW_W = {112: 2}  # kernels.cu: unit_regs::W (default 1)
# k_mmv_row1 (one activation row, one batch, 32-128 lanes per row): loads per row a thread holds,
# rows per lane group (sharing the activation loads) and blocks per SM it is bounded to
# (registers: Q8_0x8 fits 12 in 40, the others 8 in 64); best measured on an H200
_ROW1 = {102: (2, 2, 8), 108: (2, 1, 12), 112: (2, 1, 8), 12: (2, 1, 8)}
_ATT_G = 4  # kernels.cu: ATT_G, chunks of 32 positions per k_attention block
# k_mmv_ring per x8 type: slots per warp (S - 1 steps in flight), blocks of 4 warps per SM, units
# per lane per step and the step loop's unrolling; best measured on an H200 at 4096 x 14336 (S of
# 3 to 6, 6 to 12 blocks, 1 or 2 units, unrolled or not); and an x8 group's bytes
_RING = {102: (4, 8, 1, 2), 108: (4, 8, 1, 2), 112: (3, 8, 2, 1)}
_X8_GROUP = {102: 144, 108: 272, 112: 144}


def _rotation(rope) -> list[int]:
    """kernels.cu rope_cs's parameters for ROPE node ``rope``: freq_scale, ext_factor,
    attn_factor, YaRN's two correction dims and theta_scale, as double bits."""
    (_, n_dims, _, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor,
     beta_fast, beta_slow) = rope.op_params  # fmt: skip
    c0, c1 = rope_yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
    c1 = c1 if math.isfinite(c1) else -1e30
    return [_f(x) for x in (freq_scale, ext_factor, attn_factor, c0, c1, freq_base ** (-2.0 / n_dims))]


def _lanes(loads: int, u: int) -> int:
    """Lanes per row of the register mat-vecs: enough for a row's loads in one pass of ``u`` per
    lane where that fits, a power of two from 8 to 128."""
    return min(128, max(8, 1 << (-(-loads // u) - 1).bit_length()))


def _names() -> list[str]:
    f = list(CTYPE.values())
    n = [f"k_unary<{t}>" for t in f] + [f"k_glu<{t}>" for t in f]
    n += [f"k_rope<{t},{d}>" for t in ("float", "__half") for d in ("float", "__half")]
    n += [f"k_binary<{a},{b}>" for a in f for b in f]
    n += [f"k_soft_max<{t}>" for t in ("float", "__half")]
    n += [f"k_get_rows<{t}>" for t in f] + [f"k_get_rows_q<{q}>" for q in _QT]
    n += [f"k_set_rows<{t}>" for t in f] + [f"k_set_rows_q<{q}>" for q in _QW]
    n += [f"k_cpy<{a},{b}>" for a in f for b in f]
    n += [f"k_cpy_q<{q},{t}>" for q in _QW for t in f] + [f"k_cpy_dq<{q}>" for q in _QT]
    n += [f"k_concat<{t}>" for t in ("float", "short", "int")]
    n += [f"k_sum_rows<{t}>" for t in f] + [f"k_sum<{t}>" for t in f]
    n += [f"k_im2col<{t}>" for t in ("float", "__half")]
    n += [f"k_mul_mat_vec<{w}>" for w in _WT] + [f"k_mul_mat_id<{w}>" for w in _WT]
    n += [f"k_dequant_f16<{w}>" for w in _WT]
    n += [f"k_mmv_pipe<{w}>" for w in _WT] + [f"k_dequant_staged<{w}>" for w in _QT]
    n += [f"k_mmv_row<{w},{u},{nm}>" for w, u in _ROW_U.items() for nm in (1, MMV_MAXN)]
    n += [f"k_mmv_row1<{w},{u},{lpr},{mb},{rt},{q}>" for w, (u, rt, mb) in _ROW1.items()
          for lpr in (32, 64, 128) for q in ("false", "true")]  # fmt: skip
    n += [f"k_mmv_ring<{w},{','.join(map(str, _RING[w]))}>" for w in _XT]
    n += [f"k_convert<{a},{b}>" for a in f for b in f]
    # plain kernels are C++ functions too: their mangled names come from NVRTC the same way
    n += ["k_norm", "k_argmax", "k_argsort", "k_col2im_1d", "k_get_rows_i32", "k_cpy_i32"]
    n += ["k_quant_x", "k_glu_vec", "k_norm_vec<1>", "k_norm_vec<4>"]
    h = ("float", "__half")
    n += [f"k_attention<{k},{v},{m},{rm}>" for k in h for v in h for m in h for rm in (1, 2, 4, 8)]
    n += [f"k_allreduce_p2p<{r}>" for r in range(2, P2P_MAX_RANKS + 1)]
    return n


_MODULES: dict[int, dict | ComputeError] = {}


def kernels(device: int) -> dict:
    """name → kernel function for ``device``, compiled on first use (a failed compile is
    remembered and raised again, not retried for every graph)."""
    fns = _MODULES.get(device)
    if fns is None:
        try:
            fns = _MODULES[device] = compile_module(device)
        except ComputeError as e:
            _MODULES[device] = e
            raise
    if isinstance(fns, ComputeError):
        raise fns
    return fns


def compile_module(device: int) -> dict:
    """Compile kernels.cu for ``device`` (NVRTC, for its compute capability; CuPy caches the
    binaries on disk). A compile error raises ComputeError with the compiler's log."""
    import cupy as cp

    src = (Path(__file__).parent / "kernels.cu").read_text()
    with cp.cuda.Device(device):
        opts = ("--std=c++17", f"-DMMVP_SEG={MMVP_SEG}", f"-DMMVP_NS={MMVP_NS}")
        mod = cp.RawModule(code=src, options=opts, name_expressions=_names())
        try:
            mod.compile()
        except cp.cuda.compiler.CompileException as e:
            raise ComputeError(f"CUDA kernels failed to compile: {e}") from e
        fns = {n: mod.get_function(n) for n in _names()}
        # the pipelined mat-vec sizes its shared memory at launch, beyond the default 48 KiB
        optin = cp.cuda.Device(device).attributes["MaxSharedMemoryPerBlockOptin"]
        for w in _WT:
            fns[f"k_mmv_pipe<{w}>"].max_dynamic_shared_size_bytes = optin
        fns["smem_optin"] = optin
        fns["sm_count"] = cp.cuda.Device(device).attributes["MultiProcessorCount"]
        fns["cc"] = int(cp.cuda.Device(device).compute_capability)
    return fns


# --- what the plugin supports ------------------------------------------------------------------------
def _rows_contig(t) -> bool:
    return t.nb[0] == t.type.type_size


def _addressable(t) -> bool:
    """Whole rows of a weight stored in the x8 layouts, or not such a weight (layout.py)."""
    try:
        type_id(t)
    except UnsupportedOpError:
        return False
    return True


def supports(op) -> bool:
    o = op.op
    if o is None or o in VIEW_OPS:
        return True
    if any(t is not None and t.nelements >= 1 << 31 for t in (op, *op.src)):
        return False  # kernels decompose indices in 32 bits
    if not all(_addressable(t) for t in (op, *op.src) if t is not None and t.type in X8):
        return False  # a view cutting the rows of regrouped weights
    s = op.src
    if o in _BIN or o in _SCALAR or o is Op.UNARY or o is Op.GLU:
        return all(x is None or x.type in FLOAT for x in s) and op.type in FLOAT
    if o in (Op.NORM, Op.RMS_NORM, Op.L2_NORM, Op.SOFT_MAX, Op.ROPE, Op.ARGMAX, Op.ARGSORT,
             Op.COL2IM_1D, Op.IM2COL, Op.CONCAT, Op.SUM, Op.SUM_ROWS, Op.MEAN):  # fmt: skip
        if o is Op.CONCAT:
            return op.type in FLOAT | {T.I32}
        return True
    if o in (Op.CPY, Op.CONT, Op.DUP):
        a = s[0]
        d = s[1] if o is Op.CPY else op
        if a.type == T.I32 or d.type == T.I32:
            return a.type == d.type
        if a.type in QUANT:
            return d.type == T.F32 and a.is_contiguous()
        if d.type in QUANT:
            return d.type in (T.Q8_0, T.Q4_0) and d.is_contiguous()
        return True
    if o is Op.GET_ROWS:
        return s[0].type in FLOAT | {T.I32} or (s[0].type in QUANT and _rows_contig(s[0]))
    if o is Op.SET_ROWS:
        return s[0].type in FLOAT or (s[0].type in (T.Q8_0, T.Q4_0) and _rows_contig(s[0]))
    if o is Op.MUL_MAT:
        a, b = s
        return a.type in FLOAT | QUANT and (a.type not in QUANT or _rows_contig(a))
    if o is Op.MUL_MAT_ID:
        a, b, _ = s
        return a.ne[0] % 32 == 0 and _rows_contig(a) and b.type == T.F32
    return False


# --- fast division magic for the index decompositions ------------------------------------------------
def fastdiv(d: int) -> list[int]:
    d = max(1, int(d))
    shift = max(0, math.ceil(math.log2(d)))
    mul = ((1 << 32) * ((1 << shift) - d)) // d + 1
    return [mul & 0xFFFFFFFF, shift, d]


def _f(x: float) -> int:
    return int(np.array([x], np.float64).view(np.int64)[0])


def _written_buffers(graph) -> set[int]:
    """ids of the buffers that some node of ``graph`` writes (its own tensor; CPY's and
    SET_ROWS's destination)."""
    out = set()
    for n in graph.nodes:
        if n.op is not None and n.op not in VIEW_OPS:
            dst = n.src[1] if n.op is Op.CPY else n.src[0] if n.op is Op.SET_ROWS else n
            out |= {id(n.buffer), id(dst.buffer)}
    return out


def check_buffers(buffers) -> None:
    """BufferFreedError if work about to be queued (a plan, a recording) uses a freed buffer."""
    for b in buffers:
        if b.freed:
            raise BufferFreedError(f"a graph computed on CUDA uses freed buffer {b.name!r}")


class CudaPlan:
    """Launches for every node of a graph on one stream, replayed (as a CUDA graph once
    warm) by ``run``."""

    def __init__(self, graph, sctx) -> None:
        import cupy as cp

        self.cp = cp
        self.sctx = sctx
        self.steps: list[Callable[[], None]] = []
        self.library_steps: set[int] = set()  # indices of cuBLAS steps (may refuse graph capture)
        self.graph_error: str | None = None  # why whole-graph capture failed, if it did
        self.segments: list | None = None  # [(cuda graph | None, steps)] when capture is partial
        self.keep: list = []  # device parameter arrays and scratch memory the steps use
        self.kernel_names: list[str] = []  # what each launch runs, in order (tests, debugging)
        self.fused: list[tuple[str, ...]] = []  # the ops of each fused launch (tests, debugging)
        self.buffers = {}
        self.uses_index = False
        self.cublas_ok = True
        self.runs = 0
        self.cuda_graph = None
        self.graph_failed = not tuning.GRAPHS.get()
        self.nodes = graph.nodes
        # activations already quantized for the register mat-vec, by the kernel that produced
        # them or by an earlier product's k_quant_x: id(tensor) → (tensor, scratch address,
        # index of the node after which the quantized copy matches the tensor)
        self.xq_ready: dict[int, tuple] = {}
        self.index = {id(n): i for i, n in enumerate(graph.nodes)}
        self.attn_scratch: tuple | None = None  # (address, bytes, counts) for k_attention
        with cp.cuda.Device(sctx.device):
            self.fns = kernels(sctx.device)
            self.pdl = pdl_wanted(self.fns["cc"])
            # buffers some kernel of this graph writes: the register mat-vec waits before reading
            # weights there (kernels.cu: pdl_enter)
            self.written = _written_buffers(graph)
            fusion = Fusion(graph)
            covered = 0  # nodes still to skip: computed by the last fused kernel
            for i, n in enumerate(graph.nodes):
                for t in (n, *n.src):
                    if t is not None:
                        if t.buffer is None:
                            raise ComputeError(f"{n.op.name} {n.name or n.uid}: tensor {t.name or t.uid} "
                                               "is not allocated")  # fmt: skip
                        self.buffers[id(t.buffer)] = t.buffer
                if covered:
                    covered -= 1
                    continue
                if n.op in VIEW_OPS:
                    continue
                covered = max(0, self._fuse(fusion, i, graph.nodes) - 1)
                if not covered:
                    self._node(n)
            # parameter uploads went through the legacy stream: finish them before any replay
            cp.cuda.runtime.deviceSynchronize()
        sctx.check_err = sctx.check_err or self.uses_index

    # --- helpers -----------------------------------------------------------------------------------
    def _P(self, vals: list[int]):
        arr = self.cp.asarray(np.asarray(vals, np.int64))
        self.keep.append(arr)
        return np.uint64(arr.data.ptr)

    @staticmethod
    def _ptr(t) -> np.uint64:
        return np.uint64(t.buffer.ctx.ptr + t.offs)

    def _scratch(self, nbytes: int) -> int:
        m = self.cp.cuda.Memory(max(nbytes, 1))
        self.keep.append(m)
        return int(m.ptr)

    def _launch(self, name: str, n: int, args: tuple, block: int = THREADS, grid=None, smem: int = 0) -> None:
        self.kernel_names.append(name)
        if grid is None:
            grid = (max(1, min((n + block - 1) // block, 65535)),)
        # a graph's first launch waits for all earlier work in the stream (kernels.cu: pdl_enter)
        pdl = self.pdl and bool(self.steps)
        stream = self.sctx.stream.ptr
        self.steps.append(Launch(name, self.fns[name], grid, (block,), smem, stream, args, pdl))

    def _elementwise_copy(self, src, dst, sp=None, dp=None) -> None:
        """dst (any layout) ← src (any layout), element order row-major (CPY semantics)."""
        n = src.nelements
        P = self._P([n, *src.ne, *src.nb, *dst.ne, *dst.nb])
        sp = self._ptr(src) if sp is None else sp
        dp = self._ptr(dst) if dp is None else dp
        if src.type == T.I32:
            self._launch("k_cpy_i32", n, (P, dp, sp))
        elif dst.type in QUANT:
            self._launch(f"k_cpy_q<{type_id(dst)},{CTYPE[src.type]}>", n // 32, (P, dp, sp))
        elif src.type in QUANT:
            self._launch(f"k_cpy_dq<{type_id(src)}>", n // 32, (P, dp, sp))
        else:
            self._launch(f"k_cpy<{CTYPE[dst.type]},{CTYPE[src.type]}>", n, (P, dp, sp))

    def _contig_copy(self, t, ty: GGMLType) -> tuple[int, list[int]]:
        """A packed copy of t converted to ``ty`` in scratch memory: (address, nb)."""
        from accelplane.core.tensor import Tensor

        tmp = Tensor(ty, t.ne)
        ptr = self._scratch(tmp.nbytes)
        if t.is_contiguous() and t.type in CTYPE:
            P = self._P([t.nelements])
            args = (P, np.uint64(ptr), self._ptr(t))
            self._launch(f"k_convert<{CTYPE[ty]},{CTYPE[t.type]}>", t.nelements, args)
        else:
            self._elementwise_copy(t, tmp, dp=np.uint64(ptr))
        return ptr, list(tmp.nb)

    # --- nodes ----------------------------------------------------------------------------------------
    def _node(self, n) -> None:
        o = n.op
        s = n.src
        if o in _BIN:
            a, b = s
            P = self._P([n.nelements, *n.ne, *n.nb, *a.nb, *b.ne, *b.nb, _BIN[o]])
            self._launch(f"k_binary<{CTYPE[a.type]},{CTYPE[b.type]}>", n.nelements,
                         (P, self._ptr(n), self._ptr(a), self._ptr(b)))  # fmt: skip
        elif o in _SCALAR or o is Op.UNARY:
            a = s[0]
            code = _SCALAR.get(o)
            p = list(n.op_params) + [0.0, 0.0]
            if o is Op.UNARY:
                code, p = int(UnaryOp(p[0])), [0.0, 0.0]
            P = self._P([n.nelements, *n.ne, *n.nb, *a.nb, code, _f(p[0]), _f(p[1])])
            self._launch(f"k_unary<{CTYPE[n.type]}>", n.nelements, (P, self._ptr(n), self._ptr(a)))
        elif o is Op.GLU:
            a, b = s
            op, swapped = GluOp(n.op_params[0]), bool(n.op_params[1])
            if b is None:
                h = n.ne[0] * a.nb[0]
                xp, gp = int(self._ptr(a)), int(self._ptr(a)) + h
                if swapped:
                    xp, gp = gp, xp
                nbx = nbg = a.nb
            else:
                xp, gp, nbx, nbg = int(self._ptr(a)), int(self._ptr(b)), a.nb, b.nb
            P = self._P([n.nelements, *n.ne, *n.nb, *nbx, *nbg, int(op)])
            args = (P, self._ptr(n), np.uint64(xp), np.uint64(gp))
            vec = n.ne[0] % 32 == 0 and n.ne[2] == n.ne[3] == 1 and xp % 16 == 0 and gp % 16 == 0
            vec = vec and self._f32_rows16(n) and all(q[0] == 4 and q[1] % 16 == 0 for q in (nbx, nbg))
            vec = vec and a.type == T.F32 and (b is None or b.type == T.F32)
            if vec:  # float4s, and the quantized activations of a register mat-vec reading it
                grid = (-(-n.nelements // 1024),)
                self._launch("k_glu_vec", 0, (*args, self._xq_for(n)), block=256, grid=grid)
            else:
                self._launch(f"k_glu<{CTYPE[n.type]}>", n.nelements, args)
        elif o in (Op.NORM, Op.RMS_NORM, Op.L2_NORM):
            self._norm(n)
        elif o is Op.SOFT_MAX:
            self._soft_max(n)
        elif o is Op.ROPE:
            self._rope(n)
        elif o is Op.MUL_MAT:
            self._mul_mat(n)
        elif o is Op.MUL_MAT_ID:
            self._mul_mat_id(n)
        elif o is Op.GET_ROWS:
            a, idx = s
            self.uses_index = True
            P = self._P([*n.ne, *n.nb, *a.nb, *idx.nb[:3], a.ne[1]])
            args = (P, self._ptr(n), self._ptr(a), self._ptr(idx), self.sctx.err.ptr)
            if a.type in QUANT:
                self._launch(f"k_get_rows_q<{type_id(a)}>", n.nelements // 32, args)
            elif a.type == T.I32:
                self._launch("k_get_rows_i32", n.nelements, args)
            else:
                self._launch(f"k_get_rows<{CTYPE[a.type]}>", n.nelements, args)
        elif o is Op.SET_ROWS:
            dst, src, idx = s
            self.uses_index = True
            P = self._P([*src.ne, *src.nb, *dst.nb, *idx.nb[:3], idx.ne[1], idx.ne[2], dst.ne[1]])
            args = (P, self._ptr(dst), self._ptr(src), self._ptr(idx), self.sctx.err.ptr)
            if dst.type in QUANT:
                self._launch(f"k_set_rows_q<{type_id(dst)}>", src.nelements // 32, args)
            else:
                self._launch(f"k_set_rows<{CTYPE[dst.type]}>", src.nelements, args)
        elif o in (Op.CPY, Op.CONT, Op.DUP):
            self._elementwise_copy(s[0], s[1] if o is Op.CPY else n)
        elif o is Op.CONCAT:
            a, b = s
            ct = {4: "int", 2: "short"}[a.type.type_size] if a.type != T.F32 else "float"
            P = self._P([n.nelements, *n.ne, *n.nb, *a.ne, *a.nb, *b.nb, n.op_params[0]])
            self._launch(f"k_concat<{ct}>", n.nelements, (P, self._ptr(n), self._ptr(a), self._ptr(b)))
        elif o in (Op.SUM_ROWS, Op.MEAN):
            a = s[0]
            P = self._P([*a.ne, *a.nb, *n.nb[1:], int(o is Op.MEAN)])
            self._launch(f"k_sum_rows<{CTYPE[a.type]}>", 0, (P, self._ptr(n), self._ptr(a)), grid=(a.nrows,))
        elif o is Op.SUM:
            a = s[0]
            P = self._P([a.nelements, *a.ne, *a.nb])
            self._launch(f"k_sum<{CTYPE[a.type]}>", 0, (P, self._ptr(n), self._ptr(a)), block=1024, grid=(1,))
        elif o is Op.ARGMAX:
            a = s[0]
            P = self._P([a.ne[0], a.ne[1], a.nb[0], a.nb[1], n.nb[0]])
            self._launch("k_argmax", 0, (P, self._ptr(n), self._ptr(a)), block=1024, grid=(a.ne[1],))
        elif o is Op.ARGSORT:
            a = s[0]
            P = self._P([*a.ne, *a.nb, *n.nb, int(n.op_params[0] == SortOrder.DESC)])
            self._launch("k_argsort", 0, (P, self._ptr(n), self._ptr(a)), block=256, grid=(a.nrows,))
        elif o is Op.IM2COL:
            self._im2col(n)
        elif o is Op.COL2IM_1D:
            a = s[0]
            s0, oc, p0 = n.op_params
            k = a.ne[0] // oc
            P = self._P([n.nelements, n.ne[0], n.ne[1], n.ne[2], *n.nb[:3], *a.nb[:3], k, a.ne[1], s0, p0,
                         *fastdiv(n.ne[0]), *fastdiv(n.ne[1])])  # fmt: skip
            self._launch("k_col2im_1d", n.nelements, (P, self._ptr(n), self._ptr(a)))
        else:  # pragma: no cover - supports() keeps these out
            raise ComputeError(f"CUDA plugin has no kernel for {o.name}")

    def _norm(self, n, mul=None, add=None) -> None:
        """A row norm; with ``mul`` (the MUL reading it, fused) times its other operand,
        written to the MUL's tensor; with ``add`` (the ADD it reads, fused) of that sum, which
        is written too."""
        a = n.src[0] if add is None else add.src[0]
        code = {Op.NORM: 0, Op.RMS_NORM: 1, Op.L2_NORM: 2}[n.op]
        out, w = (n, None) if mul is None else (mul, mul.src[1])
        wp = [0, 1, 1, 1, 1, 0, 0, 0, 0] if w is None else [1, *w.ne, *w.nb]
        ap = [0] * 9 if add is None else [1, *add.src[1].nb, *add.nb]
        P = self._P([*a.ne, *a.nb, *out.nb, code, _f(n.op_params[0]), *wp, *ap])
        ptr = [np.uint64(0) if t is None else self._ptr(t) for t in (w, add and add.src[1], add)]
        args = (P, self._ptr(out), self._ptr(a), *ptr)
        # contiguous 16-byte-aligned F32 rows of up to 16384 elements: the vector kernel (one
        # block per row: a decode has a single row)
        ts = [t for t in (a, out, w, add and add.src[1], add) if t is not None]
        vec = a.ne[0] % 4 == 0 and a.ne[0] <= 16384 and (w is None or w.ne[0] == a.ne[0])
        vec = vec and all(map(self._f32_rows16, ts))
        if vec:  # a float4 per thread where 1024 threads hold the row, else up to four
            nv = 1 if a.ne[0] <= 4096 else 4
            threads = min(1024, max(32, -(-a.ne[0] // (4 * nv) // 32) * 32))
            self._launch(f"k_norm_vec<{nv}>", 0, (*args, self._xq_for(out)), block=threads, grid=(a.nrows,))
        else:
            self._launch("k_norm", 0, args, block=256, grid=(a.nrows,))

    @staticmethod
    def _f32_rows16(t) -> bool:
        """F32 rows of contiguous elements, every row 16-byte aligned (float4 kernels)."""
        return (t.type == T.F32 and t.nb[0] == 4 and all(x % 16 == 0 for x in t.nb[1:])
                and (t.buffer.ctx.ptr + t.offs) % 16 == 0)  # fmt: skip

    def _xq_for(self, out) -> np.uint64:
        """Scratch for ``out`` quantized as k_quant_x writes it (flat over its elements), when a
        register mat-vec reads ``out``, directly or through a contiguous view of all of it in the
        same memory order (the attention's permuted, reshaped output), as rows of a multiple of
        32 elements with ne2 = ne3 = 1: the kernel writing ``out`` then writes that too, and
        _mmv_row skips k_quant_x. Else a null pointer."""

        def reads_as_is(b) -> bool:
            return b is out or (layout.root(b) is layout.root(out) and b.buffer is out.buffer
                                and b.offs == out.offs and b.nelements == out.nelements
                                and b.is_contiguous() and out.is_contiguous())  # fmt: skip

        if not tuning.XQ.get():
            return np.uint64(0)
        readers = [c for c in self.nodes if c.op is Op.MUL_MAT and c.src[0].buffer and reads_as_is(c.src[1])]
        readers = [c for c in readers if c.src[1].ne[0] % 32 == 0 and c.src[1].ne[2] == c.src[1].ne[3] == 1
                   and self._takes_row(c)]  # fmt: skip
        if not readers:
            return np.uint64(0)
        total = out.nelements
        xq = np.uint64(self._scratch(total + total // 32 * 8))
        for c in readers:
            self.xq_ready[id(c.src[1])] = (c.src[1], xq, self.index[id(out)])
        return xq

    def _xq_of(self, b, i: int) -> np.uint64 | None:
        """The quantized copy of ``b`` for node ``i``'s register mat-vec, if one was made and no
        node since wrote into ``b``'s memory (CPY or SET_ROWS into it, an op on a view of it);
        scratch is never shared, so only such writes could make the copy stale."""
        ready = self.xq_ready.get(id(b))
        if ready is None or ready[0] is not b:
            return None
        own = layout.root(b)
        for n in self.nodes[ready[2] + 1 : i]:
            if n.op is None or n.op in VIEW_OPS:
                continue
            dst = n.src[1] if n.op is Op.CPY else n.src[0] if n.op is Op.SET_ROWS else n
            if layout.root(dst) is own:
                return None
        return ready[1]

    def _fuse(self, fusion: Fusion, i: int, nodes) -> int:
        """Launch nodes ``i ..`` as one kernel where a fused kernel exists and
        accelplane.core.fusion allows it; returns how many nodes that covered (0: none)."""
        n = nodes[i]
        if n.op is Op.ROPE:
            sr = fusion.rope_set_rows(i)
            if sr is not None and self._rope_rows_fit(n, nodes[i + 1], sr):
                self._rope(n, sr)
                self.fused.append(("ROPE", "SET_ROWS"))
                return 3
            return 0
        if n.op is Op.ADD and i + 1 < len(nodes) and nodes[i + 1].op in NORMS:
            a, b = n.src
            same = tuple(a.ne) == tuple(b.ne) == tuple(n.ne)
            if same and T.F32 == a.type == b.type == n.type:
                nrm = nodes[i + 1]
                three = fusion.match(i, (Op.ADD, nrm.op, Op.MUL), written=(0,))
                if three and scales_rows(nrm, nodes[i + 2]):
                    self._norm(nrm, nodes[i + 2], add=n)
                    self.fused.append(("ADD", nrm.op.name, "MUL"))
                    return 3
                if fusion.match(i, (Op.ADD, nrm.op), written=(0,)):
                    self._norm(nrm, add=n)
                    self.fused.append(("ADD", nrm.op.name))
                    return 2
        m = fusion.norm_mul(i)
        if m is not None:
            self._norm(n, m)
            self.fused.append((n.op.name, "MUL"))
            return 2
        if n.op is Op.MUL_MAT and _qkv_fused():
            f = fusion.product_rope_cache(i)
            if f is not None and self._qkv_fits(f):
                self._mmv_row(n, f)
                self.fused.append(("MUL_MAT", "ROPE", "ROPE", "SET_ROWS", "SET_ROWS"))
                return f.covered
        attn = (Op.MUL_MAT, Op.SOFT_MAX, Op.MUL_MAT)
        run = nodes[i : i + 3]
        if n.op is Op.MUL_MAT and _attn_fused() and fusion.match(i, attn) and self._attention_fits(*run):
            self._attention(*run)
            self.fused.append(tuple(o.name for o in attn))
            return 3
        return 0

    @staticmethod
    def _attention_fits(kq, sm, kqv) -> bool:
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
        return (d % 8 == 0 and d <= 256 and 0 < dv <= 128 and q.ne[1] <= 8 and k16 and 0 < kq.ne[0] <= 8192
                and v.ne[0] == kq.ne[0] and kqv.ne[2] == kq.ne[2] and kqv.ne[3] == kq.ne[3])  # fmt: skip

    def _attention(self, kq, sm, kqv) -> None:
        """Decode attention as one launch (kernels.cu: k_attention): chunks of 32 positions,
        up to ATT_G of them per block (merged in shared memory: a short cache is one block per
        head), the blocks of a head combined through scratch by the last one to finish."""
        k, q = kq.src
        mask = sm.src[1]
        v = kqv.src[0]
        nkv, r, ne2, ne3 = kq.ne
        chunks, batches = -(-nkv // 32), ne2 * ne3
        groups = min(_ATT_G, chunks)
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
        P = self._P([k.ne[0], nkv, r, ne2, ne3, ne2 // k.ne[2], ne3 // k.ne[3], *k.nb[1:], *q.nb[1:],
                     int(mask is not None), *mnb, *mne, _f(sm.op_params[0]), dv, ne2 // v.ne[2],
                     ne3 // v.ne[3], *v.nb[1:], *kqv.nb[1:], int(vwhole), kqv.nelements])  # fmt: skip
        part, count = self._attention_scratch(batches * blocks * 8 * (dv + 2) * 4, batches)
        # the output also quantized for the output projection (kernels.cu: quantize1 wants whole
        # warps over 32-element units: Dv a multiple of 32, kqv contiguous)
        xq = self._xq_for(kqv) if dv % 32 == 0 and kqv.is_contiguous() else np.uint64(0)
        ct = {T.F16: "__half", T.F32: "float"}
        rm = 1 << (r - 1).bit_length()  # query rows compiled for: the next power of two
        name = f"k_attention<{ct[k.type]},{ct[v.type]},{ct[mask.type] if mask is not None else 'float'},{rm}>"
        mp = self._ptr(mask) if mask is not None else np.uint64(0)
        args = (P, self._ptr(kqv), self._ptr(k), self._ptr(q), mp, self._ptr(v), part, count, xq)
        self._launch(name, 0, args, block=128 * groups, grid=(blocks, batches))

    def _attention_scratch(self, part_bytes: int, batches: int) -> tuple[np.uint64, np.uint64]:
        """k_attention's partials and per-batch counts, shared by the plan's attention launches:
        they run one after another on the stream (each waits for its predecessor, kernels.cu:
        pdl_enter) and each leaves the counts at zero. Grown, not resized, when a launch needs
        more (earlier launches keep their smaller scratch)."""
        cur = self.attn_scratch
        if cur is None or cur[1] < part_bytes or cur[2].size < batches:
            part_bytes = max(part_bytes, cur[1] if cur else 0)
            count = self.cp.zeros(max(batches, cur[2].size if cur else 0), np.int32)
            self.keep.append(count)
            cur = self.attn_scratch = (self._scratch(part_bytes), part_bytes, count)
        return np.uint64(cur[0]), np.uint64(cur[2].data.ptr)

    def _soft_max(self, n) -> None:
        a, mask = n.src
        scale, max_bias = n.op_params
        nh = a.ne[2]
        nhl = 1 << int(math.floor(math.log2(nh))) if nh > 0 else 1
        m0 = 2.0 ** (-max_bias / nhl)
        m1 = 2.0 ** (-max_bias / 2.0 / nhl)
        mne = mask.ne if mask is not None else (1, 1, 1, 1)
        mnb = mask.nb if mask is not None else (0, 0, 0, 0)
        P = self._P([*a.ne, *a.nb, *n.nb, mne[1], mne[2], mne[3], *mnb, int(mask is not None), _f(scale),
                     _f(max_bias), nhl, _f(m0), _f(m1)])  # fmt: skip
        mt = "__half" if mask is not None and mask.type == T.F16 else "float"
        mp = self._ptr(mask) if mask is not None else np.uint64(0)
        self._launch(f"k_soft_max<{mt}>", 0, (P, self._ptr(n), self._ptr(a), mp), block=256, grid=(a.nrows,))

    def _rope(self, n, sr=None) -> None:
        """ROPE node ``n``; with ``sr`` (a SET_ROWS of its result, fusion.rope_set_rows and
        _rope_rows_fit said yes), each token's rotated values go straight into the cache row
        that SET_ROWS names, converted to the cache's type, and the rope's memory stays unwritten."""
        a, pos = n.src
        n_dims, mode = n.op_params[1:3]
        out, dnb, rows, extra = n, list(n.nb), np.uint64(0), [0, 0]
        if sr is not None:
            out, idx = sr.src[0], sr.src[2]
            es = out.nb[0]
            dnb = [es, es * n.ne[0], out.nb[1], 0]  # head i1 within the row, token i2 → row idx[i2]
            rows, extra = self._ptr(idx), [out.ne[1], idx.nb[0]]
            self.uses_index = True
        P = self._P([*a.ne, *a.nb, *dnb, n_dims, 2 if mode == ROPE_TYPE_NEOX else 0, *_rotation(n), *extra])
        cnt = a.ne[0] // 2 * a.nrows
        args = (P, self._ptr(out), self._ptr(a), self._ptr(pos), rows, self.sctx.err.ptr)
        self._launch(f"k_rope<{CTYPE[a.type]},{CTYPE[out.type]}>", cnt, args)

    @staticmethod
    def _rope_rows_fit(rope, view, sr) -> bool:
        """ROPE → view → SET_ROWS in the shape k_rope's rows mode writes: a contiguous rope
        result of one batch whose view is its tokens as rows (ne0 · ne1 values each), set into
        a 2-D F16/F32 cache of rows that long by a contiguous I32 index per token."""
        cache, src, idx = sr.src
        return (rope.type in (T.F32, T.F16) and rope.is_contiguous() and rope.ne[3] == 1
                and cache.type in (T.F32, T.F16) and cache.nb[0] == cache.type.type_size
                and cache.ne[2] == cache.ne[3] == 1 and src is view and view.view_offs == 0
                and tuple(view.ne) == (rope.ne[0] * rope.ne[1], rope.ne[2], 1, 1)
                and view.is_contiguous() and cache.ne[0] == view.ne[0]
                and idx.type == T.I32 and tuple(idx.ne) == (rope.ne[2], 1, 1, 1))  # fmt: skip

    def _im2col(self, n) -> None:
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
        P = self._P([n.nelements, *dne, *dnb, *nbx, w, h, kw, kh, s0, s1, p0, p1, d0, d1,
                     *fastdiv(dne[0]), *fastdiv(dne[1]), *fastdiv(dne[2]), *fastdiv(kw), *fastdiv(kh)])
        self._launch(f"k_im2col<{CTYPE[n.type]}>", n.nelements, (P, self._ptr(n), self._ptr(x)))

    # --- matrix products --------------------------------------------------------------------------------
    def _x_f32(self, b) -> tuple[np.uint64, list[int]]:
        """Activations as F32 rows aligned for float4 loads (a converted copy when needed)."""
        ok = b.type == T.F32 and _rows_contig(b) and all(v % 16 == 0 for v in b.nb[1:])
        ok = ok and (b.buffer.ctx.ptr + b.offs) % 16 == 0
        if ok:
            return self._ptr(b), list(b.nb)
        ptr, nb = self._contig_copy(b, T.F32)
        return np.uint64(ptr), nb

    @staticmethod
    def _rows_aligned(a) -> bool:
        """Rows fit the staged/pipelined kernels: 16-byte aligned, a whole number of 16-byte words."""
        aligned = (a.buffer.ctx.ptr + a.offs) % 16 == 0 and all(x % 16 == 0 for x in a.nb[1:])
        return aligned and a.row_bytes % 16 == 0 and _rows_contig(a)

    def _mmvp_plan(self, a, b) -> tuple[int, int] | None:
        """(warps per block, dynamic shared memory bytes) for k_mmv_pipe, or None where it does
        not apply: rows not aligned, K not a multiple of 32, or the activations too large for
        shared memory next to the stages."""
        if _mmv_mode() == "f32" or type_id(a) not in _WT:
            return None
        k, n = a.ne[0], b.ne[1]
        if k % 32 or not self._rows_aligned(a) or k * n >= 1 << 28:
            return None
        xbytes = n * k * 4 if a.type in FLOAT else n * k + n * (k // 32) * 8
        forced = tuning.MMV_WARPS.get()  # the kernel's launch bounds: 512 threads
        choices = [int(forced)] if forced else [16, 8, 4]
        for warps in choices:
            smem = warps * MMVP_NS * MMVP_SEG + xbytes
            # fewer, larger blocks share the activations' setup; but keep every SM busy
            busy = warps == choices[-1] or -(-a.ne[1] // warps) >= self.fns["sm_count"]
            if smem <= self.fns["smem_optin"] and busy:
                return warps, smem
        return None

    def _mmv_pipe(self, n, warps: int, smem: int) -> None:
        """The pipelined mat-vec (kernels.cu: k_mmv_pipe) on a persistent grid."""
        from cupy_backends.cuda.api import driver

        a, b = n.src
        xp, xnb = self._x_f32(b)
        wt = type_id(a)
        unit = MMVQ_UNIT.get(wt, 16)
        seg = MMVP_SEG // unit * unit
        P = self._P([a.ne[1], a.ne[0], b.ne[1], b.ne[2], b.ne[3], b.ne[2] // a.ne[2], b.ne[3] // a.ne[3],
                     *a.nb[1:], *n.nb[1:], a.row_bytes, seg, *xnb[1:]])  # fmt: skip
        name = f"k_mmv_pipe<{wt}>"
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(self.fns[name].kernel.ptr, 32 * warps, smem)
        batches = b.ne[2] * b.ne[3]
        resident = max(1, per_sm) * self.fns["sm_count"]
        grid = (max(1, min(-(-a.ne[1] // warps), -(-resident // batches))), batches)
        self._launch(name, 0, (P, self._ptr(n), self._ptr(a), xp), block=32 * warps, grid=grid, smem=smem)

    def _mmv_row(self, n, qkv: RopeCache | None = None) -> None:
        """The register mat-vec (kernels.cu: k_quant_x, then k_mmv_row): the activations are
        quantized once into scratch memory, then blocks of 128 threads stream whole weight rows.
        With ``qkv`` (_qkv_fits said yes) the rows go through the projection's epilogue instead."""
        a, b = n.src
        k, nrow = a.ne[0], b.ne[1]
        units, batches = k // 32, b.ne[2] * b.ne[3]
        xq_bytes = nrow * k + nrow * units * 8  # int8 quants, then a float scale and an int sum per unit
        # quantized by the norm that wrote b, or for an earlier product of b (Q, K and V; the gate
        # and up projections; repeated products in a benchmark): once per graph
        xq = self._xq_of(b, self.index[id(n)])
        if xq is None:
            xp, xnb = self._x_f32(b)
            xq = np.uint64(self._scratch(xq_bytes * batches))
            P = self._P([k, nrow, b.ne[2], *xnb[1:], xq_bytes])
            self._launch("k_quant_x", 0, (P, xq, xp), block=256, grid=(-(-nrow * k // 1024), batches))
            self.xq_ready[id(b)] = (b, xq, self.index[id(n)])
        wt = type_id(a)
        u, rt, lpr = self._row1_shape(n)
        ring = qkv is None and self._ring_fits(n)
        if ring:
            name, rt, lpr = f"k_mmv_ring<{wt},{','.join(map(str, _RING[wt]))}>", 1, 32  # a warp per row
        elif lpr:
            name = f"k_mmv_row1<{wt},{u},{lpr},{_ROW1[wt][2]},{rt},{'true' if qkv else 'false'}>"
        else:  # more rows per block for short rows, so every thread keeps u loads in flight
            u, rt = _ROW_U[wt], 1
            lpr = _lanes(units // _ROW_W.get(wt, 1), u)
            name = f"k_mmv_row<{wt},{u},{1 if nrow == 1 else MMV_MAXN}>"
        P = [a.ne[1], k, nrow, b.ne[2], b.ne[3], b.ne[2] // a.ne[2], b.ne[3] // a.ne[3],
             *a.nb[1:], *n.nb[1:], lpr, xq_bytes, int(id(a.buffer) not in self.written)]  # fmt: skip
        if qkv is not None:
            P += self._qkv_params(qkv)
        grid = (-(-a.ne[1] // (rt * 128 // lpr)), batches)
        smem = 4 * _RING[wt][0] * 4 * _RING[wt][2] * _X8_GROUP[wt] if ring else 0  # warps x slots x step
        self._launch(name, 0, (self._P(P), self._ptr(n), self._ptr(a), xq), block=128, grid=grid, smem=smem)

    @staticmethod
    def _ring_fits(n) -> bool:
        """k_mmv_ring for register mat-vec ``n``: one activation row and batch, x8 weights, K a
        multiple of a step (1024 or 2048 elements: _RING's units per lane); for Q4_0x8 and
        Q8_0x8 only from K = 8192, since at K = 4096 the register kernel, one pass of loads per
        block there, was as fast or faster on an H200 (Q4_0 14336 x 4096: 9.0 against 9.8 us),
        while Q4_Kx8 gained at both."""
        a, b = n.src
        wt, k = type_id(a), a.ne[0]
        return (_ring_on() and wt in _RING and b.ne[1] == 1 and b.ne[2] * b.ne[3] == 1
                and k % (1024 * _RING[wt][2]) == 0 and (wt == 112 or k >= 8192))  # fmt: skip

    @staticmethod
    def _row1_shape(n) -> tuple[int, int, int]:
        """(loads per lane, rows per lane group, lanes per row) of k_mmv_row1 for register mat-vec
        ``n``; lanes 0 where it does not apply (several activation rows or batches, short rows)."""
        a, b = n.src
        wt = type_id(a)
        u, rt, _ = _ROW1[wt]
        lpr = _lanes(a.ne[0] // 32 // _ROW_W.get(wt, 1), u)
        one = b.ne[1] == 1 and b.ne[2] * b.ne[3] == 1 and lpr >= 32
        return u, rt, lpr if one else 0

    def _qkv_fits(self, f: RopeCache) -> bool:
        """fusion.product_rope_cache's run in the shape k_mmv_row1's QKV epilogue writes: an F32
        product [Q | K | V] of one row taking k_mmv_row1 with whole rope pairs in a block; normal
        rope over heads of an even size, Q and K contiguous slices at its start, the K rope into
        its cache as k_rope's rows mode takes it, V (as many rows as K) a contiguous slice at its
        end set into an F16/F32 cache by I32 indices; positions I32, one token."""
        n, q, k, k_set, v_set, _ = f
        if not (self._takes_row(n) and n.type == T.F32 and n.is_contiguous() and n.nrows == 1):
            return False
        _, rt, lpr = self._row1_shape(n)
        if not lpr or (rt * 128 // lpr) % 2:
            return False
        m = n.ne[0]
        qs, ks, vs = q.src[0], k.src[0], v_set.src[1]
        nq, nk = qs.nelements, ks.nelements
        hd, pos = q.ne[0], q.src[1]
        cache, idx = v_set.src[0], v_set.src[2]
        return (q.op_params[2] == ROPE_TYPE_NORMAL and hd % 2 == 0 and nq % hd == 0 and k.ne[0] == hd
                and m == nq + 2 * nk and nk % 2 == 0 and q.type == T.F32 and q.is_contiguous()
                and all(t.is_contiguous() for t in (qs, ks, vs))
                and (qs.view_offs, ks.view_offs, vs.view_offs) == (0, 4 * nq, 4 * (nq + nk))
                and vs.nelements == nk and vs.ne[3] == 1 and pos.type == T.I32 and pos.nelements == 1
                and self._rope_rows_fit(k, self.nodes[self.index[id(k)] + 1], k_set)
                and cache.type in (T.F32, T.F16) and cache.nb[0] == cache.type.type_size
                and idx.type == T.I32 and idx.ne[0] == vs.ne[1] and vs.ne[2] % idx.ne[1] == 0)  # fmt: skip

    def _qkv_params(self, f: RopeCache) -> list[int]:
        """k_mmv_row1's QKV epilogue parameters (kernels.cu: qkv_put) for a run _qkv_fits took."""
        n, q, k, k_set, v_set, _ = f
        self.uses_index = True
        err = self.sctx.err.ptr

        def put(sr, ne: tuple[int, int]) -> list[int]:  # kernels.cu: cache_put
            d, idx = sr.src[0], sr.src[2]
            return [int(self._ptr(d)), int(self._ptr(idx)), *ne, *d.nb[:3], *idx.nb[:2], idx.ne[1], d.ne[1],
                    int(d.type == T.F16)]  # fmt: skip

        nk, vs = k.src[0].nelements, v_set.src[1]
        return [q.src[0].nelements, nk, q.ne[0], q.op_params[1], *_rotation(q), int(self._ptr(q)),
                int(self._ptr(q.src[1])), int(err), *put(k_set, (nk, 1)),
                *put(v_set, (vs.ne[0], vs.ne[1]))]  # fmt: skip

    def _takes_row(self, n) -> bool:
        """MUL_MAT node ``n`` runs as the register mat-vec (_mmv_row)."""
        a, b = n.src
        return (n.nelements > 0 and b.ne[1] <= MMV_MAXN and a.ne[0] > 0 and a.ne[0] % 256 == 0
                and type_id(a) in _ROW_U and self._rows_aligned(a) and _mmv_mode() == "row")  # fmt: skip

    def _mul_mat(self, n) -> None:
        a, b = n.src
        nrow_b = b.ne[1]
        if self._takes_row(n):
            self._mmv_row(n)
            return
        small_float = a.type in FLOAT and a.ne[0] * a.ne[1] <= MMV_SMALL
        pipe = None if small_float or nrow_b > MMV_MAXN else self._mmvp_plan(a, b)
        if pipe is not None:
            self._mmv_pipe(n, *pipe)
            return
        small_float = small_float and a.ne[0] % 32 == 0 and _rows_contig(a)
        if (a.type in QUANT or small_float) and nrow_b <= MMV_MAXN:
            # small float products (attention over the KV cache) stay off cuBLAS, so a decode
            # graph is captured whole as one CUDA graph
            xp, xnb = self._x_f32(b)
            lanes = min(32, 1 << max(0, (a.ne[0] // 32 - 1).bit_length()))  # per row: >= its chunks
            # the activation rows staged in shared memory where they fit the default 48 KiB
            smem = nrow_b * a.ne[0] * 4
            smem = smem if smem <= 48 * 1024 else 0
            P = self._P([a.ne[1], a.ne[0], nrow_b, b.ne[2], b.ne[3], b.ne[2] // a.ne[2], b.ne[3] // a.ne[3],
                         *a.nb[1:], *xnb[1:], *n.nb[1:], lanes, int(smem > 0)])  # fmt: skip
            warps = 4
            rows_per_block = warps * (32 // lanes)
            grid = ((a.ne[1] + rows_per_block - 1) // rows_per_block, b.ne[2] * b.ne[3])
            self._launch(f"k_mul_mat_vec<{type_id(a)}>", 0, (P, self._ptr(n), self._ptr(a), xp),
                         block=32 * warps, grid=grid, smem=smem)  # fmt: skip
            return
        self._gemm(n)

    def _gemm(self, n) -> None:
        """cuBLAS gemmEx per batch matrix: C[N, M] = B[N, K] · A[M, K]ᵀ (F32 results)."""
        from cupy_backends.cuda.libs import cublas

        cp = self.cp
        a, b = n.src
        m, k = a.ne[1], a.ne[0]
        r2, r3 = b.ne[2] // a.ne[2], b.ne[3] // a.ne[3]
        if a.type in QUANT:
            # dequantize each weight matrix to F16 once per run, then an F16 GEMM
            wt = T.F16
            ap = self._scratch(m * k * 2 * a.ne[2] * a.ne[3])
            qid = type_id(a)
            staged = qid in MMVQ_UNIT and self._rows_aligned(a)
            unit = MMVQ_UNIT.get(qid, 16)
            for i3 in range(a.ne[3]):
                for i2 in range(a.ne[2]):
                    src = np.uint64(int(self._ptr(a)) + i2 * a.nb[2] + i3 * a.nb[3])
                    dst = np.uint64(ap + (i3 * a.ne[2] + i2) * m * k * 2)
                    if staged:
                        P = self._P([m, k, a.nb[1], a.row_bytes, MMVQ_SEG // unit * unit])
                        self._launch(f"k_dequant_staged<{qid}>", 0, (P, dst, src), block=128,
                                     grid=((m + 3) // 4,))  # fmt: skip
                    else:
                        P = self._P([m, k, a.nb[1]])
                        self._launch(f"k_dequant_f16<{qid}>", m * k // 32, (P, dst, src))
            anb = [2, 2 * k, 2 * k * m, 2 * k * m * a.ne[2]]
        else:
            wt = a.type
            ap, anb = int(self._ptr(a)), list(a.nb)
        if b.type == wt and _rows_contig(b):
            bp, bnb = int(self._ptr(b)), list(b.nb)
        else:
            bp, bnb = self._contig_copy(b, wt)
        dt = {T.F32: 0, T.F16: 2, T.BF16: 14}[wt]  # cudaDataType
        es = wt.type_size
        alpha = np.ones(1, np.float32)
        beta = np.zeros(1, np.float32)
        self.keep += [alpha, beta]
        handle = cp.cuda.device.get_cublas_handle()
        stream = self.sctx.stream
        calls = []
        for i3 in range(b.ne[3]):
            for i2 in range(b.ne[2]):
                pa = ap + (i2 // r2) * anb[2] + (i3 // r3) * anb[3]
                pb = bp + i2 * bnb[2] + i3 * bnb[3]
                pc = int(self._ptr(n)) + i2 * n.nb[2] + i3 * n.nb[3]
                calls.append((pa, pb, pc))
        lda, ldb, ldc = anb[1] // es, bnb[1] // es, n.nb[1] // 4
        nn = b.ne[1]
        ctype = 0  # CUDA_R_32F
        f16_out = tuning.GEMM_OUT.get() == "f16"
        if wt == T.F16 and f16_out and n.is_contiguous():
            # F16 results from cuBLAS, widened to F32 by one pass afterwards
            from accelplane.core.tensor import Tensor

            tmp = Tensor(T.F16, n.ne)
            cp16 = self._scratch(tmp.nbytes)
            calls = [(pa, pb, cp16 + (pc - int(self._ptr(n))) // 2) for pa, pb, pc in calls]
            ctype, ldc = 2, n.nb[1] // 4

        def step() -> None:
            cublas.setStream(handle, stream.ptr)
            for pa, pb, pc in calls:
                cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, m, nn, k,
                              alpha.ctypes.data, pa, dt, lda, pb, dt, ldb,
                              beta.ctypes.data, pc, ctype, ldc, cublas.CUBLAS_COMPUTE_32F,
                              cublas.CUBLAS_GEMM_DEFAULT)  # fmt: skip

        self.library_steps.add(len(self.steps))
        self.steps.append(step)
        if ctype == 2:
            self._elementwise_copy(tmp, n, sp=np.uint64(cp16))

    def _mul_mat_id(self, n) -> None:
        a, b, ids = n.src
        self.uses_index = True
        xp, xnb = self._x_f32(b)
        P = self._P([a.ne[1], a.ne[0], ids.ne[0], ids.ne[1], a.ne[2], b.ne[1], a.nb[1], a.nb[2],
                     xnb[1], xnb[2], n.nb[1], n.nb[2], ids.nb[0], ids.nb[1]])  # fmt: skip
        rows_per_block = 4
        grid = ((a.ne[1] + rows_per_block - 1) // rows_per_block, ids.ne[0] * ids.ne[1])
        self._launch(f"k_mul_mat_id<{type_id(a)}>", 0,
                     (P, self._ptr(n), self._ptr(a), xp, self._ptr(ids), self.sctx.err.ptr),
                     block=32 * rows_per_block, grid=grid)  # fmt: skip

    # --- replay -------------------------------------------------------------------------------------------
    def check_buffers(self) -> None:
        check_buffers(self.buffers.values())

    def run(self) -> None:
        self.check_buffers()
        cp = self.cp
        stream = self.sctx.stream
        with cp.cuda.Device(self.sctx.device), stream:
            if self.sctx.recording is not None:  # the backend's stream is being captured
                if self.library_steps:  # fail before queuing anything: the caller runs unrecorded
                    raise ComputeError("a graph with cuBLAS calls cannot be recorded (CuPy refuses "
                                       "cuBLAS during stream capture)")  # fmt: skip
                self.sctx.recording.append(self)  # (kept alive by the recording)
                for s in self.steps:
                    s()
                return
            if self.cuda_graph is not None:
                self.cuda_graph.launch(stream)
                return
            if self.segments is not None:
                for g, steps in self.segments:
                    if g is not None:
                        g.launch(stream)
                    else:
                        for s in steps:
                            s()
                return
            self.runs += 1
            # the first run is eager (it warms library handles and workspaces); from the second
            # on the graph is captured: whole if possible, else kernel runs between library calls
            if self.runs >= 2 and not self.graph_failed and self.steps:
                try:
                    self.cuda_graph = self._capture(stream, self.steps)
                except Exception as e:
                    self.graph_error = f"{type(e).__name__}: {e}"
                    self.cuda_graph = None
                    try:
                        self.segments = self._capture_segments(stream)
                    except Exception as e2:
                        self.graph_error += f"; segments: {type(e2).__name__}: {e2}"
                        self.segments = None
                        self.graph_failed = True
                if self.cuda_graph is not None:
                    self.cuda_graph.launch(stream)
                    return
                if self.segments is not None:
                    self.runs -= 1
                    return self.run()
            for s in self.steps:
                s()

    @staticmethod
    def _capture(stream, steps):
        stream.begin_capture()
        try:
            for s in steps:
                s()
        finally:
            g = stream.end_capture()
        return g

    def _capture_segments(self, stream) -> list:
        """Graphs of the kernel runs between library (cuBLAS) calls, which run eagerly."""
        out: list = []
        run: list = []
        for i, s in enumerate(self.steps):
            if i in self.library_steps:
                if run:
                    out.append((self._capture(stream, run), run))
                    run = []
                out.append((None, [s]))
            else:
                run.append(s)
        if run:
            out.append((self._capture(stream, run), run))
        return out
