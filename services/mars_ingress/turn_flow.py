"""One turn through the ingress, from admission to its reply: admitted (mars_ingress.admission) within the
replica's capacity (mars_ingress.capacity), earlier messages MARS lacks imported (mars_ingress.history_import),
given its seq and recorded (mars_ingress.turns), published, and answered when its generated event or dead
letter comes back (mars_ingress.replies). SendTurn and Converse (plain and streamed) all go through here."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from mars import metrics
from mars.auth import Principal
from mars.bus.codec import is_transient
from mars.bus.producer import EventProducer
from mars.config import SCHEMA_VERSION, TOPIC_RECEIVED
from mars.telemetry import context_from_metadata, current_trace_id, step, text_free_span
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from opentelemetry import trace

from mars_ingress.admission import Admission, Admitted, TurnFailed
from mars_ingress.capacity import Capacity
from mars_ingress.history_import import HistoryImport
from mars_ingress.replies import PendingReplies
from mars_ingress.settings import IngressSettings
from mars_ingress.spec import NAME
from mars_ingress.turns import TurnStore, charged_tokens

log = logging.getLogger(__name__)


def caller_attempt(attempt: ev.GenerationAttempt) -> ev.GenerationAttempt:
    """An arm attempt as the caller sees it: the arm, its outcome kind and its counts, without the error
    text (an upstream's status line, address or message stays in the logs and the event log)."""
    shown = ev.GenerationAttempt()
    shown.CopyFrom(attempt)
    shown.ClearField("error")
    return shown


def turn_reply(
    envelope: ev.TurnEnvelope, generated: ev.Generated, started: float, admitted: Admitted | None = None
) -> svc.TurnReply:
    limits: list[svc.RateLimit] = []
    if admitted is not None and admitted.limited:
        tokens = charged_tokens(generated) or admitted.text_tokens
        limits = admitted.rate_limits(tokens, generated.cost_usd + generated.controller_cost_usd)
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
        rate_limits=limits,
    )


def partial_reply(chunk: ev.TokenChunk) -> svc.TurnReply:
    """A streamed turn's piece of the answer as the caller gets it."""
    return svc.TurnReply(
        turn_id=chunk.turn.turn_id,
        seq=chunk.turn.seq,
        model=chunk.arm,
        partial=True,
        delta=chunk.text,
        restart=chunk.restart,
    )


class TurnFlow:
    def __init__(
        self,
        settings: IngressSettings,
        producer: EventProducer,
        admission: Admission,
        turns: TurnStore,
        imports: HistoryImport,
        replies: PendingReplies,
    ) -> None:
        self._settings = settings
        self._producer = producer
        self._admission = admission
        self._capacity = Capacity(settings)
        self._turns = turns
        self._imports = imports
        self._replies = replies
        self._tracer = trace.get_tracer("mars.ingress")

    async def turn(
        self,
        req: svc.TurnRequest,
        metadata: object,
        principal: Principal | None,
        tokens: asyncio.Queue[ev.TokenChunk] | None = None,
        caller_remaining_s: float | None = None,
        limits: list[svc.RateLimit] | None = None,
    ) -> svc.TurnReply:
        """One turn, counted in mars.turns by how it ended (SendTurn, Converse and streamed turns alike).
        `limits` gets the turn's budgets as they stand once it is let in (a streamed turn's first reply)."""
        started = time.perf_counter()
        # The authenticated tenant only: a tenant name the caller typed must not become a metric label.
        tenant = principal.tenant if principal is not None else ""
        try:
            reply = await self._answer(req, metadata, principal, tokens, caller_remaining_s, limits)
        except BaseException as exc:
            metrics.record_turn(metrics.turn_status(exc), tenant, (time.perf_counter() - started) * 1000)
            raise
        metrics.record_turn("answered", tenant, (time.perf_counter() - started) * 1000)
        return reply

    async def streamed_turn(
        self, request: svc.TurnRequest, metadata: object, principal: Principal | None
    ) -> AsyncIterator[svc.TurnReply]:
        """Partial replies as dispatch streams the answer, then the final reply (always complete: pieces
        that arrive after it are dropped, since the final text already holds them)."""
        tokens: asyncio.Queue[ev.TokenChunk] = asyncio.Queue()
        limits: list[svc.RateLimit] = []
        turn = asyncio.create_task(self.turn(request, metadata, principal, tokens, limits=limits))
        first = True
        try:
            while not turn.done():
                getter = asyncio.ensure_future(tokens.get())
                await asyncio.wait({getter, turn}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    partial = partial_reply(getter.result())
                    if first:  # the caller's headers go out with the first piece (mars_gateway)
                        partial.rate_limits.extend(limits)
                        first = False
                    yield partial
                else:
                    getter.cancel()
            while not tokens.empty():
                yield partial_reply(tokens.get_nowait())
            yield turn.result()
        finally:
            if not turn.done():
                turn.cancel()

    async def _answer(
        self,
        req: svc.TurnRequest,
        metadata: object,
        principal: Principal | None,
        tokens: asyncio.Queue[ev.TokenChunk] | None = None,
        caller_remaining_s: float | None = None,
        limits: list[svc.RateLimit] | None = None,
    ) -> svc.TurnReply:
        options = self._admission.check(req, principal)
        # The slot before the budgets and quotas: a turn shed at capacity reads no budget and takes nothing
        # from its tenant's buckets, so a client that sends it again is charged once, when it gets in (a
        # quota taken by each shed attempt drained a tenant's turns per second under overload).
        slot = self._capacity.enter(req.tenant, principal.tenant if principal is not None else "")
        pipeline_ms: float | None = None
        turn_ms: float | None = None
        failure: BaseException | None = None
        try:
            admitted = await self._admission.admit(req, principal, options)
            if limits is not None and admitted.limited:
                limits.extend(admitted.rate_limits(admitted.text_tokens, 0.0))
            reply = await self._admitted(req, metadata, admitted, tokens, caller_remaining_s)
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
        admitted: Admitted,
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
                options=admitted.options,
                deadline_ms=now_ms + int(wait_s * 1000),
            )
            span.set_attribute("mars.turn_id", envelope.turn_id)
            span.set_attribute("mars.service", NAME)
            if req.history:
                with step("ingress history"):
                    imported = await self._imports.import_unheld(req)
                span.set_attribute("mars.history_imported", imported)
            with step("ingress accept"):
                envelope.data_key_id = await self._producer.data_key_for(req.tenant, req.user_id)
                received = await self._turns.accept(envelope, req.text, admitted.key_id, admitted.text_tokens)
            generated = await self._publish_and_wait(received, wait_s, tokens)
            return turn_reply(received.turn, generated, started, admitted)

    async def _publish_and_wait(
        self, received: ev.TurnReceived, wait_s: float, tokens: asyncio.Queue[ev.TokenChunk] | None
    ) -> ev.Generated:
        """Publish the recorded turn and wait for its answer; TurnFailed (recorded) when none comes."""
        envelope = received.turn
        with self._replies.expect(envelope.turn_id, tokens) as answer:
            try:
                await self._producer.publish(TOPIC_RECEIVED, received, envelope)
                self._turns.published(envelope.turn_id)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                # Recorded already: the outbox sweep publishes it again; the call keeps waiting.
                log.warning("publishing turn %s failed (%r); the outbox will send it", envelope.turn_id, exc)
            try:
                generated = await asyncio.wait_for(answer, timeout=wait_s)
            except TimeoutError:
                await self._turns.finish(envelope.turn_id, "TIMEOUT", "no answer before the deadline")
                raise TurnFailed(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"turn {envelope.turn_id} got no answer in {wait_s:g}s; it is recorded and may still complete",
                ) from None
            except TurnFailed as exc:
                await self._turns.finish(envelope.turn_id, "FAILED", exc.detail)
                raise
        if generated.status != ev.OK:
            # Upstream error bodies and addresses go to the log and the record, the arm names (the pool's
            # own labels) and a reference to the caller.
            chain = "; ".join(f"{a.arm}: {a.error}" for a in generated.attempts)
            log.warning("turn %s: no model could answer: %s", envelope.turn_id, chain or generated.error)
            await self._turns.finish(envelope.turn_id, "FAILED", generated.error)
            arms = ", ".join(dict.fromkeys(a.arm for a in generated.attempts)) or "none"
            raise TurnFailed(
                grpc.StatusCode.UNAVAILABLE,
                f"no model could answer (arms tried: {arms}); reference {envelope.turn_id}",
            )
        # ANSWERED is recorded by the outcome group from the same event (record_generated), off the answer
        # path: writing it here too cost a Postgres transaction per turn before the reply.
        return generated
