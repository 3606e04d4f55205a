"""History import at the ingress: a user's recorded turn pairs (mars_ingress.history) take seqs and are recorded as
IMPORTED, the context they leave active goes to the state service (its table, through its RPC), and they
are published as imported generated events, which the memory writer stores through its normal commit. Used
by ImportHistory and by a turn that brings earlier messages MARS does not hold."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

import grpc
from mars.bus.producer import EventProducer
from mars.config import SCHEMA_VERSION, TOPIC_GENERATED
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from psycopg_pool import AsyncConnectionPool

from mars_ingress import history
from mars_ingress.admission import Admission, InvalidTurn, TurnFailed
from mars_ingress.settings import IngressSettings
from mars_ingress.state_context import StateContextClient

log = logging.getLogger(__name__)


class HistoryImport:
    def __init__(
        self,
        settings: IngressSettings,
        producer: EventProducer,
        pool: AsyncConnectionPool,
        admission: Admission,
        state: StateContextClient,
    ) -> None:
        self._settings = settings
        self._producer = producer
        self._pool = pool
        self._admission = admission
        self._state = state

    def checked_pairs(self, request: svc.ImportHistoryRequest) -> list[history.ImportedPair]:
        """The request's pairs (mars_ingress.history.check_history), or InvalidTurn naming the first bad one."""
        try:
            return history.check_history(
                request.tenant, request.user_id, request.turns, self._settings.max_text_chars
            )
        except history.InvalidHistory as exc:
            raise InvalidTurn(str(exc)) from None

    async def import_requested(
        self,
        request: svc.ImportHistoryRequest,
        pairs: list[history.ImportedPair],
        caller_remaining_s: Callable[[], float | None],
    ) -> svc.ImportHistoryReply:
        """ImportHistory once its pairs are checked: import them and, when the request asks to wait, wait
        for memory to store them (until the caller's deadline, less half a second to answer in);
        TurnFailed (DEADLINE_EXCEEDED) when it has not stored them all by then. `caller_remaining_s` is
        asked after the import, so the wait is what is left of the call then."""
        seqs, fresh = await self.import_pairs(request.tenant, request.user_id, pairs)
        if request.wait:
            remaining = caller_remaining_s()
            wait_s = self._settings.import_wait_s if remaining is None else max(0.0, remaining - 0.5)
            stored = await self.wait_stored([p.turn_id for p in pairs], wait_s)
            if stored < len(pairs):
                raise TurnFailed(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{len(pairs)} pairs recorded and published; memory has stored {stored} of them so far "
                    "and goes on (make the same call again to wait more: nothing is imported twice)",
                )
        log.info(
            "import: %d pairs for user %s of tenant %s (%d new)",
            len(pairs),
            request.user_id,
            request.tenant,
            fresh,
        )
        return svc.ImportHistoryReply(
            imported=fresh,
            already_imported=len(pairs) - fresh,
            turn_ids=[p.turn_id for p in pairs],
            last_seq=max(seqs),
        )

    async def import_pairs(
        self, tenant: str, user_id: str, pairs: list[history.ImportedPair]
    ) -> tuple[list[int], int]:
        """Record the pairs, hand their context to the state service, publish them: each pair's seq and how
        many are new. Every step is safe to make again, so a failed call is simply made again."""
        seqs, fresh = await self.record(tenant, user_id, pairs)
        await self._state.hand_over(tenant, user_id, pairs, max(seqs))
        await self.publish(tenant, user_id, pairs, seqs)
        return seqs, fresh

    async def publish(
        self, tenant: str, user_id: str, pairs: list[history.ImportedPair], seqs: list[int]
    ) -> None:
        """Each recorded pair as an imported generated event. Every pair is published, the ones recorded
        before too: a call that failed after recording is simply made again (the memory writer stores each
        turn id once)."""
        data_key_id = await self._producer.data_key_for(tenant, user_id)
        depths = history.thread_depths(pairs)
        for pair, seq, depth in zip(pairs, seqs, depths, strict=True):
            envelope = ev.TurnEnvelope(
                turn_id=pair.turn_id,
                tenant=tenant,
                user_id=user_id,
                session_id=pair.session_id,
                seq=seq,
                received_at_ms=int(time.time() * 1000),
                schema_version=SCHEMA_VERSION,
                data_key_id=data_key_id,
            )
            event = ev.Generated(
                turn=envelope,
                status=ev.OK,
                model=history.IMPORTED_BACKEND,
                text=pair.assistant_text,
                query=pair.user_text,
                state=history.imported_state(pair, depth),
                imported=True,
            )
            await self._producer.publish(TOPIC_GENERATED, event, envelope)

    async def import_unheld(self, req: svc.TurnRequest) -> int:
        """A turn's earlier messages (`history`) that MARS does not hold in the turn's session, imported
        before the turn takes its seq (so its view, which waits for earlier seqs, sees them). How many."""
        session = req.session_id or "default"
        digests = [history.text_digest(req.tenant, req.user_id, session, t.user_text) for t in req.history]
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                "SELECT text_digest, count(*) FROM ingress_turns WHERE tenant = %s AND user_id = %s "
                "AND text_digest = ANY(%s) AND status <> 'FAILED' GROUP BY text_digest",
                (req.tenant, req.user_id, digests),
            )
            held = Counter({str(d): int(n) for d, n in await cur.fetchall()})
        turns = history.unheld_turns(session, req.history, digests, held)
        if not turns:
            return 0
        pairs = history.check_history(req.tenant, req.user_id, turns, self._settings.max_text_chars)
        self._admission.charge_imported(req.tenant, pairs)
        await self.import_pairs(req.tenant, req.user_id, pairs)
        return len(pairs)

    async def record(
        self, tenant: str, user_id: str, pairs: list[history.ImportedPair]
    ) -> tuple[list[int], int]:
        """Each pair's seq (a pair imported before keeps its own) and how many are new. New pairs take the
        next seqs of the user and are recorded as IMPORTED in one transaction."""
        turn_ids = [p.turn_id for p in pairs]
        async with self._pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "SELECT turn_id, seq FROM ingress_turns WHERE turn_id = ANY(%s)", (turn_ids,)
            )
            known = {str(tid): int(seq) for tid, seq in await cur.fetchall()}
            new = [p for p in pairs if p.turn_id not in known]
            if new:
                cur = await conn.execute(
                    """
                    INSERT INTO ingress_user_seq (tenant, user_id, last_seq) VALUES (%s, %s, %s)
                    ON CONFLICT (tenant, user_id) DO UPDATE SET last_seq = ingress_user_seq.last_seq + %s
                    RETURNING last_seq
                    """,
                    (tenant, user_id, len(new), len(new)),
                )
                row = await cur.fetchone()
                assert row is not None
                first = int(row[0]) - len(new) + 1
                for offset, pair in enumerate(new):
                    known[pair.turn_id] = first + offset
                async with conn.cursor() as many:
                    await many.executemany(
                        "INSERT INTO ingress_turns (turn_id, tenant, user_id, session_id, seq, status, "
                        "finished_at, text_digest) VALUES (%s, %s, %s, %s, %s, 'IMPORTED', now(), %s)",
                        [
                            (
                                p.turn_id,
                                tenant,
                                user_id,
                                p.session_id,
                                known[p.turn_id],
                                history.text_digest(tenant, user_id, p.session_id, p.user_text),
                            )
                            for p in new
                        ],
                    )
        return [known[t] for t in turn_ids], len(new)

    async def wait_stored(self, turn_ids: list[str], wait_s: float) -> int:
        """How many of `turn_ids` the memory service has stored (its commit events, recorded by the outcome
        group), once all are or when `wait_s` ran out."""
        deadline = time.monotonic() + wait_s
        while True:
            async with self._pool.connection() as conn:
                cur = await conn.execute(
                    "SELECT count(*) FROM ingress_turns WHERE turn_id = ANY(%s) AND memory_stored_at IS NOT NULL",
                    (turn_ids,),
                )
                row = await cur.fetchone()
            stored = int(row[0]) if row else 0
            if stored >= len(turn_ids) or time.monotonic() >= deadline:
                return stored
            await asyncio.sleep(0.2)
