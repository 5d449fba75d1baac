"""The CUDA plugin's comm hooks: NCCL all-reduce, with small F32 tensors through peer memory.

A communicator needs two or more backends on distinct CUDA devices (NCCL allows one rank per
GPU); otherwise, or with ACCELPLANE_CUDA_ALLREDUCE=none, comm_init returns None and the SDK's
fallback serves. With peer access between the GPUs, small F32 tensors (up to
ACCELPLANE_CUDA_P2P_MAX bytes) are summed by one kernel per GPU over peer memory (p2p.py);
ACCELPLANE_CUDA_ALLREDUCE=nccl sends everything through NCCL. In NCCL, F32 tensors are reduced
in F32 in place; from a size threshold on (32768 elements for 2 devices, 131072 for 3, 262144
for 4 or more; ACCELPLANE_CUDA_NCCL_BF16_MIN overrides, in elements, 0 = never) they travel as
BF16, are summed in BF16 by NCCL and are widened back to F32: half the bytes for a bounded loss
of precision.

NCCL stays off NVLink multicast (``NCCL_NVLS_ENABLE=0`` while a communicator is made, unless the
user set it): on shared hosts multicast can take the GPUs out of service. The process
environment is restored afterwards.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType

from . import compiler, rows, tuning
from .p2p import PeerAllReduce, peer_access

_DTYPE = {GGMLType.F32: 7, GGMLType.F16: 6, GGMLType.BF16: 9}  # ncclFloat32, ncclFloat16, ncclBfloat16
_SUM = 0
_WIRE = (GGMLType.BF16, GGMLType.F32)  # compressed all-reduces: F32 tensors travel as BF16
_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}  # set while a communicator is made, where the user has not


@contextlib.contextmanager
def _env_defaults(values: dict[str, str]):
    """``values`` in the process environment where unset, for the block only."""
    added = [k for k in values if k not in os.environ]
    os.environ.update({k: values[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


class NcclComm:
    """An NCCL communicator over ``devices`` (one rank each); ``bf16_min``: elements from which
    F32 tensors travel as BF16 (None: the default for the GPU count; 0: never)."""

    def __init__(self, devices: list[int], p2p: PeerAllReduce | None = None, p2p_why: str = "",
                 bf16_min: int | None = None) -> None:  # fmt: skip
        from cupy.cuda import nccl

        self.nccl = nccl
        self.devices = devices
        self.p2p = p2p
        self.p2p_why = p2p_why  # why small tensors go through NCCL too, if they do (diagnostics)
        with _env_defaults(_NCCL_ENV):  # NCCL reads it when the communicator is made
            self.comms = nccl.NcclCommunicator.initAll(devices)
        default = {2: 32768, 3: 131072}.get(len(devices), 262144)
        self.bf16_min = default if bf16_min is None else bf16_min
        for d in devices:  # compiled now, not on a first all-reduce inside a stream capture
            compiler.device(d).prepare(rows.convert_name(*_WIRE), rows.convert_name(*_WIRE[::-1]))
        self._bf16_bufs: dict = {}  # (device, elements) -> (pointer, memory): the wire copy
        self._args: dict = {}  # (device, elements) -> the conversion kernel's arguments

    def allreduce(self, backends, tensors) -> bool:
        import cupy as cp

        t0 = tensors[0]
        if self.p2p is not None and self.p2p.serves(tensors):
            self.p2p.allreduce(backends, tensors)
            return True
        if t0.type not in _DTYPE or not all(t.is_contiguous() for t in tensors):
            return False
        compress = t0.type == GGMLType.F32 and self.bf16_min > 0 and t0.nelements >= self.bf16_min
        nccl = self.nccl
        count = t0.nelements
        if compress:
            bufs = []
            for b, t in zip(backends, tensors, strict=True):
                tmp = self._bf16(b.ctx.device, t)
                self._convert(compiler.device(b.ctx.device), b, t, tmp, to_bf16=True)
                bufs.append(tmp)
        nccl.groupStart()
        try:
            for i, (comm, b, t) in enumerate(zip(self.comms, backends, tensors, strict=True)):
                with cp.cuda.Device(b.ctx.device):
                    if compress:
                        ptr = bufs[i][0]
                        comm.allReduce(ptr, ptr, count, _DTYPE[GGMLType.BF16], _SUM, b.ctx.stream.ptr)
                    else:
                        ptr = t.buffer.ctx.ptr + t.offs
                        comm.allReduce(ptr, ptr, count, _DTYPE[t.type], _SUM, b.ctx.stream.ptr)
        finally:
            nccl.groupEnd()
        if compress:
            for b, t, tmp in zip(backends, tensors, bufs, strict=True):
                self._convert(compiler.device(b.ctx.device), b, t, tmp, to_bf16=False)
        return True

    def _bf16(self, device: int, t: Tensor):
        import cupy as cp

        key = (device, t.nelements)
        if key not in self._bf16_bufs:
            with cp.cuda.Device(device):
                mem = cp.cuda.Memory(t.nelements * 2)
            self._bf16_bufs[key] = (int(mem.ptr), mem)
        return self._bf16_bufs[key]

    def _convert(self, fns, b, t: Tensor, tmp, to_bf16: bool) -> None:
        """t (contiguous F32) ↔ the BF16 scratch, on b's stream (k_convert: no index math)."""
        import cupy as cp

        n = t.nelements
        key = (b.ctx.device, n)
        P = self._args.get(key)
        if P is None:  # the kernel's argument stays on the device: no copy, no sync per call
            with cp.cuda.Device(b.ctx.device):
                P = self._args[key] = cp.asarray(np.asarray([n], np.int64))
        tp, bp = t.buffer.ctx.ptr + t.offs, tmp[0]
        sp, dp = (tp, bp) if to_bf16 else (bp, tp)
        name = rows.convert_name(*(_WIRE if to_bf16 else _WIRE[::-1]))
        with cp.cuda.Device(b.ctx.device), b.ctx.stream:
            fns[name]((max(1, min((n + 255) // 256, 65535)),), (256,),
                      (np.uint64(P.data.ptr), np.uint64(dp), np.uint64(sp)))  # fmt: skip

    def free(self) -> None:
        if self.p2p is not None:
            self.p2p.free()
            self.p2p = None
        for c in self.comms:
            c.destroy()
        self.comms = []
        self._bf16_bufs.clear()
        self._args.clear()


def init(backends) -> NcclComm | None:
    from .runtime import StreamCtx

    settings = tuning.read()
    mode = settings.allreduce
    if mode == "none":
        return None
    if len(backends) < 2 or not all(isinstance(b.ctx, StreamCtx) for b in backends):
        return None
    devices = [b.ctx.device for b in backends]
    if len(set(devices)) != len(devices):
        return None  # NCCL takes one rank per GPU
    limit = settings.p2p_max if mode == "auto" else 0
    why = peer_access(devices) if limit >= 16 else f"off (ACCELPLANE_CUDA_ALLREDUCE={mode}, P2P_MAX={limit})"
    p2p = None if why else PeerAllReduce(devices, limit, settings.pdl)
    try:
        return NcclComm(devices, p2p, why, settings.nccl_bf16_min)
    except Exception as e:  # NCCL missing or failing: the SDK fallback serves, loudly
        import warnings

        warnings.warn(f"NCCL communicator over CUDA{devices} failed ({e}); using the SDK all-reduce",
                      stacklevel=2)  # fmt: skip
        return None
