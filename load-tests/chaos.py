"""Chaos harness: open-loop turns through a replicated local stack while processes crash, the broker
stalls and Postgres restarts; then every invariant is checked from Postgres and the topics.

    .venv/bin/python load-tests/chaos.py --scenario chaos-basic [--short] --json OUT

chaos-basic: 1,000 turns over 50 users at 20 turns/s, 2 replicas of every service, Apache Kafka. During
the run: SIGKILL one replica of each service once (spread over the run), SIGSTOP the broker for 5 s,
restart Postgres once. `--short` is the same with 100 turns over 20 users at 10 turns/s. The generators
are the stand-in LLM (fixed 50 ms): the run measures MARS's own behaviour, not a model's.

Checked afterwards:
  lost                every accepted turn (a row in ingress_turns) ends ANSWERED, or FAILED / TIMEOUT with
                      a reason; an ANSWERED turn has its answer on the generated topic, and a call answered
                      OK is recorded ANSWERED.
  duplicate_updates   router pulls beyond one per judged turn and arm (Eq. 11 applied twice).
  duplicate_records   memory records stored twice for one turn (or one user seq).
  stale_indexes       (user, memory replica) pairs whose index differs from a rebuild from Postgres.
Exit code 0 when all four are 0, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TENANT = "chaos"
WARMUP_TENANT = "chaos-warmup"


@dataclass(frozen=True)
class Scenario:
    turns: int
    users: int
    rate: float
    replicas: int = 2
    #: Each call's deadline (the caller never waits longer).
    deadline_s: float = 30.0
    broker_stall_s: float = 5.0


SCENARIOS = {"chaos-basic": Scenario(turns=1000, users=50, rate=20.0)}
SHORT = Scenario(turns=100, users=20, rate=10.0)
WORDS = (
    "ferry timetable budget hotel museum hiking recipe garden invoice deadline violin marathon "
    "passport allergy bicycle concert mortgage puppy telescope vaccine wedding tax thesis roof"
).split()


@dataclass
class Call:
    i: int
    user: str
    sent_s: float  # since the load started
    latency_s: float = 0.0
    code: str = ""
    turn_id: str = ""
    detail: str = ""


@dataclass
class Fault:
    at_s: float
    action: str
    target: str
    done_s: float = 0.0
    recovered_s: float | None = None


@dataclass
class Report:
    scenario: str
    broker: str
    turns: int
    users: int
    rate: float
    replicas: int
    accepted: int = 0
    answered: int = 0
    failed: int = 0
    timeout: int = 0
    lost: int = 0
    duplicate_updates: int = 0
    duplicate_records: int = 0
    stale_indexes: int = 0
    missing_records: int = 0
    missing_updates: int = 0
    stale_views: int = 0
    calls_ok: int = 0
    calls_error: dict[str, int] = field(default_factory=dict)
    achieved_rate: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    p99_before_ms: float = 0.0
    faults: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0
    wall_s: float = 0.0
    calls: list[dict[str, Any]] = field(default_factory=list)
    process_events: list[dict[str, Any]] = field(default_factory=list)


# --- load ---------------------------------------------------------------------------------------------


async def send_turns(
    targets: list[str],
    sc: Scenario,
    seed: int,
    calls: list[Call],
    t0: float,
    api_key: str,
    tenant: str = TENANT,
) -> None:
    """Open loop: turn i leaves at t0 + i / rate whatever happened to the turns before it."""
    import grpc
    from mars.v1 import services_pb2 as svc
    from mars.v1 import services_pb2_grpc as svc_grpc
    from mars_ingress.client import aio_ingress_channel

    rng = random.Random(seed)
    # Client-side round robin over the ingress replicas, like a Kubernetes Service: a dead replica is
    # dropped from the pick list until it is back.
    target = "ipv4:" + ",".join(targets)
    channel = aio_ingress_channel(target, api_key, options=[("grpc.lb_policy_name", "round_robin")])
    stub = svc_grpc.IngressStub(channel)

    async def one(call: Call, text: str) -> None:
        started = time.monotonic()
        try:
            reply = await stub.SendTurn(
                svc.TurnRequest(tenant=tenant, user_id=call.user, session_id="s1", text=text),
                timeout=sc.deadline_s,
            )
            call.code, call.turn_id = "OK", reply.turn_id
        except grpc.aio.AioRpcError as exc:
            call.code, call.detail = exc.code().name, (exc.details() or "")[:200]
        call.latency_s = time.monotonic() - started

    tasks = []
    for i in range(sc.turns):
        user = f"u{i % sc.users:03d}"
        text = f"turn {i // sc.users}: what about the {rng.choice(WORDS)} and the {rng.choice(WORDS)}?"
        delay = t0 + i / sc.rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        call = Call(i, user, time.monotonic() - t0)
        calls.append(call)
        tasks.append(asyncio.create_task(one(call, text)))
    await asyncio.gather(*tasks)
    await channel.close()


# --- faults -------------------------------------------------------------------------------------------


def fault_plan(sc: Scenario, duration_s: float, seed: int) -> list[Fault]:
    """One SIGKILL per service (a random replica), the broker stall and the Postgres restart, spread
    evenly over the middle of the run in a seeded order."""
    from mars import topology

    rng = random.Random(seed)
    faults = [
        Fault(0.0, "kill", f"{s}-{rng.randint(1, sc.replicas)}" if sc.replicas > 1 else s)
        for s in topology.NAMES
    ]
    faults += [Fault(0.0, "stall", "broker"), Fault(0.0, "restart", "postgres")]
    rng.shuffle(faults)
    start, end = 0.15 * duration_s, 0.85 * duration_s
    for k, fault in enumerate(faults):
        fault.at_s = start + (end - start) * k / max(1, len(faults) - 1)
    return faults


def run_faults(stack: Any, faults: list[Fault], sc: Scenario, t0: float, log: Callable[[str], None]) -> None:
    for fault in faults:
        delay = t0 + fault.at_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        log(f"t={time.monotonic() - t0:5.1f}s  {fault.action} {fault.target}")
        if fault.action == "kill":
            stack.kill(fault.target)
        elif fault.action == "stall":
            stack.pause(fault.target)
            # Resumed from a timer, so the faults after it keep their schedule.
            threading.Timer(sc.broker_stall_s, stack.resume, args=(fault.target,)).start()
        elif fault.action == "restart":
            stack.restart(fault.target)
        fault.done_s = time.monotonic() - t0


# --- checks -------------------------------------------------------------------------------------------


def read_log(bootstrap: str, topics: tuple[str, ...]) -> dict[str, list[bytes]]:
    """Every record of the stage topics (base names), through the replay tool's reader."""
    from mars_stack import stack_kafka_options
    from mars_tools.replay.readers import read_topics

    async def _read() -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {t: [] for t in topics}
        async for record in read_topics(bootstrap, topics, kafka=stack_kafka_options(bootstrap)):
            out[record.topic].append(record.value)
        return out

    return asyncio.run(_read())


def wait_settled(dsn: str, timeout_s: float, log: Callable[[str], None]) -> None:
    """Until no turn is PENDING and the learning path (memory, router) stopped moving for 5 s."""
    import psycopg

    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        try:
            with psycopg.connect(dsn) as conn:
                pending = conn.execute(
                    "SELECT count(*) FROM ingress_turns WHERE tenant = %s AND status = 'PENDING'", (TENANT,)
                ).fetchone()[0]  # type: ignore[index]
                marks = conn.execute(
                    "SELECT (SELECT count(*) FROM memory_records), (SELECT count(*) FROM router_ledger), "
                    "(SELECT count(*) FROM ingress_turns WHERE status <> 'PENDING')"
                ).fetchone()
        except psycopg.OperationalError:
            time.sleep(1)
            continue
        if marks != last:
            last, since = marks, time.monotonic()
        if pending == 0 and time.monotonic() - since >= 5:
            return
        time.sleep(0.5)
    log(f"not settled after {timeout_s:.0f}s; checking anyway")


def check(stack: Any, report: Report, calls: list[Call]) -> None:
    import grpc
    import psycopg
    from mars.config import TOPIC_GENERATED, TOPIC_JUDGED, TOPIC_VIEW
    from mars.identity import with_identity
    from mars.v1 import events_pb2 as ev
    from mars.v1 import services_pb2 as svc
    from mars.v1 import services_pb2_grpc as svc_grpc

    log = read_log(stack.env["MARS_KAFKA_BOOTSTRAP"], (TOPIC_GENERATED, TOPIC_JUDGED, TOPIC_VIEW))
    generated: dict[str, int] = {}
    for raw in log[TOPIC_GENERATED]:
        event = ev.Generated.FromString(raw)
        generated[event.turn.turn_id] = event.status
    judged: dict[str, ev.Judged] = {}
    for raw in log[TOPIC_JUDGED]:
        event = ev.Judged.FromString(raw)
        judged[event.turn.turn_id] = event
    views = [ev.ViewBuilt.FromString(raw) for raw in log[TOPIC_VIEW]]
    report.stale_views = len({v.turn.turn_id for v in views if v.view.possibly_stale})

    with psycopg.connect(stack.env["MARS_POSTGRES_DSN"]) as conn:
        turns = conn.execute(
            "SELECT turn_id, status, coalesce(error, '') FROM ingress_turns WHERE tenant = %s", (TENANT,)
        ).fetchall()
        status = {t: s for t, s, _ in turns}
        report.accepted = len(turns)
        counts = Counter(s for _, s, _ in turns)
        report.answered, report.failed, report.timeout = (
            counts["ANSWERED"],
            counts["FAILED"],
            counts["TIMEOUT"],
        )
        lost = {t for t, s, _ in turns if s == "PENDING"}
        lost |= {t for t, s, _ in turns if s == "ANSWERED" and generated.get(t) != ev.OK}
        lost |= {t for t, s, e in turns if s in ("FAILED", "TIMEOUT") and not e.strip()}
        lost |= {c.turn_id for c in calls if c.code == "OK" and status.get(c.turn_id) != "ANSWERED"}
        report.lost = len(lost)

        # Router: one Eq. 11 update per judged turn for the answered arm and each failed arm, no more.
        ledger = conn.execute("SELECT turn_id, arm FROM router_ledger WHERE applied").fetchall()
        expected: Counter[str] = Counter()
        for turn_id, arm in ledger:
            if turn_id not in judged:
                continue  # a feedback correction (keyed by its own id): A and pulls unchanged
            expected[arm] += 1
            for failed in set(judged[turn_id].failed_arms) - {arm}:
                expected[failed] += 1
        pulls = dict(conn.execute("SELECT arm, sum(pulls)::bigint FROM router_arms GROUP BY arm").fetchall())
        report.duplicate_updates = sum(max(0, int(pulls.get(a, 0)) - n) for a, n in expected.items())
        report.duplicate_updates += sum(int(n) for a, n in pulls.items() if a not in expected and n)
        applied = {t for t, _ in ledger}
        report.missing_updates = len([t for t in judged if t in status and t not in applied])

        report.duplicate_records = conn.execute(
            "SELECT (SELECT count(*) - count(DISTINCT turn_id) FROM memory_records) + (SELECT count(*) FROM "
            "(SELECT 1 FROM memory_records GROUP BY tenant, user_id, seq HAVING count(*) > 1) d)"
        ).fetchone()[0]  # type: ignore[index]
        stored = {
            r[0] for r in conn.execute("SELECT turn_id FROM memory_records WHERE tenant = %s", (TENANT,))
        }
        report.missing_records = len([t for t, s in status.items() if s == "ANSWERED" and t not in stored])

        by_user: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for user, record_id, blob in conn.execute(
            "SELECT user_id, record_id, embedding FROM memory_records WHERE tenant = %s ORDER BY commit_no",
            (TENANT,),
        ):
            by_user[user].append((record_id, len(blob or b"") // (4 * 384)))

    stale = 0
    for addr in stack.addrs("memory"):
        with grpc.insecure_channel(addr) as plain:
            stub = svc_grpc.MemoryStub(with_identity(plain, stack.caller("chaos")))
            for user in sorted({c.user for c in calls}):
                want = by_user.get(user, [])
                got = stub.DescribeIndex(svc.DescribeIndexRequest(tenant=TENANT, user_id=user), timeout=30)
                if (
                    list(got.record_ids) != [r for r, _ in want]
                    or got.lexical_docs != len(want)
                    or (got.dense_vectors and got.dense_vectors != sum(n for _, n in want))
                ):
                    stale += 1
    report.stale_indexes = stale


def latency_report(report: Report, calls: list[Call], faults: list[Fault]) -> None:
    ok = sorted(c.latency_s for c in calls if c.code == "OK")
    if ok:
        report.p50_ms = 1000 * ok[len(ok) // 2]
        report.p99_ms = 1000 * ok[min(len(ok) - 1, int(0.99 * len(ok)))]
    first = min((f.at_s for f in faults), default=float("inf"))
    before = sorted(c.latency_s for c in calls if c.code == "OK" and c.sent_s < first)
    base = before[min(len(before) - 1, int(0.99 * len(before)))] if before else 0.0
    report.p99_before_ms = 1000 * base
    # Recovered: the first 2 s window after the fault whose calls all succeeded within max(1.5x, +50 ms)
    # of the pre-fault p99.
    bound = max(1.5 * base, base + 0.05)
    window = 2.0
    for fault in faults:
        t = fault.done_s
        horizon = max((c.sent_s for c in calls), default=0.0)
        while t + window <= horizon + 1e-9:
            inside = [c for c in calls if t <= c.sent_s < t + window]
            if inside and all(c.code == "OK" and c.latency_s <= bound for c in inside):
                fault.recovered_s = t - fault.done_s
                break
            t += 0.5
    report.faults = [asdict(f) for f in faults]


def print_table(report: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(
        title=f"{report.scenario}: {report.turns} turns, {report.users} users, {report.rate:g}/s, "
        f"{report.replicas} replicas, {report.broker}"
    )
    table.add_column("check")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    for key, target in (
        ("accepted", ""),
        ("answered", ""),
        ("failed", ""),
        ("timeout", ""),
        ("lost", "0"),
        ("duplicate_updates", "0"),
        ("duplicate_records", "0"),
        ("stale_indexes", "0"),
        ("missing_records", ""),
        ("missing_updates", ""),
        ("stale_views", ""),
        ("calls_ok", ""),
        ("achieved_rate", ""),
        ("p50_ms", ""),
        ("p99_ms", ""),
        ("p99_before_ms", ""),
        ("restarts", ""),
    ):
        value = getattr(report, key)
        table.add_row(key, f"{value:.1f}" if isinstance(value, float) else str(value), target)
    console.print(table)
    faults = Table(title="faults (recovered: p99 back within 1.5x of the pre-fault p99, target <= 15 s)")
    for col in ("at s", "action", "target", "recovered after s"):
        faults.add_column(col)
    for f in report.faults:
        rec = "-" if f["recovered_s"] is None else f"{f['recovered_s']:.1f}"
        faults.add_row(f"{f['at_s']:.1f}", f["action"], f["target"], rec)
    console.print(faults)
    if report.calls_error:
        console.print(f"call errors by status: {report.calls_error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--scenario", default="chaos-basic", choices=sorted(SCENARIOS))
    parser.add_argument("--short", action="store_true", help="about 100 turns (the make-test version)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument(
        "--broker", choices=("kafka", "tansu"), help="default: Kafka wherever Java >= 17 runs"
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--workdir", type=Path, help="keep the stack's data and logs here")
    parser.add_argument("--no-faults", action="store_true", help="the same load without faults (a baseline)")
    parser.add_argument("--rate", type=float, help="override the scenario's turns per second")
    parser.add_argument("--turns", type=int, help="override the scenario's turn count")
    parser.add_argument("--replicas", type=int, help="override the scenario's replicas per service")
    args = parser.parse_args(argv)

    sys.path[:0] = [str(REPO / "infra"), str(REPO / "services")]
    from mars_stack import LocalStack, StackSettings

    sc = SHORT if args.short else SCENARIOS[args.scenario]
    overrides = {"rate": args.rate, "turns": args.turns, "replicas": args.replicas}
    sc = dataclasses.replace(sc, **{k: v for k, v in overrides.items() if v is not None})
    name = args.scenario + (" --short" if args.short else "") + (" --no-faults" if args.no_faults else "")
    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[chaos {time.monotonic() - started:6.1f}s] {msg}", flush=True)

    settings = StackSettings(
        workdir=args.workdir,
        partitions=args.partitions,
        model_pool=REPO / "config" / "models.standin.yaml",
        llm="standin",
        broker=args.broker,
        replicas=sc.replicas,
        extra_env={
            "MARS_INGRESS_TURN_TIMEOUT_S": str(sc.deadline_s),
            "MARS_GATEWAY_TURN_TIMEOUT_S": str(sc.deadline_s),
            "MARS_MEMORY_READ_YOUR_WRITES_WAIT_S": "5",
        },
    )
    stack = LocalStack(settings)
    stack.start(progress=log)
    report = Report(name, stack.broker, sc.turns, sc.users, sc.rate, sc.replicas)
    calls: list[Call] = []
    try:
        duration = sc.turns / sc.rate
        faults = [] if args.no_faults else fault_plan(sc, duration, args.seed)
        log(
            f"stack up; sending {sc.turns} turns at {sc.rate:g}/s over {sc.users} users with {len(faults)} faults"
        )
        from mars.auth import mint_key

        dsn = stack.env["MARS_POSTGRES_DSN"]
        key, warm_key = (mint_key(dsn, t, label="chaos harness").key for t in (TENANT, WARMUP_TENANT))
        # Warm-up (its own tenant, not counted): every user once, so caches, policies and connections exist.
        warm = Scenario(turns=sc.users, users=sc.users, rate=sc.rate, deadline_s=sc.deadline_s)
        asyncio.run(
            send_turns(
                stack.addrs("ingress"), warm, args.seed + 1, [], time.monotonic(), warm_key, WARMUP_TENANT
            )
        )
        t0 = time.monotonic() + 1.0
        chaos = threading.Thread(target=run_faults, args=(stack, faults, sc, t0, log), daemon=True)
        chaos.start()
        asyncio.run(send_turns(stack.addrs("ingress"), sc, args.seed, calls, t0, key))
        chaos.join()
        report.achieved_rate = len(calls) / max(1e-9, max(c.sent_s for c in calls))
        log("load done; waiting for the pipeline to settle")
        wait_settled(stack.env["MARS_POSTGRES_DSN"], 60 + sc.deadline_s, log)
        check(stack, report, calls)
        latency_report(report, calls, faults)
        report.calls_ok = sum(c.code == "OK" for c in calls)
        report.calls_error = dict(Counter(c.code for c in calls if c.code != "OK"))
        report.restarts = sum(e.kind == "restarted" for e in stack.events)
        report.calls = [asdict(c) for c in calls]
        report.process_events = [asdict(e) for e in stack.events]
    finally:
        stack.stop()
    report.wall_s = time.monotonic() - started
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(report), indent=2))
    ok = report.lost == report.duplicate_updates == report.duplicate_records == report.stale_indexes == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
