"""scripts/setup-env, the set-up of scripts/run-main and scripts/test-all: when nothing an install
is made from has changed, a run checks the environment and returns at once, in one line.

The stamp's inputs are checked on a copy of the tree that shares this checkout's .venv (``--check``
installs nothing): a changed C source or build file makes the environment out of date, a changed
Python module (an editable install reads it from the tree) does not. The second-run test needs a
.venv set up by the script; without one it is skipped, except under CI (``CI`` set), where
scripts/test-all has just run the script and the test must run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "setup-env"
UP_TO_DATE = "setup-env: .venv is up to date ("
SECOND_RUN_S = 10.0


def _env() -> dict[str, str]:
    # the check runs .venv's interpreter on its own installs, not on this process's path
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}


def _setup_env(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(root / "scripts" / "setup-env"), *args], capture_output=True, text=True,
                          env=_env(), timeout=120)  # fmt: skip


@pytest.fixture(scope="module")
def set_up() -> None:
    """This checkout's .venv is up to date, or the test skips (fails under CI)."""
    p = _setup_env(ROOT, "--check")
    if p.returncode != 0:
        msg = f"no up-to-date .venv from scripts/setup-env here ({p.stdout.strip() or p.stderr.strip()})"
        if os.environ.get("CI"):
            pytest.fail(msg + ": CI runs scripts/setup-env first")
        pytest.skip(msg)


def test_usage_error():
    p = _setup_env(ROOT, "--no-such-option")
    assert p.returncode == 2 and p.stdout == "" and p.stderr == "usage: scripts/setup-env [--check]\n"


def test_second_run_goes_straight_to_work(set_up):
    t0 = time.monotonic()
    p = _setup_env(ROOT)
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stderr == "" and len(p.stdout.splitlines()) == 1 and p.stdout.startswith(UP_TO_DATE), p.stdout
    assert took < SECOND_RUN_S, f"a run with nothing to install took {took:.1f} s"


@pytest.fixture
def tree(set_up, tmp_path) -> Path:
    """A copy of what the stamp hashes, with this checkout's .venv linked in."""
    out = tmp_path / "tree"
    junk = shutil.ignore_patterns("__pycache__", "build", "dist", "*.egg-info", "*.so", "*.pyc")
    for d in ("sdk", "plugins", "scripts"):
        shutil.copytree(ROOT / d, out / d, ignore=junk)
    for f in ("pyproject.toml", "setup.py"):
        shutil.copy2(ROOT / f, out / f)
    (out / ".venv").symlink_to(ROOT / ".venv")
    return out


@pytest.mark.parametrize(("path", "stale"), [
    ("sdk/accelplane/cpu/_rowops.c", True),  # compiled at install time
    ("plugins/hexagon/accelplane_hexagon/htp/ops.c", True),
    ("plugins/vulkan/pyproject.toml", True),  # entry points, dependencies
    ("setup.py", True),
    ("scripts/setup-env", True),
    ("sdk/accelplane/core/graph.py", False),  # read from the tree by the editable install
    ("plugins/vulkan/accelplane_vulkan/shaders/unary.comp", False),  # compiled at run time
])  # fmt: skip
def test_stamp_covers_what_an_install_is_made_from(tree: Path, path: str, stale: bool):
    assert _setup_env(tree, "--check").returncode == 0, "the copy hashes as the checkout does"
    f = tree / path
    assert f.is_file(), f"{path}: not in the tree (update this test)"
    with f.open("a") as fh:
        fh.write("\n")
    p = _setup_env(tree, "--check")
    assert p.returncode == (1 if stale else 0), p.stdout + p.stderr
    if stale:
        assert p.stdout.startswith("setup-env: .venv is out of date"), p.stdout
