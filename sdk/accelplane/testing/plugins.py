"""Test plugins and registries for the SDK's own tests and benchmarks (not backends).

* :func:`host_plugin` — a plugin object that reuses the CPU plugin's hookimpls under its own
  device name, with chosen hooks overridden or removed (to test registration and fallbacks);
* :func:`cpu_and_async_registry` — a private Registry with the CPU plugin and the asynchronous
  test device (for scheduler, comm, meta and model tests that need several "devices").
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable

from accelplane import env
from accelplane.cpu import plugin as cpu_plugin
from accelplane.interface import HOOK_NAMES, DeviceSpec, DeviceType, hookimpl
from accelplane.runtime.registry import Registry
from accelplane.testing import asyncdev


def host_plugin(device_name: str, **hooks: Callable | None) -> types.ModuleType:
    """A plugin with every CPU hookimpl and one CPU-type device ``device_name``; each keyword
    replaces that hook (``None`` removes it)."""
    m = types.ModuleType(f"test_plugin_{device_name.lower()}")
    for h in HOOK_NAMES:
        if hasattr(cpu_plugin, h):
            setattr(m, h, getattr(cpu_plugin, h))

    def get_devices():
        return [DeviceSpec(device_name, "test host device", DeviceType.CPU)]

    m.get_devices = hookimpl(get_devices)
    for h, f in hooks.items():
        if f is None:
            delattr(m, h)
        else:
            setattr(m, h, hookimpl(f))
    return m


def cpu_and_async_registry(n_async: int = 2, delay_us: int | None = None) -> Registry:
    """A fresh Registry with the CPU plugin and ``n_async`` asynchronous test devices.
    ``delay_us``: the devices' max random queue delay (default: ACCELPLANE_TEST_DELAY_US, else
    the device's own default); read when a backend is created."""
    if delay_us is not None:
        os.environ["ACCELPLANE_TEST_DELAY_US"] = str(delay_us)
    # the device count is read while registering, and only this registry may see it: a count
    # left in os.environ would change what later registries and child processes find
    var = env.ASYNCDEV_NDEV.name
    old = os.environ.get(var)
    os.environ[var] = str(n_async)
    try:
        reg = Registry()
        for module, name in ((cpu_plugin, "cpu"), (asyncdev, "asynctest")):
            if reg.register(module, name) is None:
                raise RuntimeError(f"test registry: {name} failed: {reg.failures[-1].reason}")
    finally:
        if old is None:
            del os.environ[var]
        else:
            os.environ[var] = old
    return reg
