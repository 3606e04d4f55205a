"""The ingress's turn store: ingress_turns (each turn's record, its outcome and the outbox copy of its
event) and ingress_user_seq (each user's seq). The outcome group and the orphan sweep write outcomes here;
the servicer only calls in."""

from __future__ import annotations

import asyncio
import logging

from mars.bus.codec import PoisonEvent, is_transient
from mars.bus.producer import EventProducer
from mars.config import INGRESS_STAGE, TOPIC_RECEIVED, TOPIC_ROUTED, TOPIC_STATE, TOPIC_VIEW
from mars.data_keys import Forgotten
from mars.emitted import EmittedLedger
from mars.v1 import events_pb2 as ev
from psycopg_pool import AsyncConnectionPool

from mars_ingress import history, quota
from mars_ingress.settings import IngressSettings

log = logging.getLogger(__name__)

#: Tries at recording a turn when the database connection breaks (e.g. Postgres restarting).
ACCEPT_ATTEMPTS = 4
ANSWER_PATH_TOPICS = (TOPIC_RECEIVED, TOPIC_STATE, TOPIC_VIEW, TOPIC_ROUTED)
#: Outcome recording: first final status wins, except that a late answer replaces a TIMEOUT. The outbox
#: copy of the turn is dropped with it (the text lives on in memory, not twice).
FINISH_SQL = (
    "UPDATE ingress_turns SET status = %s, error = %s, finished_at = now(), received = NULL "
    "WHERE turn_id = %s AND (status = 'PENDING' OR (status = 'TIMEOUT' AND %s = 'ANSWERED'))"
)

#: An answered turn's tokens: the answering call's prompt + answer tokens replace the text's estimate.
TOKENS_SQL = "UPDATE ingress_turns SET tokens = %s WHERE turn_id = %s"


def charged_tokens(generated: ev.Generated) -> int:
    """What an answered turn counts against a tokens-per-minute budget: the answering call's prompt and
    answer tokens as the endpoint counted them (0: it did not say; the text's estimate stays)."""
    return int(generated.usage.input_tokens + generated.usage.output_tokens)


class TurnStore:
    def __init__(self, settings: IngressSettings, producer: EventProducer, pool: AsyncConnectionPool) -> None:
        self._settings = settings
        self._producer = producer
        self._pool = pool

    def published(self, turn_id: str) -> None:
        """The turn's TurnReceived is on the log: the outbox sweep leaves it alone. Recorded as the ingress's
        own stage rows (INGRESS_STAGE), written behind like every stage's (a lost row: one more re-send)."""
        if self._producer.ledger is None:
            self._producer.ledger = EmittedLedger(self._pool)
        self._producer.ledger.add(INGRESS_STAGE, turn_id)

    async def accept(
        self, envelope: ev.TurnEnvelope, text: str, key_id: str | None = None, tokens: int | None = None
    ) -> ev.TurnReceived:
        """Give the turn its per-user seq and record it (with its event, the outbox copy) in one
        transaction: a seq is never taken without its turn, so no later view waits for a turn that never
        was. Two round trips (pipelined): the seq, then the row with the commit. Retried on a broken
        connection; a retry after a commit whose answer was lost finds the row. `key_id` (the caller's key)
        and `tokens` (the text's estimate) are what its budgets count (mars_ingress.budget_store)."""
        for attempt in range(1, ACCEPT_ATTEMPTS + 1):
            try:
                async with self._pool.connection() as conn, conn.pipeline(), conn.transaction():
                    if attempt > 1:
                        cur = await conn.execute(
                            "SELECT received FROM ingress_turns WHERE turn_id = %s", (envelope.turn_id,)
                        )
                        done = await cur.fetchone()
                        if done is not None and done[0] is not None:
                            return ev.TurnReceived.FromString(bytes(done[0]))
                    cur = await conn.execute(
                        """
                        INSERT INTO ingress_user_seq (tenant, user_id, last_seq) VALUES (%s, %s, 1)
                        ON CONFLICT (tenant, user_id) DO UPDATE SET last_seq = ingress_user_seq.last_seq + 1
                        RETURNING last_seq
                        """,
                        (envelope.tenant, envelope.user_id),
                    )
                    row = await cur.fetchone()
                    assert row is not None
                    envelope.seq = int(row[0])
                    received = ev.TurnReceived(turn=envelope, text=text)
                    await conn.execute(
                        "INSERT INTO ingress_turns (turn_id, tenant, user_id, session_id, seq, status, "
                        "deadline_at, received, text_digest, key_id, tokens) "
                        "VALUES (%s, %s, %s, %s, %s, 'PENDING', to_timestamp(%s / 1000.0), %s, %s, %s, %s)",
                        (
                            envelope.turn_id,
                            envelope.tenant,
                            envelope.user_id,
                            envelope.session_id,
                            envelope.seq,
                            envelope.deadline_ms,
                            received.SerializeToString(),
                            history.text_digest(envelope.tenant, envelope.user_id, envelope.session_id, text),
                            key_id,
                            tokens,
                        ),
                    )
                    return received
            except Exception as exc:
                if not is_transient(exc) or attempt == ACCEPT_ATTEMPTS:
                    raise
                log.warning("accepting turn %s hit %r; retrying", envelope.turn_id, exc)
                await asyncio.sleep(0.2 * attempt)
        raise AssertionError("unreachable")

    async def record(self, turn_id: str, status: str, error: str | None = None) -> None:
        async with self._pool.connection() as conn:
            await conn.execute(FINISH_SQL, (status, error, turn_id, status))  # type: ignore[arg-type]

    async def finish(self, turn_id: str, status: str, error: str | None = None) -> None:
        """The waiting call records its outcome; on a database hiccup it leaves that to the outcome group."""
        try:
            await self.record(turn_id, status, error)
        except Exception as exc:
            if not is_transient(exc):
                raise
            # The outcome group records ANSWERED / FAILED from the log and the sweep records TIMEOUT.
            log.warning("recording turn %s as %s failed: %r", turn_id, status, exc)

    # --- outcomes (shared group: whichever replica reads the event records it) -------------------

    async def record_generated(self, event: ev.Generated) -> None:
        if event.imported:
            return  # recorded as IMPORTED when it was imported
        if event.status == ev.OK:
            # The answer's tokens count against its budgets from now on (debt), in the same round trip.
            used = charged_tokens(event)
            async with self._pool.connection() as conn, conn.pipeline():
                await conn.execute(FINISH_SQL, ("ANSWERED", None, event.turn.turn_id, "ANSWERED"))
                if used > 0:
                    await conn.execute(TOKENS_SQL, (used, event.turn.turn_id))
        else:
            await self.record(event.turn.turn_id, "FAILED", event.error or "no model could answer")

    async def record_dead_letter(self, letter: ev.DeadLetter) -> None:
        # Only the answer path's dead letters fail a turn; one from the learning path (memory writer, judge)
        # comes after the answer and must not turn an ANSWERED turn read out of order into FAILED.
        if letter.turn_id and self._settings.topics.base(letter.source_topic) in ANSWER_PATH_TOPICS:
            await self.record(letter.turn_id, "FAILED", f"turn failed in {letter.consumer}: {letter.reason}")

    async def record_judged(self, event: ev.Judged) -> None:
        """What the turn cost, for its tenant's daily spend (mars_ingress.quota.SPENT_TODAY_SQL)."""
        try:
            cost = quota.judged_cost(event)
        except ValueError as exc:  # a cost no judge makes: not counted, dead-lettered
            raise PoisonEvent(str(exc)) from None
        async with self._pool.connection() as conn:
            await conn.execute(quota.JUDGED_COST_SQL, (cost, event.turn.turn_id))

    async def record_stored(self, event: ev.MemoryCommitted) -> None:
        """Memory stored an imported pair: ImportHistory's wait counts it (turns answered live are not
        waited on, and cost no write here)."""
        if event.imported and event.stored:
            async with self._pool.connection() as conn:
                await conn.execute(
                    "UPDATE ingress_turns SET memory_stored_at = now() "
                    "WHERE turn_id = %s AND memory_stored_at IS NULL",
                    (event.turn.turn_id,),
                )

    async def sweep_orphans(self) -> None:
        """Turns whose waiting replica died: published again from the outbox when they never got past
        ingress and still have time, else TIMEOUT with the reason once their deadline has passed, never
        PENDING for good (a late answer still turns them ANSWERED)."""
        while True:
            try:
                await self._republish_unsent()
                async with self._pool.connection() as conn:
                    await conn.execute(
                        "UPDATE ingress_turns SET status = 'TIMEOUT', finished_at = now(), received = NULL, "
                        "error = 'no answer before the deadline; the ingress replica holding the call stopped' "
                        "WHERE status = 'PENDING' AND deadline_at < now() - make_interval(secs => %s)",
                        (self._settings.orphan_grace_s,),
                    )
            except Exception as exc:  # Postgres restarting: try again at the next sweep
                log.warning("orphan sweep failed: %r", exc)
            await asyncio.sleep(self._settings.orphan_sweep_every_s)

    async def _republish_unsent(self) -> None:
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                "SELECT turn_id, received FROM ingress_turns t WHERE status = 'PENDING' "
                "AND republished_at IS NULL AND received IS NOT NULL AND deadline_at > now() "
                "AND created_at < now() - make_interval(secs => %s) AND NOT EXISTS "
                "(SELECT 1 FROM stage_emitted s WHERE s.stage = %s AND s.turn_id = t.turn_id) LIMIT 500",
                (self._settings.republish_after_s, INGRESS_STAGE),
            )
            rows = await cur.fetchall()
        for turn_id, raw in rows:
            event = ev.TurnReceived.FromString(bytes(raw))
            try:
                await self._producer.publish(TOPIC_RECEIVED, event, event.turn, resent=True)
            except Forgotten:  # its user was forgotten since: nothing to send (their rows are going too)
                log.info("turn %s not published again: its user was forgotten", turn_id)
            async with self._pool.connection() as conn:
                # Sent once, and its text is on the topic now: the plaintext copy goes.
                await conn.execute(
                    "UPDATE ingress_turns SET republished_at = now(), received = NULL WHERE turn_id = %s",
                    (turn_id,),
                )
            log.warning("turn %s never left ingress; published it again from the outbox", turn_id)

    async def owner_of(self, turn_id: str) -> tuple[str, int, str, str, str] | None:
        """(session_id, seq, tenant, user_id, status) of a recorded turn, or None."""
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                "SELECT session_id, seq, tenant, user_id, status FROM ingress_turns WHERE turn_id = %s",
                (turn_id,),
            )
            row = await cur.fetchone()
        return None if row is None else (str(row[0]), int(row[1]), str(row[2]), str(row[3]), str(row[4]))
