"""The ingress's front door over the real stack: API keys (UNAUTHENTICATED / PERMISSION_DENIED), tenants
from the key, user-scoped keys, revocation within the cache TTL, `mars tenant` commands, control characters
(INVALID_ARGUMENT instead of a database error), per-tenant quotas (RESOURCE_EXHAUSTED with a retry hint),
budgets per user and per key (`mars tenant set-budget`: RESOURCE_EXHAUSTED naming the budget) and
the isolation property: two tenants' interleaved turns never see each other's (or another user's) data.
Behind it, the stage services' own door: service identities only (mars.identity), whatever the key."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import AUTH_CACHE_TTL_S, REPO, api_key, ingress_stub, query, wait_for
from mars.auth import mint_key
from mars.identity import CallerIdentity
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_ingress.client import ingress_channel
from mars_stack import LocalStack

pytestmark = pytest.mark.integration

TTL_S = AUTH_CACHE_TTL_S


@pytest.fixture(scope="module")
def stack(front_door_stack: LocalStack) -> LocalStack:
    """The stand-in stack shared with test_gateway (conftest.front_door_stack): the key cache's TTL is
    TTL_S, and the tenants limited, wordy, spender and historian have quotas."""
    return front_door_stack


def turn(user: str = "u1", text: str = "What is a good name for a cat?", tenant: str = "") -> svc.TurnRequest:
    return svc.TurnRequest(tenant=tenant, user_id=user, session_id="s", text=text)


def refused(call: object, *args: object, **kw: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kw)  # type: ignore[operator]
    return info.value


def mars(*args: str) -> subprocess.CompletedProcess[str]:
    exe = str(Path(sys.executable).parent / "mars")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, check=False)


def test_the_stack_made_a_demo_tenant_key(stack: LocalStack) -> None:
    assert stack.env["MARS_TENANT"] == "demo" and stack.env["MARS_API_KEY"].startswith("mars_")
    env_file = stack.workdir / "stack.env"
    assert f"MARS_API_KEY={stack.env['MARS_API_KEY']}" in env_file.read_text()
    assert env_file.stat().st_mode & 0o077 == 0  # the key is a secret: the file is the owner's only
    run = mars(
        "send", "Hello as the demo tenant", "--target", stack.addr("ingress"),
        "--api-key", stack.env["MARS_API_KEY"], "--tenant", "demo",
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


def test_no_key_or_a_bad_key_is_unauthenticated(stack: LocalStack) -> None:
    plain = svc_grpc.IngressStub(grpc.insecure_channel(stack.addr("ingress")))
    err = refused(plain.SendTurn, turn(tenant="acme"), timeout=30)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "missing API key" in (err.details() or "")
    err = refused(
        plain.SubmitFeedback, svc.FeedbackRequest(tenant="acme", user_id="u1", turn_id="x", rating=1)
    )
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    err = refused(lambda: list(plain.Converse(iter([turn(tenant="acme")]), timeout=30)))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    for bad in ("mars_" + "A" * 43, "not-a-key", api_key(stack, "acme")[:-1] + "?"):
        stub = svc_grpc.IngressStub(ingress_channel(stack.addr("ingress"), bad))
        err = refused(stub.SendTurn, turn(tenant="acme"), timeout=30)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, bad
        assert bad not in (err.details() or "")  # the key is never echoed


def test_good_key_is_answered_with_the_tenant_from_the_key(stack: LocalStack) -> None:
    stub = ingress_stub(stack, "acme")
    named = stub.SendTurn(turn(tenant="acme"), timeout=60)
    filled = stub.SendTurn(turn(), timeout=60)  # no tenant in the body: the key's
    assert named.text and filled.text and filled.seq == named.seq + 1
    rows = query(
        stack,
        "SELECT DISTINCT tenant FROM ingress_turns WHERE turn_id = ANY(%s)",
        ([named.turn_id, filled.turn_id],),
    )
    assert rows == [("acme",)]
    err = refused(stub.SendTurn, turn(tenant="globex"), timeout=30)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "acts for tenant 'acme', not 'globex'" in (err.details() or "")
    # Converse: the key once per stream, each request's tenant against it.
    replies = list(stub.Converse(iter([turn(), turn(tenant="acme")]), timeout=120))
    assert len(replies) == 2 and all(r.text for r in replies)
    err = refused(lambda: list(stub.Converse(iter([turn(), turn(tenant="globex")]), timeout=120)))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED


def test_user_scoped_key_acts_for_its_user_only(stack: LocalStack) -> None:
    stub = ingress_stub(stack, "acme", user="alice")
    assert stub.SendTurn(turn(user="alice"), timeout=60).text
    filled = stub.SendTurn(turn(user=""), timeout=60)  # no user in the body: the key's
    assert query(stack, "SELECT user_id FROM ingress_turns WHERE turn_id = %s", (filled.turn_id,)) == [
        ("alice",)
    ]
    err = refused(stub.SendTurn, turn(user="bob"), timeout=30)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "'alice' only" in (err.details() or "")
    # Its feedback: on alice's own turn, never on bob's.
    bob_turn = ingress_stub(stack, "acme").SendTurn(turn(user="bob"), timeout=60)
    fb = svc.FeedbackRequest(user_id="alice", turn_id=filled.turn_id, rating=0.8)
    assert stub.SubmitFeedback(fb, timeout=10).accepted
    err = refused(
        stub.SubmitFeedback, svc.FeedbackRequest(user_id="bob", turn_id=bob_turn.turn_id, rating=0.1)
    )
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED


def test_feedback_needs_the_turns_tenant_key(stack: LocalStack) -> None:
    reply = ingress_stub(stack, "acme").SendTurn(turn(user="carol"), timeout=60)
    fb = svc.FeedbackRequest(tenant="acme", user_id="carol", turn_id=reply.turn_id, rating=0.9)
    err = refused(ingress_stub(stack, "globex").SubmitFeedback, fb, timeout=10)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    other = svc.FeedbackRequest(user_id="carol", turn_id=reply.turn_id, rating=0.9)
    err = refused(ingress_stub(stack, "globex").SubmitFeedback, other, timeout=10)
    # globex's key on acme's turn reads exactly as a turn id that exists nowhere: no oracle on turn ids.
    made_up = svc.FeedbackRequest(user_id="carol", turn_id="t" + reply.turn_id[1:][::-1], rating=0.9)
    unknown = refused(ingress_stub(stack, "globex").SubmitFeedback, made_up, timeout=10)
    assert err.code() == unknown.code() == grpc.StatusCode.NOT_FOUND
    assert err.details().replace(reply.turn_id, "ID") == unknown.details().replace(made_up.turn_id, "ID")
    long_comment = svc.FeedbackRequest(user_id="carol", turn_id=reply.turn_id, rating=0.9, comment="x" * 9000)
    err = refused(ingress_stub(stack, "acme").SubmitFeedback, long_comment, timeout=10)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "the limit is 8000" in err.details()
    assert ingress_stub(stack, "acme").SubmitFeedback(fb, timeout=10).accepted


def test_tenant_commands_create_rotate_and_revoke(stack: LocalStack) -> None:
    dsn = stack.env["MARS_POSTGRES_DSN"]
    created = mars("tenant", "create", "initech", "--user", "milton", "--label", "ops", "--postgres-dsn", dsn)
    assert created.returncode == 0, created.stdout + created.stderr
    key = created.stdout.strip().splitlines()[-1]
    key_id = key[5:13]
    listed = mars("tenant", "list", "--tenant", "initech", "--postgres-dsn", dsn)
    assert key_id in listed.stdout and "milton" in listed.stdout and key not in listed.stdout
    stub = svc_grpc.IngressStub(ingress_channel(stack.addr("ingress"), key))
    assert stub.SendTurn(turn(user="milton"), timeout=60).text

    rotated = mars("tenant", "rotate", key_id, "--postgres-dsn", dsn)
    assert rotated.returncode == 0, rotated.stdout + rotated.stderr
    new_key = rotated.stdout.strip().splitlines()[-1]
    new_stub = svc_grpc.IngressStub(ingress_channel(stack.addr("ingress"), new_key))
    assert new_stub.SendTurn(turn(user="milton"), timeout=60).text  # same scope as the old one
    assert (
        refused(new_stub.SendTurn, turn(user="bob"), timeout=30).code() == grpc.StatusCode.PERMISSION_DENIED
    )
    time.sleep(TTL_S + 0.2)
    assert refused(stub.SendTurn, turn(user="milton"), timeout=30).code() == grpc.StatusCode.UNAUTHENTICATED

    assert mars("tenant", "revoke", new_key[5:13], "--postgres-dsn", dsn).returncode == 0
    time.sleep(TTL_S + 0.2)  # revocation takes effect within the cache TTL
    assert (
        refused(new_stub.SendTurn, turn(user="milton"), timeout=30).code() == grpc.StatusCode.UNAUTHENTICATED
    )
    assert mars("tenant", "revoke", new_key[5:13], "--postgres-dsn", dsn).returncode == 1
    everything = mars("tenant", "list", "--all", "--postgres-dsn", dsn)
    assert f"-> {new_key[5:13]}" in everything.stdout


def test_control_characters_are_invalid_argument_not_a_database_error(stack: LocalStack) -> None:
    stub = ingress_stub(stack, "acme")
    for req, field in [
        (turn(text="nul \x00 in the text"), "text"),
        (turn(text="escape \x1b[31m red"), "text"),
        (turn(user="eve\x00"), "user_id"),
        (svc.TurnRequest(user_id="u1", session_id="s\x07", text="hi"), "session_id"),
        (turn(tenant="acme\x00"), "tenant"),
    ]:
        err = refused(stub.SendTurn, req, timeout=30)
        if field == "tenant":  # a tenant that is not the key's is refused before it is read
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            continue
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.details())
        assert f"{field} contains the control character" in (err.details() or "")
    assert stub.SendTurn(turn(text="tabs\tand\nnewlines\r\nare fine"), timeout=60).text
    reply = stub.SendTurn(turn(user="u1"), timeout=60)
    fb = svc.FeedbackRequest(user_id="u1", turn_id=reply.turn_id, rating=0.5, comment="nul\x00")
    err = refused(stub.SubmitFeedback, fb, timeout=10)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "comment contains" in (err.details() or "")


def _retry_after_ms(err: grpc.RpcError) -> int:
    trailing = dict(err.trailing_metadata() or ())  # type: ignore[attr-defined]
    return int(trailing["retry-after-ms"])


def test_turn_rate_quota_is_resource_exhausted_with_a_retry_hint(stack: LocalStack) -> None:
    stub = ingress_stub(stack, "limited")
    assert stub.SendTurn(turn(), timeout=60).text and stub.SendTurn(turn(), timeout=60).text  # the burst
    err = refused(stub.SendTurn, turn(), timeout=30)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "over its quota of 0.05 turns/s" in (err.details() or "")
    assert 0 < _retry_after_ms(err) <= 20_000
    assert ingress_stub(stack, "acme").SendTurn(turn(), timeout=60).text  # other tenants unaffected


def test_token_quota_counts_the_text(stack: LocalStack) -> None:
    stub = ingress_stub(stack, "wordy")
    long_text = "tell me about ferries " * 20  # ~126 estimated tokens: allowed from a full bucket, then debt
    assert stub.SendTurn(turn(text=long_text), timeout=60).text
    err = refused(stub.SendTurn, turn(text="short"), timeout=30)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "60 text tokens/min" in (err.details() or "")
    assert _retry_after_ms(err) > 1000


def test_token_quota_counts_imported_history_too(stack: LocalStack) -> None:
    """A turn's earlier messages that MARS did not hold are stored with it: their text is charged (after the
    turn is let in, as debt), so history is no way around the token quota."""
    stub = ingress_stub(stack, "historian")
    earlier = [
        svc.RecordedTurn(
            session_id="s", user_text="tell me about ferries " * 10, assistant_text="ferries " * 40
        )
    ]
    request = turn(text="short")
    request.history.extend(earlier)
    assert stub.SendTurn(request, timeout=60).text
    err = refused(stub.SendTurn, turn(text="short"), timeout=30)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "60 text tokens/min" in (err.details() or "")


def test_daily_spend_limit(stack: LocalStack) -> None:
    stub = ingress_stub(stack, "spender")
    first = stub.SendTurn(turn(), timeout=60)
    assert first.cost_usd > 0
    # The ingress counts a turn's cost once its outcome group has read the turn's Judged event.
    judged = "SELECT 1 FROM ingress_turns WHERE turn_id = %s AND cost_usd > 0"
    wait_for(lambda: bool(query(stack, judged, (first.turn_id,))), 60, "the judged cost recorded")
    err = refused(stub.SendTurn, turn(), timeout=30)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "daily limit" in (err.details() or "") and "00:00 UTC" in (err.details() or "")
    assert _retry_after_ms(err) > 0


def _set_budget(stack: LocalStack, *args: str) -> subprocess.CompletedProcess[str]:
    run = mars("tenant", "set-budget", *args, "--postgres-dsn", stack.env["MARS_POSTGRES_DSN"])
    assert run.returncode == 0, run.stdout + run.stderr
    return run


def _limits(reply: svc.TurnReply) -> dict[str, tuple[float, float]]:
    return {r.budget: (r.limit, r.remaining) for r in reply.rate_limits}


def test_a_users_token_budget_refuses_that_user_only(stack: LocalStack) -> None:
    """`mars tenant set-budget --user`: the turn that spends the budget goes in (debt), the next is
    RESOURCE_EXHAUSTED naming the budget and when it frees, with the figures in trailing metadata; another
    user of the tenant is answered; `clear-budget` lets the user in again."""
    _set_budget(stack, "--tenant", "budgeted", "--user", "ann", "--tokens-per-minute", "1")
    stub = ingress_stub(stack, "budgeted")
    first = stub.SendTurn(turn(user="ann"), timeout=60)
    assert first.text and _limits(first) == {"user_tokens_per_minute": (1.0, 0.0)}
    assert 59 <= first.rate_limits[0].reset_s <= 60
    err = refused(stub.SendTurn, turn(user="ann"), timeout=30)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "user budget of 1 tokens/min reached" in (err.details() or "")
    assert re.search(r"frees at 20\d\d-\d\d-\d\dT\d\d:\d\d:\d\dZ", err.details() or ""), err.details()
    trailing = dict(err.trailing_metadata() or ())  # type: ignore[attr-defined]
    assert trailing["mars-budget"] == "user_tokens_per_minute"
    assert trailing["mars-ratelimit-limit-tokens"] == "1"
    assert trailing["mars-ratelimit-remaining-tokens"] == "0"
    assert 0 < _retry_after_ms(err) <= 60_000 and 0 < float(trailing["mars-ratelimit-reset-tokens"]) <= 60
    # Streamed turns and Converse are refused alike; another user is not.
    streamed = turn(user="ann")
    streamed.options["stream"] = "true"
    err = refused(lambda: list(stub.Converse(iter([streamed]), timeout=60)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "user budget" in (err.details() or "")
    for _ in range(2):
        assert stub.SendTurn(turn(user="bob"), timeout=60).text
    # The answer's own tokens count (the answering call's prompt + answer), not only the text's estimate.
    counted = "SELECT tokens FROM ingress_turns WHERE turn_id = %s"
    answered = first.usage.input_tokens + first.usage.output_tokens
    assert answered > 0
    wait_for(lambda: query(stack, counted, (first.turn_id,))[0][0] == answered, 30, "the answer's tokens")
    dsn = stack.env["MARS_POSTGRES_DSN"]
    listed = mars("tenant", "budgets", "--tenant", "budgeted", "--postgres-dsn", dsn)
    assert listed.returncode == 0 and "user ann" in listed.stdout and " of 1" in listed.stdout, listed.stdout
    cleared = mars("tenant", "clear-budget", "--tenant", "budgeted", "--user", "ann", "--postgres-dsn", dsn)
    assert cleared.returncode == 0, cleared.stdout + cleared.stderr
    again = stub.SendTurn(turn(user="ann"), timeout=60)
    assert again.text and not again.rate_limits


def test_the_each_user_budget_is_every_users_own(stack: LocalStack) -> None:
    """--each-user is a budget per user, not one shared by them: one user's spent budget does not refuse
    another; a user's own limit replaces the default."""
    _set_budget(stack, "--tenant", "everyone", "--each-user", "--tokens-per-minute", "1")
    _set_budget(stack, "--tenant", "everyone", "--user", "big", "--tokens-per-minute", "1000000")
    stub = ingress_stub(stack, "everyone")
    assert stub.SendTurn(turn(user="cid"), timeout=60).text
    err = refused(stub.SendTurn, turn(user="cid"), timeout=30)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "(the tenant's default for each user) of 1 tokens/min" in (err.details() or "")
    assert stub.SendTurn(turn(user="dee"), timeout=60).text  # dee's own minute
    for _ in range(2):
        reply = stub.SendTurn(turn(user="big"), timeout=60)
        assert _limits(reply)["user_tokens_per_minute"][0] == 1_000_000


def test_a_keys_daily_spend_budget_refuses_that_key_only(stack: LocalStack) -> None:
    key = api_key(stack, "keyed")
    _set_budget(stack, "--tenant", "keyed", "--key", key[5:13], "--usd-per-day", "1e-12")
    bad = mars(
        "tenant", "set-budget", "--tenant", "other", "--key", key[5:13], "--usd-per-day", "1",
        "--postgres-dsn", stack.env["MARS_POSTGRES_DSN"],
    )  # fmt: skip
    assert bad.returncode == 2 and "no API key" in bad.stdout  # another tenant's key
    stub = ingress_stub(stack, "keyed")
    first = stub.SendTurn(turn(user="eve"), timeout=60)
    assert first.cost_usd > 0 and _limits(first)["key_usd_per_day"][1] == 0.0
    recorded = query(stack, "SELECT key_id FROM ingress_turns WHERE turn_id = %s", (first.turn_id,))
    assert recorded == [(key[5:13],)]
    judged = "SELECT 1 FROM ingress_turns WHERE turn_id = %s AND cost_usd > 0"
    wait_for(lambda: bool(query(stack, judged, (first.turn_id,))), 60, "the judged cost recorded")
    err = refused(stub.SendTurn, turn(user="fay"), timeout=30)  # any user of the key
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = err.details() or ""
    assert "key budget of $1e-12/day reached" in details and "T00:00:00Z" in details
    assert dict(err.trailing_metadata())["mars-budget"] == "key_usd_per_day"  # type: ignore[attr-defined]
    # Another key of the same tenant has its own (no) budget.
    another_key = mint_key(stack.env["MARS_POSTGRES_DSN"], "keyed").key
    other = svc_grpc.IngressStub(ingress_channel(stack.addr("ingress"), another_key))
    assert other.SendTurn(turn(user="eve"), timeout=60).text


def test_isolation_between_tenants_and_users(stack: LocalStack) -> None:
    """The short version of `load-tests/isolation.py --turns 10000`: 150 seeded interleaved turns."""
    sys.path.insert(0, str(REPO / "load-tests"))
    import isolation

    report = isolation.run(
        stack.addr("ingress"),
        stack.env["MARS_POSTGRES_DSN"],
        stack.env["MARS_KAFKA_BOOTSTRAP"],
        turns=150,
        users=3,
        seed=7,
        keyring=stack.keyring(),
    )
    isolation.print_report(report)
    assert report.answered == 150 and not report.errors
    assert report.views_checked >= 150 and report.generated_checked >= 150 and report.records_checked >= 150
    assert report.views_recalling_own > 0  # memory did recall: the check is not vacuous
    assert report.cross_tenant == 0 and report.cross_user == 0, report.leaks


def test_keys_made_here_are_the_tenants(stack: LocalStack) -> None:
    """mint_key (what the harnesses and `mars tenant create` use) issues keys the ingress accepts."""
    key = mint_key(stack.env["MARS_POSTGRES_DSN"], "minted").key
    with ingress_channel(stack.addr("ingress"), key) as channel:
        assert svc_grpc.IngressStub(channel).SendTurn(turn(), timeout=60).text


# --- inside: the stage services answer service identities only (mars.identity) ---------------------------

STAGE_CALLS = [
    ("state", svc_grpc.StateEstimatorStub, "Estimate", svc.EstimateRequest(text="hello")),
    (
        "state",
        svc_grpc.StateEstimatorStub,
        "ImportContext",
        svc.ImportContextRequest(tenant="demo", user_id="u1", recent_texts=["x"], thread_depth=1, last_seq=1),
    ),
    ("memory", svc_grpc.MemoryStub, "BuildView", svc.BuildViewRequest(tenant="demo", user_id="u1", text="x")),
    ("memory", svc_grpc.MemoryStub, "DescribeIndex", svc.DescribeIndexRequest(tenant="demo", user_id="u1")),
    ("router", svc_grpc.RouterStub, "Route", svc.RouteRequest(tenant="demo", user_id="u1")),
    ("router", svc_grpc.RouterStub, "GetPolicy", svc.PolicyRequest(tenant="demo", user_id="u1")),
    ("router", svc_grpc.RouterStub, "ResetPolicy", svc.PolicyRequest(tenant="demo")),
    ("dispatch", svc_grpc.DispatchStub, "Generate", svc.GenerateRequest(arm="x", text="hi", max_tokens=4)),
    ("dispatch", svc_grpc.DispatchStub, "ListModels", svc.Empty()),
    ("judge", svc_grpc.JudgeStub, "Score", ev.Generated(text="hi")),
]


def stage_call(channel: grpc.Channel, stub: type, method: str, request: object) -> grpc.StatusCode:
    try:
        getattr(stub(channel), method)(request, timeout=30)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return, attr-defined]
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("service", "stub", "method", "request_"), STAGE_CALLS, ids=[c[2] for c in STAGE_CALLS]
)
def test_a_stage_refuses_callers_without_a_service_identity(
    stack: LocalStack, service: str, stub: type, method: str, request_: object
) -> None:
    """No credentials, the tenant's API key, or a certificate of another CA: UNAUTHENTICATED; a real tool
    identity on a method not its own: PERMISSION_DENIED. Nothing reaches the handler."""
    from mars.identity import with_identity
    from mars_stack.certs import make_identities

    addr = stack.addr(service)
    with grpc.insecure_channel(addr) as plain:
        assert stage_call(plain, stub, method, request_) == grpc.StatusCode.UNAUTHENTICATED
    with ingress_channel(addr, stack.env["MARS_API_KEY"]) as keyed:
        assert stage_call(keyed, stub, method, request_) == grpc.StatusCode.UNAUTHENTICATED
    forged = make_identities(stack.workdir / "forged", ("operator",))
    with grpc.insecure_channel(addr) as plain:
        as_forged = with_identity(plain, CallerIdentity.from_env(forged.env("operator")))
        assert stage_call(as_forged, stub, method, request_) == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(addr) as plain:  # the chaos harness may only describe memory's index
        as_chaos = with_identity(plain, stack.caller("chaos"))
        want = grpc.StatusCode.PERMISSION_DENIED if method != "DescribeIndex" else grpc.StatusCode.OK
        assert stage_call(as_chaos, stub, method, request_) == want


def test_a_stage_answers_the_operator_and_keeps_health_open(stack: LocalStack) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from mars.identity import with_identity

    with stack.channel("router") as channel:
        policy = svc_grpc.RouterStub(channel).GetPolicy(
            svc.PolicyRequest(tenant="demo", user_id="u1"), timeout=30
        )
    assert policy.arms
    with stack.channel("dispatch") as channel:
        assert svc_grpc.DispatchStub(channel).ListModels(svc.Empty(), timeout=30).models
    # A token for memory opens nothing at the router: tokens are minted per service.
    operator = stack.caller("operator")
    assert operator is not None
    token = operator.token("/mars.v1.Memory/BuildView")
    with grpc.insecure_channel(stack.addr("router")) as plain:
        with pytest.raises(grpc.RpcError) as info:
            svc_grpc.RouterStub(plain).GetPolicy(
                svc.PolicyRequest(tenant="demo", user_id="u1"),
                metadata=[("x-mars-identity", token)],
                timeout=30,
            )
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "/mars.v1.Memory, not " in info.value.details() and "/mars.v1.Router" in info.value.details()
    # Only the ingress hands over an imported context (state owns the table); the operator may not.
    handover = svc.ImportContextRequest(
        tenant="demo", user_id="ctx-probe", recent_texts=["a"], thread_depth=1, last_seq=1
    )
    with grpc.insecure_channel(stack.addr("state")) as plain:
        as_operator = with_identity(plain, operator)
        denied = stage_call(as_operator, svc_grpc.StateEstimatorStub, "ImportContext", handover)
        assert denied == grpc.StatusCode.PERMISSION_DENIED
        as_ingress = with_identity(plain, stack.caller("ingress"))
        assert svc_grpc.StateEstimatorStub(as_ingress).ImportContext(handover, timeout=30).applied
        # The same seq again (a call made again) keeps what is there.
        assert not svc_grpc.StateEstimatorStub(as_ingress).ImportContext(handover, timeout=30).applied
    for service in ("state", "memory", "router", "dispatch", "judge", "ingress"):
        with grpc.insecure_channel(stack.addr(service)) as plain:
            reply = health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


def test_reflection_is_off_on_stage_ports_and_on_at_the_ingress(stack: LocalStack) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    def listed(service: str) -> set[str] | grpc.StatusCode:
        with grpc.insecure_channel(stack.addr(service)) as plain:
            stub = reflection_pb2_grpc.ServerReflectionStub(plain)
            try:
                replies = list(
                    stub.ServerReflectionInfo(
                        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                    )
                )
            except grpc.RpcError as exc:
                return exc.code()  # type: ignore[no-any-return]
        return {s.name for r in replies for s in r.list_services_response.service}

    assert "mars.v1.Ingress" in listed("ingress")  # type: ignore[operator]
    for service in ("state", "memory", "router", "dispatch", "judge"):
        assert listed(service) == grpc.StatusCode.UNIMPLEMENTED, service


def test_an_open_stream_stops_opening_turns_once_its_key_is_revoked(stack: LocalStack) -> None:
    import queue

    key = api_key(stack, "streamer")
    requests: queue.Queue[svc.TurnRequest | None] = queue.Queue()

    def feed() -> Iterator[svc.TurnRequest]:
        while (request := requests.get()) is not None:
            yield request

    with ingress_channel(stack.addr("ingress"), key) as channel:
        replies = svc_grpc.IngressStub(channel).Converse(feed(), timeout=180)
        try:
            requests.put(turn(user="s1"))
            assert next(replies).text
            revoked = mars("tenant", "revoke", key[5:13], "--postgres-dsn", stack.env["MARS_POSTGRES_DSN"])
            assert revoked.returncode == 0, revoked.stdout + revoked.stderr
            time.sleep(TTL_S + 0.2)  # the key cache's TTL
            requests.put(turn(user="s1", text="And a second question?"))
            with pytest.raises(grpc.RpcError) as info:
                next(replies)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            requests.put(None)


def test_who_am_i_names_the_keys_tenant_and_user(stack: LocalStack) -> None:
    me = ingress_stub(stack, "acme", "alice").WhoAmI(svc.WhoAmIRequest(), timeout=10)
    assert (me.tenant, me.user_id, me.admin) == ("acme", "alice", False) and me.key_id
    with grpc.insecure_channel(stack.addr("ingress")) as plain:
        err = refused(svc_grpc.IngressStub(plain).WhoAmI, svc.WhoAmIRequest(), timeout=10)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
