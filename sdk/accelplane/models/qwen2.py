"""qwen2 (Qwen2, Qwen2.5): llama.cpp's src/models/qwen2.cpp. A llama layer with NEOX rope and
biases on the Q, K and V projections (the checkpoints have them; llama.cpp takes them when
present), an optional ``output.bias``, ``output.weight`` absent = tied."""

from __future__ import annotations

from typing import Any

from accelplane.core.ops import ROPE_TYPE_NEOX
from accelplane.models.architecture import Architecture
from accelplane.models.decoder import DecoderConfig


class Qwen2(Architecture):
    name = "qwen2"
    rope_mode = ROPE_TYPE_NEOX
    biases = frozenset({"attn_q", "attn_k", "attn_v", "output"})
    default_rope_base = 1e6
    default_rms_eps = 1e-6

    def synthetic_config(self, **kw: Any) -> DecoderConfig:
        return super().synthetic_config(**{**kw, "biases": frozenset({"attn_q", "attn_k", "attn_v"})})


QWEN2 = Qwen2()
