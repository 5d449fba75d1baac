"""Models built with the host API: a llama-architecture decoder (and its MoE variant), GGUF
I/O, and synthetic model files. See :mod:`accelplane.models.llama` and
:mod:`accelplane.models.gguf`; ``accelplane run`` and ``accelplane bench model`` use them
through :mod:`accelplane.models.runner`."""

from __future__ import annotations

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
    "EvalResult", "GGUFFile", "GGUFTensor", "LlamaConfig", "LlamaModel", "MetaValue", "SplitKind",
    "SplitRole", "WeightSpec", "make_model", "read_gguf", "save_gguf", "write_gguf",
]  # fmt: skip
