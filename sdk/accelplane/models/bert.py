"""A BERT-style encoder on the host API: token and position embeddings, post-norm layers
(multi-head self-attention with a padding mask, GELU_ERF feed-forward, LayerNorm), and masked
mean pooling. It is built from public Context calls only, the way a user would write one, so
it measures how fast any graph is, not a tuned path; :func:`torch_encoder` computes the same
function with the same weights in PyTorch (the peer of ``accelplane bench graph``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from accelplane.core.graph import Context
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType as T
from accelplane.errors import ShapeError


@dataclass(frozen=True)
class BertConfig:
    n_layers: int = 6
    d_model: int = 384
    n_heads: int = 12
    d_ff: int = 1536
    vocab: int = 8192
    max_pos: int = 512
    eps: float = 1e-12

    def __post_init__(self) -> None:
        if min(self.n_layers, self.d_model, self.n_heads, self.d_ff, self.vocab, self.max_pos) < 1:
            raise ShapeError(f"BertConfig: every size must be positive: {self}")
        if self.d_model % self.n_heads:
            raise ShapeError(f"BertConfig: d_model {self.d_model} is not a multiple of n_heads "
                             f"{self.n_heads}")


PRESETS = {
    "bert-mini": BertConfig(),  # MiniLM-L6-sized: 6 layers, d 384, 12 heads, FFN 1536
    "bert-tiny": BertConfig(n_layers=2, d_model=64, n_heads=4, d_ff=128, vocab=512, max_pos=128),
}


def weight_shapes(cfg: BertConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's numpy shape by name (a linear layer's weight is [out, in], as torch's)."""
    d, f = cfg.d_model, cfg.d_ff
    shapes: dict[str, tuple[int, ...]] = {"tok_emb": (cfg.vocab, d), "pos_emb": (cfg.max_pos, d),
                                          "emb_ln.w": (d,), "emb_ln.b": (d,)}  # fmt: skip
    for i in range(cfg.n_layers):
        for name, shape in (("q", (d, d)), ("k", (d, d)), ("v", (d, d)), ("o", (d, d)), ("ln1", None),
                            ("up", (f, d)), ("down", (d, f)), ("ln2", None)):  # fmt: skip
            shapes[f"l{i}.{name}.w"] = shape or (d,)
            shapes[f"l{i}.{name}.b"] = (shape[0],) if shape else (d,)
    return shapes


def random_weights(cfg: BertConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights of a trained model's scale: N(0, 0.02) matrices, LayerNorm gains near 1."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("ln1.w") or name.endswith("ln2.w") or name == "emb_ln.w":
            v = 1.0 + 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1:
            v = 0.02 * rng.standard_normal(shape)
        else:
            v = 0.02 * rng.standard_normal(shape) * (50.0 if "emb" in name else 1.0)
        out[name] = v.astype(np.float32)
    return out


def random_batch(cfg: BertConfig, batch: int, seq: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [batch, seq] and a padding mask [batch, seq] (1 = token, 0 = padding): lengths
    from half the sequence to all of it, the first row full."""
    if not 1 <= seq <= cfg.max_pos:
        raise ShapeError(f"sequence length {seq} must be in 1..{cfg.max_pos}")
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab, (batch, seq)).astype(np.int32)
    lengths = rng.integers(max(1, seq // 2), seq + 1, batch)
    lengths[0] = seq
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float32)
    return ids, mask


@dataclass
class Encoder:
    """The built graph's handles: weights by name, the inputs, the pooled output [batch, d]."""

    ctx: Context
    weights: dict[str, Tensor]
    ids: Tensor  # I32 [batch * seq]
    attn_mask: Tensor  # F32 [batch, 1, seq, seq]: 0 where a key is a token, -inf where padding
    pool: Tensor  # F32 [batch, 1, seq]: mask / length, the mean pooling's weights
    out: Tensor  # F32 [batch, 1, d]

    def inputs(self, ids: np.ndarray, mask: np.ndarray) -> dict[Tensor, np.ndarray]:
        """Input values for token ids and a padding mask as :func:`random_batch` makes them."""
        b, s = ids.shape
        key = np.where(mask > 0, 0.0, -np.inf).astype(np.float32)
        attn = np.broadcast_to(key[:, None, None, :], (b, 1, s, s))
        pool = (mask / mask.sum(axis=1, keepdims=True))[:, None, :].astype(np.float32)
        return {self.ids: ids.reshape(-1), self.attn_mask: attn, self.pool: pool}


def build_encoder(cfg: BertConfig, batch: int, seq: int, ctx: Context | None = None) -> Encoder:
    """The encoder's graph for ``batch`` sequences of ``seq`` tokens (F32 weights)."""
    if batch < 1 or not 1 <= seq <= cfg.max_pos:
        raise ShapeError(f"batch {batch} and sequence length {seq} must be >= 1 and <= {cfg.max_pos}")
    ctx = ctx or Context()
    d, h = cfg.d_model, cfg.n_heads
    dh = d // h
    w = {n: ctx.new_tensor(T.F32, s, n) for n, s in weight_shapes(cfg).items()}
    ids = ctx.new_tensor(T.I32, (batch * seq,), "ids").set_input()
    attn_mask = ctx.new_tensor(T.F32, (batch, 1, seq, seq), "attn_mask").set_input()
    pool = ctx.new_tensor(T.F32, (batch, 1, seq), "pool").set_input()

    def linear(x: Tensor, name: str) -> Tensor:
        return ctx.add(ctx.mul_mat(w[f"{name}.w"], x), w[f"{name}.b"])

    def layer_norm(x: Tensor, name: str) -> Tensor:
        return ctx.add(ctx.mul(ctx.norm(x, cfg.eps), w[f"{name}.w"]), w[f"{name}.b"])

    def heads(x: Tensor) -> Tensor:  # [batch, seq, d] -> [batch, heads, seq, dh]
        return ctx.permute(ctx.reshape(x, (batch, seq, h, dh)), 0, 2, 1, 3)

    pos = ctx.view(w["pos_emb"], (d, seq))  # the first seq rows (ggml order)
    x = ctx.add(ctx.reshape(ctx.get_rows(w["tok_emb"], ids), (batch, seq, d)), pos)
    x = layer_norm(x, "emb_ln")
    for i in range(cfg.n_layers):
        p = f"l{i}"
        q, k = heads(linear(x, f"{p}.q")), heads(linear(x, f"{p}.k"))
        vt = ctx.cont(ctx.permute(ctx.reshape(linear(x, f"{p}.v"), (batch, seq, h, dh)), 1, 2, 0, 3))
        probs = ctx.soft_max(ctx.mul_mat(k, q), attn_mask, 1.0 / math.sqrt(dh))
        att = ctx.cont(ctx.permute(ctx.mul_mat(vt, probs), 0, 2, 1, 3))  # [batch, seq, heads, dh]
        x = layer_norm(ctx.add(x, linear(ctx.reshape(att, (batch, seq, d)), f"{p}.o")), f"{p}.ln1")
        ff = linear(ctx.gelu_erf(linear(x, f"{p}.up")), f"{p}.down")
        x = layer_norm(ctx.add(x, ff), f"{p}.ln2")
    xt = ctx.cont(ctx.permute(x, 1, 0, 2, 3))  # [batch, d, seq]
    out = ctx.mul_mat(xt, pool)
    out.name = "pooled"
    return Encoder(ctx, w, ids, attn_mask, pool, out)


def torch_encoder(cfg: BertConfig, weights: dict[str, np.ndarray], device: str = "cpu"):
    """The same function in PyTorch, float32, eager (scaled_dot_product_attention, as current
    encoders use): a callable ``(ids [batch, seq] int, mask [batch, seq] float) -> [batch, d]``
    numpy, weights uploaded once to ``device``."""
    import torch
    import torch.nn.functional as F

    dev = torch.device(device)
    tw = {n: torch.from_numpy(v).to(dev) for n, v in weights.items()}
    h, d = cfg.n_heads, cfg.d_model

    def ln(x, name):
        return F.layer_norm(x, (d,), tw[f"{name}.w"], tw[f"{name}.b"], cfg.eps)

    @torch.inference_mode()
    def run(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        b, s = ids.shape
        t_ids = torch.from_numpy(ids.astype(np.int64)).to(dev)
        t_mask = torch.from_numpy(mask).to(dev)
        x = ln(F.embedding(t_ids, tw["tok_emb"]) + tw["pos_emb"][:s], "emb_ln")
        key = torch.zeros((b, 1, 1, s), device=dev).masked_fill(t_mask[:, None, None, :] == 0, float("-inf"))
        for i in range(cfg.n_layers):
            p = f"l{i}"

            def lin(v, n, p=p):
                return F.linear(v, tw[f"{p}.{n}.w"], tw[f"{p}.{n}.b"])

            q, k, v = (lin(x, n).view(b, s, h, d // h).transpose(1, 2) for n in ("q", "k", "v"))
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=key).transpose(1, 2).reshape(b, s, d)
            x = ln(x + lin(att, "o"), f"{p}.ln1")
            x = ln(x + lin(F.gelu(lin(x, "up")), "down"), f"{p}.ln2")
        pooled = (x * t_mask[:, :, None]).sum(1) / t_mask.sum(1, keepdim=True)
        return pooled.cpu().numpy()

    return run
