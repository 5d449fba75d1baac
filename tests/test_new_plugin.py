"""``accelplane new-plugin``: the distribution it writes is complete, lints clean, installs (a real
wheel build and install, entry point included), passes its own conformance run with cases that
ran, and its own tests; with tox installed, its tox envs pass with the SDK from a wheel of this
tree. User errors are one line with exit status 2, and leave nothing behind.

The oracles are independent of the generator: tomllib, configparser and yaml read the files,
pip installs the plugin, the conformance suite judges it against the float64 oracle.
"""

from __future__ import annotations

import ast
import configparser
import contextlib
import importlib
import inspect
import io
import os
import shutil
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import accelplane
import pytest
from accelplane.cli import main, newplugin
from accelplane.cpu import plugin as cpu_plugin
from accelplane.interface import API_VERSION, REQUIRED_HOOKS, Specs
from accelplane.runtime.registry import Registry
from packaging.requirements import Requirement
from suite_run import conformance

ROOT = Path(__file__).resolve().parents[1]
SDK = Path(accelplane.__file__).resolve().parents[1]  # the accelplane the children import
NAME, MODULE, DEVICE = "tmplcheck", "accelplane_tmplcheck", "TMPLCHECK0"
OPS = ("ADD", "MUL", "SCALE", "MUL_MAT")  # the template's kernels


def generate(name: str, where: Path) -> Path:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["new-plugin", name, str(where)])
    assert rc == 0, out.getvalue()
    return where


def child_env(*paths: Path, **extra: str) -> dict[str, str]:
    """This environment without ACCELPLANE_* variables, ``paths`` first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPLANE_")}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(SDK), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 300):
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    return generate(NAME, tmp_path_factory.mktemp("new-plugin") / "plugin")


@pytest.fixture(scope="module")
def installed(generated, tmp_path_factory) -> Path:
    """A site directory holding the plugin as pip installs it (its wheel, built here)."""
    site = tmp_path_factory.mktemp("site")
    rc, out = run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                   "--no-index", "--target", str(site), str(generated)], cwd=site)  # fmt: skip
    assert rc == 0, out
    return site


# --- what it writes --------------------------------------------------------------------------------
def test_writes_a_complete_distribution(generated):
    files = sorted(p.relative_to(generated).as_posix() for p in generated.rglob("*") if p.is_file())
    assert files == sorted(f.replace("@MODULE@", MODULE) for f in newplugin.FILES)
    meta = tomllib.loads((generated / "pyproject.toml").read_text())
    project = meta["project"]
    assert project["name"] == "accelplane-tmplcheck" and project["license"] == "MIT"
    assert project["entry-points"]["accelplane.plugins"] == {NAME: f"{MODULE}.plugin"}
    sdk = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "accelplane"]
    assert len(sdk) == 1 and sdk[0].specifier, project["dependencies"]
    assert sdk[0].specifier.contains(accelplane.__version__), "the range must admit this SDK"
    assert not sdk[0].specifier.contains(f"{int(accelplane.__version__.split('.')[0]) + 1}.0"), (
        "the range must stop before the next major release")
    assert "expected-failures.txt" in meta["tool"]["setuptools"]["package-data"][MODULE]


def test_api_version_is_a_literal(generated):
    """api_version() returns a tuple of two literal integers, this SDK's (never a name such as
    the SDK's API_VERSION, which would make the check pass whatever the plugin was written for)."""
    tree = ast.parse((generated / MODULE / "plugin.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "api_version")
    (ret,) = [n for n in ast.walk(fn) if isinstance(n, ast.Return)]
    assert ast.literal_eval(ret.value) == API_VERSION, ast.dump(ret)


def test_tox_ini_and_ci_workflow(generated):
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(generated / "tox.ini")
    assert tox["tox"]["env_list"].replace(" ", "").split(",") == ["lint", "py"]
    commands = tox["testenv"]["commands"]
    assert f"accelplane conformance {NAME}" in commands and "pytest tests" in commands
    assert "PIP_*" in tox["testenv"]["pass_env"].split(), "PIP_FIND_LINKS must reach the envs' pip"
    assert "ruff check" in tox["testenv:lint"]["commands"]
    yaml = pytest.importorskip("yaml")
    ci = yaml.safe_load((generated / ".github" / "workflows" / "ci.yml").read_text())
    steps = [s.get("run", "") for job in ci["jobs"].values() for s in job["steps"]]
    assert "tox" in steps, steps


def test_expected_failures_file_has_no_entry(generated):
    from accelplane.conformance.pytest_plugin import parse_xfails

    text = (generated / MODULE / "expected-failures.txt").read_text()
    assert parse_xfails(text, "expected-failures.txt") == ([], [])
    assert "test id: reason" in text


def test_lints_clean(generated):
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    rc, out = run([ruff, "check", "--no-cache", "."], cwd=generated)
    assert rc == 0, out


def test_package_data_ships_every_template():
    """The SDK's wheel carries the templates (else `new-plugin` fails where it is installed)."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    missing = [t for t in newplugin.FILES.values()
               if not any(fnmatch(f"cli/templates/{t}", g) for g in globs["accelplane"])]  # fmt: skip
    assert not missing, f"pyproject.toml's package-data misses the templates {missing}"


# --- it registers, installs and passes --------------------------------------------------------------
def test_two_plugins_register_beside_the_cpu_plugin(tmp_path, monkeypatch):
    """Every hook the plugin defines takes the spec's arguments, every required one is there,
    and device names derived from two names do not clash with each other or the CPU's."""
    reg = Registry()
    assert reg.register(cpu_plugin, "cpu") is not None
    for name in ("alpha", "alpha_2"):
        monkeypatch.syspath_prepend(str(generate(name, tmp_path / name)))
        mod = importlib.import_module(f"accelplane_{name}.plugin")
        hooks = {n for n in vars(Specs) if not n.startswith("_") and hasattr(mod, n)}
        assert hooks >= REQUIRED_HOOKS, REQUIRED_HOOKS - hooks
        for h in hooks:
            want = tuple(inspect.signature(getattr(Specs, h)).parameters)[1:]
            assert tuple(inspect.signature(getattr(mod, h)).parameters) == want, h
        assert reg.register(mod, name) is not None, [f.reason for f in reg.failures]
    assert sorted(d.name for d in reg.devices) == ["ALPHA0", "ALPHA_20", "CPU"]
    assert not reg.failures


def test_installed_plugin_passes_its_conformance_run(installed, tmp_path):
    r = conformance(NAME, report=tmp_path / "report.json", ACCELPLANE_PLUGINS=f"{NAME},cpu",
                    PYTHONPATH=child_env(installed)["PYTHONPATH"])  # fmt: skip
    assert r.rc == 0, r.output[-3000:]
    doc = r.report
    assert doc["plugin"] == NAME and doc["device"] == DEVICE and doc["exit_reason"] == "passed"
    for op in OPS:
        counts = doc["ops"][op]
        assert counts.get("passed", 0) > 0 and not counts.get("failed"), (op, counts)
    assert doc["ops"]["[interface]"].get("passed", 0) > 0 and not doc["ops"]["[interface]"].get("failed")
    # supports_op is honest: what it declines is "not supported", never a failure
    assert doc["totals"].get("not supported", 0) > 0 and not doc["totals"].get("failed")
    declined = {c["op"] for c in doc["cases"] if c["status"] == "not supported"}
    assert {"SILU", "SOFT_MAX", "GET_ROWS"} <= declined


def test_installed_plugin_passes_its_own_tests(generated, installed):
    # cwd holds the plugin's folder, not its package: the tests import the installed copy
    rc, out = run([sys.executable, "-m", "pytest", str(generated / "tests"), "-q", "-p", "no:cacheprovider"],
                  cwd=generated.parent, env=child_env(installed))  # fmt: skip
    assert rc == 0 and " passed" in out and "failed" not in out, out


@pytest.mark.tox
def test_tox_envs_pass_with_the_sdk_from_a_wheel(tmp_path):
    """tox as a plugin author runs it: fresh environments, accelplane from PIP_FIND_LINKS (a
    wheel of this tree), lint, the plugin's tests, its conformance run."""
    tox = shutil.which("tox")
    if tox is None:
        msg = "tox is not installed (pip install 'tox>=4.11')"
        if os.environ.get("CI"):
            pytest.fail(msg + ": CI must run this test")
        pytest.skip(msg)
    src = tmp_path / "sdk-src"  # a copy: building in the tree would leave build/ and egg-info there
    junk = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    shutil.copytree(ROOT / "sdk", src / "sdk", ignore=junk)
    for f in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / f, src / f)
    wheels = tmp_path / "wheels"
    rc, out = run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                   "-w", str(wheels), str(src)], cwd=tmp_path)  # fmt: skip
    assert rc == 0, out
    plugin = generate(NAME, tmp_path / "plugin")
    env = {k: v for k, v in child_env().items() if k != "PYTHONPATH"}
    rc, out = run([tox, "-q"], cwd=plugin, env={**env, "PIP_FIND_LINKS": str(wheels)}, timeout=600)
    assert rc == 0, out[-4000:]
    assert (plugin / ".tox" / "py" / "tmp" / f"conformance-{NAME}.json").is_file()


# --- user errors -------------------------------------------------------------------------------------
def one_line(capsys, argv: list[str], *parts: str) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("accelplane: error: "), err
    for p in parts:
        assert p in lines[0], (p, lines[0])


@pytest.mark.parametrize("name", ["My-Vendor", "myVendor", "1abc", "_abc", "ab-c", "a.b", "ÿ", "a b",
                                  "a" * (newplugin.MAX_NAME + 1), ""])  # fmt: skip
def test_bad_name_is_a_one_line_error(capsys, tmp_path, name):
    one_line(capsys, ["new-plugin", name, str(tmp_path / "p")], "is not a plugin name")
    assert not (tmp_path / "p").exists()


def test_installed_plugin_name_is_refused(capsys, tmp_path):
    one_line(capsys, ["new-plugin", "cpu", str(tmp_path / "p")], "'cpu' is installed already")
    assert not (tmp_path / "p").exists()


def test_existing_non_empty_dir_is_refused(capsys, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    one_line(capsys, ["new-plugin", "ok", str(tmp_path)], "exists and is not empty")
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("kind", ["file", "under-a-file", "nul", "empty", "too-long"])
def test_bad_dir_is_a_one_line_error(capsys, tmp_path, kind):
    f = tmp_path / "f"
    f.write_text("x")
    where = {"file": str(f), "under-a-file": str(f / "sub"), "nul": "a\0b", "empty": "",
             "too-long": str(tmp_path / ("d" * 300))}[kind]  # fmt: skip
    one_line(capsys, ["new-plugin", "ok", where], "new-plugin: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_empty_dir_and_default_dir_are_written(capsys, tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    assert main(["new-plugin", "ok", str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty" / "accelplane_ok" / "plugin.py").is_file()
    monkeypatch.chdir(tmp_path)
    assert main(["new-plugin", "ok_two"]) == 0
    assert (tmp_path / "accelplane-ok-two" / "accelplane_ok_two" / "plugin.py").is_file()
    out = capsys.readouterr().out
    assert "device OK_TWO0" in out and "accelplane conformance ok_two" in out
