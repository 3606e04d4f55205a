"""`mars forget-user TENANT USER`: delete every row of one user (mars.forget) and tell every replica to drop
what it caches of them (a UserForgotten event on mars.control), for operators.

It talks to Postgres and Kafka directly, as `mars tenant` and `mars migrate` do, rather than through the
ingress: an operator acting on a deletion request holds the database and broker credentials, not the
tenant's admin key, and it works while the ingress is down. A tenant's own administrators call
`Ingress.ForgetUser` with an admin key; both run the same code (mars.forget).
"""

from __future__ import annotations

import argparse
import asyncio

from mars import auth, forget
from mars.config import TOPIC_CONTROL, ServiceSettings
from mars_ingress import forget_user
from rich.markup import escape

from mars_tools.admin_cli import SettingsError, add_postgres_dsn_arg, load_settings
from mars_tools.terminal import console


async def publish_forgotten(settings: ServiceSettings, tenant: str, user_id: str, forget_id: str) -> None:
    from mars.bus.producer import EventProducer

    producer = EventProducer(settings, "cli")
    await producer.start()
    try:
        event = forget_user.control_event(tenant, user_id, forget_id)
        await producer.send_raw(
            TOPIC_CONTROL, event.SerializeToString(), forget_user.event_key(tenant, user_id)
        )
    finally:
        await producer.stop()


def cmd_forget_user(args: argparse.Namespace) -> int:
    import uuid

    import psycopg

    for name, value in (("tenant", args.tenant), ("user", args.user)):
        if not auth.ID_PATTERN.match(value):
            console.print(f"[red]{name} must match {auth.ID_PATTERN.pattern}[/]")
            return 2
    try:
        settings = load_settings(postgres_dsn=args.postgres_dsn, kafka_bootstrap=args.bootstrap)
    except SettingsError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 2
    forget_id = uuid.uuid4().hex
    try:
        with psycopg.connect(settings.postgres_dsn, autocommit=True, connect_timeout=10) as conn:
            counts = forget.forget_user_sync(conn, args.tenant, args.user)
    except Exception as exc:  # Postgres away or refusing: one line, not a traceback
        console.print(f"[red]cannot forget in Postgres: {type(exc).__name__}: {escape(str(exc))}[/]")
        return 1
    for table, n in counts.items():
        console.print(f"{table}: {n} rows deleted")
    try:
        asyncio.run(publish_forgotten(settings, args.tenant, args.user, forget_id))
    except Exception as exc:
        console.print(
            f"[red]rows deleted, but the control event did not reach Kafka ({type(exc).__name__}: "
            f"{escape(str(exc))}): memory replicas still hold the user's index; run the command again[/]"
        )
        return 1
    console.print(f"[green]forgot user {args.user} of tenant {args.tenant}[/] (forget id {forget_id})")
    return 0


def add_forget_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "forget-user",
        help="delete every row of one user and evict them from every replica's memory",
        description="Deletes the user's turns, memory records and threads, routing policy and decisions, "
        "rewards, feedback, state and user-scoped API keys in one Postgres transaction, then publishes a "
        "UserForgotten event on mars.control: every memory replica drops the user's index, every ingress "
        "replica its cached keys. Events already on Kafka topics keep their text until retention expires. "
        "Idempotent. Exit 0 on success, 1 when Postgres or Kafka failed, 2 for bad input.",
    )
    p.add_argument("tenant", help="the user's tenant")
    p.add_argument("user", help="the user id to forget")
    add_postgres_dsn_arg(p)
    p.add_argument("--bootstrap", help="Kafka bootstrap servers (default: MARS_KAFKA_BOOTSTRAP)")
    p.set_defaults(func=cmd_forget_user)
