"""Per-tenant API keys for the public ingress: generation, hashing, storage, verification and scope.

A key is `mars_` + 32 random bytes (urlsafe base64). Only its SHA-256 is stored, beside a short key id
(the first characters of the key after `mars_`: not secret, shown in listings and logs so an operator can
tell which key a caller used or which one leaked). The tenant always comes from the key, never from the
request; a key may be limited to one end user, and may carry the admin flag (tenant administration such as
ForgetUser).

Why SHA-256 and not bcrypt/scrypt/argon2: those slow hashes protect low-entropy secrets (passwords) from
offline guessing. A 256-bit random key cannot be guessed however fast the hash is, so a fast hash loses
nothing and keeps verification off the answer path's budget (microseconds, not ~100 ms per cold check).

Verification looks the key up by its id and compares the digests with `hmac.compare_digest` (constant
time), then caches the outcome by digest for a short TTL (`MARS_INGRESS_AUTH_CACHE_TTL_S`, 5 s): a revoked or
rotated key keeps working on a replica for at most that long.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

KEY_PREFIX = "mars_"
#: Random bytes in a key: 256 bits, out of reach of any guessing.
KEY_BYTES = 32
#: Characters of the key (after the prefix) that form its public id.
KEY_ID_CHARS = 8
#: What tenant and user ids may look like (the ingress validates turns with the same pattern). \Z, not $:
#: "$" also matches before a final newline, and "alice\n" would pass here and be dead-lettered by every stage.
ID_PATTERN = re.compile(r"^[A-Za-z0-9_.@:\-]{1,128}\Z")
_KEY_SHAPE = re.compile(r"^mars_[A-Za-z0-9_\-]{43}\Z")

MIGRATIONS = [
    # One row per key ever issued; revoked keys stay (revoked_at, replaced_by) for the audit trail.
    """
    CREATE TABLE IF NOT EXISTS ingress_api_keys (
        key_id TEXT PRIMARY KEY,
        key_sha256 BYTEA NOT NULL,
        tenant TEXT NOT NULL,
        user_id TEXT,
        admin BOOLEAN NOT NULL DEFAULT false,
        label TEXT NOT NULL DEFAULT '',
        created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
        revoked_at TIMESTAMPTZ,
        replaced_by TEXT
    )
    """,
    "CREATE INDEX IF NOT EXISTS ingress_api_keys_tenant ON ingress_api_keys (tenant)",
]

#: The advisory lock `mars.db.migrate` applies schemas under (the tenant commands take it too).
MIGRATION_LOCK = zlib.crc32(b"mars-migrations")


class AuthError(Exception):
    """A call that may not proceed; the message is safe to show to the caller."""


class Unauthenticated(AuthError):
    """No key, a malformed key, or one that is unknown or revoked."""


class PermissionDenied(AuthError):
    """A valid key asking for a tenant or user it does not act for."""


@dataclass(frozen=True)
class Principal:
    """Who a verified key acts for: one tenant, one user of it or any (user_id None), maybe as admin."""

    key_id: str
    tenant: str
    user_id: str | None = None
    admin: bool = False


@dataclass(frozen=True)
class StoredKey:
    """A key's row as the verifier needs it."""

    key_id: str
    digest: bytes
    tenant: str
    user_id: str | None
    admin: bool
    revoked: bool


@dataclass(frozen=True)
class NewKey:
    """A key just issued: `key` is shown once and never stored."""

    key_id: str
    key: str
    tenant: str
    user_id: str | None
    admin: bool


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    tenant: str
    user_id: str | None
    admin: bool
    label: str
    created_at: datetime
    revoked_at: datetime | None
    replaced_by: str | None


# --- pure parts ------------------------------------------------------------------------------------


def generate_key() -> NewKey:
    """A fresh random key (tenant fields empty; `issue` fills them). Its id never starts with '-' or '_':
    `mars tenant revoke -3jt0A7E` would read the id as an option (1 key in 32 had one)."""
    token = "-"
    while not token[0].isalnum():
        token = base64.urlsafe_b64encode(secrets.token_bytes(KEY_BYTES)).rstrip(b"=").decode()
    key = KEY_PREFIX + token
    return NewKey(key_id=key_id_of(key), key=key, tenant="", user_id=None, admin=False)


def key_id_of(key: str) -> str:
    """The public id of a well-formed key; Unauthenticated for anything that is not one."""
    if not _KEY_SHAPE.match(key):
        raise Unauthenticated("malformed API key (expected mars_ followed by 43 characters)")
    return key[len(KEY_PREFIX) : len(KEY_PREFIX) + KEY_ID_CHARS]


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The key of an `authorization: Bearer <key>` metadata entry; Unauthenticated when absent."""
    for name, value in metadata or ():
        if name.lower() != "authorization":
            continue
        text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("authorization metadata must be 'Bearer <API key>'")
        return token.strip()
    raise Unauthenticated(
        "missing API key: send gRPC metadata 'authorization: Bearer <key>' "
        "(an operator creates keys with `mars tenant create`)"
    )


def check_stored(stored: StoredKey | None, digest: bytes) -> Principal:
    """The principal of a presented key's digest against its stored row (looked up by key id)."""
    # compare_digest runs in constant time: how much of the digest matched does not show in the timing.
    if stored is None or not hmac.compare_digest(stored.digest, digest) or stored.revoked:
        raise Unauthenticated("invalid or revoked API key")
    return Principal(stored.key_id, stored.tenant, stored.user_id, stored.admin)


def _shown(value: str) -> str:
    return repr(value[:64])


def authorize(principal: Principal, tenant: str, user_id: str) -> tuple[str, str]:
    """The (tenant, user_id) a request may act as: the key's tenant (a request naming another is
    PermissionDenied; an empty one is filled from the key) and the request's user, which a user-scoped key
    must match (an empty one is filled from the key)."""
    if tenant and tenant != principal.tenant:
        raise PermissionDenied(
            f"API key {principal.key_id} acts for tenant {_shown(principal.tenant)}, "
            f"not {_shown(tenant)}; leave tenant empty to use the key's"
        )
    if principal.user_id is not None:
        if user_id and user_id != principal.user_id:
            raise PermissionDenied(
                f"API key {principal.key_id} acts for user {_shown(principal.user_id)} only, "
                f"not {_shown(user_id)}"
            )
        user_id = user_id or principal.user_id
    return principal.tenant, user_id


class KeyVerifier:
    """Verifies presented keys against the store, remembering each outcome (good or bad) for `ttl_s`.

    The cache is what keeps auth off the answer path's budget: a hit costs one SHA-256 and a dict lookup;
    a miss one indexed Postgres read. Entries are keyed by the full digest, so a wrong key that shares a
    key id with a good one never hits the good one's entry. Bad keys are cached too, so a caller
    hammering with a wrong key does not reach Postgres on every call. When the lookup itself fails
    (Postgres restarting), a key verified within `stale_grace_s` keeps working rather than failing every
    call of a known caller; an unknown key gets the lookup's error (the ingress answers UNAVAILABLE)."""

    def __init__(
        self,
        lookup: Callable[[str], Awaitable[StoredKey | None]],
        ttl_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = 10_000,
        stale_grace_s: float = 60.0,
    ) -> None:
        self._lookup = lookup
        self._ttl_s = ttl_s
        self._stale_grace_s = stale_grace_s
        self._clock = clock
        self._max_entries = max_entries
        self._cache: dict[bytes, tuple[float, Principal | Unauthenticated]] = {}

    async def verify(self, key: str) -> Principal:
        key_id = key_id_of(key)
        digest = key_digest(key)
        now = self._clock()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            outcome = hit[1]
        else:
            try:
                outcome = check_stored(await self._lookup(key_id), digest)
            except Unauthenticated as exc:
                outcome = exc
            except Exception:
                stale = hit is not None and hit[0] + self._stale_grace_s > now
                if hit is None or not stale or not isinstance(hit[1], Principal):
                    raise
                return hit[1]
            if len(self._cache) >= self._max_entries:
                self._evict(now)
            self._cache[digest] = (now + self._ttl_s, outcome)
        if isinstance(outcome, Unauthenticated):
            raise Unauthenticated(str(outcome))
        return outcome

    def forget_user(self, tenant: str, user_id: str) -> int:
        """Drop the remembered keys limited to one user (a forgotten user's keys are deleted: without this
        they would keep working here for up to `ttl_s`). Returns how many were dropped."""
        gone = [
            d
            for d, (_, outcome) in self._cache.items()
            if isinstance(outcome, Principal) and (outcome.tenant, outcome.user_id) == (tenant, user_id)
        ]
        for digest in gone:
            del self._cache[digest]
        return len(gone)

    def _evict(self, now: float) -> None:
        for digest in [d for d, (expires, _) in self._cache.items() if expires <= now]:
            del self._cache[digest]
        if len(self._cache) >= self._max_entries:  # all fresh: drop the oldest half
            for digest in list(self._cache)[: self._max_entries // 2]:
                del self._cache[digest]


# --- storage -----------------------------------------------------------------------------------------

_STORED_SQL = (
    "SELECT key_id, key_sha256, tenant, user_id, admin, revoked_at IS NOT NULL "
    "FROM ingress_api_keys WHERE key_id = %s"
)


def stored_from_row(row: tuple[Any, ...] | None) -> StoredKey | None:
    if row is None:
        return None
    return StoredKey(row[0], bytes(row[1]), row[2], row[3], bool(row[4]), bool(row[5]))


def pool_lookup(pool: Any) -> Callable[[str], Awaitable[StoredKey | None]]:
    """A KeyVerifier lookup over a psycopg AsyncConnectionPool."""

    async def lookup(key_id: str) -> StoredKey | None:
        async with pool.connection() as conn:
            cur = await conn.execute(_STORED_SQL, (key_id,))
            return stored_from_row(await cur.fetchone())

    return lookup


def ensure_schema(conn: Any) -> None:
    """Create the key table if missing (sync psycopg connection), under the migrations' advisory lock."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        for stmt in MIGRATIONS:
            conn.execute(stmt)


def _check_ids(tenant: str, user_id: str | None) -> None:
    if not ID_PATTERN.match(tenant):
        raise ValueError(f"tenant must match {ID_PATTERN.pattern}, got {tenant!r}")
    if user_id is not None and not ID_PATTERN.match(user_id):
        raise ValueError(f"user must match {ID_PATTERN.pattern}, got {user_id!r}")


def issue(conn: Any, tenant: str, user_id: str | None = None, admin: bool = False, label: str = "") -> NewKey:
    """Store a new key for `tenant` (sync psycopg connection; the caller's transaction if any)."""
    _check_ids(tenant, user_id)
    for _ in range(5):  # a key id collision (48 random bits) is astronomically rare; draw again
        new = generate_key()
        cur = conn.execute(
            "INSERT INTO ingress_api_keys (key_id, key_sha256, tenant, user_id, admin, label) "
            "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (key_id) DO NOTHING RETURNING key_id",
            (new.key_id, key_digest(new.key), tenant, user_id, admin, label),
        )
        if cur.fetchone() is not None:
            return NewKey(new.key_id, new.key, tenant, user_id, admin)
    raise RuntimeError("could not draw an unused key id")


def list_keys(conn: Any, tenant: str | None = None, include_revoked: bool = False) -> list[KeyInfo]:
    where, params = [], []
    if tenant:
        where.append("tenant = %s")
        params.append(tenant)
    if not include_revoked:
        where.append("revoked_at IS NULL")
    sql = (
        "SELECT key_id, tenant, user_id, admin, label, created_at, revoked_at, replaced_by "
        "FROM ingress_api_keys"
        + (" WHERE " + " AND ".join(where) if where else "")
        + " ORDER BY tenant, created_at"
    )
    return [KeyInfo(*row) for row in conn.execute(sql, params).fetchall()]


def revoke(conn: Any, key_id: str, replaced_by: str | None = None) -> bool:
    """Revoke a live key; False when there is no such live key."""
    cur = conn.execute(
        "UPDATE ingress_api_keys SET revoked_at = now(), replaced_by = %s "
        "WHERE key_id = %s AND revoked_at IS NULL RETURNING key_id",
        (replaced_by, key_id),
    )
    return cur.fetchone() is not None


def rotate(conn: Any, key_id: str) -> NewKey | None:
    """A new key with the old one's tenant, user, admin flag and label; the old one revoked. None when
    `key_id` is not a live key."""
    with conn.transaction():
        row = conn.execute(
            "SELECT tenant, user_id, admin, label FROM ingress_api_keys "
            "WHERE key_id = %s AND revoked_at IS NULL FOR UPDATE",
            (key_id,),
        ).fetchone()
        if row is None:
            return None
        new = issue(conn, row[0], row[1], bool(row[2]), row[3])
        revoke(conn, key_id, replaced_by=new.key_id)
        return new


def mint_key(
    dsn: str, tenant: str, user_id: str | None = None, admin: bool = False, label: str = ""
) -> NewKey:
    """Connect, make sure the key table exists, and issue a key (for tools and tests that own the
    pipeline's Postgres: the local stack, the harnesses, a re-drive's renamed tenants)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        ensure_schema(conn)
        return issue(conn, tenant, user_id, admin, label)
