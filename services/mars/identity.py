"""Service identity: who is calling an internal RPC, proven by a short-lived signed token.

Inside the deployment nothing is trusted: a NetworkPolicy on pod labels is no proof, since anyone who can
create a pod can set the labels. So every call to a stage service (state, memory, router, dispatch, judge)
carries a token in the `x-mars-identity` metadata: a JSON claim {sub, aud, mth, iat, exp} signed by the
caller's private key, with the caller's certificate, which the identity CA signed, which is for client
authentication (extended key usage clientAuth) and which names the caller. The stage checks the signature,
the certificate's issuer, usage and validity (and the CA's own), that the token is for this service (aud: the
gRPC service's full name, so a token for Memory opens nothing at Router) and for the method called (mth), and
unexpired, then that the service's permissions (its spec's, mars.spec) let that caller call that method. No
token, or a tenant's API key, is UNAUTHENTICATED; a known caller on a method not its own is PERMISSION_DENIED.

Identities bound to their release: where a scope is set (MARS_IDENTITY_SCOPE, a SPIFFE ID prefix
`spiffe://<trust-domain>/ns/<namespace>/<release>`), a caller's certificate must carry the URI SAN
`<scope>/<name>` (its common name is then no proof), and the token's audience names the scope: a certificate
from the same CA for another release, or a token minted by a staging release's tool, opens nothing. Without a
scope (certificates Helm's genSignedCert makes carry no URI SAN) the common name names the caller.

Health (and reflection, where a setting turns it on) stays open; the ingress is the public edge and answers
API keys (mars.auth), not identities.

Why tokens rather than mutual TLS alone: a refused TLS handshake reaches the caller as UNAVAILABLE, which
reads as an outage; a token check answers with the status that says what is wrong, works on the local
stack's plaintext loopback as on a TLS cluster, and costs a dictionary lookup per call once verified (the
verifier caches each token until it expires). Certificates are what Helm (genCA, genSignedCert) and the
local stack (infra/mars_stack/certs.py) can both mint: RSA and EC keys are accepted.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeGuard

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mars.config import CallerSettings
from mars.tls import read_pem

log = logging.getLogger(__name__)

#: The call metadata that carries the token.
IDENTITY_METADATA = "x-mars-identity"
#: How long a minted token is good for; a caller mints a new one a minute before this runs out.
TOKEN_LIFETIME_S = 300.0
#: The longest lifetime a verifier accepts, and the clock skew it allows between caller and service.
MAX_TOKEN_LIFETIME_S = 900.0
CLOCK_SKEW_S = 30.0

#: The identities that tools and people hold. operator: a person's diagnostics (`mars` against a stack, the
#: tests); replay: `mars replay redrive` and the replay Job; chaos: the chaos harness; deploy: `mars deploy`.
TOOL_IDENTITIES = ("operator", "replay", "chaos", "deploy")
#: The services that call another over gRPC (turns move over Kafka; these calls are the exceptions):
#: ingress: a history import hands the state service the context it leaves (StateEstimator.ImportContext).
SERVICE_IDENTITIES = ("ingress",)
#: Every identity a deployment mints.
IDENTITIES = TOOL_IDENTITIES + SERVICE_IDENTITIES


#: URI SAN scheme of the identities bound to a release.
SPIFFE = "spiffe://"


def check_scope(scope: str) -> str:
    """The scope itself when it is a SPIFFE ID prefix spiffe://<trust-domain>/<path> (no trailing slash)."""
    if scope and (not scope.startswith(SPIFFE) or scope.endswith("/") or "/" not in scope[len(SPIFFE) :]):
        raise IdentityConfigError(
            f"identity scope {scope!r} is not spiffe://<trust-domain>/ns/<namespace>/<release>"
        )
    return scope


def audience(scope: str, service: str) -> str:
    """A token's audience: the gRPC service, behind the release's scope where there is one."""
    return f"{scope}/{service}" if scope else service


class IdentityError(ValueError):
    """A token that proves nothing: missing, malformed, forged, expired, or for another service."""


class IdentityConfigError(ValueError):
    """Identity files that are missing, unreadable or only half given; the message names the setting."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _read(path: str, setting: str) -> bytes:
    return read_pem(path, setting, IdentityConfigError)


def _common_name(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    value = names[0].value if names else ""
    return value if isinstance(value, str) else value.decode("utf-8", "replace")


def spiffe_ids(cert: x509.Certificate) -> list[str]:
    """The certificate's spiffe:// URI SANs."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [u for u in sans.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(SPIFFE)]


def _scoped_name(cert: x509.Certificate) -> tuple[str, str]:
    """(scope, name) of a certificate: from its one SPIFFE ID <scope>/<name>, else ("", common name)."""
    ids = spiffe_ids(cert)
    if not ids:
        return "", _common_name(cert)
    if len(ids) > 1:
        raise IdentityConfigError(f"the identity certificate carries {len(ids)} SPIFFE IDs, not one")
    scope, _, name = ids[0].rpartition("/")
    return scope, name


def _for_clients(cert: x509.Certificate) -> bool:
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return False
    return ExtendedKeyUsageOID.CLIENT_AUTH in usages


def service_of(method: str) -> str:
    """ "mars.v1.Memory" of "/mars.v1.Memory/BuildView"."""
    return method.lstrip("/").split("/", 1)[0]


def _sign(key: Any, data: bytes) -> bytes:
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, padding.PKCS1v15(), hashes.SHA256())
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    raise IdentityConfigError(f"identity keys are RSA or EC, not {type(key).__name__}")


def _verify_signature(key: Any, signature: bytes, data: bytes) -> None:
    if isinstance(key, rsa.RSAPublicKey):
        key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
    elif isinstance(key, ec.EllipticCurvePublicKey):
        key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    else:
        raise IdentityError(f"the certificate's key is {type(key).__name__}, not RSA or EC")


@dataclass
class CallerIdentity:
    """A caller's name, certificate and key; mints a token per method called (bound to the method's service,
    behind the release's scope when the certificate names one) and reuses it until near its end."""

    name: str
    cert_der: bytes
    key: Any
    lifetime_s: float = TOKEN_LIFETIME_S
    #: The release the certificate's SPIFFE ID names ("" for a certificate without one).
    scope: str = ""
    clock: Callable[[], float] = time.time
    _tokens: dict[str, tuple[str, float]] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_files(cls, cert_file: str, key_file: str) -> CallerIdentity:
        cert_pem = _read(cert_file, "MARS_IDENTITY_CERT_FILE")
        key_pem = _read(key_file, "MARS_IDENTITY_KEY_FILE")
        try:
            cert = x509.load_pem_x509_certificate(cert_pem)
            key = serialization.load_pem_private_key(key_pem, password=None)
        except ValueError as exc:
            raise IdentityConfigError(f"identity certificate or key is not PEM: {exc}") from None
        scope, name = _scoped_name(cert)
        if not name:
            raise IdentityConfigError(
                f"MARS_IDENTITY_CERT_FILE={cert_file}: the certificate names no caller (no common name)"
            )
        return cls(name, cert.public_bytes(serialization.Encoding.DER), key, scope=scope)

    @classmethod
    def from_settings(cls, settings: CallerSettings) -> CallerIdentity | None:
        """The identity in MARS_IDENTITY_CERT_FILE and MARS_IDENTITY_KEY_FILE, or None when neither is set."""
        cert, key = settings.identity_cert_file, settings.identity_key_file
        if not cert and not key:
            return None
        if not (cert and key):
            raise IdentityConfigError("MARS_IDENTITY_CERT_FILE and MARS_IDENTITY_KEY_FILE go together")
        return cls.from_files(cert, key)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CallerIdentity | None:
        """`from_settings` of the caller settings in `env` (None: of this process)."""
        return cls.from_settings(CallerSettings.from_env(env))

    def token(self, method: str) -> str:
        """A token for calling `method` ("/mars.v1.Memory/BuildView") and nothing else."""
        now = self.clock()
        with self._lock:
            cached = self._tokens.get(method)
            if cached is not None and cached[1] - now > min(60.0, self.lifetime_s / 2):
                return cached[0]
            claims = {
                "sub": self.name,
                "aud": audience(self.scope, service_of(method)),
                "mth": method,
                "iat": int(now),
                "exp": int(now + self.lifetime_s),
            }
            head = (
                "v1." + _b64(self.cert_der) + "." + _b64(json.dumps(claims, separators=(",", ":")).encode())
            )
            token = head + "." + _b64(_sign(self.key, head.encode("ascii")))
            self._tokens[method] = (token, now + self.lifetime_s)
            return token


def _instant(value: object) -> TypeGuard[float]:
    """A finite number of seconds (JSON lets NaN and Infinity through; a bool is no time)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _file_state(path: str) -> tuple[int, int] | None:
    """What tells a rewritten file apart: its modification time and inode (a Secret volume swaps a link)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_ino


class _Verified(NamedTuple):
    caller: str
    audience: str
    method: str
    expires: float


class IdentityVerifier:
    """Checks tokens against the identity CA; a verified token is remembered until it expires, so a caller
    that reuses its token (as CallerIdentity does) pays for the signature check once."""

    def __init__(
        self,
        ca_pem: bytes,
        clock: Callable[[], float] = time.time,
        cache_size: int = 4096,
        scope: str = "",
    ) -> None:
        #: The release whose identities this service answers ("": any certificate the CA signed).
        self._scope = check_scope(scope)
        self._cas = self._load(ca_pem)
        #: The CA file and when it was last looked at (from_file): a rotated or revoked bundle that the
        #: kubelet writes into the mounted Secret is read within RELOAD_S, without a restart.
        self._file: str | None = None
        self._file_seen: tuple[int, int] | None = None
        self._next_look = 0.0
        self._clock = clock
        self._cache: OrderedDict[str, _Verified] = OrderedDict()
        self._cache_size = cache_size

    #: How often the CA file is looked at for a change.
    RELOAD_S = 30.0

    @staticmethod
    def _load(ca_pem: bytes) -> list[x509.Certificate]:
        try:
            return x509.load_pem_x509_certificates(ca_pem)
        except ValueError as exc:
            raise IdentityConfigError(f"the identity CA is not PEM: {exc}") from None

    @classmethod
    def from_file(cls, ca_file: str, scope: str = "", clock: Callable[[], float] = time.time) -> IdentityVerifier:
        verifier = cls(_read(ca_file, "MARS_IDENTITY_CA_FILE"), clock=clock, scope=scope)
        verifier._file = ca_file
        verifier._file_seen = _file_state(ca_file)
        verifier._next_look = clock() + cls.RELOAD_S
        return verifier

    def _look_at_file(self, now: float) -> None:
        """Read the CA file again when it changed; what was verified against the old bundle is forgotten. A
        file that cannot be read or parsed now keeps the bundle there was (and says so)."""
        if self._file is None or now < self._next_look:
            return
        self._next_look = now + self.RELOAD_S
        state = _file_state(self._file)
        if state is None or state == self._file_seen:
            return
        try:
            cas = self._load(_read(self._file, "MARS_IDENTITY_CA_FILE"))
        except IdentityConfigError as exc:
            log.error("identity CA file changed but does not load (keeping the previous bundle): %s", exc)
            return
        self._cas, self._file_seen = cas, state
        self._cache.clear()
        log.info("identity CA bundle reloaded from %s (%d CA(s))", self._file, len(cas))

    def verify(self, token: str, method: str) -> str:
        """The caller's name for a call of `method`, or IdentityError saying why the token proves nothing."""
        now = self._clock()
        self._look_at_file(now)
        expected = audience(self._scope, service_of(method))
        hit = self._cache.get(token)
        if hit is None:
            hit = self._check(token, now)
            self._cache[token] = hit
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        if hit.audience != expected:
            raise IdentityError(f"the token is for {hit.audience}, not {expected}")
        if hit.method != method:
            raise IdentityError(f"the token is for calling {hit.method}, not {method}")
        if now > hit.expires + CLOCK_SKEW_S:
            self._cache.pop(token, None)
            raise IdentityError("the token has expired")
        return hit.caller

    def _check(self, token: str, now: float) -> _Verified:
        parts = token.split(".")
        if len(parts) != 4 or parts[0] != "v1":
            raise IdentityError("not a MARS identity token")
        try:
            cert = x509.load_der_x509_certificate(_unb64(parts[1]))
            claims = json.loads(_unb64(parts[2]))
            signature = _unb64(parts[3])
        except (ValueError, binascii.Error):
            raise IdentityError("not a MARS identity token") from None
        if not isinstance(claims, dict):
            raise IdentityError("not a MARS identity token")
        self._check_certificate(cert, now)
        try:
            _verify_signature(cert.public_key(), signature, ".".join(parts[:3]).encode("ascii"))
        except InvalidSignature:
            raise IdentityError("the token's signature does not match its certificate") from None
        sub, aud, mth, iat, exp = (claims.get(k) for k in ("sub", "aud", "mth", "iat", "exp"))
        if not (isinstance(sub, str) and isinstance(aud, str) and isinstance(mth, str)):
            raise IdentityError("the token names no caller, service or method")
        if not (_instant(iat) and _instant(exp)):
            raise IdentityError("the token has no lifetime")
        if sub != self._caller_of(cert):
            raise IdentityError("the token's caller is not its certificate's")
        # NaN compares false with everything: _instant refuses it, or "exp": NaN would never expire.
        if exp < iat or exp - iat > MAX_TOKEN_LIFETIME_S or iat > now + CLOCK_SKEW_S:
            raise IdentityError("the token's lifetime is out of bounds")
        return _Verified(sub, aud, mth, float(exp))

    def _caller_of(self, cert: x509.Certificate) -> str:
        """Who the certificate names: with a scope, its SPIFFE ID <scope>/<name> (another release's, or none,
        is refused); without one, its common name."""
        if not self._scope:
            return _common_name(cert)
        ids = spiffe_ids(cert)
        ours = [i[len(self._scope) + 1 :] for i in ids if i.startswith(self._scope + "/")]
        if len(ids) != 1 or len(ours) != 1 or not ours[0] or "/" in ours[0]:
            raise IdentityError(
                "the token's certificate is not an identity of this release "
                f"(its SPIFFE ID must be {self._scope}/<name>; it has {', '.join(ids) or 'none'})"
            )
        return ours[0]

    def _check_certificate(self, cert: x509.Certificate, now: float) -> None:
        for ca in self._cas:
            try:
                cert.verify_directly_issued_by(ca)
                break
            except (ValueError, TypeError, InvalidSignature):
                continue
        else:
            raise IdentityError("the token's certificate is not signed by the identity CA")
        for signed, what in ((ca, "identity CA"), (cert, "token's certificate")):
            start, end = signed.not_valid_before_utc.timestamp(), signed.not_valid_after_utc.timestamp()
            if not start - CLOCK_SKEW_S <= now <= end + CLOCK_SKEW_S:
                raise IdentityError(f"the {what} is not valid now")
        try:
            if cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
                raise IdentityError("a CA certificate is no caller")
        except x509.ExtensionNotFound:
            pass
        if not _for_clients(cert):
            raise IdentityError(
                "the token's certificate is not for client authentication (no clientAuth extended key usage)"
            )


# --- servers --------------------------------------------------------------------------------------------


def _refusal(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    return grpc.unary_unary_rpc_method_handler(refuse)


class IdentityInterceptor(grpc.aio.ServerInterceptor):
    """Lets an internal RPC through only with a valid token of a caller `permissions` allows on the method.

    `permissions`: full method name -> the callers allowed (the serving spec's method_permissions, or
    mars.topology.PERMISSIONS for every stage). A gRPC service with a method there is internal: its
    methods not there are refused to everyone; other services (the public ingress, health, reflection)
    pass. `verifier` None (no identity CA configured) with `required` refuses every internal call: a stage left
    without its CA fails closed. `required` False lets everything through (a laptop setting, warned at start).
    """

    def __init__(
        self,
        verifier: IdentityVerifier | None,
        permissions: Mapping[str, frozenset[str]],
        required: bool = True,
        on_refusal: Callable[[str, str], None] = lambda method, code: None,
    ) -> None:
        self._verifier = verifier
        self._required = required
        self._permissions = permissions
        self._internal = frozenset(service_of(method) for method in permissions)
        self._on_refusal = on_refusal

    def check(self, method: str, metadata: Any) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may go on, else the status and message to refuse it with."""
        service = service_of(method)
        if not self._required or service not in self._internal:
            return None
        if self._verifier is None:
            return grpc.StatusCode.UNAUTHENTICATED, "this service has no identity CA (MARS_IDENTITY_CA_FILE)"
        token = next((str(v) for k, v in metadata or () if k == IDENTITY_METADATA), None)
        if token is None:
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                f"{service} is internal: the call needs a service identity",
            )
        try:
            caller = self._verifier.verify(token, method)
        except IdentityError as exc:
            return grpc.StatusCode.UNAUTHENTICATED, f"service identity refused: {exc}"
        if caller not in self._permissions.get(method, frozenset()):
            return grpc.StatusCode.PERMISSION_DENIED, f"{caller!r} may not call {method}"
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        refused = self.check(method, handler_call_details.invocation_metadata)
        if refused is None:
            return await continuation(handler_call_details)
        code, message = refused
        log.info("refused %s: %s: %s", method, code.name, message)
        self._on_refusal(method, code.name)
        return _refusal(code, message)


# --- callers --------------------------------------------------------------------------------------------


def _with_token(metadata: Any, identity: CallerIdentity, method: str | bytes) -> list[tuple[str, str]]:
    name = method.decode() if isinstance(method, bytes) else method
    return [*(metadata or ()), (IDENTITY_METADATA, identity.token(name))]


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _SyncDetails(_CallDetails, grpc.ClientCallDetails):
    pass


class IdentityClientInterceptor(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Adds the caller's token to each call of a blocking channel."""

    def __init__(self, identity: CallerIdentity) -> None:
        self._identity = identity

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        d = client_call_details
        details = _SyncDetails(
            d.method,
            d.timeout,
            _with_token(d.metadata, self._identity, d.method),
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )
        return continuation(details, request)


class IdentityAioClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the caller's token to each call of an asyncio channel."""

    def __init__(self, identity: CallerIdentity) -> None:
        self._identity = identity

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        d = client_call_details
        details = grpc.aio.ClientCallDetails(
            d.method,
            d.timeout,
            _with_token(d.metadata, self._identity, d.method),
            d.credentials,
            d.wait_for_ready,
        )
        return await continuation(details, request)


def with_identity(channel: grpc.Channel, identity: CallerIdentity | None) -> grpc.Channel:
    """`channel` carrying `identity` on every call (unchanged when None: the stage will refuse it)."""
    if identity is None:
        return channel
    return grpc.intercept_channel(channel, IdentityClientInterceptor(identity))
