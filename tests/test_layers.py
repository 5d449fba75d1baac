"""The layering is enforced: ``lint-imports`` (import-linter, with the contracts in
pyproject.toml) passes on the tree, and fails when a lower layer imports a higher one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
pytestmark = pytest.mark.skipif(LINT is None, reason="import-linter is not installed ([test] extra)")


def _tree(tmp: Path) -> dict[str, str]:
    """A copy of the Python sources under ``tmp`` (the SDK and every plugin package) and the
    environment that puts them first on the path."""
    shutil.copytree(ROOT / "sdk" / "accelplane", tmp / "sdk" / "accelplane",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))  # fmt: skip
    paths = [tmp / "sdk"]
    for pkg in ROOT.glob("plugins/*/accelplane_*"):
        dst = tmp / "plugins" / pkg.parent.name / pkg.name
        shutil.copytree(pkg, dst, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
        paths.append(dst.parent)
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, paths)))


def _lint(cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([LINT, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_tree_keeps_every_contract(tmp_path):
    r = _lint(tmp_path, _tree(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(("module", "upward"), [
    ("core/types.py", "import accelplane.runtime.registry"),  # core reaching into the runtime
    ("runtime/alloc.py", "from accelplane.sched import Scheduler"),  # the runtime into the scheduler
    ("oracle/compare.py", "import accelplane.conformance.runner"),  # the oracle into the suite
])  # fmt: skip
def test_an_upward_import_fails_lint(tmp_path, module, upward):
    env = _tree(tmp_path)
    src = tmp_path / "sdk" / "accelplane" / module
    src.write_text(src.read_text() + f"\n{upward}  # deliberate\n")
    r = _lint(tmp_path, env)
    assert r.returncode != 0, r.stdout
    assert "the SDK's layers: each imports only the layers below it BROKEN" in r.stdout, r.stdout


def test_a_plugin_importing_the_scheduler_fails_lint(tmp_path):
    env = _tree(tmp_path)
    src = tmp_path / "plugins" / "vulkan" / "accelplane_vulkan" / "plugin.py"
    src.write_text(src.read_text() + "\nfrom accelplane.sched import Scheduler  # deliberate\n")
    r = _lint(tmp_path, env)
    assert r.returncode != 0 and "public face" in r.stdout and "BROKEN" in r.stdout, r.stdout


PLUGIN_PACKAGES = [ROOT / "sdk" / "accelplane" / "cpu"] + sorted(
    p.parent for p in ROOT.glob("plugins/*/accelplane_*/__init__.py")
)


@pytest.mark.parametrize("pkg", PLUGIN_PACKAGES, ids=[p.name for p in PLUGIN_PACKAGES])
def test_plugin_code_sizes(pkg):
    """No class over 400 lines and no function over 80 in a plugin (tools/check_sizes.py); with
    limits of 1 line it must object, so it did read the package."""
    tool = ROOT / "tools" / "check_sizes.py"
    ok = subprocess.run([sys.executable, str(tool), str(pkg)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    tight = subprocess.run([sys.executable, str(tool), str(pkg), "--max-class", "1", "--max-function", "1"],
                           capture_output=True, text=True)  # fmt: skip
    assert tight.returncode == 1 and "lines > 1" in tight.stdout, tight.stdout + tight.stderr
