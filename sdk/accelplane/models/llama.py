"""A llama-architecture decoder (and its MoE variant) built only with the public host API.

The forward pass is llama.cpp's ``llm_build_llama`` written as accelplane graph ops:

* token embedding: GET_ROWS of ``token_embd`` (on the first layer's device where it runs there, else
  in host memory like llama.cpp's input layer: the ``embd`` argument);
* per layer: RMS_NORM · attn_norm → Q/K/V projections → ROPE (normal or NEOX per config) →
  K and V written into the KV cache with SET_ROWS at the tokens' positions → grouped-query
  attention over a fixed window of the cache with a causal mask (SOFT_MAX with scale and mask;
  the query heads sharing a kv head are batched into one MUL_MAT per kv head, so a decode step
  issues n_head_kv products, not n_head) → output projection → residual; RMS_NORM · ffn_norm →
  SWIGLU FFN (or the MoE FFN: router, SOFT_MAX, ARGSORT top-k, MUL_MAT_ID experts weighted by
  the renormalized router probabilities) → residual;
* RMS_NORM · output_norm → output head (logits) → ARGMAX (greedy sampling on the device).

Each layer's Q, K and V matrices (and the FFN's gate and up) are stored as one matrix when
their types match (``merge``), so a decode step runs one product per group; prefill batches
multiply by the per-projection views of it, which keep the GGUF names.

The KV cache persists across calls: K is stored as rows ``[n_ctx, n_head_kv * head_dim]``,
V transposed ``[n_head_kv * head_dim, n_ctx]`` (llama.cpp's non-flash-attention layout, so
``kq · v`` is a plain MUL_MAT); both F16 or F32. A graph is built once per
``(n_tokens, kv window, all rows)`` and reused: the window is the number of cache slots
attended, rounded up to ``kv_pad`` (so a decode graph is the same object for ``kv_pad``
consecutive tokens and the backends' plan caches hit), unused slots hidden by the mask.

Placement (``split``): ``none`` puts every layer on ``devices[0]``; ``layer`` cuts the layers
into contiguous, even chunks over ``devices`` (llama.cpp ``-sm layer``); the output layer goes
with the last layer; ``tensor`` runs every layer on all the devices at once through the meta
device (accelplane.parallel.meta: weights split by :meth:`LlamaConfig.split_role`, attention heads and FFN
columns per device, row-parallel products all-reduced).
"""

from __future__ import annotations

import math
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
from accelplane.runtime.backend import Backend, Buffer, BufferUsage, Device
from accelplane.sched import Scheduler

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


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters, named after llama.cpp's GGUF keys (``llama.embedding_length`` = d_model,
    ``llama.block_count`` = n_layers, ...; see :mod:`accelplane.models.gguf`)."""

    n_vocab: int
    d_model: int
    n_layers: int
    n_head: int
    n_head_kv: int
    d_ff: int
    n_ctx_train: int = 2048
    rms_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_neox: bool = False  # llama GGUF files use normal rope (Q/K rows permuted at conversion)
    n_rot: int = 0  # rotary dimensions; 0 = head_dim
    n_expert: int = 0  # > 0: MoE FFN (Mixtral-style llama)
    n_expert_used: int = 0
    tied_output: bool = False  # no output.weight: the head reuses token_embd

    def __post_init__(self) -> None:
        for k in ("n_vocab", "d_model", "n_layers", "n_head", "n_head_kv", "d_ff", "n_ctx_train"):
            if getattr(self, k) <= 0:
                raise ShapeError(f"llama config: {k} must be > 0, got {getattr(self, k)}")
        if self.d_model % self.n_head:
            raise ShapeError(f"llama config: d_model={self.d_model} is not a multiple of "
                             f"n_head={self.n_head}")  # fmt: skip
        if self.n_head % self.n_head_kv:
            raise ShapeError(f"llama config: n_head={self.n_head} is not a multiple of "
                             f"n_head_kv={self.n_head_kv}")  # fmt: skip
        if self.rot % 2 or self.rot > self.head_dim:
            raise ShapeError(f"llama config: n_rot={self.rot} must be even and <= head_dim")
        if self.n_expert and not 0 < self.n_expert_used <= self.n_expert:
            raise ShapeError(f"llama config: n_expert_used={self.n_expert_used} must be in "
                             f"1..n_expert={self.n_expert}")  # fmt: skip

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def rot(self) -> int:
        return self.n_rot or self.head_dim

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def rope_mode(self) -> int:
        return ROPE_TYPE_NEOX if self.rope_neox else ROPE_TYPE_NORMAL

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    def weights(self) -> list[WeightSpec]:
        """Every weight, in llama.cpp's GGUF names and order."""
        d, ff, hd = self.d_model, self.d_ff, self.head_dim
        out = [WeightSpec("token_embd.weight", (self.n_vocab, d), -1, True)]
        for i in range(self.n_layers):
            p = f"blk.{i}."
            out += [
                WeightSpec(p + "attn_norm.weight", (d,), i, False),
                WeightSpec(p + "attn_q.weight", (self.n_head * hd, d), i, True),
                WeightSpec(p + "attn_k.weight", (self.n_embd_kv, d), i, True),
                WeightSpec(p + "attn_v.weight", (self.n_embd_kv, d), i, True),
                WeightSpec(p + "attn_output.weight", (d, self.n_head * hd), i, True),
                WeightSpec(p + "ffn_norm.weight", (d,), i, False),
            ]
            if self.is_moe:
                e = self.n_expert
                out += [
                    WeightSpec(p + "ffn_gate_inp.weight", (e, d), i, False),
                    WeightSpec(p + "ffn_gate_exps.weight", (e, ff, d), i, True),
                    WeightSpec(p + "ffn_down_exps.weight", (e, d, ff), i, True),
                    WeightSpec(p + "ffn_up_exps.weight", (e, ff, d), i, True),
                ]
            else:
                out += [
                    WeightSpec(p + "ffn_gate.weight", (ff, d), i, True),
                    WeightSpec(p + "ffn_down.weight", (d, ff), i, True),
                    WeightSpec(p + "ffn_up.weight", (ff, d), i, True),
                ]
        out.append(WeightSpec("output_norm.weight", (d,), self.n_layers, False))
        if not self.tied_output:
            out.append(WeightSpec("output.weight", (self.n_vocab, d), self.n_layers, True))
        return out

    def split_role(self, name: str) -> SplitRole:
        """The tensor-parallel role of a weight or KV-cache tensor (llama.cpp's
        ``llama_meta_device_get_split_state``): Q/K/V, gate/up (experts too) and the output
        head are column-parallel; attn_output and down are row-parallel (their products are
        partial sums to all-reduce); norms, embeddings and the router are mirrored. The KV
        cache splits by kv heads (K rows on axis 0, the transposed V on axis 1)."""
        base = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name
        hd = self.head_dim
        if name.startswith("cache_k"):
            return SplitRole(SplitKind.COLUMN, 0, hd)
        if name.startswith("cache_v"):
            return SplitRole(SplitKind.COLUMN, 1, hd)
        if base in ("attn_q", "attn_k", "attn_v"):
            return SplitRole(SplitKind.COLUMN, 1, hd)
        if base in ("ffn_gate", "ffn_up", "ffn_gate_exps", "ffn_up_exps", "output"):
            return SplitRole(SplitKind.COLUMN, 1)
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
    mask: Tensor
    v_idx: Tensor
    logits: Tensor
    argmax: Tensor
    groups: dict[int, str] = field(default_factory=dict)  # id(node) -> "inp" / "blk.N" / "out"


@dataclass
class EvalResult:
    """``ids``: the greedy next token after each output row; ``logits``: F32 [rows, n_vocab]
    (None when not requested). Rows: every token (all_logits) or the last one."""

    ids: np.ndarray
    logits: np.ndarray | None


def _packed(ctx: Context, cb: _Namer, t: Tensor, name: str) -> Tensor:
    """``t`` packed: a CONT where its layout needs one; a permute that moves only dimensions
    of size 1 (every single-token step) is already packed, and costs no copy."""
    return t if t.is_contiguous() else cb(ctx.cont(t), name)


def rope_into_cache(ctx: Context, q: Tensor, k: Tensor, v: Tensor, pos: Tensor, kc: Tensor, vc: Tensor,
                    v_idx: Tensor, *, hd: int, n_head: int, n_kv_head: int, rot: int, mode: int,
                    per_channel_v: bool = False, name: _Namer = lambda t, _: t,
                    **rope_kw) -> tuple[Tensor, Tensor, Tensor]:
    """The attention's inputs for tokens whose projections are ``q``, ``k``, ``v`` (a row of
    n_head hd, n_kv_head hd and n_kv_head hd values per token): Q roped; K roped and written
    into the K cache ``kc`` (a row per position) at ``pos``; V written into the transposed V
    cache ``vc`` (a row per channel), by one slot index per value (``v_idx``: channel n_ctx +
    position) or, ``per_channel_v``, per channel at ``pos`` (indices local to a tensor-split
    shard). Returns (roped Q, the K cache write, the V cache write). ``name`` names each node."""
    n_tok, e_kv, n_ctx = pos.ne[0], n_kv_head * hd, kc.ne[1]
    q = name(ctx.rope(ctx.reshape_ne(q, hd, n_head, n_tok), pos, rot, mode, **rope_kw), "Qrope")
    k = name(ctx.rope(ctx.reshape_ne(k, hd, n_kv_head, n_tok), pos, rot, mode, **rope_kw), "Krope")
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


def _gets_rows(dev: Device, ty: GGMLType, cfg: LlamaConfig) -> bool:
    """``dev`` runs the token embedding's GET_ROWS for weights of type ``ty``."""
    ctx = Context("embd-probe")
    w = ctx.new_tensor_ne(ty, cfg.d_model, cfg.n_vocab)
    return dev.supports_op(ctx.get_rows(w, ctx.new_tensor_ne(T.I32, 1)))


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


class LlamaModel:
    """A llama model placed on ``devices`` and run through a :class:`~accelplane.sched.Scheduler`.

    ``devices``: where the weights go, in priority order (``split='none'``: all on the
    first; ``'layer'``: layers spread over all of them). The scheduler's backends are the
    non-CPU devices in that order, then a CPU device (``cpu``, or a CPU device among
    ``devices``, or the global registry's "CPU"), which holds the inputs and the token
    embeddings. ``types``: weight type by GGUF name (default F32). ``n_ctx``: KV cache size;
    ``cache_type``: F16 or F32; ``kv_pad``: attention window granularity (see the module
    docstring). ``merge``: store each layer's Q, K and V (and FFN gate and up) projections as
    one matrix when their types match, so a decode step runs one product where it ran three
    (two); the GGUF names stay as views of it. Default: on, unless ACCELPLANE_MODEL_MERGE=0;
    never with ``split='tensor'`` (the shards cut per projection). ``embd``: where the token
    embeddings live: "device" (the first layer's device, so a step on one device is one
    scheduler split, with no host computation and copy before it; not with ``split='tensor'``),
    "cpu" (host memory, llama.cpp's input layer) or "auto" (the default, unless
    ACCELPLANE_MODEL_EMBD says otherwise): "device" when the first layer's device is not a CPU
    and runs GET_ROWS of the embeddings' type, else "cpu". Call :meth:`load_weights` (or use
    :meth:`from_gguf`) before :meth:`eval`. ``policy``: the scheduler's synchronization policy
    (docs/ordering.md), default ACCELPLANE_MODEL_POLICY or else "relaxed": a decode step's four
    inputs then go to the device as asynchronous copies behind one synchronize instead of four
    blocking ones (2.5 % more tokens/s on an H200); devices whose caps exclude it stay strict.
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        devices: Sequence[Device],
        *,
        split: str = "none",
        n_ctx: int | None = None,
        cache_type: GGMLType | str = T.F16,
        kv_pad: int = 256,
        types: Mapping[str, GGMLType | str | int] | None = None,
        cpu: Device | None = None,
        policy: str | None = None,
        merge: bool | None = None,
        embd: str | None = None,
    ) -> None:
        check_split(split)
        if not devices:
            raise DeviceError("a model needs at least one device")
        self.cfg = cfg
        self.split = split
        self.n_ctx = int(n_ctx or min(cfg.n_ctx_train, 512))
        if self.n_ctx <= 0:
            raise ShapeError(f"n_ctx must be > 0, got {self.n_ctx}")
        self.kv_pad = max(1, int(kv_pad))
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
            self.sched = Scheduler(self.backends, policy=policy)
        self.n_past = 0
        self._steps: dict[tuple[int, int, bool], _Step] = {}
        self._positions_set: tuple[_Step, int] | None = None  # (step, n_past) its inputs hold
        self.buffers: list[Buffer] = []
        if merge is None:
            merge = env.MODEL_MERGE.get()
        self.merge = bool(merge) and self.meta is None
        self._build_weights(types or {})

    # --- weights and cache ---------------------------------------------------------------------
    def _device_of(self, spec: WeightSpec) -> Device:
        if spec.layer < 0:  # the input layer (``embd``), unless the head shares it
            return self.output_dev if self.cfg.tied_output else self.embd_dev
        if spec.layer >= self.cfg.n_layers:
            return self.output_dev
        return self.layer_dev[spec.layer]

    def _build_weights(self, types: Mapping[str, GGMLType | str | int]) -> None:
        cfg = self.cfg
        self.wctx = Context("llama-weights")
        self.w: dict[str, Tensor] = {}
        self.placement: dict[str, Device] = {}
        self.merged: dict[str, Tensor] = {}  # "blk.i.attn_qkv" / "blk.i.ffn_gate_up" → matrix
        by_dev: dict[Device, list[Tensor]] = {}
        specs = {s.name: s for s in cfg.weights()}
        tys = {n: parse_type(types.get(n, T.F32)) for n in specs}
        views: dict[str, Tensor] = {}
        if self.merge:
            for merged, parts in self._merge_groups():
                if any(p not in specs for p in parts) or len({tys[p] for p in parts}) != 1:
                    continue
                rows = [specs[p].shape[0] for p in parts]
                k = specs[parts[0]].shape[1]
                m = self.wctx.new_tensor(tys[parts[0]], (sum(rows), k), merged + ".weight").set_param()
                self.merged[merged] = m
                by_dev.setdefault(self._device_of(specs[parts[0]]), []).append(m)
                r0 = 0
                for p, r in zip(parts, rows, strict=True):
                    views[p] = self.wctx.view(m, (k, r), None, r0 * m.nb[1]).set_name(p)
                    r0 += r
        for spec in specs.values():
            t = views.get(spec.name)
            if t is None:
                t = self.wctx.new_tensor(tys[spec.name], spec.shape, spec.name).set_param()
            self.w[spec.name] = t
            dev = self._device_of(spec)
            self.placement[spec.name] = dev
            by_dev.setdefault(dev, []).append(t)
        self.cache_k: list[Tensor] = []
        self.cache_v: list[Tensor] = []
        cache_by_dev: dict[Device, list[Tensor]] = {}
        for i in range(cfg.n_layers):
            k = self.wctx.new_tensor(self.cache_type, (self.n_ctx, cfg.n_embd_kv), f"cache_k_l{i}")
            v = self.wctx.new_tensor(self.cache_type, (cfg.n_embd_kv, self.n_ctx), f"cache_v_l{i}")
            self.cache_k.append(k)
            self.cache_v.append(v)
            cache_by_dev.setdefault(self.layer_dev[i], []).extend((k, v))
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
            for dev, ts in by_dev.items():
                buf = alloc_tensors(ts, dev.buffer_type, BufferUsage.WEIGHTS)
                if buf is not None:
                    self.buffers.append(buf)
            for dev, ts in cache_by_dev.items():
                buf = alloc_tensors(ts, dev.buffer_type, BufferUsage.ANY)
                if buf is not None:
                    # unwritten slots are masked out, but 0 * NaN garbage would still be NaN
                    buf.clear(0)
                    self.buffers.append(buf)
        except Exception:
            self.free()
            raise

    def _merge_groups(self) -> list[tuple[str, tuple[str, ...]]]:
        """(merged name, its parts in row order) per layer: the projections that read the same
        activations. Gate rows come before up rows: SWIGLU of one tensor gates its first half."""
        out = []
        for i in range(self.cfg.n_layers):
            p = f"blk.{i}."
            out.append((p + "attn_qkv", (p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight")))
            if not self.cfg.is_moe:
                out.append((p + "ffn_gate_up", (p + "ffn_gate.weight", p + "ffn_up.weight")))
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
        if t.name.endswith(("attn_q.weight", "attn_output.weight")):
            g = self.cfg.head_dim * (self.cfg.n_head // self.cfg.n_head_kv)
        return self.meta.split(t, role.axis, g)

    def load_weights(self, source: Callable[[str], np.ndarray],
                     progress: Callable[[int], None] | None = None) -> None:  # fmt: skip
        """Copy every weight's raw bytes (``source(name)``: uint8, the GGUF block layout of the
        tensor's type) into its device buffer. ``progress(nbytes)`` after each tensor."""
        for name, t in self.w.items():
            data = np.asarray(source(name))
            raw = data.reshape(-1).view(np.uint8)
            if raw.size != t.nbytes:
                raise ShapeError(f"weight {name}: {raw.size} bytes given, {t.type.name} "
                                 f"{t.shape} takes {t.nbytes}")  # fmt: skip
            t.set_bytes(raw)
            if progress is not None:
                progress(t.nbytes)

    def set_weights(self, values: Mapping[str, np.ndarray]) -> None:
        """Set weights from float arrays (quantized to each tensor's type on the way in)."""
        for name, v in values.items():
            self.w[name].set(v)

    @classmethod
    def from_gguf(cls, source: str | GGUFFile, devices: Sequence[Device], *,
                  progress: Callable[[int], None] | None = None, **kw) -> LlamaModel:  # fmt: skip
        """Load a llama GGUF file (path or an opened :class:`~accelplane.models.gguf.GGUFFile`)
        onto ``devices``; other keyword arguments as the constructor."""
        from accelplane.models.gguf import GGUFFile, read_gguf

        f = source if isinstance(source, GGUFFile) else read_gguf(source)
        cfg = f.llama_config()
        f.check_llama_tensors(cfg)
        kw.setdefault("n_ctx", min(cfg.n_ctx_train, 512))
        m = cls(cfg, devices, types={n: t.type for n, t in f.tensors.items()}, **kw)
        try:
            m.load_weights(lambda n: f.tensors[n].data, progress)
        except Exception:
            m.free()
            raise
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
        self._steps = {}
        self._positions_set = None

    # --- graph --------------------------------------------------------------------------------
    def window(self, n_end: int) -> int:
        """Cache slots attended when the last position is ``n_end - 1``."""
        return min(self.n_ctx, -(-n_end // self.kv_pad) * self.kv_pad)

    def step(self, n_tokens: int, n_kv: int, all_rows: bool = False) -> _Step:
        """The (cached) graph for a batch of ``n_tokens`` attending ``n_kv`` cache slots;
        ``all_rows``: logits for every token, else only for the last."""
        key = (n_tokens, n_kv, all_rows or n_tokens == 1)
        st = self._steps.get(key)
        if st is None:
            st = self._steps[key] = self._build(*key)
        return st

    def _build(self, n_tok: int, n_kv: int, all_rows: bool) -> _Step:
        """Build the forward graph (module docstring) for one batch shape."""
        cfg, w = self.cfg, self.w
        ctx = Context(f"llama-{n_tok}x{n_kv}")
        groups: dict[int, str] = {}
        group = "inp"

        def cb(t: Tensor, name: str) -> Tensor:
            groups[id(t)] = group
            return t.set_name(f"{group}.{name}" if group.startswith("blk") else name)

        d, hd, n_head, n_kv_head = cfg.d_model, cfg.head_dim, cfg.n_head, cfg.n_head_kv
        e_kv = cfg.n_embd_kv
        tokens = ctx.new_tensor(T.I32, (n_tok,), "inp_tokens").set_input()
        pos = ctx.new_tensor(T.I32, (n_tok,), "inp_pos").set_input()
        g = n_head // n_kv_head
        # row t * g + r: token t, query head r of its group (see the attention below)
        mask = ctx.new_tensor(T.F32, (n_tok * g, n_kv), "inp_kq_mask").set_input()
        v_idx = ctx.new_tensor(T.I32, (n_tok * e_kv,), "inp_v_idxs").set_input()
        rope_kw = dict(n_ctx_orig=cfg.n_ctx_train, freq_base=cfg.rope_base)
        kq_scale = 1.0 / math.sqrt(hd)
        esz = self.cache_type.type_size

        cur = cb(ctx.get_rows(w["token_embd.weight"], tokens), "inp_embd")
        for il in range(cfg.n_layers):
            group = f"blk.{il}"
            p = f"blk.{il}."
            inp = cur
            x = cb(ctx.mul(cb(ctx.rms_norm(cur, cfg.rms_eps), "norm"), w[p + "attn_norm.weight"]),
                   "attn_norm")  # fmt: skip
            qkv_w = self.merged.get(p + "attn_qkv")
            if qkv_w is not None and n_tok == 1:
                # one product; Q, K, V are contiguous slices of its single row
                qkv = cb(ctx.mul_mat(qkv_w, x), "QKVcur")
                nq, fsz = n_head * hd, qkv.nb[0]
                q = ctx.view(qkv, (nq, 1), None, 0)
                k = ctx.view(qkv, (e_kv, 1), None, nq * fsz)
                v = ctx.view(qkv, (e_kv, 1), None, (nq + e_kv) * fsz)
            else:
                q = cb(ctx.mul_mat(w[p + "attn_q.weight"], x), "Qcur")
                k = cb(ctx.mul_mat(w[p + "attn_k.weight"], x), "Kcur")
                v = cb(ctx.mul_mat(w[p + "attn_v.weight"], x), "Vcur")
            # KV cache writes; the attention reads views of the SET_ROWS results, so the graph
            # orders the writes before the reads
            q, k_set, v_set = rope_into_cache(
                ctx, q, k, v, pos, self.cache_k[il], self.cache_v[il], v_idx, hd=hd, n_head=n_head,
                n_kv_head=n_kv_head, rot=cfg.rot, mode=cfg.rope_mode, per_channel_v=self.meta is not None,
                name=cb, **rope_kw)  # fmt: skip
            kk = ctx.view(k_set, (hd, n_kv, n_kv_head), (esz, e_kv * esz, hd * esz))
            vv = ctx.view(v_set, (n_kv, hd, n_kv_head), (esz, self.n_ctx * esz, hd * self.n_ctx * esz))
            # grouped-query attention as one product per kv head: its g query heads' rows
            # (token-major, head-minor) form one [g * n_tok, hd] matrix
            qg = _packed(ctx, cb, ctx.permute(ctx.reshape_ne(q, hd, g, n_kv_head, n_tok), 0, 1, 3, 2),
                         "q_grouped")  # [n_head_kv, n_tok, g, hd]  # fmt: skip
            qg = ctx.reshape_ne(qg, hd, g * n_tok, n_kv_head)
            kq = cb(ctx.mul_mat(kk, qg), "kq")  # [n_head_kv, n_tok * g, n_kv]
            kq = cb(ctx.soft_max(kq, mask, kq_scale), "kq_soft_max")
            kqv = cb(ctx.mul_mat(vv, kq), "kqv")  # [n_head_kv, n_tok * g, hd]
            o = ctx.permute(ctx.reshape_ne(kqv, hd, g, n_tok, n_kv_head), 0, 1, 3, 2)
            o = _packed(ctx, cb, o, "kqv_merged")  # [n_tok, n_head_kv, g, hd] = [n_tok, n_head, hd]
            o = cb(ctx.mul_mat(w[p + "attn_output.weight"], ctx.reshape_ne(o, n_head * hd, n_tok)),
                   "attn_out")  # fmt: skip
            ffn_inp = cb(ctx.add(o, inp), "ffn_inp")
            x = cb(ctx.mul(cb(ctx.rms_norm(ffn_inp, cfg.rms_eps), "norm"), w[p + "ffn_norm.weight"]),
                   "ffn_norm")  # fmt: skip
            f = self._moe(ctx, cb, x, p, n_tok) if cfg.is_moe else self._ffn(ctx, cb, x, p)
            cur = cb(ctx.add(f, ffn_inp), "l_out")

        group = "out"
        if not all_rows and n_tok > 1:
            cur = ctx.view(cur, (d, 1), (cur.nb[0], cur.nb[1]), (n_tok - 1) * cur.nb[1])
        cur = cb(ctx.mul(cb(ctx.rms_norm(cur, cfg.rms_eps), "norm"), w["output_norm.weight"]),
                 "result_norm")  # fmt: skip
        head = w["token_embd.weight"] if cfg.tied_output else w["output.weight"]
        logits = cb(ctx.mul_mat(head, cur), "result_output")
        ids = cb(ctx.argmax(logits), "result_argmax")
        graph = ctx.graph(logits, ids)
        return _Step(graph, n_tok, n_kv, all_rows, tokens, pos, mask, v_idx, logits, ids, groups)

    def _ffn(self, ctx: Context, cb: _Namer, x: Tensor, p: str) -> Tensor:
        w = self.w
        gu_w = self.merged.get(p + "ffn_gate_up")
        if gu_w is not None:  # SWIGLU of one tensor: silu(first half) * second half, per row
            a = cb(ctx.swiglu(cb(ctx.mul_mat(gu_w, x), "ffn_gate_up")), "ffn_swiglu")
            return cb(ctx.mul_mat(w[p + "ffn_down.weight"], a), "ffn_out")
        g = cb(ctx.mul_mat(w[p + "ffn_gate.weight"], x), "ffn_gate")
        u = cb(ctx.mul_mat(w[p + "ffn_up.weight"], x), "ffn_up")
        return cb(ctx.mul_mat(w[p + "ffn_down.weight"], cb(ctx.swiglu(g, u), "ffn_swiglu")), "ffn_out")

    def _moe(self, ctx: Context, cb: _Namer, x: Tensor, p: str, n_tok: int) -> Tensor:
        """llama.cpp's build_moe_ffn for llama: softmax gating, top-k, weights renormalized."""
        w, cfg = self.w, self.cfg
        n_exp, k = cfg.n_expert, cfg.n_expert_used
        logits = cb(ctx.mul_mat(w[p + "ffn_gate_inp.weight"], x), "ffn_moe_logits")  # [T, E]
        probs = cb(ctx.soft_max(logits), "ffn_moe_probs")
        order = cb(ctx.argsort(probs, SortOrder.DESC), "ffn_moe_argsort")
        ids = ctx.view(order, (k, n_tok), (order.nb[0], order.nb[1]))  # top-k expert ids
        wts = cb(ctx.get_rows(ctx.reshape_ne(probs, 1, n_exp, n_tok), ids), "ffn_moe_weights")
        wts = ctx.reshape_ne(wts, k, n_tok)
        wts = cb(ctx.div(wts, cb(ctx.sum_rows(wts), "ffn_moe_weights_sum")), "ffn_moe_weights_norm")
        wts = ctx.reshape_ne(wts, 1, k, n_tok)
        xb = ctx.reshape_ne(x, cfg.d_model, 1, n_tok)
        g = cb(ctx.mul_mat_id(w[p + "ffn_gate_exps.weight"], xb, ids), "ffn_moe_gate")
        u = cb(ctx.mul_mat_id(w[p + "ffn_up_exps.weight"], xb, ids), "ffn_moe_up")
        a = cb(ctx.swiglu(g, u), "ffn_moe_swiglu")  # [T, k, d_ff]
        dn = cb(ctx.mul_mat_id(w[p + "ffn_down_exps.weight"], a, ids), "ffn_moe_down")  # [T, k, d]
        dn = cb(ctx.mul(dn, wts), "ffn_moe_weighted")
        out = None
        for j in range(k):  # sum over the used experts (views, as llama.cpp)
            vj = ctx.view(dn, (cfg.d_model, n_tok), (dn.nb[0], dn.nb[2]), j * dn.nb[1])
            out = vj if out is None else cb(ctx.add(out, vj), "ffn_moe_out")
        if k == 1:
            out = cb(ctx.cont(out), "ffn_moe_out")
        return out

    # --- running ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the context (positions restart at 0; stale cache slots are masked)."""
        self.n_past = 0

    def _set_positions(self, st: _Step, n_past: int) -> None:
        """Write step ``st``'s position inputs for tokens at ``n_past ..``: the positions, the
        causal mask (per query row of a GQA group) and the V cache slots."""
        n = st.n_tokens
        pos = np.arange(n_past, n_past + n, dtype=np.int32)
        st.pos.set(pos)
        # slots up to each token's own position are visible
        mask = np.where(np.arange(st.n_kv)[None, :] <= pos[:, None], 0.0, -np.inf).astype(np.float32)
        st.mask.set(np.repeat(mask, self.cfg.n_head // self.cfg.n_head_kv, axis=0))
        if self.meta is None:
            e = np.arange(self.cfg.n_embd_kv, dtype=np.int32)
            st.v_idx.set((e[None, :] * self.n_ctx + pos[:, None]).reshape(-1))

    def eval(self, tokens: Sequence[int] | np.ndarray, *, all_logits: bool = False,
             want_logits: bool = True) -> EvalResult:  # fmt: skip
        """Run ``tokens`` at positions ``n_past ..``: write their K/V into the cache, return
        the greedy next ids and (``want_logits``) the logits of the last token, or of every
        token with ``all_logits``. Advances ``n_past``."""
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = toks.size
        if n == 0:
            raise ShapeError("eval: no tokens")
        if self.n_past + n > self.n_ctx:
            raise OutOfRangeError(f"eval: {self.n_past} + {n} tokens exceed the context of "
                                  f"{self.n_ctx}")  # fmt: skip
        if toks.min() < 0 or toks.max() >= self.cfg.n_vocab:
            raise OutOfRangeError(f"eval: token ids must be in 0..{self.cfg.n_vocab - 1}")
        st = self.step(n, self.window(self.n_past + n), all_logits)
        self.sched.alloc_graph(st.graph)
        st.tokens.set(toks.astype(np.int32))
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
        return EvalResult(ids, logits)

    def generate(self, prompt: Sequence[int], n_new: int,
                 on_token: Callable[[int], None] | None = None) -> list[int]:  # fmt: skip
        """Greedy: ``n_new`` tokens after ``prompt`` (continuing the context); the first comes
        from the prefill, each further one from a decode step."""
        out: list[int] = []
        if n_new <= 0:
            return out
        tok = int(self.eval(prompt, want_logits=False).ids[-1])
        while True:
            out.append(tok)
            if on_token:
                on_token(tok)
            if len(out) == n_new:
                return out
            tok = int(self.eval([tok], want_logits=False).ids[-1])

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
