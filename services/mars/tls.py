"""TLS for the gRPC servers and their callers: the ingress over TLS, and optionally mutual TLS everywhere.

Servers: `MARS_TLS_CERT_FILE` + `MARS_TLS_KEY_FILE` switch a service's port to TLS; `MARS_TLS_CLIENT_CA_FILE`
also requires callers to present a certificate that CA signed (mTLS). Callers (the CLI, tools, tests):
`MARS_TLS_CA_FILE` is the CA they trust for the server, `MARS_TLS_CLIENT_CERT_FILE` / `..._KEY_FILE` the
certificate they present. The files are PEM, as a Kubernetes TLS Secret mounts them (tls.crt, tls.key,
ca.crt), and are read once at start: rotating them means restarting the pods.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from mars.config import CallerSettings, ServiceSettings


class TlsConfigError(ValueError):
    """TLS files that are missing, unreadable or only half given; the message names the setting."""


def read_pem(path: str, setting: str, error: type[ValueError] = TlsConfigError) -> bytes:
    """The bytes of a PEM file a setting names; `error` (naming the setting and the path) when unreadable.
    Also the identity files' reader (mars.identity)."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise error(f"{setting}={path}: cannot read it ({exc.strerror})") from None


def server_credentials(settings: ServiceSettings) -> grpc.ServerCredentials | None:
    """The server's TLS credentials, or None for plaintext (no certificate configured)."""
    cert, key, client_ca = settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file
    if not cert and not key:
        if client_ca:
            raise TlsConfigError(
                "MARS_TLS_CLIENT_CA_FILE (mutual TLS) needs MARS_TLS_CERT_FILE and _KEY_FILE"
            )
        return None
    if not (cert and key):
        raise TlsConfigError("MARS_TLS_CERT_FILE and MARS_TLS_KEY_FILE go together: set both or neither")
    pair = (read_pem(key, "MARS_TLS_KEY_FILE"), read_pem(cert, "MARS_TLS_CERT_FILE"))
    if client_ca:
        return grpc.ssl_server_credentials(
            [pair], root_certificates=read_pem(client_ca, "MARS_TLS_CLIENT_CA_FILE"), require_client_auth=True
        )
    return grpc.ssl_server_credentials([pair])


def add_port(server: grpc.aio.Server, address: str, settings: ServiceSettings) -> int:
    """Bind the server's port, over TLS when the settings give a certificate; the port bound."""
    credentials = server_credentials(settings)
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


@dataclass(frozen=True)
class ClientTls:
    """What a caller needs for a TLS server: the CA it trusts, and for mTLS its own certificate and key."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    @classmethod
    def from_settings(cls, settings: CallerSettings) -> ClientTls:
        return cls(settings.tls_ca_file, settings.tls_client_cert_file, settings.tls_client_key_file)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientTls:
        """The MARS_TLS_* caller settings of `env` (None: of this process)."""
        return cls.from_settings(CallerSettings.from_env(env))

    @property
    def enabled(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    def credentials(self) -> grpc.ChannelCredentials:
        if bool(self.cert_file) != bool(self.key_file):
            raise TlsConfigError("MARS_TLS_CLIENT_CERT_FILE and MARS_TLS_CLIENT_KEY_FILE go together")
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca_file, "MARS_TLS_CA_FILE") if self.ca_file else None,
            private_key=read_pem(self.key_file, "MARS_TLS_CLIENT_KEY_FILE") if self.key_file else None,
            certificate_chain=read_pem(self.cert_file, "MARS_TLS_CLIENT_CERT_FILE")
            if self.cert_file
            else None,
        )


def channel(target: str, client_tls: ClientTls | None = None, options: Any = None) -> grpc.Channel:
    """A channel to `target`: TLS when the caller has TLS settings (default: MARS_TLS_* env), else plain."""
    client_tls = client_tls if client_tls is not None else ClientTls.from_env()
    if client_tls.enabled:
        return grpc.secure_channel(target, client_tls.credentials(), options=options)
    return grpc.insecure_channel(target, options=options)


def aio_channel(
    target: str, client_tls: ClientTls | None = None, options: Any = None, interceptors: Any = None
) -> grpc.aio.Channel:
    """`channel` for asyncio callers."""
    client_tls = client_tls if client_tls is not None else ClientTls.from_env()
    if client_tls.enabled:
        return grpc.aio.secure_channel(
            target, client_tls.credentials(), options=options, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
