"""The chaos harness's short scenario (load-tests/chaos.py --short): ~100 turns through two replicas of
every service on Apache Kafka while one replica of each service is SIGKILLed, the broker is SIGSTOPped
for 5 s and Postgres restarts. Nothing accepted is lost, nothing is applied twice, no index is stale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import require_kafka, run_harness

pytestmark = [pytest.mark.integration, pytest.mark.resilience]


def test_chaos_short_loses_nothing_and_applies_nothing_twice(tmp_path: Path) -> None:
    require_kafka()
    out = tmp_path / "chaos.json"
    done = run_harness(
        "chaos.py",
        "--scenario",
        "chaos-basic",
        "--short",
        "--json",
        str(out),
        "--workdir",
        str(tmp_path / "stack"),
    )
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["broker"] == "kafka"
    for key in ("lost", "duplicate_updates", "duplicate_records", "stale_indexes"):
        assert report[key] == 0, (key, report[key], done.stdout[-3000:])
    assert done.returncode == 0
    # The faults really happened and the supervisor brought every killed replica back.
    actions = sorted(f["action"] for f in report["faults"])
    assert actions == ["kill"] * 6 + ["restart", "stall"]
    assert report["restarts"] >= 7
    # Most turns were accepted and every accepted one has a final status.
    assert report["accepted"] >= 50
    assert report["answered"] + report["failed"] + report["timeout"] == report["accepted"]
    assert report["answered"] >= report["accepted"] // 2
