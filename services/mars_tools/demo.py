"""The built-in demo conversation: two users, two sessions each, played through the gRPC ingress."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
from mars.client import ingress_channel
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from rich.console import Console
from rich.table import Table

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


def play(target: str, tenant: str = "demo", max_tokens: int = 64, api_key: str = "") -> list[DemoRow]:
    """Send the demo turns as `tenant` with `api_key` (the local stack's: MARS_API_KEY in stack.env)."""
    rows = []
    with ingress_channel(target, api_key) as channel:
        stub = svc_grpc.IngressStub(channel)
        for user, session, text in DEMO:
            req = svc.TurnRequest(
                tenant=tenant,
                user_id=user,
                session_id=session,
                text=text,
                options={"max_tokens": str(max_tokens)},
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


def ledger_rewards(dsn: str, turn_ids: list[str], wait_s: float = 30.0) -> dict[str, float]:
    """Rewards arrive after the answer (learning path); poll the router's ledger for a while."""
    import psycopg

    deadline = time.monotonic() + wait_s
    found: dict[str, float] = {}
    while time.monotonic() < deadline:
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(
                "SELECT turn_id, reward FROM router_ledger WHERE turn_id = ANY(%s)", (turn_ids,)
            )
            found = {r[0]: float(r[1]) for r in rows}
        if len(found) == len(turn_ids):
            break
        time.sleep(0.2)
    return found
