"""Spans never carry an exception's text: a message can quote a user's turn or answer, which the events
carry sealed, and traces leave the deployment (OTLP, files). The exception's type is kept."""

from __future__ import annotations

import pytest
from mars.telemetry import text_free_span
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

SECRET = "my bank PIN is 4321"


def _everything(span: object) -> str:
    """All the text a span exports: its status, attributes and events (with their attributes)."""
    parts = [str(span.status.description), str(dict(span.attributes or {}))]  # type: ignore[attr-defined]
    for event in span.events:  # type: ignore[attr-defined]
        parts += [event.name, str(dict(event.attributes or {}))]
    return " ".join(parts)


def test_an_exception_ending_a_span_is_recorded_by_its_type_only() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with pytest.raises(ValueError, match="PIN"), text_free_span(tracer, "stage step"):
        raise ValueError(f"could not parse {SECRET!r}")
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["exception.type"] == "ValueError"
    assert SECRET not in _everything(span) and "4321" not in _everything(span)


def test_opentelemetrys_default_would_have_exported_the_text() -> None:
    """What the helper is for: the plain API records the message (so the test above can fail)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with pytest.raises(ValueError), tracer.start_as_current_span("plain"):
        raise ValueError(f"could not parse {SECRET!r}")
    (span,) = exporter.get_finished_spans()
    assert SECRET in _everything(span)
