"""Code that reads in one sitting: no class of the plugin over 400 lines, no function (method,
nested function) over 80. ``largest(package_dir)`` measures any package; run this file as a
script to print a package's largest: ``python plugins/cuda/tests/test_sizes.py DIR``."""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import accelplane_cuda

MAX_CLASS, MAX_FUNCTION = 400, 80


@dataclass(frozen=True)
class Size:
    """A class or function: its length in lines (decorators included) and where it is."""

    lines: int
    where: str  # path:line qualified.name


def sizes(package_dir: Path) -> tuple[list[Size], list[Size]]:
    """(classes, functions) of every .py file under ``package_dir``, longest first (ties in
    file order)."""
    classes: list[Size] = []
    functions: list[Size] = []

    def visit(node: ast.AST, path: Path, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                size = Size(child.end_lineno - first + 1, f"{path}:{child.lineno} {prefix}{child.name}")
                (classes if isinstance(child, ast.ClassDef) else functions).append(size)
                visit(child, path, f"{prefix}{child.name}.")
            else:
                visit(child, path, prefix)

    for path in sorted(Path(package_dir).rglob("*.py")):
        visit(ast.parse(path.read_text(), str(path)), path, "")
    return sorted(classes, key=lambda s: -s.lines), sorted(functions, key=lambda s: -s.lines)


def largest(package_dir: Path) -> tuple[Size | None, Size | None]:
    """The longest class and the longest function under ``package_dir`` (None where there is none)."""
    classes, functions = sizes(package_dir)
    return (classes[0] if classes else None), (functions[0] if functions else None)


def test_no_class_or_function_too_long():
    classes, functions = sizes(Path(accelplane_cuda.__file__).parent)
    assert classes and functions
    assert [c for c in classes if c.lines > MAX_CLASS] == []
    assert [f for f in functions if f.lines > MAX_FUNCTION] == []


def test_sizes_measure_what_they_say(tmp_path):
    """The measure itself: decorated, nested and method definitions, against counted lines."""
    body = "\n".join(f"    x{i} = {i}" for i in range(5))
    (tmp_path / "m.py").write_text(
        f"import functools\n\n\n@functools.cache\ndef f():\n{body}\n    def g():\n        return 1\n"
        "    return g\n\n\nclass C:\n    def m(self):\n        return 2\n"
    )  # fmt: skip
    classes, functions = sizes(tmp_path)
    assert [(s.lines, s.where.split()[-1]) for s in classes] == [(3, "C")]
    assert [(s.lines, s.where.split()[-1]) for s in functions] == [(10, "f"), (2, "f.g"), (2, "C.m")]


if __name__ == "__main__":
    for d in sys.argv[1:] or [Path(accelplane_cuda.__file__).parent]:
        cls, fn = largest(Path(d))
        print(f"{d}: longest class {cls}, longest function {fn}")
