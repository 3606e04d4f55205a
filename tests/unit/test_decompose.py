"""The load harness's per-hop decomposition on a synthetic trace: segments that add up to the ingress
call, the model call taken out of dispatch, steps counted on the answer path only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "load-tests"))
import decompose
from decompose import Span


def span(service: str, name: str, start_ms: float, end_ms: float, turn_id: str = "") -> Span:
    return Span(service, name, "t1", start_ms / 1000, end_ms / 1000, turn_id)


def one_turn() -> list[Span]:
    return [
        span("ingress", "ingress SendTurn", 0, 100, "turn-1"),
        span("ingress", "ingress accept", 0, 2),
        span("ingress", "publish mars.turn.received", 3, 5),
        span("state", "state mars.turn.received", 7, 12),
        span("state", "publish mars.turn.state", 10, 11),
        span("memory", "memory mars.turn.state", 14, 40),
        span("memory", "memory embed-query", 15, 22),
        span("memory", "publish mars.turn.view", 30, 32),
        span("router", "router mars.turn.view", 34, 45),
        span("router", "publish mars.turn.routed", 40, 41),
        span("dispatch", "dispatch mars.turn.routed", 43, 110),
        span("dispatch", "dispatch model-call", 44, 94),
        span("dispatch", "publish mars.turn.generated", 95, 96),
        span("ingress", "ingress mars.turn.generated", 97, 98),
        # The learning path, after the answer: not an answer-path step.
        span("memory", "memory mars.turn.generated", 99, 130),
        span("memory", "memory embed-query", 100, 104),
    ]


def test_segments_telescope_to_the_call_minus_the_model() -> None:
    segments, steps, overhead = decompose.turn_segments(one_turn())  # type: ignore[misc]
    assert segments == pytest.approx(
        {
            "ingress accept": 3,
            "hop -> state": 4,
            "state": 3,
            "hop -> memory": 4,
            "memory view": 16,
            "hop -> router": 4,
            "router": 6,
            "hop -> dispatch": 3,
            "dispatch": 52 - 50,
            "hop -> ingress": 2,
            "ingress reply": 3,
        }
    )
    assert overhead == pytest.approx(100 - 50)
    assert sum(segments.values()) == pytest.approx(overhead)
    assert steps["memory memory embed-query"] == pytest.approx(7)  # not the learning path's 4 ms
    assert steps["dispatch dispatch model-call"] == pytest.approx(50)


def test_a_turn_missing_a_stage_is_left_out() -> None:
    spans = [s for s in one_turn() if s.service != "router"]
    assert decompose.turn_segments(spans) is None
    summary = decompose.decompose(spans, since=-1, until=1)
    assert summary["turns"] == 0


def test_decompose_keeps_the_turns_started_in_the_window() -> None:
    summary = decompose.decompose(one_turn(), since=-1, until=1)
    assert summary["turns"] == 1
    assert summary["server_overhead"]["p50_ms"] == pytest.approx(50)
    assert decompose.decompose(one_turn(), since=1, until=2)["turns"] == 0


def test_a_call_that_ended_before_its_answer_is_left_out() -> None:
    # The caller's deadline ran out (the answer came later): no segments for a call that got no answer.
    spans = [s for s in one_turn() if s.name != "ingress SendTurn"]
    spans.append(span("ingress", "ingress SendTurn", 0, 90, "turn-1"))
    assert decompose.turn_segments(spans) is None


def test_by_window_splits_the_run() -> None:
    rows = decompose.by_window(one_turn(), since=-10.0, until=10.0, window_s=10.0)
    assert [(r["from_s"], r["turns"]) for r in rows] == [(0.0, 0), (10.0, 1)]
    assert rows[1]["p50_ms"] == pytest.approx(50)
