"""Tensor-parallel helpers for tests and benchmarks: the Megatron split of
:func:`~accelplane.models.blocks.llama_layer`'s weights, and runs of the same layer graph on
one device and on a :class:`~accelplane.parallel.meta.MetaDevice` with the same (seeded) values."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType
from accelplane.models.blocks import LayerGraph, llama_layer
from accelplane.parallel.meta import MetaDevice, SplitFn, SplitState
from accelplane.runtime.alloc import GraphAllocator, alloc_tensors
from accelplane.runtime.backend import Backend, Device


@dataclass(frozen=True)
class LayerParams:
    """Arguments of :func:`llama_layer` (its defaults)."""

    d_model: int = 64
    n_head: int = 4
    n_kv_head: int = 2
    d_ff: int = 128
    n_tokens: int = 7
    n_layers: int = 1
    wtype: GGMLType = GGMLType.F32

    def build(self) -> LayerGraph:
        return llama_layer(self.d_model, self.n_head, self.n_kv_head, self.d_ff, self.n_tokens,
                           self.wtype, self.n_layers)  # fmt: skip


def megatron_split(meta: MetaDevice, p: LayerParams, q_granularity: int | None = None) -> SplitFn:
    """llama.cpp's split of a llama layer (``llama_meta_device_get_split_state``): wq/wk/wv
    column-parallel by heads (wq by groups of n_head / n_kv_head heads, so each device's query
    heads use its kv heads), wo row-parallel by the same groups; gate/up column-parallel, down
    row-parallel; norms mirrored. ``q_granularity`` overrides wq's and wo's granularity."""
    hd = p.d_model // p.n_head
    gq = q_granularity or hd * (p.n_head // p.n_kv_head)
    rules = {"wq": (1, gq), "wk": (1, hd), "wv": (1, hd), "wo": (0, gq),
             "w_gate": (1, 1), "w_up": (1, 1), "w_down": (0, 1)}  # fmt: skip

    def fn(t: Tensor) -> SplitState | None:
        r = rules.get(t.name.rsplit(".", 1)[-1])
        return None if r is None else meta.split(t, r[0], r[1])

    return fn


def layer_values(lg: LayerGraph, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(weight values, input values) by tensor name, from ``seed``."""
    rng = np.random.default_rng(seed)
    w = {t.name: v for t, v in lg.weight_values(rng).items()}
    i = {t.name: v for t, v in lg.inputs(rng).items()}
    return w, i


class _Run:
    """Call with the input values: allocate the layer graph, set the inputs, compute, return
    the output. Subclasses say how to allocate and compute."""

    lg: LayerGraph

    @property
    def graph(self):
        if not hasattr(self, "_graph"):
            self._graph = self.lg.ctx.graph(self.lg.out)
        return self._graph

    def __call__(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        g = self.graph
        self._alloc(g)
        _set(self.lg, inputs)
        self._compute(g)
        return self.lg.out.get()


@dataclass
class SingleRun(_Run):
    """The layer graph on one device's backend (the reference of the tensor-parallel runs)."""

    lg: LayerGraph
    backend: Backend
    galloc: GraphAllocator
    buffers: list = field(default_factory=list)

    def _alloc(self, g) -> None:
        self.galloc.alloc_graph(g)

    def _compute(self, g) -> None:
        self.backend.compute(g)

    def free(self) -> None:
        self.galloc.free()
        for b in self.buffers:
            b.free()
        self.backend.free()


def single(device: Device, p: LayerParams, weights: dict[str, np.ndarray]) -> SingleRun:
    lg = p.build()
    buf = alloc_tensors(lg.weights, device.buffer_type)
    for w in lg.weights:
        w.set(weights[w.name])
    return SingleRun(lg, device.new_backend(), GraphAllocator(device.buffer_type), [buf])


@dataclass
class MetaRun(_Run):
    """The layer graph on a meta device."""

    lg: LayerGraph
    meta: MetaDevice

    def _alloc(self, g) -> None:
        self.meta.alloc_graph(g)

    def _compute(self, g) -> None:
        self.meta.compute(g)


def tensor_parallel(devices: list, p: LayerParams, weights: dict[str, np.ndarray],
                    split: Callable[[MetaDevice, LayerParams], SplitFn] = megatron_split,
                    **meta_kw) -> MetaRun:  # fmt: skip
    """The layer on ``MetaDevice(devices, split(meta, p), **meta_kw)`` with ``weights`` set."""
    lg = p.build()
    meta = MetaDevice(devices, **meta_kw)
    meta.split_state = split(meta, p)
    meta.alloc_weights(lg.weights)
    for w in lg.weights:
        w.set(weights[w.name])
    return MetaRun(lg, meta)


def _set(lg: LayerGraph, inputs: dict[str, np.ndarray]) -> None:
    for t in (lg.x, lg.pos, lg.mask):
        t.set(inputs[t.name])
