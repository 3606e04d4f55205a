"""Local certificate authorities for the local stack and tests, as PEM files (what a Kubernetes TLS Secret
would mount): one for TLS (a CA, a server certificate for 127.0.0.1/localhost, a client certificate), and
one for service identities (mars.identity: a CA and one certificate per caller, named by its common name)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LocalCerts:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


@dataclass(frozen=True)
class IdentityFiles:
    """The identity CA and, per caller name, its certificate and key files."""

    ca: Path
    callers: dict[str, tuple[Path, Path]]

    def env(self, name: str) -> dict[str, str]:
        """A caller's MARS_IDENTITY_CERT_FILE and _KEY_FILE (mars.identity.CallerIdentity.from_env)."""
        cert, key = self.callers[name]
        return {"MARS_IDENTITY_CERT_FILE": str(cert), "MARS_IDENTITY_KEY_FILE": str(key)}


def make_identities(folder: Path, names: tuple[str, ...], scope: str = "") -> IdentityFiles:
    """Write a fresh identity CA and a certificate for each name into `folder` (valid one day), for client
    authentication; with `scope` (spiffe://<trust-domain>/ns/<namespace>/<release>), each also carries its
    SPIFFE ID <scope>/<name> as a URI SAN (mars.identity: bound to that release)."""
    ca, mint = identity_authority(folder)
    return IdentityFiles(ca=ca, callers={name: mint(name, scope) for name in names})


Mint = Callable[..., tuple[Path, Path]]


def identity_authority(folder: Path) -> tuple[Path, Mint]:
    """A fresh identity CA in `folder` (ca.crt) and a function mint(name, scope="", server_only=False) that
    writes <name>.crt / <name>.key signed by it: a client certificate (clientAuth), with the SPIFFE ID
    <scope>/<name> where a scope is given; `server_only` marks it for server authentication alone."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca, leaf = _authority(folder, "MARS identity CA")

    def mint(name: str, scope: str = "", server_only: bool = False) -> tuple[Path, Path]:
        sans = [x509.UniformResourceIdentifier(f"{scope}/{name}")] if scope else []
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server_only else ExtendedKeyUsageOID.CLIENT_AUTH
        cert, key = leaf(name, usage, sans)
        return write_private(folder / f"{name}.crt", cert), write_private(folder / f"{name}.key", key)

    return ca, mint


def write_private(path: Path, data: bytes) -> Path:
    """Written 0600 from the start (write_bytes then chmod left a key readable to all for a moment), and
    never through a symbolic link at `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # a file that was there keeps its old mode otherwise
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return path


@dataclass(frozen=True)
class KubePKI:
    """What a local Kubernetes control plane needs (infra/k8s): its CA, the API server's serving pair, an
    admin client pair (group system:masters) and the service-account signing key pair."""

    ca: Path
    apiserver_cert: Path
    apiserver_key: Path
    admin_cert: Path
    admin_key: Path
    service_account_key: Path
    service_account_pub: Path


def make_kube_pki(folder: Path, service_ip: str = "10.96.0.1", extra_hosts: tuple[str, ...] = ()) -> KubePKI:
    """Write a fresh cluster CA and the control plane's certificates into `folder` (valid one day);
    `extra_hosts`: more names or addresses the API server answers on (a real node's address)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca, leaf = _authority(folder, "MARS local Kubernetes CA")
    hosts = (
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "127.0.0.1",
        service_ip,
        *(h for h in extra_hosts if h not in ("127.0.0.1", service_ip)),
    )
    server_cert, server_key = leaf("kube-apiserver", ExtendedKeyUsageOID.SERVER_AUTH, _sans(hosts))
    admin_cert, admin_key = leaf("mars-admin", ExtendedKeyUsageOID.CLIENT_AUTH, [], "system:masters")
    sa_key = ec.generate_private_key(ec.SECP256R1())
    sa_private = sa_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    sa_public = sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return KubePKI(
        ca=ca,
        apiserver_cert=write_private(folder / "apiserver.crt", server_cert),
        apiserver_key=write_private(folder / "apiserver.key", server_key),
        admin_cert=write_private(folder / "admin.crt", admin_cert),
        admin_key=write_private(folder / "admin.key", admin_key),
        service_account_key=write_private(folder / "sa.key", sa_private),
        service_account_pub=write_private(folder / "sa.pub", sa_public),
    )


def _sans(hosts: tuple[str, ...]) -> list[Any]:
    """Subject alternative names: an IP address entry for each address, a DNS name for the rest."""
    from cryptography import x509

    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    return sans


def make_local_ca(folder: Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1")) -> LocalCerts:
    """Write a fresh CA and a server and a client certificate signed by it into `folder` (valid one day)."""
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca, leaf = _authority(folder, "MARS local CA")
    server_cert, server_key = leaf("mars-server", ExtendedKeyUsageOID.SERVER_AUTH, _sans(hosts))
    client_cert, client_key = leaf("mars-client", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    return LocalCerts(
        ca=ca,
        server_cert=write_private(folder / "tls.crt", server_cert),
        server_key=write_private(folder / "tls.key", server_key),
        client_cert=write_private(folder / "client.crt", client_cert),
        client_key=write_private(folder / "client.key", client_key),
    )


Leaf = Callable[..., tuple[bytes, bytes]]


def _authority(folder: Path, ca_name: str) -> tuple[Path, Leaf]:
    """A fresh CA written to folder/ca.crt, and a function that signs a leaf (common name, extended key
    usage, subject alternative names) with it, giving (certificate PEM, key PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(common: str, organization: str = "") -> x509.Name:
        attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common)]
        if organization:  # Kubernetes reads a client certificate's O as its group
            attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
        return x509.Name(attributes)

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(name(ca_name))
        .issuer_name(name(ca_name))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(
        common: str, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName], organization: str = ""
    ) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(common, organization))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), key_pem(key)

    ca = write_private(folder / "ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM))
    return ca, leaf
