#!/usr/bin/env python3
"""Size limits of a plugin's Python code: no class over 400 lines, no function over 80.

    python tools/check_sizes.py PACKAGE_DIR [PACKAGE_DIR ...] [--max-class N] [--max-function N]

Prints the largest class and function of each package and every definition past a limit;
exits 1 when there is one, 2 on a bad argument (a directory that does not exist, a file that
does not parse). Lines are counted from the ``def``/``class`` line (decorators excluded) to the
definition's last line, so a method counts inside its class and on its own; a nested function
counts inside the function that holds it and on its own.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

MAX_CLASS = 400
MAX_FUNCTION = 80

Sized = tuple[str, int]  # (qualified name "path/to/module.py:Outer.inner", lines)


def _definitions(tree: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
    """Every class and function in ``tree`` with its qualified name, outermost first."""
    stack: list[tuple[ast.AST, str]] = [(tree, "")]
    while stack:
        node, scope = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{scope}.{child.name}" if scope else child.name
                yield f"{prefix}:{name}", child
                stack.append((child, name))
            else:
                stack.append((child, scope))


def sizes(package_dir: str | Path) -> tuple[list[Sized], list[Sized]]:
    """(classes, functions) of every ``*.py`` under ``package_dir``, each as (name, lines).

    Raises FileNotFoundError for a missing directory and SyntaxError for a file that does not
    parse (its path in the message)."""
    root = Path(package_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"not a directory: {root}")
    classes: list[Sized] = []
    functions: list[Sized] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for name, node in _definitions(tree, rel):
            lines = node.end_lineno - node.lineno + 1
            (classes if isinstance(node, ast.ClassDef) else functions).append((name, lines))
    return classes, functions


def largest(package_dir: str | Path) -> tuple[Sized, Sized]:
    """The largest class and the largest function under ``package_dir`` as (name, lines);
    ("", 0) where there is none."""
    classes, functions = sizes(package_dir)
    pick = lambda items: max(items, key=lambda s: s[1], default=("", 0))  # noqa: E731
    return pick(classes), pick(functions)


def over_limits(package_dir: str | Path, max_class: int = MAX_CLASS,
                max_function: int = MAX_FUNCTION) -> list[str]:
    """One line per class or function past its limit."""
    classes, functions = sizes(package_dir)
    return ([f"class {n}: {k} lines > {max_class}" for n, k in classes if k > max_class]
            + [f"function {n}: {k} lines > {max_function}" for n, k in functions if k > max_function])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/check_sizes.py", description=__doc__.split("\n")[0])
    ap.add_argument("package_dirs", nargs="+", metavar="PACKAGE_DIR")
    ap.add_argument("--max-class", type=int, default=MAX_CLASS)
    ap.add_argument("--max-function", type=int, default=MAX_FUNCTION)
    args = ap.parse_args(argv)
    failed = False
    for d in args.package_dirs:
        try:
            (cname, clines), (fname, flines) = largest(d)
            bad = over_limits(d, args.max_class, args.max_function)
        except (OSError, SyntaxError, UnicodeDecodeError) as e:
            print(f"{d}: {e}", file=sys.stderr)
            return 2
        print(f"{d}: largest class {cname or '-'} ({clines}), largest function {fname or '-'} ({flines})")
        for line in bad:
            print(f"  {line}")
        failed |= bool(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
