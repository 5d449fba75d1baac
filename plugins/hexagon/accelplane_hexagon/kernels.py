"""What each op group asks of the NPU kernels (htp/*.c): its opcode, its source and destination
tensors and its kernel parameters (computed here, on the host, as ggml's Hexagon backend does),
one function per op family, added to the batch being built (plan.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from accelplane.core.ops import ROPE_TYPE_NEOX, GluOp, Op, UnaryOp, rope_params, rope_yarn_corr_dims
from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType
from accelplane.errors import ComputeError

from .runtime import ALIGNMENT, Options

if TYPE_CHECKING:
    from .plan import Builder

T = GGMLType

_BINARY = {Op.ADD: "HTP_OP_ADD", Op.SUB: "HTP_OP_SUB", Op.MUL: "HTP_OP_MUL", Op.DIV: "HTP_OP_DIV"}
_ACT = {UnaryOp.SILU: "HTP_ACT_SILU", UnaryOp.GELU: "HTP_ACT_GELU", UnaryOp.SIGMOID: "HTP_ACT_SIGMOID",
        UnaryOp.NEG: "HTP_ACT_NEG", UnaryOp.EXP: "HTP_ACT_EXP", UnaryOp.TANH: "HTP_ACT_TANH",
        UnaryOp.SOFTPLUS: "HTP_ACT_SOFTPLUS"}  # fmt: skip
_GLU_ACT = {GluOp.SWIGLU: "HTP_ACT_SILU", GluOp.GEGLU: "HTP_ACT_GELU"}


def label(t: Tensor) -> str:
    """How messages name a tensor: its name, else its id and op."""
    return repr(t.name) if t.name else f"#{t.uid} ({t.op.name if t.op else 'leaf'})"


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


# --- kernel parameters ----------------------------------------------------------------------
def _mm_params(x: Tensor, w: Tensor, n_mm: int, acc_f16: bool, n_acc_rows: int, n_hits: int,
               xrows: int) -> tuple[dict, int]:  # fmt: skip
    K = x.ne[0]
    n_kt = K // 32
    quant = w.type in (T.Q4_0, T.Q8_0)
    row_bytes = _align(K + 2 * n_kt) if quant else 4 * K
    n_rows = x.ne[1] * x.ne[2] * x.ne[3]
    q_offs = 0
    acc_offs = _align(q_offs + n_rows * row_bytes)
    tile_offs = _align(acc_offs + min(n_acc_rows, xrows) * 128)
    hits_offs = _align(tile_offs + max(1088, 4 * K))
    need = _align(hits_offs + 8 * n_hits)
    kp = {"mm.n_mm": n_mm, "mm.acc_f16": int(acc_f16), "mm.n_kt": n_kt, "mm.q_row_bytes": row_bytes,
          "mm.q_offs": q_offs, "mm.acc_offs": acc_offs, "mm.tile_offs": tile_offs,
          "mm.hits_offs": hits_offs}  # fmt: skip
    return kp, need


def _rope_params(t: Tensor) -> dict:
    (n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor,
     beta_fast, beta_slow) = rope_params(t)  # fmt: skip
    if n_ctx_orig > 0:
        corr0, corr1 = rope_yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
    else:  # ggml's log(0) case: an empty correction range
        corr0, corr1 = 0.0, -math.inf
    mscale = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale)) if ext_factor != 0 else attn_factor
    return {"rope.theta_scale": freq_base ** (-2.0 / n_dims), "rope.freq_scale": freq_scale,
            "rope.ext_factor": ext_factor, "rope.mscale": mscale, "rope.corr0": corr0,
            "rope.corr1": corr1, "rope.n_dims": n_dims, "rope.neox": int(mode == ROPE_TYPE_NEOX)}  # fmt: skip


def _softmax_params(t: Tensor) -> dict:
    scale, max_bias = t.op_params[0], t.op_params[1]
    n_head = t.src[0].ne[2]
    n_log2 = 1 << int(math.floor(math.log2(n_head)))
    return {"softmax.scale": scale, "softmax.max_bias": max_bias,
            "softmax.m0": 2.0 ** (-max_bias / n_log2), "softmax.m1": 2.0 ** (-(max_bias / 2.0) / n_log2),
            "softmax.n_head_log2": n_log2}  # fmt: skip


# --- one function per op family ---------------------------------------------------------------
def _binary(b: Builder, group: list[Tensor], opts: Options, lib) -> None:
    n = group[0]
    b.add(_BINARY[n.op], [n.src[0], n.src[1]], [n], f"{n.op.name} {label(n)}")


def _scale(b: Builder, group: list[Tensor], opts: Options, lib) -> None:
    n = group[0]
    kp = {"scale.scale": n.op_params[0], "scale.bias": n.op_params[1]}
    b.add("HTP_OP_SCALE", [n.src[0]], [n], f"{n.op.name} {label(n)}", kp)


def _unary(b: Builder, group: list[Tensor], opts: Options, lib) -> None:
    n = group[0]
    act = getattr(lib, _ACT[UnaryOp(n.op_params[0])])
    b.add("HTP_OP_UNARY", [n.src[0]], [n], f"{n.op.name} {label(n)}", {"act.act": act})


def _glu(b: Builder, group: list[Tensor], opts: Options, lib) -> None:
    n = group[0]
    a, g = n.src
    kp = {"act.act": getattr(lib, _GLU_ACT[GluOp(n.op_params[0])]), "act.swapped": int(n.op_params[1]),
          "act.split": int(g is None)}  # fmt: skip
    b.add("HTP_OP_GLU", [a] if g is None else [a, g], [n], f"{n.op.name} {label(n)}", kp)


def _norm(b: Builder, group: list[Tensor], opts: Options, lib) -> None:
    """NORM, RMS_NORM, and RMS_NORM fused with the MUL that reads it (fusion.fuse)."""
    n = group[0]
    eps = {"norm.eps": n.op_params[0]}
    if len(group) == 2:
        m = group[1]
        w = m.src[1] if m.src[0] is n else m.src[0]
        b.add("HTP_OP_RMS_NORM_MUL", [n.src[0], w], [m], f"RMS_NORM+MUL {label(m)}", eps)
        return
    code = "HTP_OP_NORM" if n.op is Op.NORM else "HTP_OP_RMS_NORM"
    b.add(code, [n.src[0]], [n], f"{n.op.name} {label(n)}", eps)


def _soft_max(b: Builder, group: list[Tensor], opts: Options, lib) -> None:
    n = group[0]
    a, mask = n.src
    b.add("HTP_OP_SOFT_MAX", [a] if mask is None else [a, mask], [n], f"{n.op.name} {label(n)}",
          _softmax_params(n))  # fmt: skip


def _rope(b: Builder, group: list[Tensor], opts: Options, lib) -> None:
    n = group[0]
    b.add("HTP_OP_ROPE", [n.src[0], n.src[1]], [n], f"{n.op.name} {label(n)}", _rope_params(n),
          8 * (n.op_params[1] // 2))  # fmt: skip


def _get_rows(b: Builder, group: list[Tensor], opts: Options, lib) -> None:
    n = group[0]
    b.add("HTP_OP_GET_ROWS", [n.src[0], n.src[1]], [n], f"{n.op.name} {label(n)}")


def _set_rows(b: Builder, group: list[Tensor], opts: Options, lib) -> None:
    n = group[0]
    b.add("HTP_OP_SET_ROWS", [n.src[1], n.src[2]], [n], f"{n.op.name} {label(n)}")


def _cpy(b: Builder, group: list[Tensor], opts: Options, lib) -> None:
    n = group[0]
    b.add("HTP_OP_CPY", [n.src[0]], [n], f"{n.op.name} {label(n)}")


def _mul_mat(b: Builder, group: list[Tensor], opts: Options, lib) -> None:
    """One MUL_MAT, or up to three sharing their activations (fusion.fuse): one NPU op."""
    n = group[0]
    x = n.src[1]
    kp, need = _mm_params(x, n.src[0], len(group), opts.acc_f16, x.ne[1], 0, lib.HTP_MM_XROWS)
    what = f"{n.op.name} {label(n)}"
    if len(group) > 1:
        what = f"MUL_MAT x{len(group)} " + ", ".join(label(m) for m in group)
    b.add("HTP_OP_MUL_MAT", [x] + [m.src[0] for m in group], list(group), what, kp, need)


def _mul_mat_id(b: Builder, group: list[Tensor], opts: Options, lib) -> None:
    n = group[0]
    w, x, ids = n.src
    hits = ids.ne[0] * ids.ne[1]
    kp, need = _mm_params(x, w, 1, opts.acc_f16, hits, hits, lib.HTP_MM_XROWS)
    b.add("HTP_OP_MUL_MAT_ID", [x, w, ids], [n], f"{n.op.name} {label(n)}", kp, need)


_EMIT: dict[Op, Callable[[Builder, list[Tensor], Options, object], None]] = {
    Op.ADD: _binary, Op.SUB: _binary, Op.MUL: _binary, Op.DIV: _binary, Op.SCALE: _scale,
    Op.UNARY: _unary, Op.GLU: _glu, Op.NORM: _norm, Op.RMS_NORM: _norm, Op.SOFT_MAX: _soft_max,
    Op.ROPE: _rope, Op.GET_ROWS: _get_rows, Op.SET_ROWS: _set_rows, Op.CPY: _cpy, Op.CONT: _cpy,
    Op.DUP: _cpy, Op.MUL_MAT: _mul_mat, Op.MUL_MAT_ID: _mul_mat_id,
}  # fmt: skip


def emit(b: Builder, group: list[Tensor], opts: Options, lib) -> None:
    """Add the NPU op of ``group`` (a node, or nodes fusion.fuse grouped) to the batch ``b``."""
    n = group[0]
    fn = _EMIT.get(n.op)
    if fn is None:  # supports_op said no: the caller's graph should not be here
        raise ComputeError(f"HTP: op {n.op.name} ({label(n)}) is not supported on this device")
    fn(b, group, opts, lib)
