"""qwen3 (Qwen3 dense): llama.cpp's src/models/qwen3.cpp. A llama layer with NEOX rope and an
RMS norm of each Q and K head before the rope (``attn_q_norm``, ``attn_k_norm``: one weight
per head dimension); the head size is the checkpoint's ``head_dim`` (written as
``attention.key_length``), not necessarily n_embd / n_head; no biases by default."""

from __future__ import annotations

from typing import Any

from accelplane.core.ops import ROPE_TYPE_NEOX
from accelplane.models.architecture import Architecture, RopeScaling
from accelplane.models.decoder import DecoderConfig
from accelplane.models.hparams import CommonHparams, Keys


class Qwen3(Architecture):
    name = "qwen3"
    rope_mode = ROPE_TYPE_NEOX
    default_rope_base = 1e6
    default_rms_eps = 1e-6

    def extra_config(self, hp: CommonHparams, keys: Keys) -> dict[str, Any]:
        return {"qk_norm": True}

    def synthetic_config(self, **kw: Any) -> DecoderConfig:
        return super().synthetic_config(**kw, qk_norm=True)

    def metadata(self, cfg: DecoderConfig, scaling: RopeScaling):
        out = super().metadata(cfg, scaling)
        # Qwen3's config always has head_dim
        out["attention.key_length"] = out["attention.value_length"] = (cfg.head_dim, "UINT32")
        return out


QWEN3 = Qwen3()
