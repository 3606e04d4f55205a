"""The gateway's pure part (mars_gateway.mapping): which message is the turn, which earlier ones are the
conversation, the completion body, and how each gRPC status reads over HTTP."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars_gateway import mapping
from mars_gateway.openai_api import ChatCompletion, ChatCompletionRequest

ARMS = ["small", "large"]


def body(*messages: tuple[str, Any], **kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "mars", "messages": [{"role": r, "content": c} for r, c in messages], **kw}
    )


def test_the_last_user_message_is_the_turn_and_earlier_pairs_the_conversation() -> None:
    plan = mapping.plan_turn(
        body(
            ("system", "be brief"),
            ("assistant", "Hello! How can I help?"),  # a greeting before any user message: not memory
            ("user", "Plan 3 days in Kyoto"),
            ("assistant", "Day 1: ..."),
            ("user", "and a tea ceremony"),
            ("user", [{"type": "text", "text": "on day 2"}]),  # consecutive user messages: one turn
            ("assistant", "Added."),
            ("user", "unanswered"),
            ("user", [{"type": "text", "text": "Make day 2"}, {"type": "text", "text": "less busy"}]),
            max_completion_tokens=32,
        ),
        ARMS,
        "mars",
    )
    assert plan.text == "Make day 2\nless busy"
    assert [(t.user_text, t.assistant_text) for t in plan.history] == [
        ("Plan 3 days in Kyoto", "Day 1: ..."),
        ("and a tea ceremony\n\non day 2", "Added."),
        ("unanswered", ""),
    ]
    assert plan.max_tokens == 32
    assert mapping.turn_options(plan, stream=True) == {"max_tokens": "32", "stream": "true"}


@pytest.mark.parametrize(
    ("request_body", "status", "param", "message"),
    [
        (body(("user", "hi"), model="gpt-9"), 404, "model", "model 'gpt-9' does not exist; GET /v1/models lists"),
        (body(("user", "hi"), model="small"), 400, "model", "send model 'mars'"),
        (body(("user", "hi"), n=2), 400, "n", "n must be 1"),
        (body(("user", "hi"), tools=[{"type": "function"}]), 400, "tools", "tools are not supported"),
        (body(("user", "hi"), ("assistant", "yo")), 400, "messages[1]", "must be the user's turn"),
        (body(("user", "   ")), 400, "messages[0].content", "messages[0].content is empty"),
        (
            body(("user", [{"type": "image_url", "image_url": {"url": "x"}}])),
            400,
            "messages[0].content",
            "is a 'image_url' part; MARS reads text parts only",
        ),
    ],
)
def test_what_mars_cannot_honour_is_refused_with_the_field(
    request_body: ChatCompletionRequest, status: int, param: str, message: str
) -> None:
    with pytest.raises(mapping.BadRequest) as info:
        mapping.plan_turn(request_body, ARMS, "mars")
    assert info.value.status == status and info.value.param == param
    assert message in str(info.value)


def test_a_reply_becomes_an_openai_completion_with_the_mars_extension() -> None:
    reply = svc.TurnReply(
        turn_id="t1",
        seq=4,
        text="Day 2: Kiyomizu, then tea.",
        model="large",
        state=ev.SessionState(action=ev.MATCH, phase=ev.REVISE, top_k_hint=5),
        view_blocks=3,
        view_tokens=120,
        cost_usd=0.001,
        usage=ev.Usage(input_tokens=120, output_tokens=8),
        attempts=[ev.GenerationAttempt(arm="large", ok=True)],
    )
    plan = mapping.TurnPlan(text="q", history=[svc.RecordedTurn(user_text="a")], max_tokens=8)
    out = mapping.completion(reply, plan, created=7)
    data = out.model_dump()
    assert ChatCompletion.model_validate(data) == out
    assert data["id"] == "chatcmpl-t1" and data["model"] == "large" and data["created"] == 7
    assert data["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Day 2: Kiyomizu, then tea."},
            "finish_reason": "length",  # all 8 allowed tokens used
            "logprobs": None,
        }
    ]
    assert data["usage"] == {"prompt_tokens": 120, "completion_tokens": 8, "total_tokens": 128}
    assert data["mars"]["state"]["action"] == "MATCH" and data["mars"]["state"]["phase"] == "REVISE"
    assert data["mars"]["turn_id"] == "t1" and data["mars"]["history_pairs"] == 1
    assert data["mars"]["attempts"][0]["arm"] == "large"
    reply.usage.output_tokens = 3
    assert mapping.completion(reply, plan).choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("code", "status", "type_"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
        (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
        (grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout"),
        (grpc.StatusCode.INTERNAL, 500, "server_error"),
        (grpc.StatusCode.DATA_LOSS, 500, "server_error"),
    ],
)
def test_grpc_statuses_read_as_http(code: grpc.StatusCode, status: int, type_: str) -> None:
    err = mapping.http_error(code)
    assert (err.status, err.type) == (status, type_)


@pytest.mark.parametrize(
    ("header", "fields", "user"),
    [
        ("hdr", {"user": "u", "safety_identifier": "s", "metadata": {"user_id": "m"}}, "hdr"),
        (None, {"user": "u", "safety_identifier": "s", "metadata": {"user_id": "m"}}, "u"),
        (None, {"user": " ", "safety_identifier": "s", "metadata": {"user_id": "m"}}, "s"),
        (None, {"metadata": {"user_id": "m", "session_id": "trip"}}, "m"),
        (None, {"metadata": {"session_id": "trip"}}, ""),  # the key's user, or the ingress says it is missing
        (None, {}, ""),
    ],
)
def test_the_end_user_is_the_first_way_given(header: str | None, fields: dict[str, Any], user: str) -> None:
    assert mapping.end_user(header, body(("user", "hi"), **fields)) == user


def test_the_session_is_the_header_else_the_metadata() -> None:
    request = body(("user", "hi"), metadata={"session_id": "trip"})
    assert mapping.session_of("hdr", request) == "hdr"
    assert mapping.session_of(None, request) == "trip"
    assert mapping.session_of(None, body(("user", "hi"))) == ""


def test_the_missing_user_message_names_every_way() -> None:
    for way in ("X-MARS-User", "`user`", "`safety_identifier`", "`metadata.user_id`", "--user"):
        assert way in mapping.NO_USER


def test_the_ingress_saying_user_id_is_required_reads_as_every_way_to_name_the_user() -> None:
    from grpc.aio import AioRpcError, Metadata
    from mars_gateway.app import from_rpc

    def refused(details: str) -> Any:
        return from_rpc(
            AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, Metadata(), Metadata(), details=details)
        )

    missing = refused("user_id is required")
    assert missing.status == 400
    assert (missing.body.error.message, missing.body.error.param) == (mapping.NO_USER, "user")
    other = refused("text is empty")
    assert (other.body.error.message, other.body.error.param) == ("text is empty", None)
