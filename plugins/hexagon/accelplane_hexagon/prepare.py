"""Host side: a graph becomes, once, a list of op batches for the emulated NPU.

Like ggml's Hexagon host code: compute nodes are fused where that saves NPU work (RMS_NORM +
MUL; matmuls sharing their activations, e.g. Q/K/V or FFN gate/up), every op's kernel
parameters are computed here, and the ops are packed into batches of at most ``opbatch`` op
descriptors, each executed by one call into the NPU side. The result is cached per graph
(accelplane.runtime.plancache.PlanCache), so an unchanged graph is not prepared again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from accelplane.core.ops import ROPE_TYPE_NEOX, VIEW_OPS, GluOp, Op, UnaryOp, rope_yarn_corr_dims
from accelplane.core.tensor import Tensor, TensorFlag
from accelplane.core.types import GGMLType
from accelplane.errors import BufferFreedError, ComputeError, ConfigError
from accelplane.runtime.backend import Buffer

from . import npu, tuning
from .memory import HtpBuffer
from .support import is_repacked
from .tuning import Tuning

T = GGMLType
ALIGN = 128

_BINARY = {Op.ADD: "HTP_OP_ADD", Op.SUB: "HTP_OP_SUB", Op.MUL: "HTP_OP_MUL", Op.DIV: "HTP_OP_DIV"}
_ACT = {UnaryOp.SILU: "HTP_ACT_SILU", UnaryOp.GELU: "HTP_ACT_GELU", UnaryOp.SIGMOID: "HTP_ACT_SIGMOID",
        UnaryOp.NEG: "HTP_ACT_NEG", UnaryOp.EXP: "HTP_ACT_EXP", UnaryOp.TANH: "HTP_ACT_TANH"}  # fmt: skip
_GLU_ACT = {GluOp.SWIGLU: "HTP_ACT_SILU", GluOp.GEGLU: "HTP_ACT_GELU"}


@dataclass(frozen=True)
class Options:
    """Per-backend settings: ``init_backend`` params (``"opbatch=8,fusion=0,acc=fp32"``) over
    the plugin's settings (tuning.py: ACCELPLANE_HEXAGON_OPBATCH, _OPFUSION, _ACC)."""

    opbatch: int = 1024
    fusion: bool = True
    acc_f16: bool = True  # per-tile matmul accumulators in fp16 (the HVX kernels'), else fp32

    @classmethod
    def parse(cls, params: str = "", base: Tuning | None = None) -> Options:
        t = base or tuning.read()
        kv = {"opbatch": str(t.opbatch), "fusion": "1" if t.fusion else "0", "acc": t.acc}
        for item in filter(None, (p.strip() for p in params.split(","))):
            k, sep, v = (x.strip() for x in item.partition("="))
            if not sep or k not in kv:
                raise ConfigError(f"HTP backend params: {item!r} is not one of opbatch=N, fusion=0|1, "
                                  "acc=fp16|fp32")  # fmt: skip
            kv[k] = v
        if not kv["opbatch"].isdigit() or int(kv["opbatch"]) < 1:
            raise ConfigError(f"HTP: opbatch must be >= 1, got {kv['opbatch']}")
        if kv["fusion"].lower() not in ("0", "1", "true", "false", "on", "off", "yes", "no"):
            raise ConfigError(f"HTP: fusion must be 1 or 0, got {kv['fusion']!r}")
        if kv["acc"] not in ("fp16", "fp32"):
            raise ConfigError(f"HTP: acc must be fp16 or fp32, got {kv['acc']!r}")
        fusion = kv["fusion"].lower() in ("1", "true", "on", "yes")
        return cls(int(kv["opbatch"]), fusion, kv["acc"] == "fp16")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _name(t: Tensor) -> str:
    return repr(t.name) if t.name else f"#{t.uid} ({t.op.name if t.op else 'leaf'})"


# --- fusion -------------------------------------------------------------------------------------
def _span(t: Tensor) -> tuple[int, int, int]:
    return id(t.buffer), t.offs, t.offs + t.nbytes


def _overlap(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def _mm_kind(w: Tensor) -> str:
    return "q" if w.type in (T.Q4_0, T.Q8_0) else w.type.name


def _can_hoist(m: Tensor, between: list[Tensor]) -> bool:
    """Running matmul ``m`` before the nodes ``between`` changes nothing: none of them writes
    what m reads, and none reads or writes m's output memory (the allocator may have reused
    it for a tensor that is live in between)."""
    out = _span(m)
    reads = [_span(s) for s in m.src if s is not None]
    for k in between:
        w = _span(k)
        if _overlap(w, out) or any(_overlap(w, r) for r in reads):
            return False
        if any(s is not None and _overlap(_span(s), out) for s in k.src):
            return False
    return True


def _norm_mul(n: Tensor, m: Tensor, uses: dict[int, int]) -> bool:
    if m.op is not Op.MUL or m.type != T.F32 or uses.get(id(n), 0) != 1 or n.flags & TensorFlag.OUTPUT:
        return False
    a, b = m.src
    if a is n and b is n:  # the fused kernel reads the weight from memory the norm leaves unwritten
        return False
    if a is n:
        return b.type == T.F32
    return b is n and a.type == T.F32 and a.ne == n.ne


def fuse(graph, nodes: list[Tensor]) -> list[list[Tensor]]:
    """Compute nodes grouped into NPU ops: [rms_norm, mul], [mul_mat, mul_mat(, mul_mat)] or
    single nodes. A group runs at its first node's place."""
    uses: dict[int, int] = {}
    for n in graph.nodes:
        for s in {id(s) for s in n.src if s is not None} | ({id(n.view_src)} if n.view_src else set()):
            uses[s] = uses.get(s, 0) + 1
    groups: list[list[Tensor]] = []
    taken: set[int] = set()
    for i, n in enumerate(nodes):
        if id(n) in taken:
            continue
        if n.op is Op.RMS_NORM and i + 1 < len(nodes) and _norm_mul(n, nodes[i + 1], uses):
            groups.append([n, nodes[i + 1]])
            taken.add(id(nodes[i + 1]))
            continue
        group = [n]
        if n.op is Op.MUL_MAT:
            for j in range(i + 1, len(nodes)):
                m = nodes[j]
                if len(group) == 3:
                    break
                if (id(m) not in taken and m.op is Op.MUL_MAT and m.src[1] is n.src[1]
                        and _mm_kind(m.src[0]) == _mm_kind(n.src[0])
                        and _can_hoist(m, nodes[i + 1 : j])):  # fmt: skip
                    group.append(m)
                    taken.add(id(m))
        groups.append(group)
    return groups


def _partner(n: Tensor, m: Tensor) -> bool:
    return m.op is Op.MUL_MAT and m.src[1] is n.src[1] and _mm_kind(m.src[0]) == _mm_kind(n.src[0])


def reorder(graph) -> int:
    """graph_optimize: move MUL_MATs that share their activations next to the first of them
    (ggml's Hexagon backend does the same), where their sources are ready there, so that
    they fuse. Only before allocation: the allocator then plans memory for the new order
    (after it, moving nodes could break its reuse, so an allocated graph is left alone).
    Returns the number of nodes moved."""
    nodes = graph.nodes
    if any(n.buffer is not None and n.view_src is None for n in nodes if n.op not in VIEW_OPS):
        return 0
    moved = 0
    i = 0
    while i < len(nodes):
        n = nodes[i]
        end = i + 1
        if n.op is Op.MUL_MAT:
            while end < len(nodes) and end - i < 3 and _partner(n, nodes[end]):
                end += 1
            for j in range(end, len(nodes)):
                if end - i == 3:
                    break
                m = nodes[j]
                if _partner(n, m) and not any(id(k) in {id(s) for s in m.src if s is not None}
                                              for k in nodes[end:j]):  # fmt: skip
                    nodes.insert(end, nodes.pop(j))
                    end += 1
                    moved += 1
        i = end
    return moved


# --- batches ------------------------------------------------------------------------------------
class Batch:
    """One prepared request: cffi arrays of buffers, tensors and ops, and the VTCM scratch."""

    __slots__ = ("req", "rsp", "keep", "labels", "tensors")

    def __init__(self, ffi, lib, bufs: list[Buffer], tensors: list[Tensor], ops: list[dict],
                 vtcm: int) -> None:  # fmt: skip
        self.tensors = tensors
        self.labels = [o["label"] for o in ops]
        mems = [b.ctx.mem for b in bufs]  # kept alive with the batch (pointers into them)
        scratch = np.zeros(vtcm + ALIGN, np.uint8)
        shift = (-scratch.ctypes.data) % ALIGN
        c_bufs = ffi.new("htp_buf_desc[]", max(1, len(bufs)))
        for i, m in enumerate(mems):
            c_bufs[i].base = ffi.cast("uint8_t *", m.ctypes.data)
            c_bufs[i].size = m.size
        bidx = {id(b): i for i, b in enumerate(bufs)}
        c_tens = ffi.new("htp_tensor_desc[]", max(1, len(tensors)))
        for i, t in enumerate(tensors):
            d = c_tens[i]
            d.buf = bidx[id(t.buffer)]
            d.type = _htp_type(lib, t)
            d.offs = t.offs
            d.span = t.data_owner.extra.nbytes if is_repacked(t) else t.nbytes
            d.ne = list(t.ne)
            d.nb = list(t.nb)
        c_ops = ffi.new("htp_op_desc[]", max(1, len(ops)))
        for i, o in enumerate(ops):
            d = c_ops[i]
            d.opcode = getattr(lib, o["opcode"])
            d.n_src, d.n_dst = len(o["src"]), len(o["dst"])
            d.src = o["src"] + [-1] * (lib.HTP_MAX_SRC - len(o["src"]))
            d.dst = o["dst"] + [-1] * (lib.HTP_MAX_DST - len(o["dst"]))
            d.vtcm_need = o["vtcm"]
            for path, v in o["kp"].items():  # "mm.n_kt" -> d.kp.mm.n_kt
                group, name = path.split(".")
                setattr(getattr(d.kp, group), name, v)
        req = ffi.new("htp_batch_req *")
        req.n_bufs, req.n_tensors, req.n_ops = len(bufs), len(tensors), len(ops)
        req.bufs, req.tensors, req.ops = c_bufs, c_tens, c_ops
        req.vtcm = ffi.cast("uint8_t *", scratch.ctypes.data + shift)
        req.vtcm_size = vtcm
        self.req = req
        self.rsp = ffi.new("htp_batch_rsp *")
        self.keep: list[Any] = [mems, scratch, c_bufs, c_tens, c_ops]

    def execute(self, lib) -> None:
        lib.htp_batch_execute(self.req, self.rsp)
        if self.rsp.status != 0:
            if self.rsp.op >= 0:
                what = self.labels[self.rsp.op]
            else:
                what = f"tensor {_name(self.tensors[self.rsp.tensor])}"
            npu.check(self.rsp, what)


def _htp_type(lib, t: Tensor) -> int:
    if is_repacked(t):
        return lib.HTP_TYPE_Q4_0_TILED if t.type == T.Q4_0 else lib.HTP_TYPE_Q8_0_TILED
    return int(t.type)


class _Builder:
    """Collects the ops of one batch with their tensor and buffer tables."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.tidx: dict[int, int] = {}
        self.bufs: list[Buffer] = []
        self.bidx: dict[int, int] = {}
        self.ops: list[dict] = []
        self.vtcm = 0

    def tensor(self, t: Tensor) -> int:
        i = self.tidx.get(id(t))
        if i is None:
            i = self.tidx[id(t)] = len(self.tensors)
            self.tensors.append(t)
            if id(t.buffer) not in self.bidx:
                self.bidx[id(t.buffer)] = len(self.bufs)
                self.bufs.append(t.buffer)
        return i

    def add(self, opcode: str, src: list[Tensor], dst: list[Tensor], label: str,
            kp: dict | None = None, vtcm: int = 0) -> None:  # fmt: skip
        self.ops.append({"opcode": opcode, "src": [self.tensor(s) for s in src],
                         "dst": [self.tensor(d) for d in dst], "kp": kp or {}, "vtcm": vtcm,
                         "label": label})  # fmt: skip
        self.vtcm = max(self.vtcm, vtcm)


# --- kernel parameters, one function per op family ------------------------------------------
def _mm_params(x: Tensor, w: Tensor, n_mm: int, acc_f16: bool, n_acc_rows: int, n_hits: int,
               xrows: int) -> tuple[dict, int]:  # fmt: skip
    K = x.ne[0]
    n_kt = K // 32
    quant = w.type in (T.Q4_0, T.Q8_0)
    row_bytes = _align(K + 2 * n_kt) if quant else 4 * K
    n_rows = x.ne[1] * x.ne[2] * x.ne[3]
    q_offs = 0
    acc_offs = _align(q_offs + n_rows * row_bytes)
    tile_offs = _align(acc_offs + min(n_acc_rows, xrows) * 128)
    hits_offs = _align(tile_offs + max(1088, 4 * K))
    need = _align(hits_offs + 8 * n_hits)
    kp = {"mm.n_mm": n_mm, "mm.acc_f16": int(acc_f16), "mm.n_kt": n_kt, "mm.q_row_bytes": row_bytes,
          "mm.q_offs": q_offs, "mm.acc_offs": acc_offs, "mm.tile_offs": tile_offs,
          "mm.hits_offs": hits_offs}  # fmt: skip
    return kp, need


def _rope_params(t: Tensor) -> dict:
    (_, n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor,
     beta_fast, beta_slow) = t.op_params[:10]  # fmt: skip
    if n_ctx_orig > 0:
        corr0, corr1 = rope_yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
    else:  # ggml's log(0) case: an empty correction range
        corr0, corr1 = 0.0, -math.inf
    mscale = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale)) if ext_factor != 0 else attn_factor
    return {"rope.theta_scale": freq_base ** (-2.0 / n_dims), "rope.freq_scale": freq_scale,
            "rope.ext_factor": ext_factor, "rope.mscale": mscale, "rope.corr0": corr0,
            "rope.corr1": corr1, "rope.n_dims": n_dims, "rope.neox": int(mode == ROPE_TYPE_NEOX)}  # fmt: skip


def _softmax_params(t: Tensor) -> dict:
    scale, max_bias = t.op_params[0], t.op_params[1]
    n_head = t.src[0].ne[2]
    n_log2 = 1 << int(math.floor(math.log2(n_head)))
    return {"softmax.scale": scale, "softmax.max_bias": max_bias,
            "softmax.m0": 2.0 ** (-max_bias / n_log2), "softmax.m1": 2.0 ** (-(max_bias / 2.0) / n_log2),
            "softmax.n_head_log2": n_log2}  # fmt: skip


def _emit(b: _Builder, group: list[Tensor], opts: Options, lib) -> None:
    n = group[0]
    op = n.op
    label = f"{op.name} {_name(n)}"
    if op is Op.RMS_NORM and len(group) == 2:
        m = group[1]
        w = m.src[1] if m.src[0] is n else m.src[0]
        eps = {"norm.eps": n.op_params[0]}
        b.add("HTP_OP_RMS_NORM_MUL", [n.src[0], w], [m], f"RMS_NORM+MUL {_name(m)}", eps)
    elif op in _BINARY:
        b.add(_BINARY[op], [n.src[0], n.src[1]], [n], label)
    elif op is Op.SCALE:
        kp = {"scale.scale": n.op_params[0], "scale.bias": n.op_params[1]}
        b.add("HTP_OP_SCALE", [n.src[0]], [n], label, kp)
    elif op is Op.UNARY:
        act = getattr(lib, _ACT[UnaryOp(n.op_params[0])])
        b.add("HTP_OP_UNARY", [n.src[0]], [n], label, {"act.act": act})
    elif op is Op.GLU:
        a, g = n.src
        kp = {"act.act": getattr(lib, _GLU_ACT[GluOp(n.op_params[0])]), "act.swapped": int(n.op_params[1]),
              "act.split": int(g is None)}  # fmt: skip
        b.add("HTP_OP_GLU", [a] if g is None else [a, g], [n], label, kp)
    elif op in (Op.NORM, Op.RMS_NORM):
        code = "HTP_OP_NORM" if op is Op.NORM else "HTP_OP_RMS_NORM"
        b.add(code, [n.src[0]], [n], label, {"norm.eps": n.op_params[0]})
    elif op is Op.SOFT_MAX:
        a, mask = n.src
        b.add("HTP_OP_SOFT_MAX", [a] if mask is None else [a, mask], [n], label, _softmax_params(n))
    elif op is Op.ROPE:
        b.add("HTP_OP_ROPE", [n.src[0], n.src[1]], [n], label, _rope_params(n), 8 * (n.op_params[1] // 2))
    elif op is Op.GET_ROWS:
        b.add("HTP_OP_GET_ROWS", [n.src[0], n.src[1]], [n], label)
    elif op is Op.SET_ROWS:
        b.add("HTP_OP_SET_ROWS", [n.src[1], n.src[2]], [n], label)
    elif op in (Op.CPY, Op.CONT, Op.DUP):
        b.add("HTP_OP_CPY", [n.src[0]], [n], label)
    elif op is Op.MUL_MAT:
        x = n.src[1]
        kp, need = _mm_params(x, n.src[0], len(group), opts.acc_f16, x.ne[1], 0, lib.HTP_MM_XROWS)
        if len(group) > 1:
            label = f"MUL_MAT x{len(group)} " + ", ".join(_name(m) for m in group)
        b.add("HTP_OP_MUL_MAT", [x] + [m.src[0] for m in group], list(group), label, kp, need)
    elif op is Op.MUL_MAT_ID:
        w, x, ids = n.src
        hits = ids.ne[0] * ids.ne[1]
        kp, need = _mm_params(x, w, 1, opts.acc_f16, hits, hits, lib.HTP_MM_XROWS)
        b.add("HTP_OP_MUL_MAT_ID", [x, w, ids], [n], label, kp, need)
    else:  # supports_op said no: the caller's graph should not be here
        raise ComputeError(f"HTP: op {op.name} ({_name(n)}) is not supported on this device")


@dataclass
class Prepared:
    """A graph ready to run: its batches, the buffers they use, and what preparation did."""

    batches: list[Batch]
    buffers: list[Buffer]
    n_ops: int = 0  # NPU op descriptors
    fused: dict[str, int] = field(default_factory=dict)  # kind -> groups fused

    def run(self) -> int:
        """Execute every batch in order; returns the number of NPU calls made."""
        for b in self.buffers:
            if b.freed:
                raise BufferFreedError(f"a graph computed on HTP uses freed buffer {b.name!r}")
        _, lib = npu.load()
        for batch in self.batches:
            batch.execute(lib)
        return len(self.batches)


def prepare(graph, opts: Options) -> Prepared:
    """Turn ``graph`` into batches (see the module docstring)."""
    ffi, lib = npu.load()
    nodes = [n for n in graph.nodes if n.op not in VIEW_OPS]
    bufs: dict[int, Buffer] = {}
    for n in nodes:
        for t in (n, *n.src):
            if t is None:
                continue
            if t.buffer is None:
                raise ComputeError(f"HTP: {n.op.name} {_name(n)}: tensor {_name(t)} is not allocated")
            if t.buffer.freed:
                raise BufferFreedError(f"HTP: {n.op.name} {_name(n)}: tensor {_name(t)}'s buffer was freed")
            if not isinstance(t.buffer.ctx, HtpBuffer):
                raise ComputeError(f"HTP: {n.op.name} {_name(n)}: tensor {_name(t)} is in buffer "
                                   f"{t.buffer.name!r}, not in an HTP buffer")  # fmt: skip
            bufs[id(t.buffer)] = t.buffer
    groups = fuse(graph, nodes) if opts.fusion else [[n] for n in nodes]
    batches: list[Batch] = []
    fused: dict[str, int] = {}
    b = _Builder()
    for g in groups:
        _emit(b, g, opts, lib)
        if len(g) > 1:
            kind = "rms_norm_mul" if g[0].op is Op.RMS_NORM else f"mul_mat_x{len(g)}"
            fused[kind] = fused.get(kind, 0) + 1
        if len(b.ops) == opts.opbatch:
            batches.append(Batch(ffi, lib, b.bufs, b.tensors, b.ops, b.vtcm))
            b = _Builder()
    if b.ops:
        batches.append(Batch(ffi, lib, b.bufs, b.tensors, b.ops, b.vtcm))
    return Prepared(batches, list(bufs.values()), len(groups), fused)
