"""The built-in demo conversation: two users, two sessions each, played through the gRPC ingress."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc
from aiokafka.errors import KafkaError
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_ingress.client import ingress_channel
from rich.console import Console
from rich.table import Table

log = logging.getLogger(__name__)

DEMO: list[tuple[str, str, str]] = [
    ("alice", "s1", "I'm planning a 5-day trip to Kyoto in April. Can you sketch an itinerary?"),
    ("bob", "s1", "Help me write a cover letter for a junior data analyst job."),
    ("alice", "s1", "Make day 2 less busy and add a tea ceremony."),
    ("bob", "s1", "Make it shorter and mention my SQL experience."),
    ("alice", "s1", "How do I get red wine out of a carpet?"),
    ("alice", "s2", "Back to my Kyoto trip: what did we plan for day 2 last time?"),
    ("bob", "s2", "Can you summarize the final version of my cover letter?"),
    ("alice", "s2", "Finalize the itinerary with a budget under 1500 dollars."),
]


@dataclass
class DemoRow:
    user: str
    session: str
    text: str
    reply: svc.TurnReply | None
    error: str | None


def play(
    target: str,
    tenant: str = "demo",
    max_tokens: int = 64,
    api_key: str = "",
    view_tokens: int | None = None,
) -> list[DemoRow]:
    """Send the demo turns as `tenant` with `api_key` (the local stack's: MARS_API_KEY in stack.env);
    `view_tokens` caps the memory packed into each prompt (the turn option), for a short prefill."""
    options = {"max_tokens": str(max_tokens)}
    if view_tokens is not None:
        options["view_tokens"] = str(view_tokens)
    rows = []
    with ingress_channel(target, api_key) as channel:
        stub = svc_grpc.IngressStub(channel)
        for user, session, text in DEMO:
            req = svc.TurnRequest(
                tenant=tenant,
                user_id=user,
                session_id=session,
                text=text,
                options=options,
            )
            try:
                rows.append(DemoRow(user, session, text, stub.SendTurn(req, timeout=300), None))
            except grpc.RpcError as exc:
                rows.append(DemoRow(user, session, text, None, f"{exc.code().name}: {exc.details()}"))
    return rows


def render(rows: list[DemoRow], console: Console, rewards: dict[str, float] | None = None) -> None:
    rewards = rewards or {}
    table = Table(title="MARS demo: one row per turn", show_lines=False)
    for col in (
        "user/session",
        "seq",
        "turn",
        "state",
        "view",
        "model",
        "cost $",
        "reward",
        "latency ms",
        "answer",
    ):
        table.add_column(col, overflow="fold")
    for r in rows:
        if r.reply is None:
            table.add_row(
                f"{r.user}/{r.session}", "-", r.text[:40], "-", "-", "-", "-", "-", "-", f"[red]{r.error}"
            )
            continue
        s = r.reply.state
        state = (
            f"{ev.Action.Name(s.action)} {ev.Phase.Name(s.phase)} {ev.RetrievalScope.Name(s.retrieval_scope)}"
        )
        table.add_row(
            f"{r.user}/{r.session}",
            str(r.reply.seq),
            r.text[:40],
            state,
            f"{r.reply.view_blocks} blk / {r.reply.view_tokens} tok",
            r.reply.model,
            f"{r.reply.cost_usd:.7f}",
            f"{rewards[r.reply.turn_id]:.3f}" if r.reply.turn_id in rewards else "pending",
            f"{r.reply.latency_ms:.0f}",
            r.reply.text.strip().replace("\n", " ")[:60],
        )
    console.print(table)
    answered = [r.reply for r in rows if r.reply]
    if answered:
        lat = sorted(r.latency_ms for r in answered)
        # Everything but the model calls: Kafka hops, state, memory view, routing, Postgres.
        overhead = sorted(r.latency_ms - sum(a.latency_ms for a in r.attempts) for r in answered)
        console.print(
            f"per-turn latency over {len(lat)} answered turns: p50 {lat[len(lat) // 2]:.0f} ms, "
            f"max {lat[-1]:.0f} ms; pipeline overhead without model calls: "
            f"p50 {overhead[len(overhead) // 2]:.0f} ms, max {overhead[-1]:.0f} ms"
        )


def judged_rewards(
    bootstrap: str,
    turn_ids: list[str],
    since_ms: int,
    prefix: str = "",
    wait_s: float = 30.0,
    kafka: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Each turn's reward (Eq. 17) from its judged event on Kafka: rewards arrive after the answer, on the
    learning path, so the judged topic is read until every turn has one or `wait_s` ran out. The events are
    the judge's public output; the router's ledger is the router's own table."""
    import asyncio
    import contextlib

    from mars.config import TOPIC_JUDGED

    from mars_tools.replay.readers import read_topics

    wanted = set(turn_ids)
    found: dict[str, float] = {}

    async def read() -> None:
        # One reader from the demo's start, until every turn has its reward or `wait_s` has passed.
        deadline = time.monotonic() + wait_s
        records = read_topics(
            bootstrap, (TOPIC_JUDGED,), since_ms=since_ms, idle_s=wait_s, prefix=prefix, kafka=kafka
        )
        async with contextlib.aclosing(records):  # stops the consumer however the loop ends
            async for record in records:
                judged = ev.Judged.FromString(record.value)
                if judged.turn.turn_id in wanted:
                    found[judged.turn.turn_id] = judged.reward
                if len(found) == len(wanted) or time.monotonic() > deadline:
                    return

    try:
        asyncio.run(read())
    except (OSError, KafkaError) as exc:  # rewards are extra: the table goes out without them
        log.warning("rewards not read from %s: %r", bootstrap, exc)
    return found
