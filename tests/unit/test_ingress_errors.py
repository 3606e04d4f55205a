"""Errors that are not the caller's become a status and a plain message, never a stack trace."""

from __future__ import annotations

import grpc
import psycopg
from aiokafka.errors import KafkaTimeoutError
from mars_ingress.service import unexpected_status


def test_database_or_broker_trouble_is_unavailable_with_a_retry_hint() -> None:
    for exc in (psycopg.OperationalError("server closed the connection"), KafkaTimeoutError()):
        code, message = unexpected_status(exc)
        assert code == grpc.StatusCode.UNAVAILABLE
        assert "retry" in message and "Traceback" not in message


def test_anything_else_is_internal_without_details() -> None:
    code, message = unexpected_status(ValueError("secret internals"))
    assert code == grpc.StatusCode.INTERNAL
    assert "secret internals" not in message


def test_a_dead_letter_tells_the_caller_the_stage_and_a_reference_only() -> None:
    import asyncio

    from mars.v1 import events_pb2 as ev
    from mars_ingress.service import IngressServicer, TurnFailed
    from mars_ingress.settings import IngressSettings

    async def run() -> TurnFailed:
        servicer = IngressServicer(IngressSettings(), None, None)  # type: ignore[arg-type]
        fut: asyncio.Future[ev.Generated] = asyncio.get_running_loop().create_future()
        servicer._waiting["t1"] = fut
        await servicer.on_dead_letter(
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
