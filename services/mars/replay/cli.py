"""`mars replay read` and `mars replay export`: the event log back as turn traces, or as a portable file."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from rich.console import Console
from rich.progress import Progress

from mars import data_keys
from mars.config import Topics, validate_topic_prefix
from mars.kafka_options import env_kafka_options
from mars.private_files import open_private
from mars.replay.traces import TOPICS, RawRecord, TraceBuilder, records_from_lines, summarize


async def read_topics(
    bootstrap: str,
    topics: tuple[str, ...] = TOPICS,
    since_ms: int | None = None,
    idle_s: float = 2.0,
    on_record: Callable[[], None] = lambda: None,
    prefix: str = "",
    kafka: dict[str, Any] | None = None,
) -> AsyncIterator[RawRecord]:
    """Every record of `topics` (base names) of the run with topic prefix `prefix`, from the beginning (or
    from `since_ms`), until the log has been quiet for `idle_s`. Records carry the base topic name, so
    traces and exported files read the same whatever the prefix. End offsets are not trusted (seen wrong
    on the embedded broker); quiet time is. `kafka`: client options; default `bootstrap` with the security
    settings of the MARS_* environment (SASL, TLS)."""
    names = Topics(prefix)
    consumer = AIOKafkaConsumer(
        **(kafka if kafka is not None else env_kafka_options(bootstrap)),
        enable_auto_commit=False,
        fetch_max_wait_ms=50,
        max_partition_fetch_bytes=8 << 20,
    )
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()  # type: ignore[attr-defined]
        tps = [
            TopicPartition(names.name(t), p)
            for t in topics
            for p in sorted(consumer.partitions_for_topic(names.name(t)) or ())
        ]
        if not tps:
            return
        consumer.assign(tps)
        if since_ms is None:
            await consumer.seek_to_beginning(*tps)
        else:
            offsets = await consumer.offsets_for_times({tp: since_ms for tp in tps})
            for tp, found in offsets.items():
                if found is None:
                    await consumer.seek_to_end(tp)
                else:
                    consumer.seek(tp, found.offset)
        last = time.monotonic()
        while time.monotonic() - last < idle_s:
            batch = await consumer.getmany(timeout_ms=200, max_records=5000)
            for tp, records in batch.items():
                for r in records:
                    on_record()
                    base = names.base(tp.topic) or tp.topic
                    yield RawRecord(base, tp.partition, r.offset, r.timestamp, r.value or b"")
                last = time.monotonic()
    finally:
        await consumer.stop()


def _print_summary(console: Console, summary: dict[str, object], seconds: float) -> None:
    console.print(json.dumps(summary, indent=2))
    turns = int(summary["turns"])  # type: ignore[call-overload]
    rate = turns / seconds if seconds > 0 else 0.0
    console.print(
        f"{turns} turn traces ({summary['complete']} complete) in {seconds:.2f}s: {rate:,.0f} traces/s"
    )


def load_traces(args: argparse.Namespace, console: Console) -> tuple[TraceBuilder, int]:
    """Traces from `args.file` (an exported log) or from the topics (`args.bootstrap`, `since_ms`,
    `idle_s`, `topic_prefix`); the exit code is non-zero after an error was printed."""
    builder = TraceBuilder(data_keys.tool_keyring(lambda msg: console.print(f"[yellow]{msg}[/]")))
    if args.file:
        path = Path(args.file)
        if not path.is_file():
            console.print(f"[red]no log file at {path}[/]")
            return builder, 2
        with path.open(errors="replace") as fh:
            for record in records_from_lines(fh, builder.counts):
                builder.add(record)
    else:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("reading topics", total=None)
            seen = 0

            def tick() -> None:
                nonlocal seen
                seen += 1
                if seen % 1000 == 0:
                    progress.update(task, completed=seen)

            async def run() -> None:
                async for record in read_topics(
                    args.bootstrap,
                    since_ms=args.since_ms,
                    idle_s=args.idle_s,
                    on_record=tick,
                    prefix=args.topic_prefix,
                ):
                    builder.add(record)

            try:
                asyncio.run(run())
            except Exception as exc:  # a broker that cannot be reached: a message, not a traceback
                console.print(f"[red]cannot read from {args.bootstrap}: {type(exc).__name__}: {exc}[/]")
                return builder, 1
    return builder, 0


def cmd_read(args: argparse.Namespace) -> int:
    console = Console(soft_wrap=True, stderr=True)
    started = time.perf_counter()
    builder, rc = load_traces(args, console)
    if rc:
        return rc
    seconds = time.perf_counter() - started
    if args.out:
        # Opened with the data keys, the traces hold users' words in the clear: the owner's alone, and out
        # of reach of a forget (it deletes keys, not this file).
        with open_private(args.out) as fh:
            for trace in builder.traces.values():
                fh.write(json.dumps(trace.to_dict()) + "\n")
        console.print(
            f"traces written to {args.out} (mode 0600): opened turn text is in the clear there, and "
            "forgetting a user does not reach it; delete it when done"
        )
    summary = summarize(builder)
    _print_summary(console, summary, seconds)
    if args.summary:
        Path(args.summary).write_text(json.dumps(summary, indent=2))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    console = Console(soft_wrap=True, stderr=True)
    counts: Counter[str] = Counter()

    async def run() -> None:
        with Path(args.out).open("w") as fh:
            async for record in read_topics(
                args.bootstrap, since_ms=args.since_ms, idle_s=args.idle_s, prefix=args.topic_prefix
            ):
                fh.write(record.to_json() + "\n")
                counts[record.topic] += 1

    try:
        asyncio.run(run())
    except Exception as exc:
        console.print(f"[red]cannot read from {args.bootstrap}: {type(exc).__name__}: {exc}[/]")
        return 1
    console.print(f"{sum(counts.values())} records written to {args.out}: {dict(counts)}")
    return 0


def topic_prefix_arg(value: str) -> str:
    """argparse type of --topic-prefix: the prefix, or a usage error saying what is wrong with it."""
    try:
        return validate_topic_prefix(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_replay_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    replay = sub.add_parser("replay", help="read the event log back: turn traces, summaries, exports")
    replay_sub = replay.add_subparsers(dest="replay_cmd", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--bootstrap",
            default=os.environ.get("MARS_KAFKA_BOOTSTRAP", "127.0.0.1:9092"),
            help="Kafka bootstrap servers (default: MARS_KAFKA_BOOTSTRAP, else 127.0.0.1:9092); SASL and TLS "
            "come from the MARS_KAFKA_SECURITY_PROTOCOL/SASL_*/SSL_* variables",
        )
        p.add_argument("--since-ms", type=int, help="start at this Unix time in ms (default: the beginning)")
        p.add_argument("--idle-s", type=float, default=2.0, help="stop after the log is quiet this long")
        p.add_argument(
            "--topic-prefix",
            type=topic_prefix_arg,
            default=os.environ.get("MARS_TOPIC_PREFIX", ""),
            help="read the run whose topics carry this prefix (default: MARS_TOPIC_PREFIX, e.g. run7.)",
        )

    r = replay_sub.add_parser(
        "read",
        help="join each turn's stage events into one trace; print the summary",
        description="Reads the stage topics (or an exported log file), joins events by turn_id, writes one JSON "
        "trace per turn and prints turns, failures, fallbacks, stage latencies, the two cost views, rewards and "
        "routing shares by state slice. Missing stages, duplicates, unknown schema versions and unreadable "
        "lines are counted, never fatal. Sealed user text is opened with the users' data keys when "
        "MARS_MASTER_KEY_FILE and MARS_POSTGRES_DSN are set as for the services; turns of forgotten users "
        "(their key deleted) are left out and counted as forgotten_turns.",
    )
    common(r)
    r.add_argument("--file", help="read this exported log file instead of the topics")
    r.add_argument("--out", help="write the traces as JSON lines here")
    r.add_argument("--summary", help="write the summary as JSON here")
    r.set_defaults(func=cmd_read)

    from mars.replay.redrive import add_run_parser
    from mars.replay.report import add_report_parser

    add_report_parser(replay_sub)
    add_run_parser(replay_sub)
    from mars.replay.offpolicy import add_ope_parser

    add_ope_parser(replay_sub, common)

    e = replay_sub.add_parser(
        "export",
        help="write the stage topics to a portable log file (JSON lines; records carry the base topic names)",
    )
    common(e)
    e.add_argument("--out", required=True, help="the log file to write")
    e.set_defaults(func=cmd_export)
