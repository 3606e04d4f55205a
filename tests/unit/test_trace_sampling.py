"""Trace sampling (MARS_TRACE_SAMPLE_RATIO): a turn is traced whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path

from mars.config import ServiceSettings
from mars.telemetry import context_from_headers, inject_headers, tracer_provider


def _spans(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_turn_is_traced_whole_or_not_at_all(tmp_path: Path) -> None:
    never = ServiceSettings(trace_dir=str(tmp_path / "a"), trace_sample_ratio=0.0)
    always = ServiceSettings(trace_dir=str(tmp_path / "b"), trace_sample_ratio=1.0)
    root_tracer = tracer_provider("ingress", always).get_tracer("t")
    skip_tracer = tracer_provider("ingress", never).get_tracer("t")
    downstream = tracer_provider("memory", never).get_tracer("t")

    # A turn sampled where it started is traced downstream too, whatever the downstream ratio.
    with root_tracer.start_as_current_span("turn"):
        headers = inject_headers()
    with downstream.start_as_current_span("memory view", context=context_from_headers(headers)) as span:
        assert span.is_recording()
    # A turn left out where it started leaves no span anywhere, and still carries its trace id on.
    with skip_tracer.start_as_current_span("turn") as root:
        assert not root.is_recording()
        headers = inject_headers()
        trace_id = root.get_span_context().trace_id
    with downstream.start_as_current_span("memory view", context=context_from_headers(headers)) as span:
        assert not span.is_recording()
        assert span.get_span_context().trace_id == trace_id
    assert [s["name"] for s in _spans(tmp_path / "a" / "memory.jsonl")] == ["memory view"]
    assert [s["name"] for s in _spans(tmp_path / "b" / "ingress.jsonl")] == ["turn"]
    assert _spans(tmp_path / "a" / "ingress.jsonl") == []


def test_the_ratio_is_a_share() -> None:
    import pydantic
    import pytest

    with pytest.raises(pydantic.ValidationError):
        ServiceSettings(trace_sample_ratio=1.5)


def test_without_an_exporter_nothing_is_recorded_and_the_trace_id_goes_on() -> None:
    tracer = tracer_provider("ingress", ServiceSettings()).get_tracer("t")
    with tracer.start_as_current_span("turn") as root:
        assert not root.is_recording()
        trace_id = root.get_span_context().trace_id
        assert root.get_span_context().is_valid  # the reply's trace_id is still there to quote
        headers = inject_headers()
    # A caller's trace (sampled where it came from) is continued, not recorded, here.
    with tracer.start_as_current_span("memory view", context=context_from_headers(headers)) as span:
        assert not span.is_recording() and span.get_span_context().trace_id == trace_id
