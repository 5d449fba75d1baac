"""faulty_comm: the asynchronous test device, whose all-reduce leaves the last backend's
contribution out of the sum."""

import threading

import numpy as np
from accelplane.core.tensor import strided_view
from accelplane.interface import hookimpl
from accelplane.testing import asyncdev as _base
from accelplane.testing.asyncdev import *  # noqa: F403

from . import renamed


@hookimpl
def get_devices():
    return renamed(_base.get_devices(), "FAULTY_COMM")


@hookimpl
def comm_allreduce_tensor(comm, tensors):
    n = len(comm.backends)
    parts: list = [None] * n
    barrier = threading.Barrier(n, timeout=_base.WAIT_TIMEOUT_S)
    for i, (b, t) in enumerate(zip(comm.backends, tensors, strict=True)):

        def task(i=i, t=t) -> None:
            v = strided_view(t, _base._bytes(t))
            parts[i] = v.astype(np.float32)
            barrier.wait()
            total = parts[0].copy()
            for p in parts[1:-1]:  # the bug: parts[-1] is dropped
                total += p
            barrier.wait()
            v[...] = total

        b.ctx.stream.submit(task, "allreduce")
    return True
