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
        *("--trace-sample", "1"),  # every turn traced: the decomposition below counts them all
        *("--floor-count", "10"),  # samples per floor part: the medians need few, each is a full embedding or hop
        *("--json", str(out), "--workdir", str(tmp_path / "stack"), "--plot", str(tmp_path / "load.png")),
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
            # Some process of the system used CPU for the turns.
            assert sum(row["cpu_ms_per_turn"].values()) > 0 and row["cores_busy"] > 0
            # Every turn was answered: the system's CPU per answered turn is its CPU per turn sent.
            system_cpu = sum(v for k, v in row["cpu_ms_per_turn"].items() if k != "load generator")
            assert row["cpu_ms_per_answered"] == pytest.approx(system_cpu, rel=1e-6)
            assert row["failed"] == row["rejected"] == row["timed_out"] == 0
    assert (
        "memory" in report["mars"][0]["cpu_ms_per_turn"]
        and "postgres" in report["mars"][0]["cpu_ms_per_turn"]
    )

    # The decomposition: every answered turn of each rate cut into segments that add up to the server's
    # share of the overhead, and the steps inside the stages.
    for rate, row, cut in zip((4.0, 8.0), report["mars"], report["decomposition"], strict=True):
        assert cut["rate"] == rate
        assert cut["turns"] == round(rate * 3)  # every turn sent in the window was traced end to end
        # Every stage and hop of the path took time: a span missing or out of place reads 0 or below.
        segments = {name: s["mean_ms"] for name, s in cut["segments"].items()}
        assert all(v > 0 for v in segments.values()), segments
        # The server's overhead (its call minus the model call it timed) lies inside what the client measured
        # for the same turn (the call's whole time minus the upstream's fixed 50 ms), so their medians keep
        # that order; 2 ms for the spans' and the client's clocks rounding apart.
        assert cut["server_overhead"]["p50_ms"] <= row["overhead_p50_ms"] + 2.0
        assert cut["steps"]["memory memory embed-query"] > 0 and cut["steps"]["router router decide"] > 0
        assert cut["steps"]["dispatch dispatch model-call"] >= 50  # the stand-in's fixed latency
    floor = report["floor"]
    parts = ("hop_ms", "embedding_ms", "search_ms", "transaction_ms", "pair_embedding_ms")
    assert all(floor[k] > 0 for k in parts)
    # The stored pair (question and answer) is longer than the question alone: it costs more to embed.
    assert floor["pair_embedding_ms"] > floor["embedding_ms"]
    assert floor["sum_ms"] > 5 * floor["hop_ms"] + floor["pair_embedding_ms"]
    assert (tmp_path / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
