"""Models built with the host API: a llama-architecture decoder (and its MoE variant), a BERT
encoder for embeddings, GGUF I/O, and synthetic model files. See :mod:`accelplane.models.llama`,
:mod:`accelplane.models.bert` and :mod:`accelplane.models.gguf`; ``accelplane run`` and
``accelplane bench model`` use them through :mod:`accelplane.models.runner`, ``accelplane
embed`` through :class:`~accelplane.models.bert.BertModel`."""

from __future__ import annotations

from accelplane.models.bert import BertConfig, BertModel
from accelplane.models.gguf import (
    GGUFFile,
    GGUFTensor,
    MetaValue,
    make_model,
    read_gguf,
    save_gguf,
    write_gguf,
)
from accelplane.models.llama import EvalResult, LlamaConfig, LlamaModel, SplitKind, SplitRole, WeightSpec

__all__ = [
    "BertConfig", "BertModel", "EvalResult", "GGUFFile", "GGUFTensor", "LlamaConfig", "LlamaModel",
    "MetaValue", "SplitKind", "SplitRole", "WeightSpec", "make_model", "read_gguf", "save_gguf", "write_gguf",
]  # fmt: skip
