"""Running a GGUF model of a supported architecture on the devices this machine has, through the
scheduler: the default synthetic model (made once and cached), device choice, loading with a
progress bar, greedy generation of token ids and its teacher-forced replay, and text generation
with the model's tokenizer and a sampler (what ``accelplane run`` and ``accelplane bench model``
are built on); and the synthetic models ``accelplane make-model`` writes (:data:`MAKE_ARCHS`)."""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from accelplane.errors import ComputeError, DeviceError, ShapeError
from accelplane.interface import DeviceType
from accelplane.models import bert
from accelplane.models.archs import ARCHITECTURES
from accelplane.models.decoder import DecoderModel, Routing
from accelplane.models.gguf import (
    GGUFFile,
    parallel_sources,
    synthetic_sources,
    total_bytes,
    write_gguf,
)
from accelplane.models.sampling import Sampler
from accelplane.models.tokenizer import Tokenizer
from accelplane.runtime.backend import Device
from accelplane.runtime.plancache import cache_dir
from accelplane.runtime.progress import Bar

# the model `accelplane run` makes when given none: small enough to make in a second and run
# anywhere, big enough that the matrix products dominate (7.3M parameters, 7.4 MiB in Q8_0)
DEFAULT_MODEL = dict(n_layers=4, d_model=256, n_head=8, n_head_kv=4, d_ff=768, n_vocab=8192,
                     n_ctx=2048, wtype="q8_0", seed=0)  # fmt: skip
GENERATOR_VERSION = 2  # bump when the synthetic weights change, so cached files are remade
# `accelplane make-model --preset`; 1b has TinyLlama-1.1B's shapes (the benchmark model), 8b
# Llama-3-8B's (the multi-GPU benchmark model)
PRESETS = {
    "tiny": dict(n_layers=2, d_model=64, n_head=4, n_head_kv=2, d_ff=128, n_vocab=256, n_ctx=512),
    "small": {k: v for k, v in DEFAULT_MODEL.items() if k not in ("wtype", "seed")},
    "1b": dict(n_layers=22, d_model=2048, n_head=32, n_head_kv=4, d_ff=5632, n_vocab=32000,
               n_ctx=2048),
    "8b": dict(n_layers=32, d_model=4096, n_head=32, n_head_kv=8, d_ff=14336, n_vocab=128256,
               n_ctx=8192),
}  # fmt: skip
# `accelplane make-model --arch`: per architecture of gguf.SYNTHETIC_ARCHS, its presets, the
# default one, and the make_model keywords the command line may set
_DECODER_FLAGS = ("n_layers", "d_model", "n_head", "n_head_kv", "d_ff", "n_vocab", "n_ctx", "n_expert",
                  "n_expert_used", "head_dim", "seed", "output_type", "tied", "rope_base", "rope_scaling",
                  "rope_factor")  # fmt: skip
# qwen3moe: experts in every layer. 8b-a1b: 7.6B parameters of which 1.2B are active per token
# (24 layers, 64 experts of FFN 768, 8 used; Qwen3-30B-A3B's expert size, half its layers)
MOE_PRESETS = {
    "tiny": dict(PRESETS["tiny"], n_expert=4, n_expert_used=2, d_ff_exp=64),
    "small": dict(PRESETS["small"], n_expert=8, n_expert_used=2, d_ff_exp=384),
    "8b-a1b": dict(n_layers=24, d_model=2048, n_head=16, n_head_kv=4, head_dim=128, d_ff=6144,
                   n_vocab=32000, n_ctx=4096, n_expert=64, n_expert_used=8, d_ff_exp=768),
}  # fmt: skip
_ARCH_FLAGS = {"gemma3": ("sliding_window", "logit_softcap"), "qwen3moe": ("d_ff_exp",)}
MAKE_ARCHS: dict[str, tuple[dict[str, dict], str, tuple[str, ...]]] = {
    **{name: (MOE_PRESETS if name == "qwen3moe" else PRESETS, "small",
              _DECODER_FLAGS + _ARCH_FLAGS.get(name, ())) for name in ARCHITECTURES},
    "bert": (bert.MODEL_PRESETS, "mini", ("n_layers", "d_model", "n_head", "d_ff", "n_vocab", "n_ctx", "seed",
                                          "pooling")),
}  # fmt: skip
# logits vs the CPU plugin over every compared step; measured on this machine's plugins
# (Q8_0 model, F16 cache): 1.6e-4 SYCL (CPU OpenCL), ~2e-4 Vulkan (lavapipe), 3e-4 Hexagon (emulated)
NMSE_TOL = 1e-3
# a MoE router's choice that differs from the reference's own top k is a near tie when the
# reference's probabilities of the experts swapped are within this log-ratio (10 %); the
# synthetic 8b-a1b qwen3moe (64 experts, Q4_0) swaps up to 4.6 % on SYCL (OpenCL CPU) vs CPU
ROUTE_TIE = 0.1


def default_model_path(out: TextIO | None = None) -> Path:
    """The default synthetic model, made on first use under cache_dir('models')."""
    out = out or sys.stderr
    m = DEFAULT_MODEL
    name = (f"synthetic-llama-{m['n_layers']}L-{m['d_model']}d-{m['n_vocab']}v-{m['wtype']}"
            f"-s{m['seed']}-g{GENERATOR_VERSION}.gguf")  # fmt: skip
    path = cache_dir("models") / name
    if not path.exists():
        print(f"making the default synthetic model (once): {path}", file=out)
        make_with_bar(path, **m)
    return path


def make_with_bar(path: str | Path, jobs: int | None = None, **kw) -> None:
    """make_model with a progress bar over the bytes written."""
    _, md, srcs = synthetic_sources(**kw)
    with Bar("make", sum(s.nbytes for s in srcs), "MiB", 2**-20) as bar, parallel_sources(srcs, jobs) as srcs:
        write_gguf(path, md, srcs, progress=bar.update)


def describe_model(f: GGUFFile) -> str:
    """One line: the model's name, architecture, shapes, parameters, bytes and types."""
    if f.get("general.architecture") == bert.ARCH:
        return bert.describe(f)
    cfg = f.model_config()
    types = sorted({t.type.name.lower() for t in f.tensors.values()})
    n_params = sum(int(np.prod(t.shape)) for t in f.tensors.values())
    moe = (f", {cfg.n_expert} experts ({cfg.n_expert_used} used"
           f"{f', FFN {cfg.d_ff_exp}' if cfg.d_ff_exp else ''})" if cfg.is_moe else "")  # fmt: skip
    hd = f", head size {cfg.head_dim}" if cfg.head_dim * cfg.n_head != cfg.d_model else ""
    swa = f", sliding window {cfg.n_swa} in {sum(cfg.swa_layers)} layers" if cfg.has_swa else ""
    return (f"{f.get('general.name', f.path.name if f.path else '?')}: {cfg.arch}, {cfg.n_layers} layers, "
            f"d_model {cfg.d_model}, {cfg.n_head} heads ({cfg.n_head_kv} kv){hd}, d_ff {cfg.d_ff}, vocab "
            f"{cfg.n_vocab}{moe}{swa}, {n_params / 1e6:.1f}M params, {total_bytes(f) / 2**20:.1f} MiB "
            f"({'/'.join(types)})")  # fmt: skip


def pick_devices(reg, names: Sequence[str] | None) -> list[Device]:
    """Devices by name (comma lists allowed), else every accelerator that is not emulated on
    the host's CPU and whose runtime opens (Registry.usable), in the registry's ranking (GPUs,
    then integrated GPUs, then accelerators), else the best-ranked CPU device. The model's
    scheduler adds a CPU backend last in any case."""
    if names:
        out = []
        for n in names:
            out += [reg.device(x.strip()) for x in n.split(",") if x.strip()]
        return list(dict.fromkeys(out))
    ranked = [d for d, _ in reg.ranked()]
    return reg.accelerators() or [d for d in ranked if d.type == DeviceType.CPU][:1] or reg.usable(ranked)[:1]


def _cpu_of(reg) -> Device:
    for d in reg.devices:
        if d.type == DeviceType.CPU:
            return d
    raise DeviceError("no CPU device registered: the scheduler needs one (the built-in cpu plugin)")


def load(f: GGUFFile, devices: Sequence[Device], cpu: Device, split: str, n_ctx: int,
         show: bool = True, **kw) -> DecoderModel:  # fmt: skip
    """DecoderModel.from_gguf with a progress bar over the bytes loaded."""
    with Bar("load", total_bytes(f), "MiB", 2**-20, enabled=show) as bar:
        return DecoderModel.from_gguf(f, devices, split=split, n_ctx=n_ctx, cpu=cpu,
                                    progress=bar.update, **kw)  # fmt: skip


def context_for(cfg, n_tokens: int, what: str, cache_type_size: int = 2) -> int:
    """The KV cache length for ``n_tokens`` positions (a multiple of 256), or ShapeError when
    they exceed the model's trained context (n_ctx), naming the cache size it would take."""
    n_ctx = -(-(n_tokens + 1) // 256) * 256
    if n_tokens > cfg.n_ctx_train:
        kv = 2 * cfg.n_layers * n_ctx * cfg.n_embd_kv * cache_type_size
        raise ShapeError(
            f"{what} = {n_tokens} tokens exceed the model's context of {cfg.n_ctx_train} tokens "
            f"(n_ctx; a KV cache of {n_ctx} positions would take {kv / 2**20:.1f} MiB)"
        )
    return n_ctx


def check_finite(logits: np.ndarray, step: str) -> None:
    """ComputeError when ``logits`` hold NaN or infinity, naming the step and how to find the
    node that produced them."""
    bad = ~np.isfinite(logits)
    if bad.any():
        kinds = "NaN" if np.isnan(logits).any() else "infinity"
        raise ComputeError(
            f"the logits of {step} hold {kinds} ({int(bad.sum())} of {logits.size} values); "
            "run again with ACCELPLANE_CHECK_RESULTS=1 to find the first node that produces it"
        )


@contextlib.contextmanager
def no_gc_pauses() -> Iterator[None]:
    """A token loop without the cyclic garbage collector's pauses (a full collection can take
    tens of milliseconds, several decode steps on a GPU): collect once before the block, move
    what survives out of the collector's view (gc.freeze) and keep it off during the block;
    afterwards the previous state is restored. Reference counting still frees what the loop
    drops; only cycles made inside the block wait for the next collection."""
    was = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was:
            gc.enable()


@dataclass
class RunResult:
    prompt: list[int]
    tokens: list[int]  # generated: the prefill's next token, then one per decode step
    logits: list[np.ndarray]  # one row per step (prefill's last row, then each decode)
    pp_s: float
    tg_s: float


def generate(model: DecoderModel, prompt: Sequence[int], n_decode: int, keep_logits: bool,
             show: bool = True) -> RunResult:  # fmt: skip
    """Prefill ``prompt``, then ``n_decode`` greedy decode steps, timed."""
    model.reset()
    t0 = time.perf_counter()
    r = model.eval(prompt, want_logits=keep_logits)
    pp = time.perf_counter() - t0
    toks = [int(r.ids[-1])]
    logits = [r.logits[-1].copy()] if keep_logits else []
    if keep_logits:
        check_finite(logits[0], "the prefill")
    with Bar("generate", n_decode, "tok", enabled=show) as bar, no_gc_pauses():
        t0 = time.perf_counter()
        for _ in range(n_decode):
            r = model.eval([toks[-1]], want_logits=keep_logits)
            toks.append(int(r.ids[-1]))
            if keep_logits:
                logits.append(r.logits[-1].copy())
                check_finite(logits[-1], f"decode step {len(logits) - 1}")
            bar.update(1)
        tg = time.perf_counter() - t0
    return RunResult(list(map(int, prompt)), toks, logits, pp, tg)


@dataclass
class TextResult:
    prompt: list[int]
    tokens: list[int]  # generated, without the end-of-generation token that stopped it
    text: str  # the generated tokens' text
    eog: int | None  # the end-of-generation token that stopped generation, or None (the limit)
    pp_s: float  # the prefill (and the first token's pick)
    steps: int  # decode steps: each gave one token after the first
    tg_s: float


def generate_text(model: DecoderModel, tok: Tokenizer, prompt: Sequence[int], n_max: int, sampler: Sampler,
                  on_text: Callable[[str], None] | None = None) -> TextResult:  # fmt: skip
    """Prefill ``prompt``, then pick up to ``n_max`` tokens with ``sampler``, stopping early at an
    end-of-generation token (which is not kept). ``on_text(s)`` gets the text as it is made
    (a character split across tokens comes whole, with its last token)."""
    model.reset()
    stream = tok.stream()
    # the device's argmax serves greedy decoding unless the model has rows past the vocabulary
    logits = not sampler.greedy or model.cfg.n_vocab > tok.n_vocab
    out: list[int] = []
    text: list[str] = []
    eog, steps, tg, pp = None, 0, 0.0, 0.0

    def emit(s: str) -> None:
        if s:
            text.append(s)
            if on_text:
                on_text(s)

    def keep(t: int) -> None:
        if not tok.is_eog(t):
            out.append(t)
            emit(stream.feed(t))

    with no_gc_pauses():
        if not logits and n_max > 0:  # the device's picks fed back on it (DecoderModel.decode)
            t0 = time.perf_counter()
            first = int(model.eval(prompt, want_logits=False).ids[-1])
            pp = time.perf_counter() - t0
            picks = [first]
            keep(first)
            if not tok.is_eog(first) and n_max > 1:
                t0 = time.perf_counter()
                picks += model.decode(first, n_max - 1, on_token=keep, stop=tok.is_eog)
                steps, tg = len(picks) - 1, time.perf_counter() - t0
            eog = picks[-1] if tok.is_eog(picks[-1]) else None
        while logits and len(out) < n_max:
            t0 = time.perf_counter()
            row = model.eval(out[-1:] if out else prompt).logits[-1, : tok.n_vocab]
            check_finite(row, f"step {len(out)}")
            t = sampler(row)
            dt = time.perf_counter() - t0
            if out:
                steps, tg = steps + 1, tg + dt
            else:
                pp = dt
            if tok.is_eog(t):
                eog = t
                break
            out.append(t)
            emit(stream.feed(t))
    emit(stream.flush())
    return TextResult(list(map(int, prompt)), out, "".join(text), eog, pp, steps, tg)


def teacher_forced(model: DecoderModel, prompt: Sequence[int], tokens: Sequence[int]) -> list[np.ndarray]:
    """Logits of the same steps as :func:`generate`, feeding ``tokens`` instead of sampling."""
    model.reset()
    out = [model.eval(prompt).logits[-1].copy()]
    for t in tokens:
        out.append(model.eval([t]).logits[-1].copy())
    return out


def teacher_forced_routing(model: DecoderModel, prompt: Sequence[int], tokens: Sequence[int],
                           forced: Sequence[Sequence[Routing]] | None = None,
                           ) -> tuple[list[np.ndarray], list[list[Routing]]]:  # fmt: skip
    """:func:`teacher_forced` for a MoE model, with each step's routing per MoE layer: the
    model's own (traced), or with ``forced`` (a routing list per step, as this returns) the
    experts given, so that two runs compare arithmetic on the same experts."""
    model.reset()
    logits, routes = [], []
    for i, toks in enumerate([list(prompt), *([t] for t in tokens)]):
        r = model.eval(toks, trace_routing=forced is None, routing=None if forced is None else forced[i])
        logits.append(r.logits[-1].copy())
        routes.append(r.routing)
    return logits, routes


@dataclass
class RoutingAgreement:
    """How one run's expert choices compare with a reference's own top k, per (step, MoE layer,
    token): ``choices`` compared, ``differ`` where the sets differ, and the largest log-ratio
    of the reference's probabilities across a swap (0 when none differ): the swap's distance
    from a tie. ``ok``: every differing choice within ``tie``, and none off the run's own top k."""

    choices: int
    differ: int
    worst: float
    tie: float
    not_top: int = 0  # choices that are not a top k of the run's own probabilities

    @property
    def ok(self) -> bool:
        return self.worst <= self.tie and self.not_top == 0


def routing_agreement(used: Sequence[Sequence[Routing]], ref: Sequence[Sequence[Routing]],
                      tie: float = ROUTE_TIE) -> RoutingAgreement:  # fmt: skip
    """Compare the experts ``used`` (per step, per MoE layer) with the top k of the reference
    probabilities ``ref`` (same steps and layers: teacher_forced_routing's, the reference run
    forced to ``used``): for each token, the log of the reference's probability ratio between
    the best expert it would have picked but was not used and the worst used it would not have
    picked. Also counts the choices that are not a top k of ``used``'s own probabilities (the
    run's router and its choice disagree: a defect, not rounding)."""
    choices = differ = not_top = 0
    worst = 0.0
    for us, rs in zip(used, ref, strict=True):
        for u, r in zip(us, rs, strict=True):
            k = u.ids.shape[1]
            own = np.argsort(-r.probs, axis=1, kind="stable")[:, :k]
            for t in range(u.ids.shape[0]):
                choices += 1
                mine = np.zeros(u.probs.shape[1], bool)
                mine[u.ids[t]] = True
                if mine.sum() != k or ((~mine).any() and u.probs[t][~mine].max() > u.probs[t][mine].min()):
                    not_top += 1
                a, b = set(u.ids[t].tolist()), set(own[t].tolist())
                if a == b:
                    continue
                differ += 1
                p = r.probs[t].astype(np.float64)
                best_left = max(p[e] for e in b - a)
                worst_used = min(p[e] for e in a - b)
                worst = max(worst, float(np.log(best_left / max(worst_used, 1e-300))))
    return RoutingAgreement(choices, differ, worst, tie, not_top)


def meta_summary(meta) -> dict:
    """The meta device's last computed step: segments, all-reduces and how they ran."""
    st = meta.stats
    return {"segments": st.segments, "allreduces": st.allreduces, "algorithms": sorted(st.algorithms),
            "replays": st.replays, "computes": st.computes, "record_error": st.record_error}
