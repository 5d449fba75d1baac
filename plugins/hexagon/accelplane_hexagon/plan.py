"""Host side: a graph becomes, once, a list of op batches for the emulated NPU.

Like ggml's Hexagon host code: compute nodes are fused where that saves NPU work (fusion.py),
every op's kernel parameters are computed here (kernels.py), and the ops are packed into
batches of at most ``opbatch`` op descriptors, each executed by one call into the NPU side.
The result is cached per graph (accelplane.plancache.PlanCache), so an unchanged graph is not
prepared again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from accelplane.core.ops import VIEW_OPS, Op
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType
from accelplane.errors import ComputeError
from accelplane.runtime.backend import Buffer

from . import npu
from .fusion import fuse
from .kernels import emit, label
from .runtime import ALIGNMENT, HtpBuffer, Options
from .support import is_repacked

T = GGMLType


class Batch:
    """One prepared request: cffi arrays of buffers, tensors and ops, and the VTCM scratch."""

    __slots__ = ("req", "rsp", "keep", "labels", "tensors")

    def __init__(self, ffi, lib, bufs: list[Buffer], tensors: list[Tensor], ops: list[dict],
                 vtcm: int) -> None:  # fmt: skip
        self.tensors = tensors
        self.labels = [o["label"] for o in ops]
        mems = [b.ctx.mem for b in bufs]  # kept alive with the batch (pointers into them)
        scratch = np.zeros(vtcm + ALIGNMENT, np.uint8)
        shift = (-scratch.ctypes.data) % ALIGNMENT
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
                what = f"tensor {label(self.tensors[self.rsp.tensor])}"
            npu.check(self.rsp, what)


def _htp_type(lib, t: Tensor) -> int:
    if is_repacked(t):
        return lib.HTP_TYPE_Q4_0_TILED if t.type == T.Q4_0 else lib.HTP_TYPE_Q8_0_TILED
    return int(t.type)


class Builder:
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

    def add(self, opcode: str, src: list[Tensor], dst: list[Tensor], what: str,
            kp: dict | None = None, vtcm: int = 0) -> None:  # fmt: skip
        self.ops.append({"opcode": opcode, "src": [self.tensor(s) for s in src],
                         "dst": [self.tensor(d) for d in dst], "kp": kp or {}, "vtcm": vtcm,
                         "label": what})  # fmt: skip
        self.vtcm = max(self.vtcm, vtcm)


@dataclass
class Prepared:
    """A graph ready to run: its batches, the buffers they use, and what preparation did."""

    batches: list[Batch]
    buffers: list[Buffer]
    n_ops: int = 0  # NPU op descriptors
    fused: dict[str, int] = field(default_factory=dict)  # kind -> groups fused

    def run(self) -> int:
        """Execute every batch in order; returns the number of NPU calls made."""
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
                raise ComputeError(f"HTP: {n.op.name} {label(n)}: tensor {label(t)} is not allocated")
            if not isinstance(t.buffer.ctx, HtpBuffer):
                raise ComputeError(f"HTP: {n.op.name} {label(n)}: tensor {label(t)} is in buffer "
                                   f"{t.buffer.name!r}, not in an HTP buffer")  # fmt: skip
            bufs[id(t.buffer)] = t.buffer
    groups = fuse(graph, nodes) if opts.fusion else [[n] for n in nodes]
    batches: list[Batch] = []
    fused: dict[str, int] = {}
    b = Builder()
    for g in groups:
        emit(b, g, opts, lib)
        if len(g) > 1:
            kind = "rms_norm_mul" if g[0].op is Op.RMS_NORM else f"mul_mat_x{len(g)}"
            fused[kind] = fused.get(kind, 0) + 1
        if len(b.ops) == opts.opbatch:
            batches.append(Batch(ffi, lib, b.bufs, b.tensors, b.ops, b.vtcm))
            b = Builder()
    if b.ops:
        batches.append(Batch(ffi, lib, b.bufs, b.tensors, b.ops, b.vtcm))
    return Prepared(batches, list(bufs.values()), len(groups), fused)
