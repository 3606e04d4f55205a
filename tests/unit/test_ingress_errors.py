"""Errors that are not the caller's become a status and a plain message, never a stack trace: the ingress
maps them with the same rpc_status as every service."""

from __future__ import annotations

import grpc
import psycopg
from aiokafka.errors import KafkaTimeoutError
from mars.runtime import rpc_status
from mars_ingress.admission import InvalidTurn, TurnFailed, quota_failure


def test_database_or_broker_trouble_is_unavailable_with_a_retry_hint() -> None:
    for exc in (psycopg.OperationalError("server closed the connection"), KafkaTimeoutError()):
        code, message = rpc_status(exc)
        assert code == grpc.StatusCode.UNAVAILABLE
        assert "retry" in message and "Traceback" not in message


def test_anything_else_is_internal_without_details() -> None:
    code, message = rpc_status(ValueError("secret internals"))
    assert code == grpc.StatusCode.INTERNAL
    assert "secret internals" not in message


def test_the_ingress_refusals_keep_their_status_and_trailing_metadata() -> None:
    from mars_ingress.quota import Refusal

    assert rpc_status(InvalidTurn("text is empty")) == (grpc.StatusCode.INVALID_ARGUMENT, "text is empty")
    refusal = quota_failure(Refusal("turns_per_s", 0.75, "tenant acme is over 2 turns/s"))
    assert rpc_status(refusal) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "tenant acme is over 2 turns/s")
    # The wait for the caller, and no retry by gRPC itself (mars_ingress.client): a quota's wait may be hours.
    assert refusal.trailing == (("retry-after-ms", "750"), ("grpc-retry-pushback-ms", "-1"))
    failed = TurnFailed(
        grpc.StatusCode.UNAVAILABLE, "no model could answer", detail="arm-a: 502 from 10.0.0.7"
    )
    assert rpc_status(failed) == (grpc.StatusCode.UNAVAILABLE, "no model could answer")


def test_a_dead_letter_tells_the_caller_the_stage_and_a_reference_only() -> None:
    import asyncio

    from mars.v1 import events_pb2 as ev
    from mars_ingress.admission import TurnFailed
    from mars_ingress.replies import PendingReplies
    from mars_ingress.settings import IngressSettings

    async def run() -> TurnFailed:
        replies = PendingReplies(IngressSettings())
        with replies.expect("t1") as fut:
            await replies.on_dead_letter(
                ev.DeadLetter(
                    turn_id="t1",
                    source_topic="mars.turn.received",
                    consumer="mars-state",
                    reason="handler failed after 3 attempts: UntranslatableCharacter('\\u0000 cannot be converted')",
                )
            )
        exc = fut.exception()
        assert isinstance(exc, TurnFailed)
        return exc

    exc = asyncio.run(run())
    assert exc.code == grpc.StatusCode.INTERNAL
    assert str(exc) == "turn failed in the state stage; reference t1"
    assert "UntranslatableCharacter" in exc.detail  # kept for the log and the turn's record


def test_the_failed_stage_is_the_service_whose_group_dead_lettered_the_turn() -> None:
    from mars_ingress.replies import failed_stage

    assert failed_stage("mars-router-updates", "") == "router"
    assert failed_stage("run7.mars-memory-view", "run7.") == "memory"
    assert failed_stage("state-control", "") == "pipeline"  # a broadcast reader, no group
