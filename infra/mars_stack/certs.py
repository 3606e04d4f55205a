"""A local certificate authority for TLS tests and the local stack: a CA, a server certificate for
127.0.0.1/localhost, and a client certificate, as PEM files (what a Kubernetes TLS Secret would mount)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LocalCerts:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_local_ca(folder: Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1")) -> LocalCerts:
    """Write a fresh CA and a server and a client certificate signed by it into `folder` (valid one day)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write(path: Path, data: bytes) -> Path:
        path.write_bytes(data)
        path.chmod(0o600)
        return path

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(name("MARS local CA"))
        .issuer_name(name("MARS local CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(common: str, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(common))
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

    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    server_cert, server_key = leaf("mars-server", ExtendedKeyUsageOID.SERVER_AUTH, sans)
    client_cert, client_key = leaf("mars-client", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    return LocalCerts(
        ca=write(folder / "ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM)),
        server_cert=write(folder / "tls.crt", server_cert),
        server_key=write(folder / "tls.key", server_key),
        client_cert=write(folder / "client.crt", client_cert),
        client_key=write(folder / "client.key", client_key),
    )
