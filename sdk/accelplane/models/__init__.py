"""Models built with the host API: the decoder of every supported architecture (llama and its
MoE variant, qwen2, qwen3, qwen3moe, gemma3), a BERT encoder for embeddings, GGUF I/O, and synthetic
model files. See :mod:`accelplane.models.decoder`, :mod:`accelplane.models.archs`,
:mod:`accelplane.models.bert` and :mod:`accelplane.models.gguf`; ``accelplane run`` and
``accelplane bench model`` use them through :mod:`accelplane.models.runner`, ``accelplane
embed`` through :class:`~accelplane.models.bert.BertModel`."""

from __future__ import annotations

from accelplane.models.archs import ARCHITECTURES, config_from_metadata
from accelplane.models.bert import BertConfig, BertModel
from accelplane.models.decoder import (
    DecoderConfig,
    DecoderModel,
    EvalResult,
    SplitKind,
    SplitRole,
    WeightSpec,
)
from accelplane.models.gguf import (
    GGUFFile,
    GGUFTensor,
    MetaValue,
    make_model,
    read_gguf,
    save_gguf,
    write_gguf,
)

# the names from when llama was the only architecture
LlamaConfig = DecoderConfig
LlamaModel = DecoderModel

__all__ = [
    "ARCHITECTURES", "BertConfig", "BertModel", "DecoderConfig", "DecoderModel", "EvalResult", "GGUFFile",
    "GGUFTensor", "LlamaConfig", "LlamaModel", "MetaValue", "SplitKind", "SplitRole", "WeightSpec",
    "config_from_metadata", "make_model", "read_gguf", "save_gguf", "write_gguf",
]  # fmt: skip
