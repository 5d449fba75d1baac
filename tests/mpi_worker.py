"""One MPI rank of the tensor-parallel tests (started by tests/test_meta.py through mpirun):
the llama layer graph split over this rank's CPU backends and every other rank's, compared with
the same graph computed on one device in this process.

Usage: mpirun -n R python tests/mpi_worker.py [--local N] [--layers L] [--mode ok|hang|die]
``hang``: rank 1 sleeps instead of computing (the others must fail at ACCELPLANE_MPI_TIMEOUT);
``die``: rank 1 exits before computing (mpirun must end the job).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import accelplane.cpu.plugin as cpu_plugin
import numpy as np
from accelplane.bench.tp import LayerParams, layer_values, single, tensor_parallel
from accelplane.parallel.mpi import MPIGroup
from accelplane.runtime.registry import Registry


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--local", type=int, default=1, help="CPU backends per rank")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mode", default="ok", choices=["ok", "hang", "die"])
    a = ap.parse_args()
    group = MPIGroup()
    reg = Registry()
    reg.register(cpu_plugin, "cpu")
    cpu = reg.device("CPU")
    p = LayerParams(d_model=64, n_head=8, n_kv_head=4, d_ff=96, n_tokens=5, n_layers=a.layers)
    weights, inputs = layer_values(p.build(), seed=7)  # the same values on every rank
    want = single(cpu, p, weights)(inputs)
    run = tensor_parallel([cpu] * a.local, p, weights, group=group)
    assert run.meta.n == a.local * group.size, run.meta.n
    if group.rank == 1 and a.mode == "hang":
        time.sleep(3600)
    if group.rank == 1 and a.mode == "die":
        sys.stdout.flush()
        os._exit(17)
    got = run(inputs)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    # a collective get of a split weight reassembles it on every rank
    wq = next(w for w in run.lg.weights if w.name.endswith("wq"))
    same_w = np.array_equal(wq.get(), weights[wq.name])
    ok = err < 1e-5 and same_w
    print(f"rank {group.rank}/{group.size}: devices {run.meta.n}, max rel err {err:.3g}, "
          f"weights gathered {same_w}, {run.meta.stats.algorithms} -> {'ok' if ok else 'FAIL'}", flush=True)
    run.meta.free()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
