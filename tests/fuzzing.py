"""The shared fuzz switch: ``ACCELPLANE_FUZZ=long`` runs the property-based and fuzz tests at
their long example counts (tox -e fuzz), else at a CI-sized count (accelplane.env.FUZZ)."""

from accelplane import env


def examples(ci: int, long: int) -> int:
    """``long`` under ACCELPLANE_FUZZ=long, else ``ci``."""
    return long if env.FUZZ.get() == "long" else ci
