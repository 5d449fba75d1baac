"""llama (Llama 1-3, Mistral, TinyLlama, Mixtral-style MoE): llama.cpp's src/models/llama.cpp.

Normal (GPT-J) rope: llama.cpp's converter permutes the rows of Q and K (LlamaModel.permute)
so that rotating adjacent pairs of a GGUF row equals Hugging Face's rotate-half of the
checkpoint's. Llama 3's rope scaling is the ``rope_freqs.weight`` tensor the converter computes
(one factor per rotated pair, dividing its frequency). Optional biases on Q, K, V, the output
projection and the FFN; ``output.weight`` absent = tied to the token embedding.
"""

from __future__ import annotations

import numpy as np

from accelplane.models.architecture import Architecture, RopeScaling, llama3_rope_factors
from accelplane.models.decoder import BIASED, DecoderConfig, WeightSpec


def permuted_rows(n_rows: int, n_head: int) -> np.ndarray:
    """The row order of llama.cpp's converter's ``permute(w, n_head)``: within each head, the
    first half of the rows interleaved with the second (GGUF row r = checkpoint row order[r])."""
    return np.arange(n_rows).reshape(n_head, 2, n_rows // n_head // 2).swapaxes(1, 2).reshape(-1)


class Llama(Architecture):
    name = "llama"
    biases = frozenset(BIASED) - {"output"}
    rope_freqs = True

    def metadata(self, cfg: DecoderConfig, scaling: RopeScaling):
        out = super().metadata(cfg, scaling)
        out["vocab_size"] = (cfg.n_vocab, "UINT32")
        out["rope.dimension_count"] = (cfg.rot, "UINT32")
        return out

    def row_order(self, spec: WeightSpec, cfg: DecoderConfig) -> np.ndarray | None:
        base = spec.name.rsplit(".", 2)[-2] if spec.name.startswith("blk.") else ""
        if base == "attn_q":
            return permuted_rows(spec.shape[0], cfg.n_head)
        if base == "attn_k":
            return permuted_rows(spec.shape[0], cfg.n_head_kv)
        return None

    def computed(self, spec: WeightSpec, cfg: DecoderConfig, scaling: RopeScaling) -> np.ndarray | None:
        if spec.name == "rope_freqs.weight":
            return llama3_rope_factors(cfg.rope_base, cfg.head_dim, scaling)
        return None


LLAMA = Llama()
