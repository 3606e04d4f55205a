"""Service identity tokens (mars.identity): minted by a caller's certificate and key, checked against the
identity CA, bound to one service and one lifetime, and the stage servers' decision per method."""

from __future__ import annotations

import base64
import datetime
import json
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from mars.identity import (
    IDENTITY_METADATA,
    CallerIdentity,
    IdentityConfigError,
    IdentityError,
    IdentityInterceptor,
    IdentityVerifier,
)
from mars.topology import PERMISSIONS
from mars_stack.certs import identity_authority, make_identities


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_identities(tmp_path_factory.mktemp("ids"), ("operator", "chaos", "memory")).ca.parent


def caller(folder: Path, name: str, clock: float | None = None) -> CallerIdentity:
    identity = CallerIdentity.from_files(str(folder / f"{name}.crt"), str(folder / f"{name}.key"))
    if clock is not None:
        identity.clock = lambda: clock
    return identity


def verifier(folder: Path) -> IdentityVerifier:
    return IdentityVerifier.from_file(str(folder / "ca.crt"))


def test_a_token_names_its_caller_for_the_service_it_was_minted_for(ca: Path) -> None:
    token = caller(ca, "operator").token("/mars.v1.Memory/BuildView")
    assert verifier(ca).verify(token, "/mars.v1.Memory/BuildView") == "operator"
    with pytest.raises(IdentityError, match=r"for mars\.v1\.Memory, not mars\.v1\.Router"):
        verifier(ca).verify(token, "/mars.v1.Router/GetPolicy")


def test_a_caller_reuses_its_token_until_near_its_end() -> None:
    times = [1000.0]
    identity = CallerIdentity("x", b"", None, lifetime_s=300.0, clock=lambda: times[0])
    identity._tokens["/mars.v1.Judge/Score"] = ("cached", 1300.0)
    assert identity.token("/mars.v1.Judge/Score") == "cached"
    times[0] = 1250.0  # 50 s left: under a minute, so a new one would be minted (and this key cannot sign)
    with pytest.raises(IdentityConfigError, match="RSA or EC"):
        identity.token("/mars.v1.Judge/Score")


def test_a_certificate_from_another_ca_is_refused(ca: Path, tmp_path: Path) -> None:
    other = make_identities(tmp_path / "other", ("operator",))
    forged = CallerIdentity.from_files(*map(str, other.callers["operator"])).token("/mars.v1.Memory/BuildView")
    with pytest.raises(IdentityError, match="not signed by the identity CA"):
        verifier(ca).verify(forged, "/mars.v1.Memory/BuildView")


def test_a_changed_claim_breaks_the_signature(ca: Path) -> None:
    version, cert, claims, signature = caller(ca, "chaos").token("/mars.v1.Router/GetPolicy").split(".")
    decoded = json.loads(base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4)))
    decoded["sub"] = "operator"
    forged_claims = base64.urlsafe_b64encode(json.dumps(decoded).encode()).rstrip(b"=").decode()
    with pytest.raises(IdentityError, match="signature does not match"):
        verifier(ca).verify(".".join([version, cert, forged_claims, signature]), "/mars.v1.Router/GetPolicy")


@pytest.mark.parametrize("token", ["", "Bearer mars_abc", "v1.a.b.c", "v1.!!.??.**", "v2.x.y.z"])
def test_garbage_is_no_token(ca: Path, token: str) -> None:
    with pytest.raises(IdentityError, match="not a MARS identity token"):
        verifier(ca).verify(token, "/mars.v1.Memory/BuildView")


def test_an_expired_token_is_refused(ca: Path) -> None:
    minted_at = datetime.datetime.now(datetime.UTC).timestamp()
    token = caller(ca, "operator", clock=minted_at).token("/mars.v1.Memory/BuildView")
    late = IdentityVerifier.from_file(str(ca / "ca.crt"))
    late._clock = lambda: minted_at + 301 + 31  # past exp and the allowed skew
    with pytest.raises(IdentityError, match="expired"):
        late.verify(token, "/mars.v1.Memory/BuildView")
    # Once verified and cached, a token still expires on time.
    v = verifier(ca)
    assert v.verify(token, "/mars.v1.Memory/BuildView") == "operator"
    v._clock = lambda: minted_at + 400
    with pytest.raises(IdentityError, match="expired"):
        v.verify(token, "/mars.v1.Memory/BuildView")


def test_a_token_minted_in_the_future_or_for_too_long_is_refused(ca: Path) -> None:
    now = datetime.datetime.now(datetime.UTC).timestamp()
    future = caller(ca, "operator", clock=now + 3600).token("/mars.v1.Memory/BuildView")
    with pytest.raises(IdentityError, match="lifetime is out of bounds"):
        verifier(ca).verify(future, "/mars.v1.Memory/BuildView")
    eternal = caller(ca, "operator")
    eternal.lifetime_s = 86_400
    with pytest.raises(IdentityError, match="lifetime is out of bounds"):
        verifier(ca).verify(eternal.token("/mars.v1.Memory/BuildView"), "/mars.v1.Memory/BuildView")


@pytest.mark.parametrize(
    ("iat", "exp", "why"),
    [
        ("now", float("nan"), "no lifetime"),
        (float("nan"), "now", "no lifetime"),
        ("now", float("inf"), "no lifetime"),
        (float("-inf"), "now", "no lifetime"),
        (True, "now", "no lifetime"),
        ("now", "before", "out of bounds"),
    ],
)
def test_a_lifetime_that_is_not_two_finite_ordered_times_is_refused(
    ca: Path, iat: object, exp: object, why: str
) -> None:
    """A token signed by a real identity whose claims say "exp": NaN (json writes and reads NaN) compared
    false with every bound and never expired; infinite, boolean and reversed times are refused too."""
    from mars import identity

    now = float(int(datetime.datetime.now(datetime.UTC).timestamp()))
    times = {"now": now, "before": now - 10}
    claims = {
        "sub": "operator",
        "aud": "mars.v1.Memory",
        "mth": "/mars.v1.Memory/BuildView",
        "iat": times.get(iat, iat) if isinstance(iat, str) else iat,
        "exp": times.get(exp, exp) if isinstance(exp, str) else exp,
    }
    signer = caller(ca, "operator")
    head = "v1." + identity._b64(signer.cert_der) + "." + identity._b64(json.dumps(claims).encode())
    token = head + "." + identity._b64(identity._sign(signer.key, head.encode("ascii")))
    with pytest.raises(IdentityError, match=why):
        verifier(ca).verify(token, "/mars.v1.Memory/BuildView")


def rsa_authority(folder: Path, names: tuple[str, ...]) -> None:
    """An RSA CA and RSA leaves, as Helm's genCA and genSignedCert make them (the chart's identities)."""
    folder.mkdir(parents=True)
    now = datetime.datetime.now(datetime.UTC)

    def cert(
        common: str, key: rsa.RSAPrivateKey, issuer: x509.Name, signer: rsa.RSAPrivateKey, ca: bool
    ) -> bytes:
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])
        built = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer if not ca else subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:  # genSignedCert marks its leaves for server and client authentication
            usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            built = built.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        built = built.sign(signer, hashes.SHA256())
        return built.public_bytes(serialization.Encoding.PEM)

    ca_key = rsa.generate_private_key(65537, 2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mars-identity-ca")])
    (folder / "ca.crt").write_bytes(cert("mars-identity-ca", ca_key, ca_name, ca_key, True))
    (folder / "ca.key").write_bytes(
        ca_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    for name in names:
        key = rsa.generate_private_key(65537, 2048)
        (folder / f"{name}.crt").write_bytes(cert(name, key, ca_name, ca_key, False))
        (folder / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.TraditionalOpenSSL,  # Helm writes PKCS#1 "RSA PRIVATE KEY"
                serialization.NoEncryption(),
            )
        )


def test_rsa_identities_as_helm_mints_them_verify(tmp_path: Path) -> None:
    rsa_authority(tmp_path / "helm", ("replay",))
    token = caller(tmp_path / "helm", "replay").token("/mars.v1.Router/GetPolicy")
    assert verifier(tmp_path / "helm").verify(token, "/mars.v1.Router/GetPolicy") == "replay"
    # The CA's own certificate signs, but it is no caller.
    ca_as_caller = CallerIdentity.from_files(str(tmp_path / "helm/ca.crt"), str(tmp_path / "helm/ca.key"))
    with pytest.raises(IdentityError, match="CA certificate is no caller"):
        verifier(tmp_path / "helm").verify(ca_as_caller.token("/mars.v1.Router/GetPolicy"), "/mars.v1.Router/GetPolicy")


def test_identity_files_half_given_or_missing_are_named(tmp_path: Path) -> None:
    assert CallerIdentity.from_env({}) is None
    with pytest.raises(IdentityConfigError, match="go together"):
        CallerIdentity.from_env({"MARS_IDENTITY_CERT_FILE": "/x"})
    with pytest.raises(IdentityConfigError, match="MARS_IDENTITY_CERT_FILE=/nope: cannot read it"):
        CallerIdentity.from_files("/nope", "/nope.key")
    with pytest.raises(IdentityConfigError, match="MARS_IDENTITY_CA_FILE"):
        IdentityVerifier.from_file(str(tmp_path / "absent.crt"))


def decide(interceptor: IdentityInterceptor, method: str, token: str | None) -> grpc.StatusCode | None:
    metadata = [("authorization", "Bearer mars_tenantkey")] + ([(IDENTITY_METADATA, token)] if token else [])
    refused = interceptor.check(method, tuple(metadata))
    return None if refused is None else refused[0]


def test_the_server_decides_by_token_and_permission(ca: Path) -> None:
    check = IdentityInterceptor(verifier(ca), PERMISSIONS)
    operator, chaos = caller(ca, "operator"), caller(ca, "chaos")
    reset, describe = "/mars.v1.Router/ResetPolicy", "/mars.v1.Memory/DescribeIndex"
    assert decide(check, reset, operator.token(reset)) is None
    assert decide(check, reset, None) == grpc.StatusCode.UNAUTHENTICATED  # a tenant's API key opens nothing
    assert decide(check, reset, chaos.token(reset)) == grpc.StatusCode.PERMISSION_DENIED
    assert decide(check, describe, chaos.token(describe)) is None
    assert decide(check, describe, chaos.token("/mars.v1.Router/GetPolicy")) == grpc.StatusCode.UNAUTHENTICATED
    # Bound to its method: a token for one method of the service opens no other.
    assert decide(check, reset, operator.token("/mars.v1.Router/GetPolicy")) == grpc.StatusCode.UNAUTHENTICATED
    # A service's own certificate (memory) is an identity, but no method lists it.
    assert decide(check, describe, caller(ca, "memory").token(describe)) == grpc.StatusCode.PERMISSION_DENIED
    # A method nobody is listed for is refused to everyone.
    unlisted = "/mars.v1.Memory/Unlisted"
    assert decide(check, unlisted, operator.token(unlisted)) == grpc.StatusCode.PERMISSION_DENIED
    # Health, reflection and the public ingress are not the identity check's.
    for open_method in ("/grpc.health.v1.Health/Check", "/mars.v1.Ingress/SendTurn"):
        assert decide(check, open_method, None) is None


def test_a_stage_without_its_ca_fails_closed_unless_identity_is_turned_off(ca: Path) -> None:
    token = caller(ca, "operator").token("/mars.v1.Judge/Score")
    assert decide(IdentityInterceptor(None, PERMISSIONS), "/mars.v1.Judge/Score", token) == grpc.StatusCode.UNAUTHENTICATED
    assert decide(IdentityInterceptor(None, PERMISSIONS, required=False), "/mars.v1.Judge/Score", None) is None


def test_every_internal_method_is_in_the_permissions() -> None:
    from mars.v1 import services_pb2

    internal = {"StateEstimator", "Memory", "Router", "Dispatch", "Judge"}
    methods = {
        f"/mars.v1.{s.name}/{m.name}"
        for s in services_pb2.DESCRIPTOR.services_by_name.values()
        if s.name in internal
        for m in s.methods
    }
    assert methods == set(PERMISSIONS)


# --- bound to the release ---------------------------------------------------------------------------------

SCOPE = "spiffe://mars.test/ns/prod/mars"


def test_a_scoped_caller_names_its_release_and_is_refused_by_another(tmp_path: Path) -> None:
    """Same CA, two releases (as one issuer shared by staging and production would make them): each
    release's services answer only their own release's identities."""
    ca, mint = identity_authority(tmp_path / "ids")
    prod = IdentityVerifier.from_file(str(ca), SCOPE)
    method = "/mars.v1.Router/GetPolicy"
    operator = CallerIdentity.from_files(*map(str, mint("operator", SCOPE)))
    assert (operator.name, operator.scope) == ("operator", SCOPE)
    assert prod.verify(operator.token(method), method) == "operator"
    # From the same CA, for another release: its token names staging, and its certificate is staging's.
    stranger = CallerIdentity.from_files(*map(str, mint("replay", "spiffe://mars.test/ns/staging/mars")))
    with pytest.raises(IdentityError):
        prod.verify(stranger.token(method), method)
    stranger.scope = SCOPE  # a token claiming this release: the certificate still says staging
    with pytest.raises(IdentityError, match="not an identity of this release"):
        prod.verify(stranger.token(method), method)
    # From the same CA with no SPIFFE ID (its common name says "deploy"): refused where a scope is set.
    bare = CallerIdentity.from_files(*map(str, mint("deploy")))
    bare.scope = SCOPE
    with pytest.raises(IdentityError, match="not an identity of this release"):
        prod.verify(bare.token(method), method)


def test_a_token_of_another_release_is_refused_even_from_a_shared_certificate(tmp_path: Path) -> None:
    """The audience names the release: a verifier of another scope refuses a token minted for this one."""
    files = make_identities(tmp_path / "ids", ("operator",), SCOPE)
    method = "/mars.v1.Judge/Score"
    token = CallerIdentity.from_files(*map(str, files.callers["operator"])).token(method)
    staging = IdentityVerifier.from_file(str(files.ca), "spiffe://mars.test/ns/staging/mars")
    with pytest.raises(IdentityError):
        staging.verify(token, method)


def test_a_certificate_without_client_authentication_usage_is_refused(tmp_path: Path) -> None:
    ca, mint = identity_authority(tmp_path / "ids")
    method = "/mars.v1.Router/GetPolicy"
    server = CallerIdentity.from_files(*map(str, mint("operator", SCOPE, server_only=True)))
    with pytest.raises(IdentityError, match="clientAuth"):
        IdentityVerifier.from_file(str(ca), SCOPE).verify(server.token(method), method)


def test_an_expired_identity_ca_opens_nothing(tmp_path: Path) -> None:
    files = make_identities(tmp_path / "ids", ("operator",), SCOPE)
    method = "/mars.v1.Router/GetPolicy"
    token = CallerIdentity.from_files(*map(str, files.callers["operator"])).token(method)
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    after = ca.not_valid_after_utc.timestamp() + 3600  # the leaf is as old: checked first, the CA too
    late = IdentityVerifier(files.ca.read_bytes(), clock=lambda: after, scope=SCOPE)
    with pytest.raises(IdentityError, match="not valid now"):
        late.verify(token, method)


def test_a_scope_that_is_no_spiffe_id_is_a_configuration_error() -> None:
    for bad in ("mars/prod", "spiffe://only-domain", "spiffe://d/ns/x/"):
        with pytest.raises(IdentityConfigError, match="spiffe://"):
            IdentityVerifier(b"", scope=bad)


def test_a_rewritten_ca_file_is_read_again_without_a_restart(tmp_path: Path) -> None:
    """A rotated or revoked bundle (the identity Job rewrites the Secret, the kubelet the mounted file) takes
    effect within RELOAD_S: what was verified against the old CA is forgotten."""
    import os

    first, mint_first = identity_authority(tmp_path / "first")
    second, mint_second = identity_authority(tmp_path / "second")
    mounted = tmp_path / "ca.crt"
    mounted.write_bytes(first.read_bytes())
    times = [time.time()]
    verifier = IdentityVerifier.from_file(str(mounted), SCOPE, clock=lambda: times[0])
    method = "/mars.v1.Router/GetPolicy"
    old = CallerIdentity.from_files(*map(str, mint_first("replay", SCOPE)))
    new = CallerIdentity.from_files(*map(str, mint_second("replay", SCOPE)))
    assert verifier.verify(old.token(method), method) == "replay"
    mounted.write_bytes(second.read_bytes())  # the revocation: a new CA alone
    os.utime(mounted, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    assert verifier.verify(old.token(method), method) == "replay"  # not looked at yet (cached)
    times[0] += IdentityVerifier.RELOAD_S + 1
    with pytest.raises(IdentityError, match="not signed by the identity CA"):
        verifier.verify(old.token(method), method)
    assert verifier.verify(new.token(method), method) == "replay"
