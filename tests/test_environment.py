"""accelplane.env: every ACCELPLANE_* variable is declared once and parsed strictly, the code
reads none of them behind the parser's back, and the docs list exactly the declared ones."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from accelplane import env
from accelplane.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("sdk", "plugins") for p in (ROOT / d).rglob("*")
           if p.suffix in (".py", ".c", ".h", ".cu", ".cl") and "tests" not in p.parts]  # fmt: skip


def _plugin_tuning() -> None:
    """Import every plugin's settings module, so that their variables are declared."""
    import importlib

    for p in sorted(ROOT.glob("plugins/*/accelplane_*/tuning.py")):
        importlib.import_module(f"{p.parent.name}.tuning")


@pytest.mark.parametrize(("value", "want"), [("1", True), ("0", False), ("TRUE", True), ("off", False),
                                             ("yes", True), ("", True), ("  ", True)])  # fmt: skip
def test_flag(monkeypatch, value, want):
    monkeypatch.setenv("ACCELPLANE_FUSION", value)
    assert env.FUSION.get() is want  # empty or blank: the default


@pytest.mark.parametrize(("var", "bad", "accepts"), [
    ("ACCELPLANE_CHECK_RESULTS", "banana", "expected 1 or 0"),
    ("ACCELPLANE_NTHREADS", "abc", "expected an integer from 1 to 1024"),
    ("ACCELPLANE_NTHREADS", "0", "expected an integer from 1 to 1024"),
    ("ACCELPLANE_CPU_ISA", "bogus", "expected one of auto, avx512, avx2-vnni, avx2, portable"),
    ("ACCELPLANE_SCHED_DEBUG", "3", "expected one of 0, 1, 2"),
    ("ACCELPLANE_MPI_TIMEOUT", "nan", "expected a number >= 0.001"),
    ("ACCELPLANE_MPI_TIMEOUT", "-1", "expected a number >= 0.001"),
    ("ACCELPLANE_PLUGINS", " , ", "expected a comma-separated list of names"),
])  # fmt: skip
def test_a_bad_value_is_a_config_error_naming_it(monkeypatch, var, bad, accepts):
    monkeypatch.setenv(var, bad)
    v = env.declared()[var]
    with pytest.raises(ConfigError) as e:
        v.get()
    msg = str(e.value)
    assert msg.startswith(f"{var}={bad!r}: {accepts}"), msg
    assert v.help in msg
    with pytest.raises(ConfigError):
        env.check()
    assert any(r["name"] == var and r["problem"] for r in env.report())


def test_choice_takes_any_case_and_returns_the_allowed_spelling(monkeypatch):
    monkeypatch.setenv("ACCELPLANE_MODEL_POLICY", "STRICT")
    assert env.MODEL_POLICY.get() == "strict"


def test_settings_dataclass_reads_every_field(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class S:
        fusion: bool = env.field(env.FUSION)
        threads: int | None = env.field(env.NTHREADS)
        other: int = 7  # not a setting

    monkeypatch.setenv("ACCELPLANE_FUSION", "0")
    monkeypatch.setenv("ACCELPLANE_NTHREADS", "3")
    assert env.read(S) == S(False, 3, 7)
    monkeypatch.setenv("ACCELPLANE_NTHREADS", "x")
    with pytest.raises(ConfigError, match="ACCELPLANE_NTHREADS"):
        env.read(S)


def test_declarations_are_unique_and_prefixed():
    with pytest.raises(ValueError, match="declared twice"):
        env.flag("ACCELPLANE_FUSION", False, "another meaning")
    with pytest.raises(ValueError, match="start with ACCELPLANE_"):
        env.flag("FUSION", True, "no prefix")
    assert env.flag("ACCELPLANE_FUSION", True, env.FUSION.help) is env.FUSION  # the same: fine


def test_unknown_variables_are_reported(monkeypatch):
    monkeypatch.setenv("ACCELPLANE_NO_SUCH_THING", "1")
    (row,) = [r for r in env.report() if r["name"] == "ACCELPLANE_NO_SUCH_THING"]
    assert row["problem"] == "no installed component reads this variable"


def test_no_code_reads_an_accelplane_variable_past_the_parser():
    var = r"""\s*f?["']ACCELPLANE_\w*["']"""
    direct = re.compile(rf"(environ\.get\(|getenv\(){var}|environ\[{var}\s*\](?!\s*=[^=])")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in SOURCES if p.name != "env.py"
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if direct.search(line)]  # fmt: skip
    assert not found, f"read ACCELPLANE_* through accelplane.env instead: {found}"


def test_docs_list_exactly_the_declared_variables():
    """README.md lists the SDK's variables, each plugin's README its own."""
    _plugin_tuning()
    named = re.compile(r"`(ACCELPLANE_[A-Z0-9_]+)")
    for owner, doc in [("accelplane", ROOT / "README.md"),
                       *[(p.parent.name, p) for p in ROOT.glob("plugins/*/README.md")]]:  # fmt: skip
        text = doc.read_text()
        listed = set(named.findall(text))
        declared = {n for n, v in env.declared().items() if v.owner == owner}
        if owner == "accelplane":  # the README also names plugins' variables in examples
            listed &= {n for n, v in env.declared().items() if v.owner == "accelplane"}
        assert declared <= listed, f"{doc.relative_to(ROOT)} does not list {sorted(declared - listed)}"
        unknown = {n for n in listed if n not in env.declared()}
        assert not unknown, f"{doc.relative_to(ROOT)} names variables nothing declares: {sorted(unknown)}"
