"""gemma3 (Gemma 3 text): llama.cpp's src/models/gemma3.cpp.

NEOX rope; the token embeddings times sqrt(n_embd); per-head RMS norms of Q and K before the
rope; RMS norms of the attention's and the FFN's outputs before their residual adds
(``post_attention_norm``, ``post_ffw_norm``); a GEGLU FFN with the tanh GELU; the output head tied
to the token embedding; final soft-capping when ``final_logit_softcapping`` is given.

Layers attend through a sliding window of ``attention.sliding_window`` positions except every
sixth (``attention.sliding_window_pattern``: a period, or one flag per layer), and rope with
their own frequency base (``rope.freq_base_swa``, default 10000) and no scaling; the global
layers use ``rope.freq_base`` and the linear scaling factor.

Gemma's RMS norm is ``x * (1 + w)``; the converter stores ``1 + w`` (Gemma3Model.norm_shift),
so llama.cpp, and this module, multiply by the stored weight. The attention scale is
1 / sqrt(head size) (1 / sqrt(n_embd / n_head) for the 27B model, as llama.cpp has it).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from accelplane.core.ops import ROPE_TYPE_NEOX
from accelplane.errors import GGUFError
from accelplane.models.architecture import Architecture, RopeScaling
from accelplane.models.decoder import DecoderConfig, WeightSpec
from accelplane.models.hparams import CommonHparams, Keys

SWA_PERIOD = 6  # llama.cpp's default pattern for gemma3: five sliding-window layers, one global


def _f32(x: float) -> float:
    return float(np.float32(x))


def swa_pattern(n_layers: int, period: int) -> tuple[bool, ...]:
    """llama.cpp's set_swa_pattern(period): layer il is a sliding-window layer unless
    il % period == period - 1 (period 0: all are)."""
    return tuple(period == 0 or il % period < period - 1 for il in range(n_layers))


class Gemma3(Architecture):
    name = "gemma3"
    rope_mode = ROPE_TYPE_NEOX
    default_rope_base = 1e6
    default_rms_eps = 1e-6

    def extra_config(self, hp: CommonHparams, keys: Keys) -> dict[str, Any]:
        n_swa = keys.arch("attention.sliding_window", int, 0)
        swa: tuple[bool, ...] = ()
        if n_swa > 0:
            key = f"{self.name}.attention.sliding_window_pattern"
            mv = keys.md.get(key)
            if mv is not None and isinstance(mv.value, list | tuple | np.ndarray):
                swa = tuple(bool(x) for x in mv.value)
                if len(swa) != hp.n_layer:
                    raise GGUFError(f"metadata key {key!r}: {len(swa)} flags for {hp.n_layer} "
                                    f"layers{mv.at()}")  # fmt: skip
            else:
                swa = swa_pattern(hp.n_layer, keys.arch("attention.sliding_window_pattern", int, SWA_PERIOD))
        # llama.cpp: the 27B model (62 layers) scales by n_embd / n_head, the others by the head size
        per = hp.n_embd // hp.n_head if hp.n_layer == 62 else hp.n_embd_head_k
        return dict(
            qk_norm=True, post_norms=True, ffn_act="gelu", embd_scale=_f32(math.sqrt(hp.n_embd)),
            attn_scale=_f32(1.0 / math.sqrt(per)), n_swa=n_swa if any(swa) else 0,
            swa_layers=swa if any(swa) else (),
            rope_base_swa=keys.arch("rope.freq_base_swa", float, 10000.0),
            logit_softcap=keys.arch("final_logit_softcapping", float, 0.0),
        )  # fmt: skip

    def synthetic_config(self, *, n_swa: int = 0, logit_softcap: float = 0.0, **kw: Any) -> DecoderConfig:
        """``n_swa``: the sliding window (0: none, every layer global)."""
        n_layers = kw["n_layers"]
        swa = swa_pattern(n_layers, SWA_PERIOD) if n_swa else ()
        hd = kw.get("n_embd_head") or kw["d_model"] // kw["n_head"]
        return super().synthetic_config(
            **{**kw, "tied_output": True}, qk_norm=True, post_norms=True, ffn_act="gelu",
            embd_scale=_f32(math.sqrt(kw["d_model"])), attn_scale=_f32(1.0 / math.sqrt(hd)),
            n_swa=n_swa if any(swa) else 0, swa_layers=swa if any(swa) else (), logit_softcap=logit_softcap,
        )  # fmt: skip

    def metadata(self, cfg: DecoderConfig, scaling: RopeScaling):
        out = super().metadata(cfg, scaling)
        out["attention.key_length"] = out["attention.value_length"] = (cfg.head_dim, "UINT32")
        if cfg.has_swa:
            out["rope.freq_base_swa"] = (cfg.rope_base_swa, "FLOAT32")
        if cfg.logit_softcap:
            out["final_logit_softcapping"] = (cfg.logit_softcap, "FLOAT32")
        if cfg.has_swa:
            out["attention.sliding_window"] = (cfg.n_swa, "UINT32")
        return out

    def hf_spread(self, spec: WeightSpec) -> tuple[float, float]:
        if spec.name.endswith("norm.weight"):  # the checkpoint holds w of x * (1 + w)
            return 0.0, 0.1
        return super().hf_spread(spec)

    def norm_shift(self, name: str) -> float:
        return 1.0 if name.endswith("norm.weight") else 0.0


GEMMA3 = Gemma3()
