"""Listing CUDA devices asks the driver (libcuda through ctypes), never CuPy: names, compute
capability and memory from attribute queries, no context. Checked against a fake driver (no
GPU needed); the real driver's answers are the GPU runs' (test_cuda.py)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from accelplane.errors import DeviceError, DeviceOpenError
from accelplane.runtime.registry import Registry
from accelplane_cuda import plugin, runtime

GIB = 1 << 30


class FakeDriver:
    """libcuda's calls the probe makes, answering for ``devices`` [(name, (major, minor), bytes)]."""

    def __init__(self, devices, init_status: int = 0) -> None:
        self.devices = devices
        self.init_status = init_status
        self.calls: list[str] = []

    def cuInit(self, flags):
        self.calls.append("cuInit")
        return self.init_status

    def cuGetErrorName(self, status, out):
        out._obj.value = {100: b"CUDA_ERROR_NO_DEVICE", 35: b"CUDA_ERROR_INSUFFICIENT_DRIVER"}[status]
        return 0

    def cuDeviceGetCount(self, n):
        n._obj.value = len(self.devices)
        return 0

    def cuDeviceGet(self, dev, i):
        dev._obj.value = i
        return 0

    def cuDeviceGetName(self, buf, size, dev):
        buf.value = self.devices[dev.value][0].encode()
        return 0

    def cuDeviceTotalMem_v2(self, total, dev):
        total._obj.value = self.devices[dev.value][2]
        return 0

    def cuDeviceGetAttribute(self, out, attr, dev):
        cc = self.devices[dev.value][1]
        out._obj.value = {runtime.CC_MAJOR: cc[0], runtime.CC_MINOR: cc[1]}[attr]
        return 0

    def __getattr__(self, name):  # anything else (a context, a module load) is not the probe's
        raise AssertionError(f"the probe called {name}")


@pytest.fixture
def driver(monkeypatch):
    """Install a fake driver (and pretend CuPy is installed, which only find_spec asks)."""
    real_find_spec = importlib.util.find_spec

    def install(devices, init_status: int = 0) -> FakeDriver:
        fake = FakeDriver(devices, init_status)
        monkeypatch.setattr(runtime, "_driver", lambda: fake)

        def find_spec(name, *a):
            return object() if name == "cupy" else real_find_spec(name, *a)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        return fake

    return install


def test_devices_are_listed_from_the_driver(driver):
    fake = driver([("NVIDIA H200", (9, 0), 140 * GIB), ("NVIDIA H200", (9, 0), 140 * GIB)])
    cupy_was_loaded = "cupy" in sys.modules
    reg = Registry()
    assert reg.register(plugin, "cuda"), reg.failures
    devs = reg.devices_of("cuda")
    assert [d.name for d in devs] == ["CUDA0", "CUDA1"]
    assert devs[1].description == "NVIDIA H200 (sm_90, 140 GiB)"
    assert devs[1].ctx.index == 1 and devs[1].ctx.cc == (9, 0) and devs[1].ctx.total_memory == 140 * GIB
    assert not any(d.is_open for d in devs) and ("cupy" in sys.modules) == cupy_was_loaded
    assert devs[0].memory(open=False) is None, "free memory needs a context: not at listing"
    assert fake.calls == ["cuInit"]


@pytest.mark.parametrize("devices, status, why", [
    ([], 0, "no CUDA device: the CUDA driver reports 0 devices"),
    ([], 100, "no CUDA device: cuInit: CUDA_ERROR_NO_DEVICE"),
    ([], 35, "no CUDA device: cuInit: CUDA_ERROR_INSUFFICIENT_DRIVER"),
], ids=["zero", "no-device", "old-driver"])  # fmt: skip
def test_no_device_is_said(driver, devices, status, why):
    driver(devices, status)
    with pytest.raises(DeviceError) as e:
        runtime.probe()
    assert str(e.value) == why


def test_a_missing_driver_or_cupy_is_no_device(monkeypatch, driver):
    driver([("NVIDIA H200", (9, 0), 140 * GIB)])

    def no_driver():
        raise OSError("libcuda.so.1: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(runtime, "_driver", no_driver)
    with pytest.raises(DeviceError, match=r"^no CUDA device: the NVIDIA driver's libcuda.so.1 does not load"):
        runtime.probe()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(DeviceError, match=r"^no CUDA device: CuPy is not installed"):
        runtime.probe()


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed: it opens")
def test_a_device_whose_runtime_does_not_load_fails_typed_at_first_use(driver):
    driver([("NVIDIA H200", (9, 0), 140 * GIB)])
    reg = Registry()
    assert reg.register(plugin, "cuda")
    (dev,) = reg.devices_of("cuda")
    with pytest.raises(DeviceOpenError, match=r"^plugin 'cuda': device CUDA0 did not open: "
                       r"ModuleNotFoundError: No module named 'cupy'"):  # fmt: skip
        dev.new_backend()
