"""GLSL compute shaders → SPIR-V with glslc, cached by source hash.

Lookup order for a shader's SPIR-V: the per-user cache (accelplane.runtime.plancache.cache_dir), then
SPIR-V built into the package (``python -m accelplane_vulkan.shaders --build`` writes it to
accelplane_vulkan/spirv, for machines without glslc), then glslc. A shader that does not
compile raises ShaderCompileError with glslc's own message: a half-built backend is never
handed out (the ggml fix to vulkan-shaders-gen: check the compiler's exit status).

No Vulkan import here: compiling needs glslc only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from accelplane.errors import KernelCompileError
from accelplane.runtime.plancache import cache_dir
from accelplane.runtime.progress import phase

from . import tuning

SHADER_DIR = Path(__file__).parent / "shaders"
PREBUILT_DIR = Path(__file__).parent / "spirv"
GLSLC_ARGS = ("-fshader-stage=compute", "--target-env=vulkan1.2", "-O")


class ShaderCompileError(KernelCompileError):
    """glslc rejected a shader (the message is glslc's) or is not installed."""


def shader_dir() -> Path:
    """Where the shaders are read from: ACCELPLANE_VK_SHADER_DIR (kernel development), else
    the package's shaders/."""
    d = tuning.read().shader_dir
    return Path(d) if d else SHADER_DIR


def shader_names(shader_dir: Path = SHADER_DIR) -> list[str]:
    return sorted(p.stem for p in shader_dir.glob("*.comp"))


def source_key(name: str, shader_dir: Path = SHADER_DIR) -> str:
    """Hash of everything the SPIR-V depends on: the shader, every include, glslc's flags."""
    h = hashlib.sha256(" ".join(GLSLC_ARGS).encode())
    for p in [shader_dir / f"{name}.comp", *sorted(shader_dir.glob("*.glsl"))]:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:24]


def glslc() -> str | None:
    return shutil.which(tuning.read().glslc)


def run_glslc(src: Path, include_dir: Path) -> bytes:
    """Compile one file; raise ShaderCompileError with glslc's message on any failure."""
    exe = glslc()
    if exe is None:
        raise ShaderCompileError(
            f"cannot compile {src.name}: glslc not found (install it: apt-get install glslc, "
            "or set ACCELPLANE_GLSLC), and no cached SPIR-V matches this source"
        )
    p = subprocess.run(
        [exe, *GLSLC_ARGS, "-I", str(include_dir), str(src), "-o", "-"], capture_output=True, check=False
    )
    if p.returncode != 0:
        msg = p.stderr.decode(errors="replace").strip()
        raise ShaderCompileError(f"glslc failed on {src.name} (exit status {p.returncode}):\n{msg}")
    if len(p.stdout) < 20 or p.stdout[:4] != b"\x03\x02\x23\x07":  # SPIR-V magic, little-endian
        raise ShaderCompileError(f"glslc produced no SPIR-V for {src.name}")
    return p.stdout


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _built(name: str, shader_dir: Path) -> tuple[Path, Path | None]:
    """(where the cache keeps the SPIR-V of this source, the file that has it now or None)."""
    fname = f"{name}-{source_key(name, shader_dir)}.spv"
    cached = cache_dir("vulkan", "spirv") / fname
    return cached, next((p for p in (cached, PREBUILT_DIR / fname) if p.is_file()), None)


def spirv(name: str, shader_dir: Path = SHADER_DIR) -> bytes:
    """The SPIR-V of shaders/<name>.comp, compiled on first use and cached."""
    cached, found = _built(name, shader_dir)
    if found is not None:
        return found.read_bytes()
    code = run_glslc(shader_dir / f"{name}.comp", shader_dir)
    _write_atomic(cached, code)
    for old in cached.parent.glob(f"{name}-*.spv"):  # earlier versions of this shader
        if old != cached:
            old.unlink(missing_ok=True)
    return code


def compile_all(shader_dir: Path = SHADER_DIR) -> dict[str, bytes]:
    """Every shader's SPIR-V (all or nothing); compiling the ones not cached says so on a
    terminal when it takes a while (a new install, an edited shader)."""
    names = shader_names(shader_dir)
    todo = [n for n in names if _built(n, shader_dir)[1] is None]
    if not todo:
        return {n: spirv(n, shader_dir) for n in names}
    with phase(f"vulkan: compiling {len(todo)} shader{'s' * (len(todo) != 1)} with glslc"):
        return {n: spirv(n, shader_dir) for n in names}


def build_prebuilt() -> list[Path]:
    """Write every shader's SPIR-V into the package (accelplane_vulkan/spirv)."""
    PREBUILT_DIR.mkdir(exist_ok=True)
    for old in PREBUILT_DIR.glob("*.spv"):
        old.unlink()
    out = []
    for name, code in compile_all().items():
        p = PREBUILT_DIR / f"{name}-{source_key(name)}.spv"
        _write_atomic(p, code)
        out.append(p)
    return out


if __name__ == "__main__":  # python -m accelplane_vulkan.shaders [--build]
    if "--build" in sys.argv[1:]:
        for p in build_prebuilt():
            print(p)
    else:
        for n, code in compile_all().items():
            print(f"{n}: {len(code)} bytes")
