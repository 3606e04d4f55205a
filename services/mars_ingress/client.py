"""Client side of the ingress: channels that send an API key with every call, and per-tenant keys for the
tools that send as several tenants.

    with ingress_channel("127.0.0.1:50051", api_key) as channel:
        IngressStub(channel).SendTurn(TurnRequest(user_id="u1", text="hi"))   # tenant: the key's

The key travels as gRPC metadata `authorization: Bearer <key>` (see mars.auth). An empty key sends none
(an ingress with MARS_INGRESS_AUTH_REQUIRED=false).

A turn the ingress sheds at its concurrency limit (RESOURCE_EXHAUSTED with the trailer
`grpc-retry-pushback-ms`, mars_ingress.capacity) is sent again by gRPC itself after the server's pushback, up
to `SHED_RETRY_ATTEMPTS` attempts within the call's deadline (gRFC A6 retries, `RETRY_SERVICE_CONFIG`). A quota
refusal carries a pushback of -1 and is not retried: its wait (`retry-after-ms`) is the caller's to decide.
Nothing is written before a turn is admitted, so sending it again is safe. Pass the option
`("grpc.enable_retries", 0)` to see every refusal (a load generator measuring them does).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import grpc.aio
from mars import tls

from mars_ingress.spec import SPEC

Options = Sequence[tuple[str, Any]]

SHED_RETRY_ATTEMPTS = 5  # the most gRPC allows
RETRY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": SPEC.grpc_service, "method": "SendTurn"}],
                "retryPolicy": {
                    "maxAttempts": SHED_RETRY_ATTEMPTS,
                    # Used only when a refusal names no pushback (the ingress's always do).
                    "initialBackoff": "0.2s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["RESOURCE_EXHAUSTED"],
                },
            }
        ]
    }
)


def _channel_options(options: Options | None) -> list[tuple[str, Any]]:
    """`options` with the shed-retry service config, unless the caller brings a service config of its own."""
    out = list(options or ())
    if not any(name == "grpc.service_config" for name, _ in out):
        out.append(("grpc.service_config", RETRY_SERVICE_CONFIG))
    return out


def bearer(api_key: str) -> tuple[tuple[str, str], ...]:
    """The metadata that carries `api_key` (none for an empty key)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _with_key(details: Any, api_key: str) -> Any:
    metadata = list(details.metadata or ())
    metadata.extend(bearer(api_key))
    return details._replace(metadata=metadata)


class _BearerInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, api_key: str) -> None:
        self._key = api_key

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_key(details, self._key), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_key(details, self._key), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(_with_key(details, self._key), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(_with_key(details, self._key), requests)


def ingress_channel(target: str, api_key: str, options: Options | None = None) -> grpc.Channel:
    """A blocking channel to the ingress at `target` that sends `api_key` with every call; over TLS when
    the caller has TLS settings (MARS_TLS_CA_FILE, and a client certificate for mutual TLS: mars.tls)."""
    channel = tls.channel(target, options=_channel_options(options))
    if not api_key:
        return channel
    return grpc.intercept_channel(channel, _BearerInterceptor(api_key))


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, api_key: str) -> None:
        self._key = api_key

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_key(details, self._key), request)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, api_key: str) -> None:
        self._key = api_key

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_key(details, self._key), requests)


def aio_ingress_channel(target: str, api_key: str, options: Options | None = None) -> grpc.aio.Channel:
    """An asyncio channel to the ingress at `target` that sends `api_key` with every call (TLS as above)."""
    interceptors: list[Any] = [_AioUnaryUnary(api_key), _AioStreamStream(api_key)] if api_key else []
    return tls.aio_channel(target, options=_channel_options(options), interceptors=interceptors)


class TenantKeys:
    """An API key per tenant, for tools that send as several tenants (a re-drive, an eval's fresh tenant,
    the harnesses): created on demand in the pipeline's Postgres when `postgres_dsn` is given (as `mars
    tenant create` would), else the one `api_key` for every tenant (the ingress refuses tenants it is not
    for)."""

    def __init__(self, api_key: str = "", postgres_dsn: str = "", label: str = "tool") -> None:
        self._api_key = api_key
        self._dsn = postgres_dsn
        self._label = label
        self._keys: dict[str, str] = {}

    def key(self, tenant: str) -> str:
        if not self._dsn or not tenant:
            return self._api_key
        if tenant not in self._keys:
            from mars.auth import mint_key

            self._keys[tenant] = mint_key(self._dsn, tenant, label=self._label).key
        return self._keys[tenant]


class TenantChannels:
    """One blocking ingress channel per tenant, each with that tenant's key."""

    def __init__(self, target: str, keys: TenantKeys, options: Options | None = None) -> None:
        self._target = target
        self._keys = keys
        self._options = options
        self._channels: dict[str, grpc.Channel] = {}

    def stub(self, tenant: str, make: Callable[[grpc.Channel], Any]) -> Any:
        if tenant not in self._channels:
            self._channels[tenant] = ingress_channel(self._target, self._keys.key(tenant), self._options)
        return make(self._channels[tenant])

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
