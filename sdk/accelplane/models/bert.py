"""BERT on the host API: llama.cpp's ``bert`` architecture (``llama_model_bert``), written as
accelplane graph ops, for two users:

* GGUF embedding models (:class:`BertModel`, ``accelplane embed``): metadata keys and tensor
  names as llama.cpp reads them (``bert.block_count``, ``bert.embedding_length``,
  ``bert.attention.layer_norm_epsilon``, ``bert.pooling_type``, ``tokenizer.ggml.token_type_count``,
  ...; ``token_embd``, ``token_types``, ``position_embd``, ``token_embd_norm``,
  ``blk.N.attn_q`` ...), and synthetic files written the way convert_hf_to_gguf.py writes a
  converted BERT (:func:`synthetic_sources`, ``accelplane make-model --arch bert``);
* ``accelplane bench graph``: the same encoder with random float32 weights
  (:func:`random_weights`) beside :func:`torch_encoder`, the same function in PyTorch.

The forward pass, for a batch of sequences padded to one length: token embeddings (GET_ROWS)
+ row 0 of the token-type embeddings (llama.cpp gives every token type 0) + position
embeddings (GET_ROWS of positions 0, 1, ...), LayerNorm; per layer: Q, K, V projections with
their biases, multi-head self-attention (SOFT_MAX with scale 1/sqrt(head_dim) and a mask that
hides padding keys), output projection, residual, LayerNorm; FFN (up, GELU, down, with
biases), residual, LayerNorm; then pooling as ``bert.pooling_type`` says: the mean over the
sequence's tokens, its first (CLS) or last token, or none (every token's vector). Padded keys
get probability 0 and padded rows are never pooled, so a sequence's result does not depend on
what it was batched with. The FFN's GELU is llama.cpp's (ggml_gelu, the tanh form) for GGUF
models, the exact erf form for the benchmark (PyTorch's default). Biases llama.cpp treats as
optional (Q/K/V, attention output, FFN) and the token-type embeddings may be absent from a
file; the graph then omits them.

Embedding output (:meth:`BertModel.embed`) is normalized as llama.cpp's embedding tool does it
(:func:`normalize`, ``--embd-normalize``: Euclidean by default).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

import numpy as np

from accelplane.core.graph import Context, Graph
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType, parse_type
from accelplane.errors import ConfigError, DeviceError, GGUFError, OutOfRangeError, ShapeError, TokenizerError
from accelplane.interface import DeviceType
from accelplane.models.decoder import WeightSpec, copy_weight_bytes, set_weight_values, with_weights_of
from accelplane.models.hparams import Keys, common_hparams
from accelplane.runtime.alloc import alloc_tensors
from accelplane.runtime.backend import Backend, Buffer, BufferUsage, Device
from accelplane.sched import Scheduler

if TYPE_CHECKING:
    from accelplane.models.gguf import GGUFFile, MetaValue, TensorSource

T = GGMLType
ARCH = "bert"


class Pooling(IntEnum):
    """``bert.pooling_type`` (llama.cpp's ``llama_pooling_type``). RANK (a classifier head)
    is not supported."""

    NONE = 0
    MEAN = 1
    CLS = 2
    LAST = 3
    RANK = 4


def parse_pooling(p: Pooling | str | int) -> Pooling:
    """A pooling from its name (none, mean, cls, last) or value; ConfigError otherwise, and for RANK."""
    try:
        out = Pooling[p.upper()] if isinstance(p, str) else Pooling(int(p))
    except (KeyError, ValueError):
        raise ConfigError(f"pooling {p!r}: expected none, mean, cls or last") from None
    if out is Pooling.RANK:
        raise ConfigError("pooling 'rank' (a classifier head) is not supported: use none, mean, cls or last")
    return out


ACTIVATIONS = ("gelu", "gelu_erf")  # llama.cpp's bert FFN (tanh form); the exact one (HF, PyTorch)


@dataclass(frozen=True)
class BertConfig:
    """Hyper-parameters, named as :class:`~accelplane.models.decoder.DecoderConfig`'s (``n_ctx_train``
    = ``bert.context_length`` = rows of the position embeddings)."""

    n_layers: int = 6
    d_model: int = 384
    n_head: int = 12
    d_ff: int = 1536
    n_vocab: int = 8192
    n_ctx_train: int = 512
    eps: float = 1e-12
    n_token_types: int = 0  # rows of token_types.weight (tokenizer.ggml.token_type_count); 0: none
    pooling: Pooling = Pooling.MEAN
    act: str = "gelu"

    def __post_init__(self) -> None:
        sizes = dict(n_layers=self.n_layers, d_model=self.d_model, n_head=self.n_head, d_ff=self.d_ff,
                     n_vocab=self.n_vocab, n_ctx_train=self.n_ctx_train)  # fmt: skip
        for k, v in sizes.items():
            if v < 1:
                raise ShapeError(f"bert config: {k} must be > 0, got {v}")
        if self.n_token_types < 0:
            raise ShapeError(f"bert config: n_token_types must be >= 0, got {self.n_token_types}")
        if self.d_model % self.n_head:
            raise ShapeError(f"bert config: d_model {self.d_model} is not a multiple of n_head {self.n_head}")
        if not (math.isfinite(self.eps) and self.eps >= 0):
            raise ShapeError(f"bert config: eps must be finite and >= 0, got {self.eps}")
        object.__setattr__(self, "pooling", parse_pooling(self.pooling))
        if self.act not in ACTIVATIONS:
            raise ConfigError(f"bert config: act {self.act!r} is not one of {', '.join(ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def weights(self) -> list[WeightSpec]:
        """Every weight, in llama.cpp's GGUF names (shapes numpy-ordered: a linear layer's weight
        is [out, in]). ``matrix``: quantizable (the position and token-type embeddings stay F32,
        as convert_hf_to_gguf.py keeps them)."""
        d, f = self.d_model, self.d_ff
        out = [WeightSpec("token_embd.weight", (self.n_vocab, d), -1, True)]
        if self.n_token_types:
            out.append(WeightSpec("token_types.weight", (self.n_token_types, d), -1, False))
        out += [WeightSpec("position_embd.weight", (self.n_ctx_train, d), -1, False),
                WeightSpec("token_embd_norm.weight", (d,), -1, False),
                WeightSpec("token_embd_norm.bias", (d,), -1, False)]  # fmt: skip
        for i in range(self.n_layers):
            for name, rows, cols in (("attn_q", d, d), ("attn_k", d, d), ("attn_v", d, d),
                                     ("attn_output", d, d), ("attn_output_norm", d, 0), ("ffn_up", f, d),
                                     ("ffn_down", d, f), ("layer_output_norm", d, 0)):  # fmt: skip
                p = f"blk.{i}.{name}"
                out.append(WeightSpec(p + ".weight", (rows, cols) if cols else (rows,), i, bool(cols)))
                out.append(WeightSpec(p + ".bias", (rows,), i, False))
        return out

    def optional(self) -> frozenset[str]:
        """The weights llama.cpp loads when present (TENSOR_NOT_REQUIRED): the token-type
        embeddings and the projections' biases."""
        names = {"token_types.weight"}
        for i in range(self.n_layers):
            names |= {f"blk.{i}.{n}.bias" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up",
                                                     "ffn_down")}  # fmt: skip
        return frozenset(names)


# llama.cpp's bert tensors that only its RANK pooling (a classifier head) reads: tolerated, unused
CLASSIFIER_TENSORS = frozenset({"cls.weight", "cls.bias", "cls.output.weight", "cls.output.bias"})

PRESETS = {  # `accelplane bench graph --preset`: compared with PyTorch, so the exact GELU
    "bert-mini": BertConfig(act="gelu_erf"),  # MiniLM-L6-sized: 6 layers, d 384, 12 heads, FFN 1536
    "bert-tiny": BertConfig(n_layers=2, d_model=64, n_head=4, d_ff=128, n_vocab=512, n_ctx_train=128,
                            act="gelu_erf"),  # fmt: skip
}
# `accelplane make-model --arch bert --preset`: synthetic_sources keywords; mini has
# all-MiniLM-L6-v2's shapes (30522 WordPiece tokens, 2 token types)
MODEL_PRESETS = {
    "tiny": dict(n_layers=2, d_model=64, n_head=4, d_ff=256, n_vocab=512, n_ctx=512),
    "mini": dict(n_layers=6, d_model=384, n_head=12, d_ff=1536, n_vocab=30522, n_ctx=512),
}


def weight_shapes(cfg: BertConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's numpy shape by GGUF name."""
    return {s.name: s.shape for s in cfg.weights()}


_EMBEDDINGS = ("token_embd.weight", "position_embd.weight", "token_types.weight")


def random_weights(cfg: BertConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights of a trained model's scale: N(0, 0.02) matrices and biases, embeddings
    N(0, 1), LayerNorm gains 1 + N(0, 0.1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            v = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            v = 0.02 * rng.standard_normal(shape) * (50.0 if name in _EMBEDDINGS else 1.0)
        out[name] = v.astype(np.float32)
    return out


def random_batch(cfg: BertConfig, batch: int, seq: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [batch, seq] and a padding mask [batch, seq] (1 = token, 0 = padding): lengths
    from half the sequence to all of it, the first row full."""
    if not 1 <= seq <= cfg.n_ctx_train:
        raise ShapeError(f"sequence length {seq} must be in 1..{cfg.n_ctx_train}")
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.n_vocab, (batch, seq)).astype(np.int32)
    lengths = rng.integers(max(1, seq // 2), seq + 1, batch)
    lengths[0] = seq
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float32)
    return ids, mask


# --- the graph -----------------------------------------------------------------------------------
@dataclass
class Encoder:
    """The built graph's handles: weights by name, the inputs, the output: [batch, 1, d] pooled
    by the mean, [batch, d] by CLS or LAST, [batch, seq, d] with no pooling."""

    ctx: Context
    weights: Mapping[str, Tensor]
    cfg: BertConfig
    pooling: Pooling
    batch: int
    seq: int
    ids: Tensor  # I32 [batch * seq]
    pos: Tensor  # I32 [seq]: positions 0 .. seq-1 (rows of position_embd)
    types: Tensor | None  # I32 [1]: 0, the token-type row every token gets
    attn_mask: Tensor  # F32 [batch, 1, seq, seq]: 0 where a query sees a key, -inf elsewhere
    pool: Tensor | None  # MEAN: F32 [batch, 1, seq], mask / length, the mean's weights
    rows: Tensor | None  # CLS, LAST: I32 [batch], the pooled token's row in [batch * seq]
    out: Tensor

    def inputs(self, ids: np.ndarray, mask: np.ndarray) -> dict[Tensor, np.ndarray]:
        """Input values for token ids [batch, seq] and a padding mask [batch, seq] (1 = token,
        0 = padding; each row's tokens first, at least one). ShapeError otherwise."""
        ids, mask = np.asarray(ids), np.asarray(mask)
        b, s = self.batch, self.seq
        if ids.shape != (b, s) or mask.shape != (b, s):
            raise ShapeError(f"encoder inputs: ids {ids.shape} and mask {mask.shape} must both be {(b, s)}")
        valid = mask > 0
        lengths = valid.sum(axis=1)
        if lengths.min() < 1 or (valid != (np.arange(s)[None, :] < lengths[:, None])).any():
            raise ShapeError("encoder inputs: each mask row must be ones (at least one) then zeros")
        key = np.where(valid, 0.0, -np.inf).astype(np.float32)
        attn = np.broadcast_to(key[:, None, None, :], (b, 1, s, s))
        vals = {self.ids: ids.reshape(-1).astype(np.int32), self.pos: np.arange(s, dtype=np.int32),
                self.attn_mask: attn}  # fmt: skip
        if self.types is not None:
            vals[self.types] = np.zeros(1, np.int32)
        if self.pool is not None:
            vals[self.pool] = (mask / lengths[:, None])[:, None, :].astype(np.float32)
        if self.rows is not None:
            first = np.arange(b) * s
            vals[self.rows] = (first if self.pooling is Pooling.CLS else first + lengths - 1).astype(np.int32)
        return vals


def new_weights(ctx: Context, cfg: BertConfig, types: Mapping[str, GGMLType | str | int] | None = None,
                ) -> dict[str, Tensor]:  # fmt: skip
    """Weight tensors in ``ctx``: one per name of ``types`` (its type), default every weight of
    ``cfg`` in F32."""
    types = types if types is not None else {s.name: T.F32 for s in cfg.weights()}
    shapes = weight_shapes(cfg)
    return {n: ctx.new_tensor(parse_type(ty), shapes[n], n).set_param() for n, ty in types.items()}


def build_encoder(cfg: BertConfig, batch: int, seq: int, ctx: Context | None = None,
                  weights: Mapping[str, Tensor] | None = None,
                  pooling: Pooling | str | None = None) -> Encoder:  # fmt: skip
    """The encoder's graph (module docstring) for ``batch`` sequences padded to ``seq`` tokens.
    ``weights``: tensors by GGUF name (any of :meth:`BertConfig.optional` may be missing), made
    anywhere; default: new F32 tensors in ``ctx`` for every weight. ``pooling``: default the
    config's."""
    if batch < 1 or not 1 <= seq <= cfg.n_ctx_train:
        raise ShapeError(f"batch {batch} and sequence length {seq} must be >= 1, the length at most "
                         f"{cfg.n_ctx_train} (the model's context)")  # fmt: skip
    pooling = cfg.pooling if pooling is None else parse_pooling(pooling)
    ctx = ctx or Context("bert")
    w = weights if weights is not None else new_weights(ctx, cfg)
    shapes = weight_shapes(cfg)
    for name, shape in shapes.items():
        t = w.get(name)
        if t is None and name not in cfg.optional():
            raise ShapeError(f"bert encoder: weight {name!r} is missing")
        if t is not None and tuple(t.shape) != shape:
            raise ShapeError(f"bert encoder: weight {name!r} has shape {tuple(t.shape)}, the config "
                             f"needs {shape}")  # fmt: skip
    d, h, dh = cfg.d_model, cfg.n_head, cfg.head_dim
    ids = ctx.new_tensor(T.I32, (batch * seq,), "inp_tokens").set_input()
    pos = ctx.new_tensor(T.I32, (seq,), "inp_pos").set_input()
    attn_mask = ctx.new_tensor(T.F32, (batch, 1, seq, seq), "inp_kq_mask").set_input()

    def linear(x: Tensor, name: str) -> Tensor:
        y = ctx.mul_mat(w[f"{name}.weight"], x)
        b = w.get(f"{name}.bias")
        return y if b is None else ctx.add(y, b)

    def layer_norm(x: Tensor, name: str) -> Tensor:
        return ctx.add(ctx.mul(ctx.norm(x, cfg.eps), w[f"{name}.weight"]), w[f"{name}.bias"])

    def heads(x: Tensor) -> Tensor:  # [batch, seq, d] -> [batch, heads, seq, dh]
        return ctx.permute(ctx.reshape(x, (batch, seq, h, dh)), 0, 2, 1, 3)

    act = ctx.gelu if cfg.act == "gelu" else ctx.gelu_erf
    x = ctx.get_rows(w["token_embd.weight"], ids)  # [batch * seq, d]
    types = None
    if "token_types.weight" in w:
        types = ctx.new_tensor(T.I32, (1,), "inp_token_type").set_input()
        x = ctx.add(x, ctx.get_rows(w["token_types.weight"], types))
    x = ctx.add(ctx.reshape(x, (batch, seq, d)), ctx.get_rows(w["position_embd.weight"], pos))
    x = layer_norm(x, "token_embd_norm")
    for i in range(cfg.n_layers):
        p = f"blk.{i}"
        q, k = heads(linear(x, f"{p}.attn_q")), heads(linear(x, f"{p}.attn_k"))
        vt = ctx.cont(ctx.permute(ctx.reshape(linear(x, f"{p}.attn_v"), (batch, seq, h, dh)), 1, 2, 0, 3))
        probs = ctx.soft_max(ctx.mul_mat(k, q), attn_mask, 1.0 / math.sqrt(dh))
        att = ctx.cont(ctx.permute(ctx.mul_mat(vt, probs), 0, 2, 1, 3))  # [batch, seq, heads, dh]
        o = linear(ctx.reshape(att, (batch, seq, d)), f"{p}.attn_output")
        x = layer_norm(ctx.add(o, x), f"{p}.attn_output_norm")
        ff = linear(act(linear(x, f"{p}.ffn_up")), f"{p}.ffn_down")
        x = layer_norm(ctx.add(ff, x), f"{p}.layer_output_norm")
    pool = rows = None
    if pooling is Pooling.MEAN:
        pool = ctx.new_tensor(T.F32, (batch, 1, seq), "inp_mean").set_input()
        out = ctx.mul_mat(ctx.cont(ctx.permute(x, 1, 0, 2, 3)), pool)  # [batch, d, seq] by the weights
    elif pooling in (Pooling.CLS, Pooling.LAST):
        rows = ctx.new_tensor(T.I32, (batch,), "inp_cls").set_input()
        out = ctx.get_rows(ctx.reshape(x, (batch * seq, d)), rows)
    else:
        out = x
    out.name = "result_embd_pooled" if pooling is not Pooling.NONE else "result_embd"
    return Encoder(ctx, w, cfg, pooling, batch, seq, ids, pos, types, attn_mask, pool, rows, out)


def torch_encoder(cfg: BertConfig, weights: dict[str, np.ndarray], device: str = "cpu"):
    """The same function in PyTorch, float32, eager (scaled_dot_product_attention, as current
    encoders use), mean pooling: a callable ``(ids [batch, seq] int, mask [batch, seq] float) ->
    [batch, d]`` numpy, weights uploaded once to ``device``."""
    import torch
    import torch.nn.functional as F

    if cfg.pooling is not Pooling.MEAN:
        raise ConfigError("torch_encoder computes the mean-pooled encoder")
    dev = torch.device(device)
    tw = {n: torch.from_numpy(v).to(dev) for n, v in weights.items()}
    h, d = cfg.n_head, cfg.d_model
    approximate = "tanh" if cfg.act == "gelu" else "none"

    def ln(x, name):
        return F.layer_norm(x, (d,), tw[f"{name}.weight"], tw[f"{name}.bias"], cfg.eps)

    def lin(x, name):
        return F.linear(x, tw[f"{name}.weight"], tw.get(f"{name}.bias"))

    @torch.inference_mode()
    def run(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        b, s = ids.shape
        t_ids = torch.from_numpy(ids.astype(np.int64)).to(dev)
        t_mask = torch.from_numpy(mask).to(dev)
        x = F.embedding(t_ids, tw["token_embd.weight"]) + tw["position_embd.weight"][:s]
        if "token_types.weight" in tw:
            x = x + tw["token_types.weight"][0]
        x = ln(x, "token_embd_norm")
        key = torch.zeros((b, 1, 1, s), device=dev).masked_fill(t_mask[:, None, None, :] == 0, float("-inf"))
        for i in range(cfg.n_layers):
            p = f"blk.{i}"
            q, k, v = (lin(x, f"{p}.attn_{n}").view(b, s, h, d // h).transpose(1, 2) for n in "qkv")
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=key).transpose(1, 2).reshape(b, s, d)
            x = ln(x + lin(att, f"{p}.attn_output"), f"{p}.attn_output_norm")
            ff = lin(F.gelu(lin(x, f"{p}.ffn_up"), approximate=approximate), f"{p}.ffn_down")
            x = ln(x + ff, f"{p}.layer_output_norm")
        pooled = (x * t_mask[:, :, None]).sum(1) / t_mask.sum(1, keepdim=True)
        return pooled.cpu().numpy()

    return run


# --- normalization -------------------------------------------------------------------------------
def check_norm(p: int) -> int:
    """``p`` if it is a normalization :func:`normalize` takes, else ConfigError."""
    if isinstance(p, bool) or not isinstance(p, int | np.integer) or p < -1:
        raise ConfigError(f"normalize: p must be an integer >= -1 (-1 none, 0 max absolute, 1 taxicab, "
                          f"2 Euclidean, >2 p-norm), got {p!r}")  # fmt: skip
    return int(p)


def normalize(v: np.ndarray, p: int = 2) -> np.ndarray:
    """Each row of ``v`` scaled as llama.cpp's ``common_embd_normalize(.., embd_norm=p)``: -1 none,
    0 by max |x| / 32760 (the int16 range), 2 Euclidean (the default), any other p >= 1 the
    p-norm; a row whose norm is 0 becomes zeros. Float32 out, computed in float64."""
    p = check_norm(p)
    x = np.asarray(v, dtype=np.float32)
    if p == -1:
        return x.copy()
    a = np.abs(x.astype(np.float64))
    if p == 0:
        s = a.max(axis=-1, keepdims=True) / 32760.0
    elif p == 2:
        s = np.sqrt((a * a).sum(axis=-1, keepdims=True))
    else:
        s = (a**p).sum(axis=-1, keepdims=True) ** (1.0 / p)
    scale = np.divide(1.0, s, out=np.zeros_like(s), where=s > 0)
    return (x * scale).astype(np.float32)  # in float64: 1 / s of a tiny row overflows float32


# --- GGUF ----------------------------------------------------------------------------------------
def config_from_gguf(f: GGUFFile) -> BertConfig:
    """The hyper-parameters of a ``bert`` file, read as llama.cpp reads them: sizes from
    ``bert.*`` (``attention.layer_norm_epsilon`` required, ``pooling_type`` default none;
    ``attention.causal`` is not read: llama.cpp runs a model without a KV cache through its
    encoder, whose attention is bidirectional), ``tokenizer.ggml.token_type_count``
    (required, as llama.cpp requires it), the vocabulary from ``token_embd.weight``. GGUFError
    naming the file and the key otherwise, and for what accelplane's bert does not do: grouped
    KV heads, head sizes other than embedding_length / head_count, RANK pooling."""
    where = f"{f.path}: " if f.path else ""
    md = f.metadata
    try:
        arch = Keys(md, ARCH).get("general.architecture", str)
        if arch != ARCH:
            raise GGUFError(f"architecture {arch!r} is not bert")
        emb = f.tensors.get("token_embd.weight")
        if emb is None or len(emb.shape) != 2:
            raise GGUFError("missing tensor 'token_embd.weight' (2 dims), whose rows are the vocabulary")
        hp = common_hparams(md, f.tensors)  # the keys bert shares with the decoders, as llama.cpp reads them
        k, a = Keys(md, ARCH), ARCH + "."
        if hp.n_head_kv != hp.n_head:
            raise GGUFError(f"{a}attention.head_count_kv = {hp.n_head_kv} differs from head_count = "
                            f"{hp.n_head} (grouped KV heads), which accelplane's bert does not "
                            "support")  # fmt: skip
        hd = hp.n_embd // hp.n_head
        if hp.n_embd % hp.n_head == 0:
            for key, v in (("key_length", hp.n_embd_head_k), ("value_length", hp.n_embd_head_v)):
                if v != hd:
                    raise GGUFError(f"{a}attention.{key} = {v} differs from embedding_length / head_count = "
                                    f"{hd}, which accelplane's bert does not support")  # fmt: skip
        n_types = k.get("tokenizer.ggml.token_type_count", int, 0)
        if n_types == 0:
            raise GGUFError("missing metadata key 'tokenizer.ggml.token_type_count' (llama.cpp's bert needs "
                            "the token type count; convert_hf_to_gguf.py writes it)")  # fmt: skip
        pooling = k.arch("pooling_type", int, int(Pooling.NONE))
        if pooling not in (0, 1, 2, 3):
            what = "RANK (a classifier head)" if pooling == Pooling.RANK else "unknown"
            raise GGUFError(f"{a}pooling_type = {pooling} is {what}; accelplane's bert pools by none (0), "
                            f"mean (1), cls (2) or last (3){md[a + 'pooling_type'].at()}")  # fmt: skip
        n_layers = hp.n_layer
        if n_layers > len(f.tensors):  # a corrupted block count: do not list its weights
            i = next(i for i in range(len(f.tensors) + 1) if f"blk.{i}.attn_q.weight" not in f.tensors)
            raise GGUFError(f"missing tensor 'blk.{i}.attn_q.weight' required by the bert.* metadata "
                            f"({a}block_count = {n_layers})")  # fmt: skip
        toks = md.get("tokenizer.ggml.tokens")
        if toks is not None and len(toks.value) != emb.shape[0]:
            raise GGUFError(f"tokenizer.ggml.tokens has {len(toks.value)} tokens, token_embd.weight "
                            f"{emb.shape[0]} rows{toks.at()}")  # fmt: skip
        return BertConfig(
            n_layers=n_layers, d_model=hp.n_embd, n_head=hp.n_head, d_ff=hp.n_ff, n_vocab=emb.shape[0],
            n_ctx_train=hp.n_ctx_train, eps=k.arch("attention.layer_norm_epsilon", float),
            n_token_types=n_types,
            pooling=Pooling(pooling), act="gelu",
        )  # fmt: skip
    except (ShapeError, ConfigError) as e:
        raise GGUFError(f"{where}bad bert metadata: {e}") from None
    except GGUFError as e:
        raise GGUFError(f"{where}{e}") from None


def check_gguf_tensors(f: GGUFFile, cfg: BertConfig) -> None:
    """Every tensor ``cfg`` needs is present (the optional ones may be absent) with its shape,
    embeddings other than the token embedding, norms and biases of a float type, and no tensor
    a bert model does not have; GGUFError naming it otherwise."""
    from accelplane.models.gguf import check_weights

    check_weights(f, cfg.weights(), ARCH, optional=cfg.optional(), ignored=CLASSIFIER_TENSORS,
                  must_be_float=lambda s: not s.matrix)  # fmt: skip


def describe(f: GGUFFile) -> str:
    """One line: name, architecture, shapes, pooling, parameters, bytes and types."""
    from accelplane.models.gguf import total_bytes

    cfg = config_from_gguf(f)
    types = sorted({t.type.name.lower() for t in f.tensors.values()})
    n_params = sum(int(np.prod(t.shape)) for t in f.tensors.values())
    return (f"{f.get('general.name', f.path.name if f.path else '?')}: bert, {cfg.n_layers} layers, d_model "
            f"{cfg.d_model}, {cfg.n_head} heads, d_ff {cfg.d_ff}, vocab {cfg.n_vocab}, context "
            f"{cfg.n_ctx_train}, pooling {cfg.pooling.name.lower()}, {n_params / 1e6:.1f}M params, "
            f"{total_bytes(f) / 2**20:.1f} MiB ({'/'.join(types)})")  # fmt: skip


def vocabulary(n_vocab: int) -> tuple[list[str], list[int]]:
    """A WordPiece vocabulary laid out as bert-base's and stored as convert_hf_to_gguf.py stores
    one (phantom space: a word-initial piece gets U+2581 in front, a ``##`` continuation loses its
    ``##``): [PAD] 0, [unused0..98], [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103, then word-initial
    and continuation pieces of every lowercase letter, digit and ASCII punctuation mark, a few
    whole words, and placeholders up to ``n_vocab`` (at least 104). Token types: CONTROL (3) for
    the five special tokens, NORMAL (1) for the others."""
    if n_vocab < 104:
        raise ShapeError(f"a bert vocabulary needs at least 104 tokens ([MASK] is 103), got {n_vocab}")
    special = {0: "[PAD]", 100: "[UNK]", 101: "[CLS]", 102: "[SEP]", 103: "[MASK]"}
    toks = [special.get(i, f"\u2581[unused{i - 1}]") for i in range(104)]
    chars = "abcdefghijklmnopqrstuvwxyz0123456789" + "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
    words = ["the", "of", "and", "to", "in", "is", "hello", "world", "embed", "model", "text", "token"]
    toks += [f"\u2581{c}" for c in chars] + list(chars) + [f"\u2581{w}" for w in words]
    toks += [f"\u2581w{i}" for i in range(len(toks), n_vocab)]
    toks = toks[:n_vocab]
    return toks, [3 if i in special else 1 for i in range(n_vocab)]


def gguf_metadata(cfg: BertConfig, name: str = "", file_type: int | None = None,
                  tokenizer: bool = True) -> dict[str, MetaValue]:  # fmt: skip
    """llama.cpp's metadata for ``cfg``, keys and value types as convert_hf_to_gguf.py writes them
    for a BERT (``bert.attention.causal`` false, ``bert.pooling_type`` as a sentence-transformers
    model's pooling config gives it). ``tokenizer``: the WordPiece vocabulary of
    :func:`vocabulary` with bert-base's special token ids."""
    from accelplane.models.gguf import MetaValue, _gguf

    V = _gguf().GGUFValueType
    a = ARCH + "."
    md: dict[str, MetaValue] = {"general.architecture": MetaValue(ARCH, V.STRING)}
    if name:
        md["general.name"] = MetaValue(name, V.STRING)
    for k, v in (("block_count", cfg.n_layers), ("context_length", cfg.n_ctx_train),
                 ("embedding_length", cfg.d_model), ("feed_forward_length", cfg.d_ff),
                 ("attention.head_count", cfg.n_head)):  # fmt: skip
        md[a + k] = MetaValue(int(v), V.UINT32)
    md[a + "attention.layer_norm_epsilon"] = MetaValue(float(np.float32(cfg.eps)), V.FLOAT32)
    if file_type is not None:
        md["general.file_type"] = MetaValue(int(file_type), V.UINT32)
    md[a + "attention.causal"] = MetaValue(False, V.BOOL)
    md[a + "pooling_type"] = MetaValue(int(cfg.pooling), V.UINT32)
    md["tokenizer.ggml.token_type_count"] = MetaValue(max(1, cfg.n_token_types), V.UINT32)
    if tokenizer:
        toks, ttype = vocabulary(cfg.n_vocab)
        md["tokenizer.ggml.model"] = MetaValue("bert", V.STRING)
        md["tokenizer.ggml.pre"] = MetaValue("default", V.STRING)
        md["tokenizer.ggml.tokens"] = MetaValue(toks, V.ARRAY, V.STRING)
        md["tokenizer.ggml.token_type"] = MetaValue(ttype, V.ARRAY, V.INT32)
        for k, v in (("bos", 101), ("eos", 102), ("unknown", 100), ("seperator", 102), ("padding", 0),
                     ("mask", 103)):  # fmt: skip
            md[f"tokenizer.ggml.{k}_token_id"] = MetaValue(v, V.UINT32)
        md["tokenizer.ggml.add_bos_token"] = MetaValue(True, V.BOOL)
        md["tokenizer.ggml.add_eos_token"] = MetaValue(True, V.BOOL)
    if file_type is not None:
        md["general.quantization_version"] = MetaValue(2, V.UINT32)
    return md


def synthetic_sources(
    *,
    n_layers: int = 2,
    d_model: int = 64,
    n_head: int = 4,
    d_ff: int | None = None,
    n_vocab: int = 512,
    n_ctx: int = 512,
    n_token_types: int = 2,
    pooling: Pooling | str | int = Pooling.MEAN,
    eps: float = 1e-12,
    wtype: GGMLType | str = T.Q8_0,
    embd_type: GGMLType | str | None = None,
    seed: int = 0,
    name: str = "",
) -> tuple[BertConfig, dict[str, MetaValue], list[TensorSource]]:
    """The config, metadata and (lazily produced) tensors of a synthetic bert: the matrices
    (token embedding: ``embd_type``, default ``wtype``) of ``wtype``, the position and token-type
    embeddings, norms and biases F32, as convert_hf_to_gguf.py types them. Weights as
    :func:`accelplane.models.gguf.synthetic_tensor` makes them."""
    from accelplane.models.gguf import FILE_TYPES, SEED_KEY, MetaValue, _gguf, weight_sources

    cfg = BertConfig(n_layers=n_layers, d_model=d_model, n_head=n_head, d_ff=d_ff or 4 * d_model,
                     n_vocab=n_vocab, n_ctx_train=n_ctx, eps=eps, n_token_types=n_token_types,
                     pooling=parse_pooling(pooling))  # fmt: skip
    wt = parse_type(wtype)
    srcs = weight_sources(cfg.weights(), wt, seed, {"token_embd.weight": parse_type(embd_type or wt)})
    md = gguf_metadata(cfg, name or f"synthetic-bert-{wt.name.lower()}", FILE_TYPES.get(wt))
    md[SEED_KEY] = MetaValue(int(seed), _gguf().GGUFValueType.UINT32)
    return dataclasses.replace(cfg, eps=float(np.float32(eps))), md, srcs  # as a reader of the file sees it


def encode_texts(f: GGUFFile, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text by the file's own vocabulary, special tokens added
    (``accelplane.models.tokenizer``). TokenizerError when that module is not installed."""
    try:
        from accelplane.models.tokenizer import Tokenizer
    except ModuleNotFoundError as e:
        if e.name != "accelplane.models.tokenizer":
            raise
        raise TokenizerError("embedding text needs accelplane.models.tokenizer, which this installation "
                             "lacks; pass token ids instead (accelplane embed --ids)") from None  # fmt: skip
    tok = Tokenizer.from_gguf(f)
    return [list(tok.encode(t, add_special=True)) for t in texts]


def check_ids(cfg: BertConfig, seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Each sequence as an int64 array; ShapeError for an empty or too long one (more tokens
    than the context), OutOfRangeError for an id outside the vocabulary."""
    out = []
    for i, s in enumerate(seqs):
        a = np.asarray(s)
        if a.ndim != 1 or not (a.size == 0 or np.issubdtype(a.dtype, np.integer)):
            raise ShapeError(f"sequence {i}: expected a list of integer token ids, got {a.dtype} "
                             f"{a.shape}")  # fmt: skip
        if not 1 <= a.size <= cfg.n_ctx_train:
            raise ShapeError(f"sequence {i}: {a.size} tokens; a sequence takes 1 to "
                             f"{cfg.n_ctx_train} (the model's context)")  # fmt: skip
        bad = (a < 0) | (a >= cfg.n_vocab)
        if bad.any():
            j = int(np.argmax(bad))
            raise OutOfRangeError(f"sequence {i}, token {j}: id {int(a[j])} is outside the vocabulary "
                                  f"0..{cfg.n_vocab - 1}")  # fmt: skip
        out.append(a.astype(np.int64))
    return out


# --- the model -----------------------------------------------------------------------------------
@dataclass
class _Step:
    enc: Encoder
    graph: Graph


@dataclass
class BertModel:
    """A bert model's weights on ``devices[0]``, run through a :class:`~accelplane.sched.Scheduler`
    whose backends are that device and then a CPU device (``cpu``, default the registry's "CPU")
    for what it cannot run. ``types``: each present weight's type by GGUF name (default: every
    weight, F32). Load with :meth:`load_weights` or :meth:`set_weights`, or use :meth:`from_gguf`.
    ``max_batch_tokens``: padded tokens computed in one graph (bounds the attention scores'
    memory: batch * heads * seq * seq floats)."""

    cfg: BertConfig
    devices: Sequence[Device]
    types: Mapping[str, GGMLType | str | int] | None = None
    cpu: Device | None = None
    max_batch_tokens: int = 4096
    wctx: Context = field(init=False)
    w: dict[str, Tensor] = field(init=False)
    buffers: list[Buffer] = field(init=False, default_factory=list)
    backends: list[Backend] = field(init=False, default_factory=list)
    sched: Scheduler | None = field(init=False, default=None)
    _steps: dict[tuple[int, int, Pooling], _Step] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if not self.devices:
            raise DeviceError("a model needs at least one device")
        if self.max_batch_tokens < 1:
            raise ShapeError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        dev = self.devices[0]
        if self.cpu is None:
            from accelplane.runtime.registry import get_registry

            self.cpu = dev if dev.type == DeviceType.CPU else get_registry().device("CPU")
        self.wctx = Context("bert-weights")
        self.w = new_weights(self.wctx, self.cfg, self.types)
        try:
            buf = alloc_tensors(list(self.w.values()), dev.buffer_type, BufferUsage.WEIGHTS)
            if buf is not None:
                self.buffers.append(buf)
            devs = [dev] if dev is self.cpu else [dev, self.cpu]
            self.backends = [d.new_backend() for d in devs]
            self.sched = Scheduler(self.backends)
        except Exception:
            self.free()
            raise

    @classmethod
    def from_gguf(cls, source: str | GGUFFile, devices: Sequence[Device], *,
                  progress: Callable[[int], None] | None = None, **kw) -> BertModel:  # fmt: skip
        """Load a bert GGUF file (path or an opened GGUFFile) onto ``devices``; other keywords
        as the constructor's."""
        from accelplane.models.gguf import GGUFFile, read_gguf

        f = source if isinstance(source, GGUFFile) else read_gguf(source)
        cfg = config_from_gguf(f)
        check_gguf_tensors(f, cfg)
        names = set(weight_shapes(cfg))
        m = cls(cfg, devices, types={n: t.type for n, t in f.tensors.items() if n in names}, **kw)
        return with_weights_of(m, f, progress)

    def load_weights(self, source: Callable[[str], np.ndarray], progress: Callable[[int], None] | None = None,
                     done: Callable[[str], None] | None = None) -> None:  # fmt: skip
        """:func:`copy_weight_bytes` into this model's weights."""
        copy_weight_bytes(self.w, source, progress, done)

    def set_weights(self, values: Mapping[str, np.ndarray]) -> None:
        """:func:`set_weight_values` of this model's weights."""
        set_weight_values(self.w, values)

    def _step(self, batch: int, seq: int, pooling: Pooling) -> _Step:
        key = (batch, seq, pooling)
        st = self._steps.get(key)
        if st is None:
            enc = build_encoder(self.cfg, batch, seq, Context(f"bert-{batch}x{seq}"), self.w, pooling)
            st = self._steps[key] = _Step(enc, enc.ctx.graph(enc.out))
        return st

    def embed(self, seqs: Sequence[Sequence[int]], *, pooling: Pooling | str | None = None,
              normalize_p: int = 2) -> list[np.ndarray]:  # fmt: skip
        """One embedding per sequence of token ids (special tokens included, as the model was
        trained): float32 [d_model] pooled, or [tokens, d_model] with pooling none; each vector
        normalized by :func:`normalize` with ``normalize_p`` (-1: raw). ``pooling``: default the
        file's. Sequences are batched by length, padded to a multiple of 16 tokens."""
        pooling = self.cfg.pooling if pooling is None else parse_pooling(pooling)
        check_norm(normalize_p)
        arrs = check_ids(self.cfg, seqs)
        if self.sched is None:
            raise DeviceError("the model has been freed")
        order = sorted(range(len(arrs)), key=lambda i: -arrs[i].size)
        out: list[np.ndarray | None] = [None] * len(arrs)
        i = 0
        while i < len(order):
            seq = min(self.cfg.n_ctx_train, -(-arrs[order[i]].size // 16) * 16)
            n = max(1, min(len(order) - i, self.max_batch_tokens // seq))
            chunk = order[i : i + n]
            ids = np.zeros((n, seq), np.int32)
            mask = np.zeros((n, seq), np.float32)
            for r, j in enumerate(chunk):
                ids[r, : arrs[j].size] = arrs[j]
                mask[r, : arrs[j].size] = 1
            st = self._step(n, seq, pooling)
            self.sched.alloc_graph(st.graph)
            for t, v in st.enc.inputs(ids, mask).items():
                t.set(v)
            self.sched.graph_compute(st.graph)
            self.sched.synchronize()
            res = st.enc.out.get()
            for r, j in enumerate(chunk):
                v = res[r, : arrs[j].size] if pooling is Pooling.NONE else res.reshape(n, -1)[r]
                out[j] = normalize(v, normalize_p)
            i += n
        return out  # type: ignore[return-value]

    def free(self) -> None:
        """Release the scheduler, backends and weight buffers."""
        if self.sched is not None:
            self.sched.free()
            self.sched = None
        for b in self.backends:
            b.free()
        self.backends = []
        for buf in self.buffers:
            buf.free()
        self.buffers = []
        self._steps = {}
