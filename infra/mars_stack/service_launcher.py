"""The MARS services of a local stack, one process per replica, and the HTTP gateway in front of the
ingress: their ports and addresses, the settings they share (the stack's `env`, also written to stack.env
for the tools), and each process's own (its port, its Kafka and Postgres logins, its identity)."""

from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path

from mars import topology

from mars_stack.broker import LocalBroker
from mars_stack.credentials import StackCredentials
from mars_stack.postgres import PostgresLogins
from mars_stack.readiness import free_port, grpc_serving, wait_until
from mars_stack.stack_settings import StackSettings
from mars_stack.supervisor import Supervisor


class ServiceLauncher:
    """Starts the services once the infrastructure, the logins and the credentials are there."""

    def __init__(
        self,
        settings: StackSettings,
        workdir: Path,
        supervisor: Supervisor,
        env: dict[str, str],
        ports: dict[str, int],
        broker: LocalBroker,
        postgres_logins: PostgresLogins,
        credentials: StackCredentials,
    ) -> None:
        self.settings = settings
        self.workdir = workdir
        self.supervisor = supervisor
        self.env = env
        self.ports = ports
        self.broker = broker
        self.postgres_logins = postgres_logins
        self.credentials = credentials
        #: With TLS: each service process's plaintext health-only port (MARS_HEALTH_PORT).
        self.health_ports: dict[str, int] = {}

    def service_procs(self) -> list[tuple[str, str]]:
        """(process name, service) of every service replica: "memory" alone, or "memory-1", "memory-2"."""
        out = []
        for service in self.settings.services:
            n = self.settings.replica_count(service)
            out += [(service if n == 1 else f"{service}-{i}", service) for i in range(1, n + 1)]
        return out

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

    def health_port(self, name: str) -> int:
        """Where a service process answers grpc.health.v1 in plaintext: its health-only port with TLS, else
        its gRPC port."""
        return self.health_ports.get(name, self.ports[name])

    def write_stack_env(self) -> None:
        """The services' shared settings and every process's ports, in `env` and in stack.env (what the tools
        read: MARS_ENV_FILE), with the operator's identity and each service's addresses."""
        self.env["MARS_MODEL_POOL"] = str(self.settings.model_pool)  # the tools' name
        self.env.update(topology.field_env("model_pool", str(self.settings.model_pool)))  # each deployable's
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
        lines = [f"{k}={v}" for k, v in sorted({**self.env, **self.credentials.identity_env()}.items())]
        lines += [
            f"MARS_{n.upper()}_ADDR={','.join(self.addrs(n))}"
            for n in self.settings.services
            if n != "ingress"
        ]
        env_file = self.workdir / "stack.env"
        env_file.touch(mode=0o600)  # it holds the tenant's API key
        env_file.chmod(0o600)
        env_file.write_text("\n".join(lines) + "\n")

    def start_services(self) -> None:
        procs = [
            self.supervisor.spawn(
                name,
                [sys.executable, "-m", f"mars_{service}"],
                env=self._process_env(name, service),
                service=service,
                dump_signals=(signal.SIGUSR1, signal.SIGUSR2),
            )
            for name, service in self.service_procs()
        ]
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

    def _process_env(self, name: str, service: str) -> dict[str, str]:
        """The environment of the replica `name` of `service`: the shared settings and its own."""
        env = {**os.environ, **self.env, "MARS_GRPC_PORT": str(self.ports[name]), "PYTHONUNBUFFERED": "1"}
        env["MARS_REPLICA"] = name
        if name in self.health_ports:
            env["MARS_HEALTH_PORT"] = str(self.health_ports[name])
        if self.broker.kind == "kafka":
            env["MARS_KAFKA_GROUP_INSTANCE_ID"] = name
        env.update(self.broker.client_env(service))  # its own principal, never the operator's
        env["MARS_POSTGRES_DSN"] = self.postgres_logins.dsn(service)  # its own role where there are roles
        env.update(self._caller_env(service))
        env.update(self.settings.service_env.get(service, {}))
        env.update(self.settings.service_env.get(name, {}))  # per replica ("memory-2") beats per service
        env.pop("MARS_ENV_FILE", None)
        env.pop("MARS_API_KEY", None)  # a caller's secret: no service needs it
        return env

    def _caller_env(self, service: str) -> dict[str, str]:
        """What a service that calls another gets: the ingress, its identity and the state service's address
        (history imports hand their context over, StateEstimator.ImportContext)."""
        if service != "ingress" or "state" not in self.settings.services:
            return {}
        return {**self.credentials.identity_env("ingress"), "MARS_INGRESS_STATE_ADDR": self.addr("state")}

    def start_gateway(self) -> None:
        """The HTTP gateway, a caller of the (first) ingress like any client: the callers' TLS settings."""
        gateway = topology.GATEWAY.name
        port = free_port()
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        env.update(
            {
                "MARS_GATEWAY_HTTP_PORT": str(port),
                "MARS_GATEWAY_INGRESS_ADDR": self.addr("ingress"),
                "MARS_REPLICA": gateway,
            }
        )
        env.update(self.settings.service_env.get(gateway, {}))
        env.pop("MARS_ENV_FILE", None)
        env.pop("MARS_API_KEY", None)
        env.pop("MARS_KAFKA_SASL_PASSWORD", None)  # the gateway speaks to the ingress only
        proc = self.supervisor.spawn(gateway, [sys.executable, "-m", f"mars_{gateway}"], env=env)

        def ready() -> bool:
            import httpx

            try:
                return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, 60, gateway, proc.popen, proc.log)
        self.ports[gateway] = port
        self.env["MARS_GATEWAY_URL"] = f"http://127.0.0.1:{port}"
        with (self.workdir / "stack.env").open("a") as fh:
            fh.write(f"MARS_GATEWAY_URL=http://127.0.0.1:{port}\n")
