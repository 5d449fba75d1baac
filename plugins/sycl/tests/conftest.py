"""Fixtures: a registry of the SYCL plugin with one SYCL device opened as two logical devices
(ACCELPLANE_SYCL_DEVICES=0,0) plus the CPU plugin, and a calibrated long-running kernel."""

from __future__ import annotations

import ctypes
import time

import accelplane.cpu.plugin as cpu_plugin
import pytest
from accelplane.runtime.registry import Registry


@pytest.fixture(scope="session")
def reg():
    import accelplane_sycl.plugin as sycl_plugin

    mp = pytest.MonkeyPatch()
    mp.setenv("ACCELPLANE_SYCL_DEVICES", "0,0")
    try:
        r = Registry()
        r.register(sycl_plugin, "sycl")
        r.register(cpu_plugin, "cpu")
    finally:
        mp.undo()
    if "sycl" not in r.plugins:
        why = [f.reason for f in r.failures if f.name == "sycl"]
        pytest.skip(f"no SYCL device: {why[0] if why else 'plugin not registered'}")
    return r


@pytest.fixture(scope="session")
def devs(reg):
    return reg.devices_of("sycl")


@pytest.fixture(scope="session")
def d0(devs):
    return devs[0]


@pytest.fixture(scope="session")
def d1(devs):
    return devs[1]


@pytest.fixture(scope="session")
def cpu(reg):
    return reg.devices_of("cpu")[0]


class Spinner:
    """Queues a busy kernel of about ``ms`` milliseconds on a backend's queue."""

    def __init__(self, dev) -> None:
        b = dev.new_backend()
        self.steps_per_ms = 0.0
        n = 2_000_000
        for _ in range(3):  # the first runs include the kernel's build
            t = time.perf_counter()
            self._submit(b, n).wait()
            dt = time.perf_counter() - t
        self.steps_per_ms = n / (dt * 1e3)
        b.free()

    @staticmethod
    def _submit(backend, n: int):
        bs = backend.ctx
        k = bs.dev.kernel("k_spin")
        return bs.queue.submit_async(k, [bs.dev.spin_mem(), ctypes.c_uint64(n)], [1])

    def __call__(self, backend, ms: float):
        """The SYCL event of the queued kernel."""
        return self._submit(backend, int(ms * self.steps_per_ms))


@pytest.fixture(scope="session")
def spin(d0):
    return Spinner(d0)
