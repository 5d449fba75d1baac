"""Every knob of the Hexagon plugin, in one frozen dataclass read through accelplane.env.

``read()`` parses the environment now (ConfigError for a bad value): when devices open (the
device count) and when a backend is made (its defaults, which ``init_backend`` params
override). plugins/hexagon/README.md lists each variable.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelplane import env

OWNER = "hexagon"
MAX_DEVICES = 16


@dataclass(frozen=True)
class Tuning:
    ndev: int = env.field(env.integer(
        "ACCELPLANE_HEXAGON_NDEV", 1, "emulated HTP devices to open", min=0, max=MAX_DEVICES,
        owner=OWNER))  # fmt: skip
    opbatch: int = env.field(env.integer(
        "ACCELPLANE_HEXAGON_OPBATCH", 1024, "ops per batch (one NPU call each)", min=1, owner=OWNER))
    fusion: bool = env.field(env.flag(
        "ACCELPLANE_HEXAGON_OPFUSION", True, "fuse ops into one NPU op where the kernels allow", OWNER))
    acc: str = env.field(env.choice(
        "ACCELPLANE_HEXAGON_ACC", "fp16", ("fp16", "fp32"),
        "matmul accumulators: fp16 (the HVX kernels') or fp32", OWNER))  # fmt: skip


def read() -> Tuning:
    """The settings as the environment gives them now."""
    return env.read(Tuning)
