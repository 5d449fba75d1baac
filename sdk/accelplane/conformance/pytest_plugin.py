"""The conformance suite as a pytest plugin (registered through the pytest11 entry point).

    pytest --accelplane-plugin NAME [--accelplane-device DEV] [--thorough]
           [--accelplane-xfails FILE] [--accelplane-json FILE]
    accelplane conformance NAME [--json FILE] [-k EXPR] [--thorough]

With ``--accelplane-plugin`` and no test paths, pytest collects the suite shipped in this
package. A plugin with no usable device is skipped with "no device: <reason>", never passed.
Expected failures come from the plugin's ``conformance_expected_failures`` hook and from
``--accelplane-xfails`` files: one ``test id: reason`` per line, ``#`` comments; an id that
matches no collected test is reported as stale.
"""

from __future__ import annotations

import json
import os
import warnings
from collections import defaultdict
from pathlib import Path

import pytest

SUITE_DIR = Path(__file__).parent


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


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # `pytest --accelplane-plugin X` with no paths: run the shipped suite
    if any(a == "--accelplane-plugin" or a.startswith("--accelplane-plugin=") for a in args):
        paths = [a for a in args if not a.startswith("-") and os.path.exists(a.split("::")[0])]
        if not paths:
            args.append(str(SUITE_DIR))


class SuiteState:
    """Per-session state: the device under test and the collected results."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.plugin_name: str | None = config.getoption("--accelplane-plugin")
        self.device_name: str | None = config.getoption("--accelplane-device")
        self.thorough: bool = config.getoption("--thorough")
        self.seed: int = config.getoption("--accelplane-seed")
        self.results: list[dict] = []
        self.xfails: dict[str, str] = {}
        self.matched: set[str] = set()
        self._device = None
        self._skip_reason: str | None = None

    def device(self):
        if self._device is None and self._skip_reason is None:
            import accelplane
            from accelplane.errors import AccelplaneError

            if not self.plugin_name:
                self._skip_reason = "no plugin selected (--accelplane-plugin NAME)"
                return None
            try:
                reg = accelplane.get_registry()
                devs = reg.devices_of(self.plugin_name)
                if self.device_name:
                    devs = [d for d in devs if d.name.lower() == self.device_name.lower()]
                    if not devs:
                        raise accelplane.errors.DeviceError(
                            f"plugin {self.plugin_name} has no device {self.device_name}"
                        )
                self._device = devs[0]
            except AccelplaneError as e:
                self._skip_reason = f"no device: {e}"
        return self._device

    def skip_reason(self) -> str:
        return self._skip_reason or ""


_STATE_KEY = pytest.StashKey[SuiteState]()


def state(config: pytest.Config) -> SuiteState:
    return config.stash[_STATE_KEY]


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_STATE_KEY] = SuiteState(config)
    _RESULTS.clear()  # a second pytest.main in one process (accelplane.cli.main) starts afresh
    config.addinivalue_line("markers", "conformance: a case of the accelplane conformance suite")


def parse_xfails(text: str, source: str) -> dict[str, str]:
    """``test id: reason`` lines (``#`` comments, blank lines ignored) → {id: reason}."""
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        tid, sep, reason = line.partition(": ")  # test ids never contain ": "
        if not sep or not tid.strip():
            raise pytest.UsageError(f"{source}:{n}: expected 'test id: reason', got {raw!r}")
        out[tid.strip()] = reason.strip()
    return out


def pytest_collection_modifyitems(session, config, items) -> None:
    st = state(config)
    if not st.plugin_name:
        return
    for path in config.getoption("--accelplane-xfails"):
        st.xfails.update(parse_xfails(Path(path).read_text(), path))
    dev = st.device()
    if dev is not None:
        f = dev.plugin.fn.get("conformance_expected_failures")
        text = f() if f else None
        if text:
            st.xfails.update(parse_xfails(text, f"{st.plugin_name} expected failures"))
    for item in items:
        if item.name in st.xfails:
            st.matched.add(item.name)
            item.add_marker(pytest.mark.xfail(reason=st.xfails[item.name], strict=False))
    stale = sorted(set(st.xfails) - st.matched)
    for tid in stale:
        warnings.warn(f"stale expected failure (no such test): {tid}", stacklevel=1)


def pytest_runtest_logreport(report) -> None:
    if report.when != "call" and not (report.when == "setup" and report.skipped):
        return
    props = dict(report.user_properties)
    if "accelplane_op" not in props and "accelplane_kind" not in props:
        return
    status = props.get("accelplane_status")
    if status is None:
        status = "passed" if report.passed else ("xfailed" if hasattr(report, "wasxfail")
                                                  else "failed" if report.failed else "skipped")
    _RESULTS.append({"id": report.nodeid.split("::")[-1], "kind": props.get("accelplane_kind", "op"),
                     "op": props.get("accelplane_op", ""), "status": status,
                     "error": props.get("accelplane_error")})  # fmt: skip


_RESULTS: list[dict] = []


def summarize(results: list[dict]) -> dict:
    per_op: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in results:
        key = r["op"] if r["kind"] == "op" else f"[{r['kind']}]"
        per_op[key][r["status"]] += 1
    return {k: dict(v) for k, v in sorted(per_op.items())}


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    st = state(config)
    if not st.plugin_name:
        return
    tr = terminalreporter
    dev = st.device()
    tr.section(f"accelplane conformance: {st.plugin_name}"
               + (f" / {dev.name}" if dev else f" ({st.skip_reason()})"))  # fmt: skip
    summ = summarize(_RESULTS)
    cols = ("passed", "failed", "not supported", "xfailed", "skipped")
    tr.write_line(f"{'op':<22}" + "".join(f"{c:>15}" for c in cols))
    tot: dict[str, int] = defaultdict(int)
    for op, counts in summ.items():
        tr.write_line(f"{op:<22}" + "".join(f"{counts.get(c, 0):>15}" for c in cols))
        for c in cols:
            tot[c] += counts.get(c, 0)
    tr.write_line(f"{'total':<22}" + "".join(f"{tot[c]:>15}" for c in cols))
    path = config.getoption("--accelplane-json")
    if path:
        doc = {
            "plugin": st.plugin_name,
            "device": dev.name if dev else None,
            "skipped_reason": st.skip_reason() or None,
            "ops": summ,
            "totals": dict(tot),
            "cases": _RESULTS,
        }
        Path(path).write_text(json.dumps(doc, indent=1))
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
