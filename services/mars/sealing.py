"""Crypto-shredding of turn events: the fields marked `(mars.v1.user_text)` in events.proto (a turn's text,
an answer, memory blocks, feedback comments, streamed tokens) travel on Kafka sealed with the user's data
key, and forgetting the user deletes the key, so that the text already on the topics (which Kafka cannot
delete record by record) can no longer be read by anyone.

Pure functions here; the keys themselves (wrapped by the master key, stored in Postgres) are
mars.data_keys. A sealed field is "v2:" and the base64 of a 12-byte nonce and the AES-GCM ciphertext of its
UTF-8 text; the associated data binds it to the key, the turn, its tenant and user, and the field, so a
sealed value moved to another turn's event, another user's or another field does not open. (Values sealed
before v2, bare base64 bound to key and turn only, still open: they are on topics already.) An event's
TurnEnvelope.data_key_id says which key sealed it ("" = plaintext); mars.data_keys also checks that the key
belongs to the envelope's tenant and user before opening anything with it.
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
from collections.abc import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from mars.v1 import events_pb2 as ev

KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12


class SealError(ValueError):
    """A sealed field that does not open with its key: tampered, truncated or sealed for another turn."""


def new_key() -> bytes:
    return AESGCM.generate_key(bit_length=KEY_BYTES * 8)


def _is_text(field: FieldDescriptor) -> bool:
    return bool(field.GetOptions().Extensions[ev.user_text])


@functools.cache
def text_paths(descriptor: Descriptor) -> tuple[tuple[FieldDescriptor, Descriptor | None], ...]:
    """The fields of a message type to seal: (user_text string field, None) or (message field whose type
    holds such fields somewhere, its type). Computed once per type from the proto options."""
    out: list[tuple[FieldDescriptor, Descriptor | None]] = []
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_STRING and _is_text(field):
            out.append((field, None))
        elif field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type is not descriptor:
            if text_paths(field.message_type):
                out.append((field, field.message_type))
    return tuple(out)


def has_user_text(message_type: type[Message]) -> bool:
    return bool(text_paths(message_type.DESCRIPTOR))


def _map_text(msg: Message, fn: Callable[[str, str], str]) -> None:
    """Replace each non-empty user_text value v of `msg` (nested messages too) by fn(field's full name, v)."""
    for field, sub in text_paths(msg.DESCRIPTOR):
        repeated = field.is_repeated
        if sub is None:
            if repeated:
                values = getattr(msg, field.name)
                values[:] = [fn(field.full_name, v) if v else v for v in values]
            elif value := getattr(msg, field.name):
                setattr(msg, field.name, fn(field.full_name, value))
        elif repeated:
            for item in getattr(msg, field.name):
                _map_text(item, fn)
        elif msg.HasField(field.name):
            _map_text(getattr(msg, field.name), fn)


#: Marks a value sealed with the v2 associated data (base64 never holds ':').
V2 = "v2:"


def _aad(key_id: str, turn: ev.TurnEnvelope, field: str) -> bytes:
    return "\x1f".join(("v2", key_id, turn.turn_id, turn.tenant, turn.user_id, field)).encode()


def _aad_v1(key_id: str, turn_id: str) -> bytes:
    return f"{key_id}\x1f{turn_id}".encode()


def seal(event: Message, turn: ev.TurnEnvelope, key_id: str, key: AESGCM) -> Message:
    """A copy of `event` (whose envelope is `turn`) with every user_text field sealed with `key` and
    `data_key_id` set; `event` itself is left as it was."""
    sealed = type(event)()
    sealed.CopyFrom(event)

    def encrypt(field: str, text: str) -> str:
        nonce = os.urandom(NONCE_BYTES)
        ciphertext = key.encrypt(nonce, text.encode(), _aad(key_id, turn, field))
        return V2 + base64.b64encode(nonce + ciphertext).decode("ascii")

    _map_text(sealed, encrypt)
    sealed.turn.data_key_id = key_id  # type: ignore[attr-defined]
    return sealed


def unseal(event: Message, key: AESGCM) -> None:
    """Open every user_text field of a sealed `event` in place (its envelope keeps data_key_id, so that what
    a stage publishes from it is sealed with the same key). SealError when a field does not open."""
    turn: ev.TurnEnvelope = event.turn  # type: ignore[attr-defined]

    def decrypt(field: str, value: str) -> str:
        v2 = value.startswith(V2)
        aad = _aad(turn.data_key_id, turn, field) if v2 else _aad_v1(turn.data_key_id, turn.turn_id)
        try:
            raw = base64.b64decode(value.removeprefix(V2).encode("ascii"), validate=True)
            return key.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], aad).decode()
        except (InvalidTag, ValueError, binascii.Error, UnicodeError) as exc:
            raise SealError(
                f"a sealed text field of turn {turn.turn_id} does not open with data key {turn.data_key_id}"
            ) from exc

    _map_text(event, decrypt)


def master_key_id(master: bytes) -> str:
    """A master key's public name (stored beside each data key it wraps): a digest that reveals nothing of
    the key, so a process can tell which of its master keys opens a row, and `mars keys rotate` which rows
    still wait for the new one."""
    import hashlib

    return hashlib.sha256(b"mars master key id\x00" + master).hexdigest()[:16]


def wrap(master: AESGCM, key_id: str, tenant: str, user_id: str, key: bytes) -> bytes:
    """A data key encrypted by the master key (what Postgres stores), bound to its id and owner."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + master.encrypt(nonce, key, f"{key_id}\x1f{tenant}\x1f{user_id}".encode())


def unwrap(master: AESGCM, key_id: str, tenant: str, user_id: str, wrapped: bytes) -> bytes:
    try:
        return master.decrypt(
            wrapped[:NONCE_BYTES], wrapped[NONCE_BYTES:], f"{key_id}\x1f{tenant}\x1f{user_id}".encode()
        )
    except InvalidTag as exc:
        raise SealError(
            f"data key {key_id} does not open with this master key (MARS_MASTER_KEY_FILE differs from the "
            "one that wrapped it)"
        ) from exc


def parse_master_key(text: str) -> bytes:
    """The master key from its file or variable: 32 bytes as base64 (what `mars keys master` prints)."""
    try:
        key = base64.b64decode(text.strip().encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeError) as exc:
        raise ValueError(
            "the master key must be 32 bytes in base64 (make one with `mars keys master`)"
        ) from exc
    if len(key) != KEY_BYTES:
        raise ValueError(f"the master key must be {KEY_BYTES} bytes in base64, got {len(key)} bytes")
    return key


def master_key_text() -> str:
    """A new master key, as its file holds it."""
    return base64.b64encode(new_key()).decode("ascii") + "\n"
