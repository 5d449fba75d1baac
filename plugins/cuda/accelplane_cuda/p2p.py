"""One-shot all-reduce of small F32 tensors through peer memory, for the CUDA comm (nccl.py).

A tensor-split decode token all-reduces two 16 KiB activations per layer. NCCL takes ~20 µs
for that on two NVLink-linked H200s, mostly fixed latency; here each GPU runs one kernel
(kernels/allreduce.cu: ``k_allreduce_p2p``) that pushes its term into every peer's memory, raises a flag
there, waits for the peers' flags and sums the terms in rank order, so every GPU ends with the
same bits. No host work per call, and the kernel records into a CUDA graph like any other.

Serves contiguous F32 tensors of a multiple of 4 elements at 16-byte aligned addresses, up to
``ACCELPLANE_CUDA_P2P_MAX`` bytes (default 1 MiB; 0 turns the path off); the rest goes to
NCCL. Needs peer access between every pair of the 2 to 8 GPUs (``cudaDeviceCanAccessPeer``).
A peer that never arrives raises CommTimeoutError at the next synchronize (after ~10 s) instead
of hanging; the communicator is unusable after that.
"""

from __future__ import annotations

import numpy as np
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType

from . import compiler

AR_MAXB = 64  # blocks per launch at most (kernels/allreduce.cu: the flags and counters per block)
THREADS = 256
MAX_RANKS = 8  # the kernel is compiled for 2 to this many GPUs
_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled

FAMILY = compiler.family("allreduce", {"k_allreduce_p2p": compiler.product(range(2, MAX_RANKS + 1))},
                         defines={"AR_MAXB": AR_MAXB})  # fmt: skip


def peer_access(devices: list[int]) -> str:
    """Enable peer access between every pair of ``devices``; "" when done, else why not."""
    import cupy as cp

    if not 2 <= len(devices) <= MAX_RANKS:
        return f"{len(devices)} GPUs (the kernel serves 2 to {MAX_RANKS})"
    rt = cp.cuda.runtime
    for d in devices:
        for p in devices:
            if p == d:
                continue
            if not rt.deviceCanAccessPeer(d, p):
                return f"CUDA{d} cannot access CUDA{p}'s memory"
            with cp.cuda.Device(d):
                try:
                    rt.deviceEnablePeerAccess(p)
                except rt.CUDARuntimeError as e:
                    if e.status != _ALREADY_ENABLED:
                        return f"enabling peer access CUDA{d} -> CUDA{p}: {e}"
    return ""


class PeerAllReduce:
    """The receive slots, flags and counters of every GPU, and the prepared launches (``pdl``:
    with programmatic dependent launch where the GPU has it, launch.py)."""

    def __init__(self, devices: list[int], limit: int, pdl: bool) -> None:
        import cupy as cp

        self.devices = devices
        self.pdl = pdl
        nr = len(devices)
        self.cap = limit // 16 * 4  # floats per receive slot, a multiple of 4
        size = 2 * nr * self.cap * 4 + AR_MAXB * nr * 4 + AR_MAXB * 4
        self.mem = []
        for d in devices:
            with cp.cuda.Device(d):
                m = cp.cuda.Memory(size)
                cp.cuda.runtime.memset(m.ptr, 0, size)
                cp.cuda.runtime.deviceSynchronize()
            self.mem.append(m)
        self.bases = [int(m.ptr) for m in self.mem]
        self.name = compiler.name("k_allreduce_p2p", nr)
        for d in devices:  # compiled now, not on a first all-reduce inside a stream capture
            compiler.device(d).prepare(self.name)
        self._launches: dict = {}  # (rank, address, elements) -> (Launch, its parameter array)

    def serves(self, tensors: list[Tensor]) -> bool:
        t = tensors[0]
        if t.type != GGMLType.F32 or t.nelements % 4 or t.nelements > self.cap:
            return False
        return all(x.is_contiguous() and (x.buffer.ctx.ptr + x.offs) % 16 == 0 for x in tensors)

    def allreduce(self, backends, tensors: list[Tensor]) -> None:
        import cupy as cp

        for rank, (b, t) in enumerate(zip(backends, tensors, strict=True)):
            with cp.cuda.Device(b.ctx.device):
                self._launch(rank, b, t)()
            b.ctx.check_err = True  # a peer that never arrived shows at synchronize

    def _launch(self, rank: int, b, t: Tensor):
        ptr = t.buffer.ctx.ptr + t.offs
        key = (rank, ptr, t.nelements, b.ctx.stream.ptr)
        got = self._launches.get(key)
        if got is None:
            import cupy as cp

            from .launch import Launch, pdl_wanted

            fns = compiler.device(b.ctx.device)
            n4 = t.nelements // 4
            P = cp.asarray(np.asarray([n4, rank, self.cap, *self.bases], np.int64))
            grid = max(1, min(AR_MAXB, -(-n4 // THREADS)))
            name = self.name
            args = (np.uint64(P.data.ptr), np.uint64(ptr), b.ctx.err.ptr)
            launch = Launch(name, fns[name], (grid,), (THREADS,), 0, b.ctx.stream.ptr, args,
                            pdl_wanted(fns.cc, self.pdl))  # fmt: skip
            cp.cuda.runtime.deviceSynchronize()  # the parameter upload, before any launch reads it
            got = self._launches[key] = (launch, P)
        return got[0]

    def free(self) -> None:
        self._launches.clear()
        self.mem = []
