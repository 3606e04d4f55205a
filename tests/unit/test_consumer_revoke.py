"""A rebalance waits for the revoked partitions' records only as long as the stage allows, then cancels
them (their next owner redoes them): the pure part of StageConsumer that the k8s e2e rolling updates rely on
(the memory view group's 1 s instead of the consumers' 5 s)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from aiokafka import TopicPartition
from mars.bus.consumer import StageConsumer
from mars.bus.delivery import Subscription
from mars.config import TOPIC_GENERATED
from mars_memory.service import VIEW_REVOKE_WAIT_S


def bare_consumer(revoke_wait_s: float) -> StageConsumer:
    """A StageConsumer with only what _partitions_revoked reads: no broker, a broadcast reader (no commit)."""
    consumer = StageConsumer.__new__(StageConsumer)
    consumer._revoke_wait_s = revoke_wait_s
    consumer._broadcast = True
    consumer._chains = {}
    consumer._tracks = {}
    return consumer


def test_a_record_held_past_the_stages_wait_is_cancelled_and_one_of_another_partition_is_not() -> None:
    async def run() -> tuple[float, asyncio.Task[None], bool]:
        consumer = bare_consumer(0.2)
        revoked, kept = TopicPartition("mars.turn.state", 0), TopicPartition("mars.turn.state", 1)
        held = asyncio.create_task(asyncio.sleep(60))  # a view waiting for the user's turn n-1
        other = asyncio.create_task(asyncio.sleep(60))
        consumer._chains = {(revoked, b"u1"): held, (kept, b"u2"): other}
        began = time.monotonic()
        await consumer._partitions_revoked({revoked})
        spent = time.monotonic() - began
        await asyncio.sleep(0)
        other_untouched = not other.done()
        other.cancel()
        return spent, held, other_untouched

    spent, held, other_untouched = asyncio.run(run())
    assert held.cancelled()
    assert spent < StageConsumer.REVOKE_WAIT_S / 2, spent
    assert spent >= 0.2 - 0.05, spent  # it did wait for the record first
    assert other_untouched, "a record of a partition not revoked was cancelled"


def test_a_record_that_finishes_within_the_wait_is_not_cancelled() -> None:
    async def run() -> asyncio.Task[None]:
        consumer = bare_consumer(2.0)
        tp = TopicPartition("mars.turn.state", 0)
        quick = asyncio.create_task(asyncio.sleep(0.05))
        consumer._chains = {(tp, b"u1"): quick}
        await consumer._partitions_revoked({tp})
        return quick

    quick = asyncio.run(run())
    assert quick.done() and not quick.cancelled()


def test_the_memory_view_group_waits_less_than_the_default() -> None:
    assert 0 < VIEW_REVOKE_WAIT_S < StageConsumer.REVOKE_WAIT_S


def timed_stop(kafka_consumer: object, broadcast: bool, close_wait_s: float) -> float:
    """Seconds a StageConsumer over `kafka_consumer` (aiokafka's, faked) takes to stop, with nothing in hand."""

    async def run() -> float:
        consumer = bare_consumer(0.2)
        consumer._broadcast = broadcast
        consumer._task, consumer._group_id, consumer._lag = None, "mars-router", {("g", "t"): 1}
        consumer._consumer = kafka_consumer  # type: ignore[assignment]
        consumer.CLOSE_WAIT_S = close_wait_s  # type: ignore[misc]
        began = time.monotonic()
        await consumer.stop()
        return time.monotonic() - began

    return asyncio.run(run())


class _HangingClose:
    """aiokafka's consumer whose stop never returns: its TLS connections never report their close."""

    def __init__(self) -> None:
        self.stopping = asyncio.Event()

    async def stop(self) -> None:
        self.stopping.set()
        await asyncio.sleep(3600)


def test_a_stop_whose_connection_close_hangs_returns_after_the_close_wait() -> None:
    hanging = _HangingClose()
    spent = timed_stop(hanging, broadcast=True, close_wait_s=0.3)
    assert hanging.stopping.is_set()  # aiokafka's stop was asked for (it leaves the group first)
    assert 0.3 - 0.05 <= spent < 2.0, spent


def test_broadcast_readers_fetch_with_their_own_longer_wait_and_groups_with_the_short_one() -> None:
    """A group's rebalance listener waits behind its fetch in flight (same connection), so only the broadcast
    readers, in no group, take the long wait (mars.config: kafka_broadcast_fetch_max_wait_ms)."""
    from mars.v1 import events_pb2 as ev
    from mars_ingress.settings import IngressSettings
    from mars_ingress.spec import OUTCOMES, SPEC

    settings = IngressSettings(kafka_fetch_max_wait_ms=300, kafka_broadcast_fetch_max_wait_ms=4000)
    assert IngressSettings().kafka_broadcast_fetch_max_wait_ms > IngressSettings().kafka_fetch_max_wait_ms

    async def waits() -> tuple[int, int]:
        async def ignore(event: object) -> None:
            return None

        made = [
            StageConsumer(settings, None, SPEC, reader, subs)  # type: ignore[arg-type]
            for reader, subs in (
                (f"{SPEC.name}-replies", [Subscription(TOPIC_GENERATED, ev.Generated, ignore)]),
                (OUTCOMES, [Subscription(t, ev.Generated, ignore) for t in OUTCOMES.topics]),
            )
        ]
        waits = tuple(c._consumer._fetch_max_wait_ms for c in made)
        for c in made:
            await c._consumer.stop()  # never started: nothing to leave, no connection
        return waits  # type: ignore[return-value]

    assert asyncio.run(waits()) == (4000, 300)


class _Transport:
    def __init__(self, closed: asyncio.Event) -> None:
        self.closed, self.aborted = closed, False

    def abort(self) -> None:
        self.aborted = True
        self.closed.set()


class _ClosesOnAbort:
    """aiokafka's consumer whose TLS close waits for the broker's goodbye (after its fetch in flight): its stop
    returns once a transport is aborted, or after an hour."""

    def __init__(self) -> None:
        closed = asyncio.Event()
        self.transport = _Transport(closed)
        writer = type("Writer", (), {"transport": self.transport})()
        self._client = type("Client", (), {"_conns": {0: type("Conn", (), {"_writer": writer})()}})()

    async def stop(self) -> None:
        self._client._conns = {}  # type: ignore[attr-defined]  # as aiokafka's close forgets them
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.transport.closed.wait(), 3600)


@pytest.mark.parametrize("broadcast", [True, False])
def test_a_broadcast_readers_stop_drops_its_connections_after_a_short_grace(broadcast: bool) -> None:
    fake = _ClosesOnAbort()
    spent = timed_stop(fake, broadcast, close_wait_s=1.0)
    if broadcast:  # no group to leave, nothing to commit: dropped after BROADCAST_CLOSE_GRACE_S
        assert fake.transport.aborted and spent < 0.9, spent
    else:  # a group's close is waited for (it leaves the group), up to CLOSE_WAIT_S
        assert not fake.transport.aborted and spent >= 1.0 - 0.05, spent
