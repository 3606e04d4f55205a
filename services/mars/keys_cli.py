"""`mars keys master` and `mars keys check`: the master key that wraps every user's data key (mars.sealing,
mars.data_keys): make one, and check that the configured one opens the data keys stored in Postgres (a
master key that differs from the one that wrapped them would leave every sealed event unreadable)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from mars import data_keys, sealing
from mars.admin_cli import SettingsError, load_settings
from mars.private_files import open_private

console = Console(width=None if sys.stdout.isatty() else 160)


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


def cmd_check(args: argparse.Namespace) -> int:
    import psycopg
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    try:
        settings = load_settings(postgres_dsn=args.postgres_dsn)
        master = data_keys.master_key(settings)
    except (SettingsError, ValueError) as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 2
    if master is None:
        console.print("[red]no master key configured: set MARS_MASTER_KEY_FILE (or MARS_MASTER_KEY)[/]")
        return 2
    wrapping = AESGCM(master)
    opened = failed = 0
    try:
        with psycopg.connect(settings.postgres_dsn, autocommit=True, connect_timeout=10) as conn:
            exists = conn.execute("SELECT to_regclass('user_data_keys') IS NOT NULL").fetchone()
            rows = (
                conn.execute("SELECT key_id, tenant, user_id, wrapped FROM user_data_keys").fetchall()
                if exists and exists[0]
                else []
            )
    except Exception as exc:  # Postgres away or refusing: one line, not a traceback
        console.print(f"[red]cannot read the data keys: {type(exc).__name__}: {escape(str(exc))}[/]")
        return 1
    for key_id, tenant, user_id, wrapped in rows:
        try:
            sealing.unwrap(wrapping, str(key_id), str(tenant), str(user_id), bytes(wrapped))
            opened += 1
        except sealing.SealError:
            failed += 1
    console.print(f"{opened} data keys open with this master key, {failed} do not")
    if failed:
        console.print("[red]the configured master key is not the one that wrapped every data key[/]")
    return 1 if failed else 0


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
    p.add_argument(
        "--postgres-dsn",
        help="libpq connection string (default: MARS_POSTGRES_DSN, else postgresql://mars@127.0.0.1:5432/mars)",
    )
    p.set_defaults(func=cmd_check)
