"""The decoder-only transformer of every supported architecture (llama, qwen2, qwen3, qwen3moe, gemma3;
:mod:`accelplane.models.archs` reads each one's GGUF into a :class:`DecoderConfig`), built only
with the public host API and run through the scheduler.

The forward pass is llama.cpp's graph builders (src/models/llama.cpp, qwen2.cpp, qwen3.cpp,
gemma3.cpp) written as accelplane graph ops, each architecture's differences being switches of
the config:

* token embedding: GET_ROWS of ``token_embd`` (on the first layer's device where it runs there, else
  in host memory like llama.cpp's input layer: the ``embd`` argument), times ``embd_scale`` when set
  (gemma3: sqrt(n_embd));
* per layer: RMS_NORM · attn_norm → Q/K/V projections (+ their biases where the file has them:
  qwen2) → per-head RMS_NORM · attn_q_norm / attn_k_norm (``qk_norm``: qwen3, gemma3) → ROPE
  (normal or NEOX, the layer's own frequency base and scale, Llama 3's ``rope_freqs`` factors) →
  K and V written into the KV cache with SET_ROWS at the tokens' positions → grouped-query
  attention over a fixed window of the cache with a causal mask, or for a sliding-window layer
  (gemma3) one that also hides keys ``n_swa`` or more positions back (SOFT_MAX with scale and
  mask; the query heads sharing a kv head are batched into one MUL_MAT per kv head, so a decode
  step issues n_head_kv products, not n_head) → output projection (+ bias) → RMS_NORM ·
  post_attention_norm (``post_norms``: gemma3) → residual; RMS_NORM · ffn_norm → the gated FFN (SWIGLU,
  or GEGLU with the tanh GELU for gemma3; or the MoE FFN: router, SOFT_MAX, ARGSORT top-k,
  MUL_MAT_ID experts (of FFN length ``d_ff_exp``) weighted by the renormalized router
  probabilities) → RMS_NORM ·
  post_ffw_norm (``post_norms``) → residual;
* RMS_NORM · output_norm → output head (logits; + output.bias) → final soft-capping
  ``c * tanh(logits / c)`` (``logit_softcap``) → ARGMAX (greedy sampling on the device).

Norm weights are used as stored: gemma's ``x * (1 + w)`` is ``x * w'`` with the ``w' = 1 + w`` that
llama.cpp's converter writes.

Each layer's Q, K and V matrices (and the FFN's gate and up, and their biases) are stored as one
tensor when their types match (``merge``), so a decode step runs one product per group; prefill
batches multiply by the per-projection views of it, which keep the GGUF names.

The KV cache persists across calls: K is stored as rows ``[n_ctx, n_head_kv * head_dim]``,
V transposed ``[n_head_kv * head_dim, n_ctx]`` (llama.cpp's non-flash-attention layout, so
``kq · v`` is a plain MUL_MAT); both F16 or F32. A graph is built once per
``(n_tokens, kv window, all rows)`` and reused: the window is the number of cache slots
attended, rounded up to a multiple of ``kv_pad`` (``kv_growth="pad"``) or to ``kv_pad`` times a
power of two (``"double"``), unused slots hidden by the mask. A decode graph is thus the same
object for many consecutive tokens and the backends' plan caches hit; each new window is a graph
to split and plan (a tenth of a second or more in Python for a 1B llama), which is why devices
double theirs: a generation of n tokens plans about log2(n / kv_pad) windows, not n / kv_pad, and
a device's attention over up to twice the slots costs little next to a re-plan (an H200's fused
decode attention takes about as long for 1024 positions as for 256). Host attention pays per
slot, so CPUs pad.

Placement (``split``): ``none`` puts every layer on ``devices[0]``; ``layer`` cuts the layers
into contiguous, even chunks over ``devices`` (llama.cpp ``-sm layer``); the output layer goes
with the last layer; ``tensor`` runs every layer on all the devices at once through the meta
device (accelplane.parallel.meta: weights split by :meth:`DecoderConfig.split_role`, attention
heads and FFN columns per device, row-parallel products all-reduced).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from accelplane import env
from accelplane.core.graph import Context, Graph
from accelplane.core.ops import ROPE_TYPE_NEOX, ROPE_TYPE_NORMAL, VIEW_OPS, SortOrder, op_desc
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType, parse_type
from accelplane.errors import ConfigError, DeviceError, OutOfRangeError, ShapeError
from accelplane.interface import DeviceType
from accelplane.runtime.alloc import alloc_tensors
from accelplane.runtime.backend import Backend, Buffer, BufferType, BufferUsage, Device, Event
from accelplane.runtime.data import set_bytes
from accelplane.sched import Scheduler
from accelplane.sched.experts import reads_in_place

if TYPE_CHECKING:
    from accelplane.models.gguf import GGUFFile

T = GGMLType
SPLIT_MODES = ("none", "layer", "tensor")
_Namer = Callable[[Tensor, str], Tensor]  # names a node and records its group (inp/blk.N/out)


# --- configuration ---------------------------------------------------------------------------
class SplitKind(Enum):
    """A weight's role under tensor parallelism (Megatron pattern, llama.cpp ``-sm tensor``)."""

    COLUMN = "column"  # output features (weight rows, ggml axis 1) split: outputs concatenate
    ROW = "row"  # input features (ggml axis 0) split: partial sums need an all-reduce
    MIRRORED = "mirrored"  # a full copy on every device


@dataclass(frozen=True)
class SplitRole:
    """How a tensor-split device would cut one weight or cache tensor.

    ``axis``: the ggml axis that is split (None when mirrored); ``granularity``: elements along
    that axis that must stay on one device (a whole attention head, or 1)."""

    kind: SplitKind
    axis: int | None
    granularity: int = 1


@dataclass(frozen=True)
class WeightSpec:
    """One weight of the model: GGUF name, numpy-ordered shape, layer (-1 = input layer,
    n_layers = output layer) and whether it is a matrix (quantizable) or a norm vector."""

    name: str
    shape: tuple[int, ...]
    layer: int
    matrix: bool


# the tensors that may carry a ``.bias`` beside their ``.weight`` (llama.cpp's optional biases)
BIASED = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output")
FFN_ACTS = ("silu", "gelu")  # SWIGLU; GEGLU with the tanh GELU (llama.cpp's LLM_FFN_GELU)


@dataclass(frozen=True)
class DecoderConfig:
    """Hyper-parameters of a decoder, named after llama.cpp's hparams (``{arch}.embedding_length``
    = d_model, ``{arch}.block_count`` = n_layers, ...; :mod:`accelplane.models.archs` reads them
    from a GGUF file), and the switches that make one architecture's graph (module docstring).

    ``n_embd_head``: the attention head size (``attention.key_length``; 0 = d_model / n_head);
    ``rope_scale``: ggml's freq_scale (1 / the linear scaling factor); ``rope_freqs``: the file
    has Llama 3's ``rope_freqs.weight`` factors; ``swa_layers``: per layer, whether it attends
    through the sliding window of ``n_swa`` positions (and ropes with ``rope_base_swa`` and
    ``rope_scale_swa``), empty = none does; ``attn_scale``: the attention's scale (0 = 1 /
    sqrt(head size)); ``biases``: the :data:`BIASED` names that have a bias tensor;
    ``embd_scale``: the token embeddings' factor (0 = none); ``logit_softcap``: the final
    soft-capping (0 = none)."""

    n_vocab: int
    d_model: int
    n_layers: int
    n_head: int
    n_head_kv: int
    d_ff: int
    n_ctx_train: int = 2048
    rms_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_mode: int = ROPE_TYPE_NORMAL  # llama GGUF files use normal rope (Q/K rows permuted at conversion)
    n_rot: int = 0  # rotary dimensions; 0 = head_dim
    n_expert: int = 0  # > 0: MoE FFN (Mixtral-style llama, qwen3moe)
    n_expert_used: int = 0
    d_ff_exp: int = 0  # an expert's FFN length (expert_feed_forward_length); 0 = d_ff
    tied_output: bool = False  # no output.weight: the head reuses token_embd
    arch: str = "llama"
    n_embd_head: int = 0
    rope_scale: float = 1.0
    rope_attn_factor: float = 1.0
    rope_freqs: bool = False
    n_swa: int = 0
    swa_layers: tuple[bool, ...] = ()
    rope_base_swa: float = 10000.0
    rope_scale_swa: float = 1.0
    attn_scale: float = 0.0
    biases: frozenset[str] = frozenset()
    qk_norm: bool = False
    post_norms: bool = False
    ffn_act: str = "silu"
    embd_scale: float = 0.0
    logit_softcap: float = 0.0

    def __post_init__(self) -> None:
        what = f"{self.arch} config"
        for k in ("n_vocab", "d_model", "n_layers", "n_head", "n_head_kv", "d_ff", "n_ctx_train"):
            if getattr(self, k) <= 0:
                raise ShapeError(f"{what}: {k} must be > 0, got {getattr(self, k)}")
        if not self.n_embd_head and self.d_model % self.n_head:
            raise ShapeError(f"{what}: d_model={self.d_model} is not a multiple of "
                             f"n_head={self.n_head}")  # fmt: skip
        if self.n_embd_head < 0:
            raise ShapeError(f"{what}: n_embd_head must be >= 0, got {self.n_embd_head}")
        if self.n_head % self.n_head_kv:
            raise ShapeError(f"{what}: n_head={self.n_head} is not a multiple of "
                             f"n_head_kv={self.n_head_kv}")  # fmt: skip
        if self.rot <= 0 or self.rot % 2 or self.rot > self.head_dim:
            raise ShapeError(f"{what}: n_rot={self.rot} must be even, > 0 and <= head_dim={self.head_dim}")
        if self.rope_mode not in (ROPE_TYPE_NORMAL, ROPE_TYPE_NEOX):
            raise ShapeError(f"{what}: rope mode {self.rope_mode} (0 normal, 2 neox)")
        if self.n_expert and not 0 < self.n_expert_used <= self.n_expert:
            raise ShapeError(f"{what}: n_expert_used={self.n_expert_used} must be in "
                             f"1..n_expert={self.n_expert}")  # fmt: skip
        if self.d_ff_exp < 0 or (self.d_ff_exp and not self.n_expert):
            raise ShapeError(f"{what}: d_ff_exp={self.d_ff_exp} must be >= 0, and set only with experts")
        if self.swa_layers and (len(self.swa_layers) != self.n_layers or self.n_swa <= 0):
            raise ShapeError(f"{what}: swa_layers needs one flag per layer ({self.n_layers}) and n_swa > 0, "
                             f"got {len(self.swa_layers)} flags and n_swa={self.n_swa}")  # fmt: skip
        if self.ffn_act not in FFN_ACTS:
            raise ShapeError(f"{what}: ffn_act {self.ffn_act!r} is not one of {', '.join(FFN_ACTS)}")
        bad = sorted(set(self.biases) - set(BIASED))
        if bad or (self.is_moe and set(self.biases) & {"ffn_gate", "ffn_up", "ffn_down"}):
            raise ShapeError(f"{what}: biases {sorted(self.biases)}: only {', '.join(BIASED)} may have one "
                             "(and no FFN bias in a MoE)")  # fmt: skip
        for k in ("rope_base", "rope_scale", "rope_base_swa", "rope_scale_swa", "rms_eps"):
            v = getattr(self, k)
            if not (v > 0 and math.isfinite(v)):
                raise ShapeError(f"{what}: {k} must be a positive number, got {v}")
        for k in ("attn_scale", "embd_scale", "logit_softcap"):
            v = getattr(self, k)
            if not (v >= 0 and math.isfinite(v)):
                raise ShapeError(f"{what}: {k} must be >= 0, got {v}")

    @property
    def head_dim(self) -> int:
        return self.n_embd_head or self.d_model // self.n_head

    @property
    def rot(self) -> int:
        return self.n_rot or self.head_dim

    @property
    def n_embd_q(self) -> int:
        return self.n_head * self.head_dim

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def rope_neox(self) -> bool:
        return self.rope_mode == ROPE_TYPE_NEOX

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def ff_exp(self) -> int:
        """An expert's FFN length."""
        return self.d_ff_exp or self.d_ff

    @property
    def has_swa(self) -> bool:
        return any(self.swa_layers)

    def is_swa(self, il: int) -> bool:
        """Layer ``il`` attends through the sliding window."""
        return bool(self.swa_layers) and self.swa_layers[il]

    def rope_of(self, il: int) -> tuple[float, float]:
        """(frequency base, frequency scale) of layer ``il``'s rope (llama.cpp's
        get_rope_freq_base/scale: a sliding-window layer has its own)."""
        if self.is_swa(il):
            return self.rope_base_swa, self.rope_scale_swa
        return self.rope_base, self.rope_scale

    @property
    def kq_scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def weights(self) -> list[WeightSpec]:
        """Every weight, in llama.cpp's GGUF names and order (rope_freqs first, as its converter
        writes it)."""
        d, ff, hd = self.d_model, self.d_ff, self.head_dim
        nq, nkv = self.n_embd_q, self.n_embd_kv
        out = []

        def add(base: str, shape: tuple[int, ...], layer: int, matrix: bool = True) -> None:
            out.append(WeightSpec(base + ".weight", shape, layer, matrix))
            name = base.rsplit(".", 1)[-1]
            if name in self.biases:
                out.append(WeightSpec(base + ".bias", shape[:1], layer, False))

        if self.rope_freqs:
            out.append(WeightSpec("rope_freqs.weight", (self.rot // 2,), 0, False))  # with the first layer
        out.append(WeightSpec("token_embd.weight", (self.n_vocab, d), -1, True))
        for i in range(self.n_layers):
            p = f"blk.{i}."
            add(p + "attn_norm", (d,), i, False)
            add(p + "attn_q", (nq, d), i)
            add(p + "attn_k", (nkv, d), i)
            add(p + "attn_v", (nkv, d), i)
            if self.qk_norm:
                add(p + "attn_q_norm", (hd,), i, False)
                add(p + "attn_k_norm", (hd,), i, False)
            add(p + "attn_output", (d, nq), i)
            if self.post_norms:
                add(p + "post_attention_norm", (d,), i, False)
            add(p + "ffn_norm", (d,), i, False)
            if self.is_moe:
                e, fe = self.n_expert, self.ff_exp
                out += [
                    WeightSpec(p + "ffn_gate_inp.weight", (e, d), i, False),
                    WeightSpec(p + "ffn_gate_exps.weight", (e, fe, d), i, True),
                    WeightSpec(p + "ffn_down_exps.weight", (e, d, fe), i, True),
                    WeightSpec(p + "ffn_up_exps.weight", (e, fe, d), i, True),
                ]
            else:
                add(p + "ffn_gate", (ff, d), i)
                add(p + "ffn_down", (d, ff), i)
                add(p + "ffn_up", (ff, d), i)
            if self.post_norms:
                add(p + "post_ffw_norm", (d,), i, False)
        add("output_norm", (d,), self.n_layers, False)
        if not self.tied_output:
            add("output", (self.n_vocab, d), self.n_layers)
        elif "output" in self.biases:
            out.append(WeightSpec("output.bias", (self.n_vocab,), self.n_layers, False))
        return out

    def split_role(self, name: str) -> SplitRole:
        """The tensor-parallel role of a weight or KV-cache tensor (llama.cpp's
        ``llama_meta_device_get_split_state``): Q/K/V, gate/up (experts too) and the output
        head are column-parallel, their biases split the same way; attn_output and down are
        row-parallel (their products are partial sums to all-reduce); norms, embeddings, the
        router, the rope factors and the biases of row-parallel products are mirrored. The KV
        cache splits by kv heads (K rows on axis 0, the transposed V on axis 1)."""
        base, _, kind = name.rpartition(".")
        base = base.rsplit(".", 1)[-1] if kind in ("weight", "bias") else name
        hd = self.head_dim
        if name.startswith("cache_k"):
            return SplitRole(SplitKind.COLUMN, 0, hd)
        if name.startswith("cache_v"):
            return SplitRole(SplitKind.COLUMN, 1, hd)
        col = 0 if kind == "bias" else 1  # a bias vector is split along its only axis
        if base in ("attn_q", "attn_k", "attn_v"):
            return SplitRole(SplitKind.COLUMN, col, hd)
        if base in ("ffn_gate", "ffn_up", "ffn_gate_exps", "ffn_up_exps", "output"):
            return SplitRole(SplitKind.COLUMN, col)
        if kind == "bias":
            return SplitRole(SplitKind.MIRRORED, None)
        if base == "attn_output":
            return SplitRole(SplitKind.ROW, 0, hd)
        if base in ("ffn_down", "ffn_down_exps"):
            return SplitRole(SplitKind.ROW, 0)
        return SplitRole(SplitKind.MIRRORED, None)


# --- the model ---------------------------------------------------------------------------------
@dataclass
class _Step:
    """One reusable graph and its inputs/outputs."""

    graph: Graph
    n_tokens: int
    n_kv: int
    all_rows: bool
    tokens: Tensor
    pos: Tensor  # positions = cache rows written (the cache is linear: slot i holds position i)
    mask: Tensor | None  # None when every layer has the sliding window
    v_idx: Tensor
    logits: Tensor
    argmax: Tensor
    groups: dict[int, str] = field(default_factory=dict)  # id(node) -> "inp" / "blk.N" / "out"
    mask_swa: Tensor | None = None  # the sliding-window layers' mask
    # traced or forced routing (DecoderModel.eval): per MoE layer, its probabilities [T, E] and
    # the experts used: the ARGSORT [T, E] (the first k are used), or the forced ids input [T, k]
    routes: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    # several tokens: each token's mask row repeated on the device for its query heads, mask[i]
    # = input[mask_rows[i]] (one token: the inputs hold those rows themselves)
    mask_rows: Tensor | None = None


class _PickRing:
    """Where :meth:`DecoderModel.decode` reads its picks: two 4-byte slots (in the embeddings'
    device's pinned host memory where it has some: a copy into pageable memory would block
    until it ran), an event per slot, and, on a device with events and asynchronous queues,
    a second queue (``reader``) that reads once the computing queue has recorded ``done``."""

    def __init__(self, dev: Device) -> None:
        host = dev.host_buffer_type
        self.buf = host.alloc(8) if host is not None and host.is_host else None
        mem = self.buf.host_array[:8] if self.buf is not None else np.zeros(8, np.uint8)
        self.slots = [mem[:4], mem[4:]]
        self.events = [dev.new_event() for _ in range(2)]
        side = dev.caps.async_ and dev.has_events
        self.reader: Backend | None = dev.new_backend() if side else None
        self.done: Event | None = dev.new_event() if side else None

    def take(self, k: int) -> int:
        """The pick in slot ``k``, once its read has landed."""
        self.events[k].synchronize()
        return int(self.slots[k].view(np.float32)[0])

    def free(self) -> None:
        for ev in [*self.events, self.done]:
            if ev is not None:
                ev.free()
        if self.reader is not None:
            self.reader.free()
        if self.buf is not None:
            self.buf.free()


@dataclass
class EvalResult:
    """``ids``: the greedy next token after each output row; ``logits``: F32 [rows, n_vocab]
    (None when not requested). Rows: every token (all_logits) or the last one."""

    ids: np.ndarray
    logits: np.ndarray | None
    routing: list[Routing] | None = None  # eval(trace_routing / routing=...): per MoE layer


@dataclass
class Routing:
    """One MoE layer's routing of a step's tokens: the router's probabilities ``probs`` F32
    [T, E] and the experts used ``ids`` I32 [T, k] (its top k, or those it was given)."""

    probs: np.ndarray
    ids: np.ndarray


def _made_from(out: Tensor, stops: Sequence[Tensor]) -> list[Tensor]:
    """The computed tensors (op nodes and views) ``out`` is made from, itself included, up to but
    not through ``stops`` and leaves."""
    seen = {id(t) for t in stops}
    found, todo = [], [out]
    while todo:
        t = todo.pop()
        if t is None or id(t) in seen or t.op is None:
            continue
        seen.add(id(t))
        found.append(t)
        todo.extend(t.src)
    return found


def _packed(ctx: Context, cb: _Namer, t: Tensor, name: str) -> Tensor:
    """``t`` packed: a CONT where its layout needs one; a permute that moves only dimensions
    of size 1 (every single-token step) is already packed, and costs no copy."""
    return t if t.is_contiguous() else cb(ctx.cont(t), name)


def rope_into_cache(ctx: Context, q: Tensor, k: Tensor, v: Tensor, pos: Tensor, kc: Tensor, vc: Tensor,
                    v_idx: Tensor, *, hd: int, n_head: int, n_kv_head: int, rot: int, mode: int,
                    per_channel_v: bool = False, name: _Namer = lambda t, _: t,
                    qk_norm: Callable[[Tensor, str], Tensor] | None = None,
                    **rope_kw) -> tuple[Tensor, Tensor, Tensor]:
    """The attention's inputs for tokens whose projections are ``q``, ``k``, ``v`` (a row of
    n_head hd, n_kv_head hd and n_kv_head hd values per token): Q roped; K roped and written
    into the K cache ``kc`` (a row per position) at ``pos``; V written into the transposed V
    cache ``vc`` (a row per channel), by one slot index per value (``v_idx``: channel n_ctx +
    position) or, ``per_channel_v``, per channel at ``pos`` (indices local to a tensor-split
    shard). ``qk_norm(t, "q" | "k")`` normalizes the [hd, heads, tokens] Q and K per head before
    their rope. ``rope_kw``: :meth:`Context.rope`'s keywords (freq_base, freq_factors, ...).
    Returns (roped Q, the K cache write, the V cache write). ``name`` names each node."""
    n_tok, e_kv, n_ctx = pos.ne[0], n_kv_head * hd, kc.ne[1]
    q = ctx.reshape_ne(q, hd, n_head, n_tok)
    k = ctx.reshape_ne(k, hd, n_kv_head, n_tok)
    if qk_norm is not None:
        q, k = qk_norm(q, "q"), qk_norm(k, "k")
    q = name(ctx.rope(q, pos, rot, mode, **rope_kw), "Qrope")
    k = name(ctx.rope(k, pos, rot, mode, **rope_kw), "Krope")
    k_set = name(ctx.set_rows(kc, ctx.reshape_ne(k, e_kv, n_tok), pos), "k_cache_write")
    if per_channel_v:
        esz = vc.nb[0]
        v_set = ctx.set_rows(ctx.view(vc, (1, n_ctx, e_kv), (esz, esz, n_ctx * esz)),
                             ctx.view(v, (1, n_tok, e_kv), (v.nb[0], v.nb[1], v.nb[0])), pos)  # fmt: skip
    else:
        v_set = ctx.set_rows(ctx.reshape_ne(vc, 1, n_ctx * e_kv), ctx.reshape_ne(v, 1, n_tok * e_kv), v_idx)
    return q, k_set, name(v_set, "v_cache_write")


def check_split(split: str) -> None:
    """DeviceError unless ``split`` is one of none, layer, tensor."""
    if split not in SPLIT_MODES:
        raise DeviceError(f"unknown split mode {split!r} (none, layer, tensor)")


def _gets_rows(dev: Device, ty: GGMLType, cfg: DecoderConfig) -> bool:
    """``dev`` runs the token embedding's GET_ROWS for weights of type ``ty``."""
    ctx = Context("embd-probe")
    w = ctx.new_tensor_ne(ty, cfg.d_model, cfg.n_vocab)
    return dev.supports_op(ctx.get_rows(w, ctx.new_tensor_ne(T.I32, 1)))


def moe_gating(ctx: Context, logits: Tensor, k: int, norm: bool = True, name: _Namer = lambda t, _: t,
               ids: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """llama.cpp's softmax gating of ``logits`` [T, E]: the ``k`` experts of highest probability
    per token (``ids`` [T, k], a view of the descending ARGSORT) and their probabilities
    (``weights`` [T, k, 1]), when ``norm`` divided by their sum. The nodes come in the order
    accelplane.core.fusion's moe_gating run names. Given ``ids`` (I32 [T, k]), those experts
    are used instead of the top k (no ARGSORT), with their probabilities."""
    n_exp, n_tok = logits.ne[0], logits.ne[1]
    probs = name(ctx.soft_max(logits), "ffn_moe_probs")
    if ids is None:
        order = name(ctx.argsort(probs, SortOrder.DESC), "ffn_moe_argsort")
        ids = ctx.view(order, (k, n_tok), (order.nb[0], order.nb[1]))  # top-k expert ids
    elif tuple(ids.ne[:2]) != (k, n_tok) or ids.type != T.I32:
        got = f"{ids.type.name} {list(ids.ne[:2])}"
        raise ShapeError(f"moe_gating: ids must be I32 [{n_tok}, {k}] (ggml order [k, T]), got {got}")
    wts = name(ctx.get_rows(ctx.reshape_ne(probs, 1, n_exp, n_tok), ids), "ffn_moe_weights")
    if norm:
        wts = ctx.reshape_ne(wts, k, n_tok)
        wts = name(ctx.div(wts, name(ctx.sum_rows(wts), "ffn_moe_weights_sum")), "ffn_moe_weights_norm")
        wts = ctx.reshape_ne(wts, 1, k, n_tok)
    return ids, wts


def moe_weighted_sum(ctx: Context, experts: Tensor, weights: Tensor, name: _Namer = lambda t, _: t) -> Tensor:
    """The experts' outputs ``experts`` [T, k, d] weighted by ``weights`` [T, k, 1] and summed over
    the k slots, as llama.cpp does it (a MUL, then ADDs of its [T, d] views in slot order; one
    slot: a CONT of the view): [T, d]."""
    d, k, n_tok = experts.ne[0], experts.ne[1], experts.ne[2]
    dn = name(ctx.mul(experts, weights), "ffn_moe_weighted")
    out = None
    for j in range(k):
        vj = ctx.view(dn, (d, n_tok), (dn.nb[0], dn.nb[2]), j * dn.nb[1])
        out = vj if out is None else name(ctx.add(out, vj), "ffn_moe_out")
    return name(ctx.cont(out), "ffn_moe_out") if k == 1 else out


@dataclass(frozen=True)
class _Place:
    """Where a tensor-split weight lives, for reports: all the meta device's devices."""

    name: str


def layer_devices(n_layers: int, n_devices: int) -> list[int]:
    """Device index per layer for ``split=layer``: contiguous chunks as even as possible,
    earlier devices take the remainder (llama.cpp's default tensor_split is even too)."""
    base, rem = divmod(n_layers, n_devices)
    out: list[int] = []
    for d in range(n_devices):
        out += [d] * (base + (1 if d < rem else 0))
    return out


def copy_weight_bytes(w: Mapping[str, Tensor], source: Callable[[str], np.ndarray],
                      progress: Callable[[int], None] | None = None,
                      done: Callable[[str], None] | None = None) -> None:  # fmt: skip
    """Copy every weight's raw bytes (``source(name)``: uint8, the GGUF block layout of the
    tensor's type) into its device buffer, one tensor at a time; ``progress(nbytes)`` and
    ``done(name)`` (the source's bytes are no longer needed) after each. ShapeError when a size
    differs from the tensor's."""
    for name, t in w.items():
        raw = np.asarray(source(name)).reshape(-1).view(np.uint8)
        if raw.size != t.nbytes:
            raise ShapeError(f"weight {name}: {raw.size} bytes given, {t.type.name} {t.shape} takes "
                             f"{t.nbytes}")  # fmt: skip
        t.set_bytes(raw)
        del raw
        if done is not None:
            done(name)
        if progress is not None:
            progress(t.nbytes)


def with_weights_of(m, f: GGUFFile, progress: Callable[[int], None] | None = None):
    """Model ``m`` with its weights loaded from GGUF file ``f`` (``m.load_weights``) straight
    from the file's memory map, each tensor's pages released once it is uploaded
    (:meth:`GGUFFile.release`), so the process never holds a second copy of the weights; on an
    error ``m`` is freed and the error raised."""
    try:
        m.load_weights(lambda n: f.tensors[n].data, progress, f.release)
    except Exception:
        m.free()
        raise
    return m


def set_weight_values(w: Mapping[str, Tensor], values: Mapping[str, np.ndarray]) -> None:
    """Set weights from float arrays (quantized to each tensor's type on the way in);
    ShapeError for a name the model does not have."""
    for name, v in values.items():
        if name not in w:
            raise ShapeError(f"set_weights: the model has no weight {name!r}")
        w[name].set(v)


class DecoderModel:
    """A decoder model placed on ``devices`` and run through a :class:`~accelplane.sched.Scheduler`.

    ``devices``: where the weights go, in priority order (``split='none'``: all on the first;
    ``'layer'``: layers spread over all of them). The scheduler's backends are the non-CPU devices
    in that order, then a CPU device (``cpu``, or a CPU device among ``devices``, or the global
    registry's "CPU"), which holds the inputs and the token embeddings. ``types``: weight type by
    GGUF name (default F32). ``n_ctx``: KV cache size; ``cache_type``: F16 or F32; ``kv_pad``:
    attention window granularity (see the module docstring; default 32 when every device is a CPU,
    whose attention costs per slot, else 256: fewer graphs for a device to replay); ``kv_growth``:
    "pad" (windows are multiples of ``kv_pad``) or "double" (``kv_pad`` times a power of two);
    default "pad" when every device is a CPU, else "double". ``merge``: store
    each layer's Q, K and V (and FFN gate and up) projections as one matrix when their types match,
    so a decode step runs one product where it ran three (two); the GGUF names stay as views of it.
    Default: on, unless ACCELPLANE_MODEL_MERGE=0; never with ``split='tensor'`` (the shards cut per
    projection). ``embd``: where the token embeddings live: "device" (the first layer's device, so a
    step on one device is one scheduler split, with no host computation and copy before it; not with
    ``split='tensor'``), "cpu" (host memory, llama.cpp's input layer) or "auto" (the default, unless
    ACCELPLANE_MODEL_EMBD says otherwise): "device" when the first layer's device is not a CPU and
    runs GET_ROWS of the embeddings' type, else "cpu". Call :meth:`load_weights` (or use
    :meth:`from_gguf`) before :meth:`eval`. ``policy``: the scheduler's synchronization policy
    (docs/ordering.md), default ACCELPLANE_MODEL_POLICY or else "relaxed": a decode step's four
    inputs then go to the device as asynchronous copies behind one synchronize instead of four
    blocking ones (2.5 % more tokens/s on an H200); devices whose caps exclude it stay strict.
    ``cpu_moe``: the expert tensors (``*_exps``) of the first ``cpu_moe`` layers live in host memory
    (``n_layers`` or more: every layer's), as llama.cpp's ``--n-cpu-moe`` / ``--cpu-moe``: in the
    layer device's pinned host buffers where it has them, else the CPU device's. The scheduler runs
    their products on the CPU, or, for a batch a device offloads (offload_op), uploads only the
    experts the router selected. ``moe_device_share`` (default ACCELPLANE_MODEL_MOE_DEVICE_SHARE,
    else 0: the CPU computes them all): in a decode of such layers on a device that reads its
    pinned host memory in place (caps.host_reads, with events; the relaxed policy), the share of
    each token's experts (its first slots, rounded, at least one, never all) the device computes,
    reading them over its link while the CPU computes the others. """

    def __init__(
        self,
        cfg: DecoderConfig,
        devices: Sequence[Device],
        *,
        split: str = "none",
        n_ctx: int | None = None,
        cache_type: GGMLType | str = T.F16,
        kv_pad: int | None = None,
        kv_growth: str | None = None,
        types: Mapping[str, GGMLType | str | int] | None = None,
        cpu: Device | None = None,
        policy: str | None = None,
        merge: bool | None = None,
        embd: str | None = None,
        cpu_moe: int = 0,
        moe_device_share: float | None = None,
    ) -> None:
        check_split(split)
        if not devices:
            raise DeviceError("a model needs at least one device")
        self.cfg = cfg
        self.split = split
        self.n_ctx = int(n_ctx or min(cfg.n_ctx_train, 512))
        if self.n_ctx <= 0:
            raise ShapeError(f"n_ctx must be > 0, got {self.n_ctx}")
        self.cache_type = parse_type(cache_type)
        if self.cache_type not in (T.F16, T.F32):
            raise ShapeError(f"KV cache type must be F16 or F32, got {self.cache_type.name}")
        given = list(devices)
        self.devices = list(dict.fromkeys(devices))
        cpus = [d for d in self.devices if d.type == DeviceType.CPU]
        if cpu is None:
            if cpus:
                cpu = cpus[0]
            else:
                from accelplane.runtime.registry import get_registry

                cpu = get_registry().device("CPU")
        self.cpu = cpu
        host = all(d.type == DeviceType.CPU for d in self.devices)
        if kv_pad is None:  # host attention pays per slot attended; a device per graph variant
            kv_pad = 32 if host else 256
        if isinstance(kv_pad, bool) or not isinstance(kv_pad, int | np.integer) or kv_pad < 1:
            raise ConfigError(f"kv_pad must be an integer >= 1 (cache slots), got {kv_pad!r}")
        self.kv_pad = int(kv_pad)
        kv_growth = kv_growth or ("pad" if host else "double")
        if kv_growth not in ("pad", "double"):
            raise ConfigError(f"kv_growth must be 'pad' or 'double', got {kv_growth!r}")
        self.kv_growth = kv_growth
        if not isinstance(cpu_moe, int) or cpu_moe < 0:
            raise ConfigError(f"cpu_moe must be an integer >= 0 (layers), got {cpu_moe!r}")
        if cpu_moe and not cfg.is_moe:
            raise ConfigError(f"cpu_moe={cpu_moe}: this {cfg.arch} model has no experts for host memory")
        if cpu_moe and split == "tensor":
            raise ConfigError("cpu_moe: experts in host memory do not combine with split='tensor'")
        self.cpu_moe = min(cpu_moe, cfg.n_layers)
        share = env.MODEL_MOE_DEVICE_SHARE.get() if moe_device_share is None else moe_device_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0.0 <= share <= 1.0:
            raise ConfigError(f"moe_device_share must be a number in [0, 1], got {share!r}")
        self.moe_device_share = float(share)
        self.layer_dev: list[Device] = (
            [self.devices[0]] * cfg.n_layers if split == "none"
            else [self.devices[i] for i in layer_devices(cfg.n_layers, len(self.devices))]
        )  # fmt: skip
        self.output_dev = self.layer_dev[-1]
        embd = embd or env.MODEL_EMBD.get()
        if embd not in ("auto", "cpu", "device"):
            raise ConfigError(f"embd must be auto, cpu or device, got {embd!r}")
        first = self.layer_dev[0]
        if embd == "auto":
            ety = parse_type((types or {}).get("token_embd.weight", T.F32))
            embd = "device" if first.type != DeviceType.CPU and _gets_rows(first, ety, cfg) else "cpu"
        self.embd_dev = first if embd == "device" and split != "tensor" else cpu
        self.meta = None
        policy = policy or env.MODEL_POLICY.get()
        if policy not in ("strict", "relaxed"):
            raise ConfigError(f"policy must be relaxed or strict, got {policy!r}")
        if split == "tensor":
            from accelplane.parallel.meta import MetaDevice

            # the same device may appear twice (one device as two shards): keep repeats
            tp = [d for d in given if d.type != DeviceType.CPU] or given
            self.meta = MetaDevice(tp, self._tp_split_state)
            self.sched = self.meta  # the same alloc_graph / graph_compute / synchronize / free
            self.backends: list[Backend] = list(self.meta.backends)
        else:
            sched_devs = [d for d in self.devices if d.type != DeviceType.CPU] + [cpu]
            self.backends = [d.new_backend() for d in sched_devs]
            # two copy slots: decode() queues a step while the last still computes (a slot's
            # inputs are not overwritten under it); host experts keep one (their device pools
            # would double)
            self.sched = Scheduler(self.backends, policy=policy, n_copies=1 if self.cpu_moe else 2)
        self.n_past = 0
        self.load_s = 0.0  # set by from_gguf
        self._steps: dict[tuple[int, int, bool, str, bool], _Step] = {}  # step()'s key
        self._positions_set: tuple[_Step, int] | None = None  # (step, n_past) its inputs hold
        self.tok_state: Tensor | None = None  # a decode step's token, which its argmax replaces
        # decode()'s picks by position (F32: SET_ROWS writes floats; ids < 2^24 are exact) and the
        # table that turns an I32 pick into that float (a GET_ROWS of row id: the value id)
        self.pick_hist: Tensor | None = None
        self.pick_value: Tensor | None = None
        self._chain_ok: bool | None = None  # _chains(), once known
        self._ring: _PickRing | None = None  # decode()'s reads
        self._v_base: np.ndarray | None = None  # e * n_ctx: the V cache slot of feature e at position 0
        if cfg.n_embd_kv * self.n_ctx > np.iinfo(np.int32).max:  # the I32 V cache slot indices
            raise ConfigError(f"n_ctx {self.n_ctx} is too large for this model: its V cache of "
                              f"{cfg.n_embd_kv} x {self.n_ctx} slots takes indices past 2^31")  # fmt: skip
        self.buffers: list[Buffer] = []
        if merge is None:
            merge = env.MODEL_MERGE.get()
        self.merge = bool(merge) and self.meta is None
        self.repack = env.MODEL_REPACK.get()
        self._build_weights(types or {})

    # --- weights and cache ---------------------------------------------------------------------
    def _device_of(self, spec: WeightSpec) -> Device:
        if spec.layer < 0:  # the input layer (``embd``), unless the head shares it
            return self.output_dev if self.cfg.tied_output else self.embd_dev
        if spec.layer >= self.cfg.n_layers:
            return self.output_dev
        if spec.layer < self.cpu_moe and spec.name.endswith("_exps.weight"):
            return self.cpu
        return self.layer_dev[spec.layer]

    def _buft_of(self, spec: WeightSpec) -> BufferType:
        """Where a weight's bytes live: its device's memory (a CPU's matrices: its repack buffer
        type where it has one, MODEL_REPACK); for experts kept in host memory (cpu_moe), the layer
        device's pinned host buffers where it has them and the CPU computes on them (what an
        asynchronous upload to the device needs), else the CPU's host memory."""
        dev = self._device_of(spec)
        if dev is self.cpu and 0 <= spec.layer < self.cfg.n_layers and self.layer_dev[spec.layer] is not dev:
            # host memory the layer's device may upload from (offloaded products of big batches)
            host = self.layer_dev[spec.layer].host_buffer_type
            if host is not None and host.is_host and self.cpu.supports_buft(host):
                return host
            return dev.buffer_type
        matrix = len(spec.shape) >= 2 and spec.name != "token_embd.weight"
        if self.repack and matrix and dev.type == DeviceType.CPU:
            # the CPU's matrices (products only: the embeddings are also read by GET_ROWS) in its
            # extra buffer type, as llama.cpp's CPU_REPACK; it keeps other types as they are
            for buft in dev.extra_buffer_types:
                if dev.supports_buft(buft):
                    return buft
        return dev.buffer_type

    def _build_weights(self, types: Mapping[str, GGMLType | str | int]) -> None:
        cfg = self.cfg
        self.wctx = Context(f"{cfg.arch}-weights")
        self.w: dict[str, Tensor] = {}
        self.placement: dict[str, Device] = {}
        self.merged: dict[str, Tensor] = {}  # "blk.i.attn_qkv" / "blk.i.ffn_gate_up" → matrix
        by_buft: dict[BufferType, list[Tensor]] = {}
        specs = {s.name: s for s in cfg.weights()}
        tys = {n: parse_type(types.get(n, T.F32)) for n in specs}
        views: dict[str, Tensor] = {}
        if self.merge:
            for merged, parts in self._merge_groups():
                if any(p not in specs for p in parts) or len({tys[p] for p in parts}) != 1:
                    continue
                shapes = [specs[p].shape for p in parts]
                rows = sum(sh[0] for sh in shapes)
                m = self.wctx.new_tensor(tys[parts[0]], (rows, *shapes[0][1:]), merged).set_param()
                self.merged[merged] = m
                by_buft.setdefault(self._buft_of(specs[parts[0]]), []).append(m)
                r0 = 0
                for p, sh in zip(parts, shapes, strict=True):
                    # rows r0 .. r0 + sh[0] of the merged matrix (elements of a merged bias)
                    step = m.nb[1] if len(sh) > 1 else m.nb[0]
                    views[p] = self.wctx.view(m, tuple(reversed(sh)), None, r0 * step).set_name(p)
                    r0 += sh[0]
        for spec in specs.values():
            t = views.get(spec.name)
            if t is None:
                t = self.wctx.new_tensor(tys[spec.name], spec.shape, spec.name).set_param()
            self.w[spec.name] = t
            self.placement[spec.name] = self._device_of(spec)
            by_buft.setdefault(self._buft_of(spec), []).append(t)
        self.cache_k: list[Tensor] = []
        self.cache_v: list[Tensor] = []
        cache_by_dev: dict[Device, list[Tensor]] = {}
        for i in range(cfg.n_layers):
            k = self.wctx.new_tensor(self.cache_type, (self.n_ctx, cfg.n_embd_kv), f"cache_k_l{i}")
            v = self.wctx.new_tensor(self.cache_type, (cfg.n_embd_kv, self.n_ctx), f"cache_v_l{i}")
            self.cache_k.append(k)
            self.cache_v.append(v)
            cache_by_dev.setdefault(self.layer_dev[i], []).extend((k, v))
        if self.meta is None:  # next to the embeddings its GET_ROWS reads (a decode's token feedback)
            self.tok_state = self.wctx.new_tensor(T.I32, (1,), "tok_state")
            self.pick_hist = self.wctx.new_tensor(T.F32, (self.n_ctx, 1), "pick_hist")
            self.pick_value = self.wctx.new_tensor(T.F32, (cfg.n_vocab, 1), "pick_value")
            picks = (self.tok_state, self.pick_hist, self.pick_value)
            cache_by_dev.setdefault(self.embd_dev, []).extend(picks)
        if self.meta is not None:
            place = _Place("+".join(d.name for d in self.meta.devices))
            self.placement = {name: place for name in self.w}
            try:
                self.buffers.append(self.meta.alloc_weights(list(self.w.values())))
                cb = self.meta.alloc_weights(self.cache_k + self.cache_v, usage=BufferUsage.ANY)
                cb.clear(0)
                self.buffers.append(cb)
            except Exception:
                self.free()
                raise
            return
        try:
            for buft, ts in by_buft.items():
                buf = alloc_tensors(ts, buft, BufferUsage.WEIGHTS)
                if buf is not None:
                    self.buffers.append(buf)
            for dev, ts in cache_by_dev.items():
                buf = alloc_tensors(ts, dev.buffer_type, BufferUsage.ANY)
                if buf is not None:
                    # unwritten slots are masked out, but 0 * NaN garbage would still be NaN
                    buf.clear(0)
                    self.buffers.append(buf)
            if self.pick_value is not None:
                set_bytes(self.pick_value, np.arange(cfg.n_vocab, dtype=np.float32))
        except Exception:
            self.free()
            raise

    def _merge_groups(self) -> list[tuple[str, tuple[str, ...]]]:
        """(merged name, its parts in row order) per layer: the projections that read the same
        activations, and their biases. Gate rows come before up rows: SWIGLU (GEGLU) of one
        tensor gates its first half."""
        out = []
        for i in range(self.cfg.n_layers):
            p = f"blk.{i}."
            groups = [("attn_qkv", ("attn_q", "attn_k", "attn_v"))]
            if not self.cfg.is_moe:
                groups.append(("ffn_gate_up", ("ffn_gate", "ffn_up")))
            for merged, parts in groups:
                for kind in ("weight", "bias"):
                    out.append((f"{p}{merged}.{kind}", tuple(f"{p}{x}.{kind}" for x in parts)))
        return out

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of weights per device name."""
        out: dict[str, int] = {}
        for name, t in self.w.items():
            d = self.placement[name].name
            out[d] = out.get(d, 0) + t.nbytes
        return out

    def cache_bytes(self) -> int:
        return sum(t.nbytes for t in self.cache_k + self.cache_v)

    def split_state(self, t: Tensor) -> SplitRole:
        """The tensor-parallel role of one of this model's weight or KV-cache tensors (what
        ggml_backend_meta_get_split_state_t gives for statically allocated tensors)."""
        return self.cfg.split_role(t.name)

    def _tp_split_state(self, t: Tensor):
        """The meta device's split callback: mirrored, or split along the role's axis in units
        that keep a head (whole GQA groups for Q and the output projection) on one device."""
        role = self.cfg.split_role(t.name)
        if role.kind is SplitKind.MIRRORED or role.axis is None:
            return None
        g = role.granularity
        if t.name.endswith(("attn_q.weight", "attn_q.bias", "attn_output.weight")):
            g = self.cfg.head_dim * (self.cfg.n_head // self.cfg.n_head_kv)
        return self.meta.split(t, role.axis, g)

    def load_weights(self, source: Callable[[str], np.ndarray], progress: Callable[[int], None] | None = None,
                     done: Callable[[str], None] | None = None) -> None:  # fmt: skip
        """:func:`copy_weight_bytes` into this model's weights."""
        copy_weight_bytes(self.w, source, progress, done)

    def set_weights(self, values: Mapping[str, np.ndarray]) -> None:
        """:func:`set_weight_values` of this model's weights."""
        set_weight_values(self.w, values)

    @classmethod
    def from_gguf(cls, source: str | GGUFFile, devices: Sequence[Device], *,
                  progress: Callable[[int], None] | None = None, **kw) -> DecoderModel:  # fmt: skip
        """Load a GGUF file of a supported architecture (path or an opened
        :class:`~accelplane.models.gguf.GGUFFile`) onto ``devices``; other keyword arguments as
        the constructor. The model's ``load_s`` is the seconds it took (reading the header,
        allocating, uploading: llama.cpp's load time)."""
        from accelplane.models.gguf import GGUFFile, read_gguf

        t0 = time.perf_counter()
        f = source if isinstance(source, GGUFFile) else read_gguf(source)
        cfg = f.model_config()
        f.check_tensors(cfg)
        kw.setdefault("n_ctx", min(cfg.n_ctx_train, 512))
        m = cls(cfg, devices, types={n: t.type for n, t in f.tensors.items()}, **kw)
        m = with_weights_of(m, f, progress)
        m.load_s = time.perf_counter() - t0
        return m

    def free(self) -> None:
        """Release buffers, backends and the scheduler's memory."""
        if getattr(self, "sched", None) is not None:
            self.sched.free()
            self.sched = None  # type: ignore[assignment]
        for b in getattr(self, "backends", []):
            b.free()
        self.backends = []
        for buf in self.buffers:
            buf.free()
        self.buffers = []
        if self._ring is not None:
            self._ring.free()
            self._ring = None
        self._steps = {}
        self._positions_set = None

    # --- graph --------------------------------------------------------------------------------
    def window(self, n_end: int) -> int:
        """Cache slots attended when the last position is ``n_end - 1`` (``kv_growth``)."""
        if self.kv_growth == "pad":
            return min(self.n_ctx, -(-n_end // self.kv_pad) * self.kv_pad)
        w = self.kv_pad
        while w < n_end:
            w *= 2
        return min(self.n_ctx, w)

    def step(self, n_tokens: int, n_kv: int, all_rows: bool = False, routing: str = "",
             chain: bool = False) -> _Step:  # fmt: skip
        """The (cached) graph for a batch of ``n_tokens`` attending ``n_kv`` cache slots;
        ``all_rows``: logits for every token, else only for the last. ``routing``: "" (the
        model's own, nothing kept), "trace" (each MoE layer's probabilities and ARGSORT kept as
        outputs) or "forced" (each MoE layer's experts an input, its probabilities kept).
        ``chain`` (one token, the model's own routing): the token is read from ``tok_state``
        and the step's argmax copied over it, for the next step, and into ``pick_hist`` at its
        position, for the host (:meth:`decode`)."""
        chain = chain and n_tokens == 1 and not routing and self._chains()
        key = (n_tokens, n_kv, all_rows or n_tokens == 1, routing if self.cfg.is_moe else "", chain)
        st = self._steps.get(key)
        if st is None:
            st = self._steps[key] = self._build(*key)
        return st

    def _build(self, n_tok: int, n_kv: int, all_rows: bool, routing: str, chain: bool) -> _Step:
        """Build the forward graph (module docstring) for one batch shape."""
        cfg, w = self.cfg, self.w
        ctx = Context(f"{cfg.arch}-{n_tok}x{n_kv}")
        groups: dict[int, str] = {}
        group = "inp"

        def cb(t: Tensor, name: str) -> Tensor:
            groups[id(t)] = group
            return t.set_name(f"{group}.{name}" if group.startswith("blk") else name)

        def norm(x: Tensor, weight: str, name: str) -> Tensor:
            return cb(ctx.mul(cb(ctx.rms_norm(x, cfg.rms_eps), "norm"), w[weight]), name)

        def qk_norm(t: Tensor, which: str) -> Tensor:  # per head, in the layer being built (p)
            return norm(t, f"{p}attn_{which}_norm.weight", f"{which.upper()}cur_normed")

        d, hd, n_head, n_kv_head = cfg.d_model, cfg.head_dim, cfg.n_head, cfg.n_head_kv
        e_kv = cfg.n_embd_kv
        tokens = self.tok_state if chain else ctx.new_tensor(T.I32, (n_tok,), "inp_tokens").set_input()
        pos = ctx.new_tensor(T.I32, (n_tok,), "inp_pos").set_input()
        g = n_head // n_kv_head
        # row t * g + r: token t, query head r of its group (see the attention below). Several
        # tokens: the masks come in a row per token and are repeated on the device (a GET_ROWS
        # by mask_rows), so a prompt uploads n_kv floats a token, not g times as many
        mask_rows = None
        if n_tok > 1 and g > 1:
            mask_rows = ctx.new_tensor(T.I32, (n_tok * g,), "inp_kq_mask_rows").set_input()
        rows = n_tok * g if mask_rows is None else n_tok

        def mask_input(name: str) -> tuple[Tensor, Tensor]:  # (the input, the mask read)
            m = ctx.new_tensor(T.F32, (rows, n_kv), name).set_input()
            return m, m if mask_rows is None else cb(ctx.get_rows(m, mask_rows), name + "_heads")

        mask = mask_swa = mask_in = mask_swa_in = None
        if not all(cfg.is_swa(il) for il in range(cfg.n_layers)):  # a layer attends to the whole cache
            mask_in, mask = mask_input("inp_kq_mask")
        if cfg.has_swa:  # the sliding-window layers' own mask
            mask_swa_in, mask_swa = mask_input("inp_kq_mask_swa")
        v_idx = ctx.new_tensor(T.I32, (n_tok * e_kv,), "inp_v_idxs").set_input()
        ff = w.get("rope_freqs.weight")
        esz = self.cache_type.type_size

        cur = cb(ctx.get_rows(w["token_embd.weight"], tokens), "inp_embd")
        gating: list[Tensor] = []  # each MoE layer's expert weights, ordered before its experts
        routes: list[tuple[Tensor, Tensor]] = []  # traced or forced routing (_Step.routes)
        if cfg.embd_scale:
            cur = cb(ctx.scale(cur, cfg.embd_scale), "inp_scaled")
        for il in range(cfg.n_layers):
            group = f"blk.{il}"
            p = f"blk.{il}."
            inp = cur
            x = norm(cur, p + "attn_norm.weight", "attn_norm")
            q, k, v = self._qkv(ctx, cb, x, p, n_tok)
            base, scale = cfg.rope_of(il)
            # KV cache writes; the attention reads views of the SET_ROWS results, so the graph
            # orders the writes before the reads
            q, k_set, v_set = rope_into_cache(
                ctx, q, k, v, pos, self.cache_k[il], self.cache_v[il], v_idx, hd=hd, n_head=n_head,
                n_kv_head=n_kv_head, rot=cfg.rot, mode=cfg.rope_mode, per_channel_v=self.meta is not None,
                name=cb, qk_norm=qk_norm if cfg.qk_norm else None, n_ctx_orig=cfg.n_ctx_train,
                freq_base=base, freq_scale=scale, attn_factor=cfg.rope_attn_factor,
                freq_factors=ff)  # fmt: skip
            kk = ctx.view(k_set, (hd, n_kv, n_kv_head), (esz, e_kv * esz, hd * esz))
            vv = ctx.view(v_set, (n_kv, hd, n_kv_head), (esz, self.n_ctx * esz, hd * self.n_ctx * esz))
            # grouped-query attention as one product per kv head: its g query heads' rows
            # (token-major, head-minor) form one [g * n_tok, hd] matrix
            qg = _packed(ctx, cb, ctx.permute(ctx.reshape_ne(q, hd, g, n_kv_head, n_tok), 0, 1, 3, 2),
                         "q_grouped")  # [n_head_kv, n_tok, g, hd]  # fmt: skip
            qg = ctx.reshape_ne(qg, hd, g * n_tok, n_kv_head)
            kq = cb(ctx.mul_mat(kk, qg), "kq")  # [n_head_kv, n_tok * g, n_kv]
            kq = cb(ctx.soft_max(kq, mask_swa if cfg.is_swa(il) else mask, cfg.kq_scale), "kq_soft_max")
            kqv = cb(ctx.mul_mat(vv, kq), "kqv")  # [n_head_kv, n_tok * g, hd]
            o = ctx.permute(ctx.reshape_ne(kqv, hd, g, n_tok, n_kv_head), 0, 1, 3, 2)
            o = _packed(ctx, cb, o, "kqv_merged")  # [n_tok, n_head_kv, g, hd] = [n_tok, n_head, hd]
            o = self._linear(ctx, cb, p + "attn_output", ctx.reshape_ne(o, cfg.n_embd_q, n_tok), "attn_out")
            if cfg.post_norms:
                o = norm(o, p + "post_attention_norm.weight", "attn_post_norm")
            ffn_inp = cb(ctx.add(o, inp), "ffn_inp")
            x = norm(ffn_inp, p + "ffn_norm.weight", "ffn_norm")
            if cfg.is_moe:
                f = self._moe(ctx, cb, x, il, n_tok, gating, routes if routing else None, routing == "forced")
            else:
                f = self._ffn(ctx, cb, x, p)
            if cfg.post_norms:
                f = norm(f, p + "post_ffw_norm.weight", "ffn_post_norm")
            cur = cb(ctx.add(f, ffn_inp), "l_out")

        group = "out"
        if not all_rows and n_tok > 1:
            cur = ctx.view(cur, (d, 1), (cur.nb[0], cur.nb[1]), (n_tok - 1) * cur.nb[1])
        cur = norm(cur, "output_norm.weight", "result_norm")
        head = w["token_embd.weight"] if cfg.tied_output else w["output.weight"]
        logits = cb(ctx.mul_mat(head, cur), "result_head")
        if "output.bias" in w:
            logits = cb(ctx.add(logits, w["output.bias"]), "result_head_b")
        if cfg.logit_softcap:
            c = cfg.logit_softcap
            logits = ctx.scale(cb(ctx.tanh(cb(ctx.scale(logits, 1.0 / c), "softcap_in")), "softcap_tanh"), c)
        logits = cb(logits, "result_output")  # the last of them
        ids = cb(ctx.argmax(logits), "result_argmax")
        kept: tuple[Tensor, ...] = ()
        if chain:
            value = cb(ctx.get_rows(self.pick_value, ids), "result_pick")
            kept = (cb(ctx.set_rows(self.pick_hist, value, pos), "result_kept"),)
            ids = cb(ctx.cpy(ids, self.tok_state), "result_fed")
        graph = ctx.graph(logits, *kept, ids, *(t for r in routes for t in r), expand=gating)
        return _Step(graph, n_tok, n_kv, all_rows, tokens, pos, mask_in, v_idx, logits, ids, groups,
                     mask_swa_in, routes, mask_rows)  # fmt: skip

    def _linear(self, ctx: Context, cb: _Namer, base: str, x: Tensor, name: str) -> Tensor:
        """``x`` times weight ``base``.weight, plus ``base``.bias when the model has one."""
        y = cb(ctx.mul_mat(self.w[base + ".weight"], x), name)
        b = self.w.get(base + ".bias")
        return y if b is None else cb(ctx.add(y, b), name + "_b")

    def _qkv(self, ctx: Context, cb: _Namer, x: Tensor, p: str, n_tok: int) -> tuple[Tensor, Tensor, Tensor]:
        """The Q, K and V projections (with their biases) of activations ``x``: one product by
        the merged matrix for a single token (Q, K, V are contiguous slices of its one row),
        else one per projection."""
        qkv_w = self.merged.get(p + "attn_qkv.weight")
        if qkv_w is None or n_tok != 1:
            return tuple(self._linear(ctx, cb, p + n, x, c) for n, c in  # type: ignore[return-value]
                         (("attn_q", "Qcur"), ("attn_k", "Kcur"), ("attn_v", "Vcur")))  # fmt: skip
        qkv = cb(ctx.mul_mat(qkv_w, x), "QKVcur")
        qkv_b = self.merged.get(p + "attn_qkv.bias")
        if qkv_b is not None:
            qkv = cb(ctx.add(qkv, qkv_b), "QKVcur_b")
        fsz, r0, out = qkv.nb[0], 0, []
        nq, nkv = self.cfg.n_embd_q, self.cfg.n_embd_kv
        for n, rows in (("attn_q", nq), ("attn_k", nkv), ("attn_v", nkv)):
            t = ctx.view(qkv, (rows, 1), None, r0 * fsz)
            b = self.w.get(p + n + ".bias")
            out.append(t if b is None or qkv_b is not None else cb(ctx.add(t, b), n + "_b"))
            r0 += rows
        return out[0], out[1], out[2]

    def _ffn(self, ctx: Context, cb: _Namer, x: Tensor, p: str) -> Tensor:
        """The gated FFN: act(gate) * up, down (``act``: SILU, or the tanh GELU)."""
        glu = ctx.geglu if self.cfg.ffn_act == "gelu" else ctx.swiglu
        act = f"ffn_{'geglu' if self.cfg.ffn_act == 'gelu' else 'swiglu'}"
        gu_w = self.merged.get(p + "ffn_gate_up.weight")
        bias_ok = (p + "ffn_gate.bias" in self.w) == (p + "ffn_gate_up.bias" in self.merged)
        if gu_w is not None and bias_ok:  # GLU of one tensor: act(first half) * second half, per row
            gu = cb(ctx.mul_mat(gu_w, x), "ffn_gate_up")
            gu_b = self.merged.get(p + "ffn_gate_up.bias")
            if gu_b is not None:
                gu = cb(ctx.add(gu, gu_b), "ffn_gate_up_b")
            a = cb(glu(gu), act)
        else:
            g = self._linear(ctx, cb, p + "ffn_gate", x, "ffn_gate")
            u = self._linear(ctx, cb, p + "ffn_up", x, "ffn_up")
            a = cb(glu(g, u), act)
        return self._linear(ctx, cb, p + "ffn_down", a, "ffn_out")

    def _device_slots(self, il: int, n_tok: int) -> int:
        """How many of each token's expert slots layer ``il``'s device computes in a batch of
        ``n_tok`` whose experts live in host memory (``moe_device_share``): where the device
        reads them in place and the relaxed policy lets the CPU start before the device is done
        (:meth:`_moe`); 0: the CPU computes all."""
        k, dev = self.cfg.n_expert_used, self.layer_dev[il] if il < len(self.layer_dev) else None
        if (il >= self.cpu_moe or k < 2 or self.moe_device_share <= 0.0 or dev is None
                or dev is self.cpu or not (dev.caps.host_reads and dev.has_events)
                or self.sched.policy != "relaxed"):  # fmt: skip
            return 0
        return min(k - 1, max(1, round(k * self.moe_device_share)))

    def _moe(self, ctx: Context, cb: _Namer, x: Tensor, il: int, n_tok: int, gating: list[Tensor],
             routes: list[tuple[Tensor, Tensor]] | None = None, forced: bool = False) -> Tensor:  # fmt: skip
        """llama.cpp's build_moe_ffn for llama and qwen3moe: softmax gating, top-k, weights
        renormalized. The weights go to ``gating``: the graph orders their run (softmax →
        argsort → top-k view → get_rows → sum_rows → div) before the experts, as llama.cpp
        does, so a plugin can compute it as one kernel (accelplane.core.fusion: moe_gating).
        ``routes``: gets (probabilities, ARGSORT or, ``forced``, the ids input) as outputs.
        Where layer ``il`` gives its device slots (:meth:`_device_slots`; experts in host
        memory): those first slots pinned to the device, which reads their experts in place
        (accelplane.sched.experts: reads_in_place; else the CPU computes all), then the others
        on the CPU with the weights, the two weighted sums added on the device. The device's
        come first in the graph: the scheduler queues them behind the router and the copies of
        what the CPU needs, and the CPU computes its slots while the device computes its own
        (docs/ordering.md)."""
        w, cfg, p = self.w, self.cfg, f"blk.{il}."
        k = cfg.n_expert_used
        logits = cb(ctx.mul_mat(w[p + "ffn_gate_inp.weight"], x), "ffn_moe_logits")  # [T, E]
        given = cb(ctx.new_tensor(T.I32, (n_tok, k)), "ffn_moe_ids").set_input() if forced else None
        named: dict[str, Tensor] = {}

        def name(t: Tensor, what: str) -> Tensor:
            named[what] = t
            return cb(t, what)

        ids, wts = moe_gating(ctx, logits, k, name=name, ids=given)
        gating.append(wts)
        if routes is not None:
            used = given if given is not None else ids.view_src  # the input, or the whole ARGSORT
            routes.append((named["ffn_moe_probs"].set_output(), used.set_output()))
        xb = ctx.reshape_ne(x, cfg.d_model, 1, n_tok)

        def experts(ids: Tensor, wts: Tensor) -> Tensor:
            g = cb(ctx.mul_mat_id(w[p + "ffn_gate_exps.weight"], xb, ids), "ffn_moe_gate")
            u = cb(ctx.mul_mat_id(w[p + "ffn_up_exps.weight"], xb, ids), "ffn_moe_up")
            a = cb(ctx.swiglu(g, u), "ffn_moe_swiglu")  # [T, k, ff_exp]
            dn = cb(ctx.mul_mat_id(w[p + "ffn_down_exps.weight"], a, ids), "ffn_moe_down")  # [T, k, d]
            return moe_weighted_sum(ctx, dn, wts, name=cb)

        device_slots = self._device_slots(il, n_tok)
        if not device_slots:
            return experts(ids, wts)

        def slots(j0: int, j1: int) -> tuple[Tensor, Tensor]:
            return (ctx.view(ids, (j1 - j0, n_tok), (ids.nb[0], ids.nb[1]), j0 * ids.nb[0]),
                    ctx.view(wts, (1, j1 - j0, n_tok), (wts.nb[0], wts.nb[1], wts.nb[2]), j0 * wts.nb[1]))

        dev = self.layer_dev[il]
        mine = slots(0, device_slots)
        if not reads_in_place(dev, w[p + "ffn_gate_exps.weight"], mine[0]):
            return experts(ids, wts)
        # an ADD lists its first operand's nodes first: the device's slots, then the host's
        on_dev = experts(*mine)
        host = experts(*slots(device_slots, k))
        out = cb(ctx.add(on_dev, host), "ffn_moe_out")
        backend = next(b for b in self.sched.backends if b.device is dev)
        for t in _made_from(out, (host, xb, ids, wts)):
            self.sched.set_tensor_backend(t, backend)
        return out

    # --- running ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the context (positions restart at 0; stale cache slots are masked)."""
        self.n_past = 0

    def _set_positions(self, st: _Step, n_past: int) -> None:
        """Write step ``st``'s position inputs for tokens at ``n_past ..``: the positions, the
        causal masks (per query row of a GQA group; the sliding window's also hides slots
        n_swa or more positions back, llama.cpp's is_masked_swa) and the V cache slots. The
        arrays are built here in the inputs' own dtypes and shapes, so they go in as bytes
        (set_bytes), without Tensor.set's conversions and checks: a decode writes them every
        token."""
        n = st.n_tokens
        pos = np.arange(n_past, n_past + n, dtype=np.int32)
        set_bytes(st.pos, pos)
        g = self.cfg.n_head // self.cfg.n_head_kv
        slot = np.arange(st.n_kv)[None, :]
        # slots up to each token's own position are visible
        visible = slot <= pos[:, None]
        zero, hidden = np.float32(0), np.float32(-np.inf)
        # a row per token, repeated for the g query heads of its kv head here or on the device
        reps = g if st.mask_rows is None else 1
        if st.mask_rows is not None:
            set_bytes(st.mask_rows, np.repeat(np.arange(n, dtype=np.int32), g))
        if st.mask is not None:
            set_bytes(st.mask, np.repeat(np.where(visible, zero, hidden), reps, axis=0))
        if st.mask_swa is not None:
            visible &= pos[:, None] - slot < self.cfg.n_swa
            set_bytes(st.mask_swa, np.repeat(np.where(visible, zero, hidden), reps, axis=0))
        if self.meta is None:
            if self._v_base is None:
                self._v_base = np.arange(self.cfg.n_embd_kv, dtype=np.int32) * np.int32(self.n_ctx)
            set_bytes(st.v_idx, (self._v_base[None, :] + pos[:, None]).reshape(-1))

    def eval(self, tokens: Sequence[int] | np.ndarray, *, all_logits: bool = False,
             want_logits: bool = True, trace_routing: bool = False,
             routing: Sequence[Routing] | None = None) -> EvalResult:  # fmt: skip
        """Run ``tokens`` at positions ``n_past ..``: write their K/V into the cache, return
        the greedy next ids and (``want_logits``) the logits of the last token, or of every
        token with ``all_logits``. Advances ``n_past``.

        A MoE model's routing: ``trace_routing`` returns each MoE layer's (:class:`Routing`);
        ``routing`` (one per MoE layer, for these tokens) makes each layer use the given experts
        instead of its top k (teacher-forcing the routing of another run), and returns the
        routing with this model's own probabilities."""
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = toks.size
        if n == 0:
            raise ShapeError("eval: no tokens")
        if self.n_past + n > self.n_ctx:
            raise OutOfRangeError(f"eval: {self.n_past} + {n} tokens exceed the context of "
                                  f"{self.n_ctx}")  # fmt: skip
        if toks.min() < 0 or toks.max() >= self.cfg.n_vocab:
            raise OutOfRangeError(f"eval: token ids must be in 0..{self.cfg.n_vocab - 1}")
        mode = "forced" if routing is not None else "trace" if trace_routing else ""
        if mode and not self.cfg.is_moe:
            raise ShapeError("eval: routing is traced or given for MoE models only")
        st = self.step(n, self.window(self.n_past + n), all_logits, mode)
        self.sched.alloc_graph(st.graph)
        set_bytes(st.tokens, toks.astype(np.int32))  # checked above
        if routing is not None:
            self._force_routing(st, routing, n)
        ready = self._positions_set
        if ready is None or ready[0] is not st or ready[1] != self.n_past:
            self._set_positions(st, self.n_past)
        self._positions_set = None
        self.sched.graph_compute(st.graph)
        # a decode step usually follows at the next position: write its positions while the
        # devices work, where the scheduler is done with this step's inputs (and not through
        # the meta device, whose inputs are its devices' memory)
        nxt = self.n_past + n
        early = n == 1 and self.meta is None and nxt < self.n_ctx and self.sched.inputs_released()
        if early and self.step(1, self.window(nxt + 1), False) is st:
            self._set_positions(st, nxt)
            self._positions_set = (st, nxt)
        self.sched.synchronize()
        self.n_past += n
        ids = st.argmax.get().astype(np.int64)
        logits = st.logits.get() if want_logits else None
        k = self.cfg.n_expert_used
        routes = [Routing(p.get().reshape(n, -1), u.get().reshape(n, -1)[:, :k].astype(np.int32))
                  for p, u in st.routes] if mode else None  # fmt: skip
        return EvalResult(ids, logits, routes)

    def _force_routing(self, st: _Step, routing: Sequence[Routing], n: int) -> None:
        """Write the given experts into step ``st``'s ids inputs, checked against the model."""
        k, n_exp = self.cfg.n_expert_used, self.cfg.n_expert
        if len(routing) != len(st.routes):
            raise ShapeError(f"eval: routing for {len(st.routes)} MoE layers expected, got {len(routing)}")
        for (_, inp), r in zip(st.routes, routing, strict=True):
            ids = np.asarray(r.ids)
            if ids.shape != (n, k):
                raise ShapeError(f"eval: routing ids of shape ({n}, {k}) expected, got {ids.shape}")
            if ids.size and (ids.min() < 0 or ids.max() >= n_exp):
                raise OutOfRangeError(f"eval: routing ids must be in 0..{n_exp - 1}")
            inp.set(ids.astype(np.int32))

    def decode(self, first: int, n: int, on_token: Callable[[int], None] | None = None,
               stop: Callable[[int], bool] | None = None) -> list[int]:  # fmt: skip
        """Greedy decoding: feed ``first`` at position ``n_past``, then each step's own pick, for
        up to ``n`` steps; return the picks (the greedy next token after each fed one) and advance
        ``n_past`` by the steps kept. ``on_token(t)`` gets each pick as it is known; ``stop(t)``
        True makes ``t`` the last.

        A step's pick goes from its argmax to the next step's embedding lookup on the device
        (a CPY into ``tok_state``), so the host queues step i + 1 (its positions written into
        the scheduler's other copy slot) before it reads step i's pick: no host round trip
        between tokens. The host reads the pick from ``pick_hist`` (where the step wrote it at
        its position, so no later step writes over it) on a second queue of the device where
        it has events: a read in the computing queue would hold the next step until it landed.
        Under the tensor split, where the embeddings' device cannot run those copies, or with
        a vocabulary of 2^24 tokens or more, each step is one :meth:`eval` instead."""
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
            raise ShapeError(f"decode: n must be an integer >= 0, got {n!r}")
        v = self.cfg.n_vocab
        if isinstance(first, bool) or not isinstance(first, int | np.integer) or not 0 <= first < v:
            raise OutOfRangeError(f"decode: the first token must be an id in 0..{v - 1}, got {first!r}")
        if self.n_past + n > self.n_ctx:
            raise OutOfRangeError(f"decode: {self.n_past} + {n} tokens exceed the context of {self.n_ctx}")
        out: list[int] = []

        def pick(t: int) -> bool:
            out.append(t)
            if on_token:
                on_token(t)
            return bool(stop and stop(t))

        if not self._chains():
            tok = int(first)
            for _ in range(n):
                tok = int(self.eval([tok], want_logits=False).ids[-1])
                if pick(tok):
                    break
            return out
        ring = self._pick_ring()
        be = self.sched.backends[self._embd_backend()]
        reader = ring.reader or be
        self._positions_set = None
        self.sched.synchronize()
        set_bytes(self.tok_state, np.array([first], dtype=np.int32))
        last: _Step | None = None
        queued = 0  # steps queued whose pick is not read yet (0 or 1)
        try:
            for i in range(n):
                st = self.step(1, self.window(self.n_past + 1), chain=True)
                if last is not None and st is not last:
                    self.sched.synchronize()  # a new graph may be planned over memory the last one uses
                last = st
                self.sched.alloc_graph(st.graph)
                self._set_positions(st, self.n_past)
                self.sched.graph_compute(st.graph)
                if ring.done is not None:
                    ring.done.record(be)
                    ring.done.wait(reader)
                reader.get_tensor_async(self.pick_hist, ring.slots[i % 2], 4 * self.n_past, 4)
                ring.events[i % 2].record(reader)
                self.n_past += 1
                queued += 1
                if i > 0:
                    t = ring.take((i - 1) % 2)
                    queued -= 1
                    if pick(t):
                        break
            else:
                if queued:
                    queued = 0
                    pick(ring.take((n - 1) % 2))
        finally:
            if ring.reader is not None:
                ring.reader.synchronize()
            self.sched.synchronize()
            self.n_past -= queued  # the step queued past a stop: its cache row stays masked
        return out

    def _chains(self) -> bool:
        """Whether :meth:`decode` feeds picks back on the device (its docstring)."""
        if self._chain_ok is None:
            # picks are kept as floats: exact below 2^24
            ok = self.tok_state is not None and self.cfg.n_vocab <= 1 << 24
            if ok:
                ctx = Context("chain-check")
                ids = ctx.new_tensor(T.I32, (1,), "pick")
                value = ctx.get_rows(self.pick_value, ids)
                kept = ctx.set_rows(self.pick_hist, value, ctx.new_tensor(T.I32, (1,), "pos"))
                ok = all(self.embd_dev.supports_op(t) for t in (ctx.cpy(ids, self.tok_state), value, kept))
            self._chain_ok = ok
        return self._chain_ok

    def _embd_backend(self) -> int:
        return next(i for i, b in enumerate(self.sched.backends) if b.device is self.embd_dev)

    def _pick_ring(self) -> _PickRing:
        if self._ring is None:
            self._ring = _PickRing(self.embd_dev)
        return self._ring

    def generate(self, prompt: Sequence[int], n_new: int,
                 on_token: Callable[[int], None] | None = None) -> list[int]:  # fmt: skip
        """Greedy: ``n_new`` tokens after ``prompt`` (continuing the context); the first comes
        from the prefill, the others from :meth:`decode`."""
        if n_new <= 0:
            return []
        tok = int(self.eval(prompt, want_logits=False).ids[-1])
        if on_token:
            on_token(tok)
        return [tok, *self.decode(tok, n_new - 1, on_token)]

    # --- reporting ------------------------------------------------------------------------------
    def describe_plan(self, n_tokens: int = 1) -> list[str]:
        """Lines saying where the weights are and which device runs which ops of the graph
        for ``n_tokens`` (planned and allocated by the scheduler; nothing is computed)."""
        st = self.step(n_tokens, self.window(max(1, n_tokens)), False)
        self.sched.alloc_graph(st.graph)
        lines = []
        for dev, nb in self.weight_bytes().items():
            lines.append(f"weights on {dev}: {nb / 2**20:.1f} MiB")
        if self.meta is not None:
            lines.append(f"tensor split over {len(self.meta.devices)} devices "
                         f"({', '.join(d.name for d in self.meta.devices)}):")  # fmt: skip
            return lines + [f"  {x}" for x in self.meta.describe(st.graph)]
        caches: dict[str, int] = {}
        for i, dev in enumerate(self.layer_dev):
            caches[dev.name] = caches.get(dev.name, 0) + self.cache_k[i].nbytes + self.cache_v[i].nbytes
        for dev, nb in caches.items():
            lines.append(f"KV cache on {dev}: {nb / 2**20:.1f} MiB ({self.cache_type.name}, n_ctx "
                         f"{self.n_ctx})")  # fmt: skip
        per_group: dict[str, Counter] = {}
        ops_on: dict[str, dict[str, list[str]]] = {}
        for n in st.graph.nodes:
            if n.op in VIEW_OPS:
                continue
            g = st.groups.get(id(n), "?")
            b = self.sched.get_tensor_backend(n)
            bn = b.device.name if b is not None else "?"
            per_group.setdefault(g, Counter())[bn] += 1
            ops_on.setdefault(g, {}).setdefault(bn, []).append(op_desc(n))
        rows: list[tuple[str, str]] = []
        for g, cnt in per_group.items():
            parts = []
            for bn, c in cnt.most_common():
                ops = sorted(set(ops_on[g][bn]))
                parts.append(f"{bn} ({c} ops)" if len(cnt) == 1 or c > 3
                             else f"{bn} ({', '.join(ops)})")  # fmt: skip
            rows.append((g, ", ".join(parts)))
        # compress runs of layers with the same placement
        merged: list[tuple[str, str]] = []
        run_start = run_end = None
        for g, desc in rows + [("", "")]:
            if g.startswith("blk.") and run_start is not None and desc == merged[-1][1] and (
                    int(g[4:]) == int(run_end[4:]) + 1):  # fmt: skip
                run_end = g
                merged[-1] = (f"{run_start} - {run_end}", desc)
                continue
            if g:
                merged.append((g, desc))
            run_start = run_end = g if g.startswith("blk.") else None
        lines.append(f"graph for {n_tokens} token(s): {self.sched.stats.splits} split(s), "
                     f"{self.sched.stats.copies} input copies")  # fmt: skip
        w = max(len(g) for g, _ in merged)
        for g, desc in merged:
            lines.append(f"  {g:<{w}}  {desc}")
        return lines
