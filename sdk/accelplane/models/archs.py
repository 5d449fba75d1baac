"""The decoder architectures accelplane runs, by their ``general.architecture`` name, and the
configuration of a GGUF file of any of them (:func:`config_from_metadata`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from accelplane.errors import GGUFError
from accelplane.models.architecture import Architecture
from accelplane.models.decoder import DecoderConfig
from accelplane.models.gemma3 import GEMMA3
from accelplane.models.hparams import Keys, common_hparams
from accelplane.models.llama import LLAMA
from accelplane.models.qwen2 import QWEN2
from accelplane.models.qwen3 import QWEN3
from accelplane.models.qwen3moe import QWEN3MOE

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (LLAMA, QWEN2, QWEN3, QWEN3MOE, GEMMA3)}


def architecture(name: str) -> Architecture:
    """The decoder architecture called ``name``; GGUFError naming the supported ones otherwise
    (for bert, an encoder: pointing to ``accelplane embed``)."""
    a = ARCHITECTURES.get(name)
    if a is None:
        if name == "bert":
            raise GGUFError("architecture 'bert' is an embedding model: run it with accelplane embed")
        raise GGUFError(f"architecture {name!r} is not supported (accelplane models: "
                        f"{', '.join(ARCHITECTURES)}; embeddings: bert)")  # fmt: skip
    return a


def config_from_metadata(md: Mapping[str, Any], tensors: Mapping[str, Any] | None = None) -> DecoderConfig:
    """The DecoderConfig of a GGUF file's metadata ``md`` (key → MetaValue), read as llama.cpp
    reads it for its architecture. ``tensors`` (name → an object with ``.shape``) supply the
    vocabulary size when ``{arch}.vocab_size`` is absent, and say which optional tensors (the
    output head, biases, rope factors) the file has."""
    arch = architecture(Keys(md, "").get("general.architecture", str))
    return arch.config(common_hparams(md, tensors), Keys(md, arch.name), tensors or {})
