"""A stream's timeline (Backend.timeline_begin): device timestamps around each copy and graph
compute it queues while noted, read back as seconds on one clock for the device's streams."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .vk import NULL, V, check, ffi, lib

if TYPE_CHECKING:
    from .device import LogicalDevice

POOL = 256  # timestamp queries per pool (two a noted copy or compute)


class Timeline:
    """Timestamp query pairs of a stream's noted work, in queue order."""

    def __init__(self, dev: LogicalDevice) -> None:
        self.dev = dev
        self.noted: list[tuple[str, object, int]] = []  # (kind, pool, first query)
        self.pools: list = []
        self.next = POOL

    def stamps(self, kind: str) -> tuple:
        """Two queries (pool, first) for the start and end of work being recorded, noted as ``kind``."""
        if self.next + 2 > POOL:
            self.pools.append(self.dev.new_query_pool(POOL))
            self.next = 0
        q = (self.pools[-1], self.next)
        self.next += 2
        self.noted.append((kind, *q))
        return q

    def end(self) -> list[tuple[str, float, float]]:
        """(kind, start, end) of the noted work, in seconds from the device's origin (the first
        timestamp it read); the stream has been synchronized. Frees the pools."""
        out, data = [], ffi.new("uint64_t[2]")
        period = self.dev.phys.limits["timestampPeriod"] * 1e-9
        flags = V.VK_QUERY_RESULT_64_BIT | V.VK_QUERY_RESULT_WAIT_BIT
        for kind, pool, i in self.noted:
            r = lib.vkGetQueryPoolResults(self.dev.handle, pool, i, 2, 16, data, 8, flags)
            check(r, "vkGetQueryPoolResults")
            if self.dev.ts_origin is None:
                self.dev.ts_origin = int(data[0])
            t0, t1 = ((int(x) - self.dev.ts_origin) * period for x in (data[0], data[1]))
            out.append((kind, t0, t1))
        self.free()
        return out

    def free(self) -> None:
        for pool in self.pools:
            lib.vkDestroyQueryPool(self.dev.handle, pool, NULL)
        self.noted, self.pools, self.next = [], [], POOL
