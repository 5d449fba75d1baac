"""``accelplane conformance`` in a subprocess with a controlled environment, for the tests of
the suite itself (test_suite_catches_bugs.py, test_conformance_exit.py).

The child sees no ACCELPLANE_* variable of this process, only those given; tests/ is on its
PYTHONPATH, so ``ACCELPLANE_EXTRA_PLUGINS=faulty_tail=faulty.tail`` loads a plugin of
tests/faulty/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent
TIMEOUT_S = 300


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str
    report: dict | None  # the JSON report, when one was written

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def last_line(self) -> str:
        """The last non-empty line of stdout: the verdict."""
        lines = [x for x in self.stdout.splitlines() if x.strip()]
        return lines[-1] if lines else ""


def conformance(plugin: str, *args: str, report: Path | None = None, **env: str) -> Result:
    """``accelplane conformance PLUGIN ARGS...`` (``--json REPORT`` when given) with the
    ACCELPLANE_* variables ``env`` and no others."""
    e = {n: v for n, v in os.environ.items() if not n.startswith("ACCELPLANE_")}
    e["PYTHONPATH"] = os.pathsep.join([str(TESTS), *filter(None, [e.get("PYTHONPATH")])])
    e.update(env)
    cmd = [sys.executable, "-m", "accelplane.cli", "conformance", plugin, *args]
    if report is not None:
        cmd += ["--json", str(report)]
    p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=TESTS)
    doc = json.loads(report.read_text()) if report is not None and report.exists() else None
    return Result(p.returncode, p.stdout, p.stderr, doc)
