"""Building a cffi extension next to its sources, for a source-tree run without installing
(``python path/to/_build.py``): the SDK's CPU kernels and any plugin's C side."""

from __future__ import annotations

import importlib.machinery
import os
import tempfile
from typing import Any


def build_in_place(builder: Any, here: str, stem: str, verbose: bool = False) -> str:
    """Compile ``builder`` (a ``cffi.FFI`` whose sources are absolute paths: compile() works in a
    temporary folder) and move the extension into the folder ``here`` as ``stem`` plus the
    suffix pip's build gives it, removing builds of ``stem`` under other suffixes. Returns the
    extension's path."""
    with tempfile.TemporaryDirectory() as tmp:
        out = builder.compile(tmpdir=tmp, verbose=verbose)
        # cffi's C targets the limited API, so pip's build names it STEM.abi3.so: a build under
        # another suffix would shadow, or be shadowed by, the next pip install -e
        name = os.path.basename(out)
        if ".abi3.so" in importlib.machinery.EXTENSION_SUFFIXES and name.endswith(".so"):
            name = stem + ".abi3.so"
        for old in os.listdir(here):
            if old.startswith(stem + ".") and old.endswith((".so", ".pyd")):
                os.remove(os.path.join(here, old))
        dest = os.path.join(here, name)
        os.replace(out, dest)
    return dest
