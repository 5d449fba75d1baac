"""The ISA tier: the tiled matmul's integer kernel, written with HVX intrinsics
(``tiledot-hvx.c``), built for Hexagon v67 with clang-19 and run under qemu-hexagon on fixed
inputs; its int32 row sums and accumulated results must equal the host-C emulation's
(``_htp.htp_tile_rowdot``) bit for bit.

Needs clang-19, ld.lld-19 and qemu-hexagon (plugins/hexagon/system-deps installs them);
:func:`missing` says which are absent. QEMU 7.2 (Debian bookworm) knows Hexagon up to v67 and
no HVX floating point, which is why the kernel's float part is scalar code.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
HTP_DIR = HERE.parent / "htp"
TOOLS = ("clang-19", "ld.lld-19", "qemu-hexagon")
CFLAGS = ("--target=hexagon-unknown-none-elf", "-mv67", "-mhvx", "-mhvx-length=128B", "-O2", "-G0",
          "-ffreestanding", "-fno-builtin", "-nostdlib", "-static", "-ffp-contract=off",
          "-Wall", "-Werror")  # fmt: skip


def missing() -> list[str]:
    """The tools of this tier not found on PATH."""
    return [t for t in TOOLS if shutil.which(t) is None]


@dataclass
class TileCase:
    """One row tile of ``n_kt`` repacked tiles against ``n_x`` rows of Q8_0 activation blocks."""

    q4: bool
    tiles: np.ndarray  # uint8 [n_kt * tile_bytes]
    xq: np.ndarray  # int8 [n_x, n_kt * 32]
    xd: np.ndarray  # uint16 fp16 bits [n_x, n_kt]

    @property
    def n_kt(self) -> int:
        return self.xd.shape[1]

    @property
    def n_x(self) -> int:
        return self.xd.shape[0]


@dataclass
class TileResult:
    isum: np.ndarray  # int32 [n_x, n_kt, 32]
    out16: np.ndarray  # uint32 bits of the fp16-accumulated results [n_x, 32]
    out32: np.ndarray  # uint32 bits of the fp32-accumulated results [n_x, 32]


def _f16_bits(rng: np.random.Generator, n: int, lo: float, hi: float) -> np.ndarray:
    v = rng.uniform(lo, hi, n) * rng.choice([-1.0, 1.0], n)
    return v.astype(np.float16).view(np.uint16)


def fixed_case(q4: bool, n_kt: int = 8, n_x: int = 4, seed: int = 20261129) -> TileCase:
    """Deterministic inputs with the edges in: every int8 (and nibble) value, zero, subnormal
    and large fp16 scales (large enough that some fp16 accumulators overflow to inf)."""
    rng = np.random.default_rng(seed)
    tile_bytes, qbytes = (576, 512) if q4 else (1088, 1024)
    tiles = rng.integers(0, 256, (n_kt, tile_bytes), dtype=np.uint8)
    scales = _f16_bits(rng, n_kt * 32, 1e-3, 2.0).reshape(n_kt, 32)
    scales[:, 0] = 0  # a padding-like row
    scales[:, 1] = np.float16(3.0e-6).view(np.uint16)  # subnormal
    scales[:, 2] = np.float16(4000.0).view(np.uint16)  # overflows an fp16 accumulator
    tiles[:, qbytes:] = scales.view(np.uint8).reshape(n_kt, 64)
    xq = rng.integers(-128, 128, (n_x, n_kt * 32), dtype=np.int64).astype(np.int8)
    xq[0, :32] = np.arange(-128, 128, 8, dtype=np.int64).astype(np.int8)
    xd = _f16_bits(rng, n_x * n_kt, 1e-3, 1.0).reshape(n_x, n_kt)
    xd[-1, -1] = 0
    return TileCase(q4, tiles.reshape(-1), xq, xd)


def run_host(case: TileCase) -> TileResult:
    """The host-C emulation's results for ``case``."""
    from ..npu import load

    ffi, lib = load()
    isum = np.zeros((case.n_x, case.n_kt, 32), np.int32)
    outs = []
    ty = lib.HTP_TYPE_Q4_0_TILED if case.q4 else lib.HTP_TYPE_Q8_0_TILED
    tiles = np.ascontiguousarray(case.tiles)
    xq = np.ascontiguousarray(case.xq)
    xd = np.ascontiguousarray(case.xd)
    for acc_f16 in (1, 0):
        out = np.zeros((case.n_x, 32), np.float32)
        rc = lib.htp_tile_rowdot(ty, ffi.from_buffer("uint8_t[]", tiles), case.n_kt,
                                 ffi.from_buffer("int8_t[]", xq), ffi.from_buffer("uint16_t[]", xd),
                                 case.n_x, acc_f16, ffi.from_buffer("int32_t[]", isum),
                                 ffi.from_buffer("float[]", out))  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"htp_tile_rowdot returned {rc}")
        outs.append(out.view(np.uint32))
    return TileResult(isum, outs[0], outs[1])


def _c_array(ctype: str, name: str, values: np.ndarray) -> str:
    body = ",".join(str(int(v)) for v in values.reshape(-1))
    return f"static const {ctype} {name}[] __attribute__((aligned(128))) = {{{body}}};\n"


def write_inputs(case: TileCase, path: Path) -> None:
    path.write_text(
        f"#define TILE_Q4 {int(case.q4)}\n#define N_KT {case.n_kt}\n#define N_X {case.n_x}\n"
        + _c_array("uint8_t", "TILES", case.tiles)
        + _c_array("int8_t", "XQ", case.xq)
        + _c_array("uint16_t", "XD", case.xd)
    )


def build(case: TileCase, workdir: Path) -> Path:
    """Compile and link the HVX kernel with ``case`` baked in; returns the ELF's path."""
    write_inputs(case, workdir / "inputs.h")
    elf = workdir / "tiledot.elf"
    cmd = ["clang-19", *CFLAGS, f"-I{HTP_DIR}", f"-I{workdir}", "-fuse-ld=lld",
           f"--ld-path={shutil.which('ld.lld-19')}", "-Wl,-e,_start", str(HERE / "tiledot-hvx.c"),
           "-o", str(elf)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    return elf


def run_isa(case: TileCase, workdir: Path | None = None) -> TileResult:
    """Build and run the HVX kernel under qemu-hexagon; parse what it prints."""
    with tempfile.TemporaryDirectory(prefix="htp-isa-") as tmp:
        wd = Path(workdir or tmp)
        elf = build(case, wd)
        env = dict(os.environ, QEMU_CPU="v67")
        p = subprocess.run(["qemu-hexagon", str(elf)], check=True, capture_output=True, text=True,
                           timeout=120, env=env)  # fmt: skip
    rows: dict[str, list[list[int]]] = {"isum": [], "out16": [], "out32": []}
    lines = p.stdout.splitlines()
    if not lines or lines[-1] != "done":
        raise RuntimeError(f"qemu-hexagon run did not finish: {p.stdout[-500:]!r} {p.stderr[-500:]!r}")
    for line in lines[:-1]:
        key, *words = line.split()
        rows[key].append([int(w, 16) for w in words])
    isum = np.array(rows["isum"], np.uint32).view(np.int32).reshape(case.n_x, case.n_kt, 32)
    return TileResult(isum, np.array(rows["out16"], np.uint32), np.array(rows["out32"], np.uint32))


def mismatches(a: TileResult, b: TileResult) -> list[str]:
    """What differs between two results; empty when every int32 sum and every result's bits
    (NaNs included: both sides round through the same fp16 code) are equal."""
    out = []
    if not np.array_equal(a.isum, b.isum):
        out.append(f"{int(np.sum(a.isum != b.isum))} int32 row sums differ")
    for name in ("out16", "out32"):
        x, y = getattr(a, name), getattr(b, name)
        if not np.array_equal(x, y):
            i = tuple(np.argwhere(x != y)[0])
            out.append(f"{name}: {int(np.sum(x != y))} results differ, first at {i}: "
                       f"{int(x[i]):#010x} vs {int(y[i]):#010x}")  # fmt: skip
    return out
