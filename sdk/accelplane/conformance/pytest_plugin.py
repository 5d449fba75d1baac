"""The conformance suite as a pytest plugin (registered through the pytest11 entry point).

    pytest --accelplane-plugin NAME [--accelplane-device DEV] [--thorough]
           [--accelplane-xfails FILE] [--accelplane-json FILE] [--accelplane-allow-no-device]
    accelplane conformance NAME [--device DEV] [--json FILE] [-k EXPR] [--thorough]
           [--xfails FILE] [--allow-no-device]

With ``--accelplane-plugin`` and no test paths, pytest collects the suite shipped in this
package.

A run is green only when it proved something. The exit status (whenever it is not 0, the last
line of the output says why; the JSON report records ``exit_status`` and ``exit_reason``):

* 0: every selected case ran and passed, or failed as an expected failure says; with
  ``--accelplane-allow-no-device``, also a plugin that is installed but has no device, reported
  as one line ``skipped: no device: <reason>``. "No device" is what the registry records when
  the plugin's get_devices found none or raised DeviceError (hardware or runtime absent).
* 1: a case failed, or an expected failure passed (strict: the line names the entry to delete).
* 4 (pytest's usage error): the plugin cannot be tested, whatever --allow-no-device says: it is
  not installed (the line names the installed plugins, and the closest name to a misspelt one),
  did not load (the registry's stage and reason: an import error is a broken plugin, not an
  absent device), has no device named ``--accelplane-device``, or has no device and
  ``--accelplane-allow-no-device`` is not given; or the expected failures are wrong: an entry
  that matches no case (the line names the closest case id), a malformed line, a file that
  cannot be read.
* 5 (pytest's "no tests"): no case ran: the selection (``-k``) matches no case, or every
  selected case was skipped or not supported.
* 2, 3: pytest's own (interrupted, internal error).

Expected failures come from the plugin's ``conformance_expected_failures`` hook and from
``--accelplane-xfails`` files: one ``test id: reason`` per line, ``#`` comments. The test id is
the case's pytest name, as the JSON report's ``"id"`` prints it, e.g.
``test_op[MUL_MAT(type_a=q4_0,type_b=f32,m=16,n=1,k=256,bs=[[1,1],[1,1]])]`` or
``test_event_across_devices``. A full node id, ``test_ops.py::test_op[...]`` (any path before
the ``::``), is accepted too: it names the same case, and only in that module. Entries are
strict: an entry whose case passes fails the run, and an entry that matches no collected case
is an error naming the closest real id. (When explicit test paths narrow the collection, an
entry is checked only if its test function was collected; with node ids as paths, not at all.)
"""

from __future__ import annotations

import difflib
import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

from accelplane.conformance import UNTESTABLE

SUITE_DIR = Path(__file__).parent
NOTHING_RAN = int(pytest.ExitCode.NO_TESTS_COLLECTED)  # 5: no case ran
RAN = ("passed", "failed", "xfailed", "xpassed")  # the statuses of a case that ran


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("accelplane", "accelplane conformance suite")
    g.addoption("--accelplane-plugin", default=None, help="plugin (entry-point name) to test")
    g.addoption("--accelplane-device", default=None,
                help="device name of that plugin (default: its first device)")  # fmt: skip
    g.addoption("--accelplane-xfails", action="append", default=[],
                help="expected-failures file: 'test id: reason' per line")  # fmt: skip
    g.addoption("--accelplane-json", default=None, help="write a JSON report here")
    g.addoption("--thorough", action="store_true", default=False,
                help="more random repeats for ordering cases, and the thorough-only cases")  # fmt: skip
    g.addoption("--accelplane-seed", type=int, default=1234, help="random seed of the suite")
    g.addoption("--accelplane-allow-no-device", action="store_true", default=False,
                help="a plugin that is installed but has no device (hardware or runtime absent) "
                     "is 'skipped: no device', exit status 0, not an error")  # fmt: skip


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # `pytest --accelplane-plugin X` with no paths: run the shipped suite
    if any(a == "--accelplane-plugin" or a.startswith("--accelplane-plugin=") for a in args):
        paths = [a for a in args if not a.startswith("-") and os.path.exists(a.split("::")[0])]
        if not paths:
            args.append(str(SUITE_DIR))


# --- the plugin under test ----------------------------------------------------------------------
@dataclass(frozen=True)
class Unavailable:
    """Why the plugin under test cannot be tested; ``no_device``: only because it has no device."""

    reason: str
    no_device: bool = False


def _not_installed(name: str, installed: list[str], why: str = "") -> Unavailable:
    close = difflib.get_close_matches(name, installed, n=1)
    return Unavailable(
        (why or f"plugin {name!r} is not installed (installed: {', '.join(installed) or 'none'})")
        + (f"; did you mean {close[0]!r}?" if close else "")
    )


def _from_failure(f) -> Unavailable:
    """The registry's record of a plugin that failed to load."""
    if f.no_device:
        return Unavailable(f.reason, no_device=True)
    return Unavailable(f"plugin {f.name!r} did not load (at {f.stage}): {f.reason}")


def find_devices(name: str) -> list | Unavailable:
    """The devices of plugin ``name``, or why it has none."""
    import accelplane
    from accelplane.errors import DeviceOpenError, PluginLoadError
    from accelplane.runtime import registry

    try:
        reg = accelplane.get_registry()
    except PluginLoadError as e:  # ACCELPLANE_PLUGINS names a plugin that is broken or missing
        if e.failure is not None and e.failure.name == name:
            return _from_failure(e.failure)
        installed = registry.installed_names()
        if name not in installed:
            return _not_installed(name, installed, f"plugin {name!r} is not installed: {e}")
        return Unavailable(f"the registry did not load: {e}")
    if name in reg.plugins:
        devs = reg.plugins[name].devices
        try:  # the suite proves devices that work: one whose runtime does not open is broken
            for d in devs:
                d.open()
        except DeviceOpenError as e:
            return Unavailable(str(e))
        return devs
    failed = [f for f in reg.failures if f.name == name]
    if failed:
        return _from_failure(failed[0])
    installed = sorted({*registry.installed_names(), *reg.plugins, *(f.name for f in reg.failures)})
    if name in installed:
        env = [f"{v}={os.environ[v]}" for v in ("ACCELPLANE_PLUGINS", "ACCELPLANE_DISABLE_PLUGINS")
               if os.environ.get(v, "").strip()]  # fmt: skip
        return Unavailable(f"plugin {name!r} is installed but not loaded"
                           + (f" ({', '.join(env)})" if env else ""))  # fmt: skip
    return _not_installed(name, installed)


# --- expected failures ----------------------------------------------------------------------------
@dataclass(frozen=True)
class XFail:
    """One expected-failures entry: ``name`` is the bare pytest name of the case, ``module`` the
    test module's file name when the entry is a full node id."""

    name: str
    module: str | None
    reason: str
    source: str  # where the entry is written: FILE:LINE
    entry: str  # the test id as written

    def matches(self, item) -> bool:
        return item.name == self.name and (self.module is None or item.path.name == self.module)


def parse_xfails(text: str, source: str) -> tuple[list[XFail], list[str]]:
    """``test id: reason`` lines (``#`` comments, blank lines ignored) → (entries, problems)."""
    out: list[XFail] = []
    problems: list[str] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        tid, sep, reason = line.partition(": ")  # test ids never contain ": "
        tid = tid.strip()
        path, _, name = tid.rpartition("::")
        if not sep or not name:
            problems.append(f"{source}:{n}: expected 'test id: reason', got {raw!r}")
            continue
        out.append(XFail(name, Path(path).name if path else None, reason.strip(), f"{source}:{n}", tid))
    return out, problems


def _checkable(config: pytest.Config, items) -> set[str] | None:
    """Test functions whose every case was collected (None: all of them, the whole suite)."""
    args = [a for a in config.args if not a.startswith("-")]
    if any("::" in a for a in args):
        return set()
    if any(Path(a).resolve() == SUITE_DIR.resolve() for a in args):
        return None
    return {getattr(i, "originalname", i.name) for i in items}


def _closest(x: XFail, items) -> str:
    if x.module:
        word, ids = f"{x.module}::{x.name}", {f"{i.path.name}::{i.name}" for i in items}
    else:
        word, ids = x.name, {i.name for i in items}
    close = difflib.get_close_matches(word, sorted(ids), n=1, cutoff=0)
    return close[0] if close else "(none collected)"


# --- session state ---------------------------------------------------------------------------------
class SuiteState:
    """Per-session state: the device under test, expected failures, and the verdict."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.plugin_name: str | None = config.getoption("--accelplane-plugin")
        self.device_name: str | None = config.getoption("--accelplane-device")
        self.thorough: bool = config.getoption("--thorough")
        self.seed: int = config.getoption("--accelplane-seed")
        self.allow_no_device: bool = config.getoption("--accelplane-allow-no-device")
        self.xfails: list[XFail] = []
        self.marked: dict[str, XFail] = {}  # case name → the entry that marks it
        self.stale: list[dict] = []  # entries that match no case: entry, source, closest
        self.problems: list[str] = []  # what makes the run untestable besides the plugin
        self.unavailable: Unavailable | None = None
        self.exit_status: int | None = None
        self.exit_reason: str | None = None
        self._device = None
        self._looked = False

    def device(self):
        if not self._looked:
            self._looked = True
            found = (find_devices(self.plugin_name) if self.plugin_name
                     else Unavailable("no plugin selected (--accelplane-plugin NAME)"))  # fmt: skip
            if isinstance(found, Unavailable):
                self.unavailable = found
            elif self.device_name:
                named = [d for d in found if d.name.lower() == self.device_name.lower()]
                if named:
                    self._device = named[0]
                else:
                    self.unavailable = Unavailable(
                        f"plugin {self.plugin_name!r} has no device {self.device_name!r} "
                        f"(its devices: {', '.join(d.name for d in found)})"
                    )
            else:
                self._device = found[0]
        return self._device

    @property
    def skipped(self) -> bool:
        """The plugin has no device, and --accelplane-allow-no-device says that is fine."""
        return self.unavailable is not None and self.unavailable.no_device and self.allow_no_device

    def skip_reason(self) -> str:
        u = self.unavailable
        return "" if u is None else f"no device: {u.reason}" if u.no_device else u.reason

    def conclude(self, session: pytest.Session) -> None:
        """Set the exit status and its reason from the plugin, the expected failures and the
        results (see the module docstring)."""
        counts: dict[str, int] = defaultdict(int)
        for r in _RESULTS:
            counts[r["status"]] += 1
        xpassed = _xpassed()
        untestable, failed = [], []
        u = self.unavailable
        if u is not None and not self.skipped:
            untestable.append(u.reason if not u.no_device else
                              f"plugin {self.plugin_name!r} has no device: {u.reason} (where that is "
                              "expected, --allow-no-device or --accelplane-allow-no-device reports it as "
                              "skipped)")  # fmt: skip
        untestable += self.problems
        if self.stale:
            n = len(self.stale)
            untestable.append(f"{n} expected-failure {'entry matches' if n == 1 else 'entries match'} "
                              "no case: " + "; ".join(f"{s['entry']!r} ({s['source']}; closest: "
                                                      f"{s['closest']!r})" for s in self.stale))  # fmt: skip
        status = int(session.exitstatus)
        n_failed = session.testsfailed - len(xpassed)
        if n_failed > 0:
            failed.append(f"{n_failed} {'case' if n_failed == 1 else 'cases'} failed")
        if xpassed:
            what = ("1 expected failure now passes: delete its entry" if len(xpassed) == 1 else
                    f"{len(xpassed)} expected failures now pass: delete their entries")  # fmt: skip
            failed.append(f"{what} " + ", ".join(f"{self.marked[i].entry!r} ({self.marked[i].source})"
                                                 for i in xpassed))  # fmt: skip
        if untestable:
            self.exit_status, self.exit_reason = UNTESTABLE, "; ".join(untestable + failed)
        elif self.skipped:
            self.exit_status, self.exit_reason = 0, f"skipped: {self.skip_reason()}"
        elif failed or status not in (0, NOTHING_RAN):
            self.exit_status = status or 1
            self.exit_reason = "; ".join(failed) or f"pytest exit status {status}"
        elif not any(counts.get(s) for s in RAN):
            k = self.config.getoption("keyword")
            why = (f"the selection{f' (-k {k!r})' if k else ''} matches no case" if not _RESULTS else
                   f"all {len(_RESULTS)} selected cases were skipped ("
                   + ", ".join(f"{c} {s}" for s, c in sorted(counts.items())) + ")")  # fmt: skip
            self.exit_status, self.exit_reason = NOTHING_RAN, f"no case ran: {why}"
        else:
            self.exit_status, self.exit_reason = 0, "passed"
        session.exitstatus = self.exit_status

    def exit_line(self) -> str | None:
        """The last line of the output: why the run is not green, or that it was skipped."""
        if self.exit_status == 0:
            return self.exit_reason if self.skipped else None
        return f"accelplane conformance: {self.exit_reason}"


_STATE_KEY = pytest.StashKey[SuiteState]()


def state(config: pytest.Config) -> SuiteState:
    return config.stash[_STATE_KEY]


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_STATE_KEY] = SuiteState(config)
    _RESULTS.clear()  # a second pytest.main in one process (accelplane.cli.main) starts afresh
    config.addinivalue_line("markers", "conformance: a case of the accelplane conformance suite")


def _read_xfails(st: SuiteState, dev) -> None:
    for path in st.config.getoption("--accelplane-xfails"):
        try:
            text = Path(path).read_text()
        except OSError as e:
            st.problems.append(f"expected-failures file {path}: {e.strerror or e}")
            continue
        entries, problems = parse_xfails(text, path)
        st.xfails += entries
        st.problems += problems
    f = dev.plugin.fn.get("conformance_expected_failures") if dev is not None else None
    if f is not None:
        source = f"{st.plugin_name}'s conformance_expected_failures"
        try:
            text = f()
        except Exception as e:
            st.problems.append(f"{source} raised {type(e).__name__}: {e}")
            text = None
        entries, problems = parse_xfails(text or "", source)
        st.xfails += entries
        st.problems += problems
    seen: dict[str, str] = {}
    for x in st.xfails:
        key = f"{x.module or ''}::{x.name}"
        if key in seen:
            st.problems.append(f"expected failure {x.entry!r} is listed twice ({seen[key]} and {x.source})")
        seen[key] = x.source


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> bool | None:
    # a plugin that cannot be tested runs nothing; without expected-failures files to check
    # against the cases, there is nothing to collect either
    config = session.config
    st = state(config)
    if (st.plugin_name and st.device() is None and not config.getoption("--accelplane-xfails")
            and not config.option.collectonly):  # fmt: skip
        return True
    return None


# tryfirst: the entries are judged against every collected case, before -k deselects any
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items) -> None:
    st = state(config)
    if not st.plugin_name:
        return
    dev = st.device()
    _read_xfails(st, dev)
    checkable = _checkable(config, items)
    for x in st.xfails:
        hits = [i for i in items if x.matches(i)]
        for item in hits:
            st.marked[item.name] = x
            item.add_marker(pytest.mark.xfail(reason=f"{x.reason} ({x.source})", strict=True))
        if not hits and (checkable is None or x.name.split("[", 1)[0] in checkable):
            st.stale.append({"entry": x.entry, "source": x.source, "closest": _closest(x, items)})
    if st.unavailable is not None and not config.option.collectonly:
        items[:] = []  # nothing to run: the verdict says why, in one line


def pytest_runtest_logreport(report) -> None:
    if report.when != "call" and not (report.when == "setup" and report.skipped):
        return
    props = dict(report.user_properties)
    if "accelplane_op" not in props and "accelplane_kind" not in props:
        return
    status = props.get("accelplane_status")
    if status is None:
        xpass = report.failed and str(report.longrepr).startswith("[XPASS(strict)]")
        status = ("passed" if report.passed else "xpassed" if xpass else "xfailed"
                  if hasattr(report, "wasxfail") else "failed" if report.failed else "skipped")  # fmt: skip
    _RESULTS.append({"id": report.nodeid.split("::")[-1], "kind": props.get("accelplane_kind", "op"),
                     "op": props.get("accelplane_op", ""), "status": status,
                     "error": props.get("accelplane_error")})  # fmt: skip


_RESULTS: list[dict] = []


def _xpassed() -> list[str]:
    """Ids of the cases whose expected failure passed."""
    return [r["id"] for r in _RESULTS if r["status"] == "xpassed"]


def summarize(results: list[dict]) -> dict:
    per_op: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in results:
        key = r["op"] if r["kind"] == "op" else f"[{r['kind']}]"
        per_op[key][r["status"]] += 1
    return {k: dict(v) for k, v in sorted(per_op.items())}


def report(st: SuiteState) -> dict:
    """The JSON report: per-op counts, every case, and the verdict."""
    summ = summarize(_RESULTS)
    tot: dict[str, int] = defaultdict(int)
    for counts in summ.values():
        for c, n in counts.items():
            tot[c] += n
    dev = st.device()
    return {
        "plugin": st.plugin_name,
        "device": dev.name if dev else None,
        "skipped_reason": st.skip_reason() if st.skipped else None,
        "exit_status": st.exit_status,
        "exit_reason": st.exit_reason,
        "xpassed_strict": [{"id": i, "entry": st.marked[i].entry, "source": st.marked[i].source}
                           for i in _xpassed()],  # fmt: skip
        "stale_expected_failures": st.stale,
        "ops": summ,
        "totals": dict(tot),
        "cases": _RESULTS,
    }


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus):
    # outermost wrapper: the verdict is set before the terminal summary, and its line is printed
    # after pytest's own last line
    st = state(session.config)
    if not st.plugin_name or session.config.option.collectonly:
        return (yield)
    st.conclude(session)
    path = session.config.getoption("--accelplane-json")
    if path:
        Path(path).write_text(json.dumps(report(st), indent=1))
    result = yield
    line = st.exit_line()
    if line:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line(line, red=st.exit_status != 0, yellow=st.exit_status == 0, bold=True)
        else:
            print(line, flush=True)
    return result


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    st = state(config)
    if not st.plugin_name or config.option.collectonly:
        return
    tr = terminalreporter
    doc = report(st)
    if st.unavailable is None:  # else nothing ran: the last line says why
        tr.section(f"accelplane conformance: {st.plugin_name} / {st.device().name}")
        cols = ("passed", "failed", "not supported", "xfailed", "xpassed", "skipped")
        tr.write_line(f"{'op':<22}" + "".join(f"{c:>14}" for c in cols))
        for op, counts in doc["ops"].items():
            tr.write_line(f"{op:<22}" + "".join(f"{counts.get(c, 0):>14}" for c in cols))
        tr.write_line(f"{'total':<22}" + "".join(f"{doc['totals'].get(c, 0):>14}" for c in cols))
    if doc["xpassed_strict"]:
        tr.write_line("expected failures that now pass (delete these entries):", red=True)
        for x in doc["xpassed_strict"]:
            tr.write_line(f"  {x['entry']}  ({x['source']})")
    if st.stale:
        tr.write_line("expected-failure entries that match no case:", red=True)
        for s in st.stale:
            tr.write_line(f"  {s['entry']}  ({s['source']}); closest: {s['closest']}")
    for p in st.problems:
        tr.write_line(p, red=True)
    path = config.getoption("--accelplane-json")
    if path:
        tr.write_line(f"JSON report written to {path}")


# --- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def ap_suite(request) -> SuiteState:
    return state(request.config)


@pytest.fixture(scope="session")
def ap_device(ap_suite):
    dev = ap_suite.device()
    if dev is None:
        pytest.skip(ap_suite.skip_reason())
    return dev


@pytest.fixture(scope="session")
def ap_backend(ap_device):
    b = ap_device.new_backend()
    yield b
    b.free()


@pytest.fixture(scope="session")
def ap_devices(ap_suite, ap_device):
    """Every device of the plugin under test (for multi-device cases)."""
    return list(ap_device.plugin.devices)


@pytest.fixture
def ap_rng(ap_suite, request):
    import zlib

    import numpy as np

    return np.random.default_rng([ap_suite.seed, zlib.crc32(request.node.name.encode())])
