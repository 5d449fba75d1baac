"""A plugin test helper for fused kernels (accelplane.core.fusion): run norm → MUL on a device and
check it against float64 numpy, returning the plan so the caller can check what it fused."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from accelplane.core.graph import Context, Graph
from accelplane.core.types import GGMLType
from accelplane.runtime.alloc import alloc_tensors
from accelplane.runtime.backend import Backend, Device


def norm_oracle(op: str, x: np.ndarray, eps: float) -> np.ndarray:
    """NORM / RMS_NORM / L2_NORM of the last axis, in float64."""
    x = x.astype(np.float64)
    if op == "NORM":
        x = x - x.mean(-1, keepdims=True)
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    if op == "RMS_NORM":
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return x / np.maximum(np.sqrt((x * x).sum(-1, keepdims=True)), eps)


def run_norm_mul(device: Device, plan_of: Callable[[Backend, Graph], object], op: str = "RMS_NORM",
                 keep_norm: bool = False, ne0: int = 2048, seed: int = 0) -> object:  # fmt: skip
    """y = norm(x) * w with x [2, 3, ne0] and w [2, 1, ne0] (broadcast over rows) on ``device``;
    with ``keep_norm`` the norm is a graph output too (so it may not be fused away). Asserts
    the results against float64 numpy and returns ``plan_of(backend, graph)``."""
    eps = 1e-6
    ctx = Context()
    x = ctx.new_tensor(GGMLType.F32, (2, 3, ne0), "x")
    w = ctx.new_tensor(GGMLType.F32, (2, 1, ne0), "w")
    fn = {"NORM": ctx.norm, "RMS_NORM": ctx.rms_norm, "L2_NORM": ctx.l2_norm}[op]
    nrm = fn(x, eps)
    y = ctx.mul(nrm, w)
    g = ctx.graph(y, nrm) if keep_norm else ctx.graph(y)
    buf = alloc_tensors([x, w, *g.nodes], device.buffer_type)
    rng = np.random.default_rng(seed)
    xv = rng.standard_normal(x.shape).astype(np.float32)
    wv = rng.standard_normal(w.shape).astype(np.float32)
    x.set(xv)
    w.set(wv)
    be = device.new_backend()
    try:
        be.compute(g)
        want = norm_oracle(op, xv, eps)
        np.testing.assert_allclose(y.get(), want * wv, rtol=1e-4, atol=1e-5)
        if keep_norm:
            np.testing.assert_allclose(nrm.get(), want, rtol=1e-4, atol=1e-5)
        return plan_of(be, g)
    finally:
        be.free()
        buf.free()
