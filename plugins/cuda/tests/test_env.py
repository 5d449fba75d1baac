"""The plugin's ACCELPLANE_CUDA_* settings (no GPU needed): defaults, allowed values, and a
DeviceError naming the variable for anything else."""

from __future__ import annotations

import pytest
from accelplane.errors import DeviceError
from accelplane_cuda import env, launch, layout


def test_choice_and_flag(monkeypatch):
    monkeypatch.delenv("ACCELPLANE_CUDA_X", raising=False)
    assert env.choice("ACCELPLANE_CUDA_X", "a", ("a", "b")) == "a"
    assert env.flag("ACCELPLANE_CUDA_X") is True and env.flag("ACCELPLANE_CUDA_X", default=False) is False
    monkeypatch.setenv("ACCELPLANE_CUDA_X", "b")
    assert env.choice("ACCELPLANE_CUDA_X", "a", ("a", "b")) == "b"
    monkeypatch.setenv("ACCELPLANE_CUDA_X", "0")
    assert env.flag("ACCELPLANE_CUDA_X") is False
    for bad in ("yes", "", "2"):
        monkeypatch.setenv("ACCELPLANE_CUDA_X", bad)
        with pytest.raises(DeviceError, match="ACCELPLANE_CUDA_X must be 1 or 0"):
            env.flag("ACCELPLANE_CUDA_X")


@pytest.mark.parametrize(("var", "read"), [("ACCELPLANE_CUDA_PDL", lambda: launch.pdl_wanted(90)),
                                           ("ACCELPLANE_CUDA_REPACK", layout.enabled)])  # fmt: skip
def test_switches_read_through_it(monkeypatch, var, read):
    monkeypatch.setenv(var, "0")
    assert read() is False
    monkeypatch.setenv(var, "1")
    assert read() is True
    monkeypatch.setenv(var, "off")
    with pytest.raises(DeviceError, match=var):
        read()
