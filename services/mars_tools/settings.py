"""Defaults of the `mars` commands (one typed model, MARS_* variables, or the env file named by
MARS_ENV_FILE, such as the stack.env the local stack writes); each command's flags override them."""

from __future__ import annotations

from mars.config import CallerSettings


class ToolSettings(CallerSettings):
    #: The pipeline's ingress (host:port).
    ingress_addr: str = "127.0.0.1:50051"
    #: A tenant's API key and its tenant (the local stack writes both).
    api_key: str = ""
    tenant: str = ""
    #: The pipeline's Kafka; "": the command's own default (some then read no events).
    kafka_bootstrap: str = ""
    #: The pipeline's topic prefix ("" for none).
    topic_prefix: str = ""
    #: Whether the broker's end offsets can be trusted (`mars replay --until end`); the local stack writes
    #: false on Tansu, whose end offsets have been seen wrong.
    kafka_trust_end_offsets: bool = True
    #: The pipeline's Postgres; "": none (commands that could mint a key there send --api-key instead).
    postgres_dsn: str = ""
    #: The model pool YAML; "": the command's own default.
    model_pool: str = ""
