"""Devices are listed from each plugin's probe and open on first use (runtime/backend.py,
Device.open): once, thread-safe; a failure is one typed DeviceOpenError naming the plugin, the
device and the cause, kept for every later use; a ConfigError stays itself; listings
(info, ranked, memory(open=False)) open nothing; default placement passes over a device that
does not open."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from accelplane.core.graph import Context
from accelplane.errors import AccelplaneError, ConfigError, DeviceError, DeviceOpenError
from accelplane.interface import DeviceSpec, DeviceType
from accelplane.runtime.alloc import alloc_tensors
from accelplane.runtime.registry import Registry
from accelplane.testing.plugins import host_plugin


class Runtime:
    """A fake device runtime: counts how often it is opened; ``fail`` makes opening raise."""

    def __init__(self, fail: BaseException | None = None, delay: float = 0.0) -> None:
        self.opened = 0
        self.fail = fail
        self.delay = delay

    def open(self):
        self.opened += 1
        time.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return ("runtime", self.opened)


def _init_backend(device, backend, params):
    return ("stream", device.runtime)  # a real use: the plugin reaches its runtime


def _memory(device):
    return (1, 2) if device.is_open else None  # the figures need the runtime


def registry(*devices: tuple[str, Runtime, DeviceType]) -> Registry:
    reg = Registry()
    for name, rt, kind in devices:
        spec = DeviceSpec(name, f"{name} test device", kind, ctx=f"probe of {name}", open=rt.open)
        plugin = host_plugin(name, get_devices=lambda spec=spec: [spec], init_backend=_init_backend,
                             device_memory=_memory)  # fmt: skip
        assert reg.register(plugin, name.lower())
    return reg


def test_listing_opens_nothing_and_first_use_opens_once():
    rt = Runtime()
    reg = registry(("ACC0", rt, DeviceType.ACCEL))
    (dev,) = reg.devices
    info = reg.info()
    reg.ranked()
    assert rt.opened == 0 and not dev.is_open
    assert dev.ctx == "probe of ACC0", "before opening, ctx is what the probe said"
    assert dev.memory(open=False) is None and info["plugins"][0]["devices"][0]["memory_total"] is None
    b1, b2 = dev.new_backend(), dev.new_backend()
    assert rt.opened == 1 and dev.is_open
    assert b1.ctx == b2.ctx == ("stream", ("runtime", 1)) and dev.runtime == ("runtime", 1)
    assert dev.memory() == (1, 2) and reg.info()["plugins"][0]["devices"][0]["open"] is True


def test_a_memory_query_opens_the_device():
    rt = Runtime()
    (dev,) = registry(("ACC0", rt, DeviceType.ACCEL)).devices
    assert dev.memory() == (1, 2) and rt.opened == 1


def test_concurrent_first_uses_open_once():
    rt = Runtime(delay=0.05)
    (dev,) = registry(("ACC0", rt, DeviceType.ACCEL)).devices
    got = []
    threads = [threading.Thread(target=lambda: got.append(dev.open())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rt.opened == 1 and got == [("runtime", 1)] * 8


@pytest.mark.parametrize("cause", [RuntimeError("clCreateContext returned -6"),
                                   OSError("libfake.so.2: cannot open shared object file"),
                                   DeviceError("the driver lost the device")],
                         ids=["RuntimeError", "OSError", "DeviceError"])  # fmt: skip
def test_a_runtime_that_does_not_open_is_a_typed_error_kept(cause):
    rt = Runtime(fail=cause)
    reg = registry(("BAD0", rt, DeviceType.GPU), ("GOOD0", Runtime(), DeviceType.GPU))
    bad = reg.device("BAD0")
    errors = []
    for use in (bad.new_backend, lambda: bad.buffer_type.alloc(16), bad.memory, bad.open):
        with pytest.raises(DeviceOpenError) as e:
            use()
        errors.append(e.value)
    msg = str(errors[0])
    assert msg == f"plugin 'bad0': device BAD0 did not open: {type(cause).__name__}: {cause}", msg
    assert isinstance(errors[0], DeviceError) and isinstance(errors[0], AccelplaneError)
    assert errors[0].__cause__ is cause
    assert all(e is errors[0] for e in errors), "every later use raises the same error"
    assert rt.opened == 1, "a failed open is not retried behind the user's back"
    assert bad.open_error is errors[0] and not bad.is_open
    assert reg.device("GOOD0").new_backend() is not None, "the other devices carry on"


def test_default_placement_passes_over_a_device_that_does_not_open():
    from accelplane.models.runner import pick_devices

    reg = registry(("BAD0", Runtime(fail=RuntimeError("no context")), DeviceType.GPU),
                   ("GOOD0", Runtime(), DeviceType.GPU), ("HOST", Runtime(), DeviceType.CPU))  # fmt: skip
    order = [d.name for d, _ in reg.ranked()]
    assert order[0] == "BAD0", "the ranking itself opens nothing"
    assert reg.best_device().name == "GOOD0"
    assert [d.name for d in pick_devices(reg, None)] == ["GOOD0"]
    info = reg.info(open=True)
    (bad,) = [d for p in info["plugins"] for d in p["devices"] if d["name"] == "BAD0"]
    assert bad["open"] is False and "did not open: RuntimeError: no context" in bad["open_error"]
    assert [r["device"] for r in info["default_order"]] == ["good0/GOOD0", "host/HOST"]
    assert [d.name for d in pick_devices(reg, ["BAD0"])] == ["BAD0"], "a named device is taken as named"
    every = registry(("BAD0", Runtime(fail=RuntimeError("no context")), DeviceType.GPU))
    with pytest.raises(DeviceError, match="no device opened: plugin 'bad0': device BAD0"):
        every.best_device()


def test_a_config_error_from_open_stays_itself():
    err = ConfigError("ACCELPLANE_FAKE_QUEUES='x': expected an integer")
    rt = Runtime(fail=err)
    reg = registry(("CFG0", rt, DeviceType.GPU), ("GOOD0", Runtime(), DeviceType.GPU))
    dev = reg.device("CFG0")
    for _ in range(2):
        with pytest.raises(ConfigError) as e:
            dev.new_backend()
        assert e.value is err
    with pytest.raises(ConfigError):
        reg.info(open=True)  # the user's setting to fix: not listed as a broken device
    with pytest.raises(ConfigError):
        reg.usable(reg.devices)


def test_a_plugin_without_open_is_always_open():
    reg = Registry()
    assert reg.register(host_plugin("PLAIN"), "plain")
    (dev,) = reg.devices
    assert dev.is_open and dev.runtime is dev.ctx and dev.open_error is None
    ctx = Context()
    x = ctx.new_tensor("f32", (4,), "x")
    buf = alloc_tensors([x], dev.buffer_type)
    x.set(np.arange(4, dtype=np.float32))
    assert x.get().tolist() == [0, 1, 2, 3]
    buf.free()
