"""`mars bench replay`: how fast `mars replay read` turns the log into traces, against a local broker.

Starts the embedded broker (Tansu), writes `--turns` synthetic turns (one event per stage, realistic
sizes: a state, a view of 8 blocks, a routed event with 35 features, a generated answer, a judgement),
then reads them back through the same code as `mars replay read` and prints traces per second, counted
from the first record to the last (the final quiet wait that ends a read is excluded).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from aiokafka import AIOKafkaProducer
from google.protobuf.message import Message
from mars.bus.codec import event_key
from mars.bus.topics import ensure_topics
from mars.config import SCHEMA_VERSION
from mars.v1 import events_pb2 as ev
from rich.console import Console

from mars_tools.replay.readers import read_topics
from mars_tools.replay.traces import STAGES, TraceBuilder, summarize


def synthetic_turn(i: int) -> list[tuple[str, bytes, bytes]]:
    turn = ev.TurnEnvelope(
        turn_id=f"bench-{i}", tenant="bench", user_id=f"u{i % 200}", session_id="s", seq=i // 200 + 1,
        received_at_ms=int(time.time() * 1000), schema_version=SCHEMA_VERSION,
    )  # fmt: skip
    state = ev.SessionState(action=ev.MATCH, phase=ev.REVISE, retrieval_scope=ev.LOCAL, top_k_hint=5)
    view = ev.CandidateView()
    for b in range(8):
        view.blocks.add(block_id=f"b{b}", kind=ev.RETRIEVED_HISTORY, text="memory text " * 40, score=0.5)
    view.load.estimated_tokens = 2000 + i % 3000
    text = "What should I change in the draft?"
    generated = ev.Generated(
        turn=turn, status=ev.OK, model="arm-a", text="An answer " * 30, cost_usd=1e-4, state=state
    )
    generated.attempts.add(arm="arm-a", ok=True)
    events: dict[str, Message] = {
        "received": ev.TurnReceived(turn=turn, text=text),
        "state": ev.StateEstimated(turn=turn, text=text, state=state),
        "view": ev.ViewBuilt(turn=turn, text=text, state=state, view=view),
        "routed": ev.Routed(
            turn=turn, text=text, state=state, view=view, features=[0.5] * 35, chosen_arm="arm-a"
        ),
        "generated": generated,
        "judged": ev.Judged(turn=turn, arm="arm-a", utility=0.7, reward=0.69, cost_usd=1e-4),
    }
    return [(topic, event_key(turn), events[name].SerializeToString()) for name, topic, _ in STAGES]


def _local(bootstrap: str) -> dict[str, Any]:
    """Client options for the bench's own embedded broker: plaintext, whatever MARS_KAFKA_* says."""
    return {"bootstrap_servers": bootstrap}


async def _write(bootstrap: str, turns: int) -> None:
    producer = AIOKafkaProducer(**_local(bootstrap), enable_idempotence=False, linger_ms=20)
    await producer.start()
    try:
        pending = []
        for i in range(turns):
            for topic, key, value in synthetic_turn(i):
                pending.append(await producer.send(topic, value, key=key))
            if len(pending) >= 3000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()


async def _read(bootstrap: str) -> tuple[TraceBuilder, float]:
    builder = TraceBuilder()
    first = last = 0.0
    async for record in read_topics(bootstrap, idle_s=2.0, kafka=_local(bootstrap)):
        now = time.perf_counter()
        first = first or now
        builder.add(record)
        last = time.perf_counter()
    return builder, last - first


def cmd_replay_bench(args: argparse.Namespace) -> int:
    from mars_stack import LocalStack, StackSettings

    console = Console(soft_wrap=True)
    console.print("starting the embedded broker")
    stack = LocalStack(
        StackSettings(
            start_postgres=False, start_llm=False, services=(), partitions=3, kafka_security="plaintext"
        )
    ).start()
    try:
        bootstrap = stack.env["MARS_KAFKA_BOOTSTRAP"]
        asyncio.run(ensure_topics(_local(bootstrap), 3))
        t0 = time.perf_counter()
        asyncio.run(_write(bootstrap, args.turns))
        console.print(
            f"wrote {args.turns} turns ({args.turns * len(STAGES)} events) in {time.perf_counter() - t0:.1f}s"
        )
        builder, seconds = asyncio.run(_read(bootstrap))
        t1 = time.perf_counter()
        summary = summarize(builder)
        summarize_s = time.perf_counter() - t1
    finally:
        stack.stop()
    rate = summary["complete"] / seconds if seconds > 0 else 0.0
    console.print(
        f"read {summary['complete']} complete traces in {seconds:.2f}s: {rate:,.0f} traces/s "
        f"(summary {summarize_s * 1000:.0f} ms)"
    )
    return 0


def add_replay_bench_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "replay",
        help="`mars replay read` throughput against the embedded broker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--turns", type=int, default=10_000, help="synthetic turns to write and read (default 10,000)"
    )
    p.set_defaults(func=cmd_replay_bench)
