"""Per-user data keys for sealing event text (mars.sealing), kept in Postgres wrapped by the master key.

One key per (tenant, user_id), made by the ingress at the user's first turn (or feedback) after the last
forget; every stage reads it by id (cached for MARS_DATA_KEY_CACHE_S). `mars.forget` deletes the row: the
user's sealed text on every topic is then unreadable, and a turn of the user still in flight is dropped by
the first stage that cannot find the key. A key cached by a running process before the forget stays usable
there until its cache entry expires (ingress and memory drop it at once, on the UserForgotten event).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from google.protobuf.message import Message

from mars import sealing
from mars.config import ServiceSettings
from mars.v1 import events_pb2 as ev

DATA_KEYS_SCHEMA = """
CREATE TABLE IF NOT EXISTS user_data_keys (
    key_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    user_id TEXT NOT NULL,
    wrapped BYTEA NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    UNIQUE (tenant, user_id)
)
"""
#: Which master key wrapped a row (mars.sealing.master_key_id); '' for rows from before rotation existed.
DATA_KEYS_MASTER_ID = "ALTER TABLE user_data_keys ADD COLUMN IF NOT EXISTS master_key_id TEXT NOT NULL DEFAULT ''"

_BY_ID = "SELECT tenant, user_id, wrapped, master_key_id FROM user_data_keys WHERE key_id = %s"
_BY_USER = "SELECT key_id, wrapped, master_key_id FROM user_data_keys WHERE tenant = %s AND user_id = %s"
_CREATE = (
    "INSERT INTO user_data_keys (key_id, tenant, user_id, wrapped, master_key_id) VALUES (%s, %s, %s, %s, %s) "
    "ON CONFLICT (tenant, user_id) DO NOTHING"
)


class MasterKeys:
    """The master key that wraps new data keys, and the previous ones still accepted while `mars keys
    rotate` re-wraps their rows (MARS_PREVIOUS_MASTER_KEY_FILE): each row names the key that wrapped it."""

    def __init__(self, current: bytes, previous: tuple[bytes, ...] = ()) -> None:
        self.current_id = sealing.master_key_id(current)
        self._keys = {sealing.master_key_id(k): AESGCM(k) for k in (*previous, current)}
        self._current = self._keys[self.current_id]

    def opens_with_current(self, key_id: str, tenant: str, user_id: str, wrapped: bytes, master_id: str) -> bool:
        """Whether the current master key alone opens the row (once rotated, the previous key can go)."""
        if master_id:
            return master_id == self.current_id
        try:
            sealing.unwrap(self._current, key_id, tenant, user_id, wrapped)
            return True
        except sealing.SealError:
            return False

    def wrap(self, key_id: str, tenant: str, user_id: str, key: bytes) -> tuple[bytes, str]:
        """The data key wrapped by the current master key, and that key's id."""
        return sealing.wrap(self._current, key_id, tenant, user_id, key), self.current_id

    def unwrap(self, key_id: str, tenant: str, user_id: str, wrapped: bytes, master_id: str) -> bytes:
        """The data key of a row; SealError when no master key held here opens it."""
        if master_id and master_id not in self._keys:
            raise sealing.SealError(
                f"data key {key_id} is wrapped by master key {master_id}, which this process does not hold "
                "(MARS_MASTER_KEY_FILE, or MARS_PREVIOUS_MASTER_KEY_FILE while rotating)"
            )
        # A row from before master_key_id existed names none: the current key first, then the others.
        ids = [master_id] if master_id else [self.current_id, *(k for k in self._keys if k != self.current_id)]
        for mid in ids[:-1]:
            try:
                return sealing.unwrap(self._keys[mid], key_id, tenant, user_id, wrapped)
            except sealing.SealError:
                continue
        return sealing.unwrap(self._keys[ids[-1]], key_id, tenant, user_id, wrapped)


class Forgotten(Exception):
    """The event's data key is gone: its user was forgotten, and the event's text with them."""

    def __init__(self, key_id: str) -> None:
        super().__init__(f"data key {key_id} was deleted (its user was forgotten)")
        self.key_id = key_id


def master_keys(settings: ServiceSettings) -> MasterKeys | None:
    """The current master key with the previous one (MARS_PREVIOUS_MASTER_KEY_FILE) when rotating; None
    without a master key. ValueError names the variable when a key is malformed or its file unreadable."""
    current = master_key(settings)
    if current is None:
        if settings.previous_master_key_file:
            raise ValueError("MARS_PREVIOUS_MASTER_KEY_FILE is set but no MARS_MASTER_KEY_FILE: set both")
        return None
    if not settings.previous_master_key_file:
        return MasterKeys(current)
    return MasterKeys(current, (_key_file(settings.previous_master_key_file, "MARS_PREVIOUS_MASTER_KEY_FILE"),))


def _key_file(path: str, variable: str) -> bytes:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{variable} {path}: {exc.strerror}") from exc
    try:
        return sealing.parse_master_key(text)
    except ValueError as exc:
        raise ValueError(f"{variable} {path}: {exc}") from exc


def master_key(settings: ServiceSettings) -> bytes | None:
    """The master key from MARS_MASTER_KEY_FILE or MARS_MASTER_KEY; None when neither is set (events then
    travel in plaintext). ValueError names the variable when the key is malformed or the file unreadable."""
    if settings.master_key_file:
        return _key_file(settings.master_key_file, "MARS_MASTER_KEY_FILE")
    if secret := settings.master_key.get_secret_value():
        try:
            return sealing.parse_master_key(secret)
        except ValueError as exc:
            raise ValueError(f"MARS_MASTER_KEY: {exc}") from exc
    return None


@dataclass
class _Entry:
    key: AESGCM | None  # None: no such key (deleted)
    tenant: str
    user_id: str
    at: float


class _KeyCache:
    """Keys by id and users' key ids, each kept `cache_s`; the part both keyrings share."""

    def __init__(self, master: bytes | MasterKeys, cache_s: float) -> None:
        self._masters = master if isinstance(master, MasterKeys) else MasterKeys(master)
        self._cache_s = cache_s
        self._by_id: dict[str, _Entry] = {}
        self._by_user: dict[tuple[str, str], tuple[str, float]] = {}

    def _cached(self, key_id: str) -> _Entry | None:
        entry = self._by_id.get(key_id)
        if entry is not None and time.monotonic() - entry.at < self._cache_s:
            return entry
        return None

    def _cached_user(self, tenant: str, user_id: str) -> str | None:
        hit = self._by_user.get((tenant, user_id))
        if hit is not None and time.monotonic() - hit[1] < self._cache_s:
            return hit[0]
        return None

    def _store(self, key_id: str, row: Any) -> _Entry:
        if len(self._by_id) > 100_000:
            self._by_id.clear()
        if row is None:
            entry = _Entry(None, "", "", time.monotonic())
        else:
            tenant, user_id, wrapped, master_id = str(row[0]), str(row[1]), bytes(row[2]), str(row[3])
            key = self._masters.unwrap(key_id, tenant, user_id, wrapped, master_id)
            entry = _Entry(AESGCM(key), tenant, user_id, time.monotonic())
            self._by_user[tenant, user_id] = (key_id, entry.at)
        self._by_id[key_id] = entry
        return entry

    def _new_row(self, tenant: str, user_id: str) -> tuple[str, str, str, bytes, str]:
        key_id = secrets.token_hex(12)
        wrapped, master_id = self._masters.wrap(key_id, tenant, user_id, sealing.new_key())
        return key_id, tenant, user_id, wrapped, master_id

    def forget_user(self, tenant: str, user_id: str) -> None:
        """Drop the user's keys from this process (a UserForgotten event or this process's own forget)."""
        self._by_user.pop((tenant, user_id), None)
        for key_id in [k for k, e in self._by_id.items() if (e.tenant, e.user_id) == (tenant, user_id)]:
            del self._by_id[key_id]


class Keyring(_KeyCache):
    """The data keys of a service (async, over its connection pool)."""

    def __init__(self, pool: Any, master: bytes | MasterKeys, cache_s: float = 60.0) -> None:
        super().__init__(master, cache_s)
        self._pool = pool

    async def key(self, key_id: str) -> AESGCM | None:
        return (await self._entry(key_id)).key

    async def _entry(self, key_id: str) -> _Entry:
        entry = self._cached(key_id)
        if entry is None:
            async with self._pool.connection() as conn:
                cur = await conn.execute(_BY_ID, (key_id,))
                entry = self._store(key_id, await cur.fetchone())
        return entry

    async def for_user(self, tenant: str, user_id: str) -> str:
        """The id of the user's data key, made now if the user has none (the ingress, before publishing)."""
        if (key_id := self._cached_user(tenant, user_id)) is not None:
            return key_id
        async with self._pool.connection() as conn:
            for _ in range(3):  # a concurrent first turn of the same user may win the insert
                cur = await conn.execute(_BY_USER, (tenant, user_id))
                row = await cur.fetchone()
                if row is not None:
                    self._store(str(row[0]), (tenant, user_id, row[1], row[2]))
                    return str(row[0])
                await conn.execute(_CREATE, self._new_row(tenant, user_id))
        raise RuntimeError(f"no data key could be made for {tenant}/{user_id}")

    async def seal(self, event: Message, turn: ev.TurnEnvelope) -> Message:
        """`event` as it goes on the topic: sealed with the key its envelope names (as is when it names none
        or holds no user text). Forgotten when that key is gone."""
        if not turn.data_key_id or not sealing.has_user_text(type(event)):
            return event
        key = _owned(turn, await self._entry(turn.data_key_id))
        return sealing.seal(event, turn, turn.data_key_id, key)

    async def unseal(self, event: Message) -> None:
        """Open a consumed event in place. Forgotten when its key is gone, SealError when it does not open
        or the key is not the envelope's user's."""
        if is_sealed(event):
            turn: ev.TurnEnvelope = event.turn  # type: ignore[attr-defined]
            sealing.unseal(event, _owned(turn, await self._entry(turn.data_key_id)))


class SyncKeyring(_KeyCache):
    """The data keys for tools reading topics (replay, eval), over one psycopg connection."""

    def __init__(self, conn: Any, master: bytes | MasterKeys, cache_s: float = 300.0) -> None:
        super().__init__(master, cache_s)
        self._conn = conn

    def key(self, key_id: str) -> AESGCM | None:
        return self._entry(key_id).key

    def _entry(self, key_id: str) -> _Entry:
        entry = self._cached(key_id)
        if entry is None:
            entry = self._store(key_id, self._conn.execute(_BY_ID, (key_id,)).fetchone())
        return entry

    def for_user(self, tenant: str, user_id: str) -> str:
        """The id of the user's data key, made now if the user has none (harnesses writing events)."""
        for _ in range(3):
            row = self._conn.execute(_BY_USER, (tenant, user_id)).fetchone()
            if row is not None:
                self._store(str(row[0]), (tenant, user_id, row[1], row[2]))
                return str(row[0])
            self._conn.execute(_CREATE, self._new_row(tenant, user_id))
        raise RuntimeError(f"no data key could be made for {tenant}/{user_id}")

    def seal(self, event: Message) -> Message:
        """`event` sealed with its user's data key (made now if the user has none), as the ingress would
        publish it: for harnesses that write turn events straight to a stack whose services seal (they take
        no plaintext text). As is when the event holds no user text."""
        if not sealing.has_user_text(type(event)):
            return event
        turn: ev.TurnEnvelope = event.turn  # type: ignore[attr-defined]
        key_id = self.for_user(turn.tenant, turn.user_id)
        return sealing.seal(event, turn, key_id, _owned(turn, self._entry(key_id)))

    def unseal(self, event: Message) -> None:
        if is_sealed(event):
            turn: ev.TurnEnvelope = event.turn  # type: ignore[attr-defined]
            sealing.unseal(event, _owned(turn, self._entry(turn.data_key_id)))


def _owned(turn: ev.TurnEnvelope, entry: _Entry) -> AESGCM:
    """The key of a looked-up entry, if it is the envelope's user's: Forgotten when the key is gone,
    SealError when it is another user's (an event that names someone else's key id: whoever can write to
    the topics could otherwise have a stage open user B's text as user A's)."""
    if entry.key is None:
        raise Forgotten(turn.data_key_id)
    if (entry.tenant, entry.user_id) != (turn.tenant, turn.user_id):
        raise sealing.SealError(
            f"data key {turn.data_key_id} is not the key of the turn's tenant and user ({turn.turn_id})"
        )
    return entry.key


def is_sealed(event: Message) -> bool:
    turn: ev.TurnEnvelope = event.turn  # type: ignore[attr-defined]
    return bool(turn.data_key_id) and sealing.has_user_text(type(event))


def tool_keyring(warn: Callable[[str], None], settings: ServiceSettings | None = None) -> SyncKeyring | None:
    """The data keys for a tool reading topics or exported logs (replay, redrive), from the MARS_*
    environment (MARS_MASTER_KEY_FILE and MARS_POSTGRES_DSN, as the services have them). None when no master
    key is configured, or (after `warn` says why) when the keys cannot be reached: sealed text then stays
    sealed and forgotten users' turns cannot be told apart."""
    import psycopg

    settings = settings or ServiceSettings()
    try:
        master = master_keys(settings)
        if master is None:
            return None
        conn = psycopg.connect(settings.postgres_dsn, autocommit=True, connect_timeout=5)
    except (ValueError, psycopg.Error) as exc:
        warn(f"cannot open the users' data keys ({exc}); sealed text stays sealed")
        return None
    return SyncKeyring(conn, master)
