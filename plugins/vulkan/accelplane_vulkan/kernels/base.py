"""What every op family's builder shares: the device's Caps, the Dispatch a plan records, the
scratch copies some dispatches make, and the addressing units and push-constant packing of
shaders/common.glsl.

Conventions shared with shaders/common.glsl: bindings A, B, C, D = 0..3 (sources, then the
destination); offsets and strides are in units of the tensor's element (4 bytes for F32/I32,
2 for F16/BF16, 2-byte words for quantized blocks); element types are specialization
constants holding GGUF type ids.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from accelplane.core.tensor import Tensor
from accelplane.core.types import GGMLType

from ..tuning import Tuning

T = GGMLType
FLOAT = frozenset({T.F32, T.F16, T.BF16})
# the block types shaders/common.glsl decodes; mul_mat_vec_q takes the first four (MMV_Q)
MMV_Q = frozenset({T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K})
QUANT = MMV_Q | {T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q5_K, T.IQ4_NL, T.IQ4_XS}
TYPES = FLOAT | QUANT | {T.I32}  # every type a shader reads or writes
NEEDS_16BIT = FLOAT - {T.F32} | QUANT  # read or written through 16-bit storage
NO_MASK = 0xFFFFFFFF

LOCAL_SIZE = {  # local_size_x of each shader (workgroup size)
    "unary": 256,
    "binary": 256,
    "glu": 256,
    "copy": 256,
    "quantize": 64,
    "quantize_b8": 64,
    "set_rows": 64,
    "get_rows": 256,
    "concat": 256,
    "rope": 256,
    "argsort": 128,
    "im2col": 256,
    "col2im": 256,
}


@dataclass(frozen=True)
class Caps:
    """What the device offers that kernels depend on."""

    storage16: bool = True  # storageBuffer16BitAccess: F16/BF16/quantized tensors
    subgroup: int = 0  # subgroup size where compute shaders have subgroup arithmetic, else 0
    int_dot: bool = False  # shaderIntegerDotProduct: packed int8 dot products (mul_mat_vec_q8)
    mmv_rows: int = 4  # weight rows per workgroup of mul_mat_vec_q (0: mul_mat_vec), tuning.py
    mmv_wg: int = 128  # threads per workgroup of mul_mat_vec_q

    @classmethod
    def of(cls, storage16: bool, subgroup: int, int_dot: bool, t: Tuning) -> Caps:
        """The device's features as the user's settings (``t``) let the kernels use them."""
        return cls(storage16, subgroup if t.mmv_subgroup else 0, int_dot and t.mmv_q8, t.mmv_rows, t.mmv_wg)


@dataclass(frozen=True)
class Scratch:
    """A region of the plan's scratch buffer holding a derived copy of tensor ``src`` (int8
    blocks of mul_mat_vec_q8's activations): bound as binding ``slot`` in place of a tensor,
    its offset in 4-byte words written by the plan into the push constants at byte
    ``push_at``. The writing dispatch (``write``) is recorded only while no region holds that
    copy of ``src`` already (a plan quantizes an activation once for all its products, until
    a node writes the activation's memory); a reading dispatch follows its writer."""

    src: Tensor
    nbytes: int
    slot: int
    push_at: int
    write: bool


@dataclass
class Dispatch:
    """One vkCmdDispatch: ``groups`` workgroups of ``shader`` (spread over x/y/z by the plan)."""

    shader: str
    spec: tuple[int, ...]
    bindings: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]  # A, B, C, D
    push: bytes
    groups: int
    scratch: Scratch | None = None  # takes the place of bindings[scratch.slot]


# --- units --------------------------------------------------------------------------------------
def unit(t: Tensor) -> int:
    """Bytes of one addressing unit of ``t`` in the shaders."""
    return 2 if t.type in QUANT else t.type.type_size


def eoffs(t: Tensor) -> int:
    return t.offs // unit(t)


def enb(t: Tensor) -> tuple[int, int, int, int]:
    u = unit(t)
    return tuple(n // u for n in t.nb)  # type: ignore[return-value]


def addressable(t: Tensor) -> bool:
    u = unit(t)
    return all(n % u == 0 for n in t.nb) and t.view_offs % u == 0


def pack(*vals) -> bytes:
    """Push constants: 4-tuples become uvec4, ints uint (or int), floats float (std430)."""
    fmt, flat = "<", []
    for v in vals:
        if isinstance(v, tuple):
            fmt += "IIII"
            flat.extend(int(x) for x in v)
        elif isinstance(v, float):
            fmt += "f"
            flat.append(v)
        else:
            fmt += "I" if v >= 0 else "i"
            flat.append(int(v))
    out = struct.pack(fmt, *flat)
    assert len(out) <= 128, f"push constants of {len(out)} bytes exceed 128"
    return out


def workgroups(n: int, local: int) -> int:
    return -(-n // local)


# --- dispatch shapes shared by the builders -----------------------------------------------------
def elementwise(shader: str, spec, bindings, push, n: int) -> list[Dispatch]:
    """One thread per element: ``n`` elements in workgroups of the shader's LOCAL_SIZE."""
    return [Dispatch(shader, tuple(int(x) for x in spec), bindings, push, workgroups(n, LOCAL_SIZE[shader]))]


def rows(t: Tensor, shader: str, spec, push, bindings) -> list[Dispatch]:
    """One workgroup per row of t's source."""
    return [Dispatch(shader, tuple(int(x) for x in spec), bindings, push, t.src[0].nrows)]
