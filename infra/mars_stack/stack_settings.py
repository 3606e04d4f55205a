"""What a local stack runs (`StackSettings`): which infrastructure and services, how many replicas, and how
they are secured. `mars stack`, `mars run`, the tests and the harnesses fill it in; `LocalStack` reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mars import topology

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_POOL = REPO_ROOT / "config" / "models.local.yaml"


@dataclass
class StackSettings:
    workdir: Path | None = None
    partitions: int = 3
    model_pool: Path = DEFAULT_POOL
    llm_context: int = 4096
    start_llm: bool = True
    start_broker: bool = True
    start_postgres: bool = True
    #: The services to start (every deployable spec's, mars.topology, by default).
    services: tuple[str, ...] = field(default_factory=lambda: topology.NAMES)
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
