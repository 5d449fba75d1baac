"""The plugin's ACCELPLANE_CUDA_* settings (no GPU needed): one frozen dataclass, every field a
declared variable of the plugin, defaults, and a ConfigError naming the variable for anything
else."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from accelplane import env
from accelplane.errors import ConfigError
from accelplane_cuda import tuning

README = Path(__file__).parents[1] / "README.md"


def _vars() -> dict[str, env.Var]:
    return {f.name: f.metadata["env"] for f in dataclasses.fields(tuning.Tuning)}


def test_every_setting_is_a_field_of_the_plugin():
    names = {n for n, v in env.declared().items() if v.owner == "cuda"}
    assert names == {v.name for v in _vars().values()}
    assert all(n.startswith("ACCELPLANE_CUDA_") for n in names)
    assert dataclasses.fields(tuning.Tuning) and tuning.Tuning.__dataclass_params__.frozen


def test_readme_lists_exactly_the_settings():
    listed = set(re.findall(r"^\| `(ACCELPLANE_CUDA_[A-Z0-9_]+)", README.read_text(), re.M))
    assert listed == {v.name for v in _vars().values()}


def test_defaults(monkeypatch):
    for v in _vars().values():
        monkeypatch.delenv(v.name, raising=False)
    t = tuning.read()
    assert t == tuning.Tuning()
    assert (t.graphs, t.pdl, t.offload_min_batch, t.allreduce, t.p2p_max, t.nccl_bf16_min) == (
        True, True, 32, "auto", 1 << 20, None)  # fmt: skip


@pytest.mark.parametrize(("var", "field"), [("ACCELPLANE_CUDA_PDL", "pdl"),
                                             ("ACCELPLANE_CUDA_GRAPHS", "graphs")])  # fmt: skip
def test_switches_read_through_it(monkeypatch, var, field):
    monkeypatch.setenv(var, "0")
    assert getattr(tuning.read(), field) is False
    monkeypatch.setenv(var, "1")
    assert getattr(tuning.read(), field) is True
    monkeypatch.setenv(var, "maybe")
    with pytest.raises(ConfigError, match=var):
        tuning.read()


@pytest.mark.parametrize(("var", "bad"), [("ACCELPLANE_CUDA_ALLREDUCE", "mpi"),
                                          ("ACCELPLANE_CUDA_P2P_MAX", "-1"),
                                          ("ACCELPLANE_CUDA_OFFLOAD_MIN_BATCH", "0"),
                                          ("ACCELPLANE_CUDA_NCCL_BF16_MIN", "x")])  # fmt: skip
def test_bad_values_name_the_variable(monkeypatch, var, bad):
    monkeypatch.setenv(var, bad)
    with pytest.raises(ConfigError, match=f"{var}={bad!r}"):
        tuning.read()
