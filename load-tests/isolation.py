"""Tenant and user isolation over the running pipeline: 0 cross-tenant and 0 cross-user reads.

    .venv/bin/python load-tests/isolation.py --turns 10000 [--json OUT]

Two tenants, each with its own API key, send interleaved turns (a seeded random order, concurrent across
users, in order per user) for the same user ids (u0, u1, ...: the same names in both tenants). Every turn's
text holds a secret token that no other turn has. Afterwards everything any turn could have been shown is
read back and every secret found in it must belong to that turn's own tenant and user:

- the memory view of every turn (`mars.turn.view` events: the blocks memory built for it),
- the blocks packed into every model prompt and the answer (`mars.turn.generated` events),
- the answer each caller got (the stand-in LLM echoes the question, so an answer shows what it was asked),
- the stored memory (`memory_records` rows: the user text and answer under each tenant and user).

A leak is a secret of another tenant (cross-tenant) or of another user of the same tenant (cross-user).
The check is not vacuous: it also counts the views that did recall the user's own earlier secrets.
The suite runs a short version (tests/integration/test_ingress_security.py); this command starts a stack of
its own (stand-in LLM, Apache Kafka or Tansu) for the full run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TENANTS = ("iso-a", "iso-b")
SECRET = re.compile(r"\bsec[0-9a-f]{12}\b")
WORDS = "ferry budget hotel museum recipe garden invoice violin passport bicycle concert telescope".split()


@dataclass
class Report:
    turns: int = 0
    answered: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    views_checked: int = 0
    generated_checked: int = 0
    records_checked: int = 0
    #: Views that showed at least one of the user's own earlier secrets (memory at work).
    views_recalling_own: int = 0
    cross_tenant: int = 0
    cross_user: int = 0
    #: Up to 20 examples: where, whose turn, whose secret.
    leaks: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.cross_tenant == 0 and self.cross_user == 0


def plan(turns: int, users: int, seed: int) -> list[tuple[str, str, str, str]]:
    """(tenant, user, session, text) per turn, in a seeded random interleaving; each text has a secret."""
    rng = random.Random(seed)
    out = []
    for i in range(turns):
        tenant, user = rng.choice(TENANTS), f"u{rng.randrange(users)}"
        secret = f"sec{rng.getrandbits(48):012x}"
        text = f"Remember code {secret} for the {rng.choice(WORDS)}; what codes did I give you for it? ({i})"
        out.append((tenant, user, f"s{rng.randrange(2)}", text))
    return out


async def send_all(
    target: str, keys: dict[str, str], turns: list[tuple[str, str, str, str]], timeout_s: float
) -> tuple[list[tuple[str, str, str, Any]], Counter[str]]:
    """Send every turn (in order per tenant and user, users concurrently); (tenant, user, text, reply)."""
    import grpc
    from mars.v1 import services_pb2 as svc
    from mars.v1 import services_pb2_grpc as svc_grpc
    from mars_ingress.client import aio_ingress_channel

    channels = {t: aio_ingress_channel(target, keys[t]) for t in TENANTS}
    stubs = {t: svc_grpc.IngressStub(c) for t, c in channels.items()}
    queues: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for tenant, user, session, text in turns:
        queues.setdefault((tenant, user), []).append((session, text))
    replies: list[tuple[str, str, str, Any]] = []
    errors: Counter[str] = Counter()

    async def talk(tenant: str, user: str, items: list[tuple[str, str]]) -> None:
        for session, text in items:
            try:
                # The tenant comes from the key: the body leaves it empty half the time.
                body_tenant = tenant if len(text) % 2 else ""
                reply = await stubs[tenant].SendTurn(
                    svc.TurnRequest(tenant=body_tenant, user_id=user, session_id=session, text=text),
                    timeout=timeout_s,
                )
                replies.append((tenant, user, text, reply))
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] += 1

    try:
        await asyncio.gather(*(talk(t, u, items) for (t, u), items in queues.items()))
    finally:
        for channel in channels.values():
            await channel.close()
    return replies, errors


def owners(turns: list[tuple[str, str, str, str]]) -> dict[str, tuple[str, str]]:
    return {SECRET.findall(text)[0]: (tenant, user) for tenant, user, _, text in turns}


def _check(
    report: Report, where: str, reader: tuple[str, str], text: str, owner: dict[str, tuple[str, str]]
) -> int:
    """Count leaks in `text` shown to `reader`; the number of the reader's own secrets found."""
    own = 0
    for secret in set(SECRET.findall(text)):
        whose = owner.get(secret)
        if whose is None or whose == reader:
            own += whose == reader
            continue
        if whose[0] != reader[0]:
            report.cross_tenant += 1
        else:
            report.cross_user += 1
        if len(report.leaks) < 20:
            report.leaks.append(
                f"{where}: turn of {reader[0]}/{reader[1]} saw {whose[0]}/{whose[1]}'s {secret}"
            )
    return own


def check(
    report: Report,
    turns: list[tuple[str, str, str, str]],
    replies: list[tuple[str, str, str, Any]],
    bootstrap: str,
    dsn: str,
    since_ms: int,
    prefix: str = "",
    keyring: Any = None,
) -> None:
    """`keyring` (a mars.data_keys.SyncKeyring) opens the sealed text of views and answers; without one a
    sealed event stops the check, which would otherwise find no secret in ciphertext and pass vacuously."""
    import psycopg
    from mars.config import TOPIC_GENERATED, TOPIC_VIEW
    from mars.data_keys import is_sealed
    from mars.v1 import events_pb2 as ev
    from mars_tools.replay.readers import read_topics

    owner = owners(turns)
    for tenant, user, _, reply in replies:
        _check(report, "answer", (tenant, user), reply.text, owner)

    def opened(event: Any) -> Any:
        if is_sealed(event):
            if keyring is None:
                raise RuntimeError(
                    "events are sealed and no data keys were given: the check would be vacuous"
                )
            keyring.unseal(event)
        return event

    from mars_stack import stack_kafka_options

    async def read() -> None:
        async for record in read_topics(
            bootstrap,
            (TOPIC_VIEW, TOPIC_GENERATED),
            since_ms,
            3.0,
            prefix=prefix,
            kafka=stack_kafka_options(bootstrap),
        ):
            if record.topic == TOPIC_VIEW:
                built = opened(ev.ViewBuilt.FromString(record.value))
                if built.turn.tenant not in TENANTS:
                    continue
                reader = (built.turn.tenant, built.turn.user_id)
                shown = "\n".join(b.text for b in built.view.blocks)
                report.views_checked += 1
                # The turn's own secret is in its query, not its view: any own secret here is recalled.
                if _check(report, "view", reader, shown, owner):
                    report.views_recalling_own += 1
            else:
                gen = opened(ev.Generated.FromString(record.value))
                if gen.turn.tenant not in TENANTS:
                    continue
                report.generated_checked += 1
                packed = "\n".join(b.text for b in gen.packed_blocks)
                _check(report, "prompt", (gen.turn.tenant, gen.turn.user_id), packed + "\n" + gen.text, owner)

    asyncio.run(read())
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT tenant, user_id, user_text || ' ' || assistant_text FROM memory_records "
            "WHERE tenant = ANY(%s)",
            (list(TENANTS),),
        ).fetchall()
    for tenant, user, text in rows:
        report.records_checked += 1
        _check(report, "memory record", (tenant, user), text, owner)


def wait_stored(dsn: str, turns: int, timeout_s: float) -> None:
    """Until memory holds a record of each answered turn (or `timeout_s` has passed)."""
    import psycopg

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with psycopg.connect(dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FROM memory_records WHERE tenant = ANY(%s)", (list(TENANTS),)
            ).fetchone()
        if row is not None and row[0] >= turns:
            return
        time.sleep(0.5)


def run(
    target: str,
    dsn: str,
    bootstrap: str,
    turns: int,
    users: int,
    seed: int,
    prefix: str = "",
    timeout_s: float = 60.0,
    keyring: Any = None,
) -> Report:
    """Mint a key per tenant in `dsn`, send `turns` interleaved turns to `target`, check what was shown."""
    from mars.auth import mint_key

    started = time.monotonic()
    keys = {t: mint_key(dsn, t, label="isolation check").key for t in TENANTS}
    planned = plan(turns, users, seed)
    since_ms = int(time.time() * 1000) - 1000
    replies, errors = asyncio.run(send_all(target, keys, planned, timeout_s))
    report = Report(turns=turns, answered=len(replies), errors=dict(errors))
    wait_stored(dsn, len(replies), 120.0)  # the memory writer stores turns off the answer path
    check(report, planned, replies, bootstrap, dsn, since_ms, prefix, keyring)
    report.wall_s = time.monotonic() - started
    return report


def print_report(report: Report) -> None:
    print(
        f"isolation: {report.turns} turns ({report.answered} answered, errors {report.errors or 'none'}) in "
        f"{report.wall_s:.0f}s; checked {report.views_checked} views, {report.generated_checked} prompts and "
        f"answers, {report.records_checked} memory records; {report.views_recalling_own} views recalled the "
        f"user's own secrets; cross-tenant reads {report.cross_tenant}, cross-user reads {report.cross_user}"
    )
    for leak in report.leaks:
        print(f"  LEAK {leak}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--turns", type=int, default=10_000, help="turns in all (default 10000)")
    parser.add_argument("--users", type=int, default=8, help="user ids per tenant (the same in both)")
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=120.0, help="each turn's deadline")
    parser.add_argument("--workdir", type=Path, help="keep the stack's data and logs here")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)

    sys.path[:0] = [str(REPO / "infra"), str(REPO / "services")]
    from mars_stack import LocalStack, StackSettings

    stack = LocalStack(
        StackSettings(
            workdir=args.workdir or Path(tempfile.mkdtemp(prefix="mars-isolation-")),
            model_pool=REPO / "config" / "models.standin.yaml",
            llm="standin",
            extra_env={
                "MARS_INGRESS_TURN_TIMEOUT_S": str(args.timeout_s),
                "MARS_GATEWAY_TURN_TIMEOUT_S": str(args.timeout_s),
            },
        )
    ).start(progress=lambda m: print(f"[isolation] {m}", flush=True))
    try:
        report = run(
            stack.addr("ingress"),
            stack.env["MARS_POSTGRES_DSN"],
            stack.env["MARS_KAFKA_BOOTSTRAP"],
            args.turns,
            args.users,
            args.seed,
            timeout_s=args.timeout_s,
            keyring=stack.keyring(),
        )
    finally:
        stack.stop()
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    return 0 if report.ok and report.answered == report.turns else 1


if __name__ == "__main__":
    raise SystemExit(main())
