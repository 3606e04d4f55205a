"""A stage's output: one event per turn, published once in effect (at-least-once delivery, duplicates
suppressed by turn_id in memory and in the `stage_emitted` ledger)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from google.protobuf.message import Message

from mars import emitted
from mars.bus.delivery import first_delivery
from mars.bus.producer import EventProducer
from mars.telemetry import step
from mars.v1 import events_pb2 as ev


class StageOutput:
    """A stage's one output event per turn: `done` says a redelivered input was already answered;
    `emit` publishes, then records the turn in `stage_emitted` (at-least-once, duplicates suppressed)."""

    #: Turns this process emitted lately (a redelivery after a retried batch, an outbox re-send).
    REMEMBERED = 50_000

    def __init__(self, pool: Any, producer: EventProducer, stage: str, topic: str) -> None:
        self._pool = pool
        self._producer = producer
        self._stage = stage
        self._topic = topic
        self._emitted: OrderedDict[str, None] = OrderedDict()
        if producer.ledger is None:
            producer.ledger = emitted.EmittedLedger(pool)
        self._ledger = producer.ledger

    async def done(self, turn_id: str) -> bool:
        """Whether this stage already emitted for the turn. Answered from memory for what this process
        emitted and for a first delivery (see `first_delivery`: the only earlier copy of such a turn on
        the partition came through this same consumer, so this process emitted for it if anyone did);
        from the `stage_emitted` ledger otherwise (a partition taken over from another replica)."""
        if turn_id in self._emitted:
            return True
        if first_delivery.get():
            return False
        with step("done-check"):
            async with self._pool.connection() as conn:
                done = await emitted.already_emitted(conn, self._stage, turn_id)
        if done:  # a later copy of the turn (an outbox re-send) is then answered from memory too
            self._remember(turn_id)
        return done

    def _remember(self, turn_id: str) -> None:
        self._emitted[turn_id] = None
        if len(self._emitted) > self.REMEMBERED:
            self._emitted.popitem(last=False)

    async def emit(self, event: Message, turn: ev.TurnEnvelope) -> None:
        await self._producer.publish(self._topic, event, turn)
        self._remember(turn.turn_id)
        self._ledger.add(self._stage, turn.turn_id)
