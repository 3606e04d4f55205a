"""Reply correlation at the ingress: the calls waiting on this replica for their turn's generated event (or
its dead letter), and the token queues of streamed turns. Every replica reads every reply (a broadcast
consumer, mars_ingress.service.build); only the replica holding the call finds a waiter."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from mars import topology
from mars.v1 import events_pb2 as ev

from mars_ingress.admission import TurnFailed
from mars_ingress.settings import IngressSettings

log = logging.getLogger(__name__)


def failed_stage(consumer: str, prefix: str) -> str:
    """The service whose consumer group (as on the broker, behind the run's topic prefix) dead-lettered a
    turn, from the specs (mars.topology), for the caller's message; "pipeline" for a reader of no group."""
    try:
        return topology.group(consumer.removeprefix(prefix)).service
    except ValueError:
        return "pipeline"


class PendingReplies:
    """Turns this replica is answering, by turn_id: the future their call awaits, and for a streamed turn
    the queue its token chunks go to."""

    def __init__(self, settings: IngressSettings) -> None:
        self._settings = settings
        self._waiting: dict[str, asyncio.Future[ev.Generated]] = {}
        self._streams: dict[str, asyncio.Queue[ev.TokenChunk]] = {}

    @contextmanager
    def expect(
        self, turn_id: str, tokens: asyncio.Queue[ev.TokenChunk] | None = None
    ) -> Iterator[asyncio.Future[ev.Generated]]:
        """The future of the turn's answer (and its tokens into `tokens`) while the block runs; forgotten
        after it, so a late answer finds no one waiting."""
        fut: asyncio.Future[ev.Generated] = asyncio.get_running_loop().create_future()
        self._waiting[turn_id] = fut
        if tokens is not None:
            self._streams[turn_id] = tokens
        try:
            yield fut
        finally:
            self._waiting.pop(turn_id, None)
            self._streams.pop(turn_id, None)

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
            stage = failed_stage(letter.consumer, self._settings.topics.prefix)
            detail = f"turn failed in {letter.consumer}: {letter.reason}"
            log.error("turn %s dead-lettered: %s", letter.turn_id, detail)
            fut.set_exception(
                TurnFailed(
                    grpc.StatusCode.INTERNAL,
                    f"turn failed in the {stage} stage; reference {letter.turn_id}",
                    detail=detail,
                )
            )
