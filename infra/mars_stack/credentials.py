"""The local stack's PKI and keys, made in its work directory: the master key that wraps the users' data
keys, the local CA of mutual TLS, and the identity CA with a certificate per tool (mars.identity)."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from mars_stack.readiness import StackError
from mars_stack.stack_settings import StackSettings

if TYPE_CHECKING:
    from mars.data_keys import SyncKeyring
    from mars.identity import CallerIdentity

    from mars_stack.certs import IdentityFiles

#: What a caller of a TLS stack needs (mars.tls.ClientTls.from_env): the CA and the client certificate.
CALLER_TLS_VARS = ("MARS_TLS_CA_FILE", "MARS_TLS_CLIENT_CERT_FILE", "MARS_TLS_CLIENT_KEY_FILE")


class StackCredentials:
    """Makes the stack's keys and certificates and puts their files' settings in the stack's shared `env`;
    gives the tools their identities and the harnesses the users' data keys."""

    def __init__(self, settings: StackSettings, workdir: Path, env: dict[str, str]) -> None:
        self.settings = settings
        self.workdir = workdir
        self.env = env
        #: The identity CA and the tools' certificates (None without settings.identity).
        self.identities: IdentityFiles | None = None
        self._keyring: SyncKeyring | None = None

    def make_master_key(self) -> None:
        """The master key that wraps every user's data key (MARS_MASTER_KEY_FILE), made once per work
        directory: a stack started again over the same Postgres data opens the keys it made before."""
        from mars import sealing

        path = self.workdir / "master.key"
        if not path.exists():
            path.touch(mode=0o600)
            path.write_text(sealing.master_key_text())
        self.env["MARS_MASTER_KEY_FILE"] = str(path)

    def make_tls(self) -> None:
        """Certificates from a local CA: every service serves with the server certificate and asks callers
        for one the CA signed; callers (the tools, tests, other services) trust the CA and present the
        client certificate."""
        from mars_stack.certs import make_local_ca

        certs = make_local_ca(self.workdir / "tls")
        self.env.update(
            MARS_TLS_CERT_FILE=str(certs.server_cert),
            MARS_TLS_KEY_FILE=str(certs.server_key),
            MARS_TLS_CLIENT_CA_FILE=str(certs.ca),
            MARS_TLS_CA_FILE=str(certs.ca),
            MARS_TLS_CLIENT_CERT_FILE=str(certs.client_cert),
            MARS_TLS_CLIENT_KEY_FILE=str(certs.client_key),
        )

    def make_identities(self) -> None:
        """The identity CA the stage services trust (MARS_IDENTITY_CA_FILE) and a certificate per tool."""
        from mars.identity import IDENTITIES

        from mars_stack.certs import make_identities

        if not self.settings.identity:
            self.env["MARS_IDENTITY_REQUIRED"] = "false"
            return
        # Bound to this stack: a release of its own (a SPIFFE ID per identity); another stack's, even from a
        # CA made the same way, opens nothing here.
        scope = f"spiffe://mars.local/ns/local/stack-{secrets.token_hex(4)}"
        self.identities = make_identities(self.workdir / "identity", IDENTITIES, scope)
        self.env["MARS_IDENTITY_CA_FILE"] = str(self.identities.ca)
        self.env["MARS_IDENTITY_SCOPE"] = scope

    def identity_env(self, name: str = "operator") -> dict[str, str]:
        """A tool's identity as environment (MARS_IDENTITY_CERT_FILE and _KEY_FILE), for a subprocess;
        empty when the stack runs without identities."""
        return self.identities.env(name) if self.identities is not None else {}

    def caller(self, name: str = "operator") -> CallerIdentity | None:
        """A tool's identity, to call the stage services (None when the stack runs without identities)."""
        from mars.identity import CallerIdentity

        return CallerIdentity.from_env(self.identity_env(name))

    def keyring(self) -> SyncKeyring | None:
        """The users' data keys of this stack, to open sealed event text as its services do (tests and
        harnesses reading topics); None when the stack runs without a master key (plaintext events)."""
        if self._keyring is None and self.env.get("MARS_MASTER_KEY_FILE"):
            from mars.config import ServiceSettings
            from mars.data_keys import tool_keyring

            def fail(message: str) -> None:
                raise StackError(message)

            self._keyring = tool_keyring(
                fail,
                ServiceSettings(
                    postgres_dsn=self.env["MARS_POSTGRES_DSN"],
                    master_key_file=self.env["MARS_MASTER_KEY_FILE"],
                ),
            )
        return self._keyring
