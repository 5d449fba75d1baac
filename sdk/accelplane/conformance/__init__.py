"""The accelplane conformance suite: one pytest plugin that proves any backend plugin.

Run it with ``accelplane conformance NAME`` or ``pytest --accelplane-plugin NAME``. pytest is a
dependency of the SDK (the suite is a pytest plugin); this module imports nothing of it, so the
command can say in one line what is missing when pytest is not installed.
"""

from __future__ import annotations

import re
from importlib import metadata

# the exit status of a run that cannot prove the plugin (pytest's USAGE_ERROR, which the suite's
# pytest plugin sets): docs/writing-a-plugin.md, "Proving it"
UNTESTABLE = 4


def _pytest_requirement() -> str:
    """The SDK's declared pytest requirement (``pytest>=8``), from the installed metadata."""
    try:
        reqs = metadata.requires("accelplane") or []
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        reqs = []
    for r in reqs:
        spec, _, marker = r.partition(";")  # an extra's requirement has a marker: not ours
        m = re.match(r"\s*([A-Za-z0-9._-]+)", spec)
        if not marker and m and m.group(1).lower() == "pytest":
            return spec.replace(" ", "")
    return "pytest"


def pytest_missing(err: ImportError) -> str:
    """The verdict line of a run whose ``import pytest`` raised ``err``: what is missing and the
    pip command that installs it."""
    req = _pytest_requirement()
    if err.name == "pytest":
        return (f"accelplane conformance: cannot run the suite: pytest is not installed "
                f"(install it: python -m pip install '{req}')")  # fmt: skip
    return (f"accelplane conformance: cannot run the suite: pytest does not import "
            f"({type(err).__name__}: {err}; reinstall it: python -m pip install --force-reinstall '{req}')")
