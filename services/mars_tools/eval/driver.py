"""Driving a running pipeline through its gRPC ingress, and reading back the views it logged.

Benchmark runners (`mars eval realmem`, `mars eval locomo`) send a benchmark's turns as a user would,
then read the memory views the pipeline put on the event log: the metrics are computed from what the
model was shown, not from a side channel. A failed turn is recorded and counted, never fatal.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError
from mars.config import TOPIC_VIEW
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_ingress.client import ingress_channel
from mars_ingress.history import MAX_TURNS_PER_CALL

from mars_tools.replay.readers import read_topics


class HistoryImportFailed(RuntimeError):
    """Recorded history could not be stored: scoring queries without it would mislead."""


@dataclass(frozen=True)
class SentTurn:
    """One turn sent through the ingress: its pipeline turn id and answer, or the error it got."""

    session_id: str
    text: str
    turn_id: str = ""
    answer: str = ""
    model: str = ""
    cost_usd: float = 0.0
    latency_ms: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


class IngressDriver:
    """Sends one user's turns in order through `Ingress.SendTurn` (the public API, nothing private)."""

    def __init__(
        self,
        target: str,
        tenant: str,
        user_id: str,
        timeout_s: float = 300.0,
        options: Mapping[str, str] | None = None,
        channel: grpc.Channel | None = None,
        api_key: str = "",
    ) -> None:
        self._channel = channel or ingress_channel(target, api_key)
        self._stub = svc_grpc.IngressStub(self._channel)
        self.tenant = tenant
        self.user_id = user_id
        self._timeout_s = timeout_s
        self._options = dict(options or {})
        self.sent: list[SentTurn] = []
        #: Recorded pairs newly stored by import_history.
        self.imported = 0

    def send(self, session_id: str, text: str) -> SentTurn:
        request = svc.TurnRequest(
            tenant=self.tenant, user_id=self.user_id, session_id=session_id, text=text, options=self._options
        )
        started = time.perf_counter()
        try:
            reply = self._stub.SendTurn(request, timeout=self._timeout_s)
        except grpc.RpcError as exc:
            code = exc.code().name if exc.code() is not None else "UNKNOWN"
            turn = SentTurn(session_id, text, error=f"{code}: {exc.details()}")
        else:
            turn = SentTurn(
                session_id,
                text,
                turn_id=reply.turn_id,
                answer=reply.text,
                model=reply.model,
                cost_usd=reply.cost_usd,
                latency_ms=(time.perf_counter() - started) * 1000,
            )
        self.sent.append(turn)
        return turn

    def import_history(self, turns: Sequence[svc.RecordedTurn]) -> list[str]:
        """Store recorded turn pairs as this user's history (`Ingress.ImportHistory`, waiting until memory
        holds them), in calls of at most MAX_TURNS_PER_CALL; their turn ids, in order. HistoryImportFailed
        when a call fails (scoring queries without their history would mislead)."""
        turn_ids: list[str] = []
        for start in range(0, len(turns), MAX_TURNS_PER_CALL):
            request = svc.ImportHistoryRequest(
                tenant=self.tenant,
                user_id=self.user_id,
                turns=list(turns[start : start + MAX_TURNS_PER_CALL]),
                wait=True,
            )
            try:
                reply = self._stub.ImportHistory(request, timeout=max(self._timeout_s, 600.0))
            except grpc.RpcError as exc:
                code = exc.code().name if exc.code() is not None else "UNKNOWN"
                raise HistoryImportFailed(
                    f"importing {len(request.turns)} recorded pairs of user {self.user_id}: {code}: {exc.details()}"
                ) from None
            self.imported += reply.imported
            turn_ids += reply.turn_ids
        return turn_ids

    def close(self) -> None:
        self._channel.close()


@dataclass(frozen=True)
class PipelineTarget:
    """A running pipeline to drive: its ingress, its broker and topic prefix (to read views back), the
    tenant to send as and its API key, per-turn options and timeout, and when the run started (views are read
    from then)."""

    ingress: str
    bootstrap: str
    tenant: str
    prefix: str = ""
    options: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 300.0
    since_ms: int | None = None
    api_key: str = ""

    @contextmanager
    def user(self, user_id: str, sent: list[SentTurn]) -> Iterator[IngressDriver]:
        """A driver for one user; every turn it sent is appended to `sent` when it closes."""
        driver = IngressDriver(
            self.ingress, self.tenant, user_id, self.timeout_s, self.options, api_key=self.api_key
        )
        try:
            yield driver
        finally:
            driver.close()
            sent.extend(driver.sent)

    def views(self, turns: Iterable[SentTurn]) -> dict[str, ev.CandidateView]:
        """The logged views of the turns that got an answer."""
        return collect_views(self.bootstrap, [t.turn_id for t in turns if t.ok], self.since_ms, self.prefix)


def failures(turns: Iterable[SentTurn]) -> int:
    return sum(1 for t in turns if not t.ok)


def collect_views(
    bootstrap: str,
    turn_ids: Iterable[str],
    since_ms: int | None = None,
    prefix: str = "",
    idle_s: float = 2.0,
    wait_s: float = 30.0,
) -> dict[str, ev.CandidateView]:
    """The logged view of each of `turn_ids` (read from the view topic of the run with `prefix`).

    Views are emitted before the answer, so they are normally all there once the turns returned; reading
    is retried until every view is found or `wait_s` has passed (a turn that failed before its view was
    built has none, and the caller counts it)."""
    wanted = set(turn_ids)
    found: dict[str, ev.CandidateView] = {}
    deadline = time.monotonic() + wait_s

    async def read_once() -> None:
        async for record in read_topics(bootstrap, (TOPIC_VIEW,), since_ms, idle_s, prefix=prefix):
            try:
                built = ev.ViewBuilt.FromString(record.value)
            except DecodeError:  # not one of ours (the consumers dead-letter such records)
                continue
            if built.turn.turn_id in wanted:
                found[built.turn.turn_id] = built.view

    while True:
        asyncio.run(read_once())
        if wanted <= found.keys() or time.monotonic() >= deadline:
            return found
        time.sleep(1.0)


def shown_sources(view: ev.CandidateView, exclude_session: str = "") -> list[ev.MemoryBlock]:
    """The memory blocks of a view that come from stored turns: the retrieved history first (the
    retrieval's ranking, best first), then the recent turns; those of `exclude_session` (the query's
    own conversation) left out."""
    blocks = [b for b in view.blocks if not exclude_session or b.source_session_id != exclude_session]
    return [b for b in blocks if b.kind == ev.RETRIEVED_HISTORY] + [
        b for b in blocks if b.kind == ev.RECENT_TURN
    ]


def distinct(values: Iterable[str]) -> list[str]:
    """First occurrences, in order, without empty values."""
    return list(dict.fromkeys(v for v in values if v))
