"""The shared fuzz switch: ACCELPLANE_FUZZ=long runs property tests at their long example counts."""

import os


def examples(ci: int, long: int) -> int:
    return long if os.environ.get("ACCELPLANE_FUZZ") == "long" else ci
