"""API keys: generation, hashing, parsing the bearer metadata, scope, and the verifier's cache."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from mars import auth
from mars.auth import PermissionDenied, Principal, StoredKey, Unauthenticated


def test_generated_keys_are_random_prefixed_and_carry_their_id() -> None:
    keys = [auth.generate_key() for _ in range(200)]
    assert len({k.key for k in keys}) == 200
    for k in keys:
        assert k.key.startswith("mars_") and len(k.key) == 5 + 43
        assert k.key_id == k.key[5:13] == auth.key_id_of(k.key)
        assert auth.key_digest(k.key) == hashlib.sha256(k.key.encode()).digest()


def test_key_ids_never_read_as_command_line_options() -> None:
    """`mars tenant revoke KEY_ID`: an id starting with '-' was taken for an option (1 key in 32)."""
    from mars_tools.cli import build_parser

    ids = [auth.generate_key().key_id for _ in range(3000)]
    assert all(i[0].isalnum() for i in ids)
    assert {i[1] for i in ids} & {"-", "_"}  # the rest of the id is still urlsafe base64
    args = build_parser().parse_args(["tenant", "revoke", "--", "-3jt0A7E"])  # an older key's id
    assert args.key_id == "-3jt0A7E"


@pytest.mark.parametrize(
    "bad", ["", "mars_short", "sk-" + "a" * 43, "mars_" + "a" * 42 + "!", "mars_" + "a" * 44]
)
def test_malformed_keys_are_unauthenticated(bad: str) -> None:
    with pytest.raises(Unauthenticated, match="malformed"):
        auth.key_id_of(bad)


def test_bearer_token_from_metadata() -> None:
    assert auth.bearer_token([("x-other", "1"), ("authorization", "Bearer  mars_abc ")]) == "mars_abc"
    assert auth.bearer_token([("Authorization", b"bearer k")]) == "k"
    with pytest.raises(Unauthenticated, match="missing API key"):
        auth.bearer_token([("x-other", "1")])
    with pytest.raises(Unauthenticated, match="missing API key"):
        auth.bearer_token(None)
    with pytest.raises(Unauthenticated, match="Bearer"):
        auth.bearer_token([("authorization", "Basic dXNlcjpwdw==")])


def _stored(key: str, revoked: bool = False, user: str | None = None) -> StoredKey:
    return StoredKey(auth.key_id_of(key), auth.key_digest(key), "acme", user, False, revoked)


def test_check_stored_compares_digests_and_refuses_revoked_keys() -> None:
    good = auth.generate_key().key
    assert auth.check_stored(_stored(good), auth.key_digest(good)) == Principal(auth.key_id_of(good), "acme")
    other = good[:13] + ("A" if good[13] != "A" else "B") + good[14:]  # same key id, another key
    with pytest.raises(Unauthenticated, match="invalid or revoked"):
        auth.check_stored(_stored(good), auth.key_digest(other))
    with pytest.raises(Unauthenticated, match="invalid or revoked"):
        auth.check_stored(_stored(good, revoked=True), auth.key_digest(good))
    with pytest.raises(Unauthenticated, match="invalid or revoked"):
        auth.check_stored(None, auth.key_digest(good))


def test_tenant_comes_from_the_key() -> None:
    p = Principal("k1", "acme")
    assert auth.authorize(p, "", "u1") == ("acme", "u1")
    assert auth.authorize(p, "acme", "u2") == ("acme", "u2")
    with pytest.raises(PermissionDenied, match="acts for tenant 'acme', not 'globex'"):
        auth.authorize(p, "globex", "u1")


def test_user_scoped_keys_act_for_their_user_only() -> None:
    p = Principal("k1", "acme", user_id="alice")
    assert auth.authorize(p, "", "") == ("acme", "alice")
    assert auth.authorize(p, "acme", "alice") == ("acme", "alice")
    with pytest.raises(PermissionDenied, match="user 'alice' only, not 'bob'"):
        auth.authorize(p, "acme", "bob")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_verifier_caches_outcomes_for_the_ttl_then_sees_revocation() -> None:
    key = auth.generate_key().key
    table = {auth.key_id_of(key): _stored(key)}
    lookups: list[str] = []

    async def lookup(key_id: str) -> StoredKey | None:
        lookups.append(key_id)
        return table.get(key_id)

    clock = FakeClock()
    verifier = auth.KeyVerifier(lookup, ttl_s=5.0, clock=clock)

    async def run() -> None:
        assert (await verifier.verify(key)).tenant == "acme"
        assert (await verifier.verify(key)).tenant == "acme"
        assert len(lookups) == 1  # the second came from the cache
        table[auth.key_id_of(key)] = _stored(key, revoked=True)
        clock.now += 4.9
        assert (await verifier.verify(key)).tenant == "acme"  # still cached: revocation within the TTL
        clock.now += 0.2
        with pytest.raises(Unauthenticated):
            await verifier.verify(key)
        with pytest.raises(Unauthenticated):  # a bad key's outcome is cached too
            await verifier.verify(key)
        assert len(lookups) == 2
        wrong = key[:13] + ("A" if key[13] != "A" else "B") + key[14:]
        with pytest.raises(Unauthenticated):
            await verifier.verify(wrong)  # same id, other digest: its own entry, its own lookup
        assert len(lookups) == 3

    asyncio.run(run())


def test_verifier_cache_stays_bounded() -> None:
    async def lookup(key_id: str) -> StoredKey | None:
        return None

    clock = FakeClock()
    verifier = auth.KeyVerifier(lookup, ttl_s=60.0, clock=clock, max_entries=10)

    async def run() -> None:
        for _ in range(50):
            with pytest.raises(Unauthenticated):
                await verifier.verify(auth.generate_key().key)
        assert len(verifier._cache) <= 10

    asyncio.run(run())


def test_a_known_key_outlives_a_store_outage_for_the_grace_only() -> None:
    key = auth.generate_key().key
    down = [False]

    async def lookup(key_id: str) -> StoredKey | None:
        if down[0]:
            raise ConnectionError("postgres restarting")
        return _stored(key)

    clock = FakeClock()
    verifier = auth.KeyVerifier(lookup, ttl_s=5.0, clock=clock, stale_grace_s=30.0)

    async def run() -> None:
        await verifier.verify(key)
        down[0] = True
        clock.now += 20
        assert (await verifier.verify(key)).tenant == "acme"  # expired but within the grace
        with pytest.raises(ConnectionError):
            await verifier.verify(auth.generate_key().key)  # never seen: the outage shows
        clock.now += 20
        with pytest.raises(ConnectionError):
            await verifier.verify(key)

    asyncio.run(run())
