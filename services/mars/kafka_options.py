"""The aiokafka keyword arguments every Kafka client (producer, consumer, admin) takes from the settings:
bootstrap servers, security protocol, SASL login and TLS context.

One builder for the services, the replay and eval tools and the `mars topics` / `mars deploy` commands,
so a broker that asks for SASL or TLS (an external Kafka in Kubernetes) is reached the same way by all.
Consistency of the settings is checked when they load (`ServiceSettings`); this module only maps them.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from aiokafka.helpers import create_ssl_context

from mars.config import ServiceSettings


def kafka_client_options(settings: ServiceSettings, bootstrap: str | None = None) -> dict[str, Any]:
    """Keyword arguments for AIOKafkaProducer/AIOKafkaConsumer/AIOKafkaAdminClient: `bootstrap` (default
    the settings' MARS_KAFKA_BOOTSTRAP) and the security settings. Reads the TLS files when the protocol
    uses TLS; a file that is not there is a ValueError naming its variable."""
    protocol = settings.kafka_security_protocol
    options: dict[str, Any] = {
        "bootstrap_servers": bootstrap or settings.kafka_bootstrap,
        "security_protocol": protocol,
    }
    if protocol.startswith("SASL_"):
        options["sasl_mechanism"] = settings.kafka_sasl_mechanism
        # aiokafka names these "plain" but uses them for the SCRAM mechanisms too.
        options["sasl_plain_username"] = settings.kafka_sasl_username
        options["sasl_plain_password"] = settings.kafka_sasl_password.get_secret_value()
    if protocol.endswith("SSL"):
        options["ssl_context"] = tls_context(settings)
    return options


def tls_context(settings: ServiceSettings) -> ssl.SSLContext:
    """A client TLS context that verifies the brokers (hostname included) against MARS_KAFKA_SSL_CAFILE,
    or the system CAs when it is empty, presenting the client certificate when one is set."""
    files = {
        "MARS_KAFKA_SSL_CAFILE": settings.kafka_ssl_cafile,
        "MARS_KAFKA_SSL_CERTFILE": settings.kafka_ssl_certfile,
        "MARS_KAFKA_SSL_KEYFILE": settings.kafka_ssl_keyfile,
    }
    for name, path in files.items():
        if path and not Path(path).is_file():
            raise ValueError(f"{name}={path}: no such file (is the Secret with it mounted there?)")
    try:
        return create_ssl_context(
            cafile=settings.kafka_ssl_cafile or None,
            certfile=settings.kafka_ssl_certfile or None,
            keyfile=settings.kafka_ssl_keyfile or None,
        )
    except ssl.SSLError as exc:
        raise ValueError(f"Kafka TLS files could not be loaded ({', '.join(files)}): {exc}") from exc


def env_kafka_options(bootstrap: str | None = None) -> dict[str, Any]:
    """`kafka_client_options` of the MARS_* environment: for tools that take their bootstrap on the command
    line (`--bootstrap`) and the security settings from the environment they share with the services."""
    return kafka_client_options(ServiceSettings(), bootstrap)
