"""Every kernel family compiles with nvcc for sm_90 with every instantiation the plugin asks NVRTC
for (no GPU needed: the CUDA compiler only; skipped without nvcc). The source, the options and
the instantiations are the plugin's own (compiler.Family); each instantiation is referenced from
host code so that nvcc instantiates it, and the cubin must hold exactly one kernel per name."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from accelplane_cuda import compiler

ARCH = "sm_90"
NVCC = shutil.which("nvcc")
_STB_GLOBAL, _STT_FUNC = 1, 2


def _global_functions(cubin: bytes) -> list[str]:
    """Names of the global function symbols of an ELF64 cubin (the kernels)."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    symtab = next(s for s in sections if s[1] == 2)  # SHT_SYMTAB
    strtab = sections[symtab[6]][4]
    out = []
    for i in range(symtab[5] // 24):
        name, info = struct.unpack_from("<IB", cubin, symtab[4] + 24 * i)
        if info >> 4 == _STB_GLOBAL and info & 15 == _STT_FUNC:
            out.append(cubin[strtab + name : cubin.index(b"\0", strtab + name)].decode())
    return out


def nvcc_source(fam: compiler.Family) -> str:
    """The family's source with a host-side reference to each instantiation it is compiled for."""
    refs = "".join(f"    (void*)&{n},\n" for n in fam.names())
    return f"{fam.source()}\nvoid* const accelplane_instances[] = {{\n{refs}}};\n"


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("family", [f.file for f in compiler.families()])
def test_family_compiles_with_nvcc(family, tmp_path):
    fam = next(f for f in compiler.families() if f.file == family)
    src = tmp_path / f"{family}.cu"
    src.write_text(nvcc_source(fam))
    out = tmp_path / f"{family}.cubin"
    cmd = [NVCC, *fam.options(), f"-arch={ARCH}", "-cubin", "-diag-suppress", "177", "-o", str(out), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr[-4000:]}"
    kernels = _global_functions(out.read_bytes())
    assert len(kernels) == len(set(kernels)) == len(fam.names()), (len(kernels), len(fam.names()))
    # as many of each kernel as its table lists (mangled: _Z, the name's length, the name)
    per_kernel = {k: sum(m.startswith(f"_Z{len(k)}{k}") for m in kernels) for k in fam.kernels}
    assert per_kernel == {k: len(inst) for k, inst in fam.kernels.items()}


def test_families_cover_every_kernel():
    """Every __global__ function of kernels/*.cu belongs to one family's table, and every
    family's file exists (a kernel no table names would never be compiled or launched)."""
    import re

    declared = {k for f in compiler.families() for k in f.kernels}
    files = {p.stem for p in compiler.KERNEL_DIR.glob("*.cu")}
    assert files == {f.file for f in compiler.families()}
    defined = set()
    for p in compiler.KERNEL_DIR.glob("*.cu"):
        defined |= set(re.findall(r"__global__[^{;]*?\b(k_\w+)\s*\(", p.read_text()))
    assert defined == declared
    assert Path(compiler.KERNEL_DIR, "common.cuh").is_file()
