"""`mars identity ensure-secrets`: the release's service identities, made in the cluster by a Job.

Helm's genCA / genSignedCert cannot write a URI SAN, so their certificates named a caller by common name
alone (any certificate with CN `operator` from a shared issuer became `operator`), and the Secrets they made
were part of every release revision: `helm rollback` re-applied an old CA and old certificates and so undid
a revocation. Here a Job (a Helm hook before install and upgrade, as the master key's) makes them through the
API server instead, outside the release's manifests:

- `<fullname>-identity-ca-key` (ca.crt, ca.key): the identity CA, read by this Job alone. Kept across runs;
  made anew when missing (deleting it is the revocation: the next upgrade starts a new CA and drops the old
  one from the bundle) or when it would expire within the leaves' validity (then the old CA stays in the
  bundle until it expires, so pods holding certificates it signed keep working through the rotation).
- `<fullname>-identity-ca` (ca.crt): the bundle the stage services trust.
- `<fullname>-identity-<name>` (kubernetes.io/tls) per identity that runs in the cluster: a client
  certificate (clientAuth) with the SPIFFE ID `<scope>/<name>` as its URI SAN, valid `--days`, minted anew
  on every run, so an upgrade renews them.

The stage services check the SPIFFE ID against MARS_IDENTITY_SCOPE (mars.identity), so a certificate of this
CA for another release, or another CA's, opens nothing. Talks to the API server as master_key_secret does.

With `--tls-host`, the same run makes the services' TLS (the chart's tls.mint): a CA of its own in
`<fullname>-tls-ca-key` (kept, rotated and revoked as the identity CA is) and `<fullname>-tls`
(kubernetes.io/tls: tls.crt, tls.key and the CA bundle as ca.crt), one certificate for every service's DNS
names, for server and client authentication (mutual TLS presents it), minted anew on every run.
"""

from __future__ import annotations

import base64
import datetime
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from mars.identity import check_scope

from mars_tools.deploy.master_key_secret import ApiServer, SecretError, _refusal

#: The CA lives this many times a leaf's validity (it is rotated when it would expire within one).
CA_LIFETIMES = 4
CA_KEY_FILE, CA_CERT_FILE = "ca.key", "ca.crt"


def _utc(now: float | None) -> datetime.datetime:
    return (
        datetime.datetime.fromtimestamp(now, datetime.UTC)
        if now is not None
        else datetime.datetime.now(datetime.UTC)
    )


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def mint_ca(
    scope: str, days: int, now: float | None = None, title: str = "MARS identity CA"
) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) of a new CA (`title`) for the release `scope`, valid `days`."""
    key = ec.generate_private_key(ec.SECP256R1())
    start = _utc(now)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{title} {scope}"[:64])])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - datetime.timedelta(minutes=5))
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def mint_server(
    ca_cert_pem: bytes, ca_key_pem: bytes, hosts: Sequence[str], days: int, now: float | None = None
) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) of the services' TLS certificate: the DNS names `hosts`, server and client
    authentication (mutual TLS presents the same certificate)."""
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise SecretError("the TLS CA's key is not an EC key this tool made")
    key = ec.generate_private_key(ec.SECP256R1())
    start = _utc(now)
    end = min(start + datetime.timedelta(days=days), ca_cert.not_valid_after_utc)
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0][:64])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - datetime.timedelta(minutes=5))
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in hosts]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def mint_leaf(
    ca_cert_pem: bytes, ca_key_pem: bytes, name: str, scope: str, days: int, now: float | None = None
) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) of `name`'s identity: client authentication, SPIFFE ID <scope>/<name>."""
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise SecretError("the identity CA's key is not an EC key this tool made")
    key = ec.generate_private_key(ec.SECP256R1())
    start = _utc(now)
    end = min(start + datetime.timedelta(days=days), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - datetime.timedelta(minutes=5))
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(f"{scope}/{name}")]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


@dataclass(frozen=True)
class IdentityPlan:
    """What one run makes: the release's Secrets' prefix (<fullname>), its scope and identities."""

    fullname: str
    scope: str
    names: tuple[str, ...]
    days: int = 90
    labels: dict[str, str] = field(default_factory=dict)
    #: The services' DNS names: with any, the services' TLS is made too (`tls_secret`).
    tls_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_scope(self.scope)
        if not self.scope:
            raise SecretError("--scope is required: spiffe://<trust-domain>/ns/<namespace>/<release>")
        if self.days < 1:
            raise SecretError(f"--days must be at least 1, got {self.days}")

    @property
    def ca_key_secret(self) -> str:
        return f"{self.fullname}-identity-ca-key"

    @property
    def ca_secret(self) -> str:
        return f"{self.fullname}-identity-ca"

    def secret(self, name: str) -> str:
        return f"{self.fullname}-identity-{name}"

    @property
    def tls_ca_key_secret(self) -> str:
        return f"{self.fullname}-tls-ca-key"

    @property
    def tls_secret(self) -> str:
        return f"{self.fullname}-tls"


@dataclass
class Outcome:
    """What a run did: whether it made a new CA (and why), which CAs the bundle holds, what it renewed."""

    new_ca: str = ""  # "", "first", "revoked" (the key Secret was gone) or "expiring"
    bundle: int = 0
    renewed: list[str] = field(default_factory=list)
    #: The same for the services' TLS CA, when the run made the TLS Secret.
    tls_new_ca: str = ""
    tls_bundle: int = 0


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(data: dict[str, str], key: str) -> bytes:
    return base64.b64decode(data.get(key, "") or "")


class _Secrets:
    def __init__(self, api: ApiServer, client: httpx.Client) -> None:
        self._base = f"{api.url}/api/v1/namespaces/{api.namespace}/secrets"
        self._headers = {"Authorization": f"Bearer {api.token}"}
        self._client = client
        self._url = api.url

    def _call(self, method: str, url: str, **kw: Any) -> httpx.Response:
        try:
            return self._client.request(method, url, headers=self._headers, **kw)
        except httpx.HTTPError as exc:
            raise SecretError(
                f"cannot reach the API server at {self._url}: {type(exc).__name__}: {exc}"
            ) from None

    def get(self, name: str) -> dict[str, str] | None:
        found = self._call("GET", f"{self._base}/{name}")
        if found.status_code == 404:
            return None
        if found.status_code != 200:
            raise SecretError(_refusal("read", name, found))
        return dict(found.json().get("data") or {})

    def put(self, name: str, kind: str, data: dict[str, bytes], labels: dict[str, str]) -> None:
        """Create the Secret, or replace what it holds."""
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "labels": labels},
            "type": kind,
            "data": {k: _b64(v) for k, v in data.items()},
        }
        made = self._call("POST", self._base, json=body)
        if made.status_code == 201:
            return
        if made.status_code != 409:
            raise SecretError(_refusal("create", name, made))
        replaced = self._call("PUT", f"{self._base}/{name}", json=body)
        if replaced.status_code != 200:
            raise SecretError(_refusal("replace", name, replaced))


def _still_valid(pem: bytes, at: datetime.datetime) -> list[bytes]:
    out = []
    for cert in x509.load_pem_x509_certificates(pem) if pem.strip() else []:
        if cert.not_valid_after_utc > at:
            out.append(cert.public_bytes(serialization.Encoding.PEM))
    return out


@dataclass
class _Authority:
    cert: bytes
    key: bytes
    #: Every CA certificate still trusted: this one first, then older ones while they are valid.
    bundle: list[bytes]
    new: str  # "", "first", "revoked" or "expiring"


def _ensure_ca(
    secrets: _Secrets,
    key_secret: str,
    old_bundle_pem: bytes,
    had_bundle: bool,
    title: str,
    plan: IdentityPlan,
    at: datetime.datetime,
    now: float | None,
) -> _Authority:
    """Keep (or make) the CA held in `key_secret`: made anew when missing (a revocation, when a bundle
    existed: nothing of it is carried) or expiring within a leaf's validity (the old one stays trusted while
    it is valid)."""
    held = secrets.get(key_secret)
    ca_cert, ca_key = (_unb64(held, CA_CERT_FILE), _unb64(held, CA_KEY_FILE)) if held else (b"", b"")
    new, carried = "", []
    if not ca_cert or not ca_key:
        new = "revoked" if had_bundle else "first"
    else:
        expires = x509.load_pem_x509_certificate(ca_cert).not_valid_after_utc
        if expires - at < datetime.timedelta(days=plan.days):
            new = "expiring"
            carried = _still_valid(ca_cert, at)
    if new:
        ca_cert, ca_key = mint_ca(plan.scope, plan.days * CA_LIFETIMES, now, title)
        secrets.put(key_secret, "Opaque", {CA_CERT_FILE: ca_cert, CA_KEY_FILE: ca_key}, plan.labels)
    else:  # keep what the bundle held besides the current CA while it is valid
        current = x509.load_pem_x509_certificate(ca_cert).public_bytes(serialization.Encoding.PEM)
        carried = [c for c in _still_valid(old_bundle_pem, at) if c != current]
    return _Authority(ca_cert, ca_key, [ca_cert, *carried], new)


def ensure_identities(
    api: ApiServer,
    plan: IdentityPlan,
    transport: httpx.BaseTransport | None = None,
    now: float | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> Outcome:
    """Make (or keep) the CA, write the bundle, and mint every identity anew (see the module's text); the
    services' TLS likewise where the plan names their hosts."""
    at = _utc(now)
    outcome = Outcome()
    verify = ssl.create_default_context(cafile=api.ca_file) if isinstance(api.ca_file, str) else api.ca_file
    with httpx.Client(verify=verify, transport=transport, timeout=30) as client:
        secrets = _Secrets(api, client)
        old_bundle = secrets.get(plan.ca_secret)
        ca = _ensure_ca(
            secrets,
            plan.ca_key_secret,
            _unb64(old_bundle or {}, CA_CERT_FILE),
            old_bundle is not None,
            "MARS identity CA",
            plan,
            at,
            now,
        )
        outcome.new_ca, outcome.bundle = ca.new, len(ca.bundle)
        if ca.new:
            progress(f"made a new identity CA ({ca.new}) in {plan.ca_key_secret}")
        secrets.put(plan.ca_secret, "Opaque", {CA_CERT_FILE: b"".join(ca.bundle)}, plan.labels)
        for name in plan.names:
            cert, key = mint_leaf(ca.cert, ca.key, name, plan.scope, plan.days, now)
            secrets.put(
                plan.secret(name), "kubernetes.io/tls", {"tls.crt": cert, "tls.key": key}, plan.labels
            )
            outcome.renewed.append(name)
            progress(f"minted {plan.secret(name)} ({plan.scope}/{name}, {plan.days} days)")
        if plan.tls_hosts:
            old_tls = secrets.get(plan.tls_secret)
            tls_ca = _ensure_ca(
                secrets,
                plan.tls_ca_key_secret,
                _unb64(old_tls or {}, CA_CERT_FILE),
                old_tls is not None,
                "MARS services TLS CA",
                plan,
                at,
                now,
            )
            outcome.tls_new_ca, outcome.tls_bundle = tls_ca.new, len(tls_ca.bundle)
            cert, key = mint_server(tls_ca.cert, tls_ca.key, plan.tls_hosts, plan.days, now)
            tls = {"tls.crt": cert, "tls.key": key, CA_CERT_FILE: b"".join(tls_ca.bundle)}
            secrets.put(plan.tls_secret, "kubernetes.io/tls", tls, plan.labels)
            progress(f"minted {plan.tls_secret} for {len(plan.tls_hosts)} DNS names ({plan.days} days)")
    return outcome


def names_of(values: Sequence[str]) -> tuple[str, ...]:
    """Identity names as given (repeatable and comma-separated), each a plain name."""
    out = [n.strip() for v in values for n in v.split(",") if n.strip()]
    bad = [n for n in out if not n.replace("-", "").isalnum()]
    if bad or not out:
        raise SecretError(f"identity names are letters, digits and '-': {bad or 'none given'}")
    return tuple(dict.fromkeys(out))


def run_in_memory(args: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The Secrets `mars identity ensure-secrets ARGS` (e.g. the chart's Job's arguments, `mars` and the
    command words included or not) makes, run against an in-memory API server: name -> the Secret. For
    tests that mount what a cluster's pods would (the Job runs for real in the Kubernetes e2e)."""
    import json

    words = list(args)
    while words and not words[0].startswith("--"):
        words.pop(0)
    flags: dict[str, list[str]] = {}
    for flag, value in zip(words[::2], words[1::2], strict=True):
        flags.setdefault(flag, []).append(value)
    secrets: dict[str, dict[str, Any]] = {}

    def api(request: httpx.Request) -> httpx.Response:
        name = request.url.path.rsplit("/", 1)[-1]
        if request.method == "GET":
            return httpx.Response(200, json=secrets[name]) if name in secrets else httpx.Response(404)
        body = json.loads(request.content)
        if request.method == "POST" and body["metadata"]["name"] in secrets:
            return httpx.Response(409)
        secrets[body["metadata"]["name"]] = body
        return httpx.Response(201 if request.method == "POST" else 200, json=body)

    plan = IdentityPlan(
        flags["--fullname"][0],
        flags["--scope"][0],
        names_of(flags["--name"]),
        int(flags["--days"][0]),
        tls_hosts=tuple(flags.get("--tls-host", [])),
    )
    ensure_identities(
        ApiServer("https://in-memory", "token", False, "default"), plan, httpx.MockTransport(api)
    )
    return secrets
