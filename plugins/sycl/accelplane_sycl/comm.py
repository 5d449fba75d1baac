"""All-reduce over exactly two SYCL devices (the comm extension); anything else is left to the
SDK's fallbacks (comm_init returns None, comm_allreduce_tensor returns False).

One call, for contiguous F32 tensors x0 on rank 0 and x1 on rank 1, queued on both backends'
in-order queues with no host synchronization:

- below BF16_MIN_ELEMENTS: each rank sends its F32 tensor into the peer's inbox and adds it
  there (x_r += inbox_r);
- at or above it: each rank compresses x_r to BF16 in its outbox (rounding its own x_r to BF16
  too, so both ranks add the same operands and end with the same bits), sends the outbox (half
  the bytes) into the peer's inbox, which the peer widens and adds.

The devices have separate SYCL contexts, where a USM pointer of one is invalid in the other, so
a send is a device→host copy on the sender's queue into the sender's staging memory and a
host→device copy on the receiver's queue that waits (device-side barrier) for it. Each device
has one persistent scratch allocation of 4 × nelem bytes (F32 inbox, or BF16 outbox + inbox),
grown when a larger tensor comes; a staging buffer is reused once the peer's read of the last
call has completed (an event the sender's queue waits on).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from accelplane.core.types import GGMLType

BF16_MIN_ELEMENTS = 32768


def init(backends) -> SyclComm | None:
    from .stream import Stream

    if len(backends) != 2 or not all(isinstance(b.ctx, Stream) for b in backends):
        return None
    if backends[0].ctx.dev is backends[1].ctx.dev:
        return None  # one device: nothing to reduce across
    return SyclComm([b.ctx for b in backends])


class SyclComm:
    def __init__(self, streams: list[Any]) -> None:
        self.bs = streams
        self.cap = 0  # elements the scratch holds
        self.scratch: list[Any] = [None, None]  # UsmBuffer per rank
        self.stage: list[np.ndarray | None] = [None, None]  # host memory rank r sends through
        self.stage_free: list[Any] = [None, None]  # event: the peer has read stage[r]
        self.wire_bytes = 0  # bytes each rank sent in the last call

    def _fits(self, tensors) -> bool:
        for bs, t in zip(self.bs, tensors, strict=True):
            u = t.buffer.ctx if t.buffer is not None else None
            if t.type != GGMLType.F32 or not t.is_contiguous() or getattr(u, "dev", None) is not bs.dev:
                return False
        return True

    def _grow(self, n: int) -> None:
        if n <= self.cap:
            return
        for r, bs in enumerate(self.bs):
            if self.scratch[r] is not None:
                bs.retire([self.scratch[r]])  # queued work may still use it
                bs.keep(self.stage[r])
                self.bs[1 - r].keep(self.stage[r])
            self.scratch[r] = bs.dev.alloc(4 * n, host=False)
            self.stage[r] = np.empty(4 * n, np.uint8)
            self.stage_free[r] = None
        self.cap = n

    def allreduce(self, tensors) -> bool:
        if len(tensors) != 2 or not self._fits(tensors):
            return False
        n = tensors[0].nelements
        if n == 0:
            return True
        self._grow(n)
        bf16 = n >= BF16_MIN_ELEMENTS
        wire = (2 if bf16 else 4) * n
        sent = []
        for r, (bs, x) in enumerate(zip(self.bs, tensors, strict=True)):
            q, xm, xo = bs.queue, x.buffer.ctx.mem, ctypes.c_uint64(x.offs)
            if self.stage_free[r] is not None:
                q.submit_barrier([self.stage_free[r]])
            if bf16:
                out = self.scratch[r]
                args = [out.mem, ctypes.c_uint64(0), xm, xo, ctypes.c_int(1)]  # round own x to BF16 too
                q.submit_async(bs.dev.kernel("k_to_bf16"), args, [n])
                src = out.at(0, wire, q)
            else:
                src = x.buffer.ctx.at(x.offs, wire, q)
            sent.append(q.memcpy_async(self.stage[r][:wire], src, wire))
        for r, (bs, x) in enumerate(zip(self.bs, tensors, strict=True)):
            q, p = bs.queue, 1 - r
            inbox = 2 * n if bf16 else 0
            q.submit_barrier([sent[p]])
            dst = self.scratch[r].at(inbox, wire, q)
            self.stage_free[p] = q.memcpy_async(dst, self.stage[p][:wire], wire)
            args = [x.buffer.ctx.mem, ctypes.c_uint64(x.offs), self.scratch[r].mem, ctypes.c_uint64(inbox)]
            bs.last = q.submit_async(bs.dev.kernel("k_add_bf16" if bf16 else "k_add_f32"), args, [n])
        self.wire_bytes = wire
        return True

    def free(self) -> None:
        for bs in self.bs:
            bs.sync(check=False)  # the one wait: nothing queued may still use the scratch
        for s in self.scratch:
            if s is not None:
                s.release()
        self.scratch = [None, None]
        self.stage = [None, None]
        self.stage_free = [None, None]
        self.cap = 0
        for bs in self.bs:  # a wait for the queues: what their index kernels reported, once freed
            bs.raise_errors()
