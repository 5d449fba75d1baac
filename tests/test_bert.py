"""The host-API encoder (accelplane.models.bert) against the float64 oracle on every installed
device, and against PyTorch where it is installed; `bench graph`'s rows."""

from __future__ import annotations

import accelplane
import numpy as np
import pytest
from accelplane.bench.graph import bench_graph
from accelplane.errors import ShapeError
from accelplane.models.bert import (
    PRESETS,
    BertConfig,
    build_encoder,
    random_batch,
    random_weights,
    torch_encoder,
)
from accelplane.oracle import reference
from accelplane.runtime.alloc import alloc_ctx_tensors
from accelplane.sched import Scheduler

CFG = PRESETS["bert-tiny"]
B, S = 3, 9


def _run(dev_name: str):
    enc = build_encoder(CFG, B, S)
    w = random_weights(CFG)
    ids, mask = random_batch(CFG, B, S)
    sched = Scheduler.from_devices([dev_name])
    try:
        alloc_ctx_tensors(enc.ctx, sched.backends[0].device.buffer_type)
        for n, t in enc.weights.items():
            t.set(w[n])
        iv = enc.inputs(ids, mask)
        for t, v in iv.items():
            t.set(v)
        g = enc.ctx.graph(enc.out)
        sched.compute(g)
        got = enc.out.get().reshape(B, -1)
    finally:
        sched.free()
    want = reference.evaluate(g, {**{enc.weights[n]: v for n, v in w.items()}, **iv})[enc.out].reshape(B, -1)
    return got, want, w, ids, mask


@pytest.mark.parametrize("dev", [d.name for d in accelplane.devices()])
def test_encoder_matches_the_float64_oracle(dev):
    got, want, *_ = _run(dev)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert mask_matters()


def mask_matters() -> bool:
    """Padding changes the result: the pooled vector of a padded row differs from the same row
    unpadded (else the mask would be untested)."""
    ids, mask = random_batch(CFG, B, S)
    full = np.ones_like(mask)
    w = random_weights(CFG)
    outs = []
    for m in (mask, full):
        enc = build_encoder(CFG, B, S)
        iv = enc.inputs(ids, m)
        g = enc.ctx.graph(enc.out)
        outs.append(reference.evaluate(g, {**{enc.weights[n]: v for n, v in w.items()}, **iv})[enc.out])
    return not np.allclose(outs[0], outs[1])


def test_torch_peer_computes_the_same_function():
    pytest.importorskip("torch")
    got, want, w, ids, mask = _run("CPU")
    peer = torch_encoder(CFG, w)(ids, mask)
    assert np.abs(peer - want).max() <= 1e-5 * np.abs(want).max()


def test_bench_graph_rows():
    rows = bench_graph("bert-tiny", [accelplane.device("CPU")], reps=2, batch=2, seq=8)
    (r,) = rows
    assert r["device"] == "CPU" and r["ms"] > 0 and r["nodes_on_device"] == r["nodes"] > 0
    if r["torch_ms"] is not None:
        assert r["max_rel_diff"] < 1e-5 and r["speedup"] == pytest.approx(r["torch_ms"] / r["ms"])


@pytest.mark.parametrize("bad", [dict(d_model=30, n_head=4), dict(n_layers=0)])
def test_bad_config_is_a_shape_error(bad):
    with pytest.raises(ShapeError):
        BertConfig(**bad)
    with pytest.raises(ShapeError):
        build_encoder(CFG, 1, CFG.n_ctx_train + 1)
    with pytest.raises(ShapeError, match="unknown preset"):
        bench_graph("nope", [])
