"""OpenTelemetry setup and W3C trace-context propagation over Kafka headers and gRPC metadata.

Nothing is exported by default; `MARS_OTLP_ENDPOINT` adds an OTLP exporter and `MARS_TRACE_DIR` a
JSON-lines file per service (used by the end-to-end tests to check one trace covers a whole turn).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from mars.config import ServiceSettings

log = logging.getLogger(__name__)


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file."""

    def __init__(self, path: Path, service: str) -> None:
        self._path = path
        self._service = service
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            ctx = span.get_span_context()
            if ctx is None:
                continue
            parent = span.parent
            lines.append(
                json.dumps(
                    {
                        "service": self._service,
                        "name": span.name,
                        "trace_id": format(ctx.trace_id, "032x"),
                        "span_id": format(ctx.span_id, "016x"),
                        "parent_span_id": format(parent.span_id, "016x") if parent else None,
                        "attributes": {k: _jsonable(v) for k, v in (span.attributes or {}).items()},
                        "start_ns": span.start_time,
                        "end_ns": span.end_time,
                    }
                )
            )
        with self._lock, self._path.open("a", encoding="utf-8") as fh:
            for line in lines:
                fh.write(line + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def _jsonable(value: object) -> object:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, Iterable):
        return list(value)
    return str(value)


def setup_tracing(service: str, settings: ServiceSettings) -> TracerProvider:
    """Install a tracer provider for `service` with the exporters the settings ask for."""
    provider = TracerProvider(resource=Resource.create({"service.name": f"mars-{service}"}))
    if settings.trace_dir:
        # Simple (synchronous) processor: spans must be on disk before a test reads them.
        provider.add_span_processor(
            SimpleSpanProcessor(JsonLinesSpanExporter(Path(settings.trace_dir) / f"{service}.jsonl", service))
        )
    if settings.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint)))
    trace.set_tracer_provider(provider)
    return provider


def inject_headers() -> list[tuple[str, bytes]]:
    """Current trace context as Kafka headers."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return [(k, v.encode()) for k, v in carrier.items()]


def context_from_headers(headers: Sequence[tuple[str, bytes]] | None) -> otel_context.Context:
    carrier = {k: v.decode(errors="replace") for k, v in (headers or [])}
    return propagate.extract(carrier)


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    carrier: Mapping[str, str] = {
        k: v if isinstance(v, str) else v.decode(errors="replace") for k, v in (metadata or [])
    }
    return propagate.extract(carrier)


def current_trace_id() -> str:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""
