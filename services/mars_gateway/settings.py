"""The gateway's settings (`MARS_*` environment variables, or a file named by MARS_ENV_FILE)."""

from __future__ import annotations

from typing import ClassVar

from mars.config import CallerSettings
from mars.tls import ClientTls
from pydantic import Field


class GatewaySettings(CallerSettings):
    """The gateway calls the ingress as any client does: its TLS settings are the caller's (MARS_TLS_CA_FILE,
    MARS_TLS_CLIENT_CERT_FILE / _KEY_FILE, in CallerSettings)."""

    #: Its own settings are read as MARS_GATEWAY_<FIELD> (mars.config.env_name).
    env_section: ClassVar[str] = "GATEWAY"

    #: Where the gateway serves HTTP.
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=8080, ge=0, le=65535)
    #: The gRPC ingress it forwards to.
    ingress_addr: str = "127.0.0.1:50051"
    #: The model pool, for GET /v1/models (the arms); the same file as the router's and dispatch's.
    model_pool: str = "config/models.local.yaml"
    #: How long a completion waits for its answer (the ingress's own bound, MARS_TURN_TIMEOUT_S, also holds).
    turn_timeout_s: float = Field(default=180.0, gt=0)
    #: Largest request body (413 above it). The ingress's text limits apply to what is inside.
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    #: Port of the Prometheus endpoint (GET /metrics on http_host): mars.gateway.requests and
    #: mars.gateway.duration; 0 serves none.
    metrics_port: int = Field(default=0, ge=0, le=65535)
    log_level: str = "INFO"
    #: Serve on uvloop (libuv) rather than asyncio's own loop.
    uvloop: bool = True

    def client_tls(self) -> ClientTls:
        return ClientTls.from_settings(self)
