"""``accelplane bench moe`` on the asynchronous test device (its streams run on threads, so
copies and computes can overlap): both rows, the copies' time and their overlap with the
computes from the device's timeline (Backend.timeline_begin), whole tensors prefetched only
with prefetch on."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_bench_moe_reports_prefetch_and_overlap(tmp_path):
    out = tmp_path / "moe.json"
    env = dict(os.environ, ACCELPLANE_EXTRA_PLUGINS="asynctest=accelplane.testing.asyncdev",
               ACCELPLANE_TEST_DELAY_US="0")  # fmt: skip
    cmd = [sys.executable, "-m", "accelplane.cli", "bench", "moe", "-d", "ASYNC0", "--moe-tokens", "32",
           "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert [row["prefetch"] for row in rows] == [0, 3]
    for row in rows:
        assert row["device"] == "ASYNC0" and row["ms_per_compute"] > 0
        assert row["copy_ms"] > 0 and 0 <= row["overlap_ms"] <= row["copy_ms"], row
        assert 0 < row["expert_MiB"] <= row["expert_MiB_all"]
    assert rows[0]["prefetched"] == 0 and rows[1]["prefetched"] > 0, rows
