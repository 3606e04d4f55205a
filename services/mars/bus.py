"""Turn events over Kafka (aiokafka): keyed publishing with trace headers, and stage consumers that
commit after their side effects, process each partition in order, and dead-letter poison messages.

Services name topics by their base names (`mars.config.TOPIC_*`); the producer and the consumers put the
settings' topic prefix in front (`ServiceSettings.topics`), so a prefixed run needs no change elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from aiokafka import (
    AIOKafkaConsumer,
    AIOKafkaProducer,
    ConsumerRebalanceListener,
    ConsumerRecord,
    TopicPartition,
)
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import (
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAlreadyExistsError,
    for_code,
)
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet
from opentelemetry import trace

from mars import metrics, topology
from mars.config import (
    ALL_TOPICS,
    SCHEMA_VERSION,
    TOPIC_CONTROL,
    TOPIC_FEEDBACK,
    TOPIC_GENERATED,
    TOPIC_JUDGED,
    TOPIC_MEMORY_COMMITTED,
    TOPIC_RECEIVED,
    TOPIC_ROUTED,
    TOPIC_STATE,
    TOPIC_TOKENS,
    TOPIC_VIEW,
    ServiceSettings,
)
from mars.data_keys import Forgotten, Keyring, is_sealed
from mars.kafka_options import kafka_client_options
from mars.sealing import SealError, has_user_text
from mars.telemetry import context_from_headers, inject_headers, step, text_free_span
from mars.v1 import events_pb2 as ev

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from mars.db import EmittedLedger

#: Set for the record a stage handler is working on: True when no consumer of its group can have handled
#: it before (its offset was at or past the partition's end when this consumer got the partition), so a
#: stage need not ask Postgres whether it already emitted for the turn (see StageOutput.done).
first_delivery: ContextVar[bool] = ContextVar("mars_first_delivery", default=False)
#: Header on a record that repeats a turn published before (EventProducer.publish(resent=True)).
RESENT_HEADER = "mars-resent"


class PoisonEvent(Exception):
    """An event that can never be processed (bad content); it goes straight to the dead-letter topic."""


#: Kafka's refusals of a record for its size: retrying the same record can never get it through.
TOO_LARGE = (MessageSizeTooLargeError, RecordTooLargeError, RecordListTooLargeError)


#: The event type on each turn-event topic (base names): every topic whose events carry a TurnEnvelope.
TOPIC_EVENTS: dict[str, type[Message]] = {
    TOPIC_RECEIVED: ev.TurnReceived,
    TOPIC_STATE: ev.StateEstimated,
    TOPIC_VIEW: ev.ViewBuilt,
    TOPIC_ROUTED: ev.Routed,
    TOPIC_GENERATED: ev.Generated,
    TOPIC_TOKENS: ev.TokenChunk,
    TOPIC_JUDGED: ev.Judged,
    TOPIC_FEEDBACK: ev.Feedback,
    TOPIC_MEMORY_COMMITTED: ev.MemoryCommitted,
}


def is_transient(exc: BaseException) -> bool:
    """Infrastructure trouble that passes (Postgres restarting, the broker stalled): the event is retried
    until it goes through, never dead-lettered for it. A record too large for the broker is not: it would
    be retried forever and hold up its partition."""
    import psycopg
    from psycopg_pool import PoolTimeout

    if isinstance(exc, (*TOO_LARGE, psycopg.errors.ProgramLimitExceeded)):
        return False
    return isinstance(exc, psycopg.OperationalError | PoolTimeout | KafkaError | ConnectionError)


def poison_reason(exc: BaseException) -> str | None:
    """Why a handler's failure is the event's own fault (its content can never be processed: a retry
    would fail the same way), or None. Such an event is dead-lettered at once with this reason."""
    import psycopg

    if isinstance(exc, TOO_LARGE):
        return f"the stage's output for this event is too large to publish ({type(exc).__name__}: {exc})"
    if isinstance(exc, psycopg.DataError | psycopg.errors.ProgramLimitExceeded):
        # SQLSTATE class 22 (NUL in text, numbers out of range, bad encodings) and 54 (a value too large
        # for an index row): deterministic, the same event fails the same way every time.
        return f"Postgres refused the event's data ({type(exc).__name__}: {exc})"
    return None


class TurnEvent(Protocol):
    @property
    def turn(self) -> ev.TurnEnvelope: ...


def event_key(turn: ev.TurnEnvelope) -> bytes:
    """All of a user's events share one key, hence one partition index in every topic."""
    return f"{turn.tenant}/{turn.user_id}".encode()


#: Longest turn_id, tenant, user_id or session_id an envelope may carry (ingress allows 128).
MAX_ID_CHARS = 256
#: Dead letters keep at most this much of the poison record's payload and key (a letter must stay well
#: under the broker's record size limit, 1 MiB by default, or it could never be published).
DEAD_LETTER_PAYLOAD_BYTES = 64 * 1024
DEAD_LETTER_KEY_BYTES = 1024
DEAD_LETTER_REASON_CHARS = 2000


def id_problem(name: str, value: str, required: bool = True) -> str | None:
    """What is wrong with an identifier (tenant, user_id, turn_id, session_id), or None. Postgres refuses
    NUL in text; control characters and unbounded lengths have no business in a key."""
    if not value:
        return f"{name} is missing" if required else None
    if len(value) > MAX_ID_CHARS:
        return f"{name} has {len(value)} characters; the limit is {MAX_ID_CHARS}"
    if "\x00" in value:
        return f"{name} contains a NUL character"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return f"{name} contains a control character"
    return None


def validate_envelope(turn: ev.TurnEnvelope) -> None:
    missing = [f for f in ("turn_id", "tenant", "user_id") if not getattr(turn, f)]
    if missing:
        raise PoisonEvent(f"envelope is missing {', '.join(missing)}")
    if turn.seq <= 0:
        raise PoisonEvent(f"envelope seq must be positive, got {turn.seq}")
    if turn.schema_version != SCHEMA_VERSION:
        raise PoisonEvent(f"unknown schema_version {turn.schema_version} (this build reads {SCHEMA_VERSION})")
    for name in ("turn_id", "tenant", "user_id", "session_id"):
        if (problem := id_problem(name, getattr(turn, name), required=False)) is not None:
            raise PoisonEvent(f"envelope {problem}")


def validate_key(key: bytes | None, turn: ev.TurnEnvelope) -> None:
    """A record's key is its envelope's tenant/user_id: a user's events share one partition, in order. A
    record keyed otherwise sits on the wrong partition (ordering and read-your-writes no longer hold)."""
    expected = event_key(turn)
    if key != expected:
        raise PoisonEvent(
            f"record key {_clip(repr(key), 120)} does not match the envelope's tenant/user_id "
            f"{_clip(repr(expected), 120)}"
        )


def wire_type_clash(event: Message) -> str | None:
    """A field whose number the message type knows but whose wire type differs (protobuf parses it into
    the unknown fields, silently): the record is another message type (or another schema), not this one.
    Unknown field numbers alone are not: a newer producer may have added fields."""
    for msg in (event, getattr(event, "turn", None)):
        if not isinstance(msg, Message):
            continue
        known = msg.DESCRIPTOR.fields_by_number
        for field in UnknownFieldSet(msg):
            if field.field_number in known:
                name = known[field.field_number].name
                return (
                    f"field {field.field_number} ({msg.DESCRIPTOR.name}.{name}) has the wrong wire type "
                    f"{field.wire_type}: not a {event.DESCRIPTOR.full_name} (wrong message type on this topic?)"
                )
    return None


#: Top-level text fields of the stage events (user text, answers, comments), bounded by
#: ServiceSettings.max_event_text_chars.
TEXT_FIELDS = ("text", "query", "comment")


def oversized_text(event: Message, limit: int) -> str | None:
    """Why an event's text is too long for the stages to take on (embedding, storing and prompting a
    text costs in proportion to it), or None."""
    for name in TEXT_FIELDS:
        if name in event.DESCRIPTOR.fields_by_name:
            size = len(getattr(event, name))
            if size > limit:
                return f"{name} has {size} characters; the limit is {limit} (MARS_MAX_EVENT_TEXT_CHARS)"
    return None


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _printable(text: str, limit: int) -> str:
    """A reason or id fit for a dead letter and for Postgres: NUL and other control characters escaped,
    the length bounded."""
    if any(ord(c) < 0x20 and c not in "\n\t" for c in text):
        text = "".join(c if ord(c) >= 0x20 or c in "\n\t" else f"\\x{ord(c):02x}" for c in text)
    return _clip(text, limit)


@dataclass(frozen=True)
class TopicsEnsured:
    """What `ensure_topics` did: topics created, topics already there, and topics the broker refused
    (name and the broker's reason, e.g. a replication factor above its broker count)."""

    created: tuple[str, ...]
    existing: tuple[str, ...]
    failed: tuple[tuple[str, str], ...] = ()


async def ensure_topics(
    kafka: dict[str, Any],
    partitions: int,
    topics: tuple[str, ...] = ALL_TOPICS,
    replication_factor: int = 1,
) -> TopicsEnsured:
    """Create the stage topics (full names: `ServiceSettings.topics.all` for a prefixed run) with one
    shared partition count and replication factor; existing topics are left alone (their partition count
    is not changed). `kafka`: the client options (`mars.kafka_options.kafka_client_options`)."""
    admin = AIOKafkaAdminClient(**kafka)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        wanted = [
            NewTopic(t, num_partitions=partitions, replication_factor=replication_factor)
            for t in topics
            if t not in existing
        ]
        failed: list[tuple[str, str]] = []
        raced: set[str] = set()
        if wanted:
            try:
                response = await admin.create_topics(wanted)
            except TopicAlreadyExistsError:
                raced = {t.name for t in wanted}  # another service created them first
            else:
                # The broker answers per topic; an error there is not raised by the client.
                for topic, code, *message in response.topic_errors:
                    if code == TopicAlreadyExistsError.errno:
                        raced.add(topic)
                    elif code:
                        reason = (message[0] if message else None) or for_code(code).__name__
                        failed.append((topic, str(reason)))
        failed_names = {t for t, _ in failed}
        return TopicsEnsured(
            created=tuple(t.name for t in wanted if t.name not in raced and t.name not in failed_names),
            existing=tuple(t for t in topics if t in existing or t in raced),
            failed=tuple(failed),
        )
    finally:
        await admin.close()


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
        reason = _printable(reason, DEAD_LETTER_REASON_CHARS) or "no reason given"
        if len(payload) > DEAD_LETTER_PAYLOAD_BYTES:
            reason += f" [payload cut to its first {DEAD_LETTER_PAYLOAD_BYTES} of {len(payload)} bytes]"
            payload = payload[:DEAD_LETTER_PAYLOAD_BYTES]
        if id_problem("turn_id", turn_id, required=False) is not None:
            turn_id = _printable(turn_id, 200)  # not a turn anyone waits for; kept readable
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


Handler = Callable[[Any], Awaitable[None]]


@dataclass(frozen=True)
class Subscription:
    #: The base topic name; the consumer subscribes to it under the settings' topic prefix.
    topic: str
    message_type: type[Message]
    handler: Handler
    #: Dead-letter events (they carry no envelope) skip envelope validation.
    requires_envelope: bool = True


class _PartitionTrack:
    """The offsets of one partition fetched and not finished yet (fetched in order, finished in any)."""

    def __init__(self) -> None:
        self.open: deque[int] = deque()
        self.finished_set: set[int] = set()
        self.next_fetch: int | None = None
        self.committed = -1

    def fetched(self, offset: int) -> None:
        self.open.append(offset)
        self.next_fetch = offset + 1

    def finished(self, offset: int) -> None:
        self.finished_set.add(offset)
        while self.open and self.open[0] in self.finished_set:
            self.finished_set.discard(self.open.popleft())

    def committable(self) -> int | None:
        """The offset to commit: the first unfinished record, or past the last fetched one."""
        if self.open:
            return self.open[0]
        return self.next_fetch


class _Undeliverable(Exception):
    """A record no handler gets: dead-lettered with its kind, or ("forgotten") skipped."""

    def __init__(self, kind: str, reason: str, turn_id: str) -> None:
        super().__init__(reason)
        self.kind, self.reason, self.turn_id = kind, reason, turn_id


def check_group(service: str, group_id: str, subscriptions: Sequence[Subscription]) -> None:
    """A stage group reads exactly the topics the topology gives it, in the service it names: a handler
    added or dropped in one place and not the other fails at start, not as lag nobody scales on."""
    group = topology.group(group_id)
    handled = sorted(s.topic for s in subscriptions)
    if group.service != service or handled != sorted(group.topics):
        raise ValueError(
            f"consumer group {group_id} of {service} handles {', '.join(handled)}; the topology gives it to "
            f"{group.service} with {', '.join(sorted(group.topics))}"
        )


def check_broadcast(service: str, subscriptions: Sequence[Subscription]) -> None:
    """A broadcast reader reads only what the topology says the service reads outside its groups (its Kafka
    principal may read nothing else)."""
    allowed = set(topology.service(service).broadcast_reads)
    if extra := sorted({s.topic for s in subscriptions} - allowed):
        raise ValueError(
            f"{service} reads {', '.join(extra)} outside its groups; the topology gives it "
            f"{', '.join(sorted(allowed)) or 'nothing'} (mars.topology broadcast_reads)"
        )


class StageConsumer:
    """A consumer group over one or more topics.

    Records of one key (one user) are handled in order; keys and partitions are handled concurrently, and
    fetching goes on while handlers run. A partition's offset is committed (every COMMIT_EVERY_S) up to its
    first unfinished record, so nothing is skipped after a crash or a rebalance.

    `broadcast=True` makes a reader outside any group instead: it gets every partition (every ingress
    replica must see every reply), starts at the end (or the beginning where end offsets are not
    trusted), and commits nothing.
    """

    #: Records fetched and not finished, at most (fetching pauses above it).
    MAX_IN_FLIGHT = 1000
    COMMIT_EVERY_S = 0.5
    #: How long a rebalance waits for the revoked partitions' records before cancelling them.
    REVOKE_WAIT_S = 5.0

    def __init__(
        self,
        settings: ServiceSettings,
        producer: EventProducer,
        service: str,
        group_id: str,
        subscriptions: list[Subscription],
        broadcast: bool = False,
    ) -> None:
        if not broadcast:
            check_group(service, group_id, subscriptions)
        else:
            check_broadcast(service, subscriptions)
        self._settings = settings
        self._producer = producer
        self._service = service
        self._topics = settings.topics
        self._broadcast = broadcast
        # Groups are per run too: two runs on one broker must not share (and rebalance) a group.
        self._group_id = self._topics.prefix + group_id
        self._subs = {self._topics.name(s.topic): s for s in subscriptions}
        # Metric labels, made once: the group and topic names without the run's prefix (see mars.metrics).
        self._group_label = group_id
        self._topic_label = {self._topics.name(s.topic): s.topic for s in subscriptions}
        self._stage_attrs = {
            (topic, outcome): {"group": group_id, "topic": base, "outcome": outcome}
            for topic, base in self._topic_label.items()
            for outcome in metrics.STAGE_OUTCOMES
        }
        self._delay_attrs = {
            topic: {"group": group_id, "topic": base} for topic, base in self._topic_label.items()
        }
        #: Records behind per (group, topic) label, recomputed every COMMIT_EVERY_S (mars.consumer.lag).
        self._lag: dict[tuple[str, str], int] = {}
        #: Per assigned partition: the first offset no consumer of the group can have handled before.
        self._fresh_from: dict[TopicPartition, int] = {}
        #: Per partition: the offsets fetched and not yet finished, and the last committed offset.
        self._tracks: dict[TopicPartition, _PartitionTrack] = {}
        #: The last task of each (partition, key): the next record of that key starts after it.
        self._chains: dict[tuple[TopicPartition, bytes | None], asyncio.Task[None]] = {}
        self._in_flight = 0
        self._room = asyncio.Event()
        self._consumer = AIOKafkaConsumer(
            **kafka_client_options(settings),
            group_id=None if broadcast else self._group_id,
            enable_auto_commit=False,
            # A new group starts at the beginning: nothing published before its first commit is skipped.
            auto_offset_reset="earliest",
            fetch_max_wait_ms=settings.kafka_fetch_max_wait_ms,
            max_poll_records=200,
            group_instance_id=(settings.kafka_group_instance_id or None) if not broadcast else None,
            session_timeout_ms=settings.kafka_session_timeout_ms,
            heartbeat_interval_ms=settings.kafka_heartbeat_interval_ms,
            # Range: a member gets the same partition indexes of every topic it reads, so a user's events
            # on two topics (memory: received and state) reach the same replica.
            partition_assignment_strategy=(RangePartitionAssignor,),
        )
        if not broadcast:
            self._consumer.subscribe(list(self._subs), listener=_FreshOffsets(self))
        self._tracer = trace.get_tracer(f"mars.{service}")
        self._task: asyncio.Task[None] | None = None
        metrics.watch_consumer(self)

    async def _partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._fresh_from = {tp: o for tp, o in self._fresh_from.items() if tp in assigned}
        if not assigned or not self._settings.kafka_trust_end_offsets:
            return  # Tansu: end offsets not trusted, every record is checked
        try:
            ends = await self._consumer.end_offsets(list(assigned))
        except Exception as exc:  # no shortcut this time: every record of these partitions is checked
            log.warning("end offsets of %s unavailable (%r): checking every record", self._group_id, exc)
            return
        self._fresh_from.update(ends)

    async def start(self) -> None:
        await self._consumer.start()
        if self._broadcast:
            await self._assign_all()
        self._task = asyncio.create_task(self._run(), name=f"consumer-{self._group_id}")

    async def _assign_all(self) -> None:
        tps: list[TopicPartition] = []
        for topic in self._subs:
            parts = self._consumer.partitions_for_topic(topic)
            if not parts:
                await self._consumer._client.force_metadata_update()
                parts = self._consumer.partitions_for_topic(topic) or set()
            tps += [TopicPartition(topic, p) for p in sorted(parts)]
        self._consumer.assign(tps)
        if self._settings.kafka_trust_end_offsets:
            await self._consumer.seek_to_end(*tps)
            for tp in tps:  # resolve the positions now, so nothing published after start() is missed
                await self._consumer.position(tp)
        else:
            await self._consumer.seek_to_beginning(*tps)

    async def wait_assigned(self, timeout_s: float = 90.0) -> None:
        """Group joins take seconds on the embedded broker; services report SERVING only after this."""
        deadline = time.monotonic() + timeout_s
        while not self._joined():
            if self._task is not None and self._task.done():
                self._task.result()
            if time.monotonic() > deadline:
                raise TimeoutError(f"consumer group {self._group_id} got no partitions in {timeout_s}s")
            await asyncio.sleep(0.05)

    def _joined(self) -> bool:
        """Partitions assigned, or the group's assignment done and empty (more replicas than partitions:
        this one idles as a standby until a rebalance gives it work)."""
        if self._consumer.assignment():
            return True
        subscription = self._consumer._subscription.subscription
        return subscription is not None and subscription.assignment is not None

    async def stop(self) -> None:
        """Stop fetching, let the records in hand finish (bounded), commit them, leave the group."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        tasks = list(self._chains.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.REVOKE_WAIT_S)
            for task in pending:
                task.cancel()
        if not self._broadcast:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._commit_finished(), timeout=self.REVOKE_WAIT_S)
        await self._consumer.stop()
        self._lag = {}

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    async def _run(self) -> None:
        """Fetch without waiting for the handlers: each record starts as soon as the one before it with the
        same key is done, so a slow record (a model call, a view waiting for read-your-writes) holds up only
        its own user. Offsets are committed in the background up to the first unfinished record."""
        committer = asyncio.create_task(self._commit_loop(), name=f"commit-{self._group_id}")
        try:
            while True:
                while self._in_flight >= self.MAX_IN_FLIGHT:
                    self._room.clear()
                    await self._room.wait()
                batches = await self._consumer.getmany(timeout_ms=200)
                for tp, records in batches.items():
                    track = self._tracks.setdefault(tp, _PartitionTrack())
                    for record in records:
                        track.fetched(record.offset)
                        chain = (tp, record.key)
                        before = self._chains.get(chain)
                        task = asyncio.create_task(self._handle_after(before, record, tp, track))
                        self._chains[chain] = task
                        self._in_flight += 1
        finally:
            committer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await committer

    async def _handle_after(
        self,
        before: asyncio.Task[None] | None,
        record: ConsumerRecord[Any, Any],
        tp: TopicPartition,
        track: _PartitionTrack,
    ) -> None:
        chain = (tp, record.key)
        try:
            if before is not None:
                await asyncio.shield(before)  # never raises: failures are retried inside
            if record.timestamp > 0:  # the record's age as its stage starts on it (waits behind its key)
                metrics.instruments().queue_delay.record(
                    max(0.0, time.time() * 1000 - record.timestamp), self._delay_attrs[record.topic]
                )
            while True:
                try:
                    await self._handle(record)
                    break
                except Exception as exc:
                    # Not the event's fault (Postgres restarting, the broker stalled): the same record again,
                    # the ones behind it on its key wait (handlers are idempotent by turn_id). Nothing here
                    # may raise: a chain that ended without finishing its record would hold the partition's
                    # commits back until a restart.
                    with contextlib.suppress(Exception):
                        if is_transient(exc):
                            log.warning("record on %s hit %r; retrying", self._group_id, exc)
                        else:
                            log.exception("record on %s failed; retrying", self._group_id)
                    await asyncio.sleep(0.5)
            track.finished(record.offset)
        finally:
            self._in_flight -= 1
            self._room.set()
            if self._chains.get(chain) is asyncio.current_task():
                del self._chains[chain]

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.COMMIT_EVERY_S)
            try:
                self._lag = self._lag_now()
            except Exception:  # a metric must never stop the commits
                log.debug("lag of %s not computed", self._group_id, exc_info=True)
            if self._broadcast:
                continue
            await self._commit_finished()

    def _lag_now(self) -> dict[tuple[str, str], int]:
        """Records behind per topic, from this consumer's own view (no broker call): per assigned partition,
        the high watermark of its last fetch response minus its first unfinished record (or its position
        when none is open). Partitions never fetched yet (no high watermark) are left out."""
        subscription = self._consumer._subscription.subscription
        assignment = subscription.assignment if subscription is not None else None
        if assignment is None:
            return {}
        lag: dict[tuple[str, str], int] = {}
        for tp in self._consumer.assignment():
            state = assignment.state_value(tp)
            if state is None or state.highwater is None:
                continue
            track = self._tracks.get(tp)
            if track is not None and track.open:
                position = track.open[0]
            elif state.has_valid_position:
                position = state.position
            elif track is not None and track.next_fetch is not None:
                position = track.next_fetch
            else:
                continue
            key = (self._group_label, self._topic_label.get(tp.topic, tp.topic))
            lag[key] = lag.get(key, 0) + max(0, state.highwater - position)
        return lag

    def lag_snapshot(self) -> dict[tuple[str, str], int]:
        """The last computed lag (read by the mars.consumer.lag gauge, on the metrics thread)."""
        return self._lag

    async def _commit_finished(self) -> None:
        ledger = self._producer.ledger
        if ledger is not None and ledger.pending:
            try:  # the rows of what is committed now must be written first (mars.db.EmittedLedger)
                await ledger.flush()
            except Exception as exc:
                log.warning("stage ledger not written; offsets of %s not committed: %r", self._group_id, exc)
                return
        offsets = {}
        for tp, track in self._tracks.items():
            next_offset = track.committable()
            if next_offset is not None and next_offset > track.committed:
                offsets[tp] = next_offset
        if not offsets:
            return
        try:
            await self._consumer.commit(offsets)
        except Exception as exc:  # a rebalance or the broker away: the next round commits again
            log.warning("committing offsets of %s failed: %r", self._group_id, exc)
            return
        for tp, offset in offsets.items():
            if tp in self._tracks:
                self._tracks[tp].committed = offset

    async def _partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        """Let the revoked partitions' records finish (bounded), commit them, and forget the partitions:
        their next owner starts after what was done here."""
        tasks = [t for (tp, _), t in self._chains.items() if tp in revoked]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.REVOKE_WAIT_S)
            for task in pending:
                task.cancel()  # redelivered to the next owner: handlers are idempotent by turn_id
        if not self._broadcast:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._commit_finished(), timeout=self.REVOKE_WAIT_S)
        for tp in revoked:
            self._tracks.pop(tp, None)

    async def _handle(self, record: ConsumerRecord[Any, Any]) -> None:
        sub = self._subs[record.topic]
        try:
            event, turn_id = await self._decode(record, sub)
        except _Undeliverable as exc:
            if exc.kind == "forgotten":
                # The user was forgotten: the event's text is gone with the key, and nothing is left to do.
                log.info("turn %s on %s skipped: its user was forgotten", exc.turn_id, record.topic)
                self._timed(record.topic, "forgotten", time.perf_counter())
            else:
                await self._dead_letter(record, exc.reason, exc.turn_id, exc.kind)
            return
        tp = TopicPartition(record.topic, record.partition)
        first_delivery.set(
            record.offset >= self._fresh_from.get(tp, math.inf)
            and not any(k == RESENT_HEADER for k, _ in record.headers or ())
        )
        await self._run_handler(record, sub, event, turn_id)

    async def _decode(self, record: ConsumerRecord[Any, Any], sub: Subscription) -> tuple[Message, str]:
        """The record's event, checked and unsealed, and its turn id; _Undeliverable says why not."""
        turn_id = ""
        kind = "undecodable"  # what the check that fails found wrong (mars.dead_letters reason_kind)
        try:
            event = sub.message_type()
            try:
                event.ParseFromString(record.value or b"")
            except Exception as exc:  # DecodeError (bad UTF-8 in a string, truncation, ...) or worse
                raise PoisonEvent(f"cannot decode {sub.message_type.__name__}: {exc}") from exc
            if sub.requires_envelope:
                kind = "invalid_envelope"
                turn = event.turn  # type: ignore[attr-defined]
                turn_id = turn.turn_id
                validate_envelope(turn)
                validate_key(record.key, turn)
            if (clash := wire_type_clash(event)) is not None:
                kind = "undecodable"
                raise PoisonEvent(f"cannot decode {sub.message_type.__name__}: {clash}")
            if (
                sub.requires_envelope
                and self._producer.keyring is not None
                and not event.turn.data_key_id  # type: ignore[attr-defined]
                and has_user_text(sub.message_type)
            ):
                # A service that seals takes no plaintext: anyone who may write the topic could otherwise
                # plant text for any user. The reason names the missing seal, never the text.
                kind = "unsealed"
                raise PoisonEvent(
                    f"unsealed {sub.message_type.__name__}: its envelope names no data key, and this "
                    "service takes user text only sealed with the user's data key"
                )
            if sub.requires_envelope and is_sealed(event):
                kind = "unsealable"
                if self._producer.keyring is None:
                    raise PoisonEvent(
                        "the event's text is sealed with a data key and this service has no master key "
                        "(set MARS_MASTER_KEY_FILE as for the other services)"
                    )
                try:
                    await self._producer.keyring.unseal(event)  # a database hiccup raises: retried
                except SealError as exc:
                    raise PoisonEvent(str(exc)) from exc
            if (oversized := oversized_text(event, self._settings.max_event_text_chars)) is not None:
                kind = "oversized_text"
                raise PoisonEvent(oversized)
        except PoisonEvent as exc:
            raise _Undeliverable(kind, str(exc), turn_id) from exc
        except Forgotten as exc:
            raise _Undeliverable("forgotten", "", turn_id) from exc
        return event, turn_id

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
        await self._producer.dead_letter(record, reason, self._group_id, turn_id)
        metrics.record_dead_letter(self._group_label, self._topic_label.get(record.topic, record.topic), kind)


__all__ = [
    "TOPIC_EVENTS",
    "EventProducer",
    "PoisonEvent",
    "StageConsumer",
    "Subscription",
    "TopicPartition",
    "TopicsEnsured",
    "ensure_topics",
    "event_key",
    "id_problem",
    "is_transient",
    "poison_reason",
    "validate_envelope",
    "validate_key",
    "wire_type_clash",
]


class _FreshOffsets(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, consumer: StageConsumer) -> None:
        self._consumer = consumer

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._consumer._partitions_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._consumer._partitions_assigned(set(assigned))


def control_reader(
    settings: ServiceSettings,
    producer: EventProducer,
    service: str,
    on_forgotten: Callable[[ev.UserForgotten], Awaitable[None]],
) -> StageConsumer:
    """Every replica of `service` reads every control event (a broadcast reader, outside any group): a
    forgotten user's caches go everywhere, whoever owns their partitions."""
    return StageConsumer(
        settings,
        producer,
        service,
        f"{service}-control",
        [Subscription(TOPIC_CONTROL, ev.UserForgotten, on_forgotten, requires_envelope=False)],
        broadcast=True,
    )


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
            from mars import db

            producer.ledger = db.EmittedLedger(pool)
        self._ledger = producer.ledger

    async def done(self, turn_id: str) -> bool:
        """Whether this stage already emitted for the turn. Answered from memory for what this process
        emitted and for a first delivery (see `first_delivery`: the only earlier copy of such a turn on
        the partition came through this same consumer, so this process emitted for it if anyone did);
        from the `stage_emitted` ledger otherwise (a partition taken over from another replica)."""
        from mars import db

        if turn_id in self._emitted:
            return True
        if first_delivery.get():
            return False
        with step("done-check"):
            async with self._pool.connection() as conn:
                done = await db.already_emitted(conn, self._stage, turn_id)
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
