"""Typed settings shared by every service; each service extends `ServiceSettings` with its own model.

Settings come from `MARS_*` environment variables, then from the env file named by `MARS_ENV_FILE`
(the local stack launcher writes one), then from the defaults below.
"""

from __future__ import annotations

import os

from pydantic_settings import BaseSettings, SettingsConfigDict

#: Topic names, one per turn stage plus the dead-letter topic (ARCHITECTURE.md, "Events over Kafka").
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
)

#: Event schema versions this build understands (TurnEnvelope.schema_version).
SCHEMA_VERSION = 1


class ServiceSettings(BaseSettings):
    """Connection and runtime settings every MARS service needs."""

    model_config = SettingsConfigDict(
        env_prefix="MARS_",
        env_file=os.environ.get("MARS_ENV_FILE"),
        extra="ignore",
    )

    kafka_bootstrap: str = "127.0.0.1:9092"
    #: One partition count shared by all topics, so a user's events share a partition index everywhere.
    kafka_partitions: int = 3
    #: Measured on the embedded broker: 5 ms keeps a hop near 3.5 ms p50; the client default 500 is unusable.
    kafka_fetch_max_wait_ms: int = 5
    postgres_dsn: str = "postgresql://mars@127.0.0.1:5432/mars"
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 0
    #: Attempts at a handler before its event is dead-lettered.
    handler_attempts: int = 3
    #: OTLP/gRPC endpoint for traces; nothing is exported when unset.
    otlp_endpoint: str | None = None
    #: Directory where each service appends its finished spans as JSON lines (tests, local debugging).
    trace_dir: str | None = None
    log_level: str = "INFO"
