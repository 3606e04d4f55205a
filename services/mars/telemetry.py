"""OpenTelemetry setup (traces and metrics) and W3C trace-context propagation over Kafka headers and gRPC
metadata.

Nothing is exported by default; `MARS_OTLP_ENDPOINT` adds OTLP exporters for spans and metrics, and
`MARS_TRACE_DIR` a JSON-lines file of spans per service (used by the end-to-end tests to check one trace
covers a whole turn) and one of metric snapshots under `metrics/` (every `MARS_METRICS_INTERVAL_S`).
`MARS_METRICS_PORT` serves them to Prometheus (GET /metrics). The instruments (`mars.turns`,
`mars.stage.duration`, `mars.cost.usd`, ...) are all defined in `mars.metrics`, and bound here to the
service's MeterProvider.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from mars import metrics as mars_metrics
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


@dataclass
class Telemetry:
    """The installed providers; `shutdown` flushes what is pending (a last metric snapshot included)."""

    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    _files: list[IO[str]]
    #: The Prometheus endpoint's HTTP server, when MARS_METRICS_PORT asks for one.
    _metrics_server: Any = None

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()
        for fh in self._files:
            fh.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()


def _one_line(data: MetricsData) -> str:
    return data.to_json(indent=None) + "\n"


def setup_telemetry(service: str, settings: ServiceSettings) -> Telemetry:
    """Install the tracer and meter providers for `service` with the exporters the settings ask for."""
    resource = Resource.create({"service.name": f"mars-{service}"})
    tracer_provider = setup_tracing(service, settings, resource)
    readers: list[MetricReader] = []
    files: list[IO[str]] = []
    interval_ms = settings.metrics_interval_s * 1000
    if settings.trace_dir:
        path = Path(settings.trace_dir) / "metrics" / f"{service}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = path.open("a", encoding="utf-8")
        files.append(fh)
        exporter = ConsoleMetricExporter(out=fh, formatter=_one_line)
        readers.append(PeriodicExportingMetricReader(exporter, export_interval_millis=interval_ms))
    if settings.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        readers.append(
            PeriodicExportingMetricReader(
                OTLPMetricExporter(endpoint=settings.otlp_endpoint), export_interval_millis=interval_ms
            )
        )
    metrics_server = None
    if settings.metrics_port:
        metrics_server, reader = prometheus_endpoint(settings.metrics_port, settings.grpc_host)
        readers.append(reader)
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    metrics.set_meter_provider(meter_provider)
    mars_metrics.bind(meter_provider)
    return Telemetry(tracer_provider, meter_provider, files, metrics_server)


def prometheus_endpoint(port: int, host: str) -> tuple[Any, MetricReader]:
    """GET /metrics on `host:port` (its HTTP server, to shut down) and the reader that feeds it. Pull, not
    push: Prometheus (the chart's ServiceMonitor) scrapes it."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import start_http_server

    server, _ = start_http_server(port, addr=host)
    return server, PrometheusMetricReader()


def setup_tracing(
    service: str, settings: ServiceSettings, resource: Resource | None = None
) -> TracerProvider:
    """Install the tracer provider of `tracer_provider` for `service`."""
    provider = tracer_provider(service, settings, resource)
    trace.set_tracer_provider(provider)
    return provider


def tracer_provider(
    service: str, settings: ServiceSettings, resource: Resource | None = None
) -> TracerProvider:
    """A tracer provider for `service` with the exporters the settings ask for, sampling
    `trace_sample_ratio` of the turns that start here and following the sampled flag of those that arrive.
    Without an exporter nothing is sampled: every span is a non-recording one (recorded SDK spans cost CPU on
    every record and went nowhere), which still carries the turn's trace id (`TurnReply.trace_id`) on."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased

    exporting = bool(settings.trace_dir or settings.otlp_endpoint)
    provider = TracerProvider(
        resource=resource or Resource.create({"service.name": f"mars-{service}"}),
        sampler=ParentBased(TraceIdRatioBased(settings.trace_sample_ratio)) if exporting else ALWAYS_OFF,
    )
    if settings.trace_dir:
        exporter = JsonLinesSpanExporter(Path(settings.trace_dir) / f"{service}.jsonl", service)
        # Simple (synchronous) by default: spans must be on disk before a test reads them. Batched for load
        # runs, where writing each span on the event loop would be part of what is measured.
        provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=500, max_queue_size=65536)
            if settings.trace_batch
            else SimpleSpanProcessor(exporter)
        )
    if settings.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint)))
    return provider


@contextlib.contextmanager
def text_free_span(tracer: trace.Tracer, name: str, **kwargs: Any) -> Iterator[trace.Span]:
    """`tracer.start_as_current_span(name, ...)`, but an exception that ends it is recorded by its type
    alone: OpenTelemetry's default records the exception's message and traceback on the span, and a
    message can quote a user's text (a turn, an answer) that the events carry sealed. Traces leave the
    deployment (OTLP, files); the service log keeps the whole exception."""
    with tracer.start_as_current_span(
        name, record_exception=False, set_status_on_exception=False, **kwargs
    ) as span:
        try:
            yield span
        except BaseException as exc:
            if not isinstance(exc, GeneratorExit):
                span.set_attribute("exception.type", type(exc).__name__)
                span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
            raise


def step(name: str) -> AbstractContextManager[trace.Span]:
    """A child span for one step of a stage (e.g. "memory embed-query"): the load harness's per-hop
    decomposition reads them; without a tracer provider they cost next to nothing."""
    return text_free_span(_steps, name)


_steps = trace.get_tracer("mars.steps")


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
