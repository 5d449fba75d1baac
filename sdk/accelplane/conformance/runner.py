"""Running one op case on a plugin's device, the way test-backend-ops does, plus more:

* every tensor lives in the plugin's own buffer between guard regions of random bytes that
  must come back unchanged (catches out-of-bounds writes), and results start as NaN bytes
  (catches elements never written);
* inputs must come back unchanged unless the op writes them;
* the result is compared with the float64 oracle (accelplane.oracle.reference): no NaN where the
  oracle has none, infinities matching in sign, NMSE under the case's threshold, exact
  equality for integer results.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from accelplane.conformance.cases import OpCase
from accelplane.core.graph import Context, Graph
from accelplane.core.ops import VIEW_OPS, WRITES_VIEW_SRC
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType
from accelplane.oracle import reference
from accelplane.oracle.compare import compare
from accelplane.runtime.backend import Backend, Device

NOT_SUPPORTED = "not supported"
PASSED = "passed"
FAILED = "failed"


@dataclass
class CaseResult:
    id: str
    op: str
    status: str
    error: float | None = None
    threshold: float | None = None
    message: str = ""


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class GuardedLayout:
    """All owners of a graph's memory in one buffer of the device, between guards: every
    byte of the buffer outside the owners' ``alloc_size`` extents (the gaps of 1 KiB between
    them and the alignment padding right after each one) holds random bytes that must come
    back unchanged, so a kernel that writes even one element past its tensor is caught."""

    def __init__(self, device: Device, graph: Graph, rng: np.random.Generator) -> None:
        buft = device.buffer_type
        a = max(buft.alignment, 4)
        self.guard = _align(1024, a)
        owners: list[Tensor] = []
        for t in list(graph.leafs) + list(graph.nodes):
            if t.view_src is None and t.op not in VIEW_OPS:
                owners.append(t)
        extents: list[tuple[int, int]] = []  # [start, end) of each owner's alloc_size
        cur = self.guard
        for t in owners:
            cur = _align(cur, a)
            extents.append((cur, cur + max(buft.alloc_size(t), 1)))
            cur = _align(extents[-1][1], a) + self.guard
        # one I32 tensor over the whole buffer [0, cur) reads and writes the guard bytes
        shadow = Context("guards").new_tensor_ne(GGMLType.I32, cur // 4, name="guards")
        extra = _align(buft.alloc_size(shadow) - shadow.nbytes, a)
        self.buffer = buft.alloc(cur + extra)
        self.buffer.place(shadow, 0)
        self.pattern = rng.integers(0, 256, cur, dtype=np.uint8)
        shadow.set_bytes(self.pattern)
        self.shadow = shadow
        self.outside = np.ones(cur, bool)
        for t, (s, e) in zip(owners, extents, strict=True):
            self.buffer.place(t, s)
            self.outside[s:e] = False
        for n in graph.nodes:
            if n.view_src is not None:
                self.buffer.init_view(n)
        self.owners = owners
        self.extents = extents

    def check_guards(self) -> str:
        got = self.shadow.get_bytes()
        bad = np.flatnonzero((got != self.pattern) & self.outside)
        if not bad.size:
            return ""
        off = int(bad[0])
        after = [(t, e) for t, (_, e) in zip(self.owners, self.extents, strict=True) if e <= off]
        where = ""
        if after:
            t, e = max(after, key=lambda x: x[1])
            what = repr(t.name) if t.name else f"#{t.uid} ({t.op.name})"
            where = f", {off - e} bytes after the end of tensor {what}"
        return (f"bytes written outside every tensor: {bad.size} guard bytes changed, the first "
                f"at buffer offset {off}{where}")  # fmt: skip


def init_leaf(case: OpCase, t: Tensor, rng: np.random.Generator) -> np.ndarray:
    init = case.inits.get(t.name)
    if init is None:
        init = (lambda r, s: r.integers(0, 10, s)) if t.type == GGMLType.I32 else None
    shape = tuple(reversed(t.ne))
    vals = init(rng, shape) if init is not None else rng.uniform(-1.0, 1.0, shape)
    return vals


def graph_supported(device: Device, graph: Graph) -> tuple[bool, str]:
    for n in graph.nodes:
        if n.op in VIEW_OPS:
            continue
        if not device.supports_op(n):
            return False, f"{n.op.name} {n.type.name} ne={list(n.ne)}"
    return True, ""


def run_op_case(
    case: OpCase, device: Device, backend: Backend, rng: np.random.Generator
) -> CaseResult:
    """Run ``case`` on ``backend`` (a stream of ``device``) and judge it against the oracle."""
    ctx = Context(case.id)
    out = case.build(ctx)
    graph = ctx.graph(out)
    ok, what = graph_supported(device, graph)
    if not ok:
        return CaseResult(case.id, case.op, NOT_SUPPORTED, message=what)
    layout = GuardedLayout(device, graph, rng)
    try:
        written = {id(n.view_src) for n in graph.nodes if n.op in WRITES_VIEW_SRC}
        values = {}
        for t in graph.leafs:
            t.set(init_leaf(case, t, rng).reshape(t.shape))
            values[t] = t.get().reshape(tuple(reversed(t.ne)))
        nan = np.full(1, 0xFF, np.uint8)
        for n in graph.nodes:
            if n.view_src is None and n.op not in VIEW_OPS:
                n.set_bytes(np.broadcast_to(nan, (n.nbytes,)).copy())
        backend.graph_compute(graph)
        backend.synchronize()
        got = out.get().reshape(tuple(reversed(out.ne)))
        expected = reference.evaluate(graph, values)[out]
        ok, err, msg = compare(expected, got, case.max_nmse, case.exact)
        if ok:
            msg = layout.check_guards()
            ok = not msg
        if ok:
            for t in graph.leafs:
                if id(t) in written:
                    continue
                now = t.get().reshape(tuple(reversed(t.ne)))
                if not np.array_equal(now, values[t], equal_nan=True):
                    ok, msg = False, f"input {t.name!r} was modified by the computation"
                    break
        return CaseResult(case.id, case.op, PASSED if ok else FAILED, err, case.max_nmse, msg)
    finally:
        layout.buffer.free()
