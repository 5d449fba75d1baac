"""An independent float64 numpy forward pass of the supported decoder architectures, written
from the Hugging Face side: the weights are read with the ``gguf`` package (not accelplane),
llama's Q/K rows are put back in the checkpoint's order (the inverse of llama.cpp's converter
permutation) and rotated with Hugging Face's rotate-half, gemma's norms are applied as
``x * (1 + w)`` with ``w`` the stored value minus one. So it checks the GGUF conventions as well
as the graph: what a model file means, not only what accelplane computes."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np


def read(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """float64 weights decoded by the gguf package (numpy-ordered shapes), and the metadata."""
    r = gguf.GGUFReader(path)
    w = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        w[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(shape)
    md = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return w, md


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The checkpoint's rows of a llama Q or K matrix (inverse of the converter's permute)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def forward(w: dict[str, np.ndarray], md: dict, tokens: np.ndarray) -> np.ndarray:
    """Logits [T, vocab] of ``tokens`` at positions 0.. (no cache), float64."""
    arch = md["general.architecture"]
    a = arch + "."
    d, n_layer = md[a + "embedding_length"], md[a + "block_count"]
    n_head = md[a + "attention.head_count"]
    n_kv = md.get(a + "attention.head_count_kv", n_head)
    hd = md.get(a + "attention.key_length", d // n_head)
    eps = md[a + "attention.layer_norm_rms_epsilon"]
    base = md.get(a + "rope.freq_base", 10000.0)
    factor = md.get(a + "rope.scaling.factor", 0.0)
    if md.get(a + "rope.scaling.type", "linear") == "none":
        factor = 0
    scale = 1.0 / factor if factor else 1.0
    n_exp, k_used = md.get(a + "expert_count", 0), md.get(a + "expert_used_count", 0)
    gemma = arch == "gemma3"
    n_swa = md.get(a + "attention.sliding_window", 0) if gemma else 0
    base_swa = md.get(a + "rope.freq_base_swa", 10000.0)
    softcap = md.get(a + "final_logit_softcapping", 0.0)
    n = len(tokens)
    ff = w.get("rope_freqs.weight")

    def rms(x, g):  # gemma's x * (1 + w): the file stores 1 + w
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    def rope(x, b, s):  # x [T, heads, hd]: Hugging Face's rotate-half (NEOX), after unpermuting
        half = hd // 2
        inv = b ** (-2.0 * np.arange(half) / hd) * s
        if ff is not None:
            inv = inv / ff[:half]
        theta = np.arange(n)[:, None] * inv
        c, si = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        x0, x1 = x[..., :half], x[..., half:]
        return np.concatenate([x0 * c - x1 * si, x0 * si + x1 * c], axis=-1)

    def silu(x):
        return x / (1 + np.exp(-x))

    def gelu(x):  # the tanh approximation (gelu_pytorch_tanh)
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    def lin(x, name):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    x = w["token_embd.weight"][tokens]
    if gemma:
        x = x * math.sqrt(d)
    pos = np.arange(n)
    for li in range(n_layer):
        p = f"blk.{li}."
        swa = gemma and n_swa > 0 and li % 6 < 5
        hidden = ~(pos[None, :] <= pos[:, None])
        if swa:
            hidden |= pos[:, None] - pos[None, :] >= n_swa
        h = rms(x, w[p + "attn_norm.weight"])
        wq, wk = w[p + "attn_q.weight"], w[p + "attn_k.weight"]
        bq, bk = w.get(p + "attn_q.bias"), w.get(p + "attn_k.bias")
        if arch == "llama":  # back to the checkpoint's rows: its rope is rotate-half
            wq, wk = unpermute(wq, n_head), unpermute(wk, n_kv)
            bq = None if bq is None else unpermute(bq, n_head)
            bk = None if bk is None else unpermute(bk, n_kv)
        q = (h @ wq.T + (0 if bq is None else bq)).reshape(n, n_head, hd)
        k = (h @ wk.T + (0 if bk is None else bk)).reshape(n, n_kv, hd)
        v = lin(h, p + "attn_v").reshape(n, n_kv, hd)
        if p + "attn_q_norm.weight" in w:
            q, k = rms(q, w[p + "attn_q_norm.weight"]), rms(k, w[p + "attn_k_norm.weight"])
        b, s = (base_swa, 1.0) if swa else (base, scale)
        q, k = rope(q, b, s), rope(k, b, s)
        att = np.empty((n, n_head, hd))
        for head in range(n_head):
            kv = head // (n_head // n_kv)
            sc = q[:, head] @ k[:, kv].T / math.sqrt(hd)
            sc[hidden] = -np.inf
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            att[:, head] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kv]
        o = lin(att.reshape(n, n_head * hd), p + "attn_output")
        if gemma:
            o = rms(o, w[p + "post_attention_norm.weight"])
        x = x + o
        h = rms(x, w[p + "ffn_norm.weight"])
        if n_exp:
            logits = h @ w[p + "ffn_gate_inp.weight"].T
            pr = np.exp(logits - logits.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            y = np.zeros_like(h)
            for t in range(n):
                top = np.argsort(-pr[t], kind="stable")[:k_used]
                for e, g in zip(top, pr[t, top] / pr[t, top].sum(), strict=True):
                    gate = w[p + "ffn_gate_exps.weight"][e] @ h[t]
                    up = w[p + "ffn_up_exps.weight"][e] @ h[t]
                    y[t] += g * (w[p + "ffn_down_exps.weight"][e] @ (silu(gate) * up))
        else:
            act = gelu if gemma else silu
            y = lin(act(lin(h, p + "ffn_gate")) * lin(h, p + "ffn_up"), p + "ffn_down")
        if gemma:
            y = rms(y, w[p + "post_ffw_norm.weight"])
        x = x + y
    x = rms(x, w["output_norm.weight"])
    out = x @ w.get("output.weight", w["token_embd.weight"]).T
    if "output.bias" in w:
        out = out + w["output.bias"]
    if softcap:
        out = softcap * np.tanh(out / softcap)
    return out
