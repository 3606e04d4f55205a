"""Traces and the replay report from synthetic stage events (no broker needed for the pure parts)."""

from __future__ import annotations

import json
from pathlib import Path

from mars_tools.bench.replay import synthetic_turn
from mars_tools.replay.report import write_report
from mars_tools.replay.traces import RawRecord, TraceBuilder, summarize


def _traces(turns: int) -> TraceBuilder:
    builder = TraceBuilder()
    for i in range(turns):
        for offset, (topic, _, value) in enumerate(synthetic_turn(i)):
            builder.add(RawRecord(topic, 0, i * 6 + offset, 1_000_000 + i * 10 + offset, value))
    return builder


def test_summary_of_complete_traces() -> None:
    builder = _traces(30)
    builder.add(RawRecord("mars.turn.state", 0, 999, 0, b"\x00garbage"))
    s = summarize(builder)
    assert (s["turns"], s["complete"], s["incomplete"], s["failed"]) == (30, 30, {}, 0)
    assert s["records"]["undecodable_records"] == 1
    assert s["cost_usd"]["generator"] == s["cost_usd"]["generation_controller"] > 0
    assert s["stage_latency_ms"]["received->state"]["p50"] == 1.0
    assert s["routing_share"]["scope=LOCAL"] == {"arm-a": 1.0}


def test_report_folder_holds_markdown_and_plots(tmp_path: Path) -> None:
    files = []
    for name in ("baseline", "other"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(json.dumps(t.to_dict()) for t in _traces(40).traces.values()))
        files.append(path)
    written = write_report(files, tmp_path / "report")
    names = {p.name for p in written}
    assert {"report.md", "quality_vs_cost.png", "reward_over_time.png", "routing_share_baseline.png"} <= names
    for p in written:
        assert p.stat().st_size > 0
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| baseline | 40 |" in md and "![quality_vs_cost](quality_vs_cost.png)" in md
