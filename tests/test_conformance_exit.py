"""``accelplane conformance`` is never a false green.

Each case runs the command in a subprocess (tests/suite_run.py) against a plugin that cannot
be proven (not installed, broken at import or in get_devices, without a device, a device name
that does not exist), a selection that runs nothing, or expected failures that are wrong, and
checks the documented exit status (0 passed or skipped with --allow-no-device, 1 failed, 4 the
plugin or the expected failures are wrong, 5 no case ran) and the one line at the end that
says why. The installed vendor plugins are disabled unless a case needs one, which keeps the
runs short; runs that do run cases select a few with -k.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from accelplane.conformance.cases import all_cases
from suite_run import conformance

UNTESTABLE, NOTHING_RAN = 4, 5
VENDORS = ",".join(ep.name for ep in metadata.entry_points(group="accelplane.plugins") if ep.name != "cpu")
QUIET = {"ACCELPLANE_DISABLE_PLUGINS": VENDORS} if VENDORS else {}
ERROR = "accelplane conformance: "
ONE = "test_op[ADD(type=f32,ne_a=[16,5,4,3],ne_b=[16,5,4,3],perm=None)]"  # passes on the CPU
ONE_K = "test_op and ADD and f32"  # ONE and a dozen cases like it
NORUNTIME = {"ACCELPLANE_EXTRA_PLUGINS": "faulty_noruntime=faulty.noruntime"}
NORUNTIME_WHY = ("DeviceError: no FAKE device: ModuleNotFoundError: "
                 "No module named 'accelplane_fake_vendor_runtime'")  # fmt: skip


def run(plugin: str, *args: str, tmp: Path | None = None, **env: str):
    """The command with the vendor plugins disabled (unless ``env`` says otherwise)."""
    return conformance(plugin, *args, report=tmp / "report.json" if tmp else None, **{**QUIET, **env})


def assert_verdict(r, rc: int, line: str, more: str = "") -> None:
    """Exit status ``rc``, and the last line of the output is ``line`` followed by what the
    regex ``more`` matches (nothing, by default)."""
    assert r.rc == rc, f"exit status {r.rc}, expected {rc}:\n{r.output[-3000:]}"
    assert re.fullmatch(re.escape(line) + more, r.last_line), f"last line: {r.last_line!r}"


# --- the plugin cannot be tested -------------------------------------------------------------------
@pytest.mark.parametrize("allow", [[], ["--allow-no-device"]], ids=["strict", "allow-no-device"])
def test_plugin_not_installed_is_an_error(allow, tmp_path):
    """A typo never goes green, not even with --allow-no-device; the line names what is
    installed, and the near miss."""
    r = run("faulty_tial", *allow, tmp=tmp_path, ACCELPLANE_EXTRA_PLUGINS="faulty_tail=faulty.tail")
    assert_verdict(r, UNTESTABLE, ERROR + "plugin 'faulty_tial' is not installed (installed: ",
                   r".*\bcpu\b.*\bfaulty_tail\b.*\); did you mean 'faulty_tail'\?")  # fmt: skip
    assert r.report["exit_status"] == UNTESTABLE and "not installed" in r.report["exit_reason"]
    assert r.report["cases"] == [] and r.report["device"] is None


def test_plugin_not_installed_without_near_miss():
    r = run("nonexistent_plugin")
    assert_verdict(r, UNTESTABLE, ERROR + "plugin 'nonexistent_plugin' is not installed (installed: ",
                   r"[^;]*\bcpu\b[^;]*\)")  # fmt: skip


def test_allow_list_naming_a_missing_plugin_is_an_error():
    r = run("nosuch", "--allow-no-device", ACCELPLANE_PLUGINS="nosuch")
    assert_verdict(r, UNTESTABLE, ERROR + "plugin 'nosuch' is not installed: ACCELPLANE_PLUGINS names "
                   "nosuch, which no installed distribution provides", ".*")  # fmt: skip


@pytest.mark.parametrize("allow_list", [False, True], ids=["discovered", "ACCELPLANE_PLUGINS"])
def test_plugin_whose_import_fails_is_an_error(allow_list):
    """Broken, not absent hardware: an error even with --allow-no-device."""
    env = {"ACCELPLANE_EXTRA_PLUGINS": "faulty_import=faulty.import_error"}
    if allow_list:
        env["ACCELPLANE_PLUGINS"] = "faulty_import"
    r = run("faulty_import", "--allow-no-device", **env)
    assert_verdict(r, UNTESTABLE, ERROR + "plugin 'faulty_import' did not load (at import): "
                   "ModuleNotFoundError: No module named 'accelplane_fake_vendor_bindings'")  # fmt: skip


def test_get_devices_bug_is_an_error_not_no_device():
    r = run("faulty_devices_bug", "--allow-no-device",
            ACCELPLANE_EXTRA_PLUGINS="faulty_devices_bug=faulty.devices_bug")  # fmt: skip
    assert_verdict(r, UNTESTABLE, ERROR + "plugin 'faulty_devices_bug' did not load (at devices): "
                   "AttributeError: ", ".*")  # fmt: skip


@pytest.mark.parametrize("allow_list", [False, True], ids=["discovered", "ACCELPLANE_PLUGINS"])
def test_no_device_is_an_error_unless_allowed(allow_list, tmp_path):
    env = {**NORUNTIME, **({"ACCELPLANE_PLUGINS": "faulty_noruntime"} if allow_list else {})}
    r = run("faulty_noruntime", **env)
    assert_verdict(r, UNTESTABLE, ERROR + "plugin 'faulty_noruntime' has no device: " + NORUNTIME_WHY,
                   r" \(.*--allow-no-device.*\)")  # fmt: skip
    r = run("faulty_noruntime", "--allow-no-device", tmp=tmp_path, **env)
    assert_verdict(r, 0, "skipped: no device: " + NORUNTIME_WHY)
    rep = r.report
    assert (rep["exit_status"], rep["exit_reason"]) == (0, "skipped: no device: " + NORUNTIME_WHY)
    assert rep["skipped_reason"] == "no device: " + NORUNTIME_WHY and rep["cases"] == []


def test_plugin_that_reports_no_devices_is_no_device():
    """get_devices returning [] (the asynchronous test device with ACCELPLANE_ASYNCDEV_NDEV=0)."""
    env = {"ACCELPLANE_EXTRA_PLUGINS": "asynctest=accelplane.testing.asyncdev",
           "ACCELPLANE_ASYNCDEV_NDEV": "0"}  # fmt: skip
    why = "DeviceError: plugin reports no devices"
    r = run("asynctest", **env)
    assert_verdict(r, UNTESTABLE, ERROR + "plugin 'asynctest' has no device: " + why, ".*")
    assert_verdict(run("asynctest", "--allow-no-device", **env), 0, "skipped: no device: " + why)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None or "cuda" not in VENDORS.split(","),
                    reason="needs the CUDA plugin installed without CuPy (no GPU runtime)")  # fmt: skip
def test_cuda_without_gpu_runtime():
    """The CI leg without a GPU: an error, or skipped with --allow-no-device."""
    env = {"ACCELPLANE_PLUGINS": "cuda", "ACCELPLANE_DISABLE_PLUGINS": ""}
    why = "DeviceError: no CUDA device: CuPy is not installed (pip install cupy-cuda13x)"
    assert_verdict(run("cuda", **env), UNTESTABLE, ERROR + "plugin 'cuda' has no device: " + why, ".*")
    assert_verdict(run("cuda", "--allow-no-device", **env), 0, "skipped: no device: " + why)


def test_device_name_that_does_not_exist_is_an_error():
    r = run("cpu", "--device", "CPU7", "--allow-no-device")
    assert_verdict(r, UNTESTABLE, ERROR + "plugin 'cpu' has no device 'CPU7' (its devices: CPU)")


@pytest.mark.parametrize(("blocked", "why"), [
    ("pytest", "pytest is not installed (install it: python -m pip install 'pytest"),
    ("iniconfig", "pytest does not import (ModuleNotFoundError: import of iniconfig halted; "),
], ids=["pytest", "a dependency of pytest"])  # fmt: skip
def test_without_pytest_the_suite_cannot_run(blocked, why):
    """The suite is a pytest plugin: without an importable pytest, one line with the pip command
    (from the SDK's declared requirement) and "cannot be tested", no traceback."""
    code = (f"import sys; sys.modules[{blocked!r}] = None  # import raises ModuleNotFoundError\n"
            "from accelplane.cli import main; sys.exit(main(['conformance', 'cpu']))")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == UNTESTABLE, p.stdout + p.stderr
    assert p.stderr == "" and len(p.stdout.splitlines()) == 1, p.stdout + p.stderr
    assert p.stdout.startswith(ERROR + "cannot run the suite: " + why), p.stdout


# --- no case ran -------------------------------------------------------------------------------------
def test_selection_that_matches_nothing(tmp_path):
    r = run("cpu", "-k", "NO_SUCH_CASE", tmp=tmp_path)
    assert_verdict(r, NOTHING_RAN, ERROR + "no case ran: the selection (-k 'NO_SUCH_CASE') matches no case")
    assert r.report["exit_status"] == NOTHING_RAN


def test_every_selected_case_skipped():
    # the CPU plugin has one device: the two-device cases skip
    r = run("cpu", "-k", "test_cpy_tensor_async_two_devices or test_event_across_devices")
    assert_verdict(r, NOTHING_RAN, ERROR + "no case ran: all 2 selected cases were skipped (2 skipped)")


def test_every_selected_case_not_supported():
    r = run("honest_supports", "-k", "ARGSORT and DESC",
            ACCELPLANE_EXTRA_PLUGINS="honest_supports=faulty.honest_supports")  # fmt: skip
    n = sum(c.op == "ARGSORT" and c.params["order"] == "DESC" for c in all_cases())
    assert n > 0
    assert_verdict(r, NOTHING_RAN, ERROR + f"no case ran: all {n} selected cases were skipped "
                   f"({n} not supported)")  # fmt: skip


# --- expected failures are strict ----------------------------------------------------------------------
def test_expected_failure_that_passes_fails_the_run(tmp_path):
    xf = tmp_path / "cpu.xfails"
    xf.write_text(f"# known bugs\n{ONE}: thought broken\n")
    r = run("cpu", "-k", ONE_K, "--xfails", str(xf), tmp=tmp_path)
    assert_verdict(r, 1, ERROR + f"1 expected failure now passes: delete its entry {ONE!r} ({xf}:2)")
    assert "expected failures that now pass (delete these entries):" in r.stdout
    assert r.report["xpassed_strict"] == [{"id": ONE, "entry": ONE, "source": f"{xf}:2"}]
    assert {c["id"]: c["status"] for c in r.report["cases"]}[ONE] == "xpassed"
    assert r.report["totals"]["xpassed"] == 1 and r.report["exit_status"] == 1


def test_stale_entry_is_an_error_naming_the_closest_id(tmp_path):
    """An entry that matches no case, even one that -k does not select, names the closest id."""
    typo = ONE.replace("[16,5,4,3],perm", "[16,5,4,9],perm")
    wrong_module = f"test_interface.py::{ONE}"
    xf = tmp_path / "cpu.xfails"
    xf.write_text(f"{typo}: a typo\n{wrong_module}: in another module\n")
    r = run("cpu", "-k", "test_buffer_type_facts", "--xfails", str(xf), tmp=tmp_path)
    assert_verdict(r, UNTESTABLE, ERROR + "2 expected-failure entries match no case: "
                   f"{typo!r} ({xf}:1; closest: {ONE!r}); "
                   f"{wrong_module!r} ({xf}:2; closest: {'test_ops.py::' + ONE!r})")  # fmt: skip
    assert r.report["stale_expected_failures"] == [
        {"entry": typo, "source": f"{xf}:1", "closest": ONE},
        {"entry": wrong_module, "source": f"{xf}:2", "closest": f"test_ops.py::{ONE}"},
    ]


def test_malformed_or_missing_expected_failures_file_is_an_error(tmp_path):
    xf = tmp_path / "bad.xfails"
    xf.write_text(f"{ONE} thought broken\n")
    missing = tmp_path / "missing.xfails"
    r = run("cpu", "-k", "test_buffer_type_facts", "--xfails", str(xf), "--xfails", str(missing))
    assert_verdict(r, UNTESTABLE, ERROR + f"{xf}:1: expected 'test id: reason', got "
                   f"{ONE + ' thought broken'!r}; expected-failures file {missing}: "
                   "No such file or directory")  # fmt: skip


def test_documented_example_ids_are_real_cases():
    """The ids in the docs' example expected-failures file name cases of the suite."""
    from accelplane.conformance import test_interface

    doc = (Path(__file__).parents[1] / "docs" / "writing-a-plugin.md").read_text()
    block = doc.split("### Expected failures", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    ids = [line.partition(": ")[0] for line in block.splitlines() if line and not line.startswith("#")]
    known = {f"test_op[{c.id}]" for c in all_cases()}
    known |= {n for n in dir(test_interface) if n.startswith("test_")}
    assert ids and set(ids) <= known, set(ids) - known
