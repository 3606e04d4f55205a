"""Ingress: the public gRPC API. Validates a turn, assigns turn_id and the per-user seq, publishes it,
and answers the waiting call when the turn's generated event (or its dead letter) comes back."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import grpc
from mars import auth, forget, history, metrics, topology
from mars.auth import AuthError, KeyVerifier, PermissionDenied, Principal
from mars.bus import EventProducer, StageConsumer, Subscription, is_transient
from mars.config import (
    SCHEMA_VERSION,
    STATE_STAGE,
    TOPIC_CONTROL,
    TOPIC_DEAD_LETTER,
    TOPIC_FEEDBACK,
    TOPIC_GENERATED,
    TOPIC_RECEIVED,
    TOPIC_ROUTED,
    TOPIC_STATE,
    TOPIC_TOKENS,
    TOPIC_VIEW,
)
from mars.data_keys import Forgotten
from mars.db import pg_text
from mars.domain.feedback import rating_from
from mars.domain.text import control_character
from mars.domain.turn_options import InvalidOption, parse_turn_options
from mars.quota import Quotas, Refusal, SpendCache, TenantLimits, pool_spend, spend_refusal
from mars.runtime import GrpcBinding, ServiceContext, ServiceParts, run
from mars.telemetry import context_from_metadata, current_trace_id, step
from mars.tokens import load_counter
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from opentelemetry import trace
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from mars_ingress.schema import MIGRATIONS
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

_ID = auth.ID_PATTERN
#: The stage that consumes each answer-path topic, for the caller's message when a turn is dead-lettered.
STAGE_OF_TOPIC = {
    TOPIC_RECEIVED: "state",
    TOPIC_STATE: "memory",
    TOPIC_VIEW: "router",
    TOPIC_ROUTED: "dispatch",
}


class InvalidTurn(ValueError):
    pass


def check_no_control(field_name: str, value: str) -> None:
    """InvalidTurn when `value` holds a C0 control character other than tab, newline or return."""
    found = control_character(value)
    if found is not None:
        raise InvalidTurn(
            f"{field_name} contains the control character U+{ord(value[found]):04X} at position "
            f"{found}; only tab, newline and carriage return are allowed"
        )


def check_fields(**fields: str) -> None:
    """`check_no_control` on each named field of a request."""
    for field_name, value in fields.items():
        check_no_control(field_name, value)


def check_user_ids(tenant: str, user_id: str) -> None:
    """InvalidTurn unless both ids are usable (an administrative call names its user exactly)."""
    for field_name, value in (("tenant", tenant), ("user_id", user_id)):
        check_no_control(field_name, value)
        if not _ID.match(value):
            raise InvalidTurn(f"{field_name} must match {_ID.pattern}")


def check_feedback(request: svc.FeedbackRequest, max_chars: int) -> None:
    """InvalidTurn unless the feedback names a turn with usable ids and a comment within the turn limit (a
    longer one would be dead-lettered by the stages)."""
    check_fields(
        tenant=request.tenant, user_id=request.user_id, turn_id=request.turn_id, comment=request.comment
    )
    if not request.turn_id:
        raise InvalidTurn("turn_id is required")
    if len(request.comment) > max_chars:
        raise InvalidTurn(f"comment has {len(request.comment)} characters; the limit is {max_chars}")


def validate_turn(req: svc.TurnRequest, max_chars: int) -> dict[str, str]:
    """Bad input gets INVALID_ARGUMENT before anything is written."""
    check_fields(tenant=req.tenant, user_id=req.user_id, session_id=req.session_id, text=req.text)
    if not req.tenant.strip():
        raise InvalidTurn("tenant is required")
    if not req.user_id.strip():
        raise InvalidTurn("user_id is required")
    check_user_ids(req.tenant, req.user_id)
    if req.session_id and not _ID.match(req.session_id):
        raise InvalidTurn(f"session_id must match {_ID.pattern}")
    if not req.text.strip():
        raise InvalidTurn("text is empty")
    if len(req.text) > max_chars:
        raise InvalidTurn(f"text has {len(req.text)} characters; the limit is {max_chars}")
    try:
        parse_turn_options(req.options)
        history.check_turn_history(req.history, req.session_id or "default", max_chars)
    except (InvalidOption, history.InvalidHistory) as exc:
        raise InvalidTurn(str(exc)) from None
    return dict(req.options)


class TurnFailed(Exception):
    """A turn that ends with a status for the caller. The message is what the caller sees (short, no
    internals); `detail` is what the log and the turn's record get (defaults to the message)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        detail: str = "",
        trailing: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.code = code
        self.detail = detail or message
        self.trailing = trailing


def auth_failure(exc: AuthError) -> TurnFailed:
    code = (
        grpc.StatusCode.PERMISSION_DENIED
        if isinstance(exc, PermissionDenied)
        else grpc.StatusCode.UNAUTHENTICATED
    )
    return TurnFailed(code, str(exc))


def quota_failure(refusal: Refusal) -> TurnFailed:
    """RESOURCE_EXHAUSTED with the wait in the message and in trailing metadata `retry-after-ms`."""
    return TurnFailed(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        refusal.message,
        trailing=(("retry-after-ms", str(refusal.retry_after_ms)),),
    )


def caller_attempt(attempt: ev.GenerationAttempt) -> ev.GenerationAttempt:
    """An arm attempt as the caller sees it: the arm, its outcome kind and its counts, without the error
    text (an upstream's status line, address or message stays in the logs and the event log)."""
    shown = ev.GenerationAttempt()
    shown.CopyFrom(attempt)
    shown.ClearField("error")
    return shown


def unexpected_status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """A status and a plain message for an error that is not the caller's: never a stack trace."""
    if is_transient(exc):
        log.warning("turn not taken: %r", exc)
        return (
            grpc.StatusCode.UNAVAILABLE,
            "MARS is briefly unavailable (its database or broker is restarting); the turn was not answered, "
            "retry it",
        )
    log.exception("turn failed unexpectedly")
    return grpc.StatusCode.INTERNAL, "internal error in ingress (logged); the turn was not answered"


class IngressServicer(svc_grpc.IngressServicer):
    def __init__(self, settings: IngressSettings, producer: EventProducer, pool: AsyncConnectionPool) -> None:
        self._settings = settings
        self._producer = producer
        self._pool = pool
        self._waiting: dict[str, asyncio.Future[ev.Generated]] = {}
        #: Token queues of streaming Converse turns, by turn_id.
        self._streams: dict[str, asyncio.Queue[ev.TokenChunk]] = {}
        self._tracer = trace.get_tracer("mars.ingress")
        self._keys = KeyVerifier(auth.pool_lookup(pool), settings.auth_cache_ttl_s)
        self._quotas = Quotas(
            TenantLimits(
                turns_per_s=settings.quota_turns_per_s,
                turn_burst=settings.quota_turn_burst,
                tokens_per_min=settings.quota_tokens_per_min,
                usd_per_day=settings.quota_usd_per_day,
            ),
            settings.quota_tenants,
            settings.quota_replicas,
        )
        self._spend = SpendCache(pool_spend(pool), settings.quota_spend_cache_s, time.monotonic)
        self._count_tokens = load_counter(None)

    # --- who is calling, and may they -----------------------------------------------------------

    async def _authenticated(self, metadata: object) -> Principal | None:
        """`_authenticate` for a turn: a refused key is counted as a rejected turn (no tenant label)."""
        try:
            return await self._authenticate(metadata)
        except Exception:
            metrics.record_turn("rejected", "")
            raise

    async def _authenticate(self, metadata: object) -> Principal | None:
        """The principal of the call's API key (None when auth is off); TurnFailed otherwise."""
        if not self._settings.auth_required:
            return None
        try:
            key = auth.bearer_token(metadata)  # type: ignore[arg-type]
            return await self._keys.verify(key)
        except AuthError as exc:
            raise auth_failure(exc) from None

    async def _admit(self, req: svc.TurnRequest, principal: Principal | None) -> dict[str, str]:
        """Scope, validation and quotas of one turn; fills the tenant (and a user-scoped key's user) from
        the key into `req`. Returns the turn's options."""
        if principal is not None:
            try:
                req.tenant, req.user_id = auth.authorize(principal, req.tenant, req.user_id)
            except AuthError as exc:
                raise auth_failure(exc) from None
        options = validate_turn(req, self._settings.max_text_chars)
        limits = self._quotas.limits(req.tenant)
        # Counting the text's tokens is work on the answer path: only when a token quota asks for it.
        text_tokens = self._count_tokens(req.text) if limits.tokens_per_min > 0 else 0
        refusal = self._quotas.admit(req.tenant, text_tokens, time.monotonic())
        limit_usd = limits.usd_per_day
        if refusal is None and limit_usd > 0:
            refusal = spend_refusal(
                req.tenant, await self._spend.spent(req.tenant), limit_usd, datetime.now(UTC)
            )
        if refusal is not None:
            log.info("turn of tenant %s refused: %s", req.tenant, refusal.message)
            raise quota_failure(refusal)
        return options

    # --- reply correlation -------------------------------------------------------------------

    async def on_generated(self, event: ev.Generated) -> None:
        fut = self._waiting.get(event.turn.turn_id)
        if fut is not None and not fut.done():
            fut.set_result(event)

    async def on_token(self, chunk: ev.TokenChunk) -> None:
        queue = self._streams.get(chunk.turn.turn_id)
        if queue is not None:
            queue.put_nowait(chunk)

    async def on_dead_letter(self, letter: ev.DeadLetter) -> None:
        fut = self._waiting.get(letter.turn_id)
        if fut is not None and not fut.done():
            # The caller gets the stage and a reference; the reason (exception text, database error) is
            # for the log and the turn's record only.
            stage = STAGE_OF_TOPIC.get(self._settings.topics.base(letter.source_topic) or "", "pipeline")
            detail = f"turn failed in {letter.consumer}: {letter.reason}"
            log.error("turn %s dead-lettered: %s", letter.turn_id, detail)
            fut.set_exception(
                TurnFailed(
                    grpc.StatusCode.INTERNAL,
                    f"turn failed in the {stage} stage; reference {letter.turn_id}",
                    detail=detail,
                )
            )

    async def on_forgotten(self, event: ev.UserForgotten) -> None:
        """Every replica: the forgotten user's keys (deleted) stop working here now, not after the cache TTL."""
        self._keys.forget_user(event.tenant, event.user_id)
        self._producer.forget_user(event.tenant, event.user_id)

    async def _republish_unsent(self) -> None:
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                "SELECT turn_id, received FROM ingress_turns t WHERE status = 'PENDING' "
                "AND republished_at IS NULL AND received IS NOT NULL AND deadline_at > now() "
                "AND created_at < now() - make_interval(secs => %s) AND NOT EXISTS "
                "(SELECT 1 FROM stage_emitted s WHERE s.stage = %s AND s.turn_id = t.turn_id) LIMIT 500",
                (self._settings.republish_after_s, STATE_STAGE),
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

    # --- turn path -----------------------------------------------------------------------------

    async def _accept(self, envelope: ev.TurnEnvelope, text: str) -> ev.TurnReceived:
        """Give the turn its per-user seq and record it (with its event, the outbox copy) in one
        transaction: a seq is never taken without its turn, so no later view waits for a turn that never
        was. Retried on a broken connection; a retry after a commit whose answer was lost finds the row."""
        for attempt in range(1, ACCEPT_ATTEMPTS + 1):
            try:
                async with self._pool.connection() as conn, conn.transaction():
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
                        "deadline_at, received, text_digest) "
                        "VALUES (%s, %s, %s, %s, %s, 'PENDING', to_timestamp(%s / 1000.0), %s, %s)",
                        (
                            envelope.turn_id,
                            envelope.tenant,
                            envelope.user_id,
                            envelope.session_id,
                            envelope.seq,
                            envelope.deadline_ms,
                            received.SerializeToString(),
                            history.text_digest(envelope.tenant, envelope.user_id, envelope.session_id, text),
                        ),
                    )
                    return received
            except Exception as exc:
                if not is_transient(exc) or attempt == ACCEPT_ATTEMPTS:
                    raise
                log.warning("accepting turn %s hit %r; retrying", envelope.turn_id, exc)
                await asyncio.sleep(0.2 * attempt)
        raise AssertionError("unreachable")

    async def _record(self, turn_id: str, status: str, error: str | None = None) -> None:
        async with self._pool.connection() as conn:
            await conn.execute(FINISH_SQL, (status, error, turn_id, status))  # type: ignore[arg-type]

    async def _finish(self, turn_id: str, status: str, error: str | None = None) -> None:
        """The waiting call records its outcome; on a database hiccup it leaves that to the outcome group."""
        try:
            await self._record(turn_id, status, error)
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
            await self._record(event.turn.turn_id, "ANSWERED")
        else:
            await self._record(event.turn.turn_id, "FAILED", event.error or "no model could answer")

    async def record_dead_letter(self, letter: ev.DeadLetter) -> None:
        # Only the answer path's dead letters fail a turn; one from the learning path (memory writer, judge)
        # comes after the answer and must not turn an ANSWERED turn read out of order into FAILED.
        if letter.turn_id and self._settings.topics.base(letter.source_topic) in ANSWER_PATH_TOPICS:
            await self._record(letter.turn_id, "FAILED", f"turn failed in {letter.consumer}: {letter.reason}")

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

    async def _turn(
        self,
        req: svc.TurnRequest,
        metadata: object,
        principal: Principal | None,
        tokens: asyncio.Queue[ev.TokenChunk] | None = None,
        caller_remaining_s: float | None = None,
    ) -> svc.TurnReply:
        """One turn, counted in mars.turns by how it ended (SendTurn, Converse and streamed turns alike)."""
        started = time.perf_counter()
        # The authenticated tenant only: a tenant name the caller typed must not become a metric label.
        tenant = principal.tenant if principal is not None else ""
        try:
            reply = await self._answer(req, metadata, principal, tokens, caller_remaining_s)
        except BaseException as exc:
            metrics.record_turn(metrics.turn_status(exc), tenant, (time.perf_counter() - started) * 1000)
            raise
        metrics.record_turn("answered", tenant, (time.perf_counter() - started) * 1000)
        return reply

    async def _answer(
        self,
        req: svc.TurnRequest,
        metadata: object,
        principal: Principal | None,
        tokens: asyncio.Queue[ev.TokenChunk] | None = None,
        caller_remaining_s: float | None = None,
    ) -> svc.TurnReply:
        options = await self._admit(req, principal)
        started = time.perf_counter()
        parent = context_from_metadata(metadata)  # type: ignore[arg-type]
        with self._tracer.start_as_current_span(
            "ingress SendTurn", context=parent, kind=trace.SpanKind.SERVER
        ) as span:
            wait_s = self._settings.turn_timeout_s
            if caller_remaining_s is not None:
                wait_s = min(wait_s, caller_remaining_s)
            now_ms = int(time.time() * 1000)
            envelope = ev.TurnEnvelope(
                turn_id=uuid.uuid4().hex,
                tenant=req.tenant,
                user_id=req.user_id,
                session_id=req.session_id or "default",
                received_at_ms=now_ms,
                schema_version=SCHEMA_VERSION,
                options=options,
                deadline_ms=now_ms + int(wait_s * 1000),
            )
            span.set_attribute("mars.turn_id", envelope.turn_id)
            span.set_attribute("mars.service", "ingress")
            if req.history:
                with step("ingress history"):
                    imported = await self._import_unheld(req)
                span.set_attribute("mars.history_imported", imported)
            with step("ingress accept"):
                envelope.data_key_id = await self._producer.data_key_for(req.tenant, req.user_id)
                received = await self._accept(envelope, req.text)
            envelope = received.turn
            seq = envelope.seq
            fut: asyncio.Future[ev.Generated] = asyncio.get_running_loop().create_future()
            self._waiting[envelope.turn_id] = fut
            if tokens is not None:
                self._streams[envelope.turn_id] = tokens
            try:
                try:
                    await self._producer.publish(TOPIC_RECEIVED, received, envelope)
                except Exception as exc:
                    if not is_transient(exc):
                        raise
                    # Recorded already: the outbox sweep publishes it again; the call keeps waiting.
                    log.warning(
                        "publishing turn %s failed (%r); the outbox will send it", envelope.turn_id, exc
                    )
                try:
                    generated = await asyncio.wait_for(fut, timeout=wait_s)
                except TimeoutError:
                    await self._finish(envelope.turn_id, "TIMEOUT", "no answer before the deadline")
                    raise TurnFailed(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"turn {envelope.turn_id} got no answer in {wait_s:g}s; "
                        "it is recorded and may still complete",
                    ) from None
                except TurnFailed as exc:
                    await self._finish(envelope.turn_id, "FAILED", exc.detail)
                    raise
            finally:
                self._waiting.pop(envelope.turn_id, None)
                self._streams.pop(envelope.turn_id, None)

            if generated.status != ev.OK:
                # Upstream error bodies and addresses go to the log and the record, the arm names (the
                # pool's own labels) and a reference to the caller.
                chain = "; ".join(f"{a.arm}: {a.error}" for a in generated.attempts)
                log.warning("turn %s: no model could answer: %s", envelope.turn_id, chain or generated.error)
                await self._finish(envelope.turn_id, "FAILED", generated.error)
                arms = ", ".join(dict.fromkeys(a.arm for a in generated.attempts)) or "none"
                raise TurnFailed(
                    grpc.StatusCode.UNAVAILABLE,
                    f"no model could answer (arms tried: {arms}); reference {envelope.turn_id}",
                )
            # ANSWERED is recorded by the outcome group from the same event (record_generated), off the
            # answer path: writing it here too cost a Postgres transaction per turn before the reply.
            return svc.TurnReply(
                turn_id=envelope.turn_id,
                seq=seq,
                text=generated.text,
                model=generated.model,
                state=generated.state,
                view_blocks=len(generated.packed_block_ids),
                view_tokens=generated.packed_prompt_tokens,
                cost_usd=generated.cost_usd,
                controller_cost_usd=generated.controller_cost_usd,
                latency_ms=(time.perf_counter() - started) * 1000,
                attempts=[caller_attempt(a) for a in generated.attempts],
                trace_id=current_trace_id(),
                usage=generated.usage,
            )

    async def SendTurn(self, request: svc.TurnRequest, context: grpc.aio.ServicerContext) -> svc.TurnReply:
        try:
            metadata = context.invocation_metadata()
            principal = await self._authenticated(metadata)
            return await self._turn(request, metadata, principal, caller_remaining_s=context.time_remaining())
        except Exception as exc:
            await _abort(context, exc)
        raise AssertionError("unreachable")

    async def Converse(
        self, request_iterator: AsyncIterator[svc.TurnRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[svc.TurnReply]:
        metadata = context.invocation_metadata()
        try:
            await self._authenticated(metadata)  # a bad key ends the stream before its first turn
        except Exception as exc:
            await _abort(context, exc)
        async for request in request_iterator:
            try:
                # Each turn checks the key again (cached for MARS_AUTH_CACHE_TTL_S): a key revoked while
                # the stream is open stops opening turns within that time, as on unary calls.
                principal = await self._authenticated(metadata)
                if request.options.get("stream") == "true":
                    async for reply in self._streamed_turn(request, metadata, principal):
                        yield reply
                else:
                    yield await self._turn(request, metadata, principal)
            except Exception as exc:
                await _abort(context, exc)

    async def _streamed_turn(
        self, request: svc.TurnRequest, metadata: object, principal: Principal | None
    ) -> AsyncIterator[svc.TurnReply]:
        """Partial replies as dispatch streams the answer, then the final reply (always complete: pieces
        that arrive after it are dropped, since the final text already holds them)."""
        tokens: asyncio.Queue[ev.TokenChunk] = asyncio.Queue()
        turn = asyncio.create_task(self._turn(request, metadata, principal, tokens))

        def partial(chunk: ev.TokenChunk) -> svc.TurnReply:
            return svc.TurnReply(
                turn_id=chunk.turn.turn_id,
                seq=chunk.turn.seq,
                model=chunk.arm,
                partial=True,
                delta=chunk.text,
                restart=chunk.restart,
            )

        try:
            while not turn.done():
                getter = asyncio.ensure_future(tokens.get())
                await asyncio.wait({getter, turn}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield partial(getter.result())
                else:
                    getter.cancel()
            while not tokens.empty():
                yield partial(tokens.get_nowait())
            yield turn.result()
        finally:
            if not turn.done():
                turn.cancel()

    async def SubmitFeedback(
        self, request: svc.FeedbackRequest, context: grpc.aio.ServicerContext
    ) -> svc.FeedbackReply:
        try:
            principal = await self._authenticate(context.invocation_metadata())
            if principal is not None:
                request.tenant, request.user_id = auth.authorize(principal, request.tenant, request.user_id)
            check_feedback(request, self._settings.max_text_chars)
            rating = rating_from(request.rating, request.thumbs)
        except AuthError as exc:
            await _abort(context, auth_failure(exc))
        except InvalidTurn as exc:
            await _abort(context, exc)
        except ValueError as exc:  # rating_from's
            await _abort(context, InvalidTurn(str(exc)))
        except Exception as exc:
            await _abort(context, exc)
        try:
            await self._publish_feedback(request, rating)
        except Exception as exc:  # TurnFailed's status, or Postgres or the broker's: a plain one, never their text
            await _abort(context, exc)
        return svc.FeedbackReply(accepted=True)

    async def _publish_feedback(self, request: svc.FeedbackRequest, rating: float) -> None:
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                "SELECT session_id, seq, tenant, user_id, status FROM ingress_turns WHERE turn_id = %s",
                (request.turn_id,),
            )
            row = await cur.fetchone()
        if row is None or (row[2], row[3]) != (request.tenant, request.user_id):
            # Someone else's turn reads as no turn at all: a different answer would tell a caller which
            # (content-hash) turn ids exist in other tenants.
            raise TurnFailed(grpc.StatusCode.NOT_FOUND, f"no turn {request.turn_id} of this tenant and user")
        if row[4] == "IMPORTED":
            raise TurnFailed(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"turn {request.turn_id} is imported history: no model answered it, so there is nothing to rate",
            )
        envelope = ev.TurnEnvelope(
            turn_id=request.turn_id,
            tenant=request.tenant,
            user_id=request.user_id,
            session_id=row[0],
            seq=row[1],
            received_at_ms=int(time.time() * 1000),
            schema_version=SCHEMA_VERSION,
            data_key_id=await self._producer.data_key_for(request.tenant, request.user_id),
        )
        await self._producer.publish(
            TOPIC_FEEDBACK,
            ev.Feedback(turn=envelope, rating=rating, comment=request.comment),
            envelope,
        )

    async def ForgetUser(
        self, request: svc.ForgetUserRequest, context: grpc.aio.ServicerContext
    ) -> svc.ForgetUserReply:
        """Delete every row of the user (mars.forget) and tell every replica to drop what it caches of
        them. An admin key of the user's tenant only; idempotent (a second call deletes 0 rows)."""
        try:
            principal = await self._authenticate(context.invocation_metadata())
            request.tenant = admin_tenant(principal, request.tenant)
            check_user_ids(request.tenant, request.user_id)
        except AuthError as exc:
            await _abort(context, auth_failure(exc))
        except Exception as exc:
            await _abort(context, exc)
        event = forget.control_event(request.tenant, request.user_id)
        try:
            async with self._pool.connection() as conn:
                counts = await forget.forget_user_async(conn, request.tenant, request.user_id)
            self._producer.forget_user(request.tenant, request.user_id)
            await self._producer.send_raw(
                TOPIC_CONTROL, event.SerializeToString(), forget.event_key(request.tenant, request.user_id)
            )
        except Exception as exc:
            await _abort(context, exc)
        log.warning(
            "forget %s: user %s of tenant %s forgotten by key %s: %s",
            event.forget_id,
            request.user_id,
            request.tenant,
            principal.key_id if principal is not None else "-",
            ", ".join(f"{t}={n}" for t, n in counts.items() if n),
        )
        return svc.ForgetUserReply(forget_id=event.forget_id, rows_deleted=counts)

    async def WhoAmI(self, request: svc.WhoAmIRequest, context: grpc.aio.ServicerContext) -> svc.WhoAmIReply:
        """The call's key, verified: whom it acts for (empty with MARS_AUTH_REQUIRED=false)."""
        try:
            principal = await self._authenticate(context.invocation_metadata())
        except Exception as exc:
            await _abort(context, exc)
        if principal is None:
            return svc.WhoAmIReply()
        return svc.WhoAmIReply(
            tenant=principal.tenant,
            user_id=principal.user_id or "",
            admin=principal.admin,
            key_id=principal.key_id,
        )

    async def ImportHistory(
        self, request: svc.ImportHistoryRequest, context: grpc.aio.ServicerContext
    ) -> svc.ImportHistoryReply:
        """Record a user's recorded turn pairs (mars.history) and publish each as an imported generated
        event: the memory writer stores it through its normal, idempotent commit. Admin key only."""
        try:
            principal = await self._authenticate(context.invocation_metadata())
            request.tenant = admin_tenant(principal, request.tenant, "importing history")
            check_user_ids(request.tenant, request.user_id)
            pairs = history.check_history(
                request.tenant, request.user_id, request.turns, self._settings.max_text_chars
            )
        except AuthError as exc:
            await _abort(context, auth_failure(exc))
        except history.InvalidHistory as exc:
            await _abort(context, InvalidTurn(str(exc)))
        except Exception as exc:
            await _abort(context, exc)
        try:
            seqs, fresh = await self._record_imported(request.tenant, request.user_id, pairs)
            await self._publish_imported(request.tenant, request.user_id, pairs, seqs)
            if request.wait:  # the wait reads Postgres too: its failures get the same plain status
                remaining = context.time_remaining()
                wait_s = self._settings.import_wait_s if remaining is None else max(0.0, remaining - 0.5)
                stored = await self._wait_stored([p.turn_id for p in pairs], wait_s)
                if stored < len(pairs):
                    raise TurnFailed(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"{len(pairs)} pairs recorded and published; memory has stored {stored} of them so far "
                        "and goes on (make the same call again to wait more: nothing is imported twice)",
                    )
        except Exception as exc:
            await _abort(context, exc)
        last_seq = max(seqs)
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
            last_seq=last_seq,
        )

    async def _publish_imported(
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

    async def _import_unheld(self, req: svc.TurnRequest) -> int:
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
        if self._quotas.limits(req.tenant).tokens_per_min > 0:  # imported text is the tenant's text too
            tokens = sum(self._count_tokens(p.user_text) + self._count_tokens(p.assistant_text) for p in pairs)
            self._quotas.charge_tokens(req.tenant, tokens, time.monotonic())
        seqs, _ = await self._record_imported(req.tenant, req.user_id, pairs)
        await self._publish_imported(req.tenant, req.user_id, pairs, seqs)
        return len(pairs)

    async def _record_imported(
        self, tenant: str, user_id: str, pairs: list[history.ImportedPair]
    ) -> tuple[list[int], int]:
        """Each pair's seq (a pair imported before keeps its own) and how many are new. New pairs take the
        next seqs of the user and are recorded as IMPORTED in one transaction, and the state service's
        active context becomes the thread they leave active (unless a later turn moved it on)."""
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
                recent, depth = history.last_thread_context(pairs)
                await conn.execute(
                    history.UPSERT_STATE_CONTEXT_SQL,
                    (
                        tenant,
                        user_id,
                        Jsonb([pg_text(t) for t in recent]),
                        depth,
                        max(known.values()),
                        pairs[-1].session_id,
                    ),
                )
        return [known[t] for t in turn_ids], len(new)

    async def _wait_stored(self, turn_ids: list[str], wait_s: float) -> int:
        """How many of `turn_ids` the memory service has stored, once all are or when `wait_s` ran out."""
        deadline = time.monotonic() + wait_s
        while True:
            async with self._pool.connection() as conn:
                cur = await conn.execute(
                    "SELECT count(*) FROM memory_records WHERE turn_id = ANY(%s)", (turn_ids,)
                )
                row = await cur.fetchone()
            stored = int(row[0]) if row else 0
            if stored >= len(turn_ids) or time.monotonic() >= deadline:
                return stored
            await asyncio.sleep(0.2)


def admin_tenant(principal: Principal | None, tenant: str, action: str = "forgetting a user") -> str:
    """The tenant an administrative call acts on: the key's (a request naming another is PermissionDenied),
    and only with an admin key that is not limited to one user. No principal (auth off): the request's."""
    if principal is None:
        if not tenant:
            raise InvalidTurn("tenant is required")
        return tenant
    if not principal.admin or principal.user_id is not None:
        raise PermissionDenied(
            f"API key {principal.key_id} is not an admin key of tenant {principal.tenant!r}; "
            f"{action} takes one (`mars tenant create --admin`)"
        )
    tenant, _ = auth.authorize(principal, tenant, "")
    return tenant


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """End the call with the status for `exc`: the caller's mistake, a refusal, or a failure (a plain
    message, never internals)."""
    if isinstance(exc, InvalidTurn):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, TurnFailed):
        await context.abort(exc.code, str(exc), trailing_metadata=exc.trailing)
    await context.abort(*unexpected_status(exc))


async def build(ctx: ServiceContext) -> ServiceParts:
    settings = ctx.settings
    assert isinstance(settings, IngressSettings)
    servicer = IngressServicer(settings, ctx.producer, ctx.pool)
    # Every replica reads every reply (a call waits on the replica it came to) ...
    replies = StageConsumer(
        settings,
        ctx.producer,
        "ingress",
        "ingress-replies",
        [
            Subscription(TOPIC_GENERATED, ev.Generated, servicer.on_generated),
            Subscription(TOPIC_TOKENS, ev.TokenChunk, servicer.on_token),
            Subscription(TOPIC_DEAD_LETTER, ev.DeadLetter, servicer.on_dead_letter, requires_envelope=False),
            Subscription(TOPIC_CONTROL, ev.UserForgotten, servicer.on_forgotten, requires_envelope=False),
        ],
        broadcast=True,
    )
    # ... and one replica of the group records each outcome, so a turn whose replica died still ends
    # ANSWERED or FAILED in ingress_turns.
    outcomes = StageConsumer(
        settings,
        ctx.producer,
        "ingress",
        topology.INGRESS_OUTCOMES.name,
        [
            Subscription(TOPIC_GENERATED, ev.Generated, servicer.record_generated),
            Subscription(
                TOPIC_DEAD_LETTER, ev.DeadLetter, servicer.record_dead_letter, requires_envelope=False
            ),
        ],
    )
    return ServiceParts(
        bindings=[GrpcBinding(svc_grpc.add_IngressServicer_to_server, servicer, "mars.v1.Ingress")],
        consumers=[replies, outcomes],
        background=[servicer.sweep_orphans],
    )


def main() -> None:
    run("ingress", IngressSettings(), build, MIGRATIONS)
