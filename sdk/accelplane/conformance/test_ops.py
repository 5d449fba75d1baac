"""Op cases: every op × type × shape of the catalog against the float64 oracle."""

from __future__ import annotations

import pytest

from accelplane.conformance.cases import all_cases
from accelplane.conformance.runner import NOT_SUPPORTED, PASSED, run_op_case

CASES = all_cases()


@pytest.mark.conformance
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op(case, ap_suite, ap_device, ap_backend, ap_rng, record_property):
    if case.thorough_only and not ap_suite.thorough:
        pytest.skip("thorough only")
    record_property("accelplane_op", case.op)
    r = run_op_case(case, ap_device, ap_backend, ap_rng)
    record_property("accelplane_error", r.error)
    if r.status == NOT_SUPPORTED:
        record_property("accelplane_status", "not supported")
        pytest.skip(f"not supported: {r.message}")
    assert r.status == PASSED, r.message
