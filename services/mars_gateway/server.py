"""`python -m mars_gateway`: the OpenAI-compatible HTTP gateway (uvicorn serving mars_gateway.app)."""

from __future__ import annotations

import logging
import sys

import uvicorn
from mars import topology
from mars.model_pool import PoolFileError, load_pool
from mars.runtime import configure_logging

from mars_gateway.app import create_app
from mars_gateway.settings import GatewaySettings
from mars_gateway.spec import SPEC

log = logging.getLogger("mars_gateway")


def main() -> None:
    try:  # a misspelt MARS_* name stops the gateway here, naming the one it meant
        SPEC.settings.check_environment(elsewhere=topology.deployable_env_names())
    except ValueError as exc:
        raise SystemExit(f"{SPEC.name}: {exc}") from None
    settings = SPEC.settings()
    assert isinstance(settings, GatewaySettings)
    configure_logging(settings.log_level, SPEC.name)
    try:
        arms = load_pool(settings.model_pool).arms
    except PoolFileError as exc:
        log.error("%s", exc)
        sys.exit(2)
    if settings.metrics_port:
        from mars import metrics
        from mars.telemetry import prometheus_endpoint
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.resources import Resource

        _, reader = prometheus_endpoint(settings.metrics_port, settings.http_host)
        resource = Resource.create({"service.name": f"mars-{SPEC.name}"})
        metrics.bind(MeterProvider(resource=resource, metric_readers=[reader]))
    app = create_app(settings, arms)
    log.info(
        "gateway on http://%s:%d -> ingress %s", settings.http_host, settings.http_port, settings.ingress_addr
    )
    uvicorn.run(
        app,
        host=settings.http_host,
        port=settings.http_port,
        loop="uvloop" if settings.uvloop else "asyncio",
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=5,
    )
