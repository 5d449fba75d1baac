"""Every knob of the CUDA plugin, in one frozen dataclass read through accelplane.env.

``read()`` parses the environment now (ConfigError naming the variable for a bad value); the
plugin takes a snapshot where a setting is used: a device list when devices open, a stream
when a backend starts, a plan when it is built, a communicator when it is made.
plugins/cuda/README.md lists each variable.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelplane import env

OWNER = "cuda"


@dataclass(frozen=True)
class Tuning:
    """The plugin's settings (defaults: the measured best on an H200)."""

    graphs: bool = env.field(env.flag(
        "ACCELPLANE_CUDA_GRAPHS", True, "replay an unchanged graph as a CUDA graph (0: launch eagerly)",
        OWNER))  # fmt: skip
    pdl: bool = env.field(env.flag(
        "ACCELPLANE_CUDA_PDL", True, "programmatic dependent launch on sm_90+", OWNER))  # fmt: skip
    offload_min_batch: int = env.field(env.integer(
        "ACCELPLANE_CUDA_OFFLOAD_MIN_BATCH", 32,
        "batch from which the GPU takes products whose weights are in host memory", min=1,
        owner=OWNER))  # fmt: skip
    allreduce: str = env.field(env.choice(
        "ACCELPLANE_CUDA_ALLREDUCE", "auto", ("auto", "nccl", "none"),
        "comm over two or more GPUs: peer-memory kernel + NCCL, NCCL only, or none", OWNER))  # fmt: skip
    p2p_max: int = env.field(env.integer(
        "ACCELPLANE_CUDA_P2P_MAX", 1 << 20,
        "bytes up to which the peer-memory all-reduce kernel serves (0: never)", min=0,
        owner=OWNER))  # fmt: skip
    nccl_bf16_min: int | None = env.field(env.integer(
        "ACCELPLANE_CUDA_NCCL_BF16_MIN", None,
        "elements from which F32 all-reduces travel as BF16 (default by GPU count; 0: never)", min=0,
        owner=OWNER))  # fmt: skip


def read() -> Tuning:
    """The settings as the environment gives them now."""
    return env.read(Tuning)
