"""The conformance suite catches bugs, and fails exactly where it should.

Each faulty plugin in tests/faulty/ is a reference plugin (the CPU plugin or the asynchronous
test device) with one behaviour broken. For each, the suite runs in a subprocess
(``python -m accelplane.cli conformance NAME --json FILE``, the plugin loaded through
ACCELPLANE_EXTRA_PLUGINS) and the JSON report must show failures on exactly the cases the
fault touches: every one of them fails, and nothing else does. The reference plugins
themselves pass the whole suite, and an expected-failures file turns failures into xfails
(test_conformance_exit.py: the exit statuses, strict and stale entries).

The ordering faults (event_wait, cpy_tensor_async) are races: their runs raise the
asynchronous device's random queue delays (ACCELPLANE_TEST_DELAY_US) so that the dependent
work runs too early in practically every one of the suite's 12 repeats.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from accelplane.conformance.cases import all_cases
from accelplane.core.graph import Context
from suite_run import conformance

ASYNCTEST = "asynctest=accelplane.testing.asyncdev"
ORDERING_DELAY_US = 2000  # max random delay per queued task for the ordering-fault runs


def _op_cases() -> dict[str, tuple]:
    """report id → (case, ne of its output node)."""
    out = {}
    for c in all_cases():
        ctx = Context(c.id)
        out[f"test_op[{c.id}]"] = (c, tuple(c.build(ctx).ne))
    return out


OP_CASES = _op_cases()


@dataclass
class Run:
    rc: int
    output: str
    report: dict

    @property
    def status(self) -> dict[str, str]:
        return {c["id"]: c["status"] for c in self.report["cases"]}

    def with_status(self, status: str) -> set[str]:
        return {i for i, s in self.status.items() if s == status}

    @property
    def failed(self) -> set[str]:
        return self.with_status("failed")


_RUNS: dict[tuple, Run] = {}


def run_suite(plugin: str, module: str | None, tmp: Path, *, k: str | None = None,
              xfails: str | None = None, delay_us: int | None = None) -> Run:  # fmt: skip
    """The conformance suite on ``plugin`` (loaded from ``module``, a ``name=module.path``
    entry, when it is not an installed distribution), in a subprocess; cached per arguments."""
    key = (plugin, module, k, xfails, delay_us)
    if key in _RUNS:
        return _RUNS[key]
    tag = f"{plugin}-{len(_RUNS)}"
    env = {}
    if module:
        env["ACCELPLANE_EXTRA_PLUGINS"] = module
    if delay_us is not None:
        env["ACCELPLANE_TEST_DELAY_US"] = str(delay_us)
    args = ["-k", k] if k else []
    if xfails is not None:
        path = tmp / f"{tag}.xfails"
        path.write_text(xfails)
        args += ["--xfails", str(path)]
    r = conformance(plugin, *args, report=tmp / f"{tag}.json", **env)
    assert r.report is not None, f"no JSON report from {plugin} {args} (rc {r.rc}):\n{r.output[-4000:]}"
    run = Run(r.rc, r.output, r.report)
    assert run.report["plugin"] == plugin and run.report["device"], run.report
    _RUNS[key] = run
    return run


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("suite_runs")


def _show(ids) -> str:
    return "\n  ".join(sorted(ids)[:20]) + ("\n  …" if len(ids) > 20 else "")


def assert_fails_exactly(run: Run, expected: set[str], full: bool = True) -> None:
    """Every id in ``expected`` failed and nothing else did; with ``full``, the report
    covers every op case (the run was not cut short)."""
    assert expected, "the fault touches no case: the expectation is wrong"
    if full:
        missing = set(OP_CASES) - set(run.status)
        assert not missing, f"op cases absent from the report:\n  {_show(missing)}"
    uncaught = expected - run.failed
    assert not uncaught, f"the suite did not catch the fault in:\n  {_show(uncaught)}"
    extra = run.failed - expected
    assert not extra, f"cases failed that the fault does not touch:\n  {_show(extra)}"
    assert run.rc == 1, f"pytest exit status {run.rc} (expected 1: tests failed)"


def op_ids(pred) -> set[str]:
    return {i for i, (c, ne) in OP_CASES.items() if pred(c, ne)}


# --- the reference plugins pass --------------------------------------------------------------------
def test_cpu_plugin_passes_whole_suite(tmp):
    run = run_suite("cpu", None, tmp)
    assert run.rc == 0 and not run.failed, f"failed:\n  {_show(run.failed)}\n{run.output[-3000:]}"
    assert set(OP_CASES) <= run.with_status("passed"), "the CPU plugin supports and passes every op case"
    assert set(run.status) == run.with_status("passed") | run.with_status("skipped")


def test_asyncdev_passes_whole_suite(tmp):
    run = run_suite("asynctest", ASYNCTEST, tmp)
    assert run.rc == 0 and not run.failed, f"failed:\n  {_show(run.failed)}\n{run.output[-3000:]}"
    assert set(run.status) == run.with_status("passed"), "asynctest runs every case (two devices, comm)"
    assert set(OP_CASES) <= set(run.status)


# --- op faults (CPU plugin based) --------------------------------------------------------------------
def _adds(c, ne) -> bool:
    """Cases with an ADD whose rows have a tail (the residual block's sum included)."""
    return c.op in ("ADD", "ADD_RMS_NORM_MUL") and ne[0] > 1


def test_faulty_tail_fails_exactly_the_add_cases(tmp):
    run = run_suite("faulty_tail", "faulty_tail=faulty.tail", tmp)
    expected = op_ids(_adds)
    assert len(expected) == 36 + 2 + 8  # ADD cases, the residual blocks, the extreme views
    # the SDK's all-reduce adds partials with ADD graphs on the plugin: the fault shows there too
    comm = {f"test_comm_allreduce[{n}-{a}]" for n in (2, 3, 4) for a in ("auto", "butterfly", "ring")}
    assert_fails_exactly(run, expected | comm)
    # rows of one element have no tail: those ADD cases pass
    assert op_ids(lambda c, ne: c.op == "ADD" and ne[0] == 1) <= run.with_status("passed")


def test_faulty_oob_fails_exactly_the_mul_cases(tmp):
    """One element written past the output: caught by the guard bytes for every MUL case,
    including outputs whose size is not a multiple of the buffer alignment, and the norm
    cases that end in a MUL."""
    run = run_suite("faulty_oob", "faulty_oob=faulty.oob", tmp)
    assert_fails_exactly(run, op_ids(lambda c, ne: c.op == "MUL" or c.op.endswith("NORM_MUL")))
    assert "bytes written outside every tensor" in run.output


def test_faulty_round_even_fails_exactly_the_rounds_with_halves(tmp):
    """ROUND with halves to even: caught by every ROUND case whose inputs hold a half (the
    quarter grid and the halves of the suite's init, in cases of 21 elements and more), and
    by nothing else; the magnitudes past int32 hold no half."""
    run = run_suite("faulty_round_even", "faulty_round_even=faulty.round_even", tmp, k="test_op and ROUND")
    rounds = op_ids(lambda c, ne: c.op == "ROUND")
    with_halves = op_ids(lambda c, ne: c.op == "ROUND" and c.params.get("x") != "big" and ne[0] * ne[1] >= 21)
    assert with_halves <= run.failed <= rounds, _show(rounds - run.failed)
    assert run.with_status("passed") == rounds - run.failed and run.rc == 1


def _wrong_desc(c, ne) -> bool:
    return c.op == "ARGSORT" and c.params["order"] == "DESC" and ne[0] > 1


def test_faulty_supports_fails_exactly_the_wrong_argsorts(tmp):
    run = run_suite("faulty_supports", "faulty_supports=faulty.supports", tmp)
    assert_fails_exactly(run, op_ids(_wrong_desc))


def test_honest_supports_reports_not_supported_never_failed(tmp):
    """The same wrong kernel behind a supports_op that says no: "not supported", no failure."""
    run = run_suite("honest_supports", "honest_supports=faulty.honest_supports", tmp, k="test_op and ARGSORT")
    declined = op_ids(lambda c, ne: c.op == "ARGSORT" and c.params["order"] == "DESC")
    assert run.rc == 0 and not run.failed, run.output[-3000:]
    assert run.with_status("not supported") == declined
    assert run.with_status("passed") == op_ids(lambda c, ne: c.op == "ARGSORT") - declined


# --- interface faults (asynchronous test device based) -------------------------------------------------
def test_faulty_event_fails_exactly_the_event_wait_cases(tmp):
    run = run_suite("faulty_event", "faulty_event=faulty.event", tmp, delay_us=ORDERING_DELAY_US)
    # (the timeline case orders its second stream by an event too)
    assert_fails_exactly(run, {"test_event_record_wait_two_streams", "test_event_across_devices",
                               "test_timeline_notes_copies_and_computes"})  # fmt: skip


def test_faulty_cpy_fails_exactly_the_cpy_tensor_async_cases(tmp):
    run = run_suite("faulty_cpy", "faulty_cpy=faulty.cpy", tmp, delay_us=ORDERING_DELAY_US)
    expected = {"test_cpy_tensor_async_two_streams", "test_cpy_tensor_async_two_devices",
                "test_cpy_from_host_buffer"}  # fmt: skip
    # the SDK's butterfly and ring move partials with the plugin's cpy_tensor_async
    expected |= {f"test_comm_allreduce[{n}-{a}]" for n in (2, 3, 4) for a in ("butterfly", "ring")}
    assert_fails_exactly(run, expected)


def test_faulty_comm_fails_exactly_the_allreduce_cases(tmp):
    run = run_suite("faulty_comm", "faulty_comm=faulty.comm", tmp)
    # the plugin comm serves "auto"; butterfly and ring are the SDK's own and stay right
    assert_fails_exactly(run, {f"test_comm_allreduce[{n}-auto]" for n in (2, 3, 4)})


# --- expected failures ----------------------------------------------------------------------------------
def test_xfails_file_turns_failures_into_xfails(tmp):
    """Bare names and full node ids (with a path, or only the module) mark the same cases."""
    expected = sorted(op_ids(_adds))
    forms = ("{}", "test_ops.py::{}", "sdk/accelplane/conformance/test_ops.py::{}")
    text = "# faulty_tail's known bugs\n\n" + "".join(
        f"{forms[n % 3].format(i)}: row tail off by one\n" for n, i in enumerate(expected)
    )
    run = run_suite("faulty_tail", "faulty_tail=faulty.tail", tmp, k="test_op and ADD", xfails=text)
    assert run.rc == 0, f"exit status {run.rc}:\n{run.output[-3000:]}"
    assert not run.failed
    assert run.with_status("xfailed") == set(expected)
    assert run.with_status("passed") == op_ids(lambda c, ne: c.op == "ADD" and ne[0] == 1)
    assert run.report["totals"].get("xfailed") == len(expected)
    assert run.report["exit_status"] == 0 and run.report["stale_expected_failures"] == []
