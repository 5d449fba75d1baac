"""Hyper-parameters from GGUF metadata, read as llama.cpp reads them (llama-model.cpp's
``load_hparams``, the keys of llama-arch.cpp), for every architecture alike.

:class:`Keys` reads typed values, by full key or ``{arch}.``-prefixed key (``keys.arch("block_count",
int)`` reads ``llama.block_count`` in a llama file), raising GGUFError naming the key (and its
file offset) when one is missing or of the wrong kind. :func:`common_hparams` reads the keys every
transformer architecture shares (dimensions, heads, context, rope): the decoder architectures
(:mod:`accelplane.models.archs`) and an encoder alike build their configurations from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from accelplane.errors import GGUFError

MISSING: Any = object()


def _shown(v: Any, width: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= width else r[: width - 3] + "..."


class Keys:
    """Typed reads of GGUF metadata (``md``: key → a value with ``.value`` and ``.at()``, as
    :class:`accelplane.models.gguf.MetaValue`) for architecture ``arch``."""

    def __init__(self, md: Mapping[str, Any], arch: str) -> None:
        self.md = md
        self.arch_name = arch

    def has(self, key: str) -> bool:
        return key in self.md

    def get(self, key: str, kind: type, default: Any = MISSING) -> Any:
        """The value of ``key`` as ``kind`` (int, float, bool or str; an int key also reads as a
        float); ``default`` when absent, GGUFError when absent without a default or of another kind."""
        mv = self.md.get(key)
        if mv is None:
            if default is MISSING:
                raise GGUFError(f"missing metadata key {key!r}")
            return default
        v = mv.value
        if kind is int:
            ok = isinstance(v, int | np.integer) and not isinstance(v, bool)
        elif kind is float:
            ok = isinstance(v, int | float | np.number) and not isinstance(v, bool)
        elif kind is bool:
            ok = isinstance(v, bool | np.bool_)
        else:
            ok = isinstance(v, str)
        if not ok:
            want = {int: "an integer", float: "a number", bool: "a bool"}.get(kind, "a string")
            raise GGUFError(f"metadata key {key!r} must be {want}, got {_shown(v)}{mv.at()}")
        return kind(v)

    def arch(self, key: str, kind: type, default: Any = MISSING) -> Any:
        """:meth:`get` of ``{arch}.{key}``."""
        return self.get(f"{self.arch_name}.{key}", kind, default)

    def per_layer(self, key: str, n_layers: int, default: Any = MISSING) -> int:
        """``{arch}.{key}`` given as one integer or (llama.cpp's get_key_or_arr) as an array of
        one per layer; per-layer values must all be equal here (GGUFError otherwise)."""
        full = f"{self.arch_name}.{key}"
        mv = self.md.get(full)
        if mv is None or not isinstance(mv.value, list | tuple | np.ndarray):
            return self.get(full, int, default)
        vals = [int(x) for x in mv.value]
        if len(vals) != n_layers:
            raise GGUFError(f"metadata key {full!r}: {len(vals)} values for {n_layers} layers{mv.at()}")
        if len(set(vals)) != 1:
            raise GGUFError(f"metadata key {full!r}: per-layer values {_shown(vals)} differ, which "
                            f"accelplane does not support{mv.at()}")  # fmt: skip
        return vals[0]


# rope.scaling.type values llama.cpp knows (llama_rope_scaling_type_from_string)
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")


@dataclass(frozen=True)
class CommonHparams:
    """What every transformer architecture's GGUF says the same way (llama.cpp's general
    hparams): ``n_embd_head_k/v`` default to ``n_embd / n_head``, ``n_rot`` to the key length;
    ``rope_freq_scale`` is 1 / ``rope.scaling.factor`` (1 when the type is none or no factor is
    given), ``rope_attn_factor`` ``rope.scaling.attn_factor`` (default 1)."""

    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int
    n_embd_head_k: int
    n_embd_head_v: int
    n_rot: int
    rope_freq_base: float
    rope_scaling: str
    rope_freq_scale: float
    rope_attn_factor: float
    n_expert: int = 0
    n_expert_used: int = 0


def common_hparams(md: Mapping[str, Any], tensors: Mapping[str, Any] | None = None,
                   need_ff: bool = True) -> CommonHparams:  # fmt: skip
    """The shared hyper-parameters of a GGUF's metadata ``md``. The vocabulary size is
    ``{arch}.vocab_size``, else the token embedding's rows (``tensors``: name → an object with
    ``.shape``, numpy order), else the tokenizer's token count. ``need_ff``: the feed-forward
    length is required. GGUFError naming the key when one is missing, mistyped or impossible."""
    keys = Keys(md, "")
    arch = keys.get("general.architecture", str)
    k = Keys(md, arch)
    n_layer = k.arch("block_count", int)
    if n_layer <= 0:
        raise GGUFError(f"metadata key '{arch}.block_count' must be > 0, got {n_layer}")
    n_embd = k.arch("embedding_length", int)
    n_head = k.per_layer("attention.head_count", n_layer)
    n_head_kv = k.per_layer("attention.head_count_kv", n_layer, n_head)
    n_ff = k.per_layer("feed_forward_length", n_layer, MISSING if need_ff else 0)
    emb = (tensors or {}).get("token_embd.weight")
    toks = md.get("tokenizer.ggml.tokens")
    n_vocab = k.arch("vocab_size", int, emb.shape[0] if emb is not None else
                     len(toks.value) if toks is not None else MISSING)  # fmt: skip
    for key, v in (("embedding_length", n_embd), ("attention.head_count", n_head),
                   ("attention.head_count_kv", n_head_kv), ("vocab_size", n_vocab)):  # fmt: skip
        if v <= 0:
            raise GGUFError(f"metadata key '{arch}.{key}' must be > 0, got {v}")
    hd = n_embd // n_head
    hk = k.arch("attention.key_length", int, hd)
    hv = k.arch("attention.value_length", int, hd)
    scaling = k.arch("rope.scaling.type", str, "linear")
    if scaling not in ROPE_SCALING_TYPES:
        raise GGUFError(f"metadata key '{arch}.rope.scaling.type' = {scaling!r} is not a rope scaling type "
                        f"({', '.join(ROPE_SCALING_TYPES)})")  # fmt: skip
    factor = k.arch("rope.scaling.factor", float, 0.0) or k.arch("rope.scale_linear", float, 0.0)
    if factor < 0 or not math.isfinite(factor):
        raise GGUFError(f"metadata key '{arch}.rope.scaling.factor' must be >= 0, got {factor}")
    return CommonHparams(
        arch=arch, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
        n_ff=n_ff, n_ctx_train=k.arch("context_length", int), n_embd_head_k=hk, n_embd_head_v=hv,
        n_rot=k.arch("rope.dimension_count", int, hk),
        rope_freq_base=k.arch("rope.freq_base", float, 10000.0), rope_scaling=scaling,
        rope_freq_scale=1.0 if scaling == "none" or factor == 0 else 1.0 / factor,
        rope_attn_factor=k.arch("rope.scaling.attn_factor", float, 1.0),
        n_expert=k.arch("expert_count", int, 0), n_expert_used=k.per_layer("expert_used_count", n_layer, 0),
    )  # fmt: skip
