"""What one decoder architecture adds to the shared pieces (:mod:`accelplane.models.hparams`
reads the keys every architecture shares, :mod:`accelplane.models.decoder` builds and runs the
graph): :class:`Architecture`, subclassed once per architecture (llama.py, qwen2.py, qwen3.py,
gemma3.py), says

* how llama.cpp reads its GGUF file into a :class:`~accelplane.models.decoder.DecoderConfig`
  (its keys beyond the shared ones, its rope type, which optional tensors it takes), and
* how llama.cpp's converter (convert_hf_to_gguf.py) writes one, for synthetic models: the
  metadata keys it writes, and what it does to Hugging Face tensors on the way (llama's Q/K row
  permutation, gemma's ``1 + w`` norms, Llama 3's computed ``rope_freqs``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from accelplane.core.ops import ROPE_TYPE_NORMAL
from accelplane.errors import GGUFError, ShapeError
from accelplane.models.decoder import DecoderConfig, WeightSpec
from accelplane.models.hparams import CommonHparams, Keys


@dataclass(frozen=True)
class RopeScaling:
    """A Hugging Face ``rope_scaling`` for synthetic models: ``kind`` none, linear (written as
    ``rope.scaling.type`` and ``rope.scaling.factor``) or llama3 (written as the
    ``rope_freqs.weight`` factors its converter computes from ``factor``, ``low_freq_factor``,
    ``high_freq_factor`` and ``original_max_position_embeddings``)."""

    kind: str = "none"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("none", "linear", "llama3"):
            raise ShapeError(f"rope scaling {self.kind!r}: none, linear or llama3")
        if not self.factor > 0 or self.low_freq_factor == self.high_freq_factor:
            raise ShapeError(f"rope scaling: factor {self.factor} must be > 0 and the low and high frequency "
                             "factors must differ")  # fmt: skip


def llama3_rope_factors(base: float, dim: int, s: RopeScaling) -> np.ndarray:
    """The ``rope_freqs`` of Llama 3's rope scaling, computed as llama.cpp's converter does
    (LlamaModel.generate_extra_tensors): one factor per rotated pair, float32."""
    freqs = 1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for freq in freqs.astype(np.float64):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)  # fmt: skip
            out.append(1 / ((1 - smooth) / s.factor + smooth))
    return np.asarray(out, np.float32)


class Architecture:
    """One decoder architecture (see the module docstring). Subclasses set the class attributes
    and override the hooks that differ from llama's."""

    name = ""
    rope_mode = ROPE_TYPE_NORMAL
    # optional ``.bias`` tensors llama.cpp's loader takes for this architecture
    biases: frozenset[str] = frozenset({"attn_q", "attn_k", "attn_v"})
    rope_freqs = False  # takes Llama 3's rope_freqs.weight
    expert_ff = False  # reads an expert FFN length (expert_feed_forward_length) other than d_ff
    # synthetic defaults, as the architecture's checkpoints have them
    default_rope_base = 10000.0
    default_rms_eps = 1e-5

    # --- reading -------------------------------------------------------------------------------
    def config(self, hp: CommonHparams, keys: Keys, tensors: Mapping[str, Any]) -> DecoderConfig:
        """The DecoderConfig of a file of this architecture (llama.cpp's load_hparams and its
        per-architecture load_arch_hparams). ``tensors``: name → an object with ``.shape`` (the
        file's; empty when only the metadata is known): they say whether the output head is
        tied, which optional biases and rope factors are there."""
        if hp.rope_scaling in ("yarn", "longrope"):
            raise GGUFError(f"metadata key '{hp.arch}.rope.scaling.type' = {hp.rope_scaling!r}: accelplane "
                            "implements rope scaling none, linear and Llama 3's rope_freqs")  # fmt: skip
        if hp.n_embd_head_k != hp.n_embd_head_v:
            raise GGUFError(f"{hp.arch}.attention.key_length {hp.n_embd_head_k} differs from value_length "
                            f"{hp.n_embd_head_v}, which accelplane's decoder does not support")  # fmt: skip
        if hp.n_rot != hp.n_embd_head_k:  # llama.cpp asserts it for these architectures
            raise GGUFError(f"{hp.arch}.rope.dimension_count {hp.n_rot} differs from the head size "
                            f"{hp.n_embd_head_k} (attention.key_length or embedding_length / head_count)")
        present = {name.rsplit(".", 2)[-2] for name in tensors if name.endswith(".bias")}
        kw: dict[str, Any] = dict(
            arch=hp.arch, n_vocab=hp.n_vocab, d_model=hp.n_embd, n_layers=hp.n_layer, n_head=hp.n_head,
            n_head_kv=hp.n_head_kv, d_ff=hp.n_ff, n_ctx_train=hp.n_ctx_train, n_expert=hp.n_expert,
            n_expert_used=hp.n_expert_used,
            rms_eps=keys.arch("attention.layer_norm_rms_epsilon", float),
            rope_base=hp.rope_freq_base, rope_mode=self.rope_mode, n_rot=hp.n_rot,
            n_embd_head=hp.n_embd_head_k if hp.n_embd_head_k * hp.n_head != hp.n_embd else 0,
            rope_scale=hp.rope_freq_scale, rope_attn_factor=hp.rope_attn_factor,
            rope_freqs=self.rope_freqs and "rope_freqs.weight" in tensors,
            tied_output=bool(tensors) and "output.weight" not in tensors,
            biases=frozenset(present & set(self.biases)) if tensors else frozenset(),
        )  # fmt: skip
        kw.update(self.extra_config(hp, keys))
        try:
            return DecoderConfig(**kw)
        except ShapeError as e:
            raise GGUFError(f"bad {hp.arch} metadata: {e}") from None

    def extra_config(self, hp: CommonHparams, keys: Keys) -> dict[str, Any]:
        """This architecture's DecoderConfig fields beyond the shared ones."""
        return {}

    # --- writing, as llama.cpp's converter does ----------------------------------------------
    def synthetic_config(self, **kw: Any) -> DecoderConfig:
        """The DecoderConfig of a synthetic model: ``kw`` as DecoderConfig's, with this
        architecture's rope mode and fixed switches."""
        return DecoderConfig(arch=self.name, rope_mode=self.rope_mode, **kw)

    def metadata(self, cfg: DecoderConfig, scaling: RopeScaling) -> dict[str, tuple[Any, str]]:
        """The ``{arch}.`` keys the converter writes for ``cfg``: key suffix → (value, GGUF value
        type name: UINT32, FLOAT32, STRING, BOOL), in the converter's order (TextModel's
        set_gguf_parameters, then the architecture's own)."""
        out: dict[str, tuple[Any, str]] = {
            "block_count": (cfg.n_layers, "UINT32"), "context_length": (cfg.n_ctx_train, "UINT32"),
            "embedding_length": (cfg.d_model, "UINT32"), "feed_forward_length": (cfg.d_ff, "UINT32"),
            "attention.head_count": (cfg.n_head, "UINT32"),
            "attention.head_count_kv": (cfg.n_head_kv, "UINT32"),
        }  # fmt: skip
        if scaling.kind == "linear":
            out["rope.scaling.type"] = ("linear", "STRING")
            out["rope.scaling.factor"] = (scaling.factor, "FLOAT32")
        out["rope.freq_base"] = (cfg.rope_base, "FLOAT32")
        out["attention.layer_norm_rms_epsilon"] = (cfg.rms_eps, "FLOAT32")
        if cfg.is_moe:
            out["expert_count"] = (cfg.n_expert, "UINT32")
            out["expert_used_count"] = (cfg.n_expert_used, "UINT32")
        if cfg.n_embd_head:  # a head_dim in the checkpoint's config
            out["attention.key_length"] = (cfg.head_dim, "UINT32")
            out["attention.value_length"] = (cfg.head_dim, "UINT32")
        return out

    def hf_spread(self, spec: WeightSpec) -> tuple[float, float]:
        """(mean, std) of the synthetic checkpoint's value of ``spec`` before conversion:
        matrices N(0, 1/K) (K = row length), the token embedding (and an encoder's position and
        token-type embeddings) N(0, 1), norms 1 + N(0, 0.1), biases N(0, 0.1)."""
        if spec.name.endswith("norm.weight"):
            return 1.0, 0.1
        if spec.name in ("token_embd.weight", "position_embd.weight", "token_types.weight"):
            return 0.0, 1.0
        if spec.name.endswith(".bias"):
            return 0.0, 0.1
        return 0.0, 1.0 / math.sqrt(spec.shape[-1])

    def norm_shift(self, name: str) -> float:
        """What the converter adds to tensor ``name`` (gemma's ``1 + w`` norms)."""
        return 0.0

    def row_order(self, spec: WeightSpec, cfg: DecoderConfig) -> np.ndarray | None:
        """The converter's row permutation of ``spec`` (GGUF row r = checkpoint row
        ``order[r]``), or None when it keeps the rows."""
        return None

    def computed(self, spec: WeightSpec, cfg: DecoderConfig, scaling: RopeScaling) -> np.ndarray | None:
        """The values of a tensor the converter computes rather than copies (float32), or None."""
        return None


__all__ = ["Architecture", "RopeScaling", "llama3_rope_factors"]
