"""`mars keys master`, `check` and `rotate`: the master key that wraps every user's data key (mars.sealing,
mars.data_keys): make one, check that the configured one opens the data keys stored in Postgres (a master
key that differs from the one that wrapped them would leave every sealed event unreadable), and re-wrap
them under a new one while the previous key is still accepted."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mars import data_keys, sealing
from rich.markup import escape

from mars_tools.admin_cli import SettingsError, add_postgres_dsn_arg, load_settings
from mars_tools.private_files import open_private
from mars_tools.terminal import console


def cmd_master(args: argparse.Namespace) -> int:
    text = sealing.master_key_text()
    if not args.out:
        sys.stdout.write(text)
        return 0
    path = Path(args.out)
    if path.exists():
        # Replacing the key would leave every stored data key, and every sealed event, unreadable.
        console.print(f"[red]{escape(str(path))} exists; a master key is never overwritten[/]")
        return 1
    with open_private(path, exclusive=True) as fh:
        fh.write(text)
    console.print(f"master key written to {escape(str(path))} (mode 0600); set MARS_MASTER_KEY_FILE to it")
    return 0


#: One data key row: key id, tenant, user id, wrapped key, the id of the master key that wrapped it.
Row = tuple[str, str, str, bytes, str]
_ROWS = "SELECT key_id, tenant, user_id, wrapped, master_key_id FROM user_data_keys"
#: Re-wrap one row, unless it changed (or was deleted by a forget) since it was read.
_REWRAP = (
    "UPDATE user_data_keys SET wrapped = %s, master_key_id = %s "
    "WHERE key_id = %s AND wrapped = %s AND master_key_id = %s"
)


def _keys_and_rows(args: argparse.Namespace) -> tuple[data_keys.MasterKeys, list[Row], str] | int:
    """The configured master keys, every stored data key row and the DSN; or the exit code after saying
    what is wrong (2: settings, 1: Postgres)."""
    import psycopg

    try:
        settings = load_settings(postgres_dsn=args.postgres_dsn)
        masters = data_keys.master_keys(settings)
    except (SettingsError, ValueError) as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 2
    if masters is None:
        console.print("[red]no master key configured: set MARS_MASTER_KEY_FILE (or MARS_MASTER_KEY)[/]")
        return 2
    try:
        with psycopg.connect(settings.postgres_dsn, autocommit=True, connect_timeout=10) as conn:
            exists = conn.execute("SELECT to_regclass('user_data_keys') IS NOT NULL").fetchone()
            has_ids = conn.execute(
                "SELECT 1 FROM information_schema.columns WHERE table_name = 'user_data_keys' "
                "AND column_name = 'master_key_id'"
            ).fetchone()
            query = _ROWS if has_ids else _ROWS.replace("master_key_id", "''")
            raw = conn.execute(query).fetchall() if exists and exists[0] else []  # type: ignore[arg-type]
    except Exception as exc:  # Postgres away or refusing: one line, not a traceback
        console.print(f"[red]cannot read the data keys: {type(exc).__name__}: {escape(str(exc))}[/]")
        return 1
    rows = [(str(k), str(t), str(u), bytes(w), str(m)) for k, t, u, w, m in raw]
    return masters, rows, settings.postgres_dsn


def _opens(masters: data_keys.MasterKeys, row: Row) -> bytes | None:
    key_id, tenant, user_id, wrapped, master_id = row
    try:
        return masters.unwrap(key_id, tenant, user_id, wrapped, master_id)
    except sealing.SealError:
        return None


def cmd_check(args: argparse.Namespace) -> int:
    found = _keys_and_rows(args)
    if isinstance(found, int):
        return found
    masters, rows, _ = found
    current = only_previous = failed = 0
    for row in rows:
        if _opens(masters, row) is None:
            failed += 1
        elif masters.opens_with_current(*row):
            current += 1
        else:
            only_previous += 1
    console.print(
        f"{current} data keys open with the master key, {only_previous} only with the previous one "
        f"(MARS_PREVIOUS_MASTER_KEY_FILE), {failed} with neither"
    )
    if only_previous:
        console.print(
            "run `mars keys rotate` to wrap them with the master key before dropping the previous one"
        )
    if failed:
        console.print("[red]the configured master key is not the one that wrapped every data key[/]")
    return 1 if failed else 0


def cmd_rotate(args: argparse.Namespace) -> int:
    """Re-wrap every data key that the current master key did not wrap. The data keys themselves stay, so
    every sealed event still opens; services holding both master keys keep working throughout."""
    import psycopg
    from rich.progress import Progress

    found = _keys_and_rows(args)
    if isinstance(found, int):
        return found
    masters, rows, dsn = found
    todo = [row for row in rows if row[4] != masters.current_id]  # legacy rows ('') get their id too
    rewrapped = changed = failed = 0
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn, Progress(console=console) as bar:
        task = bar.add_task("re-wrapping data keys", total=len(todo))
        for row in todo:
            key = _opens(masters, row)
            if key is None:
                failed += 1
            else:
                key_id, tenant, user_id, wrapped, master_id = row
                fresh, fresh_id = masters.wrap(key_id, tenant, user_id, key)
                if args.dry_run:
                    rewrapped += 1
                else:
                    cur = conn.execute(_REWRAP, (fresh, fresh_id, key_id, wrapped, master_id))
                    rewrapped += cur.rowcount
                    changed += 1 - cur.rowcount
            bar.advance(task)
    verb = "would re-wrap" if args.dry_run else "re-wrapped"
    console.print(
        f"{verb} {rewrapped} data keys under master key {masters.current_id}; {len(rows) - len(todo)} were "
        f"already, {changed} changed meanwhile (forgotten), {failed} open with no configured master key"
    )
    if failed:
        console.print(
            "[red]some data keys open with neither MARS_MASTER_KEY_FILE nor MARS_PREVIOUS_MASTER_KEY_FILE[/]"
        )
    return 1 if failed else 0


def cmd_ensure_secret(args: argparse.Namespace) -> int:
    from mars_tools.deploy.master_key_secret import ApiServer, SecretError, ensure_secret

    labels = dict(label.split("=", 1) for label in args.label)
    try:
        api = ApiServer.in_cluster(args.namespace)
        created = ensure_secret(api, args.name, args.key, labels)
    except SecretError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 1
    if created:
        console.print(
            f"master key Secret {api.namespace}/{args.name} created (back it up: it is the only copy)"
        )
    else:
        console.print(f"master key Secret {api.namespace}/{args.name} exists: kept as it is")
    return 0


def label_arg(value: str) -> str:
    """An argparse type: a NAME=VALUE label (the key-making Jobs' --label)."""
    if "=" not in value:
        raise argparse.ArgumentTypeError(f"a label is NAME=VALUE, got {value!r}")
    return value


def add_keys_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    keys = sub.add_parser(
        "keys",
        help="the master key of the users' data keys (crypto-shredding of event text)",
        description="Turn events carry users' text sealed with a per-user data key; the data keys sit in "
        "Postgres wrapped by one master key (MARS_MASTER_KEY_FILE, the same for every service). Forgetting a "
        "user deletes their data key, which leaves their text on every topic unreadable.",
    )
    keys_sub = keys.add_subparsers(dest="keys_cmd", required=True)
    p = keys_sub.add_parser(
        "master",
        help="make a new master key (32 random bytes, base64)",
        description="Prints a new master key, or writes it to --out (mode 0600, never over an existing file). "
        "Store it as a Secret; every service reads it from MARS_MASTER_KEY_FILE.",
    )
    p.add_argument("--out", help="write the key to this new file instead of printing it")
    p.set_defaults(func=cmd_master)
    p = keys_sub.add_parser(
        "check",
        help="check that the configured master key opens every stored data key",
        description="Unwraps every data key in Postgres with MARS_MASTER_KEY_FILE / MARS_MASTER_KEY. Exit 0 "
        "when all open, 1 when some do not (a different master key) or Postgres failed, 2 for bad settings.",
    )
    add_postgres_dsn_arg(p)
    p.set_defaults(func=cmd_check)
    p = keys_sub.add_parser(
        "rotate",
        help="re-wrap every data key under a new master key",
        description="Rotating the master key without downtime: (1) make a new key (`mars keys master --out`); "
        "(2) give every service MARS_MASTER_KEY_FILE=the new key and MARS_PREVIOUS_MASTER_KEY_FILE=the old one "
        "(both open data keys, new ones are wrapped by the new key); (3) run this, with the same two settings, "
        "to re-wrap the stored data keys under the new key (sealed events keep opening: the data keys do not "
        "change); (4) `mars keys check`, then drop MARS_PREVIOUS_MASTER_KEY_FILE. Exit 1 when a data key opens "
        "with neither key, 2 for bad settings.",
    )
    add_postgres_dsn_arg(p)
    p.add_argument("--dry-run", action="store_true", help="count what would be re-wrapped, change nothing")
    p.set_defaults(func=cmd_rotate)
    p = keys_sub.add_parser(
        "ensure-secret",
        help="create the master key Secret in the cluster, unless it exists (the chart's Job)",
        description="Inside a pod: creates a Kubernetes Secret NAME holding a new master key under KEY, with the "
        "pod's service account, unless a Secret NAME exists (then it is kept, never overwritten). The chart "
        "runs it as a Job so that no render (helm template, GitOps) ever mints a second key. Exit 1 when the "
        "API server refuses or a Secret NAME exists without KEY.",
    )
    p.add_argument("--name", required=True, help="the Secret's name (the chart's <fullname>-master-key)")
    p.add_argument(
        "--key", default="master.key", help="the data key holding the master key (eventSealing.key)"
    )
    p.add_argument("--namespace", default="", help="default: the pod's own namespace")
    p.add_argument(
        "--label", action="append", default=[], type=label_arg, help="NAME=VALUE label, repeatable"
    )
    p.set_defaults(func=cmd_ensure_secret)
