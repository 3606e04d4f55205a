"""`mars migrate` and `mars topics ensure|list`: the schema and the topics, set up once before the services
start (the Helm chart runs both as hook Jobs; services also apply both at start, safely in parallel).

Settings come from the same MARS_* variables as the services (bootstrap, SASL/TLS, partitions, replication
factor, topic prefix, Postgres DSN); the flags override them.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from mars.config import ServiceSettings
from pydantic import ValidationError
from rich.markup import escape
from rich.table import Table

from mars_tools.terminal import console


class SettingsError(Exception):
    """MARS_* settings (or flags) that do not load; the message says which."""


def load_settings(**overrides: Any) -> ServiceSettings:
    """ServiceSettings from the MARS_* environment, with the flags given (not None) on top."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return ServiceSettings(**given)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}" for err in exc.errors()
        )
        raise SettingsError(f"invalid settings: {problems}") from None


def add_postgres_dsn_arg(p: argparse.ArgumentParser) -> None:
    """--postgres-dsn, as every command that talks to Postgres itself takes it."""
    p.add_argument(
        "--postgres-dsn",
        help="libpq connection string (default: MARS_POSTGRES_DSN, else postgresql://mars@127.0.0.1:5432/mars)",
    )


def role_passwords(directory: str | None) -> dict[str, str]:
    """Passwords of the role logins from a directory: `<dir>/<service>` as a file, or a directory holding
    `password` (a Kubernetes Secret mounted there). A login without one keeps its password."""
    from pathlib import Path

    from mars import db_roles

    if not directory:
        return {}
    root = Path(directory)
    if not root.is_dir():
        raise SettingsError(f"--role-passwords-dir {directory}: not a directory")
    found: dict[str, str] = {}
    for service in db_roles.roles():
        path = root / service
        if path.is_dir():
            path = path / "password"
        if path.is_file():
            password = path.read_text().strip()
            if password:
                found[service] = password
    return found


def cmd_migrate(args: argparse.Namespace) -> int:
    from mars import db_roles, topology
    from mars.migrations import RoleSetup, migrate_all

    services = tuple(args.service) if args.service else topology.NAMES
    try:
        settings = load_settings(postgres_dsn=args.postgres_dsn)
        roles = None
        if args.roles:
            try:
                db_roles.check_prefix(args.role_prefix)
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
            roles = RoleSetup(args.role_prefix, role_passwords(args.role_passwords_dir))
        done = asyncio.run(migrate_all(settings.postgres_dsn, services, wait_s=args.wait_s, roles=roles))
    except SettingsError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 2
    except Exception as exc:  # Postgres away or refusing: one line, not a traceback
        console.print(f"[red]migration failed: {type(exc).__name__}: {exc}[/]")
        return 1
    for m in done:
        added = ", ".join(f"{kind} {name}" for kind, name in m.added) or "nothing new"
        console.print(f"{m.service}: {m.statements} statements applied; added: {added}", soft_wrap=True)
    if args.roles:
        logins = ", ".join(db_roles.roles(args.role_prefix).values())
        console.print(f"roles and grants in place: {logins}", soft_wrap=True)
    console.print(f"[green]schema up to date[/] ({len(done)} services)")
    return 0


def _topic_settings(args: argparse.Namespace) -> ServiceSettings:
    return load_settings(
        kafka_bootstrap=args.bootstrap,
        topic_prefix=args.topic_prefix,
        kafka_partitions=getattr(args, "partitions", None),
        kafka_replication_factor=getattr(args, "replication_factor", None),
    )


def cmd_topics_ensure(args: argparse.Namespace) -> int:
    from mars.bus.topics import ensure_topics
    from mars.kafka_options import kafka_client_options

    try:
        settings = _topic_settings(args)
        kafka = kafka_client_options(settings)
    except (SettingsError, ValueError) as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 2
    wanted = settings.topics.all
    try:
        result = asyncio.run(
            asyncio.wait_for(
                ensure_topics(kafka, settings.kafka_partitions, wanted, settings.kafka_replication_factor),
                args.timeout_s,
            )
        )
    except Exception as exc:
        console.print(
            f"[red]cannot reach Kafka at {settings.kafka_bootstrap}: {type(exc).__name__}: {exc}[/]"
        )
        return 1
    for topic in result.created:
        console.print(
            f"created {topic} ({settings.kafka_partitions} partitions, "
            f"replication factor {settings.kafka_replication_factor})"
        )
    for topic in result.existing:
        console.print(f"exists  {topic} (left as it is)")
    for topic, reason in result.failed:
        console.print(f"[red]FAILED  {topic}: {reason}[/]")
    if result.failed:
        return 1
    console.print(f"[green]{len(wanted)} topics in place[/] on {settings.kafka_bootstrap}")
    return 0


def topic_rows(wanted: tuple[str, ...], described: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(topic, partitions, replication factor) of each wanted topic from the admin client's
    describe_topics answer; "missing" for a topic the broker does not have."""
    by_name = {t["topic"]: t for t in described if not t.get("error_code")}
    rows = []
    for name in wanted:
        topic = by_name.get(name)
        if topic is None or not topic.get("partitions"):
            rows.append((name, "missing", ""))
            continue
        parts = topic["partitions"]
        replicas = {len(p.get("replicas", ())) for p in parts}
        rows.append((name, str(len(parts)), "/".join(str(r) for r in sorted(replicas))))
    return rows


def cmd_topics_list(args: argparse.Namespace) -> int:
    from aiokafka.admin import AIOKafkaAdminClient
    from mars.kafka_options import kafka_client_options

    try:
        settings = _topic_settings(args)
        kafka = kafka_client_options(settings)
    except (SettingsError, ValueError) as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 2
    wanted = settings.topics.all

    async def describe() -> list[dict[str, Any]]:
        admin = AIOKafkaAdminClient(**kafka)
        await admin.start()
        try:
            return list(await admin.describe_topics(list(wanted)))
        finally:
            await admin.close()

    try:
        described = asyncio.run(asyncio.wait_for(describe(), args.timeout_s))
    except Exception as exc:
        console.print(
            f"[red]cannot reach Kafka at {settings.kafka_bootstrap}: {type(exc).__name__}: {exc}[/]"
        )
        return 1
    rows = topic_rows(wanted, described)
    table = Table(title=f"topics on {settings.kafka_bootstrap}", title_justify="left")
    table.add_column("topic")
    table.add_column("partitions", justify="right")
    table.add_column("replication", justify="right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    return 0 if all(r[1] != "missing" for r in rows) else 1


def add_migrate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from mars import topology

    p = sub.add_parser(
        "migrate",
        help="apply every service's database schema (idempotent; the Helm chart's migrate hook Job)",
        description="Applies the DDL each service applies at start (the same statements, under the same "
        "advisory lock) to the Postgres at --postgres-dsn / MARS_POSTGRES_DSN, and prints what was added. "
        "Safe to rerun and to run while services start. Exit 0 when the schema is in place, 1 when "
        "Postgres failed, 2 for bad settings. The password may come from PGPASSWORD.",
    )
    add_postgres_dsn_arg(p)
    p.add_argument(
        "--service",
        action="append",
        choices=topology.NAMES,
        help="only this service's schema (repeatable; default: all)",
    )
    p.add_argument(
        "--wait-s",
        type=float,
        default=30.0,
        help="seconds to wait for Postgres to accept a connection (e.g. while it starts) before failing "
        "(default 30)",
    )
    p.add_argument(
        "--roles",
        action="store_true",
        help="also give each service a Postgres role of its own (mars.db_roles): the role owns its service's "
        "tables and gets only its part of the shared ones; `<prefix>_operator` is the tools' login. The "
        "login at --postgres-dsn must be allowed to create roles",
    )
    p.add_argument("--role-prefix", default="mars", help="roles are <prefix>_<service> (default mars)")
    p.add_argument(
        "--role-passwords-dir",
        help="directory with each login's password: <dir>/<service> as a file or <dir>/<service>/password "
        "(services and operator; a login without one keeps its password)",
    )
    p.set_defaults(func=cmd_migrate)


def add_topics_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    topics = sub.add_parser(
        "topics",
        help="create or list the stage topics on Kafka (the Helm chart's topics hook Job)",
        description="The stage topics of a run (MARS_TOPIC_PREFIX in front of each name). Bootstrap servers, "
        "SASL and TLS come from MARS_KAFKA_BOOTSTRAP and MARS_KAFKA_SECURITY_PROTOCOL, "
        "MARS_KAFKA_SASL_MECHANISM/USERNAME/PASSWORD, MARS_KAFKA_SSL_CAFILE/CERTFILE/KEYFILE.",
    )
    topics_sub = topics.add_subparsers(dest="topics_cmd", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--bootstrap", help="Kafka bootstrap servers (default: MARS_KAFKA_BOOTSTRAP)")
        p.add_argument(
            "--topic-prefix", help="put in front of every topic name, e.g. run7. (default: MARS_TOPIC_PREFIX)"
        )
        p.add_argument(
            "--timeout-s", type=float, default=60.0, help="give up on the broker after this long (default 60)"
        )

    p = topics_sub.add_parser(
        "ensure",
        help="create the stage topics that do not exist (existing ones are left as they are)",
        description="Creates each missing stage topic with one shared partition count (a user's events "
        "share a partition index in every topic) and replication factor. Existing topics are not changed. "
        "Exit 0 when every topic exists afterwards, 1 when the broker refused one or was unreachable, 2 for "
        "bad settings.",
    )
    common(p)
    p.add_argument(
        "--partitions", type=int, help="partitions of each new topic (default: MARS_KAFKA_PARTITIONS, else 3)"
    )
    p.add_argument(
        "--replication-factor",
        type=int,
        help="replicas of each new topic's partitions (default: MARS_KAFKA_REPLICATION_FACTOR, else 1)",
    )
    p.set_defaults(func=cmd_topics_ensure)

    p = topics_sub.add_parser(
        "list",
        help="show the stage topics' partitions and replication factor (exit 1 when one is missing)",
    )
    common(p)
    p.set_defaults(func=cmd_topics_list)
