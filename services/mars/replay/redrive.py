"""`mars replay run`: re-drive recorded turns through a pipeline (possibly configured differently) and
compare its decisions with the recorded ones.

The recorded turns (TurnReceived events of an exported log) are sent through the target's gRPC ingress
under a tenant renamed with `--tenant-suffix`, so the re-drive starts from fresh memory and fresh routing
policies beside the original data. Each user's turns keep their order. `--strict` sends one turn at a
time and waits until its reward has reached the router (the policy version moved) before the next: the
paper's Algorithm 1 exactly, so the same log, configuration and seed give identical decisions.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console
from rich.progress import Progress

from mars.replay.traces import RawRecord, TraceBuilder, records_from_lines
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc


@dataclass(frozen=True)
class RecordedTurn:
    turn_id: str
    tenant: str
    user_id: str
    session_id: str
    seq: int
    text: str
    options: dict[str, str]
    routed_arm: str
    answered_by: str


def recorded_turns(records: list[RawRecord], counts: Counter[str]) -> list[RecordedTurn]:
    """Complete recorded turns in log order (by user, then seq)."""
    builder = TraceBuilder()
    for r in records:
        builder.add(r)
    counts.update(builder.counts)
    out = []
    for t in builder.traces.values():
        received, routed, generated = (
            t.events.get("received"),
            t.events.get("routed"),
            t.events.get("generated"),
        )
        if not isinstance(received, ev.TurnReceived) or not isinstance(routed, ev.Routed):
            counts["skipped_incomplete_turns"] += 1
            continue
        turn = received.turn
        out.append(
            RecordedTurn(
                turn.turn_id,
                turn.tenant,
                turn.user_id,
                turn.session_id,
                turn.seq,
                received.text,
                dict(turn.options),
                routed.chosen_arm,
                generated.model if isinstance(generated, ev.Generated) else "",
            )
        )
    return sorted(out, key=lambda r: (r.tenant, r.user_id, r.seq))


def _policy_version(router: svc_grpc.RouterStub | None, tenant: str, user: str) -> int:
    if router is None:
        return 0
    return int(router.GetPolicy(svc.PolicyRequest(tenant=tenant, user_id=user), timeout=10).version)


def redrive(
    turns: list[RecordedTurn],
    ingress_addr: str,
    suffix: str,
    router_addr: str | None,
    reward_timeout_s: float,
    on_turn: Any = lambda: None,
) -> list[dict[str, Any]]:
    ingress = svc_grpc.IngressStub(grpc.insecure_channel(ingress_addr))
    router = svc_grpc.RouterStub(grpc.insecure_channel(router_addr)) if router_addr else None
    rows = []
    for t in turns:
        tenant = t.tenant + suffix
        before = _policy_version(router, tenant, t.user_id)
        row: dict[str, Any] = {
            "recorded_turn_id": t.turn_id,
            "user_id": t.user_id,
            "seq": t.seq,
            "recorded_arm": t.routed_arm,
            "recorded_answered_by": t.answered_by,
        }
        try:
            reply = ingress.SendTurn(
                svc.TurnRequest(
                    tenant=tenant, user_id=t.user_id, session_id=t.session_id, text=t.text, options=t.options
                ),
                timeout=300,
            )
        except grpc.RpcError as exc:
            row.update(error=f"{exc.code().name}: {exc.details()}")  # type: ignore[attr-defined]
            rows.append(row)
            on_turn()
            continue
        row.update(
            turn_id=reply.turn_id,
            arm=reply.attempts[0].arm if reply.attempts else reply.model,
            answered_by=reply.model,
            text=reply.text,
            cost_usd=reply.cost_usd,
        )
        if router is not None:
            # Strict mode: the next turn may only be decided once this turn's reward is in the policy.
            deadline = time.monotonic() + reward_timeout_s
            while _policy_version(router, tenant, t.user_id) <= before:
                if time.monotonic() > deadline:
                    row["reward_wait"] = "timed out"
                    break
                time.sleep(0.05)
        rows.append(row)
        on_turn()
    return rows


def cmd_run(args: argparse.Namespace) -> int:
    console = Console(soft_wrap=True, stderr=True)
    path = Path(args.file)
    if not path.is_file():
        console.print(f"[red]no log file at {path}[/]")
        return 2
    if args.strict and not args.router:
        console.print("[red]--strict needs --router (to see each reward reach the policy)[/]")
        return 2
    counts: Counter[str] = Counter()
    with path.open(errors="replace") as fh:
        turns = recorded_turns(list(records_from_lines(fh, counts)), counts)
    if args.limit:
        turns = turns[: args.limit]
    suffix = args.tenant_suffix or f"-replay-{int(time.time())}"
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("re-driving", total=len(turns))
        rows = redrive(
            turns,
            args.ingress,
            suffix,
            args.router if args.strict else None,
            args.reward_timeout_s,
            lambda: progress.advance(task),
        )
    done = [r for r in rows if "error" not in r]
    same = sum(r["arm"] == r["recorded_arm"] for r in done)
    summary = {
        "turns": len(rows),
        "answered": len(done),
        "errors": len(rows) - len(done),
        "same_decision_as_recorded": same / len(done) if done else 0.0,
        "tenant_suffix": suffix,
        "log": dict(counts),
    }
    if args.out:
        Path(args.out).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    console.print(json.dumps(summary, indent=2))
    return 0 if not summary["errors"] else 1


def add_run_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "run",
        help="re-drive recorded turns through a pipeline and compare its decisions with the log",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--file", required=True, help="exported log file (`mars replay export`)")
    p.add_argument("--ingress", required=True, help="the target pipeline's ingress HOST:PORT")
    p.add_argument("--router", help="its router HOST:PORT (needed by --strict)")
    p.add_argument(
        "--strict", action="store_true", help="one turn at a time, each reward applied before the next"
    )
    p.add_argument("--tenant-suffix", help="appended to every tenant (default -replay-<unix time>)")
    p.add_argument("--limit", type=int, help="only the first N recorded turns (by user, then seq)")
    p.add_argument(
        "--reward-timeout-s", type=float, default=60.0, help="strict mode: longest wait for a reward"
    )
    p.add_argument("--out", help="write one JSON line per re-driven turn here")
    p.set_defaults(func=cmd_run)
