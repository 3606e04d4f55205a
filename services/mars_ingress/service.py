"""Ingress: the public gRPC API, as transport. A turn is admitted (mars_ingress.admission), given its seq
and recorded with its event (mars_ingress.turns), published, and answered when its generated event (or its
dead letter) comes back; history import is mars_ingress.history_import. Errors map to statuses in one place
(mars.runtime.rpc_status)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from mars import auth, forget, metrics, topology
from mars.auth import AuthError, Principal
from mars.bus.codec import is_transient
from mars.bus.consumer import StageConsumer
from mars.bus.delivery import Subscription
from mars.bus.producer import EventProducer
from mars.config import (
    SCHEMA_VERSION,
    TOPIC_CONTROL,
    TOPIC_DEAD_LETTER,
    TOPIC_FEEDBACK,
    TOPIC_GENERATED,
    TOPIC_JUDGED,
    TOPIC_MEMORY_COMMITTED,
    TOPIC_RECEIVED,
    TOPIC_ROUTED,
    TOPIC_STATE,
    TOPIC_TOKENS,
    TOPIC_VIEW,
)
from mars.domain.feedback import rating_from
from mars.runtime import GrpcBinding, ServiceContext, ServiceParts, abort_rpc, run
from mars.telemetry import context_from_metadata, current_trace_id, step, text_free_span
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from opentelemetry import trace
from psycopg_pool import AsyncConnectionPool

from mars_ingress import forget_user, history
from mars_ingress.admission import (
    Admission,
    InvalidTurn,
    TurnFailed,
    admin_tenant,
    auth_failure,
    check_feedback,
    check_user_ids,
)
from mars_ingress.capacity import Capacity
from mars_ingress.history_import import HistoryImport
from mars_ingress.schema import MIGRATIONS
from mars_ingress.settings import IngressSettings
from mars_ingress.state_context import StateContextClient
from mars_ingress.turns import TurnStore

log = logging.getLogger(__name__)

#: The stage that consumes each answer-path topic, for the caller's message when a turn is dead-lettered.
STAGE_OF_TOPIC = {
    TOPIC_RECEIVED: "state",
    TOPIC_STATE: "memory",
    TOPIC_VIEW: "router",
    TOPIC_ROUTED: "dispatch",
}


def caller_attempt(attempt: ev.GenerationAttempt) -> ev.GenerationAttempt:
    """An arm attempt as the caller sees it: the arm, its outcome kind and its counts, without the error
    text (an upstream's status line, address or message stays in the logs and the event log)."""
    shown = ev.GenerationAttempt()
    shown.CopyFrom(attempt)
    shown.ClearField("error")
    return shown


class IngressServicer(svc_grpc.IngressServicer):
    def __init__(self, settings: IngressSettings, producer: EventProducer, pool: AsyncConnectionPool) -> None:
        self._settings = settings
        self._producer = producer
        self._waiting: dict[str, asyncio.Future[ev.Generated]] = {}
        #: Token queues of streaming Converse turns, by turn_id.
        self._streams: dict[str, asyncio.Queue[ev.TokenChunk]] = {}
        self._tracer = trace.get_tracer("mars.ingress")
        self._admission = Admission(settings, pool)
        self._capacity = Capacity(settings)
        self.turns = TurnStore(settings, producer, pool)
        self.state = StateContextClient(settings)
        self._imports = HistoryImport(settings, producer, pool, self._admission, self.state)
        self._pool = pool

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
        self._admission.forget_user(event.tenant, event.user_id)
        self._producer.forget_user(event.tenant, event.user_id)

    # --- turn path -----------------------------------------------------------------------------

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
        options = await self._admission.admit(req, principal)
        slot = self._capacity.enter(req.tenant, principal.tenant if principal is not None else "")
        pipeline_ms: float | None = None
        turn_ms: float | None = None
        failure: BaseException | None = None
        try:
            reply = await self._admitted(req, metadata, options, tokens, caller_remaining_s)
            # The turn's time in MARS: what the model calls took is not the pipeline's capacity.
            turn_ms = reply.latency_ms
            pipeline_ms = turn_ms - sum(a.latency_ms for a in reply.attempts)
            return reply
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self._capacity.leave(slot, pipeline_ms, failure, turn_ms)

    async def _admitted(
        self,
        req: svc.TurnRequest,
        metadata: object,
        options: dict[str, str],
        tokens: asyncio.Queue[ev.TokenChunk] | None,
        caller_remaining_s: float | None,
    ) -> svc.TurnReply:
        started = time.perf_counter()
        parent = context_from_metadata(metadata)  # type: ignore[arg-type]
        with text_free_span(
            self._tracer, "ingress SendTurn", context=parent, kind=trace.SpanKind.SERVER
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
                    imported = await self._imports.import_unheld(req)
                span.set_attribute("mars.history_imported", imported)
            with step("ingress accept"):
                envelope.data_key_id = await self._producer.data_key_for(req.tenant, req.user_id)
                received = await self.turns.accept(envelope, req.text)
            generated = await self._publish_and_wait(received, wait_s, tokens)
            return _reply(received.turn, generated, started)

    async def _publish_and_wait(
        self, received: ev.TurnReceived, wait_s: float, tokens: asyncio.Queue[ev.TokenChunk] | None
    ) -> ev.Generated:
        """Publish the recorded turn and wait for its answer; TurnFailed (recorded) when none comes."""
        envelope = received.turn
        fut: asyncio.Future[ev.Generated] = asyncio.get_running_loop().create_future()
        self._waiting[envelope.turn_id] = fut
        if tokens is not None:
            self._streams[envelope.turn_id] = tokens
        try:
            try:
                await self._producer.publish(TOPIC_RECEIVED, received, envelope)
                self.turns.published(envelope.turn_id)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                # Recorded already: the outbox sweep publishes it again; the call keeps waiting.
                log.warning("publishing turn %s failed (%r); the outbox will send it", envelope.turn_id, exc)
            try:
                generated = await asyncio.wait_for(fut, timeout=wait_s)
            except TimeoutError:
                await self.turns.finish(envelope.turn_id, "TIMEOUT", "no answer before the deadline")
                raise TurnFailed(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"turn {envelope.turn_id} got no answer in {wait_s:g}s; it is recorded and may still complete",
                ) from None
            except TurnFailed as exc:
                await self.turns.finish(envelope.turn_id, "FAILED", exc.detail)
                raise
        finally:
            self._waiting.pop(envelope.turn_id, None)
            self._streams.pop(envelope.turn_id, None)
        if generated.status != ev.OK:
            # Upstream error bodies and addresses go to the log and the record, the arm names (the pool's
            # own labels) and a reference to the caller.
            chain = "; ".join(f"{a.arm}: {a.error}" for a in generated.attempts)
            log.warning("turn %s: no model could answer: %s", envelope.turn_id, chain or generated.error)
            await self.turns.finish(envelope.turn_id, "FAILED", generated.error)
            arms = ", ".join(dict.fromkeys(a.arm for a in generated.attempts)) or "none"
            raise TurnFailed(
                grpc.StatusCode.UNAVAILABLE,
                f"no model could answer (arms tried: {arms}); reference {envelope.turn_id}",
            )
        # ANSWERED is recorded by the outcome group from the same event (record_generated), off the answer
        # path: writing it here too cost a Postgres transaction per turn before the reply.
        return generated

    async def SendTurn(self, request: svc.TurnRequest, context: grpc.aio.ServicerContext) -> svc.TurnReply:
        try:
            metadata = context.invocation_metadata()
            principal = await self._admission.authenticated(metadata)
            return await self._turn(request, metadata, principal, caller_remaining_s=context.time_remaining())
        except Exception as exc:
            await abort_rpc(context, exc, "Ingress.SendTurn")
        raise AssertionError("unreachable")

    async def Converse(
        self, request_iterator: AsyncIterator[svc.TurnRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[svc.TurnReply]:
        metadata = context.invocation_metadata()
        try:
            await self._admission.authenticated(metadata)  # a bad key ends the stream before its first turn
        except Exception as exc:
            await abort_rpc(context, exc, "Ingress.Converse")
        async for request in request_iterator:
            try:
                # Each turn checks the key again (cached for MARS_AUTH_CACHE_TTL_S): a key revoked while
                # the stream is open stops opening turns within that time, as on unary calls.
                principal = await self._admission.authenticated(metadata)
                if request.options.get("stream") == "true":
                    async for reply in self._streamed_turn(request, metadata, principal):
                        yield reply
                else:
                    yield await self._turn(request, metadata, principal)
            except Exception as exc:
                await abort_rpc(context, exc, "Ingress.Converse")

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
            principal = await self._admission.authenticate(context.invocation_metadata())
            if principal is not None:
                request.tenant, request.user_id = auth.authorize(principal, request.tenant, request.user_id)
            check_feedback(request, self._settings.max_text_chars)
            rating = rating_from(request.rating, request.thumbs)
        except AuthError as exc:
            await abort_rpc(context, auth_failure(exc), "Ingress.SubmitFeedback")
        except InvalidTurn as exc:
            await abort_rpc(context, exc, "Ingress.SubmitFeedback")
        except ValueError as exc:  # rating_from's
            await abort_rpc(context, InvalidTurn(str(exc)), "Ingress.SubmitFeedback")
        except Exception as exc:
            await abort_rpc(context, exc, "Ingress.SubmitFeedback")
        try:
            await self._publish_feedback(request, rating)
        except (
            Exception
        ) as exc:  # TurnFailed's status, or Postgres or the broker's: a plain one, never their text
            await abort_rpc(context, exc, "Ingress.SubmitFeedback")
        return svc.FeedbackReply(accepted=True)

    async def _publish_feedback(self, request: svc.FeedbackRequest, rating: float) -> None:
        row = await self.turns.owner_of(request.turn_id)
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
            principal = await self._admission.authenticate(context.invocation_metadata())
            request.tenant = admin_tenant(principal, request.tenant)
            check_user_ids(request.tenant, request.user_id)
        except AuthError as exc:
            await abort_rpc(context, auth_failure(exc), "Ingress.ForgetUser")
        except Exception as exc:
            await abort_rpc(context, exc, "Ingress.ForgetUser")
        try:
            async with self._pool.connection() as conn:
                own, turns = await forget.forget_own_async(conn, "ingress", request.tenant, request.user_id)
            event = forget_user.control_event(request.tenant, request.user_id, turn_ids=turns)
            self._producer.forget_user(request.tenant, request.user_id)
            await self._producer.send_raw(
                TOPIC_CONTROL,
                event.SerializeToString(),
                forget_user.event_key(request.tenant, request.user_id),
            )
            acks = await self._acknowledgements(event.forget_id)
        except Exception as exc:
            await abort_rpc(context, exc, "Ingress.ForgetUser")
        counts = forget_user.merge_counts(own, *acks.values())
        missing = [s for s in forget.acknowledgers() if s not in acks]
        if missing:
            log.warning(
                "forget %s: no acknowledgement from %s within %gs; their rows go when they read the event",
                event.forget_id,
                ", ".join(missing),
                self._settings.forget_wait_s,
            )
        log.warning(
            "forget %s: user %s of tenant %s forgotten by key %s: %s",
            event.forget_id,
            request.user_id,
            request.tenant,
            principal.key_id if principal is not None else "-",
            ", ".join(f"{t}={n}" for t, n in counts.items() if n),
        )
        return svc.ForgetUserReply(forget_id=event.forget_id, rows_deleted=counts, not_acknowledged=missing)

    async def _acknowledgements(self, forget_id: str) -> dict[str, dict[str, int]]:
        """Every other owner's acknowledgement of the forget, or those that came within MARS_FORGET_WAIT_S."""
        deadline = time.monotonic() + self._settings.forget_wait_s
        wanted = set(forget.acknowledgers())
        while True:
            async with self._pool.connection() as conn:
                acks = await forget_user.acknowledged(conn, forget_id)
            if wanted <= set(acks) or time.monotonic() >= deadline:
                return acks
            await asyncio.sleep(0.1)

    async def WhoAmI(self, request: svc.WhoAmIRequest, context: grpc.aio.ServicerContext) -> svc.WhoAmIReply:
        """The call's key, verified: whom it acts for (empty with MARS_AUTH_REQUIRED=false)."""
        try:
            principal = await self._admission.authenticate(context.invocation_metadata())
        except Exception as exc:
            await abort_rpc(context, exc, "Ingress.WhoAmI")
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
        """Record a user's recorded turn pairs (mars_ingress.history) and publish each as an imported generated
        event: the memory writer stores it through its normal, idempotent commit. Admin key only."""
        try:
            principal = await self._admission.authenticate(context.invocation_metadata())
            request.tenant = admin_tenant(principal, request.tenant, "importing history")
            check_user_ids(request.tenant, request.user_id)
            pairs = history.check_history(
                request.tenant, request.user_id, request.turns, self._settings.max_text_chars
            )
        except AuthError as exc:
            await abort_rpc(context, auth_failure(exc), "Ingress.ImportHistory")
        except history.InvalidHistory as exc:
            await abort_rpc(context, InvalidTurn(str(exc)), "Ingress.ImportHistory")
        except Exception as exc:
            await abort_rpc(context, exc, "Ingress.ImportHistory")
        try:
            seqs, fresh = await self._imports.import_pairs(request.tenant, request.user_id, pairs)
            if request.wait:  # the wait reads Postgres too: its failures get the same plain status
                remaining = context.time_remaining()
                wait_s = self._settings.import_wait_s if remaining is None else max(0.0, remaining - 0.5)
                stored = await self._imports.wait_stored([p.turn_id for p in pairs], wait_s)
                if stored < len(pairs):
                    raise TurnFailed(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"{len(pairs)} pairs recorded and published; memory has stored {stored} of them so far "
                        "and goes on (make the same call again to wait more: nothing is imported twice)",
                    )
        except Exception as exc:
            await abort_rpc(context, exc, "Ingress.ImportHistory")
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


def _reply(envelope: ev.TurnEnvelope, generated: ev.Generated, started: float) -> svc.TurnReply:
    return svc.TurnReply(
        turn_id=envelope.turn_id,
        seq=envelope.seq,
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
            Subscription(TOPIC_GENERATED, ev.Generated, servicer.turns.record_generated),
            Subscription(
                TOPIC_DEAD_LETTER, ev.DeadLetter, servicer.turns.record_dead_letter, requires_envelope=False
            ),
            Subscription(TOPIC_MEMORY_COMMITTED, ev.MemoryCommitted, servicer.turns.record_stored),
            Subscription(TOPIC_JUDGED, ev.Judged, servicer.turns.record_judged),
        ],
    )
    return ServiceParts(
        bindings=[GrpcBinding(svc_grpc.add_IngressServicer_to_server, servicer, "mars.v1.Ingress")],
        consumers=[replies, outcomes],
        background=[servicer.turns.sweep_orphans],
        on_stop=[servicer.state.aclose],
    )


def main() -> None:
    run("ingress", IngressSettings(), build, MIGRATIONS)
