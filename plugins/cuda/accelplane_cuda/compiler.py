"""The plugin's kernels: one family per ``kernels/<name>.cu``, each compiled as its own module.

A family is declared (:func:`family`) next to the plan code that launches its kernels, with
every template instantiation it may ask for: kernel name → the template argument lists, built
from the same tables the launches read, so that adding a type is one line and no list can drift
from what is launched. A family is compiled for a device the first time a plan there looks up
one of its kernels (NVRTC through CuPy's RawModule, for the device's compute capability; CuPy
caches the binaries on disk, keyed on the source and the options, which is why the source
handed over has its includes inlined); a plan compiles only the families it uses.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelplane.errors import ComputeError
from accelplane.runtime.progress import phase

KERNEL_DIR = Path(__file__).parent / "kernels"
STD = "--std=c++17"
Arg = int | str | bool  # a template argument: an integer (type ids included), a C type, a flag
_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.M)
_ONCE = re.compile(r"^#pragma once\s*$\n?", re.M)


def name(kernel: str, *args: Arg) -> str:
    """The name expression of ``kernel`` instantiated for ``args``, as NVRTC and the plans spell
    it: ``name("k_cpy_q", T.Q8_0, "float")`` is ``k_cpy_q<8,float>``; no arguments, the plain name."""
    if not args:
        return kernel
    text = [("true" if a else "false") if isinstance(a, bool) else str(int(a)) if isinstance(a, int) else a
            for a in args]  # fmt: skip
    return f"{kernel}<{','.join(text)}>"


def product(*lists: Iterable[Arg]) -> list[tuple[Arg, ...]]:
    """Every combination of the lists' values: the instantiations of a kernel with several
    template parameters."""
    return list(itertools.product(*lists))


@dataclass(frozen=True)
class Family:
    """``kernels/<file>.cu`` and what it is compiled for.

    kernels: kernel → its instantiations' template arguments (``[()]`` for a plain kernel);
    defines: ``-D`` macros the source needs; big_smem: kernels whose dynamic shared memory may
    exceed the default 48 KiB (given the device's opt-in limit after compiling)."""

    file: str
    kernels: Mapping[str, Sequence[tuple[Arg, ...]]]
    defines: Mapping[str, int] = field(default_factory=dict)
    big_smem: tuple[str, ...] = ()

    def names(self) -> list[str]:
        return [name(k, *args) for k, inst in self.kernels.items() for args in inst]

    def options(self) -> tuple[str, ...]:
        return (STD, *(f"-D{k}={v}" for k, v in self.defines.items()))

    def source(self) -> str:
        """The file with its quoted includes inlined, each header once (``#pragma once``)."""
        return _inline(KERNEL_DIR / f"{self.file}.cu", set())


def _inline(path: Path, seen: set[Path]) -> str:
    if path in seen:
        return ""
    seen.add(path)
    text = _ONCE.sub("", path.read_text())
    return _INCLUDE.sub(lambda m: _inline(path.parent / m[1], seen), text)


_FAMILIES: dict[str, Family] = {}
_OWNER: dict[str, Family] = {}  # kernel name → its family


def family(file: str, kernels: Mapping[str, Sequence[tuple[Arg, ...]]],
           defines: Mapping[str, int] | None = None, big_smem: tuple[str, ...] = ()) -> Family:  # fmt: skip
    """Declare the family of ``kernels/<file>.cu`` (once per file; a kernel belongs to one family)."""
    fam = Family(file, dict(kernels), dict(defines or {}), big_smem)
    if file in _FAMILIES or not (KERNEL_DIR / f"{file}.cu").is_file():
        raise ValueError(f"kernels/{file}.cu: declared twice or missing")
    for k in fam.kernels:
        if k in _OWNER:
            raise ValueError(f"{k} is declared by kernels/{_OWNER[k].file}.cu and kernels/{file}.cu")
        _OWNER[k] = fam
    _FAMILIES[file] = fam
    return fam


def families() -> list[Family]:
    """Every family of the plugin (imports the modules that declare them)."""
    from . import p2p, plan  # noqa: F401 - plan imports every op module

    return list(_FAMILIES.values())


class DeviceKernels:
    """name → kernel function on one device, compiling its family on first use (a failed compile
    is remembered and raised again, not retried for every graph); and the device's attributes
    that launches are sized by: compute capability ``cc``, ``sm_count``, ``smem_optin`` (bytes
    of shared memory a block may opt in to)."""

    def __init__(self, device: int) -> None:
        import cupy as cp

        self.device = device
        attrs = cp.cuda.Device(device).attributes
        self.cc = int(cp.cuda.Device(device).compute_capability)
        self.sm_count = attrs["MultiProcessorCount"]
        self.smem_optin = attrs["MaxSharedMemoryPerBlockOptin"]
        self._fns: dict[str, Any] = {}
        self._failed: dict[str, ComputeError] = {}

    def __getitem__(self, kernel_name: str):
        fn = self._fns.get(kernel_name)
        if fn is None:
            fam = _OWNER.get(kernel_name.split("<")[0])
            if fam is None:
                raise ComputeError(f"CUDA kernel {kernel_name}: no kernel family declares it")
            self._compile(fam)
            fn = self._fns.get(kernel_name)
            if fn is None:
                raise ComputeError(f"CUDA kernel {kernel_name}: not among the instantiations kernels/"
                                   f"{fam.file}.cu is compiled for")  # fmt: skip
        return fn

    def prepare(self, *kernel_names: str) -> None:
        """Compile the families of these kernels now (before a stream capture, say) where not yet."""
        for n in kernel_names:
            self[n]

    def _compile(self, fam: Family) -> None:
        if fam.file in self._failed:
            raise self._failed[fam.file]
        import cupy as cp

        names = fam.names()
        with cp.cuda.Device(self.device):
            mod = cp.RawModule(code=fam.source(), options=fam.options(), name_expressions=names)
            try:
                what = f"cuda: CUDA{self.device}: compiling kernels/{fam.file}.cu ({len(names)} kernels)"
                with phase(what):
                    mod.compile()  # NVRTC (seconds; CuPy caches the result on disk)
            except cp.cuda.compiler.CompileException as e:
                err = ComputeError(f"CUDA kernels/{fam.file}.cu failed to compile: {e}")
                self._failed[fam.file] = err
                raise err from e
            fns = {n: mod.get_function(n) for n in names}
            for n, fn in fns.items():
                if n.split("<")[0] in fam.big_smem:
                    fn.max_dynamic_shared_size_bytes = self.smem_optin
        self._fns.update(fns)


_DEVICES: dict[int, DeviceKernels] = {}


def device(index: int) -> DeviceKernels:
    """The kernels of CUDA device ``index`` (one table per device, for the process)."""
    k = _DEVICES.get(index)
    if k is None:
        k = _DEVICES[index] = DeviceKernels(index)
    return k
