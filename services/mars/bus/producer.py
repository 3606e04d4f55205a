"""Publishing turn events: keyed by user (one partition, in order), with trace headers, sealed when the
process holds data keys; and dead letters that stay publishable whatever the poison record held.

Services name topics by their base names (`mars.config.TOPIC_*`); the producer puts the settings' topic
prefix in front (`ServiceSettings.topics`), so a prefixed run needs no change elsewhere."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaProducer, ConsumerRecord
from google.protobuf.message import Message

from mars.bus.codec import (
    DEAD_LETTER_KEY_BYTES,
    DEAD_LETTER_PAYLOAD_BYTES,
    DEAD_LETTER_REASON_CHARS,
    event_key,
    id_problem,
    printable,
)
from mars.config import ServiceSettings
from mars.data_keys import Keyring
from mars.kafka_options import kafka_client_options
from mars.telemetry import inject_headers, step
from mars.v1 import events_pb2 as ev

if TYPE_CHECKING:
    from mars.emitted import EmittedLedger

#: Header on a record that repeats a turn published before (EventProducer.publish(resent=True)).
RESENT_HEADER = "mars-resent"


class EventProducer:
    def __init__(self, settings: ServiceSettings, service: str) -> None:
        self._service = service
        self.topics = settings.topics
        # The idempotent producer (Kafka) removes duplicates from the producer's own retries; Tansu refuses it.
        # Either way exactly-once effects come from idempotency keys (turn_id) on the consumer side.
        self._producer = AIOKafkaProducer(
            **kafka_client_options(settings),
            acks="all",
            # No linger: one event per turn and stage, latency first (a 1 ms linger was ~1 ms on every hop).
            linger_ms=0,
            enable_idempotence=settings.kafka_idempotence,
        )
        #: The data keys that seal user text (set by the service runtime when a master key is configured;
        #: None: events are published as they are, and sealed events cannot be read).
        self.keyring: Keyring | None = None
        #: The process's stage ledger (write-behind), set by the first StageOutput on a pool.
        self.ledger: EmittedLedger | None = None

    async def start(self) -> None:
        await self._producer.start()

    async def data_key_for(self, tenant: str, user_id: str) -> str:
        """The id of the user's data key for a new turn or feedback ("" when events travel in plaintext)."""
        if self.keyring is None:
            return ""
        with step("data key"):
            return await self.keyring.for_user(tenant, user_id)

    def forget_user(self, tenant: str, user_id: str) -> None:
        """Drop the user's data keys from this process's cache (the user was forgotten)."""
        if self.keyring is not None:
            self.keyring.forget_user(tenant, user_id)

    async def stop(self) -> None:
        await self._producer.stop()

    async def publish(self, topic: str, event: Message, turn: ev.TurnEnvelope, resent: bool = False) -> None:
        """Publish to the base topic `topic` (one of mars.config.ALL_TOPICS) of this run. `resent`: a turn
        published before (an outbox re-send); its consumers check their ledger rather than trust offsets."""
        headers = inject_headers()
        if resent:
            headers.append((RESENT_HEADER, b"1"))
        if self.keyring is not None:
            event = await self.keyring.seal(event, turn)  # Forgotten when the user's key is gone
        with step(f"publish {topic}"):
            await self._producer.send_and_wait(
                self.topics.name(topic), event.SerializeToString(), key=event_key(turn), headers=headers
            )

    async def send_raw(self, topic: str, payload: bytes, key: bytes | None) -> None:
        await self._producer.send_and_wait(
            self.topics.name(topic), payload, key=key, headers=inject_headers()
        )

    async def dead_letter(
        self, record: ConsumerRecord[Any, Any], reason: str, consumer: str, turn_id: str
    ) -> None:
        """Publish a dead letter for `record`. Whatever the record held, the letter stays publishable: the
        payload is cut to DEAD_LETTER_PAYLOAD_BYTES (the reason says so), the key to DEAD_LETTER_KEY_BYTES,
        the reason and turn_id are escaped and bounded (they end up in Postgres text columns)."""
        payload = record.value or b""
        key = (record.key or b"")[:DEAD_LETTER_KEY_BYTES]
        reason = printable(reason, DEAD_LETTER_REASON_CHARS) or "no reason given"
        if len(payload) > DEAD_LETTER_PAYLOAD_BYTES:
            reason += f" [payload cut to its first {DEAD_LETTER_PAYLOAD_BYTES} of {len(payload)} bytes]"
            payload = payload[:DEAD_LETTER_PAYLOAD_BYTES]
        if id_problem("turn_id", turn_id, required=False) is not None:
            turn_id = printable(turn_id, 200)  # not a turn anyone waits for; kept readable
        letter = ev.DeadLetter(
            source_topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            key=key,
            payload=payload,
            reason=reason,
            consumer=consumer,
            turn_id=turn_id,
            failed_at_ms=int(time.time() * 1000),
        )
        await self._producer.send_and_wait(
            self.topics.dead_letter, letter.SerializeToString(), key=key or None
        )
