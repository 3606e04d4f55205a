"""Where a turn's time goes: the per-hop decomposition of MARS's overhead from the services' spans, and
the floor (the cheapest each part can be on this machine) measured beside it.

The services write their spans to `MARS_TRACE_DIR` (batched: `MARS_TRACE_BATCH=true`). One turn is one
trace (the ingress call starts it; every Kafka hop carries it in the headers). Its critical path is cut
into consecutive segments that add up to the ingress call exactly:

    ingress accept   call start -> publish of mars.turn.received starts (seq, row and outbox in Postgres)
    hop -> state     that publish starts -> the state handler starts (broker hop, fetch, queueing)
    state            handler start -> its publish starts
    hop -> memory, memory view, hop -> router, router, hop -> dispatch, dispatch (model call removed),
    hop -> ingress   publish of mars.turn.generated starts -> the ingress reply reader gets it
    ingress reply    -> the call returns

Work a stage does after it publishes (waiting for the broker's ack, marking the event emitted, committing
offsets) is off the turn's critical path but holds up the records behind it: it shows as queueing in the
next hop. Steps inside the stages (`mars.telemetry.step` spans: embedding, search, Postgres round trips,
packing) are reported beside the segments as their mean per turn.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: (segment, service of the handler that starts it, the topic it consumes, the topic it then publishes)
STAGES = [
    ("state", "state", "mars.turn.received", "mars.turn.state"),
    ("memory view", "memory", "mars.turn.state", "mars.turn.view"),
    ("router", "router", "mars.turn.view", "mars.turn.routed"),
    ("dispatch", "dispatch", "mars.turn.routed", "mars.turn.generated"),
]
SEGMENTS = [
    "ingress accept",
    "hop -> state",
    "state",
    "hop -> memory",
    "memory view",
    "hop -> router",
    "router",
    "hop -> dispatch",
    "dispatch",
    "hop -> ingress",
    "ingress reply",
]
#: Answer-path steps reported beside the segments (mean ms per turn), keyed "service name".
STEPS = [
    "ingress ingress accept",
    "state done-check",
    "memory done-check",
    "memory memory snapshot",
    "memory memory wait-applied",
    "memory memory embed-query",
    "memory memory search",
    "router done-check",
    "router router phases",
    "router router decide",
    "router router record",
    "dispatch done-check",
    "dispatch dispatch pack",
    "dispatch dispatch model-call",
]


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    start: float  # seconds since the epoch
    end: float
    turn_id: str

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1000


def read_spans(trace_dir: Path) -> list[Span]:
    spans = []
    for path in sorted(trace_dir.glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                raw = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a process that was stopped while writing
            if raw.get("start_ns") is None or raw.get("end_ns") is None:
                continue
            spans.append(
                Span(
                    service=raw["service"],
                    name=raw["name"],
                    trace_id=raw["trace_id"],
                    start=raw["start_ns"] / 1e9,
                    end=raw["end_ns"] / 1e9,
                    turn_id=str((raw.get("attributes") or {}).get("mars.turn_id", "")),
                )
            )
    return spans


def _first(spans: Iterable[Span], service: str, name: str) -> Span | None:
    found = [s for s in spans if s.service == service and s.name == name]
    return min(found, key=lambda s: s.start) if found else None


def turn_segments(spans: list[Span]) -> tuple[dict[str, float], dict[str, float], float] | None:
    """One trace's segments (ms), its answer-path steps (ms, summed per name) and the ingress call's
    duration minus the model calls (ms); None when a span of the critical path is missing."""
    call = _first(spans, "ingress", "ingress SendTurn")
    if call is None:
        return None
    marks: list[tuple[str, float]] = []
    published = _first(spans, "ingress", "publish mars.turn.received")
    if published is None:
        return None
    marks.append(("ingress accept", published.start))
    model_ms = 0.0
    previous = published
    for segment, service, consumes, produces in STAGES:
        handler = _first(spans, service, f"{service} {consumes}")
        out = _first(
            [s for s in spans if handler is not None and s.start >= handler.start],
            service,
            f"publish {produces}",
        )
        if handler is None or out is None:
            return None
        marks.append((f"hop -> {segment.split()[0]}", handler.start))
        marks.append((segment, out.start))
        if service == "dispatch":
            model_ms = sum(s.ms for s in spans if s.service == "dispatch" and s.name == "dispatch model-call")
        previous = out
    reply = _first([s for s in spans if s.start >= previous.start], "ingress", "ingress mars.turn.generated")
    if reply is None or reply.start > call.end:
        return None  # the call ended (its deadline) before the answer came: not an answered call
    marks.append(("hop -> ingress", reply.start))
    marks.append(("ingress reply", call.end))
    segments: dict[str, float] = {}
    at = call.start
    for name, until in marks:
        segments[name] = (until - at) * 1000
        at = until
    segments["dispatch"] -= model_ms
    steps: dict[str, float] = defaultdict(float)
    for s in spans:
        key = f"{s.service} {s.name}"
        # Only the answer path: the learning path (memory commit, judge) runs after the generated event.
        if key in STEPS and s.start < previous.start:
            steps[key] += s.ms
    return segments, dict(steps), (call.end - call.start) * 1000 - model_ms


def decompose(spans: list[Span], since: float, until: float) -> dict[str, Any]:
    """Summary of the answered turns whose ingress call started in [since, until) (epoch seconds)."""
    by_trace: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    rows = []
    for trace_spans in by_trace.values():
        call = _first(trace_spans, "ingress", "ingress SendTurn")
        if call is None or not since <= call.start < until:
            continue
        found = turn_segments(trace_spans)
        if found is not None:
            rows.append(found)
    if not rows:
        return {"turns": 0, "segments": {}, "steps": {}}

    def summary(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {
            "mean_ms": statistics.fmean(values),
            "p50_ms": ordered[len(ordered) // 2],
            "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        }

    return {
        "turns": len(rows),
        "server_overhead": summary([r[2] for r in rows]),
        "segments": {name: summary([r[0][name] for r in rows]) for name in SEGMENTS},
        # Mean per turn (a step a turn did not take counts 0): what the segments are made of.
        "steps": {name: statistics.fmean(r[1].get(name, 0.0) for r in rows) for name in STEPS},
    }


def cpu_seconds(sessions: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each named process and everything in its session or
    forked from it (its threads, Postgres's backends), from /proc; processes that exited are not counted.
    `sessions`: name -> session leader pid (the
    stack starts every process in a session of its own)."""
    tick = os.sysconf("SC_CLK_TCK")
    leader_name = {pid: name for name, pid in sessions.items()}
    used = dict.fromkeys(sessions, 0.0)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        # The session id (Postgres's backends start sessions of their own: then their parent, the postmaster).
        name = leader_name.get(int(fields[3])) or leader_name.get(int(fields[1]))
        if name is not None:
            used[name] += (int(fields[11]) + int(fields[12])) / tick
    return used


def wait_idle(
    sessions: dict[str, int], below_cores: float = 0.3, quiet_s: float = 3.0, max_s: float = 180.0
) -> float:
    """Wait until the processes use less than `below_cores` in all for `quiet_s` (a backlog left by an
    overloaded rate drained), at most `max_s`; the seconds waited."""
    started = time.monotonic()
    quiet_since = None
    before = cpu_seconds(sessions)
    while time.monotonic() - started < max_s:
        time.sleep(1.0)
        now = cpu_seconds(sessions)
        busy = sum(now.values()) - sum(before.values())
        before = now
        if busy < below_cores:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= quiet_s:
                break
        else:
            quiet_since = None
    return time.monotonic() - started


def by_window(spans: list[Span], since: float, until: float, window_s: float) -> list[dict[str, float]]:
    """Server overhead p50 / p99 of the answered turns started in each `window_s` of [since, until): a
    soak's drift (a leak or a growing queue shows as windows getting slower)."""
    rows = []
    start = since
    while start < until:
        cut = decompose(spans, start, min(start + window_s, until))
        rows.append(
            {
                "from_s": start - since,
                "turns": cut["turns"],
                "p50_ms": cut.get("server_overhead", {}).get("p50_ms", float("nan")),
                "p99_ms": cut.get("server_overhead", {}).get("p99_ms", float("nan")),
            }
        )
        start += window_s
    return rows


def _p50(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


async def floor_hop(bootstrap: str, env: dict[str, str], hops: int) -> float:
    """p50 ms of one record produced and consumed on its own, with the services' producer and fetch
    settings (acks=all, idempotence as configured, the same fetch wait)."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from mars_stack import stack_kafka_options

    topic = f"mars.load.floor.{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(**stack_kafka_options(bootstrap))
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(
        **stack_kafka_options(bootstrap),
        acks="all",
        linger_ms=1,
        enable_idempotence=env.get("MARS_KAFKA_IDEMPOTENCE", "false") == "true",
    )
    consumer = AIOKafkaConsumer(
        **stack_kafka_options(bootstrap),
        enable_auto_commit=False,
        fetch_max_wait_ms=int(env.get("MARS_KAFKA_FETCH_MAX_WAIT_MS", "500")),
    )
    await producer.start()
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)
        took = []
        for i in range(hops):
            t0 = time.perf_counter()
            await producer.send_and_wait(topic, f"hop {i}".encode(), key=b"floor")
            got = await consumer.getone()
            took.append((time.perf_counter() - t0) * 1000)
            assert got.value == f"hop {i}".encode()
        return _p50(took[min(10, hops // 10) :])  # the first hops warm the connections
    finally:
        await consumer.stop()
        await producer.stop()


async def floor_transaction(dsn: str, count: int) -> float:
    """p50 ms of one small durable write transaction (BEGIN, INSERT, COMMIT) from a pooled connection."""
    import psycopg

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        table = f"load_floor_{uuid.uuid4().hex[:8]}"
        await conn.execute(f"CREATE TABLE {table} (id TEXT PRIMARY KEY, at TIMESTAMPTZ DEFAULT now())")
        try:
            took = []
            for _ in range(count):
                t0 = time.perf_counter()
                async with conn.transaction():
                    await conn.execute(f"INSERT INTO {table} (id) VALUES (%s)", (uuid.uuid4().hex,))
                took.append((time.perf_counter() - t0) * 1000)
            return _p50(took)
        finally:
            await conn.execute(f"DROP TABLE {table}")


def floor_embedding_and_search(count: int, history: int = 200) -> tuple[float, float, float]:
    """p50 ms of one query embedding (a text not seen before), of one hybrid search (dense + BM25, fused)
    over `history` records with the query's vector already computed, and of one stored pair's embedding
    (the question and the stand-in's answer as the memory writer embeds them: MemoryRecord.text, chunked by
    the fusion's max_chunk_words), all with the memory service's default embedder (model and window)."""
    from mars.domain.memory_policy import MemoryRecord
    from mars.retrieval.embedder import LruEmbedder, load_embedder
    from mars.retrieval.hybrid import HybridMemory, embed_chunks

    embedder = load_embedder()
    words = (
        "ferry budget hotel museum recipe garden invoice violin passport bicycle concert telescope".split()
    )
    texts = [
        f"record {i}: the {words[i % 12]} and the {words[(i * 7) % 12]} we talked about, with the "
        f"{words[(i * 5) % 12]} plan for day {i}"
        for i in range(history)
    ]
    queries = [
        f"question {i}: what about the {words[i % 12]} and the {words[(i * 3) % 12]}?" for i in range(count)
    ]
    cached = LruEmbedder(embedder)
    memory = HybridMemory(embedder, query_embedder=cached)
    for i, text in enumerate(texts):
        memory.add_group(f"r{i}", i, [text], embed_chunks(embedder, [text], memory.config.max_chunk_words))
    embed_ms, search_ms, pair_ms = [], [], []
    for query in queries:
        t0 = time.perf_counter()
        cached.encode([query])
        t1 = time.perf_counter()
        memory.rank_groups(query, [], len(memory), memory.config)
        t2 = time.perf_counter()
        pair = MemoryRecord(
            record_id="", session_id="", turn_id="", seq=0, user_text=query, assistant_text=standin_llm_reply(query)
        )
        embed_chunks(embedder, [pair.text], memory.config.max_chunk_words)
        t3 = time.perf_counter()
        embed_ms.append((t1 - t0) * 1000)
        search_ms.append((t2 - t1) * 1000)
        pair_ms.append((t3 - t2) * 1000)
    return _p50(embed_ms), _p50(search_ms), _p50(pair_ms)


def standin_llm_reply(question: str) -> str:
    """The stand-in LLM's answer to `question` (what the memory writer stores beside it)."""
    from mars_stack.standin_llm import reply_text

    return reply_text([{"role": "user", "content": question}])


#: Parts of a turn the floor counts: five broker hops (received, state, view, routed, generated), one
#: query embedding, one search, one durable Postgres transaction (ingress must record the turn), and the
#: stored pair's embedding (work a memory system must do for every turn, off the answer path).
FLOOR_HOPS = 5
FLOOR_TRANSACTIONS = 1


def measure_floor(bootstrap: str, env: dict[str, str], dsn: str, count: int = 200) -> dict[str, float]:
    hop = asyncio.run(floor_hop(bootstrap, env, count))
    txn = asyncio.run(floor_transaction(dsn, count))
    embedding, search, pair = floor_embedding_and_search(count)
    return {
        "hop_ms": hop,
        "embedding_ms": embedding,
        "search_ms": search,
        "transaction_ms": txn,
        "pair_embedding_ms": pair,
        "sum_ms": FLOOR_HOPS * hop + embedding + search + FLOOR_TRANSACTIONS * txn + pair,
    }


def print_decomposition(rows: list[dict[str, Any]], floor: dict[str, float] | None) -> None:
    """Mean ms per segment for each rate (columns), then the steps, then the floor."""
    if not rows:
        return
    header = f"{'segment (mean ms)':32s}" + "".join(f"{r['rate']:>9g}/s" for r in rows)
    print("\nwhere the overhead goes\n" + header)
    for name in SEGMENTS:
        print(
            f"{name:32s}"
            + "".join(f"{r['segments'].get(name, {}).get('mean_ms', float('nan')):11.1f}" for r in rows)
        )
    print(
        f"{'= server overhead (mean)':32s}"
        + "".join(f"{r.get('server_overhead', {}).get('mean_ms', float('nan')):11.1f}" for r in rows)
    )
    print(
        f"{'  server overhead p50':32s}"
        + "".join(f"{r.get('server_overhead', {}).get('p50_ms', float('nan')):11.1f}" for r in rows)
    )
    print("steps (mean ms per turn)")
    for name in STEPS:
        print(f"  {name:30s}" + "".join(f"{r['steps'].get(name, float('nan')):11.1f}" for r in rows))
    if floor:
        print(
            f"floor: hop {floor['hop_ms']:.2f} ms, embedding {floor['embedding_ms']:.2f} ms, "
            f"search {floor['search_ms']:.2f} ms, Postgres transaction {floor['transaction_ms']:.2f} ms, "
            f"stored pair embedding {floor['pair_embedding_ms']:.2f} ms; {FLOOR_HOPS} hops + embedding + "
            f"search + {FLOOR_TRANSACTIONS} transaction + pair embedding = {floor['sum_ms']:.1f} ms"
        )
