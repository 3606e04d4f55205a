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
