"""mars_ingress.client's channels send a shed turn again after the server's pushback (gRFC A6 retries), and never a
quota refusal; over a real gRPC server in this process, whose Ingress refuses as the ingress does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_ingress.admission import quota_failure
from mars_ingress.capacity import Capacity
from mars_ingress.client import SHED_RETRY_ATTEMPTS, aio_ingress_channel
from mars_ingress.settings import IngressSettings

Refuse = Callable[[], Exception]


class _Ingress(svc_grpc.IngressServicer):
    """Refuses the first `refusals` calls with what `refuse` makes, then answers."""

    def __init__(self, refusals: int, refuse: Refuse) -> None:
        self.calls: list[float] = []
        self._refusals = refusals
        self._refuse = refuse

    async def SendTurn(self, request: svc.TurnRequest, context: grpc.aio.ServicerContext) -> svc.TurnReply:
        self.calls.append(time.monotonic())
        if len(self.calls) <= self._refusals:
            exc = self._refuse()
            context.set_trailing_metadata(exc.trailing)  # type: ignore[attr-defined]
            await context.abort(exc.code, str(exc))  # type: ignore[attr-defined]
        return svc.TurnReply(turn_id="t1", text="answered")


def _shed(retry_after_ms: int) -> Refuse:
    """The ingress's own shed refusal: its capacity held at one slot, the slot taken."""
    settings = IngressSettings(
        admission_limit=True,
        admission_initial_limit=1,
        admission_min_limit=1,
        admission_max_limit=1,
        admission_retry_after_ms=retry_after_ms,
    )
    capacity = Capacity(settings)
    capacity.enter("acme", "acme")

    def refuse() -> Exception:
        try:
            capacity.enter("acme", "acme")
        except Exception as exc:
            return exc
        raise AssertionError("the full limit let a turn in")

    return refuse


def _quota() -> Exception:
    from mars_ingress.quota import Refusal

    return quota_failure(Refusal("turns_per_s", 0.05, "tenant acme is over 2 turns/s"))


async def _call(servicer: _Ingress, options: list[tuple[str, object]] | None = None) -> object:
    server = grpc.aio.server()
    svc_grpc.add_IngressServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = aio_ingress_channel(f"127.0.0.1:{port}", "key", options=options)
    try:
        return await svc_grpc.IngressStub(channel).SendTurn(
            svc.TurnRequest(user_id="u", text="hi"), timeout=10
        )
    except grpc.aio.AioRpcError as exc:
        return exc
    finally:
        await channel.close()
        await server.stop(None)


def test_a_shed_turn_is_sent_again_after_the_servers_pushback_and_answered() -> None:
    servicer = _Ingress(2, _shed(1000))
    reply = asyncio.run(_call(servicer))
    assert isinstance(reply, svc.TurnReply) and reply.text == "answered"
    assert len(servicer.calls) == 3
    gaps = [b - a for a, b in zip(servicer.calls, servicer.calls[1:], strict=False)]
    # The pushback (1000 ms spread over 0.5x to 1.5x), not the policy's backoff (a random wait below 0.2 s,
    # then below 0.4 s).
    assert all(gap >= 0.48 for gap in gaps), gaps


def test_a_turn_shed_on_every_attempt_fails_with_the_refusal() -> None:
    servicer = _Ingress(100, _shed(10))
    refused = asyncio.run(_call(servicer))
    assert isinstance(refused, grpc.aio.AioRpcError)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "at capacity" in (refused.details() or "")
    assert len(servicer.calls) == SHED_RETRY_ATTEMPTS


def test_a_quota_refusal_is_not_sent_again() -> None:
    servicer = _Ingress(1, _quota)
    refused = asyncio.run(_call(servicer))
    assert isinstance(refused, grpc.aio.AioRpcError) and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(refused.trailing_metadata() or ())["retry-after-ms"] == "50"
    assert len(servicer.calls) == 1


@pytest.mark.parametrize("options", [[("grpc.enable_retries", 0)], [("grpc.service_config", "{}")]])
def test_a_caller_may_turn_the_retries_off(options: list[tuple[str, object]]) -> None:
    servicer = _Ingress(1, _shed(10))
    refused = asyncio.run(_call(servicer, options))
    assert isinstance(refused, grpc.aio.AioRpcError) and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(servicer.calls) == 1
