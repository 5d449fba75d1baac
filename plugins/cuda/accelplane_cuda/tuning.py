"""Every knob of the CUDA plugin, declared once and parsed strictly through accelplane.env
(a value outside the allowed ones is a ConfigError naming the variable). plugins/cuda/README.md
lists each variable."""

from __future__ import annotations

from accelplane import env

OWNER = "cuda"


def _mmvp(s: str) -> tuple[int, int]:
    try:
        seg, ns = (int(x) for x in s.split(","))
    except ValueError:
        raise ValueError("expected SEG,NS, e.g. 4096,2") from None
    if seg % 16 or seg < 2048 or not 2 <= ns <= 8:  # a stage holds at least one Q6_K unit (1680 B)
        raise ValueError("SEG a multiple of 16 >= 2048, 2 <= NS <= 8")
    return seg, ns


GRAPHS = env.flag(
    "ACCELPLANE_CUDA_GRAPHS", True, "replay an unchanged graph as a CUDA graph (0: launch eagerly)",
    owner=OWNER,
)  # fmt: skip
PDL = env.flag(
    "ACCELPLANE_CUDA_PDL", True, "programmatic dependent launch on sm_90+", owner=OWNER,
)  # fmt: skip
ATTN = env.choice(
    "ACCELPLANE_CUDA_ATTN", "fused", ("fused", "split"), "decode attention as one kernel (fused) or three",
    owner=OWNER,
)  # fmt: skip
MMV = env.choice(
    "ACCELPLANE_CUDA_MMV", "row", ("row", "pipe", "f32"), "which mat-vec kernels may run", owner=OWNER,
)  # fmt: skip
MMV_WARPS = env.choice(
    "ACCELPLANE_CUDA_MMV_WARPS", "", ("", "16", "8", "4"),
    "warps per block of the pipelined mat-vec (default: the most that fit)", owner=OWNER,
)  # fmt: skip
MMVP = env.custom(
    "ACCELPLANE_CUDA_MMVP", (4096, 2), "the pipelined mat-vec's stage bytes and stages per warp",
    "SEG,NS", _mmvp, owner=OWNER,
)  # fmt: skip
RING = env.flag(
    "ACCELPLANE_CUDA_RING", True,
    "one-row products of long x8 weight rows through per-warp shared-memory rings", owner=OWNER,
)  # fmt: skip
QKV = env.flag(
    "ACCELPLANE_CUDA_QKV", True,
    "the decode's Q/K/V projection also ropes Q and K and writes the KV caches", owner=OWNER,
)  # fmt: skip
XQ = env.flag(
    "ACCELPLANE_CUDA_XQ", True,
    "kernels producing a register mat-vec's activations also write them quantized", owner=OWNER,
)  # fmt: skip
REPACK = env.flag(
    "ACCELPLANE_CUDA_REPACK", True, "Q4_0/Q8_0/Q4_K weights stored in the aligned x8 layouts", owner=OWNER,
)  # fmt: skip
GEMM_OUT = env.choice(
    "ACCELPLANE_CUDA_GEMM_OUT", "f32", ("f32", "f16"), "cuBLAS writes F32 results, or F16 then widened",
    owner=OWNER,
)  # fmt: skip
OFFLOAD_MIN_BATCH = env.integer(
    "ACCELPLANE_CUDA_OFFLOAD_MIN_BATCH", 32,
    "batch from which the GPU takes products whose weights are in host memory", min=1, owner=OWNER,
)  # fmt: skip
ALLREDUCE = env.choice(
    "ACCELPLANE_CUDA_ALLREDUCE", "auto", ("auto", "nccl", "none"),
    "comm over two or more GPUs: peer-memory kernel + NCCL, NCCL only, or none", owner=OWNER,
)  # fmt: skip
P2P_MAX = env.integer(
    "ACCELPLANE_CUDA_P2P_MAX", 1 << 20,
    "bytes up to which the peer-memory all-reduce kernel serves (0: never)", min=0, owner=OWNER,
)  # fmt: skip
NCCL_BF16_MIN = env.integer(
    "ACCELPLANE_CUDA_NCCL_BF16_MIN", None,
    "elements from which F32 all-reduces travel as BF16 (default by GPU count; 0: never)", min=0, owner=OWNER,
)  # fmt: skip
