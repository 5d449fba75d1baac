"""Small graphs for testing and benchmarking the SDK's scheduling: a llama-like decoder layer
built only with the public host API (the models package builds the real thing)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from accelplane.core.graph import Context
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType


@dataclass
class LayerGraph:
    ctx: Context
    weights: list[Tensor]
    x: Tensor  # [tokens, d_model] input
    pos: Tensor  # [tokens] I32
    mask: Tensor  # [tokens, tokens] causal mask
    out: Tensor
    n_tokens: int

    def inputs(self, rng: np.random.Generator) -> dict[Tensor, np.ndarray]:
        n = self.n_tokens
        mask = np.triu(np.full((n, n), -np.inf, np.float32), 1)
        return {
            self.x: rng.standard_normal(self.x.shape).astype(np.float32),
            self.pos: np.arange(n, dtype=np.int32),
            self.mask: mask,
        }

    def weight_values(self, rng: np.random.Generator) -> dict[Tensor, np.ndarray]:
        out = {}
        for w in self.weights:
            scale = 1.0 if "norm" in w.name else 1.0 / np.sqrt(w.shape[-1])
            out[w] = (rng.standard_normal(w.shape) * scale).astype(np.float32)
        return out


def llama_layer(
    d_model: int = 64, n_head: int = 4, n_kv_head: int = 2, d_ff: int = 128, n_tokens: int = 7,
    wtype: GGMLType = GGMLType.F32, n_layers: int = 1,
) -> LayerGraph:  # fmt: skip
    """``n_layers`` llama decoder layers: RMS_NORM, Q/K/V projections, NEOX rope, grouped-query
    attention with a causal mask, output projection, residual, SWIGLU FFN, residual."""
    ctx = Context("llama-layer")
    hd = d_model // n_head
    x = ctx.new_tensor(GGMLType.F32, (n_tokens, d_model), "x").set_input()
    pos = ctx.new_tensor(GGMLType.I32, (n_tokens,), "pos").set_input()
    mask = ctx.new_tensor(GGMLType.F32, (n_tokens, n_tokens), "mask").set_input()
    weights: list[Tensor] = []

    def w(name: str, shape, t=wtype) -> Tensor:
        tt = ctx.new_tensor(t, shape, name).set_param()
        weights.append(tt)
        return tt

    h = x
    for li in range(n_layers):
        p = f"l{li}."
        attn_norm = w(p + "attn_norm", (d_model,), GGMLType.F32)
        wq = w(p + "wq", (d_model, d_model))
        wk = w(p + "wk", (n_kv_head * hd, d_model))
        wv = w(p + "wv", (n_kv_head * hd, d_model))
        wo = w(p + "wo", (d_model, d_model))
        ffn_norm = w(p + "ffn_norm", (d_model,), GGMLType.F32)
        wg = w(p + "w_gate", (d_ff, d_model))
        wu = w(p + "w_up", (d_ff, d_model))
        wd = w(p + "w_down", (d_model, d_ff))

        a = ctx.mul(ctx.rms_norm(h, 1e-5), attn_norm)
        q = ctx.reshape(ctx.mul_mat(wq, a), (n_tokens, n_head, hd))
        k = ctx.reshape(ctx.mul_mat(wk, a), (n_tokens, n_kv_head, hd))
        v = ctx.reshape(ctx.mul_mat(wv, a), (n_tokens, n_kv_head, hd))
        q = ctx.rope_neox(q, pos, hd)
        k = ctx.rope_neox(k, pos, hd)
        # heads outermost: q [H, T, hd], k [Hkv, T, hd], v^T [Hkv, hd, T]
        qh = ctx.permute(q, 0, 2, 1, 3)
        kh = ctx.cont(ctx.permute(k, 0, 2, 1, 3))
        vt = ctx.cont(ctx.permute(v, 1, 2, 0, 3))
        scores = ctx.mul_mat(kh, qh)  # [H, T, T]; Hkv broadcasts over H
        probs = ctx.soft_max(scores, mask, 1.0 / np.sqrt(hd))
        att = ctx.mul_mat(vt, probs)  # [H, T, hd]
        att = ctx.reshape(ctx.cont(ctx.permute(att, 0, 2, 1, 3)), (n_tokens, d_model))
        h = ctx.add(h, ctx.mul_mat(wo, att))
        f = ctx.mul(ctx.rms_norm(h, 1e-5), ffn_norm)
        f = ctx.swiglu(ctx.mul_mat(wg, f), ctx.mul_mat(wu, f))
        h = ctx.add(h, ctx.mul_mat(wd, f))
    return LayerGraph(ctx, weights, x, pos, mask, h, n_tokens)


@dataclass
class MoEGraph:
    ctx: Context
    experts: list[Tensor]  # [n_expert, d_ff, d_model] gate/up and [n_expert, d_model, d_ff] down
    router: Tensor
    x: Tensor
    out: Tensor
    mul_mat_ids: list[Tensor]
    n_tokens: int


def moe_layers(
    d_model: int = 64, d_ff: int = 96, n_expert: int = 8, n_used: int = 2, n_tokens: int = 4,
    n_layers: int = 2, wtype: GGMLType = GGMLType.F32,
) -> MoEGraph:  # fmt: skip
    """``n_layers`` MoE FFN blocks: router → ARGSORT (desc) → top-k ids → MUL_MAT_ID experts
    (gate, up → SWIGLU → down, weighted by the softmaxed router scores), residual."""
    ctx = Context("moe")
    x = ctx.new_tensor(GGMLType.F32, (n_tokens, d_model), "x").set_input()
    experts: list[Tensor] = []
    mmids: list[Tensor] = []
    h = x
    router = None
    for li in range(n_layers):
        router = ctx.new_tensor(GGMLType.F32, (n_expert, d_model), f"l{li}.router").set_param()
        gate = ctx.new_tensor(wtype, (n_expert, d_ff, d_model), f"l{li}.gate").set_param()
        up = ctx.new_tensor(wtype, (n_expert, d_ff, d_model), f"l{li}.up").set_param()
        down = ctx.new_tensor(wtype, (n_expert, d_model, d_ff), f"l{li}.down").set_param()
        experts += [gate, up, down]
        logits = ctx.mul_mat(router, h)  # [T, E]
        probs = ctx.soft_max(logits)
        order = ctx.argsort(probs, 1)  # descending
        ids = ctx.view(order, (n_used, n_tokens), (order.nb[0], order.nb[1]), 0)
        hb = ctx.reshape(h, (n_tokens, 1, d_model))
        g = ctx.mul_mat_id(gate, hb, ids)  # [T, n_used, d_ff]
        u = ctx.mul_mat_id(up, hb, ids)
        act = ctx.swiglu(g, u)
        d = ctx.mul_mat_id(down, act, ids)  # [T, n_used, d_model]
        mmids += [g, u, d]
        wts = ctx.get_rows(ctx.reshape(probs, (n_tokens, n_expert, 1)), ids)  # [T, n_used, 1]
        y = ctx.sum_rows(ctx.cont(ctx.permute(ctx.mul(d, wts), 1, 0, 2, 3)))  # [T, d_model, 1]
        h = ctx.add(h, ctx.reshape(y, (n_tokens, d_model)))
    return MoEGraph(ctx, experts, router, x, h, mmids, n_tokens)


@dataclass
class QKVBlock:
    """:func:`qkv_block`'s tensors."""

    w: Tensor  # [k, nq + 2 nk] projection weights
    x: Tensor  # [k, 1] activations
    pos: Tensor  # [1] I32 position
    k_cache: Tensor  # [nk, n_ctx]
    v_cache: Tensor  # [n_ctx, nk] (transposed: channel-major)
    v_idx: Tensor  # [nk] I32 slots of the values (the "rows" V layout)
    product: Tensor
    q_rope: Tensor
    k_rope: Tensor
    k_set: Tensor
    v_set: Tensor


def qkv_block(ctx: Context, wtype: GGMLType, k: int, hd: int, n_head: int, n_kv_head: int, n_ctx: int,
              cache_type: GGMLType = GGMLType.F16, v_rows: bool = True, freq_base: float = 5e5) -> QKVBlock:
    """The llama decode's attention input for one token, built by models.decoder's own
    rope_into_cache: one product by the merged Q/K/V weights, Q roped (normal mode), K roped and
    SET_ROWS into the K cache at the position, V set into the transposed V cache, either by one
    slot index per value (``v_rows``, the single-device layout) or per channel at the position
    (the split layout)."""
    from accelplane.core.ops import ROPE_TYPE_NORMAL
    from accelplane.models.decoder import rope_into_cache

    nq, nk = hd * n_head, hd * n_kv_head
    w = ctx.new_tensor_ne(wtype, k, nq + 2 * nk, name="w_qkv")
    x = ctx.new_tensor_ne(GGMLType.F32, k, 1, name="x")
    pos = ctx.new_tensor_ne(GGMLType.I32, 1, name="pos")
    kc = ctx.new_tensor_ne(cache_type, nk, n_ctx, name="k_cache")
    vc = ctx.new_tensor_ne(cache_type, n_ctx, nk, name="v_cache")
    v_idx = ctx.new_tensor_ne(GGMLType.I32, nk, name="v_idx")
    qkv = ctx.mul_mat(w, x)
    fsz = qkv.nb[0]
    q = ctx.view(qkv, (nq, 1), None, 0)
    kk = ctx.view(qkv, (nk, 1), None, nq * fsz)
    v = ctx.view(qkv, (nk, 1), None, (nq + nk) * fsz)
    qr, ks, vs = rope_into_cache(ctx, q, kk, v, pos, kc, vc, v_idx, hd=hd, n_head=n_head, n_kv_head=n_kv_head,
                                 rot=hd, mode=ROPE_TYPE_NORMAL, per_channel_v=not v_rows, n_ctx_orig=4096,
                                 freq_base=freq_base)  # fmt: skip
    kr = ks.src[1].src[0]  # the K rope, under its reshape
    return QKVBlock(w, x, pos, kc, vc, v_idx, qkv, qr, kr, ks, vs)
