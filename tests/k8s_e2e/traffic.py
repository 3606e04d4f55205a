"""An open-loop client for the fault runs: turns leave at a fixed rate through the ingress Service whatever
happened to the ones before them, and are counted afterwards from the client and from the Kafka log.

Each call is its own session (`c<i>`) of one of ten users of the run, so the log tells a turn accepted
twice (a duplicate) from two turns; the users' earlier sessions still feed each view.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from mars.config import (
    TOPIC_GENERATED,
    TOPIC_MEMORY_COMMITTED,
    TOPIC_RECEIVED,
    TOPIC_ROUTED,
    TOPIC_STATE,
    TOPIC_VIEW,
)

USERS = 10


@dataclass
class Call:
    i: int
    user: str
    session: str
    sent_s: float
    latency_s: float = 0.0
    code: str = ""
    turn_id: str = ""
    detail: str = ""


@dataclass
class RunCounts:
    """One fault run as the client and the log saw it."""

    name: str
    #: Turns per second the client sent.
    rate: float = 0.0
    sent: int = 0
    answered: int = 0
    failed: int = 0
    lost: int = 0
    duplicated: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    seconds: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    #: Where the slow turns waited, from the log's timestamps (slow_hops).
    slow: str = ""

    def line(self) -> str:
        errors = f" errors {self.errors}" if self.errors else ""
        slow = f"\n  slow turns: {self.slow}" if self.slow else ""
        return (
            f"{self.name}: {self.seconds:.0f} s, sent {self.sent}, answered {self.answered}, failed {self.failed}, "
            f"lost {self.lost}, duplicated {self.duplicated}, p50 {self.p50_ms:.0f} ms, p99 {self.p99_ms:.0f} ms"
            + errors
            + slow
        )


class OpenLoop:
    """Sends turns at `rate` per second from a thread of its own until `stop()`."""

    def __init__(
        self,
        target: str,
        api_key: str,
        tenant: str,
        rate: float = 5.0,
        deadline_s: float = 60.0,
        options: tuple[tuple[str, str], ...] = (),
    ):
        self.target = target
        self.options = options
        self.api_key = api_key
        self.tenant = tenant
        self.rate = rate
        self.deadline_s = deadline_s
        self.run = uuid.uuid4().hex[:6]
        self.calls: list[Call] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._send()), daemon=True)
        self.started = 0.0

    def start(self) -> OpenLoop:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def stop(self, at_least_s: float = 60.0) -> list[Call]:
        """Keep sending until `at_least_s` since the start, then stop and wait for every answer."""
        remaining = at_least_s - self.elapsed()
        if remaining > 0:
            time.sleep(remaining)
        self._stop.set()
        self._thread.join(timeout=self.deadline_s + 30)
        return self.calls

    async def _send(self) -> None:
        import grpc
        from mars.v1 import services_pb2 as svc
        from mars.v1 import services_pb2_grpc as svc_grpc
        from mars_ingress.client import aio_ingress_channel

        channel = aio_ingress_channel(self.target, self.api_key, list(self.options))
        stub = svc_grpc.IngressStub(channel)

        async def one(call: Call) -> None:
            started = time.monotonic()
            try:
                reply = await stub.SendTurn(
                    svc.TurnRequest(
                        tenant=self.tenant,
                        user_id=call.user,
                        session_id=call.session,
                        text=f"Turn {call.i} of run {self.run}: what should I pack for the ferry to island {call.i}?",
                    ),
                    timeout=self.deadline_s,
                )
                call.code, call.turn_id = "OK", reply.turn_id
            except grpc.aio.AioRpcError as exc:
                call.code, call.detail = exc.code().name, (exc.details() or "")[:200]
            call.latency_s = time.monotonic() - started

        tasks = []
        i = 0
        while not self._stop.is_set():
            delay = self.started + i / self.rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            call = Call(i, f"{self.run}-u{i % USERS}", f"c{i}", time.monotonic() - self.started)
            self.calls.append(call)
            tasks.append(asyncio.create_task(one(call)))
            i += 1
        await asyncio.gather(*tasks)
        await channel.close()


def count(name: str, loop: OpenLoop, bootstrap: str, settle_s: float = 60.0) -> RunCounts:
    """The run's figures: from the client (sent, answered, failed, latencies) and from the log (a turn
    accepted but never answered OK is lost, a session with two accepted turns or a turn answered twice is
    duplicated). The log is read until every accepted turn has its answer or `settle_s` passes."""
    calls = loop.calls
    counts = RunCounts(
        name, rate=loop.rate, sent=len(calls), seconds=max((c.sent_s for c in calls), default=0.0)
    )
    ok = sorted(c.latency_s for c in calls if c.code == "OK")
    counts.answered = len(ok)
    counts.failed = counts.sent - counts.answered
    counts.errors = dict(Counter(f"{c.code}: {c.detail[:60]}" for c in calls if c.code != "OK"))
    if ok:
        counts.p50_ms = 1000 * ok[len(ok) // 2]
        counts.p99_ms = 1000 * ok[min(len(ok) - 1, int(0.99 * len(ok)))]
    users = {c.user for c in calls}
    deadline = time.monotonic() + settle_s
    while True:
        received, generated = _read_log(bootstrap, users)
        answered = {t for t, statuses in generated.items() if "OK" in statuses}
        if set(received) <= answered or time.monotonic() > deadline:
            break
        time.sleep(2)
    per_session = Counter(received.values())
    counts.duplicated = sum(n - 1 for n in per_session.values() if n > 1)
    counts.duplicated += sum(len(s) - 1 for s in generated.values() if len(s) > 1)
    lost = {t for t in received if t not in answered}
    lost |= {c.turn_id for c in calls if c.code == "OK" and c.turn_id not in answered}
    counts.lost = len(lost)
    counts.slow = slow_hops(bootstrap, users)
    return counts


#: The pipeline's hops in order, by the topic each one ends on.
HOPS = (TOPIC_RECEIVED, TOPIC_STATE, TOPIC_VIEW, TOPIC_ROUTED, TOPIC_GENERATED)
SLOW_S = 3.0


def slow_hops(bootstrap: str, users: set[str]) -> str:
    """Where the turns that took over SLOW_S (received to generated, in the log) waited, so a failed run says
    which stage stalled and when. A view waits (bounded) for the user's turn n-1 to be committed to memory
    (read-your-writes), so one stalled turn makes its user's next ones slow too: a slow turn whose view came
    within 1 s after turn n-1's commit is counted as waiting on n-1; the others are the roots, each with
    the hop that held it longest."""
    from mars.v1 import events_pb2 as ev
    from mars_tools.replay.readers import read_topics

    first: dict[str, dict[str, int]] = {}
    seqs: dict[str, tuple[str, int]] = {}
    committed: dict[tuple[str, int], int] = {}

    async def read() -> None:
        async for record in read_topics(bootstrap, (*HOPS, TOPIC_MEMORY_COMMITTED)):
            turn = ev.TurnReceived.FromString(record.value).turn  # field 1 is the envelope in each
            if turn.user_id not in users:
                continue
            if record.topic == TOPIC_MEMORY_COMMITTED:
                committed.setdefault((turn.user_id, turn.seq), record.timestamp_ms)
            else:
                first.setdefault(turn.turn_id, {}).setdefault(record.topic, record.timestamp_ms)
                seqs[turn.turn_id] = (turn.user_id, turn.seq)

    asyncio.run(read())
    roots: Counter[str] = Counter()
    longest: dict[str, int] = {}
    window: list[int] = []
    on_previous = 0
    for turn_id, at in first.items():
        if not all(t in at for t in HOPS) or at[TOPIC_GENERATED] - at[TOPIC_RECEIVED] <= SLOW_S * 1000:
            continue
        window.append(at[TOPIC_RECEIVED])
        waits = {b.rsplit(".", 1)[-1]: at[b] - at[a] for a, b in itertools.pairwise(HOPS)}
        for hop, ms in waits.items():
            longest[hop] = max(longest.get(hop, 0), ms)
        user, seq = seqs[turn_id]
        previous = committed.get((user, seq - 1))
        if previous is not None and at[TOPIC_STATE] < previous <= at[TOPIC_VIEW] <= previous + 1000:
            on_previous += 1
            continue
        roots[max(waits, key=lambda h: waits[h])] += 1
    if not window:
        return ""
    per_10s = Counter(time.strftime("%H:%M:%S", time.gmtime(t // 10_000 * 10)) for t in sorted(window))
    return (
        f"{len(window)} over {SLOW_S:.0f} s, {on_previous} of them waiting on the user's turn n-1; "
        f"the others held longest by {dict(roots)}; longest wait per hop (ms) {longest}; "
        f"received per 10 s (UTC) {dict(sorted(per_10s.items()))}"
    )


def _read_log(bootstrap: str, users: set[str]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(turn id -> session of every accepted turn, turn id -> statuses of its generated events) of `users`."""
    from mars.v1 import events_pb2 as ev
    from mars_tools.replay.readers import read_topics

    received: dict[str, str] = {}
    generated: dict[str, list[str]] = {}

    async def read() -> None:
        async for record in read_topics(bootstrap, (TOPIC_RECEIVED, TOPIC_GENERATED)):
            if record.topic == TOPIC_RECEIVED:
                turn = ev.TurnReceived.FromString(record.value).turn
                if turn.user_id in users:
                    received[turn.turn_id] = f"{turn.user_id}/{turn.session_id}"
            else:
                event = ev.Generated.FromString(record.value)
                if event.turn.user_id in users:
                    generated.setdefault(event.turn.turn_id, []).append(ev.TurnStatus.Name(event.status))

    asyncio.run(read())
    return received, generated
