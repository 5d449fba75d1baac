"""Experts in host memory, computed on a device: the scheduler's uploads of MUL_MAT_ID weights.

A MUL_MAT_ID whose expert weights live in a host weights buffer (llama.cpp's ``--cpu-moe``)
and whose node runs on a device reads a copy of them in device memory. These copies do not
get a place of their own in the split graphs' memory, which would hold every layer's experts
at once: they share a pool of *slots* per device, each the size of the largest such tensor.
The i-th expert input of a compute (in split order, per device) takes slot i mod S, where S is
the most expert inputs one split reads plus the prefetch depth, so a split's inputs never share
a slot, and neither do the inputs being prefetched and those of the split computing meanwhile.

In place: a device whose kernels read its own pinned host memory (``caps.host_reads``, CUDA's
unified addressing) reads a batch's experts where they are when the batch selects few of them
(:data:`IN_PLACE_SHARE`: a decode's): each selected expert crosses the link once either way,
and reading in place needs no host synchronization to learn the ids and no copy calls, so the
device's products queue like any other node (:func:`reads_in_place`).

Uploads: the ids are computed first (the split that reads the experts starts where they are
known), then only the experts they select are copied, in runs of consecutive experts, on the
split's own stream: the host waits once per compute for each ids tensor (a layer's products
share one), and the copies wait for nothing, queued behind every split that read their slot
before. With prefetch (``Scheduler(prefetch_experts=N)``), while split k computes,
the next N expert inputs whose batch uses nearly every expert (a prefill's: :data:`PREFETCH_SHARE`)
are copied whole on a second stream of the device, each after the split that last used its slot
has finished with it (an event recorded after that split, waited on by the copy stream), and
the split that reads it waits for the copy (an event), all device-side.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from accelplane.runtime.backend import Backend, BufferType, BufferUsage, Event, tensor_copy_async

if TYPE_CHECKING:
    from accelplane.core.tensor import Tensor
    from accelplane.runtime.backend import Device
    from accelplane.sched.scheduler import Scheduler, Split, SplitInput, _Plan

PREFETCH_SHARE = 0.9  # prefetch whole tensors only where this share of the experts is expected in use
IN_PLACE_SHARE = 0.25  # read in place while a batch's selections number at most this share of the experts


@dataclass
class ExpertSlots:
    """A plan's expert inputs on each device: slot per input, the split each input is read
    by, and the slots' count and size per device."""

    slot: dict[int, int] = field(default_factory=dict)  # id(SplitInput) -> slot
    ordinal: dict[int, int] = field(default_factory=dict)  # id(SplitInput) -> index among its device's
    split_of: dict[int, list[int]] = field(default_factory=dict)  # backend -> split index per ordinal
    n_slots: dict[int, int] = field(default_factory=dict)  # backend -> slots
    slot_bytes: dict[int, int] = field(default_factory=dict)  # backend -> bytes per slot
    pools: tuple[int, ...] = ()  # uids of the pool buffers the copies were placed in
    # every expert input on a device with events and its split's index, in split order: what
    # prefetch scans (a decode whose experts the CPU computes has none); built on first use
    scan: list[SplitInput] | None = None
    scan_split: list[int] = field(default_factory=list)


def is_expert_input(inp: SplitInput) -> bool:
    return inp.moe_ids is not None and not inp.user_input


def reads_in_place(device: Device, weights: Tensor, ids: Tensor) -> bool:
    """Whether ``device`` reads MUL_MAT_ID expert ``weights`` in a host weights buffer where
    they are (its own host buffer type, which its kernels reach: ``caps.host_reads``) for the
    selections ``ids`` holds: at most :data:`IN_PLACE_SHARE` of the experts, so that an upload
    would move about as many bytes over the link."""
    owner = weights.view_src or weights
    buf = owner.buffer
    return (device.caps.host_reads and buf is not None and buf.is_host and buf.buft is device.host_buffer_type
            and ids.nelements <= IN_PLACE_SHARE * weights.ne[2])  # fmt: skip


def expected_share(inp: SplitInput) -> float:
    """The share of the experts a batch of ``inp``'s ids is expected to use (each selection
    uniform and independent: 1 - (1 - 1/E)^selections)."""
    n_exp = inp.src.ne[2]
    return 1.0 - (1.0 - 1.0 / n_exp) ** inp.moe_ids.nelements


class _Pool:
    """``count`` slots of ``stride`` bytes in buffers of ``buft``, as many per buffer as its
    max size allows."""

    def __init__(self, buft: BufferType, nbytes: int, count: int) -> None:
        self.stride = -(-nbytes // buft.alignment) * buft.alignment
        self.count = count
        self.per_buf = max(1, min(count, buft.max_size // self.stride))
        sizes = [min(self.per_buf, count - i) * self.stride for i in range(0, count, self.per_buf)]
        self.buffers = [buft.alloc(n, BufferUsage.COMPUTE) for n in sizes]
        self.uid = self.buffers[0].uid

    def place(self, t: Tensor, slot: int) -> None:
        self.buffers[slot // self.per_buf].place(t, slot % self.per_buf * self.stride)

    def free(self) -> None:
        for b in self.buffers:
            b.free()


class ExpertUploads:
    """The slot pools, slot events and uploads of one scheduler (module docstring)."""

    def __init__(self, sched: Scheduler) -> None:
        self.s = sched
        self.pools: dict[int, _Pool] = {}  # backend -> its slots (n_copies x slots)
        # (backend, copy, slot) -> recorded after the split that last read the slot
        self.free_events: dict[tuple[int, int, int], Event] = {}
        self.pf_backends: dict[int, Backend] = {}  # backend -> its prefetch stream
        self.ready: dict[int, Event] = {}  # id(SplitInput) -> recorded after its prefetch copy
        # this compute's prefetched inputs not yet read: id(SplitInput) -> (copy done, reader's backend)
        self.pending: dict[int, tuple[Event, int]] = {}
        self.ids: dict[int, np.ndarray] = {}  # id(ids tensor) -> its values in this compute

    # --- planning and placement ---------------------------------------------------------------------
    def plan(self, splits: list[Split]) -> ExpertSlots:
        es = ExpertSlots()
        most: dict[int, int] = {}
        for k, sp in enumerate(splits):
            mine = [i for i in sp.inputs if is_expert_input(i)]
            if not mine:
                continue
            b = sp.backend
            most[b] = max(most.get(b, 0), len(mine))
            order = es.split_of.setdefault(b, [])
            for inp in mine:
                es.ordinal[id(inp)] = len(order)
                order.append(k)
                size = max(self.s.galloc[b].buft.alloc_size(c) for c in inp.copies)
                es.slot_bytes[b] = max(es.slot_bytes.get(b, 0), size)
        for b, m in most.items():
            es.n_slots[b] = m + max(0, self.s.prefetch_experts)
        for sp in splits:
            for inp in sp.inputs:
                if is_expert_input(inp):
                    es.slot[id(inp)] = es.ordinal[id(inp)] % es.n_slots[sp.backend]
        return es

    def place(self, es: ExpertSlots, splits: list[Split]) -> tuple[int, ...]:
        """Put the plan's expert copies in their slots, growing a device's pool where the plan
        needs more; the pools' uids (a changed tuple: the copies moved)."""
        for b, nbytes in es.slot_bytes.items():
            pool = self.pools.get(b)
            need = self.s.n_copies * es.n_slots[b]
            if pool is None or pool.stride < nbytes or pool.count < need:
                if pool is not None:
                    self.s.backends[b].synchronize()  # nothing may still read the old pool
                    pool.free()
                    self.free_events = {k: v for k, v in self.free_events.items() if k[0] != b}
                self.pools[b] = _Pool(self.s.galloc[b].buft, nbytes, need)
        uids = tuple(self.pools[b].uid for b in sorted(es.slot_bytes))
        if uids != es.pools:
            for sp in splits:
                for inp in sp.inputs:
                    if is_expert_input(inp):
                        for c, t in enumerate(inp.copies):
                            self.pools[sp.backend].place(t, c * es.n_slots[sp.backend] + es.slot[id(inp)])
            es.pools = uids
        return uids

    @property
    def pool_bytes(self) -> int:
        """Device memory the slot pools hold."""
        return sum(b.size for p in self.pools.values() for b in p.buffers)

    # --- a compute -------------------------------------------------------------------------------------
    def begin(self) -> None:
        # a prefetch the last compute never read (it stopped early) may still be writing its
        # slot: the devices' streams wait for it before this compute's uploads
        for ev, b in self.pending.values():
            ev.wait(self.s.backends[b])
        self.pending = {}
        self.ids = {}

    def upload(self, plan: _Plan, inp: SplitInput, bi: int, b: Backend, c: int) -> None:
        """Queue ``inp``'s experts on ``b`` for the split about to run: its prefetched copy
        (waited for device-side), or only the experts its ids select."""
        s, st = self.s, self.s.stats
        src, dst = inp.src, inp.copies[c]
        st.expert_bytes_total += src.nbytes
        done = self.pending.pop(id(inp), None)
        if done is not None:
            done[0].wait(b)
            st.expert_bytes += src.nbytes
            return
        ids_t = inp.moe_ids
        ids = self.ids.get(id(ids_t))
        if ids is None:  # the experts of one MoE layer share their ids: read them once
            owner = ids_t.view_src or ids_t
            s._sync(s.backends[plan.assign.get(id(owner), plan.assign.get(id(ids_t), bi))])
            ids = self.ids[id(ids_t)] = ids_t.get().reshape(-1)
        n_exp = src.ne[2]
        used = np.zeros(n_exp + 2, bool)
        used[ids[(ids >= 0) & (ids < n_exp)] + 1] = True
        # runs of consecutive selected experts: where `used` turns on, where it turns off
        edges = np.flatnonzero(used[1:] != used[:-1])
        first, end = edges[0::2], edges[1::2]
        host, nb2 = src.buffer.host_array, src.nb[2]
        # queued on b's own stream, behind every split that read the slot before: no wait
        for e0, e1 in zip(first.tolist(), end.tolist(), strict=True):
            start = src.offs + e0 * nb2
            b.set_tensor_async(dst, host[start : start + (e1 - e0) * nb2], e0 * nb2, (e1 - e0) * nb2)
            st.expert_bytes += (e1 - e0) * nb2

    def computed(self, es: ExpertSlots, sp: Split, b: Backend, c: int) -> None:
        """After split ``sp`` was queued on ``b``: its slots are free again once it finishes."""
        if self.s.prefetch_experts <= 0 or not b.device.has_events:
            return
        for inp in sp.inputs:
            if is_expert_input(inp):
                key = (sp.backend, c, es.slot[id(inp)])
                ev = self.free_events.get(key)
                if ev is None:
                    ev = self.free_events[key] = b.device.new_event()
                ev.record(b)

    def prefetch(self, es: ExpertSlots, splits: list[Split], k: int, c: int) -> None:
        """Before split k is queued: start, on a second stream of each device, the uploads of
        the next expert inputs after split k (at most ``prefetch_experts`` in flight) whose
        batches use nearly every expert and whose slot's last reader is queued before split k."""
        s = self.s
        budget = s.prefetch_experts - len(self.pending)
        if es.scan is None:
            found = [(i, inp) for i, sp in enumerate(splits) if s.backends[sp.backend].device.has_events
                     for inp in sp.inputs if is_expert_input(inp)]  # fmt: skip
            es.scan, es.scan_split = [inp for _, inp in found], [i for i, _ in found]
        for n in range(bisect_right(es.scan_split, k), len(es.scan)):
            inp, i = es.scan[n], es.scan_split[n]
            if budget <= 0:
                return
            if id(inp) in self.pending:
                continue
            sp = splits[i]
            dev = s.backends[sp.backend].device
            n_slots, order = es.n_slots.get(sp.backend), es.split_of.get(sp.backend)
            j = es.ordinal[id(inp)]
            if j >= n_slots and order[j - n_slots] >= k:
                return  # its slot is still to be read by split k or later: stop here
            if expected_share(inp) < PREFETCH_SHARE:
                continue
            pf = self.pf_backends.get(sp.backend)
            if pf is None:
                pf = self.pf_backends[sp.backend] = dev.new_backend()
            free = self.free_events.get((sp.backend, c, es.slot[id(inp)]))
            if free is not None:
                free.wait(pf)
            tensor_copy_async(s.backends[inp.src_backend], pf, inp.src, inp.copies[c], sync=s._sync)
            ev = self.ready.get(id(inp))
            if ev is None:
                ev = self.ready[id(inp)] = dev.new_event()
            ev.record(pf)
            self.pending[id(inp)] = (ev, sp.backend)
            s.stats.prefetched += 1
            budget -= 1

    def free(self) -> None:
        for e in (*self.free_events.values(), *self.ready.values()):
            e.free()
        for pb in self.pf_backends.values():
            pb.free()
        for p in self.pools.values():
            p.free()
        self.free_events, self.ready, self.pf_backends, self.pools = {}, {}, {}, {}
