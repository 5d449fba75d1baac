"""The shared fuzz switch and tally.

``ACCELPLANE_FUZZ=long`` runs the property-based and fuzz tests at their long example counts
(tox -e fuzz), else at a CI-sized count (accelplane.env.FUZZ). Fuzz tests count each case's
outcome in :data:`TALLY`; tests/conftest.py prints the counts at the end of the run.
"""

from collections import Counter, defaultdict

from accelplane import env


def examples(ci: int, long: int) -> int:
    """``long`` under ACCELPLANE_FUZZ=long, else ``ci``."""
    return long if env.FUZZ.get() == "long" else ci


class Tally:
    """Outcomes per harness: ``add("host", "computed = oracle")``."""

    def __init__(self) -> None:
        self.counts: defaultdict[str, Counter] = defaultdict(Counter)

    def add(self, harness: str, outcome: str) -> None:
        self.counts[harness][outcome] += 1

    def lines(self) -> list[str]:
        out = []
        for h, c in sorted(self.counts.items()):
            parts = ", ".join(f"{n} {k}" for k, n in sorted(c.items(), key=lambda x: -x[1]))
            out.append(f"{h}: {sum(c.values())} cases ({parts})")
        return out


TALLY = Tally()
