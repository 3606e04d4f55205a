"""MARS_METRICS_PORT serves the service's metrics to Prometheus (the chart's ServiceMonitor scrapes it)."""

from __future__ import annotations

import socket

import httpx
from mars.config import ServiceSettings
from mars.telemetry import setup_telemetry


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_metrics_port_serves_prometheus_text() -> None:
    port = _free_port()
    settings = ServiceSettings(metrics_port=port, grpc_host="127.0.0.1", uvloop=False)
    telemetry = setup_telemetry("probe", settings)
    try:
        counter = telemetry.meter_provider.get_meter("mars.test").create_counter("mars.test.turns")
        counter.add(3, {"status": "answered"})
        body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        line = next(ln for ln in body.splitlines() if ln.startswith("mars_test_turns"))
        assert 'status="answered"' in line and line.endswith(" 3.0")
    finally:
        telemetry.shutdown()
    # Shut down means nothing listens there any more (SO_REUSEADDR: the scrape's TIME_WAIT does not count).
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_no_metrics_port_no_server() -> None:
    telemetry = setup_telemetry("probe", ServiceSettings(metrics_port=0, uvloop=False))
    try:
        assert telemetry._metrics_server is None
    finally:
        telemetry.shutdown()
