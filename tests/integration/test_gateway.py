"""The OpenAI-compatible gateway (mars_gateway) over the real stack: the official `openai` client, streamed
and not, two users and two sessions; earlier messages stored once; feedback reaching the router; bad input
answered in OpenAI's error format with nothing written; budgets per user as 429 with Retry-After and OpenAI's
x-ratelimit-* headers; schemathesis against the served OpenAPI document."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import psycopg
import pytest
from conftest import (
    GATEWAY_METRICS_PORT,
    GATEWAY_QUOTA_TENANT,
    api_key,
    query,
    read_events,
    wait_for,
)
from mars.config import TOPIC_VIEW
from mars.v1 import events_pb2 as ev
from mars_ingress import budget_store
from mars_stack import LocalStack

pytestmark = pytest.mark.integration

TENANT = "gw"
QUOTA_TENANT = GATEWAY_QUOTA_TENANT
ARMS = {"broken-endpoint", "standin-short", "standin-long"}


METRICS_PORT = GATEWAY_METRICS_PORT


@pytest.fixture(scope="module")
def gw_stack(front_door_stack: LocalStack) -> LocalStack:
    """The stand-in stack with the gateway, shared with test_ingress_security (conftest.front_door_stack):
    one turn then 429 for a long while for QUOTA_TENANT (the quota test and the fuzzing tenant)."""
    return front_door_stack


def url(stack: LocalStack) -> str:
    return stack.env["MARS_GATEWAY_URL"]


def client(stack: LocalStack, tenant: str = TENANT, user: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=url(stack) + "/v1", api_key=api_key(stack, tenant, user), max_retries=0)


def mars(completion: Any) -> dict[str, Any]:
    extra: dict[str, Any] = completion.model_extra["mars"]
    return extra


def view_of(stack: LocalStack, turn_id: str) -> ev.CandidateView:
    views = [v for v in read_events(stack, TOPIC_VIEW, ev.ViewBuilt) if v.turn.turn_id == turn_id]
    assert views, f"no view logged for turn {turn_id}"
    return views[0].view


def turns_of(stack: LocalStack, user: str) -> list[tuple[str, str]]:
    return [
        (str(s), str(st))
        for s, st in query(
            stack,
            "SELECT session_id, status FROM ingress_turns WHERE tenant = %s AND user_id = %s ORDER BY seq",
            (TENANT, user),
        )
    ]


def test_models_lists_mars_and_the_pool_arms(gw_stack: LocalStack) -> None:
    ids = [m.id for m in client(gw_stack).models.list()]
    assert ids[0] == "mars" and set(ids[1:]) == ARMS
    # The key is verified (by the ingress), not merely present: a made-up one lists nothing.
    made_up = openai.OpenAI(base_url=url(gw_stack) + "/v1", api_key="mars_" + "x" * 43, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        made_up.models.list()


def test_two_users_two_sessions_through_the_openai_client(gw_stack: LocalStack) -> None:
    """Answers come back naming the arm; the conversation an app sends back is not stored again; an
    earlier turn shows in a later turn's view; the sessions and users stay apart."""
    c = client(gw_stack)
    for user in ("gw-ana", "gw-ben"):
        for session in ("trip", "work"):
            first = c.chat.completions.create(
                model="mars",
                user=user,
                metadata={"session_id": session},
                messages=[{"role": "user", "content": f"Plan 3 days in Kyoto for {user} ({session})"}],
                max_tokens=12,
            )
            answer = first.choices[0].message.content
            assert answer and first.model in ARMS - {"broken-endpoint"}
            assert mars(first)["attempts"][-1]["arm"] == first.model and mars(first)["history_pairs"] == 0
            assert first.usage is not None and first.usage.completion_tokens > 0
            second = c.chat.completions.create(
                model="mars",
                user=user,
                metadata={"session_id": session},
                messages=[
                    {"role": "system", "content": "You are a travel agent."},
                    {"role": "user", "content": f"Plan 3 days in Kyoto for {user} ({session})"},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": "Make day 2 less busy and add a tea ceremony"},
                ],
                max_tokens=12,
            )
            assert second.choices[0].message.content
            assert mars(second)["history_pairs"] == 1 and mars(second)["seq"] == mars(first)["seq"] + 1
            second_id = mars(second)["turn_id"]
            assert second.id == f"chatcmpl-{second_id}"
            sources = {b.source_turn_id for b in view_of(gw_stack, second_id).blocks}
            assert mars(first)["turn_id"] in sources, "the first turn is not in the second turn's view"
        # Nothing was imported: MARS held every earlier message already; each session has its own turns.
        assert [st for _, st in turns_of(gw_stack, user)] == ["ANSWERED"] * 4 or all(
            st in ("ANSWERED", "PENDING") for _, st in turns_of(gw_stack, user)
        )
        assert [s for s, _ in turns_of(gw_stack, user)] == ["trip", "trip", "work", "work"]


def test_earlier_messages_mars_does_not_hold_are_stored_once(gw_stack: LocalStack) -> None:
    c = client(gw_stack)
    messages = [
        {"role": "user", "content": "My dog Biscuit is allergic to chicken."},
        {"role": "assistant", "content": "Noted: no chicken for Biscuit."},
        {"role": "user", "content": "What treats can Biscuit have?"},
    ]
    for _ in range(2):
        reply = c.chat.completions.create(
            model="mars",
            user="gw-cat",
            messages=messages,
            max_tokens=8,
            extra_headers={"X-MARS-Session": "pets"},
        )
        assert mars(reply)["history_pairs"] == 1
    statuses = [st for _, st in turns_of(gw_stack, "gw-cat")]
    assert statuses.count("IMPORTED") == 1 and len(statuses) == 3  # one import, two answered turns
    imported = query(
        gw_stack,
        "SELECT turn_id FROM ingress_turns WHERE user_id = 'gw-cat' AND status = 'IMPORTED'",
    )[0][0]
    wait_for(
        lambda: bool(query(gw_stack, "SELECT 1 FROM memory_records WHERE turn_id = %s", (imported,))),
        30,
        "the imported pair in memory",
    )


def test_streaming_sends_openai_chunks_and_done(gw_stack: LocalStack) -> None:
    c = client(gw_stack)
    chunks = list(
        c.chat.completions.create(
            model="mars",
            user="gw-ana",
            messages=[{"role": "user", "content": "Name three temples in Kyoto"}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    extension = finals[0].model_extra["mars"]
    assert finals[0].model in ARMS and len({ch.id for ch in chunks}) == 1
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    # The streamed pieces add up to the answer MARS recorded (the answer the router learns from).
    generated = query(
        gw_stack, "SELECT status FROM ingress_turns WHERE turn_id = %s", (extension["turn_id"],)
    )
    assert generated and text.strip()
    with httpx.stream(
        "POST",
        url(gw_stack) + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {api_key(gw_stack, TENANT)}"},
        json={
            "model": "mars",
            "user": "gw-ben",
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        },
        timeout=120,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_feedback_reaches_the_router(gw_stack: LocalStack) -> None:
    c = client(gw_stack)
    reply = c.chat.completions.create(
        model="mars",
        user="gw-fb",
        messages=[{"role": "user", "content": "Suggest a name for my cat."}],
        max_tokens=8,
    )
    turn_id = mars(reply)["turn_id"]
    wait_for(
        lambda: bool(query(gw_stack, "SELECT 1 FROM router_ledger WHERE turn_id = %s", (turn_id,))),
        60,
        "the judged reward to reach the router",
    )
    resp = httpx.post(
        url(gw_stack) + "/v1/feedback",
        headers={"Authorization": f"Bearer {api_key(gw_stack, TENANT)}"},
        json={"turn_id": turn_id, "thumbs": -1, "user": "gw-fb"},
        timeout=30,
    )
    assert resp.status_code == 200 and resp.json() == {"accepted": True}
    wait_for(
        lambda: bool(query(gw_stack, "SELECT 1 FROM router_ledger WHERE turn_id LIKE %s", (f"{turn_id}#%",))),
        60,
        "the feedback correction in the router's ledger",
    )


def _error(resp: httpx.Response) -> dict[str, Any]:
    body: dict[str, Any] = resp.json()
    assert set(body) == {"error"} and {"message", "type"} <= set(body["error"]), body
    return body["error"]


def test_bad_input_gets_openai_errors_and_writes_nothing(gw_stack: LocalStack) -> None:
    key = api_key(gw_stack, TENANT)
    ok_body = {"model": "mars", "user": "gw-bad", "messages": [{"role": "user", "content": "hi"}]}
    cases: list[tuple[dict[str, Any], dict[str, str], int, str, str]] = [
        (ok_body, {}, 401, "authentication_error", "missing API key"),
        (ok_body, {"Authorization": "Bearer mars_" + "x" * 43}, 401, "authentication_error", "API key"),
        ({**ok_body, "model": "gpt-4o"}, {}, 404, "not_found_error", "model 'gpt-4o' does not exist"),
        ({**ok_body, "messages": []}, {}, 400, "invalid_request_error", "messages"),
        ({**ok_body, "max_tokens": 5000}, {}, 400, "invalid_request_error", "max_tokens must be an integer"),
        ({**ok_body, "user": "bad user"}, {}, 400, "invalid_request_error", "user_id must match"),
        (
            {**ok_body, "messages": [{"role": "user", "content": "x\u0000"}]},
            {},
            400,
            "invalid_request_error",
            "U+0000",
        ),
        ({"model": "mars", "messages": "hi"}, {}, 400, "invalid_request_error", "messages"),
        (
            {**ok_body, "tenant_extra": 1, "messages": [{"role": "assistant", "content": "x"}]},
            {},
            400,
            "invalid_request_error",
            "last message must be the user's",
        ),
    ]
    for body, headers, status, type_, message in cases:
        sent = {"Authorization": f"Bearer {key}", **headers} if headers or status != 401 else {}
        resp = httpx.post(url(gw_stack) + "/v1/chat/completions", json=body, headers=sent, timeout=30)
        assert resp.status_code == status, (body, resp.text)
        err = _error(resp)
        assert err["type"] == type_ and message in err["message"], (body, err)
    # Not JSON at all; a body over the limit.
    resp = httpx.post(
        url(gw_stack) + "/v1/chat/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 400 and _error(resp)["type"] == "invalid_request_error"
    resp = httpx.post(
        url(gw_stack) + "/v1/chat/completions",
        json={**ok_body, "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert resp.status_code == 413 and _error(resp)["code"] == "request_too_large"
    # A user-scoped key speaking for another user; feedback for a turn that does not exist.
    resp = httpx.post(
        url(gw_stack) + "/v1/chat/completions",
        json={**ok_body, "user": "gw-other"},
        headers={"Authorization": f"Bearer {api_key(gw_stack, TENANT, 'gw-bad')}"},
        timeout=30,
    )
    assert resp.status_code == 403 and _error(resp)["type"] == "permission_error"
    resp = httpx.post(
        url(gw_stack) + "/v1/feedback",
        json={"turn_id": "no-such-turn", "rating": 1.0, "user": "gw-bad"},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert resp.status_code == 404 and "no turn no-such-turn" in _error(resp)["message"]
    # Through the client: the SDK's own exception types.
    with pytest.raises(openai.NotFoundError):
        client(gw_stack).chat.completions.create(
            model="gpt-4o", user="gw-bad", messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.BadRequestError):
        client(gw_stack).chat.completions.create(model="mars", messages=[{"role": "user", "content": "x"}])
    assert turns_of(gw_stack, "gw-bad") == [] and turns_of(gw_stack, "gw-other") == []


LITELLM_PYTHON = Path(__file__).resolve().parents[2] / "load-tests" / ".venv-litellm" / "bin" / "python"


def test_the_litellm_sdk_names_the_user_every_way_it_can(gw_stack: LocalStack) -> None:
    """LiteLLM's SDK, as a client putting MARS behind an existing LLM proxy: a header, safety_identifier,
    metadata.user_id (through extra_body: the SDK keeps `metadata` for itself) and a body `user` all name
    the user; the SDK's own `user=` is dropped before the request leaves, and the 400 names every way."""
    assert LITELLM_PYTHON.exists(), f"LiteLLM's environment is missing ({LITELLM_PYTHON}): make litellm"
    done = subprocess.run(
        [str(LITELLM_PYTHON), str(Path(__file__).parent / "litellm_client.py"), url(gw_stack) + "/v1",
         api_key(gw_stack, TENANT), "ll"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    named = ("header", "safety_identifier", "metadata", "extra_body_user")
    assert {way: results[way] for way in named} == dict.fromkeys(named, "ok"), results
    for way in named:  # one turn each, recorded under the user that way named
        assert [session for session, _ in turns_of(gw_stack, f"ll-{way}")] == ["default"], way
    assert results["user"].startswith("BadRequestError"), results["user"]
    for way in ("X-MARS-User", "safety_identifier", "metadata.user_id", "--user"):
        assert way in results["user"], results["user"]
    assert turns_of(gw_stack, "ll-user") == []


def test_quota_is_429_with_retry_after(gw_stack: LocalStack) -> None:
    c = openai.OpenAI(base_url=url(gw_stack) + "/v1", api_key=api_key(gw_stack, QUOTA_TENANT), max_retries=0)
    body = {"model": "mars", "user": "gw-q", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    c.chat.completions.create(**body)  # type: ignore[call-overload]
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(**body)  # type: ignore[call-overload]
    headers = info.value.response.headers
    assert int(headers["Retry-After"]) >= 1
    # The tenant's turn bucket, as OpenAI's request figures: a burst of 1, none left.
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("1", "0")
    assert "x-mars-budget" not in headers  # a quota, not a budget


def set_budget(stack: LocalStack, user: str, tokens_per_minute: int) -> None:
    with psycopg.connect(stack.env["MARS_POSTGRES_DSN"], autocommit=True) as conn:
        budget_store.set_budget(conn, budget_store.Target(TENANT, user), None, tokens_per_minute)


def completion_body(user: str, stream: bool = False) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Name a river"}]
    return {"model": "mars", "user": user, "messages": messages, "max_tokens": 8, "stream": stream}


def post(stack: LocalStack, body: dict[str, Any]) -> httpx.Response:
    """The response with its body read (a stream to its [DONE])."""
    headers = {"Authorization": f"Bearer {api_key(stack, TENANT)}"}
    return httpx.post(url(stack) + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def test_a_users_budget_is_429_with_retry_after_and_ratelimit_headers(gw_stack: LocalStack) -> None:
    """A budget per user through the gateway, plain and streamed: answers carry OpenAI's x-ratelimit-*
    headers; once spent, 429 with Retry-After, x-mars-budget and the figures, before any stream starts;
    another user of the same key is answered."""
    for user, stream in (("gw-bud", False), ("gw-bud-s", True)):
        set_budget(gw_stack, user, 1)
        ok = post(gw_stack, completion_body(user, stream))
        assert ok.status_code == 200, ok.text
        assert ok.headers["x-ratelimit-limit-tokens"] == "1"
        assert ok.headers["x-ratelimit-remaining-tokens"] == "0"
        # Whole again a minute after this turn, in OpenAI's duration format.
        assert re.fullmatch(r"1m0s|59(\.\d+)?s", ok.headers["x-ratelimit-reset-tokens"]), ok.headers
        if stream:
            assert ok.text.rstrip().endswith("data: [DONE]")
        refused = post(gw_stack, completion_body(user, stream))
        assert refused.status_code == 429, refused.text
        assert refused.headers["content-type"].startswith("application/json")  # not a started stream
        err = _error(refused)
        assert err["type"] == "rate_limit_error" and "user budget of 1 tokens/min reached" in err["message"]
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        assert refused.headers["x-mars-budget"] == "user_tokens_per_minute"
        assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
        assert refused.headers["x-ratelimit-limit-tokens"] == "1"
    # Through the SDK: its RateLimitError, with the headers; another user is answered.
    with pytest.raises(openai.RateLimitError) as info:
        client(gw_stack).chat.completions.create(**completion_body("gw-bud"))  # type: ignore[call-overload]
    assert info.value.response.headers["x-mars-budget"] == "user_tokens_per_minute"
    other = post(gw_stack, completion_body("gw-unbudgeted"))
    assert other.status_code == 200 and "x-ratelimit-limit-tokens" not in other.headers


def test_the_callers_trace_continues_through_the_pipeline(gw_stack: LocalStack) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    resp = httpx.post(
        url(gw_stack) + "/v1/chat/completions",
        headers={
            "Authorization": f"Bearer {api_key(gw_stack, TENANT)}",
            "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01",
        },
        json={
            "model": "mars",
            "user": "gw-trace",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
        },
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["mars"]["trace_id"] == trace_id
    timing = resp.headers["server-timing"]
    assert timing.startswith("gateway;dur=") and ", ingress;dur=" in timing


def test_requests_are_counted_on_the_prometheus_endpoint(gw_stack: LocalStack) -> None:
    """mars.gateway.requests by route and status and the gateway's own time; a path nobody serves is
    "other", never a label of the caller's choosing."""
    httpx.get(url(gw_stack) + "/v1/models", headers={"Authorization": f"Bearer {api_key(gw_stack, TENANT)}"})
    httpx.get(url(gw_stack) + "/v1/nothing-here-" + "x" * 20)
    scraped = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
    lines = [line for line in scraped.splitlines() if line.startswith("mars_gateway_requests")]
    assert any('route="/v1/models"' in line and 'status="200"' in line for line in lines), lines
    assert any('route="other"' in line and 'status="404"' in line for line in lines), lines
    assert "nothing-here" not in scraped
    assert "mars_gateway_duration_milliseconds_bucket" in scraped


def test_health_and_the_openapi_document(gw_stack: LocalStack) -> None:
    assert httpx.get(url(gw_stack) + "/healthz").json() == {"status": "ok", "detail": ""}
    assert httpx.get(url(gw_stack) + "/readyz").status_code == 200
    doc = httpx.get(url(gw_stack) + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/models", "/v1/feedback", "/healthz", "/readyz"} <= set(doc["paths"])
    assert "bearer" in json.dumps(doc["components"]["securitySchemes"]).lower()


def test_schemathesis_finds_no_server_error(gw_stack: LocalStack, tmp_path: Path) -> None:
    """Generated requests (valid and not) against the served OpenAPI document: no 5xx. The fuzzing
    tenant's quota answers most valid completions with 429, so the run stays short."""
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    assert st, "schemathesis' st is installed with the dev extras"
    proc = subprocess.run(
        [
            st,
            "run",
            url(gw_stack) + "/openapi.json",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "25",
            "--request-timeout",
            "120",
            "-H",
            f"Authorization: Bearer {api_key(gw_stack, QUOTA_TENANT)}",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,  # its cache folder (.schemathesis) goes there
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "5 operations" in proc.stdout or "Tested: 5" in proc.stdout, proc.stdout[-2000:]
