"""How replay's commands read a run: its topics from a broker, or an exported log, into traces; and the
--topic-prefix argument they share."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from mars import data_keys
from mars.config import Topics, validate_topic_prefix
from mars.kafka_options import env_kafka_options
from rich.console import Console
from rich.progress import Progress

from mars_tools.replay.traces import TOPICS, RawRecord, TraceBuilder, records_from_lines


async def read_topics(
    bootstrap: str,
    topics: tuple[str, ...] = TOPICS,
    since_ms: int | None = None,
    idle_s: float = 2.0,
    on_record: Callable[[], None] = lambda: None,
    prefix: str = "",
    kafka: dict[str, Any] | None = None,
    until_end: bool = False,
) -> AsyncGenerator[RawRecord, None]:
    """Every record of `topics` (base names) of the run with topic prefix `prefix`, from the beginning (or
    from `since_ms`), until the log has been quiet for `idle_s`, or with `until_end` up to the end offsets
    the broker reports as the read begins (the log as of now; on a broker whose end offsets can be trusted,
    which Tansu's cannot). Records carry the base topic name, so traces and exported files read the same
    whatever the prefix. `kafka`: client options; default `bootstrap` with the security settings of the
    MARS_* environment (SASL, TLS)."""
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
        ends = await consumer.end_offsets(tps) if until_end else None
        last = time.monotonic()
        while await behind_end(consumer, ends) if ends is not None else time.monotonic() - last < idle_s:
            batch = await consumer.getmany(timeout_ms=200, max_records=5000)
            for tp, records in batch.items():
                for r in records:
                    on_record()
                    base = names.base(tp.topic) or tp.topic
                    yield RawRecord(base, tp.partition, r.offset, r.timestamp, r.value or b"")
                last = time.monotonic()
    finally:
        await consumer.stop()


async def behind_end(consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]) -> bool:
    """Whether the consumer has some partition not yet read up to its end offset in `ends`."""
    for tp, end in ends.items():
        if await consumer.position(tp) < end:
            return True
    return False


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
                    until_end=args.until == "end",
                ):
                    builder.add(record)

            try:
                asyncio.run(run())
            except Exception as exc:  # a broker that cannot be reached: a message, not a traceback
                console.print(f"[red]cannot read from {args.bootstrap}: {type(exc).__name__}: {exc}[/]")
                return builder, 1
    return builder, 0


def topic_prefix_arg(value: str) -> str:
    """argparse type of --topic-prefix: the prefix, or a usage error saying what is wrong with it."""
    try:
        return validate_topic_prefix(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
