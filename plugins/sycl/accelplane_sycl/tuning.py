"""Every knob of the SYCL plugin, in one frozen dataclass read through accelplane.env.

``read()`` parses the environment now (ConfigError for a bad value); the plugin takes a
snapshot when devices open and when a stream is made. plugins/sycl/README.md lists each variable.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelplane import env

OWNER = "sycl"


@dataclass(frozen=True)
class Tuning:
    devices: tuple[int, ...] | None = env.field(env.indices(
        "ACCELPLANE_SYCL_DEVICES",
        "device indices to open (repeats open one device as several logical devices)", OWNER))
    onemkl: bool = env.field(env.flag(
        "ACCELPLANE_SYCL_ONEMKL", True,
        "matrix products through oneMKL (dpnp) where it loads (0: the plugin's own kernels only)",
        OWNER))  # fmt: skip
    delay_us: float | None = env.field(env.TEST_DELAY_US)
    delay_seed: int | None = env.field(env.integer(
        "ACCELPLANE_SYCL_DELAY_SEED", None, "seed of the random test delays of SYCL queues",
        owner=OWNER))  # fmt: skip


def read() -> Tuning:
    """The settings as the environment gives them now."""
    return env.read(Tuning)
