"""What the local launcher reads from the environment (MARS_* variables), in one typed model: the Java and
jars of the local Apache Kafka, the broker choice, and whether work directories outlive their stack."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class LauncherSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MARS_", extra="ignore")

    #: The java binary of the local Kafka (default: java on PATH).
    java: str = ""
    #: kafka or tansu (default: Kafka wherever Java >= 17 runs); `--broker` overrides it.
    broker: str = ""
    #: Folder of Apache Kafka's jars (default: infra/kafka/target/libs, filled by `make kafka`).
    kafka_libs: str = ""
    #: The local broker's JVM heap, and its other JVM options (default: mars_stack.kafka.LOCAL_JVM_OPTS).
    kafka_heap: str = "512m"
    kafka_jvm_opts: str | None = None
    #: Start the local broker (and its storage tool) from a class-data-sharing archive of its classes, made
    #: once beside the jars (mars_stack.kafka_cds); false: every start reads the jars.
    kafka_class_archive: bool = True
    #: The local broker's own JVM formats its log dir (infra/kafka/launcher, compiled once by the JDK's
    #: javac); false, or a Java without javac: a JVM of its own formats it first (a second JVM start).
    kafka_format_in_broker: bool = True
    #: Extra server.properties of the local broker, comma-separated key=value pairs that override the
    #: defaults (e.g. num.io.threads=2,num.network.threads=1): to measure a broker setting under load.
    kafka_server_properties: str = ""
    #: The local Apache Kafka's client listener: sasl_ssl (SCRAM-SHA-512 logins per service over TLS, and
    #: ACLs from mars.kafka_acls) or plaintext (anyone on the machine may do anything; to measure what
    #: SASL_SSL costs). Tansu is always plaintext.
    local_kafka_security: str = "sasl_ssl"
    #: Each local service logs in to Postgres as its own role (mars.db_roles), owning its tables and
    #: granted nothing of another's; false: all of them as `mars` (the one login of earlier versions).
    local_postgres_roles: bool = True
    #: Threads of the local llama.cpp server (SmolLM2), for generation and for reading the prompt alike. Unset:
    #: 2 for generation, every core for the prompt. One leaves the other core of a 2-core machine to whatever
    #: runs beside it (the test suite's other worker): llama.cpp's threads wait for each other, so a process
    #: beside two of them on 2 cores made each call several times slower.
    llm_threads: int | None = Field(default=None, ge=1)
    #: Keep a stack's (or the Kubernetes control plane's) temporary work directory after it stops.
    keep_stack: bool = False
    keep_kube_workdir: bool = False


def launcher_settings() -> LauncherSettings:
    """Read now (tests and harnesses change the environment between stacks)."""
    return LauncherSettings()
