"""What a stage does with one fetched record: decode and check it, hand it to its handler (up to
`handler_attempts` times), time the call by outcome, and dead-letter what can never be processed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from aiokafka import ConsumerRecord
from google.protobuf.message import Message
from opentelemetry import trace

from mars import metrics
from mars.bus.codec import TOO_LARGE, PoisonEvent, Undeliverable, decode_record, is_transient, poison_reason
from mars.bus.producer import RESENT_HEADER, EventProducer
from mars.config import ServiceSettings
from mars.data_keys import Forgotten
from mars.telemetry import context_from_headers, text_free_span

log = logging.getLogger(__name__)

#: Set for the record a stage handler is working on: True when no consumer of its group can have handled
#: it before (its offset was at or past the partition's end when this consumer got the partition), so a
#: stage need not ask Postgres whether it already emitted for the turn (see StageOutput.done).
first_delivery: ContextVar[bool] = ContextVar("mars_first_delivery", default=False)

Handler = Callable[[Any], Awaitable[None]]


@dataclass(frozen=True)
class Subscription:
    #: The base topic name; the consumer subscribes to it under the settings' topic prefix.
    topic: str
    message_type: type[Message]
    handler: Handler
    #: Dead-letter events (they carry no envelope) skip envelope validation.
    requires_envelope: bool = True


class StageDelivery:
    """One consumer's handling of its records, apart from fetching and committing (StageConsumer)."""

    def __init__(
        self,
        settings: ServiceSettings,
        producer: EventProducer,
        service: str,
        group_id: str,
        subscriptions: list[Subscription],
    ) -> None:
        self._settings = settings
        self._producer = producer
        self._service = service
        self._topics = settings.topics
        # Groups are per run too: two runs on one broker must not share (and rebalance) a group. Dead
        # letters name their consumer by this name.
        self.group_id = self._topics.prefix + group_id
        self.subs = {self._topics.name(s.topic): s for s in subscriptions}
        # Metric labels, made once: the group and topic names without the run's prefix (see mars.metrics).
        self.group_label = group_id
        self.topic_label = {self._topics.name(s.topic): s.topic for s in subscriptions}
        self._stage_attrs = {
            (topic, outcome): {"group": group_id, "topic": base, "outcome": outcome}
            for topic, base in self.topic_label.items()
            for outcome in metrics.STAGE_OUTCOMES
        }
        self._tracer = trace.get_tracer(f"mars.{service}")

    async def deliver(self, record: ConsumerRecord[Any, Any], fresh: bool) -> None:
        """Handle one record. `fresh`: its offset is past where the partition ended when this consumer got
        it; unless it was re-sent, no consumer can have handled it before (`first_delivery`)."""
        sub = self.subs[record.topic]
        try:
            event, turn_id = await decode_record(
                record,
                sub.message_type,
                sub.requires_envelope,
                self._producer.keyring,
                self._settings.max_event_text_chars,
            )
        except Undeliverable as exc:
            if exc.kind == "forgotten":
                # The user was forgotten: the event's text is gone with the key, and nothing is left to do.
                log.info("turn %s on %s skipped: its user was forgotten", exc.turn_id, record.topic)
                self._timed(record.topic, "forgotten", time.perf_counter())
            else:
                await self._dead_letter(record, exc.reason, exc.turn_id, exc.kind)
            return
        first_delivery.set(fresh and not any(k == RESENT_HEADER for k, _ in record.headers or ()))
        await self._run_handler(record, sub, event, turn_id)

    async def _run_handler(
        self, record: ConsumerRecord[Any, Any], sub: Subscription, event: Message, turn_id: str
    ) -> None:
        """The handler, up to handler_attempts times; what fails for good is dead-lettered with its kind."""
        parent = context_from_headers(record.headers)
        attempts = max(1, self._settings.handler_attempts)
        for attempt in range(1, attempts + 1):
            with text_free_span(
                self._tracer,
                f"{self._service} {record.topic}",
                context=parent,
                kind=trace.SpanKind.CONSUMER,
                attributes={
                    "mars.turn_id": turn_id,
                    "mars.service": self._service,
                    "messaging.destination": record.topic,
                },
            ) as span:
                started = time.perf_counter()
                try:
                    await sub.handler(event)
                    self._timed(record.topic, "ok", started)
                    return
                except PoisonEvent as exc:
                    self._timed(record.topic, "dead_lettered", started)
                    span.set_attribute("exception.type", type(exc).__name__)  # never its text
                    await self._dead_letter(record, str(exc), turn_id, "rejected")
                    return
                except Forgotten:
                    # Forgotten while the stage worked on the turn: its output cannot be sealed any more.
                    log.info("turn %s dropped by %s: its user was forgotten", turn_id, self._service)
                    self._timed(record.topic, "forgotten", started)
                    return
                except Exception as exc:
                    span.set_attribute("exception.type", type(exc).__name__)  # never its text
                    if (reason := poison_reason(exc)) is not None:
                        self._timed(record.topic, "dead_lettered", started)
                        kind = "output_too_large" if isinstance(exc, TOO_LARGE) else "data_refused"
                        await self._dead_letter(record, reason, turn_id, kind)
                        return
                    if is_transient(exc):
                        self._timed(record.topic, "retried", started)
                        raise  # not the event's fault: the batch is retried, the event never dead-lettered
                    log.exception(
                        "handler failed on %s@%s (attempt %d)", record.topic, record.offset, attempt
                    )
                    if attempt == attempts:
                        self._timed(record.topic, "dead_lettered", started)
                        await self._dead_letter(
                            record,
                            # The exception's type only: its text can quote the event's (user) content,
                            # and the letter travels unsealed; the log above has the whole of it.
                            f"handler failed after {attempts} attempts: {type(exc).__name__}",
                            turn_id,
                            "handler_failed",
                        )
                        return
                    self._timed(record.topic, "retried", started)
            await asyncio.sleep(0.2 * attempt)

    def _timed(self, topic: str, outcome: str, started: float) -> None:
        """One handler call's time (mars.stage.duration), from its time.perf_counter() start."""
        metrics.instruments().stage_duration.record(
            (time.perf_counter() - started) * 1000, self._stage_attrs[topic, outcome]
        )

    async def _dead_letter(
        self, record: ConsumerRecord[Any, Any], reason: str, turn_id: str, kind: str
    ) -> None:
        """`kind`: the reason's coarse kind (mars.metrics.DEAD_LETTER_KINDS), the metric's label."""
        if record.topic == self._topics.dead_letter:
            # Never dead-letter a dead letter: that would loop forever.
            log.error("unreadable dead letter %d/%d skipped: %s", record.partition, record.offset, reason)
            return
        log.warning("dead-lettering %s@%d/%d: %s", record.topic, record.partition, record.offset, reason)
        await self._producer.dead_letter(record, reason, self.group_id, turn_id)
        metrics.record_dead_letter(self.group_label, self.topic_label.get(record.topic, record.topic), kind)
