"""Tensor parallelism across processes: an MPI process group for :class:`accelplane.parallel.meta.MetaDevice`.

One accelplane process per MPI rank (``mpirun -n R python app.py``), each with its local
devices. Every rank builds the same graphs and weights (SPMD) and creates
``MetaDevice(local_devices, split_state, group=MPIGroup())``; split states then give sizes for
all devices of all ranks, in rank order, and each rank holds only its devices' shards. Where a
PARTIAL value must be summed, the meta device sums it over its local devices (accelplane.parallel.comm),
stages the local sum in host memory and sums that across ranks with a non-blocking
``MPI_Iallreduce`` (mpi4py, numpy buffers); NCCL across hosts is the CUDA plugin's business.

Failure is bounded: every collective is polled against a deadline of
``ACCELPLANE_MPI_TIMEOUT`` seconds (default 120). A rank that dies makes mpirun end the job;
a rank that hangs, or never enters the collective, makes the others raise
:class:`~accelplane.errors.CommTimeoutError` at the deadline. Because an MPI process cannot
finalize with a collective pending, :class:`MPIGroup` installs an exception hook (like
``python -m mpi4py``) that prints the error and calls ``MPI_Abort`` when an exception is not
caught, so the whole job ends instead of hanging.

System packages: Debian's OpenMPI (``apt-get install openmpi-bin libopenmpi-dev``) and
``pip install mpi4py`` (scripts/system-deps-mpi installs both).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol

import numpy as np

from accelplane import env
from accelplane.errors import CommTimeoutError, DeviceError

DEFAULT_TIMEOUT_S: float = env.MPI_TIMEOUT.default

__all__ = ["DEFAULT_TIMEOUT_S", "MPIGroup", "ProcessGroup", "timeout_default"]


class ProcessGroup(Protocol):
    """What a meta device needs from a group of processes (ranks 0..size-1). Every call is a
    collective: all ranks make the same calls in the same order."""

    rank: int
    size: int
    kind: str  # names the transport in MetaStats.algorithms

    def allreduce(self, arr: np.ndarray, what: str = "") -> np.ndarray:
        """The elementwise sum of ``arr`` over the ranks (a new array, same dtype and shape)."""
        ...

    def allgather_int(self, value: int, what: str = "") -> list[int]:
        """Every rank's ``value``, in rank order."""
        ...


def timeout_default() -> float:
    """``ACCELPLANE_MPI_TIMEOUT`` (seconds), else :data:`DEFAULT_TIMEOUT_S`."""
    return env.MPI_TIMEOUT.get()


class MPIGroup:
    """The ranks of an MPI communicator (default ``MPI.COMM_WORLD``) as a process group.

    ``timeout``: seconds any one collective may take (default :func:`timeout_default`);
    ``abort_on_uncaught``: install the exception hook that aborts the job (module docstring).
    Raises DeviceError when mpi4py cannot be imported.
    """

    kind = "mpi"

    def __init__(self, comm: Any = None, timeout: float | None = None,
                 abort_on_uncaught: bool = True) -> None:  # fmt: skip
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise DeviceError(
                "MPIGroup needs mpi4py and an MPI library (Debian: apt-get install openmpi-bin "
                f"libopenmpi-dev; pip install mpi4py): {e}"
            ) from e
        self._mpi = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = int(self.comm.Get_rank())
        self.size = int(self.comm.Get_size())
        self.timeout = timeout_default() if timeout is None else float(timeout)
        if self.timeout <= 0:
            raise DeviceError(f"MPIGroup: timeout must be > 0 seconds, got {self.timeout}")
        if abort_on_uncaught:
            _install_abort_hook(self.comm)

    def __repr__(self) -> str:
        return f"MPIGroup(rank {self.rank} of {self.size}, timeout {self.timeout:g} s)"

    def _wait(self, req: Any, what: str, nbytes: int) -> None:
        """Poll ``req`` until it completes or the deadline passes (then CommTimeoutError)."""
        deadline = time.monotonic() + self.timeout
        polls = 0
        while not req.Test():
            if time.monotonic() > deadline:
                raise CommTimeoutError(
                    f"MPI {what or 'collective'} ({nbytes} bytes): rank {self.rank} of {self.size} waited "
                    f"{self.timeout:g} s (ACCELPLANE_MPI_TIMEOUT) for the other ranks; one of them died, "
                    "hung or did not enter the same collective"
                )
            polls += 1
            if polls > 200:  # spin briefly (a layer's all-reduce is short), then back off to 1 ms
                time.sleep(min(1e-3, 1e-6 * (polls - 200)))

    def allreduce(self, arr: np.ndarray, what: str = "") -> np.ndarray:
        send = np.ascontiguousarray(arr)
        recv = np.empty_like(send)
        self._wait(self.comm.Iallreduce(send, recv, op=self._mpi.SUM), what or "all-reduce", send.nbytes)
        return recv

    def allgather_int(self, value: int, what: str = "") -> list[int]:
        send = np.array([int(value)], np.int64)
        recv = np.empty(self.size, np.int64)
        self._wait(self.comm.Iallgather(send, recv), what or "all-gather", send.nbytes)
        return [int(x) for x in recv]

    def barrier(self, what: str = "") -> None:
        self._wait(self.comm.Ibarrier(), what or "barrier", 0)


def _install_abort_hook(comm: Any) -> None:
    """On an uncaught exception: print it, then MPI_Abort (MPI_Finalize would wait forever for
    a collective the other ranks never finish)."""
    if getattr(sys.excepthook, "_accelplane_mpi", False):
        return
    prev = sys.excepthook

    def hook(tp, val, tb) -> None:  # type: ignore[no-untyped-def]
        try:
            prev(tp, val, tb)
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            comm.Abort(1)

    hook._accelplane_mpi = True  # type: ignore[attr-defined]
    sys.excepthook = hook
