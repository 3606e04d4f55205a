"""Stage consumers over Kafka (aiokafka): a consumer group that handles each user's records in order and
users concurrently, fetches while handlers run, and commits each partition up to its first unfinished
record, after the side effects (at-least-once; stages are idempotent by turn_id). What happens to one
record is mars.bus.delivery's; the offsets' bookkeeping is mars.bus.offsets'."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, ConsumerRecord, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor

from mars import metrics
from mars.bus.codec import is_transient
from mars.bus.delivery import StageDelivery, Subscription
from mars.bus.offsets import PartitionTrack, records_behind
from mars.bus.producer import EventProducer
from mars.config import TOPIC_CONTROL, ServiceSettings
from mars.kafka_options import kafka_client_options
from mars.spec import ConsumerGroup, ServiceSpec
from mars.v1 import events_pb2 as ev

log = logging.getLogger(__name__)


def check_group(spec: ServiceSpec, group: ConsumerGroup, subscriptions: Sequence[Subscription]) -> None:
    """A stage group is one of the service's own (its spec's) and reads exactly the topics the spec gives
    it: a handler added or dropped in one place and not the other fails at start, not as lag nobody scales
    on (and not as a group its Kafka principal may not join, mars.kafka_acls)."""
    if group not in spec.groups:
        raise ValueError(
            f"consumer group {group.name} is not one of {spec.name}'s: its spec gives it "
            f"{', '.join(g.name for g in spec.groups) or 'none'}"
        )
    handled = sorted(s.topic for s in subscriptions)
    if handled != sorted(group.topics):
        raise ValueError(
            f"consumer group {group.name} of {spec.name} handles {', '.join(handled)}; its spec gives it "
            f"{', '.join(sorted(group.topics))}"
        )


def check_broadcast(spec: ServiceSpec, subscriptions: Sequence[Subscription]) -> None:
    """A broadcast reader reads only what the service's spec says it reads outside its groups (its Kafka
    principal may read nothing else)."""
    allowed = set(spec.broadcast_reads)
    if extra := sorted({s.topic for s in subscriptions} - allowed):
        raise ValueError(
            f"{spec.name} reads {', '.join(extra)} outside its groups; its spec gives it "
            f"{', '.join(sorted(allowed)) or 'nothing'} (broadcast_reads)"
        )


class StageConsumer:
    """A consumer group over one or more topics.

    Records of one key (one user) are handled in order; keys and partitions are handled concurrently, and
    fetching goes on while handlers run. A partition's offset is committed (every COMMIT_EVERY_S) up to its
    first unfinished record, so nothing is skipped after a crash or a rebalance.

    A reader named by a string instead of a ConsumerGroup is a broadcast reader, outside any group: it gets
    every partition (every ingress replica must see every reply), starts at the end (or the beginning
    where end offsets are not trusted), and commits nothing. Either way what it reads is checked against
    the service's spec at construction.
    """

    #: Records fetched and not finished, at most (fetching pauses above it).
    MAX_IN_FLIGHT = 1000
    #: The longest the fetch loop (ours: getmany) and aiokafka's background fetcher (consumer_timeout_ms)
    #: sleep with nothing to do. Records, an assignment and a stop wake both at once, so this only paces
    #: idle wake-ups: at aiokafka's 200 ms every consumer woke about 20 times a second, idle, and an idle
    #: local stack's services used 8.3 to 9.1% of a core; at 1000 ms, 5.1 to 5.3%.
    IDLE_POLL_MS = 1000
    COMMIT_EVERY_S = 0.5
    #: How long a rebalance (or a stop) waits for the revoked partitions' records before cancelling them,
    #: unless the stage says otherwise (revoke_wait_s).
    REVOKE_WAIT_S = 5.0
    #: How long a stop waits for aiokafka's own stop (leave the group, close the connections).
    CLOSE_WAIT_S = 5.0
    #: How long a broadcast reader's stop waits for its connections to close before dropping them
    #: (close_kafka_consumer).
    BROADCAST_CLOSE_GRACE_S = 0.2

    def __init__(
        self,
        settings: ServiceSettings,
        producer: EventProducer,
        spec: ServiceSpec,
        reader: ConsumerGroup | str,
        subscriptions: list[Subscription],
        revoke_wait_s: float = REVOKE_WAIT_S,
    ) -> None:
        broadcast = isinstance(reader, str)
        self._revoke_wait_s = revoke_wait_s
        if isinstance(reader, ConsumerGroup):
            check_group(spec, reader, subscriptions)
            group_id = reader.name
        else:
            check_broadcast(spec, subscriptions)
            group_id = reader
        self._delivery = StageDelivery(settings, producer, spec.name, group_id, subscriptions)
        self._settings, self._producer, self._broadcast = settings, producer, broadcast
        self._group_id = self._delivery.group_id
        self._subs = self._delivery.subs
        self._delay_attrs = {
            topic: {"group": group_id, "topic": base} for topic, base in self._delivery.topic_label.items()
        }
        #: Records behind per (group, topic) label, recomputed every COMMIT_EVERY_S (mars.consumer.lag).
        self._lag: dict[tuple[str, str], int] = {}
        #: Per assigned partition: the first offset no consumer of the group can have handled before.
        self._fresh_from: dict[TopicPartition, int] = {}
        #: Per partition: the offsets fetched and not yet finished, and the last committed offset.
        self._tracks: dict[TopicPartition, PartitionTrack] = {}
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
            # A group's rebalance listener (end_offsets) waits behind a fetch in flight on the same connection:
            # short there. A broadcast reader has no listener (mars.config: kafka_broadcast_fetch_max_wait_ms).
            fetch_max_wait_ms=(
                settings.kafka_broadcast_fetch_max_wait_ms if broadcast else settings.kafka_fetch_max_wait_ms
            ),
            max_poll_records=200,
            consumer_timeout_ms=self.IDLE_POLL_MS,
            group_instance_id=(settings.kafka_group_instance_id or None) if not broadcast else None,
            session_timeout_ms=settings.kafka_session_timeout_ms,
            heartbeat_interval_ms=settings.kafka_heartbeat_interval_ms,
            # Range: a member gets the same partition indexes of every topic it reads, so a user's events
            # on two topics (memory: received and state) reach the same replica.
            partition_assignment_strategy=(RangePartitionAssignor,),
        )
        if not broadcast:
            self._consumer.subscribe(list(self._subs), listener=_FreshOffsets(self))
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
            _, pending = await asyncio.wait(tasks, timeout=self._revoke_wait_s)
            for task in pending:
                task.cancel()
        if not self._broadcast:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._commit_finished(), timeout=self.REVOKE_WAIT_S)
        drop_after_s = self.BROADCAST_CLOSE_GRACE_S if self._broadcast else None
        await close_kafka_consumer(self._consumer, self._group_id, self.CLOSE_WAIT_S, drop_after_s)
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
                batches = await self._consumer.getmany(timeout_ms=self.IDLE_POLL_MS)
                for tp, records in batches.items():
                    track = self._tracks.setdefault(tp, PartitionTrack())
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
        track: PartitionTrack,
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
        """Records behind per (group, topic) label (mars.bus.offsets.records_behind, summed by topic)."""
        lag: dict[tuple[str, str], int] = {}
        for tp, behind in records_behind(self._consumer, self._tracks).items():
            key = (self._delivery.group_label, self._delivery.topic_label.get(tp.topic, tp.topic))
            lag[key] = lag.get(key, 0) + behind
        return lag

    def lag_snapshot(self) -> dict[tuple[str, str], int]:
        """The last computed lag (read by the mars.consumer.lag gauge, on the metrics thread)."""
        return self._lag

    async def _commit_finished(self) -> None:
        ledger = self._producer.ledger
        if ledger is not None and ledger.pending:
            try:  # the rows of what is committed now must be written first (mars.emitted.EmittedLedger)
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
            _, pending = await asyncio.wait(tasks, timeout=self._revoke_wait_s)
            for task in pending:
                task.cancel()  # redelivered to the next owner: handlers are idempotent by turn_id
        if not self._broadcast:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._commit_finished(), timeout=self.REVOKE_WAIT_S)
        for tp in revoked:
            self._tracks.pop(tp, None)

    async def _handle(self, record: ConsumerRecord[Any, Any]) -> None:
        tp = TopicPartition(record.topic, record.partition)
        await self._delivery.deliver(record, fresh=record.offset >= self._fresh_from.get(tp, math.inf))


async def close_kafka_consumer(
    consumer: AIOKafkaConsumer, name: str, wait_s: float, drop_after_s: float | None = None
) -> None:
    """aiokafka's stop, waited for at most `wait_s`. Leaving the group comes first inside it; closing the broker
    connections after it has been seen to hang (a TLS transport that never reports its close, 1 stop in about
    30): past `wait_s` the close is left to the process's exit instead of holding the stop until the supervisor
    kills it. With `drop_after_s` (a broadcast reader: no group to leave, nothing to commit) the connections
    are dropped after that long: a TLS close waits for the broker's goodbye, which comes only after the fetch
    in flight (up to kafka_broadcast_fetch_max_wait_ms; a close measured 3.8 s at 5 s)."""
    transports: list[asyncio.WriteTransport] = []
    if drop_after_s is not None:  # taken before the stop, which forgets them
        conns = getattr(getattr(consumer, "_client", None), "_conns", {}).values()
        transports = [c._writer.transport for c in conns if getattr(c, "_writer", None) is not None]
    closing = asyncio.ensure_future(consumer.stop())
    if transports:
        done, _ = await asyncio.wait({closing}, timeout=drop_after_s)
        if not done:  # its fetch is cancelled by now: nothing is left to say to the broker
            for transport in transports:
                with contextlib.suppress(Exception):
                    transport.abort()
    done, _ = await asyncio.wait({closing}, timeout=wait_s)
    if not done:
        closing.cancel()
        log.warning("consumer %s: closing its broker connections took over %.0f s; left to the exit", name, wait_s)


class _FreshOffsets(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, consumer: StageConsumer) -> None:
        self._consumer = consumer

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._consumer._partitions_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._consumer._partitions_assigned(set(assigned))


def forgets_only(
    on_forgotten: Callable[[ev.UserForgotten], Awaitable[None]],
) -> Callable[[ev.UserForgotten], Awaitable[None]]:
    """`on_forgotten` for the UserForgotten events of mars.control only: the topic's other control events
    (a PolicyDecision, whose field numbers lie past UserForgotten's) decode as an empty UserForgotten,
    which names no user and is skipped."""

    async def handle(event: ev.UserForgotten) -> None:
        if event.user_id or event.forget_id:
            await on_forgotten(event)

    return handle


def control_reader(
    settings: ServiceSettings,
    producer: EventProducer,
    spec: ServiceSpec,
    on_forgotten: Callable[[ev.UserForgotten], Awaitable[None]],
) -> StageConsumer:
    """Every replica of the service reads every control event (a broadcast reader, outside any group): a
    forgotten user's caches go everywhere, whoever owns their partitions."""
    return StageConsumer(
        settings,
        producer,
        spec,
        f"{spec.name}-control",
        [Subscription(TOPIC_CONTROL, ev.UserForgotten, forgets_only(on_forgotten), requires_envelope=False)],
    )
