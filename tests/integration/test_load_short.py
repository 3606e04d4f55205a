"""The load harness's short run (a few seconds per rate): MARS and the LiteLLM proxy on the same stand-in
upstream, every row complete and plausible. A check that the harness works, not a speed test."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import run_harness

pytestmark = pytest.mark.integration
KEYS = ("rate", "achieved", "errors", "e2e_p50_ms", "e2e_p99_ms", "overhead_p50_ms", "overhead_p99_ms")


def test_load_short_run_measures_mars_and_litellm(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    done = run_harness(
        "load.py",
        *("--rates", "4,8", "--seconds", "3", "--warmup-s", "1", "--latency-ms", "50"),
        *("--json", str(out), "--workdir", str(tmp_path / "stack")),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    for system in ("mars", "litellm"):
        rows = report[system]
        assert [r["rate"] for r in rows] == [4.0, 8.0]
        for row in rows:
            assert all(k in row and not math.isnan(row[k]) for k in KEYS), row
            assert row["errors"] == 0 and row["achieved"] > 0
            # Every answer waited for the 50 ms upstream, and the overhead is what came on top of it.
            assert row["e2e_p50_ms"] >= 50
            assert 0 < row["overhead_p50_ms"] <= row["overhead_p99_ms"] < row["e2e_p99_ms"]
