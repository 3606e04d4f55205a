"""`mars identity ensure-secrets` (the chart's identity Job) against a fake API server: the CA kept across
runs, every identity renewed on each run, rotation near the CA's end with both CAs in the bundle, deletion of
the CA's key Secret as revocation, and certificates that mars.identity accepts for their release only."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from mars.identity import CallerIdentity, IdentityError, IdentityVerifier
from mars_tools.deploy.identity_secrets import (
    CA_LIFETIMES,
    IdentityPlan,
    ensure_identities,
    names_of,
)
from mars_tools.deploy.master_key_secret import ApiServer, SecretError

API = ApiServer("https://kube.test", "token", False, "mars")
SCOPE = "spiffe://cluster.local/ns/mars/prod"
PLAN = IdentityPlan("prod-mars", SCOPE, ("ingress", "replay"), days=90)
METHOD = "/mars.v1.Router/GetPolicy"


class Cluster:
    """Secrets in a dict, behind the API server's create (POST, 409 when taken), read and replace (PUT)."""

    def __init__(self) -> None:
        self.secrets: dict[str, dict[str, object]] = {}

    def handle(self, request: httpx.Request) -> httpx.Response:
        prefix = "/api/v1/namespaces/mars/secrets"
        assert request.url.path.startswith(prefix) and request.headers["authorization"] == "Bearer token"
        name = request.url.path[len(prefix) + 1 :]
        if request.method == "GET":
            found = self.secrets.get(name)
            return httpx.Response(200, json=found) if found else httpx.Response(404, json={"message": "nf"})
        body = json.loads(request.content)
        if request.method == "POST":
            if body["metadata"]["name"] in self.secrets:
                return httpx.Response(409, json={"message": "exists"})
            self.secrets[body["metadata"]["name"]] = body
            return httpx.Response(201, json=body)
        if request.method == "PUT":
            self.secrets[name] = body
            return httpx.Response(200, json=body)
        return httpx.Response(405)

    def data(self, name: str, key: str) -> bytes:
        return base64.b64decode(self.secrets[name]["data"][key])  # type: ignore[index]


def _run(cluster: Cluster, now: float | None = None, plan: IdentityPlan = PLAN) -> object:
    return ensure_identities(API, plan, httpx.MockTransport(cluster.handle), now=now)


def _caller(cluster: Cluster, name: str, tmp_path: Path) -> CallerIdentity:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cert, key = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    cert.write_bytes(cluster.data(f"prod-mars-identity-{name}", "tls.crt"))
    key.write_bytes(cluster.data(f"prod-mars-identity-{name}", "tls.key"))
    return CallerIdentity.from_files(str(cert), str(key))


def test_the_first_run_makes_a_ca_and_identities_the_release_accepts(tmp_path: Path) -> None:
    cluster = Cluster()
    outcome = _run(cluster)
    assert outcome.new_ca == "first" and outcome.renewed == ["ingress", "replay"]  # type: ignore[attr-defined]
    assert set(cluster.secrets) == {
        "prod-mars-identity-ca-key",
        "prod-mars-identity-ca",
        "prod-mars-identity-ingress",
        "prod-mars-identity-replay",
    }
    assert set(cluster.secrets["prod-mars-identity-ca"]["data"]) == {"ca.crt"}  # type: ignore[arg-type]
    assert cluster.secrets["prod-mars-identity-replay"]["type"] == "kubernetes.io/tls"
    bundle = cluster.data("prod-mars-identity-ca", "ca.crt")
    verifier = IdentityVerifier(bundle, scope=SCOPE)
    replay = _caller(cluster, "replay", tmp_path)
    assert (replay.name, replay.scope) == ("replay", SCOPE)
    assert verifier.verify(replay.token(METHOD), METHOD) == "replay"
    cert = x509.load_pem_x509_certificate(cluster.data("prod-mars-identity-replay", "tls.crt"))
    days = (cert.not_valid_after_utc - cert.not_valid_before_utc).days
    assert 89 <= days <= 90
    # Another release's services refuse it.
    with pytest.raises(IdentityError):
        IdentityVerifier(bundle, scope="spiffe://cluster.local/ns/mars/staging").verify(replay.token(METHOD), METHOD)


def test_a_later_run_keeps_the_ca_and_renews_every_identity() -> None:
    cluster = Cluster()
    _run(cluster)
    ca_key = cluster.data("prod-mars-identity-ca-key", "ca.key")
    before = cluster.data("prod-mars-identity-ingress", "tls.crt")
    outcome = _run(cluster)
    assert outcome.new_ca == "" and outcome.bundle == 1  # type: ignore[attr-defined]
    assert cluster.data("prod-mars-identity-ca-key", "ca.key") == ca_key
    assert cluster.data("prod-mars-identity-ingress", "tls.crt") != before  # renewed on each upgrade


def test_a_ca_near_its_end_is_rotated_with_the_old_one_kept_in_the_bundle(tmp_path: Path) -> None:
    """Pods holding a certificate of the old CA keep working through the rotation: the bundle has both."""
    day = 86400.0
    t0 = time.time()
    cluster = Cluster()
    _run(cluster, now=t0)
    ca_life = CA_LIFETIMES * 90
    assert _run(cluster, now=t0 + (ca_life - 100) * day).new_ca == ""  # type: ignore[attr-defined]
    held = _caller(cluster, "replay", tmp_path / "held")  # minted by the old CA, 100 days before its end
    rotated_at = t0 + (ca_life - 89) * day  # under one leaf validity (90 days) left
    outcome = _run(cluster, now=rotated_at)
    assert outcome.new_ca == "expiring" and outcome.bundle == 2  # type: ignore[attr-defined]
    bundle = cluster.data("prod-mars-identity-ca", "ca.crt")
    verifier = IdentityVerifier(bundle, clock=lambda: rotated_at, scope=SCOPE)
    held.clock = lambda: rotated_at  # its token is minted now; its certificate is the old CA's
    assert verifier.verify(held.token(METHOD), METHOD) == "replay"
    fresh = _caller(cluster, "replay", tmp_path / "fresh")
    fresh.clock = lambda: rotated_at
    assert verifier.verify(fresh.token(METHOD), METHOD) == "replay"


def test_deleting_the_cas_key_secret_revokes_every_identity(tmp_path: Path) -> None:
    cluster = Cluster()
    _run(cluster)
    (tmp_path / "old").mkdir()
    revoked = _caller(cluster, "replay", tmp_path / "old")
    del cluster.secrets["prod-mars-identity-ca-key"]
    outcome = _run(cluster)
    assert outcome.new_ca == "revoked" and outcome.bundle == 1  # type: ignore[attr-defined]
    verifier = IdentityVerifier(cluster.data("prod-mars-identity-ca", "ca.crt"), scope=SCOPE)
    with pytest.raises(IdentityError, match="not signed by the identity CA"):
        verifier.verify(revoked.token(METHOD), METHOD)
    assert verifier.verify(_caller(cluster, "replay", tmp_path).token(METHOD), METHOD) == "replay"


def test_bad_arguments_are_refused_with_what_to_give() -> None:
    with pytest.raises(ValueError, match="spiffe://"):
        IdentityPlan("x", "not-a-scope", ("ingress",))
    with pytest.raises(SecretError, match="--days"):
        IdentityPlan("x", SCOPE, ("ingress",), days=0)
    with pytest.raises(SecretError, match="letters, digits"):
        names_of(["ingress,../etc"])
    assert names_of(["ingress,replay", "replay"]) == ("ingress", "replay")


TLS_PLAN = IdentityPlan(
    "prod-mars", SCOPE, ("ingress",), days=90, tls_hosts=("prod-mars-ingress", "prod-mars-ingress.mars.svc")
)


def _tls_ca(cluster: Cluster) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(cluster.data("prod-mars-tls", "ca.crt"))


def test_the_services_tls_has_a_ca_of_its_own_kept_renewed_and_revocable() -> None:
    """With TLS hosts the run also makes the services' TLS: a CA apart from the identity CA (a TLS
    certificate is no identity, and the reverse), its bundle in <fullname>-tls beside a certificate for every
    name given, server and client authentication; kept across runs, the certificate renewed; deleting
    <fullname>-tls-ca-key revokes it (the new bundle holds only the new CA)."""
    from cryptography.x509.oid import ExtendedKeyUsageOID

    cluster = Cluster()
    outcome = _run(cluster, plan=TLS_PLAN)
    assert outcome.tls_new_ca == "first" and outcome.tls_bundle == 1  # type: ignore[attr-defined]
    assert cluster.secrets["prod-mars-tls"]["type"] == "kubernetes.io/tls"
    cert = x509.load_pem_x509_certificate(cluster.data("prod-mars-tls", "tls.crt"))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == list(TLS_PLAN.tls_hosts)
    usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert usages == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    (ca,) = _tls_ca(cluster)
    assert cert.issuer == ca.subject
    identity_ca = x509.load_pem_x509_certificate(cluster.data("prod-mars-identity-ca", "ca.crt"))
    assert identity_ca.subject != ca.subject and "TLS" in ca.subject.rfc4514_string()
    # A later run keeps the CA and renews the certificate.
    again = _run(cluster, plan=TLS_PLAN)
    assert again.tls_new_ca == "" and _tls_ca(cluster) == [ca]  # type: ignore[attr-defined]
    renewed = x509.load_pem_x509_certificate(cluster.data("prod-mars-tls", "tls.crt"))
    assert renewed.serial_number != cert.serial_number
    # Revocation: the key Secret gone, a new CA, and the old one is not carried.
    del cluster.secrets["prod-mars-tls-ca-key"]
    revoked = _run(cluster, plan=TLS_PLAN)
    assert revoked.tls_new_ca == "revoked"  # type: ignore[attr-defined]
    assert [c.subject for c in _tls_ca(cluster)] == [ca.subject] and _tls_ca(cluster) != [ca]
    # Without TLS hosts nothing of it is made.
    plain = Cluster()
    _run(plain)
    assert not [name for name in plain.secrets if name.startswith("prod-mars-tls")]
