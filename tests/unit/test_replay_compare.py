"""The side-by-side comparison of `mars replay run` over synthetic traces (no broker needed)."""

from __future__ import annotations

from mars_tools.bench.replay import synthetic_turn
from mars_tools.replay.compare import comparison_rows, model_shares, only
from mars_tools.replay.traces import RawRecord, TraceBuilder


def _traces(first: int, turns: int) -> TraceBuilder:
    builder = TraceBuilder()
    for i in range(first, first + turns):
        for offset, (topic, _, value) in enumerate(synthetic_turn(i)):
            builder.add(RawRecord(topic, 0, i * 6 + offset, 1_000_000 + i * 10 + offset, value))
    return builder


def test_rows_compare_the_same_metrics_for_both_runs() -> None:
    recorded, redriven = _traces(0, 10), _traces(0, 10)
    redriven = only(redriven, list(redriven.traces)[:4])
    rows = {metric: (a, b) for metric, a, b in comparison_rows(recorded, redriven)}
    assert rows["turns"] == ("10", "4") and rows["complete"] == ("10", "4")
    assert rows["share arm-a"] == ("1.00", "1.00")
    assert {"mean reward", "cost USD (generation_controller)", "cost USD (feedback_inclusive)"} <= set(rows)
    assert any(metric.startswith("  scope=") for metric in rows)
    assert model_shares(TraceBuilder()) == {}
