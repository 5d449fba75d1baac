"""How many examples the fuzz tests run: the shared switch ``ACCELPLANE_FUZZ``.

Every fuzz test sizes itself through :func:`examples`, so one variable turns them all from a
CI-sized run into a long one.
"""

from __future__ import annotations

import os


def examples(ci: int, long: int) -> int:
    """Examples for one fuzz test: ``long`` when ``ACCELPLANE_FUZZ=long``, ``ci`` when it is unset
    or empty. This is the one place that reads ``ACCELPLANE_FUZZ``; any other value is an error,
    so a misspelt switch never runs the short suite silently."""
    mode = os.environ.get("ACCELPLANE_FUZZ", "")
    if mode not in ("", "long"):
        raise ValueError(f"ACCELPLANE_FUZZ must be 'long' or unset, got {mode!r}")
    return long if mode == "long" else ci
