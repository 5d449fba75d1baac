"""The SDK and every plugin as the artifacts a user installs: an sdist and a wheel each, built by
``python -m build`` (the wheel from the sdist, as an index's builder makes it), then installed into
a fresh venv and proven there with no source tree in sight.

* Every file of a distribution's packages in the source tree (Python modules and the data they
  load at run time: C sources and headers, CUDA, OpenCL and GLSL kernels, the new-plugin
  templates, py.typed) must be in both its sdist and its wheel, the compiled cffi extension in
  the wheel, the license in both; the metadata carries the one version the package declares and
  the SPDX license, a plugin's requirement on the SDK admits the SDK built beside it, and no
  build prints a warning (a setuptools deprecation, a MANIFEST.in pattern matching nothing). The
  expected lists come from the source tree, so a new kernel file is checked without touching
  this test.
* A fresh ``python -m venv`` gets the SDK, the Vulkan and the Hexagon plugins from the built
  wheels, without extras (the plugins' SDK requirement resolves through ``--find-links`` to the
  built SDK wheel); from a temporary directory, without PYTHONPATH, ``accelplane devices`` lists
  them, ``accelplane conformance`` proves the CPU plugin, Vulkan (its shaders compiled into an
  empty cache from the installed files) and Hexagon, each with the whole suite, and
  ``accelplane new-plugin`` writes a plugin from the installed templates.

About 100 s on a 2-core machine (building five projects, most of it the build environment and
the C compiles; installing; three suites), needs PyPI (or its mirror) for the build requirements
and the dependencies.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
JUNK_DIRS = {"__pycache__", "build", "dist"}
# in-place builds of the extensions and byte code: in a source tree, never in a distribution
JUNK_SUFFIXES = (".pyc", ".so", ".pyd", ".dylib")
BUILD_TIMEOUT_S = 600
# a line of build output that warns: build's "WARNING ...", distutils' "warning: ...", or a Python
# warning (SetuptoolsDeprecationWarning: ...); a C compiler's "file.c:1:2: warning:" is not at the start
BUILD_WARNING = re.compile(r"^(?:WARNING|warning:) .*|\b\w+Warning: .*", re.M)
# the plugins the venv installs: Vulkan runs on lavapipe, Hexagon in host C (both light to
# install; SYCL's runtime wheels are hundreds of MB)
VENV_PLUGINS = ("vulkan", "hexagon")


def _junk(name: str) -> bool:
    return name in JUNK_DIRS or name.endswith(".egg-info") or name.endswith(JUNK_SUFFIXES)


def _walk(top: Path) -> list[str]:
    """The files under ``top`` that a distribution is made from (paths relative to it)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if not _junk(d)]
        out += [Path(dirpath, f).relative_to(top).as_posix() for f in filenames if not _junk(f)]
    return out


@dataclass(frozen=True)
class Project:
    """One distribution of the repository, as its pyproject.toml declares it."""

    name: str  # the distribution: accelplane, accelplane-vulkan, ...
    dir: Path  # where its pyproject.toml is
    src: Path  # the folder its top-level package is in
    package: str  # the top-level import package
    plugin: str  # its accelplane.plugins entry-point name
    version: str  # the one version its sources declare
    extensions: tuple[str, ...]  # the cffi extension modules its setup.py builds
    requires_sdk: str | None  # its requirement on the SDK (None: it is the SDK)
    build_requires: tuple[str, ...]  # build-system.requires

    @property
    def norm(self) -> str:
        """The name as wheel and sdist file names spell it."""
        return self.name.replace("-", "_")

    def files(self) -> list[str]:
        """Every file of the package in the source tree (paths relative to ``src``)."""
        return sorted(f"{self.package}/{f}" for f in _walk(self.src / self.package))


def _literal(path: Path, name: str) -> str:
    """The string assigned to ``name`` in ``path`` (read, not imported)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path}: no {name} = '...'")


def _project(d: Path) -> Project:
    cfg = tomllib.loads((d / "pyproject.toml").read_text())
    proj, st = cfg["project"], cfg["tool"]["setuptools"]
    assert "version" not in proj and proj["dynamic"] == ["version"], f"{d}: the version is read from code"
    attr = st["dynamic"]["version"]["attr"]  # module.__version__
    (plugin, entry), = proj["entry-points"]["accelplane.plugins"].items()
    package = entry.split(".")[0]
    src = d / st.get("package-dir", {}).get("", ".")
    mod, var = attr.rsplit(".", 1)
    mod_path = src.joinpath(*mod.split("."))
    version = _literal(mod_path / "__init__.py" if mod_path.is_dir() else mod_path.with_suffix(".py"), var)
    extensions = ()
    if (d / "setup.py").exists():
        mods = re.findall(r'"([^":]+\.py):ffibuilder"', (d / "setup.py").read_text())
        src_of = [re.search(r'set_source\(\s*"([\w.]+)"', (d / m).read_text()) for m in mods]
        extensions = tuple(m.group(1) for m in src_of)
    sdk = [r for r in proj["dependencies"] if Requirement(r).name == "accelplane"]
    return Project(proj["name"], d, src, package, plugin, version, extensions, sdk[0] if sdk else None,
                   tuple(cfg["build-system"]["requires"]))  # fmt: skip


SDK = _project(ROOT)
PLUGINS = {p.plugin: p for p in (_project(d.parent) for d in sorted(ROOT.glob("plugins/*/pyproject.toml")))}
PROJECTS = [SDK, *PLUGINS.values()]


def _run(cmd: list, log: Path, **kw) -> subprocess.CompletedProcess:
    """``cmd`` with its output in ``log``; an assertion with the log's tail when it fails."""
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    log.write_text(f"$ {' '.join(map(str, cmd))}\n{p.stdout}\n{p.stderr}")
    what = " ".join(map(str, cmd[:6]))
    assert p.returncode == 0, f"{what} ... exited {p.returncode}:\n{(p.stdout + p.stderr)[-4000:]}"
    return p


def _copy_sources(project: Project, dest: Path) -> Path:
    """What the project's sdist is made from, without build output or in-place extensions (so
    that neither reaches a distribution by accident, and the source tree is not written)."""
    ignore = shutil.ignore_patterns(*JUNK_DIRS, "*.egg-info", *[f"*{s}" for s in JUNK_SUFFIXES])
    out = dest / project.norm
    if project is SDK:  # the repository's root: only the SDK's part
        out.mkdir(parents=True)
        for f in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE"):
            shutil.copy2(ROOT / f, out / f)
        shutil.copytree(project.src, out / project.src.relative_to(ROOT), ignore=ignore)
    else:
        shutil.copytree(project.dir, out, ignore=ignore)
    return out


def _clean_env() -> dict[str, str]:
    """This process's environment without what would put the source tree or this venv in reach."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("ACCELPLANE_", "PYTHON", "VIRTUAL_ENV"))}


def _fresh_venv(where: Path, log: Path, env: dict[str, str], *requirements: str | Path) -> Path:
    """A new venv at ``where`` with ``requirements`` installed by this interpreter's pip (no pip
    inside it: ensurepip is the slow part of a venv); its python."""
    _run([sys.executable, "-m", "venv", "--without-pip", where], log.with_suffix(".venv.log"), env=env)
    python = where / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-compile",
          "--disable-pip-version-check", *requirements], log, env=env, timeout=BUILD_TIMEOUT_S)  # fmt: skip
    return python


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """{distribution: (sdist, wheel)} of every project, built with ``python -m build`` (the
    wheel from the sdist). One fresh build environment holds ``build`` and the projects' declared
    build requirements, and nothing else (``build`` checks each project's are met in it); it
    stands in for the isolated environment ``build`` makes per build, which costs seconds each
    (test_build_requirements_cover_the_build checks no project relies on another's)."""
    tmp = tmp_path_factory.mktemp("dists")
    out = tmp / "dist"
    env = _clean_env()
    reqs = sorted({r for p in PROJECTS for r in p.build_requires})
    python = _fresh_venv(tmp / "buildenv", tmp / "buildenv.log", env, "build>=1.2", *reqs)

    def build_one(p: Project) -> None:
        src = _copy_sources(p, tmp / "src")
        r = _run([python, "-m", "build", "--no-isolation", "--outdir", out, src], tmp / f"build-{p.norm}.log",
                 timeout=BUILD_TIMEOUT_S, env=env)  # fmt: skip
        # a warning of the build (a SetuptoolsDeprecationWarning for a license table or classifier,
        # which build prints as "WARNING ..."; a MANIFEST.in pattern that matches nothing) is a
        # defect of the project's configuration
        warned = sorted(set(BUILD_WARNING.findall(r.stdout + r.stderr)))
        assert not warned, f"building {p.name} warns: {warned}"

    with ThreadPoolExecutor(2) as pool:  # one compiles while the other packs
        list(pool.map(build_one, PROJECTS))
    built = {}
    for p in PROJECTS:
        sdist = out / f"{p.norm}-{p.version}.tar.gz"
        wheels = sorted(out.glob(f"{p.norm}-{p.version}-*.whl"))
        assert sdist.exists() and len(wheels) == 1, f"{p.name}: built {sorted(x.name for x in out.iterdir())}"
        built[p.name] = (sdist, wheels[0])
    return built


@pytest.mark.parametrize("project", PROJECTS, ids=[p.name for p in PROJECTS])
def test_distributions_hold_every_file_the_package_loads(project: Project, dists):
    sdist, wheel = dists[project.name]
    expected = project.files()
    assert any(f.endswith(".py") for f in expected) and expected  # the walk found the package
    with zipfile.ZipFile(wheel) as z:
        in_wheel = set(z.namelist())
        info = f"{project.norm}-{project.version}.dist-info"
        meta = z.read(f"{info}/METADATA").decode()
    missing = [f for f in expected if f not in in_wheel]
    assert not missing, f"{wheel.name} lacks {missing}"
    for ext in project.extensions:  # the compiled cffi module, one file for every CPython >= 3.11
        stem = ext.replace(".", "/")
        assert f"{stem}.abi3.so" in in_wheel, f"{wheel.name} lacks {stem}.abi3.so"
    if project.extensions:
        assert "-cp311-abi3-" in wheel.name, wheel.name
    else:
        assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    assert f"{info}/licenses/LICENSE" in in_wheel
    with tarfile.open(sdist) as t:
        top = f"{project.norm}-{project.version}/"
        in_sdist = {n.removeprefix(top) for n in t.getnames()}
    rel = project.src.relative_to(project.dir).as_posix()
    prefix = "" if rel == "." else rel + "/"
    missing = [f for f in expected if prefix + f not in in_sdist]
    assert not missing, f"{sdist.name} lacks {missing}"
    assert "LICENSE" in in_sdist and "PKG-INFO" in in_sdist
    assert not [n for n in in_sdist if n.endswith(JUNK_SUFFIXES)], sdist.name
    tests = {f for f in in_sdist if f.startswith("tests/") and not f.endswith("/")}
    if project is SDK:  # its tests need the whole repository (docs, tools, the plugins)
        assert not tests, f"{sdist.name}: {sorted(tests)}"
    else:  # a plugin's run against the installed plugin: all of them, conftest.py too
        want = {f"tests/{f}" for f in _walk(project.dir / "tests")}
        assert want and want == tests, f"{sdist.name}: {sorted(want ^ tests)}"
    headers = dict(ln.split(": ", 1) for ln in meta.split("\n\n", 1)[0].splitlines() if ": " in ln)
    assert headers["Name"] == project.name and headers["Version"] == project.version
    assert headers["License-Expression"] == "MIT"


@pytest.mark.parametrize("plugin", list(PLUGINS), ids=list(PLUGINS))
def test_plugin_requires_an_sdk_that_the_built_one_satisfies(plugin: str):
    req = Requirement(PLUGINS[plugin].requires_sdk or "")
    assert req.name == "accelplane" and req.specifier, f"{plugin}: no versioned requirement on accelplane"
    assert req.specifier.contains(SDK.version), f"{plugin}: {req} excludes the SDK {SDK.version}"


@pytest.mark.parametrize("project", PROJECTS, ids=[p.name for p in PROJECTS])
def test_build_requirements_cover_the_build(project: Project):
    """What the shared build environment of ``dists`` would hide: a project must declare what its
    own build imports (setuptools >= 77 reads the SPDX license; setup.py's cffi_modules need cffi)."""
    names = {Requirement(r).name: Requirement(r).specifier for r in project.build_requires}
    setuptools = names.get("setuptools")
    assert setuptools is not None and setuptools.contains("77") and not setuptools.contains("76.9"), names
    if project.extensions:
        assert "cffi" in names, f"{project.name}: setup.py builds cffi modules; build requires: {names}"


def test_license_files_are_one_text():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License")
    for p in PLUGINS.values():
        assert (p.dir / "LICENSE").read_text() == text, f"{p.dir}/LICENSE differs from LICENSE"


# --- installed from the wheels into a fresh venv -------------------------------------------------
@dataclass
class Venv:
    python: Path
    bin: Path
    cwd: Path  # an empty folder: nothing of the source tree is importable from it
    env: dict[str, str]
    log: Path

    def run(self, *args: str, ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess:
        p = subprocess.run([str(self.bin / args[0]), *args[1:]], capture_output=True, text=True,
                           cwd=self.cwd, env=self.env, timeout=BUILD_TIMEOUT_S)  # fmt: skip
        with self.log.open("a") as f:
            f.write(f"$ {' '.join(args)}  (exit {p.returncode})\n{p.stdout}\n{p.stderr}\n")
        assert p.returncode in ok, f"{' '.join(args)} exited {p.returncode}:\n{(p.stdout + p.stderr)[-4000:]}"
        return p


@pytest.fixture(scope="module")
def venv(dists, tmp_path_factory) -> Venv:
    tmp = tmp_path_factory.mktemp("venv")
    env = _clean_env()
    env["ACCELPLANE_CACHE_DIR"] = str(tmp / "cache")  # kernels compiled from the installed sources
    wheels = [dists[PLUGINS[p].name][1] for p in VENV_PLUGINS]
    # the plugins' wheels only: their requirement on the SDK resolves to the built SDK wheel
    python = _fresh_venv(tmp / "v", tmp / "pip.log", env, "--find-links", wheels[0].parent, *wheels)
    (tmp / "cwd").mkdir()
    return Venv(python, python.parent, tmp / "cwd", env, tmp / "commands.log")


def test_venv_imports_the_installed_packages(venv: Venv):
    code = ("import importlib, importlib.metadata as m, json, sys, sysconfig\n"
            f"pkgs = {[SDK.package, *(PLUGINS[p].package for p in VENV_PLUGINS)]!r}\n"
            "print(json.dumps({'site': [sysconfig.get_paths()[k] for k in ('purelib', 'platlib')],\n"
            "    'path': sys.path, 'files': {p: importlib.import_module(p).__file__ for p in pkgs},\n"
            "    'versions': {d.metadata['Name']: d.version for d in m.distributions()}}))")  # fmt: skip
    got = json.loads(venv.run("python", "-c", code).stdout)
    site = [Path(s) for s in got["site"]]
    assert all(s.is_relative_to(venv.python.parent.parent) for s in site)
    for pkg, f in got["files"].items():
        assert any(Path(f).is_relative_to(s) for s in site), f"{pkg} imported from {f}, not the venv"
    assert not [p for p in got["path"] if p and Path(p).resolve().is_relative_to(ROOT)], got["path"]
    want = {SDK.name: SDK.version, **{PLUGINS[p].name: PLUGINS[p].version for p in VENV_PLUGINS}}
    assert {n: got["versions"].get(n) for n in want} == want
    assert "pytest" in got["versions"]  # the conformance suite's, a dependency of the SDK


def test_venv_devices_lists_the_plugins(venv: Venv):
    doc = json.loads(venv.run("accelplane", "devices", "--json").stdout)
    assert doc["accelplane"] == SDK.version
    loaded = {p["name"]: p["version"] for p in doc["plugins"]}
    broken = [f for f in doc["failures"] if not f["no_device"]]
    assert not broken, broken
    want = {"cpu": SDK.version, **{p: PLUGINS[p].version for p in VENV_PLUGINS}}
    names = set(loaded) | {f["name"] for f in doc["failures"]}
    assert names == set(want), names
    assert loaded == {n: want[n] for n in loaded}
    assert "cpu" in loaded and "hexagon" in loaded  # neither needs hardware nor a system package


def _has_device(plugin: str) -> bool:
    """Whether ``plugin`` has a device in this (the development) environment."""
    import accelplane

    return plugin in accelplane.get_registry().plugins


@pytest.mark.parametrize("plugin", ["cpu", *VENV_PLUGINS])
def test_venv_conformance(venv: Venv, plugin: str, tmp_path):
    """The whole suite, from the installed files alone. Vulkan needs a driver (the plugin's
    system-deps installs Mesa's): where this machine has none, the run must say exactly that."""
    report = tmp_path / "report.json"
    allow = [] if plugin not in PLUGINS or _has_device(plugin) else ["--allow-no-device"]
    venv.run("accelplane", "conformance", plugin, "--json", str(report), *allow)
    doc = json.loads(report.read_text())
    assert doc["exit_status"] == 0, doc["exit_reason"]
    if allow:
        assert doc["skipped_reason"].startswith("no device"), doc
        pytest.skip(f"{plugin}: installed and loaded, no device here ({doc['skipped_reason']})")
    assert doc["exit_reason"] == "passed" and doc["totals"].get("failed", 0) == 0
    assert doc["totals"]["passed"] >= 100, doc["totals"]


def test_venv_new_plugin_writes_from_the_installed_templates(venv: Venv, tmp_path):
    """``accelplane new-plugin`` reads its templates as package data: from the wheel it writes
    the same files, byte for byte, as the source tree's templates render to."""
    from accelplane.cli.newplugin import render

    out = tmp_path / "accelplane-wheeldemo"
    venv.run("accelplane", "new-plugin", "wheeldemo", str(out))
    got = {f: (out / f).read_text(encoding="utf-8") for f in _walk(out)}
    assert got == render("wheeldemo")


def test_venv_conformance_without_pytest_says_what_to_install(venv: Venv):
    """pytest removed from the interpreter's reach: one line naming the pip command with the SDK's
    declared requirement, and the "cannot be tested" status, no traceback."""
    code = ("import sys; sys.modules['pytest'] = None\n"  # `import pytest` raises ModuleNotFoundError
            "from accelplane.cli import main; sys.exit(main(['conformance', 'cpu']))")  # fmt: skip
    p = venv.run("python", "-c", code, ok=(4,))
    req = next(r for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
               if Requirement(r).name == "pytest")  # fmt: skip
    assert p.stdout == ("accelplane conformance: cannot run the suite: pytest is not installed "
                        f"(install it: python -m pip install '{req}')\n"), p.stdout  # fmt: skip
    assert p.stderr == ""
