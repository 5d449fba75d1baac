"""Fusion on the host, as ggml's Hexagon backend does it: RMS_NORM + MUL into one NPU op, and
up to three MUL_MATs that share their activations (Q/K/V, FFN gate/up) into one; and the
graph_optimize pass that moves such matmuls next to each other before allocation."""

from __future__ import annotations

from accelplane.core.ops import VIEW_OPS, Op
from accelplane.core.tensor import Tensor, TensorFlag
from accelplane.core.types import GGMLType

T = GGMLType


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
