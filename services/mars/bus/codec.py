"""Turn events as records: the event type on each topic, the checks a record must pass before a stage takes
it (envelope, key, wire types, seal, text size), and how a failure is classed (the event's fault, or
infrastructure trouble that passes)."""

from __future__ import annotations

from typing import Any, Protocol

from aiokafka import ConsumerRecord
from aiokafka.errors import (
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
)
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from mars.config import (
    SCHEMA_VERSION,
    TOPIC_FEEDBACK,
    TOPIC_GENERATED,
    TOPIC_JUDGED,
    TOPIC_MEMORY_COMMITTED,
    TOPIC_RECEIVED,
    TOPIC_ROUTED,
    TOPIC_STATE,
    TOPIC_TOKENS,
    TOPIC_VIEW,
)
from mars.data_keys import Forgotten, Keyring, is_sealed
from mars.sealing import SealError, has_user_text
from mars.v1 import events_pb2 as ev


class PoisonEvent(Exception):
    """An event that can never be processed (bad content); it goes straight to the dead-letter topic."""


#: Kafka's refusals of a record for its size: retrying the same record can never get it through.
TOO_LARGE = (MessageSizeTooLargeError, RecordTooLargeError, RecordListTooLargeError)


#: The event type on each turn-event topic (base names): every topic whose events carry a TurnEnvelope.
TOPIC_EVENTS: dict[str, type[Message]] = {
    TOPIC_RECEIVED: ev.TurnReceived,
    TOPIC_STATE: ev.StateEstimated,
    TOPIC_VIEW: ev.ViewBuilt,
    TOPIC_ROUTED: ev.Routed,
    TOPIC_GENERATED: ev.Generated,
    TOPIC_TOKENS: ev.TokenChunk,
    TOPIC_JUDGED: ev.Judged,
    TOPIC_FEEDBACK: ev.Feedback,
    TOPIC_MEMORY_COMMITTED: ev.MemoryCommitted,
}


def is_transient(exc: BaseException) -> bool:
    """Infrastructure trouble that passes (Postgres restarting, the broker stalled): the event is retried
    until it goes through, never dead-lettered for it. A record too large for the broker is not: it would
    be retried forever and hold up its partition."""
    import psycopg
    from psycopg_pool import PoolTimeout

    if isinstance(exc, (*TOO_LARGE, psycopg.errors.ProgramLimitExceeded)):
        return False
    return isinstance(exc, psycopg.OperationalError | PoolTimeout | KafkaError | ConnectionError)


def poison_reason(exc: BaseException) -> str | None:
    """Why a handler's failure is the event's own fault (its content can never be processed: a retry
    would fail the same way), or None. Such an event is dead-lettered at once with this reason."""
    import psycopg

    if isinstance(exc, TOO_LARGE):
        return f"the stage's output for this event is too large to publish ({type(exc).__name__}: {exc})"
    if isinstance(exc, psycopg.DataError | psycopg.errors.ProgramLimitExceeded):
        # SQLSTATE class 22 (NUL in text, numbers out of range, bad encodings) and 54 (a value too large
        # for an index row): deterministic, the same event fails the same way every time.
        return f"Postgres refused the event's data ({type(exc).__name__}: {exc})"
    return None


class TurnEvent(Protocol):
    @property
    def turn(self) -> ev.TurnEnvelope: ...


def event_key(turn: ev.TurnEnvelope) -> bytes:
    """All of a user's events share one key, hence one partition index in every topic."""
    return f"{turn.tenant}/{turn.user_id}".encode()


#: Longest turn_id, tenant, user_id or session_id an envelope may carry (ingress allows 128).
MAX_ID_CHARS = 256
#: Dead letters keep at most this much of the poison record's payload and key (a letter must stay well
#: under the broker's record size limit, 1 MiB by default, or it could never be published).
DEAD_LETTER_PAYLOAD_BYTES = 64 * 1024
DEAD_LETTER_KEY_BYTES = 1024
DEAD_LETTER_REASON_CHARS = 2000


def id_problem(name: str, value: str, required: bool = True) -> str | None:
    """What is wrong with an identifier (tenant, user_id, turn_id, session_id), or None. Postgres refuses
    NUL in text; control characters and unbounded lengths have no business in a key."""
    if not value:
        return f"{name} is missing" if required else None
    if len(value) > MAX_ID_CHARS:
        return f"{name} has {len(value)} characters; the limit is {MAX_ID_CHARS}"
    if "\x00" in value:
        return f"{name} contains a NUL character"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return f"{name} contains a control character"
    return None


def validate_envelope(turn: ev.TurnEnvelope) -> None:
    missing = [f for f in ("turn_id", "tenant", "user_id") if not getattr(turn, f)]
    if missing:
        raise PoisonEvent(f"envelope is missing {', '.join(missing)}")
    if turn.seq <= 0:
        raise PoisonEvent(f"envelope seq must be positive, got {turn.seq}")
    if turn.schema_version != SCHEMA_VERSION:
        raise PoisonEvent(f"unknown schema_version {turn.schema_version} (this build reads {SCHEMA_VERSION})")
    for name in ("turn_id", "tenant", "user_id", "session_id"):
        if (problem := id_problem(name, getattr(turn, name), required=False)) is not None:
            raise PoisonEvent(f"envelope {problem}")


def validate_key(key: bytes | None, turn: ev.TurnEnvelope) -> None:
    """A record's key is its envelope's tenant/user_id: a user's events share one partition, in order. A
    record keyed otherwise sits on the wrong partition (ordering and read-your-writes no longer hold)."""
    expected = event_key(turn)
    if key != expected:
        raise PoisonEvent(
            f"record key {clip(repr(key), 120)} does not match the envelope's tenant/user_id "
            f"{clip(repr(expected), 120)}"
        )


def wire_type_clash(event: Message) -> str | None:
    """A field whose number the message type knows but whose wire type differs (protobuf parses it into
    the unknown fields, silently): the record is another message type (or another schema), not this one.
    Unknown field numbers alone are not: a newer producer may have added fields."""
    for msg in (event, getattr(event, "turn", None)):
        if not isinstance(msg, Message):
            continue
        known = msg.DESCRIPTOR.fields_by_number
        for field in UnknownFieldSet(msg):
            if field.field_number in known:
                name = known[field.field_number].name
                return (
                    f"field {field.field_number} ({msg.DESCRIPTOR.name}.{name}) has the wrong wire type "
                    f"{field.wire_type}: not a {event.DESCRIPTOR.full_name} (wrong message type on this topic?)"
                )
    return None


#: Top-level text fields of the stage events (user text, answers, comments), bounded by
#: ServiceSettings.max_event_text_chars.
TEXT_FIELDS = ("text", "query", "comment")


def oversized_text(event: Message, limit: int) -> str | None:
    """Why an event's text is too long for the stages to take on (embedding, storing and prompting a
    text costs in proportion to it), or None."""
    for name in TEXT_FIELDS:
        if name in event.DESCRIPTOR.fields_by_name:
            size = len(getattr(event, name))
            if size > limit:
                return f"{name} has {size} characters; the limit is {limit} (MARS_MAX_EVENT_TEXT_CHARS)"
    return None


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def printable(text: str, limit: int) -> str:
    """A reason or id fit for a dead letter and for Postgres: NUL and other control characters escaped,
    the length bounded."""
    if any(ord(c) < 0x20 and c not in "\n\t" for c in text):
        text = "".join(c if ord(c) >= 0x20 or c in "\n\t" else f"\\x{ord(c):02x}" for c in text)
    return clip(text, limit)



class Undeliverable(Exception):
    """A record no handler gets: dead-lettered with its kind (mars.metrics.DEAD_LETTER_KINDS), or, of kind
    "forgotten", skipped."""

    def __init__(self, kind: str, reason: str, turn_id: str) -> None:
        super().__init__(reason)
        self.kind, self.reason, self.turn_id = kind, reason, turn_id


async def decode_record(
    record: ConsumerRecord[Any, Any],
    message_type: type[Message],
    requires_envelope: bool,
    keyring: Keyring | None,
    max_text_chars: int,
) -> tuple[Message, str]:
    """The record's event, checked and unsealed, and its turn id; Undeliverable says why not. `keyring`:
    the process's data keys (None: it seals nothing and takes no sealed event)."""
    turn_id = ""
    kind = "undecodable"  # what the check that fails found wrong (mars.dead_letters reason_kind)
    name = message_type.__name__
    try:
        event = message_type()
        try:
            event.ParseFromString(record.value or b"")
        except Exception as exc:  # DecodeError (bad UTF-8 in a string, truncation, ...) or worse
            raise PoisonEvent(f"cannot decode {name}: {exc}") from exc
        if requires_envelope:
            kind = "invalid_envelope"
            turn = event.turn  # type: ignore[attr-defined]
            turn_id = turn.turn_id
            validate_envelope(turn)
            validate_key(record.key, turn)
        if (clash := wire_type_clash(event)) is not None:
            kind = "undecodable"
            raise PoisonEvent(f"cannot decode {name}: {clash}")
        if requires_envelope and keyring is None and is_sealed(event):
            kind = "unsealable"
            raise PoisonEvent(
                "the event's text is sealed with a data key and this service has no master key "
                "(set MARS_MASTER_KEY_FILE as for the other services)"
            )
        if requires_envelope and keyring is not None:
            if not event.turn.data_key_id and has_user_text(message_type):  # type: ignore[attr-defined]
                # A service that seals takes no plaintext: anyone who may write the topic could otherwise
                # plant text for any user. The reason names the missing seal, never the text.
                kind = "unsealed"
                raise PoisonEvent(
                    f"unsealed {name}: its envelope names no data key, and this "
                    "service takes user text only sealed with the user's data key"
                )
            if is_sealed(event):
                kind = "unsealable"
                try:
                    await keyring.unseal(event)  # a database hiccup raises: retried
                except SealError as exc:
                    raise PoisonEvent(str(exc)) from exc
        if (oversized := oversized_text(event, max_text_chars)) is not None:
            kind = "oversized_text"
            raise PoisonEvent(oversized)
    except PoisonEvent as exc:
        raise Undeliverable(kind, str(exc), turn_id) from exc
    except Forgotten as exc:
        raise Undeliverable("forgotten", "", turn_id) from exc
    return event, turn_id
