"""OpenAI chat requests onto MARS turns and MARS replies back, the pure part of the gateway: which message
is the turn, which earlier ones are the conversation, the completion body, and the HTTP status and OpenAI
error type of each gRPC status."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from mars.v1 import services_pb2 as svc

from mars_gateway.openai_api import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    Choice,
    CompletionUsage,
    MarsExtension,
)


class BadRequest(ValueError):
    """The caller's mistake, found before MARS is called: 400 with `param` naming the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


@dataclass(frozen=True)
class HttpError:
    status: int
    type: str
    code: str


#: gRPC status of the ingress -> the gateway's HTTP status and OpenAI error type.
STATUS_MAP: dict[grpc.StatusCode, HttpError] = {
    grpc.StatusCode.INVALID_ARGUMENT: HttpError(400, "invalid_request_error", "invalid_request"),
    grpc.StatusCode.FAILED_PRECONDITION: HttpError(400, "invalid_request_error", "failed_precondition"),
    grpc.StatusCode.OUT_OF_RANGE: HttpError(400, "invalid_request_error", "out_of_range"),
    grpc.StatusCode.UNAUTHENTICATED: HttpError(401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: HttpError(403, "permission_error", "permission_denied"),
    grpc.StatusCode.NOT_FOUND: HttpError(404, "not_found_error", "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: HttpError(409, "invalid_request_error", "already_exists"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: HttpError(429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: HttpError(503, "service_unavailable", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: HttpError(504, "timeout", "deadline_exceeded"),
    grpc.StatusCode.CANCELLED: HttpError(499, "invalid_request_error", "cancelled"),
}
INTERNAL = HttpError(500, "server_error", "internal_error")


def http_error(code: grpc.StatusCode) -> HttpError:
    return STATUS_MAP.get(code, INTERNAL)


#: The ingress's trailing metadata of a budget's refusal (mars_ingress.admission) and the headers they become.
BUDGET_METADATA = "mars-budget"
RATELIMIT_METADATA = "mars-ratelimit-"


def number(value: float) -> str:
    """A limit or what is left of it: 2000, 0.25 (no exponent for the sizes budgets have)."""
    return f"{value:.10g}"


def duration(seconds: float) -> str:
    """A wait as OpenAI's x-ratelimit-reset-* say it: "20ms", "6.5s", "1m30s", "5h0m12s"."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours >= 1:
        return f"{int(hours)}h{int(minutes)}m{text}"
    return f"{int(minutes)}m{text}" if minutes >= 1 else text


def ratelimit_headers(limits: Iterable[svc.RateLimit]) -> dict[str, str]:
    """OpenAI-style x-ratelimit-limit-<unit>, -remaining-<unit>, -reset-<unit> of an answered turn's
    budgets (TurnReply.rate_limits): per unit (tokens, usd), the budget with the least left."""
    tightest: dict[str, svc.RateLimit] = {}
    for limit in limits:
        held = tightest.get(limit.unit)
        if held is None or (limit.remaining, -limit.reset_s) < (held.remaining, -held.reset_s):
            tightest[limit.unit] = limit
    headers: dict[str, str] = {}
    for unit, limit in sorted(tightest.items()):
        headers[f"x-ratelimit-limit-{unit}"] = number(limit.limit)
        headers[f"x-ratelimit-remaining-{unit}"] = number(limit.remaining)
        headers[f"x-ratelimit-reset-{unit}"] = duration(limit.reset_s)
    return headers


def refusal_headers(trailing: Iterable[tuple[str, str | bytes]]) -> dict[str, str]:
    """The headers of a refused call from the ingress's trailing metadata: Retry-After (whole seconds),
    x-mars-budget (the budget that binds) and the x-ratelimit-* figures."""
    headers: dict[str, str] = {}
    for key, raw in trailing:
        value = raw.decode() if isinstance(raw, bytes) else str(raw)
        if key == "retry-after-ms":
            headers["Retry-After"] = str(max(1, -(-int(value) // 1000)))
        elif key == BUDGET_METADATA:
            headers["x-mars-budget"] = value
        elif key.startswith(RATELIMIT_METADATA):
            name = key.removeprefix(RATELIMIT_METADATA)
            headers[f"x-ratelimit-{name}"] = duration(float(value)) if name.startswith("reset-") else value
    return headers


def message_text(message: ChatMessage, where: str) -> str:
    """A message's text: a string, or the text parts of a content list joined (other parts refused)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for i, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise BadRequest(
                f"{where}.content[{i}] is a {part.type!r} part; MARS reads text parts only",
                param=f"{where}.content",
            )
        texts.append(part.text)
    return "\n".join(texts)


#: Where a request names its end user, in the order they are looked at (the first one given wins); an API
#: key scoped to one user (`mars tenant create --user`) names it too, and then a user given here must match.
USER_SOURCES = ("header X-MARS-User", "`user`", "`safety_identifier`", "`metadata.user_id`")
NO_USER = (
    "the end user is missing: name it with the header X-MARS-User, or `user`, `safety_identifier` or "
    "`metadata.user_id` in the body (looked at in that order), or call with an API key scoped to one user "
    "(mars tenant create --user)"
)


def end_user(header: str | None, body: ChatCompletionRequest) -> str:
    """The request's end user, from the first of USER_SOURCES that names one; "" when none does (the
    ingress then takes it from a user-scoped key, or answers that it is missing)."""
    for value in (header, body.user, body.safety_identifier, (body.metadata or {}).get("user_id")):
        if value and value.strip():
            return value
    return ""


def session_of(header: str | None, body: ChatCompletionRequest) -> str:
    """The conversation: header X-MARS-Session, else `metadata.session_id`; "" (the default session)."""
    return header or (body.metadata or {}).get("session_id", "")


@dataclass(frozen=True)
class TurnPlan:
    """What one chat request asks of MARS."""

    text: str
    history: list[svc.RecordedTurn]
    max_tokens: int | None


def plan_turn(body: ChatCompletionRequest, arms: list[str], routed_model: str) -> TurnPlan:
    """The turn (the last message, the user's), the conversation before it as recorded pairs (a user
    message and the assistant's reply after it; consecutive user messages are one turn; system,
    developer and tool messages are not memory), and the answer length. BadRequest for what MARS cannot
    honour."""
    if body.model != routed_model and body.model not in arms:
        raise BadRequest(
            f"model {body.model[:100]!r} does not exist; GET /v1/models lists "
            f"{', '.join([routed_model, *arms])}",
            param="model",
            status=404,
            code="model_not_found",
        )
    if body.model != routed_model:
        raise BadRequest(
            f"model {body.model!r} is one of the arms MARS routes between; send model {routed_model!r} "
            "and MARS chooses the arm for each turn (the reply's model names it)",
            param="model",
        )
    if body.n not in (None, 1):
        raise BadRequest("n must be 1: MARS gives one answer per turn", param="n")
    if body.tools:
        raise BadRequest("tools are not supported by MARS", param="tools")
    last = body.messages[-1]
    where = f"messages[{len(body.messages) - 1}]"
    if last.role != "user":
        raise BadRequest(f"the last message must be the user's turn, not {last.role!r}", param=where)
    text = message_text(last, where)
    if not text.strip():
        raise BadRequest(f"{where}.content is empty", param=f"{where}.content")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    history: list[svc.RecordedTurn] = []
    pending: list[str] = []
    for i, message in enumerate(body.messages[:-1]):
        if message.role == "user":
            piece = message_text(message, f"messages[{i}]")
            if piece.strip():
                pending.append(piece)
        elif message.role == "assistant":
            reply = message_text(message, f"messages[{i}]")
            if pending:  # an assistant message with no user message before it (a greeting) is not memory
                history.append(svc.RecordedTurn(user_text="\n\n".join(pending), assistant_text=reply))
                pending = []
    if pending:
        history.append(svc.RecordedTurn(user_text="\n\n".join(pending)))
    return TurnPlan(text=text, history=history, max_tokens=max_tokens)


def turn_options(plan: TurnPlan, stream: bool) -> dict[str, str]:
    options: dict[str, str] = {}
    if plan.max_tokens is not None:
        options["max_tokens"] = str(plan.max_tokens)
    if stream:
        options["stream"] = "true"
    return options


def finish_reason(reply: svc.TurnReply, max_tokens: int | None) -> str:
    """The finish reason: "length" when the answer used its whole token allowance, "stop" otherwise."""
    used = reply.usage.output_tokens
    return "length" if max_tokens is not None and used >= max_tokens else "stop"


def usage(reply: svc.TurnReply) -> CompletionUsage:
    prompt = int(reply.usage.input_tokens)
    completion = int(reply.usage.output_tokens)
    return CompletionUsage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def extension(reply: svc.TurnReply, history_pairs: int, restart: bool = False) -> MarsExtension:
    state: dict[str, Any] = MessageToDict(reply.state, preserving_proto_field_name=True)
    return MarsExtension(
        turn_id=reply.turn_id,
        seq=reply.seq,
        state=state,
        view_blocks=reply.view_blocks,
        view_tokens=reply.view_tokens,
        cost_usd=reply.cost_usd,
        controller_cost_usd=reply.controller_cost_usd,
        latency_ms=reply.latency_ms,
        trace_id=reply.trace_id,
        attempts=[MessageToDict(a, preserving_proto_field_name=True) for a in reply.attempts],
        history_pairs=history_pairs,
        restart=restart,
    )


def completion_id(turn_id: str) -> str:
    return f"chatcmpl-{turn_id}"


def completion(reply: svc.TurnReply, plan: TurnPlan, created: int | None = None) -> ChatCompletion:
    return ChatCompletion(
        id=completion_id(reply.turn_id),
        created=int(time.time()) if created is None else created,
        model=reply.model,
        choices=[
            Choice(
                message=AssistantMessage(content=reply.text),
                finish_reason=finish_reason(reply, plan.max_tokens),  # type: ignore[arg-type]
            )
        ],
        usage=usage(reply),
        mars=extension(reply, len(plan.history)),
    )
