"""qwen3moe (Qwen3 MoE, e.g. Qwen3-30B-A3B): llama.cpp's src/models/qwen3moe.cpp. Qwen3's
attention (per-head Q/K RMS norms, NEOX rope, ``attention.key_length`` head size) and in every
layer a mixture of experts in place of the dense FFN: a router (``ffn_gate_inp``), softmax
gating, the top ``expert_used_count`` experts with their weights renormalized, each a SwiGLU of
``expert_feed_forward_length`` (the checkpoint's ``moe_intermediate_size``; when the key is
absent llama.cpp takes ``feed_forward_length / expert_used_count``). No shared expert."""

from __future__ import annotations

from typing import Any

from accelplane.errors import GGUFError
from accelplane.models.architecture import RopeScaling
from accelplane.models.decoder import DecoderConfig
from accelplane.models.hparams import CommonHparams, Keys
from accelplane.models.qwen3 import Qwen3


class Qwen3Moe(Qwen3):
    name = "qwen3moe"
    expert_ff = True

    def extra_config(self, hp: CommonHparams, keys: Keys) -> dict[str, Any]:
        if not hp.n_expert or not hp.n_expert_used:
            raise GGUFError(f"a qwen3moe file needs {hp.arch}.expert_count and expert_used_count > 0, got "
                            f"{hp.n_expert} and {hp.n_expert_used}")  # fmt: skip
        ff_exp = keys.per_layer("expert_feed_forward_length", hp.n_layer, 0) or hp.n_ff // hp.n_expert_used
        if ff_exp <= 0:
            raise GGUFError(f"metadata key '{hp.arch}.expert_feed_forward_length' must be > 0, got {ff_exp}")
        return {**super().extra_config(hp, keys), "d_ff_exp": ff_exp}

    def synthetic_config(self, **kw: Any) -> DecoderConfig:
        if not kw.get("n_expert"):
            raise GGUFError("a synthetic qwen3moe model needs n_expert > 0 (and n_expert_used)")
        return super().synthetic_config(**kw)

    def metadata(self, cfg: DecoderConfig, scaling: RopeScaling):
        out = super().metadata(cfg, scaling)
        out["expert_feed_forward_length"] = (cfg.ff_exp, "UINT32")  # Qwen2MoeModel's set_gguf_parameters
        return out


QWEN3MOE = Qwen3Moe()
