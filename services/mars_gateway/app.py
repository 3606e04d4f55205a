"""The OpenAI-compatible HTTP front door (transport only): each request becomes a call to the gRPC ingress
with the caller's API key, so auth, quotas, validation and the turn's path are the ingress's own; this
module maps bodies, statuses and the token stream (mars_gateway.mapping holds the pure part)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

import grpc
import grpc.aio
from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from mars import metrics
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mars_gateway import mapping
from mars_gateway.openai_api import (
    ROUTED_MODEL,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    ChunkDelta,
    ErrorBody,
    ErrorDetail,
    FeedbackBody,
    FeedbackResult,
    Health,
    Model,
    ModelList,
)
from mars_gateway.settings import GatewaySettings

log = logging.getLogger("mars_gateway")

INGRESS_HEALTH_SERVICE = "mars.v1.Ingress"
#: The gateway's paths: the metrics' route label (any other path counts as "other").
ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/models", "/v1/feedback", "/healthz", "/readyz", "/openapi.json", "/docs"}
)
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": what}
    for code, what in (
        (400, "bad request (OpenAI error format)"),
        (401, "missing, invalid or revoked API key"),
        (403, "the key may not act for this tenant or user"),
        (404, "no such model or turn"),
        (413, "request body too large"),
        (429, "quota or budget exceeded (Retry-After says when to try again; x-mars-budget names a budget)"),
        (503, "MARS is unavailable or no model could answer"),
        (504, "no answer before the deadline"),
    )
}


class GatewayError(Exception):
    """An error response in OpenAI's format."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(error=ErrorDetail(message=message, type=type_, param=param, code=code))
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status, headers=self.headers)


def from_bad_request(exc: mapping.BadRequest) -> GatewayError:
    type_ = "not_found_error" if exc.status == 404 else "invalid_request_error"
    return GatewayError(exc.status, str(exc), type_, exc.code or "invalid_request", exc.param)


def from_rpc(exc: grpc.aio.AioRpcError) -> GatewayError:
    """The ingress's status as OpenAI's error; its message is already written for the caller."""
    err = mapping.http_error(exc.code())
    headers = mapping.refusal_headers(exc.trailing_metadata() or ())
    message = exc.details() or exc.code().name
    param = None
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and message == "user_id is required":
        # The ingress's words are gRPC's field; an OpenAI client has several ways to say who the user is.
        message, param = mapping.NO_USER, "user"
    if err is mapping.INTERNAL:
        log.error("ingress answered %s: %s", exc.code().name, message)
    return GatewayError(err.status, message, err.type, err.code, param=param, headers=headers)


class Edge:
    """What every request passes first: 413 for a body over `limit` bytes (by its Content-Length or, chunked,
    as it arrives), and a Server-Timing header on the response: `gateway` is the time spent here, outside
    the ingress call (`ingress`, when the route made one)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.too_large = GatewayError(
            413,
            f"request body is over the gateway's limit of {limit} bytes",
            "invalid_request_error",
            "request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        too_large = self.too_large
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await too_large.response()(scope, receive, send)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        timing: dict[str, float] = {}
        scope.setdefault("state", {})["timing"] = timing

        async def timed(message: Message) -> None:
            if message["type"] == "http.response.start":
                total = (time.perf_counter() - started) * 1000
                ingress = timing.get("ingress_ms", 0.0)
                value = f"gateway;dur={total - ingress:.2f}"
                if "ingress_ms" in timing:
                    value += f", ingress;dur={ingress:.2f}"
                message["headers"] = [*message.get("headers", []), (b"server-timing", value.encode())]
                path = scope.get("path", "")
                metrics.record_gateway_request(
                    path if path in ROUTES else "other", int(message["status"]), total - ingress
                )
            await send(message)

        try:
            await self.app(scope, limited, timed)
        except _TooLarge:
            await too_large.response()(scope, receive, send)


class _TooLarge(Exception):
    pass


#: W3C trace context headers passed on to the ingress, so the turn's trace continues the caller's.
TRACE_HEADERS = ("traceparent", "tracestate")


def call_metadata(key: str, http: Request) -> tuple[tuple[str, str], ...]:
    """The ingress call's metadata: the caller's API key and its trace context."""
    trace = tuple((h, http.headers[h]) for h in TRACE_HEADERS if h in http.headers)
    return (("authorization", f"Bearer {key}"), *trace)


bearer_scheme = HTTPBearer(auto_error=False, description="a MARS tenant API key (`mars tenant create`)")


async def api_key(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]) -> str:
    if credentials is None or not credentials.credentials:
        raise GatewayError(
            401,
            "missing API key: send the header 'Authorization: Bearer <key>' (a MARS tenant API key)",
            "authentication_error",
            "missing_api_key",
        )
    return credentials.credentials


class Gateway:
    """The ingress channel and pool arms behind the routes."""

    def __init__(self, settings: GatewaySettings, arms: list[str]) -> None:
        self.settings = settings
        self.arms = arms
        self.channel: grpc.aio.Channel | None = None
        self.stub: svc_grpc.IngressStub | None = None

    async def open(self) -> None:
        from mars import tls

        self.channel = tls.aio_channel(self.settings.ingress_addr, self.settings.client_tls())
        self.stub = svc_grpc.IngressStub(self.channel)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()

    def ingress(self) -> svc_grpc.IngressStub:
        assert self.stub is not None, "gateway not started"
        return self.stub

    async def call(self, request: Request, make: Callable[[], Awaitable[Any]]) -> Any:
        """The ingress call `make` makes, its time noted for Server-Timing; its error as OpenAI's."""
        started = time.perf_counter()
        try:
            return await make()
        except grpc.aio.AioRpcError as exc:
            raise from_rpc(exc) from None
        finally:
            timing = getattr(request.state, "timing", None)
            if timing is not None:
                timing["ingress_ms"] = (time.perf_counter() - started) * 1000


def create_app(settings: GatewaySettings, arms: list[str]) -> FastAPI:
    gateway = Gateway(settings, arms)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.open()
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(
        title="MARS OpenAI-compatible gateway",
        version="1.0.0",
        description=(
            "The OpenAI chat API in front of MARS. Send model `mars` and MARS routes each turn to one of the "
            "pool's arms, with a memory view chosen by the session state. The end user is the first given of "
            "the header X-MARS-User, the body's `user`, `safety_identifier` and `metadata.user_id` (or a "
            "user-scoped key); the conversation is the header X-MARS-Session, else `metadata.session_id`. "
            "Completions carry MARS's own fields in `mars`."
        ),
        lifespan=lifespan,
        responses=_ERRORS,
    )
    app.add_middleware(Edge, limit=settings.max_body_bytes)

    _add_error_handlers(app)
    _add_health_routes(app, gateway)
    _add_openai_routes(app, gateway, settings)
    _add_feedback_route(app, gateway)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error body, never a stack trace."""

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(mapping.BadRequest)
    async def _bad_request(_: Request, exc: mapping.BadRequest) -> JSONResponse:
        return from_bad_request(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:] if p != "body") or "body"
        message = f"{where}: {first.get('msg', 'invalid request')}"
        return GatewayError(400, message, "invalid_request_error", "invalid_request", where).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("gateway error")
        return GatewayError(
            500, "internal error in the MARS gateway", "server_error", "internal_error"
        ).response()


def _add_health_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.get("/healthz", response_model=Health, tags=["health"])
    async def healthz() -> Health:
        """The process is up."""
        return Health(status="ok")

    @app.get("/readyz", response_model=Health, tags=["health"], responses={503: {"model": Health}})
    async def readyz() -> Any:
        """Ready when the ingress answers its health check as SERVING."""
        assert gateway.channel is not None
        try:
            resp = await health_pb2_grpc.HealthStub(gateway.channel).Check(
                health_pb2.HealthCheckRequest(service=INGRESS_HEALTH_SERVICE), timeout=2
            )
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return Health(status="ok")
            detail = f"ingress is {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"
        except grpc.aio.AioRpcError as exc:
            detail = f"ingress unreachable: {exc.code().name}"
        return JSONResponse(Health(status="unavailable", detail=detail).model_dump(), status_code=503)


def _add_openai_routes(app: FastAPI, gateway: Gateway, settings: GatewaySettings) -> None:
    @app.get("/v1/models", response_model=ModelList, tags=["openai"])
    async def models(http: Request, key: Annotated[str, Depends(api_key)]) -> ModelList:
        """`mars` (MARS routes each turn) and the pool's arms (the `model` a completion may name). The key
        is checked by the ingress first: the pool is nobody's business without one."""
        metadata = call_metadata(key, http)
        await gateway.call(
            http, lambda: gateway.ingress().WhoAmI(svc.WhoAmIRequest(), metadata=metadata, timeout=10)
        )
        return ModelList(data=[Model(id=ROUTED_MODEL), *(Model(id=a) for a in gateway.arms)])

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletion,
        tags=["openai"],
        responses={
            200: {
                "content": {"text/event-stream": {}},
                "description": "a completion, or with "
                "stream=true the chunks as server-sent events ending in [DONE]",
            }
        },
    )
    async def chat_completions(
        http: Request,
        body: ChatCompletionRequest,
        key: Annotated[str, Depends(api_key)],
        x_mars_user: Annotated[str | None, Header()] = None,
        x_mars_session: Annotated[str | None, Header()] = None,
    ) -> Any:
        """One MARS turn: the last (user) message, with the earlier ones as its conversation."""
        plan = mapping.plan_turn(body, gateway.arms, ROUTED_MODEL)
        request = svc.TurnRequest(
            user_id=mapping.end_user(x_mars_user, body),
            session_id=mapping.session_of(x_mars_session, body),
            text=plan.text,
            options=mapping.turn_options(plan, body.stream),
            history=plan.history,
        )
        metadata = call_metadata(key, http)
        timeout = settings.turn_timeout_s
        if not body.stream:
            reply = await gateway.call(
                http, lambda: gateway.ingress().SendTurn(request, metadata=metadata, timeout=timeout)
            )
            # Serialized by pydantic-core directly: FastAPI's response_model pass (validate, then encode)
            # would double the work for a body built from typed parts.
            return Response(
                mapping.completion(reply, plan).model_dump_json(),
                media_type="application/json",
                headers=mapping.ratelimit_headers(reply.rate_limits),
            )
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        call = gateway.ingress().Converse(iter([request]), metadata=metadata, timeout=timeout)
        stream = call.__aiter__()
        try:  # the first reply (or the error) before the response starts: errors keep their HTTP status
            first = await stream.__anext__()
        except grpc.aio.AioRpcError as exc:
            raise from_rpc(exc) from None
        except StopAsyncIteration:
            raise GatewayError(
                503, "the ingress ended the stream without an answer", "service_unavailable"
            ) from None
        return StreamingResponse(
            _sse(first, stream, plan, include_usage),
            media_type="text/event-stream",
            headers={
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                **mapping.ratelimit_headers(first.rate_limits),
            },
        )


def _add_feedback_route(app: FastAPI, gateway: Gateway) -> None:
    @app.post("/v1/feedback", response_model=FeedbackResult, tags=["mars"])
    async def feedback(
        http: Request,
        body: FeedbackBody,
        key: Annotated[str, Depends(api_key)],
        x_mars_user: Annotated[str | None, Header()] = None,
    ) -> FeedbackResult:
        """Rate an answered turn (its completion's `mars.turn_id`): the router learns from it."""
        if body.rating is None and body.thumbs is None:
            raise GatewayError(
                400, "give rating (0..1) or thumbs (1 or -1)", "invalid_request_error", param="rating"
            )
        request = svc.FeedbackRequest(
            user_id=x_mars_user or body.user or "",
            turn_id=body.turn_id,
            rating=body.rating or 0.0,
            thumbs=body.thumbs or 0,
            comment=body.comment,
        )
        metadata = call_metadata(key, http)
        reply = await gateway.call(
            http, lambda: gateway.ingress().SubmitFeedback(request, metadata=metadata, timeout=30)
        )
        return FeedbackResult(accepted=reply.accepted)


def _event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _sse(
    first: svc.TurnReply,
    rest: AsyncIterator[svc.TurnReply],
    plan: mapping.TurnPlan,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """OpenAI chunks: the role first, a chunk per piece, the finish reason, usage when asked, [DONE].
    A fallback arm's restart is a chunk whose `mars.restart` is true (clients drop what they showed); the
    final reply's text completes whatever pieces did not arrive."""
    created = int(time.time())
    cid = mapping.completion_id(first.turn_id)
    shown = ""

    def chunk(model: str, delta: ChunkDelta, **extra: Any) -> bytes:
        body = ChatCompletionChunk(
            id=cid, created=created, model=model, choices=[ChunkChoice(delta=delta)], **extra
        )
        return _event(body.model_dump(exclude_none=True))

    yield chunk(first.model, ChunkDelta(role="assistant", content=""))
    reply = first
    try:
        while True:
            if reply.partial:
                if reply.restart:
                    shown = ""
                    ext = mapping.extension(reply, len(plan.history), restart=True)
                    yield chunk(reply.model, ChunkDelta(content=""), mars=ext)
                if reply.delta:
                    shown += reply.delta
                    yield chunk(reply.model, ChunkDelta(content=reply.delta))
            else:
                if not reply.text.startswith(shown):
                    ext = mapping.extension(reply, len(plan.history), restart=True)
                    yield chunk(reply.model, ChunkDelta(content=""), mars=ext)
                    shown = ""
                if len(reply.text) > len(shown):
                    yield chunk(reply.model, ChunkDelta(content=reply.text[len(shown) :]))
                final = ChatCompletionChunk(
                    id=cid,
                    created=created,
                    model=reply.model,
                    choices=[
                        ChunkChoice(
                            delta=ChunkDelta(),
                            finish_reason=mapping.finish_reason(reply, plan.max_tokens),  # type: ignore[arg-type]
                        )
                    ],
                    mars=mapping.extension(reply, len(plan.history)),
                )
                yield _event(final.model_dump(exclude_none=True))
                if include_usage:
                    usage = ChatCompletionChunk(
                        id=cid, created=created, model=reply.model, choices=[], usage=mapping.usage(reply)
                    )
                    yield _event(usage.model_dump(exclude_none=True))
                break
            reply = await rest.__anext__()
    except grpc.aio.AioRpcError as exc:
        yield _event(from_rpc(exc).body.model_dump())
    except StopAsyncIteration:
        yield _event(
            ErrorBody(
                error=ErrorDetail(message="the answer stream ended early", type="service_unavailable")
            ).model_dump()
        )
    yield b"data: [DONE]\n\n"
