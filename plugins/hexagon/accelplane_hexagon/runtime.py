"""The objects behind the SDK's handles: the emulated device, its buffer types, its memory (host
memory that the NPU reads and writes in place, like ggml's rpcmem buffers shared between the CPU
and the DSP) and a backend with its per-backend options."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from accelplane.errors import ConfigError
from accelplane.runtime.plancache import PlanCache

from . import tuning
from .tuning import Tuning

ALIGNMENT = 128  # an HVX vector: buffers, and the regions of an op's VTCM scratch


class HtpBuffer:
    """A buffer's bytes (128-byte aligned) and whether it is a repack (weights) buffer."""

    __slots__ = ("mem", "repack")

    def __init__(self, size: int, repack: bool) -> None:
        raw = np.zeros(size + ALIGNMENT, np.uint8)
        shift = (-raw.ctypes.data) % ALIGNMENT
        self.mem = raw[shift : shift + size]
        self.repack = repack


@dataclass
class DevState:
    index: int


@dataclass
class BuftState:
    repack: bool


@dataclass(frozen=True)
class Options:
    """Per-backend settings: ``init_backend`` params (``"opbatch=8,fusion=0,acc=fp32"``) over
    the plugin's settings (tuning.py: ACCELPLANE_HEXAGON_OPBATCH, _OPFUSION, _ACC)."""

    opbatch: int = 1024
    fusion: bool = True
    acc_f16: bool = True  # per-tile matmul accumulators in fp16 (the HVX kernels'), else fp32

    @classmethod
    def parse(cls, params: str = "", base: Tuning | None = None) -> Options:
        t = base or tuning.read()
        kv = {"opbatch": str(t.opbatch), "fusion": "1" if t.fusion else "0", "acc": t.acc}
        for item in filter(None, (p.strip() for p in params.split(","))):
            k, sep, v = (x.strip() for x in item.partition("="))
            if not sep or k not in kv:
                raise ConfigError(f"HTP backend params: {item!r} is not one of opbatch=N, fusion=0|1, "
                                  "acc=fp16|fp32")  # fmt: skip
            kv[k] = v
        if not kv["opbatch"].isdigit() or int(kv["opbatch"]) < 1:
            raise ConfigError(f"HTP: opbatch must be >= 1, got {kv['opbatch']}")
        if kv["fusion"].lower() not in ("0", "1", "true", "false", "on", "off", "yes", "no"):
            raise ConfigError(f"HTP: fusion must be 1 or 0, got {kv['fusion']!r}")
        if kv["acc"] not in ("fp16", "fp32"):
            raise ConfigError(f"HTP: acc must be fp16 or fp32, got {kv['acc']!r}")
        fusion = kv["fusion"].lower() in ("1", "true", "on", "yes")
        return cls(int(kv["opbatch"]), fusion, kv["acc"] == "fp16")


class BackendState:
    """A backend: its options and the prepared plans of its graphs (plan.py)."""

    def __init__(self, opts: Options) -> None:
        from .plan import prepare

        self.opts = opts
        self.plans = PlanCache(lambda graph: prepare(graph, opts))  # builds = graphs prepared
        self.batches_sent = 0  # NPU calls made

    def compute(self, graph) -> None:
        self.batches_sent += self.plans.get(graph).run()
