"""Fixtures of the Vulkan plugin's tests."""

from __future__ import annotations

import accelplane
import pytest
from accelplane.runtime.registry import reset_registry


@pytest.fixture
def vk_devices(monkeypatch):
    """A fresh registry with the Vulkan plugin; ``vk_devices(spec)`` sets ACCELPLANE_VK_DEVICES."""

    def open_(spec: str | None = None):
        if spec is None:
            monkeypatch.delenv("ACCELPLANE_VK_DEVICES", raising=False)
        else:
            monkeypatch.setenv("ACCELPLANE_VK_DEVICES", spec)
        reset_registry()
        reg = accelplane.get_registry()
        if "vulkan" not in reg.plugins:
            why = [f.reason for f in reg.failures if f.name == "vulkan"]
            pytest.skip(f"no device: {why[0] if why else 'the vulkan plugin is not installed'}")
        return reg.plugins["vulkan"].devices

    yield open_
    reset_registry()
