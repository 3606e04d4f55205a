"""`mars replay read` and `mars replay export`: the event log back as turn traces, or as a portable file."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from pathlib import Path

from rich.console import Console

from mars_tools.private_files import open_private
from mars_tools.replay.readers import load_traces, read_topics, topic_prefix_arg
from mars_tools.replay.traces import summarize
from mars_tools.settings import ToolSettings


def _print_summary(console: Console, summary: dict[str, object], seconds: float) -> None:
    console.print(json.dumps(summary, indent=2))
    turns = int(summary["turns"])  # type: ignore[call-overload]
    rate = turns / seconds if seconds > 0 else 0.0
    console.print(
        f"{turns} turn traces ({summary['complete']} complete) in {seconds:.2f}s: {rate:,.0f} traces/s"
    )


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
        # The records' text is sealed only where the stack seals it: the owner's alone either way.
        with open_private(args.out) as fh:
            async for record in read_topics(
                args.bootstrap,
                since_ms=args.since_ms,
                idle_s=args.idle_s,
                prefix=args.topic_prefix,
                until_end=args.until == "end",
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


def add_replay_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    replay = sub.add_parser("replay", help="read the event log back: turn traces, summaries, exports")
    replay_sub = replay.add_subparsers(dest="replay_cmd", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        defaults = ToolSettings()
        p.add_argument(
            "--bootstrap",
            default=defaults.kafka_bootstrap or "127.0.0.1:9092",
            help="Kafka bootstrap servers (default: MARS_KAFKA_BOOTSTRAP, else 127.0.0.1:9092); SASL and TLS "
            "come from the MARS_KAFKA_SECURITY_PROTOCOL/SASL_*/SSL_* variables",
        )
        p.add_argument("--since-ms", type=int, help="start at this Unix time in ms (default: the beginning)")
        p.add_argument(
            "--until",
            choices=("end", "quiet"),
            default="end" if defaults.kafka_trust_end_offsets else "quiet",
            help="where reading the topics stops: end, at each partition's end as the command starts (the "
            "log as of now: a turn still in flight is read in part); quiet, once the log has been quiet "
            "for --idle-s (default: end, quiet where MARS_KAFKA_TRUST_END_OFFSETS=false, as on Tansu)",
        )
        p.add_argument(
            "--idle-s",
            type=float,
            default=2.0,
            help="with --until quiet: stop after the log is quiet this long",
        )
        p.add_argument(
            "--topic-prefix",
            type=topic_prefix_arg,
            default=defaults.topic_prefix,
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

    from mars_tools.replay.redrive import add_run_parser
    from mars_tools.replay.report import add_report_parser

    add_report_parser(replay_sub)
    add_run_parser(replay_sub)
    from mars_tools.replay.offpolicy import add_ope_parser

    add_ope_parser(replay_sub, common)

    e = replay_sub.add_parser(
        "export",
        help="write the stage topics to a portable log file (JSON lines; records carry the base topic names)",
    )
    common(e)
    e.add_argument("--out", required=True, help="the log file to write")
    e.set_defaults(func=cmd_export)
