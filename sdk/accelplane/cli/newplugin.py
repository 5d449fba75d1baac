"""``accelplane new-plugin NAME [DIR]``: write a complete out-of-tree plugin distribution.

The files come from the templates beside this module (package data, ``templates/*.tmpl``) with
``@KEY@`` placeholders filled in: a pyproject.toml declaring the ``accelplane.plugins`` entry
point, a plugin module with every required hook backed by numpy (ADD, MUL, SCALE, MUL_MAT in
F32; ``supports_op`` declines everything else), an expected-failures file, pytest tests, a
tox.ini that runs the tests and ``accelplane conformance NAME``, and a CI workflow running tox.
The plugin passes its own conformance run as generated.
"""

from __future__ import annotations

import argparse
import re
import shutil
from importlib import resources
from pathlib import Path

from accelplane._version import __version__
from accelplane.cli import UsageError
from accelplane.interface import API_VERSION

# NAME is the entry-point name (what `accelplane conformance NAME` and ACCELPLANE_PLUGINS take)
# and the suffix of the package, accelplane_NAME: a lowercase Python identifier
NAME_RE = re.compile(r"[a-z][a-z0-9_]*")
MAX_NAME = 24
# output path -> template file (templates/); @MODULE@ in a path is the package's name
FILES = {
    "pyproject.toml": "pyproject.toml.tmpl",
    "README.md": "README.md.tmpl",
    "tox.ini": "tox.ini.tmpl",
    ".gitignore": "gitignore.tmpl",
    ".github/workflows/ci.yml": "ci.yml.tmpl",
    "@MODULE@/__init__.py": "__init__.py.tmpl",
    "@MODULE@/plugin.py": "plugin.py.tmpl",
    "@MODULE@/kernels.py": "kernels.py.tmpl",
    "@MODULE@/expected-failures.txt": "expected-failures.txt.tmpl",
    "tests/test_plugin.py": "test_plugin.py.tmpl",
}


def add_parser(sub) -> None:
    """The ``new-plugin`` subcommand on the CLI's subparsers."""
    p = sub.add_parser(
        "new-plugin", help="write a new plugin distribution (numpy kernels) that passes its conformance run",
        description="Write a complete out-of-tree plugin distribution in DIR (default: ./accelplane-NAME): "
        "pyproject.toml with the accelplane.plugins entry point, the plugin module (every required hook, "
        "numpy kernels for ADD, MUL, SCALE, MUL_MAT in F32), an expected-failures file, tests, tox.ini "
        "and a CI workflow. It passes `accelplane conformance NAME` once installed (pip install -e DIR).",
    )  # fmt: skip
    p.add_argument("name", metavar="NAME", help="plugin name: lowercase letters, digits and '_', starting "
                   "with a letter (e.g. myvendor)")
    p.add_argument("dir", metavar="DIR", nargs="?",
                   help="where to write it: a new or empty directory (default ./accelplane-NAME)")


def check_name(name: str) -> None:
    """UsageError unless ``name`` can be a plugin's entry-point name and package suffix, and no
    installed plugin has it (its device name would clash)."""
    if not NAME_RE.fullmatch(name) or len(name) > MAX_NAME:
        raise UsageError(
            f"new-plugin: {name!r} is not a plugin name: lowercase letters, digits and '_', starting with "
            f"a letter, at most {MAX_NAME} characters (e.g. myvendor)"
        )
    from accelplane.runtime.registry import installed_names

    if name in installed_names():
        raise UsageError(f"new-plugin: a plugin named {name!r} is installed already "
                         "(accelplane devices lists it); choose another name")  # fmt: skip


def fields(name: str) -> dict[str, str]:
    """The placeholders' values for plugin ``name``."""
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", __version__).groups())
    return {
        "@NAME@": name,
        "@MODULE@": f"accelplane_{name}",
        "@DIST@": f"accelplane-{name.replace('_', '-')}",
        # unique across plugins (the registry refuses a clash, case-insensitively) as NAME is
        "@DEVICE@": f"{name.upper()}0",
        # this SDK's release up to the next major (the API version is checked at load anyway)
        "@SDK_REQ@": f"accelplane>={major}.{minor},<{major + 1}",
        "@API@": f"({API_VERSION[0]}, {API_VERSION[1]})",
    }


def fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace(key, value)
    left = re.findall(r"@[A-Z_]+@", text)
    if left:  # a template names a placeholder fields() does not know: a bug of the SDK
        raise RuntimeError(f"new-plugin: template placeholders without a value: {sorted(set(left))}")
    return text


def render(name: str) -> dict[str, str]:
    """Relative path -> text of every file of the plugin ``name``."""
    values = fields(name)
    base = resources.files("accelplane.cli").joinpath("templates")
    return {fill(path, values): fill(base.joinpath(tmpl).read_text(encoding="utf-8"), values)
            for path, tmpl in FILES.items()}  # fmt: skip


def target_dir(name: str, where: str | None) -> Path:
    """The directory to write into: UsageError unless it is absent or an empty directory."""
    if where is not None and (not where or "\0" in where):
        raise UsageError(f"new-plugin: DIR {where!r} is not a path")
    path = Path(where) if where is not None else Path(f"accelplane-{name.replace('_', '-')}")
    try:
        if not (path.exists() or path.is_symlink()):
            return path
        if not path.is_dir():
            raise UsageError(f"new-plugin: {path} exists and is not a directory")
        empty = next(path.iterdir(), None) is None
    except OSError as e:  # a name too long, a parent that is a file, no permission
        raise UsageError(f"new-plugin: {path}: {e.strerror or e}") from None
    if not empty:
        raise UsageError(f"new-plugin: {path} exists and is not empty; give a new or empty directory")
    return path


def write(name: str, where: str | None = None) -> tuple[Path, list[str]]:
    """Write plugin ``name`` into ``where`` (see :func:`target_dir`); returns the directory and
    the files written, relative to it. Every file is rendered before the first is written."""
    check_name(name)
    path = target_dir(name, where)
    files = render(name)
    existed = path.is_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        for rel, text in files.items():
            out = path / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text, encoding="utf-8")
    except OSError as e:
        # the directory was absent or empty: leave it so, not half a plugin
        if path.is_dir():
            for child in path.iterdir():
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
            if not existed:
                path.rmdir()
        raise UsageError(f"new-plugin: cannot write {e.filename or path}: {e.strerror or e}") from None
    return path, list(files)


def cmd_new_plugin(args: argparse.Namespace) -> int:
    path, files = write(args.name, args.dir)
    v = fields(args.name)
    print(f"wrote plugin {args.name!r} (package {v['@MODULE@']}, device {v['@DEVICE@']}) in {path}/:")
    for rel in files:
        print(f"  {rel}")
    print(f"next: pip install -e {path}  &&  accelplane conformance {args.name}  "
          f"(then pytest {path}/tests, or tox in {path})")  # fmt: skip
    return 0
