"""The plugin's ACCELPLANE_CUDA_* settings (no GPU needed): defaults, allowed values, and a
ConfigError naming the variable for anything else."""

from __future__ import annotations

import pytest
from accelplane import env
from accelplane.errors import ConfigError
from accelplane_cuda import launch, layout, tuning


def test_every_setting_is_declared_for_the_plugin():
    names = {n for n, v in env.declared().items() if v.owner == "cuda"}
    assert names == {v.name for v in vars(tuning).values() if isinstance(v, env.Var)}
    assert all(n.startswith("ACCELPLANE_CUDA_") for n in names)


@pytest.mark.parametrize(("var", "read"), [("ACCELPLANE_CUDA_PDL", lambda: launch.pdl_wanted(90)),
                                           ("ACCELPLANE_CUDA_REPACK", layout.enabled)])  # fmt: skip
def test_switches_read_through_it(monkeypatch, var, read):
    monkeypatch.setenv(var, "0")
    assert read() is False
    monkeypatch.setenv(var, "1")
    assert read() is True
    monkeypatch.setenv(var, "maybe")
    with pytest.raises(ConfigError, match=var):
        read()


@pytest.mark.parametrize(("var", "bad"), [("ACCELPLANE_CUDA_MMVP", "4096"), ("ACCELPLANE_CUDA_MMVP", "100,2"),
                                          ("ACCELPLANE_CUDA_ALLREDUCE", "mpi"),
                                          ("ACCELPLANE_CUDA_P2P_MAX", "-1"),
                                          ("ACCELPLANE_CUDA_MMV_WARPS", "32")])  # fmt: skip
def test_bad_values_name_the_variable(monkeypatch, var, bad):
    monkeypatch.setenv(var, bad)
    v = env.declared()[var]
    with pytest.raises(ConfigError, match=f"{var}={bad!r}"):
        v.get()
