"""Typed settings shared by every service; each service extends `ServiceSettings` with its own model.

Settings come from `MARS_*` environment variables, then from the env file named by `MARS_ENV_FILE`
(the local stack launcher writes one), then from the defaults below. A service's own settings are read under
its section (`MARS_ROUTER_ALPHA`), the shared ones as `MARS_<FIELD>` (`env_name`); the flat names of the
releases before sections are still read, with a warning. A service refuses to start on a `MARS_*` name that
looks meant for it and that it does not read (`CallerSettings.check_environment`, "did you mean").
"""

from __future__ import annotations

import difflib
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

#: Base topic names, one per turn stage plus the dead-letter topic (README, "What runs"; proto/mars/v1/events.proto).
#: Services publish and subscribe by these names; the bus puts the run's `topic_prefix` in front (`Topics`).
TOPIC_RECEIVED = "mars.turn.received"
TOPIC_STATE = "mars.turn.state"
TOPIC_VIEW = "mars.turn.view"
TOPIC_ROUTED = "mars.turn.routed"
TOPIC_GENERATED = "mars.turn.generated"
#: Answer tokens streamed from dispatch to the ingress for Converse calls with option stream=true.
TOPIC_TOKENS = "mars.turn.tokens"
TOPIC_JUDGED = "mars.turn.judged"
TOPIC_FEEDBACK = "mars.turn.feedback"
TOPIC_MEMORY_COMMITTED = "mars.memory.committed"
TOPIC_DEAD_LETTER = "mars.deadletter"
#: Control events (mars.v1.UserForgotten), read by every replica of a service holding per-user state in
#: memory (broadcast readers): not turn events, no stage consumes them in a group.
TOPIC_CONTROL = "mars.control"
#: Each stage's name in `stage_emitted` (mars.emitted.EmittedLedger): a service's role may read and write only
#: its own stages' rows there (mars.db_roles, row-level security).
STATE_STAGE = "state"
MEMORY_VIEW_STAGE = "memory-view"
MEMORY_COMMIT_STAGE = "memory-commit"
ROUTER_STAGE = "router"
DISPATCH_STAGE = "dispatch"
JUDGE_STAGE = "judge"
#: The ingress's own: a turn's TurnReceived acknowledged by the broker (its outbox is then done with it).
INGRESS_STAGE = "ingress"

ALL_TOPICS = (
    TOPIC_RECEIVED,
    TOPIC_STATE,
    TOPIC_VIEW,
    TOPIC_ROUTED,
    TOPIC_GENERATED,
    TOPIC_TOKENS,
    TOPIC_JUDGED,
    TOPIC_FEEDBACK,
    TOPIC_MEMORY_COMMITTED,
    TOPIC_DEAD_LETTER,
    TOPIC_CONTROL,
)

#: Event schema versions this build understands (TurnEnvelope.schema_version).
SCHEMA_VERSION = 1

#: Kafka's limits on a topic name: these characters, at most this many of them.
_TOPIC_CHARS = re.compile(r"[A-Za-z0-9._-]*")
MAX_TOPIC_LENGTH = 249
#: The longest prefix that still leaves every topic name legal.
MAX_TOPIC_PREFIX_LENGTH = MAX_TOPIC_LENGTH - max(len(t) for t in ALL_TOPICS)


def validate_topic_prefix(prefix: str) -> str:
    """The prefix itself when every prefixed topic name is a legal Kafka topic name; ValueError otherwise."""
    bad = sorted(set(_TOPIC_CHARS.sub("", prefix)))
    if bad:
        raise ValueError(
            f"topic prefix {prefix!r} has characters Kafka does not allow in topic names: {''.join(bad)!r} "
            "(allowed: letters, digits, '.', '_', '-')"
        )
    if len(prefix) > MAX_TOPIC_PREFIX_LENGTH:
        raise ValueError(
            f"topic prefix is {len(prefix)} characters; at most {MAX_TOPIC_PREFIX_LENGTH} keep every topic name "
            f"within Kafka's {MAX_TOPIC_LENGTH}"
        )
    return prefix


@dataclass(frozen=True)
class Topics:
    """The topic names of one run: every base name behind one validated prefix ("" = the plain names)."""

    prefix: str = ""

    def __post_init__(self) -> None:
        validate_topic_prefix(self.prefix)

    def name(self, base: str) -> str:
        """The topic a base name (one of ALL_TOPICS) has in this run."""
        if base not in ALL_TOPICS:
            raise ValueError(f"unknown base topic {base!r} (expected one of {', '.join(ALL_TOPICS)})")
        return self.prefix + base

    def base(self, topic: str) -> str | None:
        """The base name of one of this run's topics; None for a topic of another run or none of ours."""
        if not topic.startswith(self.prefix):
            return None
        base = topic[len(self.prefix) :]
        return base if base in ALL_TOPICS else None

    @property
    def all(self) -> tuple[str, ...]:
        return tuple(self.name(t) for t in ALL_TOPICS)

    @property
    def dead_letter(self) -> str:
        return self.name(TOPIC_DEAD_LETTER)


def topic_name(base: str, prefix: str = "") -> str:
    """`base` (one of ALL_TOPICS) as named in the run with topic prefix `prefix`."""
    return Topics(prefix).name(base)


def kafka_security_problems(
    protocol: str, username: str, password: str, cafile: str, certfile: str, keyfile: str
) -> list[str]:
    """What is inconsistent in a set of Kafka security settings (empty when nothing is), each problem
    naming the MARS_* variable to change."""
    problems: list[str] = []
    if protocol.startswith("SASL_"):
        if not username:
            problems.append(f"MARS_KAFKA_SECURITY_PROTOCOL={protocol} needs MARS_KAFKA_SASL_USERNAME")
        if not password:
            problems.append(f"MARS_KAFKA_SECURITY_PROTOCOL={protocol} needs MARS_KAFKA_SASL_PASSWORD")
    if not protocol.endswith("SSL"):
        tls_files = [
            name
            for name, value in (
                ("MARS_KAFKA_SSL_CAFILE", cafile),
                ("MARS_KAFKA_SSL_CERTFILE", certfile),
                ("MARS_KAFKA_SSL_KEYFILE", keyfile),
            )
            if value
        ]
        if tls_files:
            # Silently ignoring a CA bundle would leave the user believing the traffic is encrypted.
            problems.append(
                f"{', '.join(tls_files)} set but MARS_KAFKA_SECURITY_PROTOCOL={protocol} uses no TLS "
                "(use SSL or SASL_SSL)"
            )
    if keyfile and not certfile:
        problems.append("MARS_KAFKA_SSL_KEYFILE needs MARS_KAFKA_SSL_CERTFILE (the client certificate)")
    return problems


#: The settings sections of the deployables: a service's own settings are read as MARS_<SECTION>_<FIELD>
#: (MARS_ROUTER_ALPHA), the ones every service shares (ServiceSettings') as MARS_<FIELD> (mars.config.env_name).
SECTIONS = ("STATE", "MEMORY", "ROUTER", "DISPATCH", "JUDGE", "INGRESS", "GATEWAY")
#: MARS_* names a deployable's environment may carry that no deployable's model reads: the env-file switch of
#: the models themselves; the variables the model pool files interpolate (the local LLM server's URL and
#: GGUF file, mars.model_pool); and what the local stack writes for people and tools (stack.env): each
#: deployable's address (MARS_INGRESS_ADDR is also the tools' own, mars_tools.settings) and the gateway's URL.
#: tests/unit/test_settings_sections.py checks that no name of the tools or the launcher stops a deployable.
OTHER_NAMES = frozenset(
    {"MARS_ENV_FILE", "MARS_LOCAL_LLM_URL", "MARS_LOCAL_GGUF", "MARS_GATEWAY_URL"}
    | {f"MARS_{section}_ADDR" for section in SECTIONS}
)
#: The variables Kubernetes gives every pod for each Service of its namespace (service links: a Service
#: "mars-router" gives MARS_ROUTER_SERVICE_HOST, MARS_ROUTER_PORT_50053_TCP_ADDR, ...): never settings.
_SERVICE_LINK = re.compile(
    r"[A-Z0-9_]+_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_(ADDR|PORT|PROTO))?)?)"
)
#: How close (difflib's ratio) an unknown name must come to a known one, and a word to a section's name
#: (ROUTRE to ROUTER: 0.83; BROKER to ROUTER: 0.67), to count as its misspelling.
_MISSPELT = 0.85
_MISSPELT_SECTION = 0.75


def env_name(settings: type[CallerSettings], field_name: str) -> str:
    """The environment variable a settings model reads `field_name` from: MARS_<FIELD> for a shared field
    (or a model without a section), MARS_<SECTION>_<FIELD> for the model's own (MARS_MEMORY_ROLES, not
    MARS_MEMORY_MEMORY_ROLES, when the field already begins with the section's name)."""
    upper = field_name.upper()
    section = settings.env_section
    if not section or field_name in settings.shared_fields() or upper.startswith(section + "_"):
        return f"MARS_{upper}"
    return f"MARS_{section}_{upper}"


def old_env_names(settings: type[CallerSettings], field_name: str) -> tuple[str, ...]:
    """The names `field_name` was read from before (still read, with a warning, where env_name is unset):
    the flat MARS_<FIELD> of the releases before sections, and a rename's (`renamed_from`)."""
    names = [f"MARS_{field_name.upper()}"]
    if field_name in settings.renamed_from:
        names.append(settings.renamed_from[field_name])
    current = env_name(settings, field_name)
    return tuple(dict.fromkeys(n for n in names if n != current))


def _read_by_section(settings: type[CallerSettings], found: Mapping[str, str | None]) -> dict[str, str | None]:
    """`found` (lower-cased names -> values, as pydantic-settings reads them) re-keyed by field, under the
    flat names pydantic-settings looks fields up by: the current name first, an old one with a warning."""
    out: dict[str, str | None] = {}
    for field_name in settings.model_fields:
        current = env_name(settings, field_name)
        for name in (current, *old_env_names(settings, field_name)):
            value = found.get(name.lower())
            if value is None:
                continue
            if name != current:
                warnings.warn(
                    f"{name} is deprecated for {settings.__name__}: set {current} (read from {name} for this "
                    "release only)",
                    FutureWarning,
                    stacklevel=2,
                )
            out[f"mars_{field_name}"] = value
            break
    return out


#: A mapping read instead of the process's environment (CallerSettings.from_env), while one is set.
_GIVEN_ENV: ContextVar[Mapping[str, str] | None] = ContextVar("mars_given_env", default=None)


class _SectionedEnv(EnvSettingsSource):
    def _load_env_vars(self) -> Mapping[str, str | None]:
        given = _GIVEN_ENV.get()
        found = super()._load_env_vars() if given is None else {k.lower(): v for k, v in given.items()}
        return _read_by_section(self.settings_cls, found)  # type: ignore[arg-type]


class _SectionedDotEnv(DotEnvSettingsSource):
    def _load_env_vars(self) -> Mapping[str, str | None]:
        return _read_by_section(self.settings_cls, super()._load_env_vars())  # type: ignore[arg-type]


class CallerSettings(BaseSettings):
    """What any MARS caller of a MARS gRPC service needs (a tool, the gateway, or a service calling another):
    the TLS it speaks (mars.tls.ClientTls) and the service identity it presents (mars.identity)."""

    model_config = SettingsConfigDict(
        env_prefix="MARS_",
        env_file=os.environ.get("MARS_ENV_FILE"),
        extra="ignore",
    )
    #: The section (one of SECTIONS) of a deployable's own fields; "": every field is MARS_<FIELD>.
    env_section: ClassVar[str] = ""
    #: Field -> the environment variable it was read from before a rename: still read for one release,
    #: with a warning, where the new name is not set.
    renamed_from: ClassVar[Mapping[str, str]] = {}

    #: The CA (PEM) that signed the services' certificates; with a client certificate and key for mutual
    #: TLS. All empty: calls in plaintext.
    tls_ca_file: str = ""
    tls_client_cert_file: str = ""
    tls_client_key_file: str = ""
    #: This caller's service identity: a certificate (its common name is the caller's name) and key signed
    #: by the identity CA; both empty: calls carry none (a stage service refuses them).
    identity_cert_file: str = ""
    identity_key_file: str = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.env_section and cls.env_section not in SECTIONS:
            raise TypeError(f"{cls.__name__}.env_section {cls.env_section!r} is not one of {', '.join(SECTIONS)}")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The environment and the env file as pydantic-settings reads them, under each field's section name.
        assert isinstance(env_settings, EnvSettingsSource) and isinstance(dotenv_settings, DotEnvSettingsSource)
        return (
            init_settings,
            _SectionedEnv(
                settings_cls,
                case_sensitive=env_settings.case_sensitive,
                env_prefix=env_settings.env_prefix,
            ),
            _SectionedDotEnv(
                settings_cls,
                env_file=dotenv_settings.env_file,
                env_file_encoding=dotenv_settings.env_file_encoding,
                case_sensitive=dotenv_settings.case_sensitive,
                env_prefix=dotenv_settings.env_prefix,
            ),
            file_secret_settings,
        )

    @classmethod
    def shared_fields(cls) -> frozenset[str]:
        """The fields every model of its kind has (read as MARS_<FIELD>): a service's ServiceSettings, a
        caller's CallerSettings."""
        base = ServiceSettings if issubclass(cls, ServiceSettings) else CallerSettings
        return frozenset(base.model_fields)

    @classmethod
    def env_names(cls) -> frozenset[str]:
        """Every name this model reads, old names included."""
        return frozenset(n for f in cls.model_fields for n in (env_name(cls, f), *old_env_names(cls, f)))

    @classmethod
    def misread_names(cls, names: Iterable[str], elsewhere: Iterable[str] = ()) -> list[str]:
        """The names among `names` that look meant for this model and that it does not read, each with the
        closest it does ("did you mean"). `elsewhere`: the names the other deployables read (old ones too),
        which pass. Names of other sections are theirs to check; a name that is neither near one of this
        model's nor in its section (a tool's, the launcher's) passes."""
        known = cls.env_names() | OTHER_NAMES | set(elsewhere) | ServiceSettings.env_names()
        current = sorted({env_name(cls, f) for f in cls.model_fields})
        problems = []
        for name in sorted(n.upper() for n in names):
            if not name.startswith("MARS_") or name in known or _SERVICE_LINK.fullmatch(name):
                continue
            word = name[len("MARS_") :].split("_", 1)[0]
            if word in SECTIONS and word != cls.env_section:
                continue  # another deployable's
            near_section = bool(cls.env_section) and (
                word == cls.env_section
                or difflib.get_close_matches(word, SECTIONS, n=1, cutoff=_MISSPELT_SECTION) == [cls.env_section]
            )
            close = difflib.get_close_matches(name, current, n=1, cutoff=0.0 if near_section else _MISSPELT)
            if close:
                problems.append(f"{name} is not a setting of {cls.__name__}; did you mean {close[0]}?")
        return problems

    @classmethod
    def check_environment(cls, environ: Mapping[str, str] | None = None, elsewhere: Iterable[str] = ()) -> None:
        """Refuse to start on a misspelt setting (ValueError naming the closest valid names), checking the
        process's environment and its env file (or `environ` alone); old names only warn (when read).
        `elsewhere`: the names the other deployables read (mars.topology.deployable_env_names)."""
        names = set(os.environ if environ is None else environ)
        env_file = (os.environ if environ is None else environ).get("MARS_ENV_FILE")
        if env_file:
            from dotenv import dotenv_values

            names |= set(dotenv_values(env_file))
        if problems := cls.misread_names(names, elsewhere):
            raise ValueError("; ".join(problems))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Self:
        """The caller settings of `env` alone (MARS_* names), or of this process (None: its environment and
        MARS_ENV_FILE, like any settings model)."""
        if env is None:
            return cls()
        token = _GIVEN_ENV.set(env)  # `env` alone (parsed as the environment is), and no env file
        try:
            return cls(_env_file=None)  # type: ignore[call-arg]
        finally:
            _GIVEN_ENV.reset(token)


class ServiceSettings(CallerSettings):
    """Connection and runtime settings every MARS service needs (and, as a caller of another, its TLS and
    identity)."""

    kafka_bootstrap: str = "127.0.0.1:9092"
    #: How clients reach the brokers (Kafka's own names): TLS with SSL/SASL_SSL, SASL logins with SASL_*.
    #: Every Kafka client of every service and tool takes these (mars.kafka_options).
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "PLAIN"
    kafka_sasl_username: str = ""
    #: A secret: never printed (SecretStr), in Kubernetes it comes from the release's Secret.
    kafka_sasl_password: SecretStr = SecretStr("")
    #: PEM CA bundle that signed the brokers' certificates; "" trusts the system CAs.
    kafka_ssl_cafile: str = ""
    #: Client certificate and key (PEM) for mutual TLS; "" presents none. The key may sit in the certfile.
    kafka_ssl_certfile: str = ""
    kafka_ssl_keyfile: str = ""
    #: One partition count shared by all topics, so a user's events share a partition index everywhere.
    kafka_partitions: int = 3
    #: Copies of each topic's partitions, for the topics a service or `mars topics ensure` creates (a
    #: production cluster: 3). Existing topics keep theirs.
    kafka_replication_factor: int = Field(default=1, ge=1)
    #: Longest a fetch waits for data. Kafka answers as soon as a record arrives, so the client default is both
    #: fast (hop p50 3.3 ms measured here) and idle-cheap; Tansu waits the whole time, so the local stack sets
    #: 5 ms there (at 5 ms on Kafka, a 14-consumer idle stack burns two cores on empty fetches).
    kafka_fetch_max_wait_ms: int = 500
    #: The same for the broadcast readers (every replica reads the replies and the control topic): Kafka answers
    #: them at once too, and no rebalance waits behind their fetch (they are in no group), so a long wait makes
    #: their idle fetches a tenth as many (the broker's idle CPU is mostly such fetches); their stop drops the
    #: connections instead of waiting out the fetch (mars.bus.consumer.close_kafka_consumer). The local stack
    #: sets 5 on Tansu, as above.
    kafka_broadcast_fetch_max_wait_ms: int = Field(default=5000, ge=1)
    #: Idempotent producer (Kafka: no duplicates or reordering from producer retries). The local stack turns
    #: it off on Tansu, which refuses it; effects stay exactly-once through the consumers' turn_id keys.
    kafka_idempotence: bool = True
    #: Broadcast readers (every ingress replica's reply reader) start at the end of each partition. The local
    #: stack turns this off on Tansu, whose end offsets have been seen wrong: they read from the beginning.
    kafka_trust_end_offsets: bool = True
    #: This process's name among its service's replicas (set by the launcher, e.g. "memory-2").
    replica: str = ""
    #: Static group membership (Kafka KIP-345): a stable id per replica (a StatefulSet pod name, or the
    #: launcher's replica name). A replica restarted under the same id takes its partitions back at once,
    #: without a rebalance; "" joins as a dynamic member. Tansu does not support it.
    kafka_group_instance_id: str = ""
    #: A member silent this long is dropped and its partitions move (a replica that died for good).
    kafka_session_timeout_ms: int = 10_000
    kafka_heartbeat_interval_ms: int = 2_000
    postgres_dsn: str = "postgresql://mars@127.0.0.1:5432/mars"
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 0
    #: TLS on this service's gRPC port: its certificate chain and key (PEM files, e.g. a mounted Kubernetes
    #: TLS Secret); both empty serves plaintext. See mars.tls.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    #: Mutual TLS: callers must present a certificate signed by this CA (PEM); empty asks for none.
    tls_client_ca_file: str = ""
    #: The CA (PEM) that signs service identities (mars.identity): a stage service checks each internal
    #: call's token against it. Unset while identity_required: every internal call is refused (fails closed).
    identity_ca_file: str = ""
    #: The release this service answers (mars.identity): spiffe://<trust-domain>/ns/<namespace>/<release>. Set,
    #: a caller's certificate must carry the URI SAN <scope>/<name> and its tokens name the scope, so another
    #: release's identities (same CA or not) open nothing. Empty: the certificate's common name names the
    #: caller (certificates without a SPIFFE ID, as Helm's genSignedCert makes them).
    identity_scope: str = ""
    #: Require a service identity on the stage services' RPCs; false lets any caller that reaches the port in
    #: (a laptop setting, warned at start).
    identity_required: bool = True
    #: gRPC reflection on a stage service's port (off: it lists the internal API to whoever asks); the
    #: ingress, the public API, always serves it.
    grpc_reflection: bool = False
    #: Close each client connection (HTTP/2 GOAWAY, the calls on it finish) after this many seconds, so a
    #: client behind a Kubernetes ClusterIP reconnects and is spread over the replicas, and a pod that is
    #: stopping has lost every client before its SIGTERM (the chart keeps it below shutdown.preStopSeconds);
    #: 0 keeps connections for as long as the client does.
    grpc_max_connection_age_s: float = Field(default=0.0, ge=0.0)
    #: A plaintext port serving grpc.health.v1 only, for probes that cannot speak TLS (Kubernetes' native
    #: gRPC probes); 0 serves none (health is on the main port too).
    health_port: int = Field(default=0, ge=0, le=65535)
    #: The master key (32 bytes, base64; `mars keys master` makes one) that wraps every user's data key:
    #: with it, the user text of turn events is sealed on Kafka and forgetting a user makes their text on
    #: every topic unreadable (mars.sealing). A file (a mounted Kubernetes Secret) or the value itself;
    #: neither set: events carry text in plaintext (a warning at start). Every service needs the same key.
    master_key_file: str = ""
    master_key: SecretStr = SecretStr("")
    #: While rotating the master key (`mars keys rotate`): the key being replaced. Data keys it wrapped
    #: still open; new ones are wrapped by MARS_MASTER_KEY_FILE. Unset once the rotation is done.
    previous_master_key_file: str = ""
    #: How long a process keeps a user's data key after reading it. A forgotten user's key stays usable
    #: this long in processes that do not read the mars.control topic.
    data_key_cache_s: float = Field(default=60.0, gt=0)
    #: Attempts at a handler before its event is dead-lettered.
    handler_attempts: int = 3
    #: Longest text (the turn's text, an answer, a feedback comment) a stage event may carry; a longer one
    #: is dead-lettered. Keep it above ingress's MARS_MAX_TEXT_CHARS and the longest answer expected.
    max_event_text_chars: int = Field(default=100_000, ge=1)
    #: OTLP/gRPC endpoint for traces; nothing is exported when unset.
    otlp_endpoint: str | None = None
    #: Port of the Prometheus endpoint (GET /metrics on grpc_host) for the metrics; 0 serves none.
    metrics_port: int = Field(default=0, ge=0, le=65535)
    #: Directory where each service appends its finished spans as JSON lines, and metric snapshots under
    #: metrics/ (tests, local debugging).
    trace_dir: str | None = None
    #: Write trace_dir spans in batches from a background thread (load runs: off the answer path) rather
    #: than each span as it ends (the default: tests read the file right after a call).
    trace_batch: bool = False
    #: Share of turns traced (their trace id decides, and every service follows the sampled flag the turn
    #: arrives with, so a turn is traced whole or not at all). 1 traces every turn; a load run's
    #: decomposition needs a tenth of them. Without an exporter (OTLP or trace_dir) nothing is traced.
    trace_sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    #: Seconds between metric exports (to the OTLP endpoint and the trace_dir file).
    metrics_interval_s: float = Field(default=30.0, gt=0)
    log_level: str = "INFO"
    #: Run the service's event loop on uvloop (libuv) rather than asyncio's own selector loop.
    uvloop: bool = True
    #: Put in front of every topic name (e.g. "run7." gives "run7.mars.turn.received"), so runs with
    #: different configurations share one broker without mixing events; "" keeps the plain names.
    topic_prefix: str = ""

    @field_validator("topic_prefix")
    @classmethod
    def _check_topic_prefix(cls, value: str) -> str:
        return validate_topic_prefix(value)

    @model_validator(mode="after")
    def _check_kafka_security(self) -> Self:
        # Found at start, with the variable to fix, rather than as a broker refusing the login later.
        problems = kafka_security_problems(
            self.kafka_security_protocol,
            self.kafka_sasl_username,
            self.kafka_sasl_password.get_secret_value(),
            self.kafka_ssl_cafile,
            self.kafka_ssl_certfile,
            self.kafka_ssl_keyfile,
        )
        if problems:
            raise ValueError("Kafka security settings: " + "; ".join(problems))
        return self

    def longest_call_s(self) -> float:
        """How long one call to this service may rightly last (0: no longer than a stop's grace). A
        connection's calls in flight get at least this long after its max-age GOAWAY: the GOAWAY is there
        to spread connections, never to cut a call short."""
        return 0.0

    @property
    def topics(self) -> Topics:
        return Topics(self.topic_prefix)
