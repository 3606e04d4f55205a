"""`mars import-history`: a user's recorded conversation (JSON lines) into a running MARS through
`Ingress.ImportHistory`, in calls of up to 500 pairs, with a progress bar."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

from mars.v1 import services_pb2 as svc
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mars_tools.send_cli import caller_args, tenant_of

console = Console()
#: Pairs per call: each call waits for memory to store its pairs, so the bar moves as they are stored.
BATCH = 500
FIELDS = ("session_id", "user_text", "assistant_text", "key")


class RecordedFileError(ValueError):
    """A line of the history file that is not a recorded pair, with its line number."""


def read_recorded(lines: Iterable[str]) -> list[svc.RecordedTurn]:
    """One RecordedTurn per non-empty line: {"session_id", "user_text", "assistant_text"[, "key"]}."""
    out: list[svc.RecordedTurn] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise RecordedFileError(f"line {number}: not JSON ({exc})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("user_text"), str):
            raise RecordedFileError(f'line {number}: expected an object with a "user_text" string')
        unknown = sorted(set(obj) - set(FIELDS))
        if unknown:
            raise RecordedFileError(
                f"line {number}: unknown field(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}"
            )
        if not all(isinstance(obj.get(f, ""), str) for f in FIELDS):
            raise RecordedFileError(f"line {number}: {', '.join(FIELDS)} must be strings")
        out.append(svc.RecordedTurn(**{f: obj.get(f, "") for f in FIELDS}))
    return out


def cmd_import_history(args: argparse.Namespace) -> int:
    import grpc
    from mars.v1 import services_pb2_grpc as svc_grpc
    from mars_ingress.client import ingress_channel

    path = Path(args.file)
    try:
        turns = read_recorded(path.read_text(encoding="utf-8").splitlines())
    except OSError as exc:
        console.print(f"[red]cannot read {path}: {exc.strerror}[/]")
        return 2
    except (RecordedFileError, UnicodeDecodeError) as exc:
        console.print(f"[red]{path}: {exc}[/]")
        return 2
    if not turns:
        console.print(f"[red]{path} holds no recorded pairs[/]")
        return 2
    imported = already = 0
    with (
        ingress_channel(args.target, args.api_key) as channel,
        Progress(
            TextColumn("importing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
        ) as progress,
    ):
        stub = svc_grpc.IngressStub(channel)
        task = progress.add_task("pairs", total=len(turns))
        for start in range(0, len(turns), BATCH):
            batch = turns[start : start + BATCH]
            try:
                reply = stub.ImportHistory(
                    svc.ImportHistoryRequest(
                        tenant=tenant_of(args), user_id=args.user, turns=batch, wait=True
                    ),
                    timeout=args.timeout,
                )
            except grpc.RpcError as exc:
                # The ingress numbers pairs per call (turns[i]): say which pairs of the file this call held.
                console.print(
                    f"[red]{exc.code().name}[/]: {exc.details()} (in the call of pairs {start + 1}-"
                    f"{start + len(batch)} of the file; the {start} before them are stored, and importing "
                    "the file again skips them)"
                )
                return 1
            imported += reply.imported
            already += reply.already_imported
            progress.update(task, advance=len(batch))
    console.print(
        f"{len(turns)} pairs for user {args.user}: {imported} imported, {already} already there "
        f"(last seq {reply.last_seq})"
    )
    return 0


def add_import_history_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "import-history",
        help="store a user's recorded conversation (JSON lines) as their memory, through the ingress",
        description="Each line is one recorded pair: "
        '{"session_id": "...", "user_text": "...", "assistant_text": "...", "key": "optional id"}, in the order '
        "they happened. Pairs are stored through the memory service's normal commit (never judged); "
        "importing the same file again stores nothing new. Takes an admin key of the tenant.",
    )
    p.add_argument("file", help="JSON lines file of recorded pairs")
    p.add_argument("--user", required=True, help="the user whose history it is")
    caller_args(p, "default")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each call of 500 pairs may take")
    p.set_defaults(func=cmd_import_history)
