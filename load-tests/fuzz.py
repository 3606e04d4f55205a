"""Fuzzing harness: malformed and adversarial events on every consumed topic, and hypothesis-generated
requests against the internal gRPC services, over a real local stack (Apache Kafka, Postgres, the
stand-in LLM, the six services).

    .venv/bin/python load-tests/fuzz.py --events 1000 --requests 10000 [--json OUT]
    .venv/bin/python load-tests/fuzz.py --rpcs ingress --requests 2000   # the public API (see README)

Consumers (`--events N`): N events drawn by hypothesis across the stage topics (received, state, view,
routed, generated, judged, feedback; a few on the dead-letter topic that ingress reads): random bytes,
truncated protobufs, another message type on the topic, invalid UTF-8 in a string field, NUL characters
in ids and in text, huge text fields (up to ~1 MB, the broker's record limit), unknown schema_version,
seq <= 0, missing tenant / user / turn id, a record key that disagrees with the envelope, non-finite or
out-of-range numbers, bodies fuzzed field by field behind a valid envelope, replays of turns that were
already answered, events naming a real user's data key whose text is not that key's ciphertext (dead-lettered
as unsealable), user text without any data key on a stack that seals (dead-lettered as unsealed: the
services take sealed text only), and events naming a data key that does not exist (a forgotten user's:
dropped). Events that must reach a handler's own checks go sealed with their user's key where the stack
seals, as the ingress would publish them. Checked afterwards:
  crashes              service processes that exited (the launcher restarts them; each exit counts)
  not_dead_lettered    malformed events without a dead letter from every consumer group of their topic
  vague_reasons        dead letters of malformed events whose reason does not name the problem
  handler_failures     dead letters that say "handler failed after N attempts" (an unexpected exception
                       in a handler, rather than bad input recognised as such)
  duplicate_effects    replayed turns with a second state/view/route/answer/judgement, router update or
                       memory record
  unanswered           valid turns sent after the storm without an OK answer and a judgement
  lag                  records not committed by the stage groups once everything settled (stuck partitions)
Internal RPCs (`--requests N`): N requests spread over StateEstimator.Estimate, Memory.BuildView /
DescribeIndex, Router.Route / GetPolicy / ResetPolicy, Dispatch.Generate / ListModels and Judge.Score,
drawn by hypothesis from the request types (arbitrary unicode with NUL, huge strings, extreme integers,
NaN / inf doubles, unknown enum values, random maps and repeated fields; half of them with valid ids so
they get past the first check). Counted by status code; INTERNAL, UNKNOWN and DEADLINE_EXCEEDED are
failures. Exit code 0 when every count above is 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO / "services", REPO / "infra"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import grpc  # noqa: E402
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition  # noqa: E402
from google.protobuf.descriptor import Descriptor, FieldDescriptor  # noqa: E402
from google.protobuf.message import Message  # noqa: E402
from google.protobuf.message_factory import GetMessageClass  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from mars.config import (  # noqa: E402
    SCHEMA_VERSION,
    TOPIC_DEAD_LETTER,
    TOPIC_FEEDBACK,
    TOPIC_GENERATED,
    TOPIC_JUDGED,
    TOPIC_MEMORY_COMMITTED,
    TOPIC_RECEIVED,
    TOPIC_ROUTED,
    TOPIC_STATE,
    TOPIC_VIEW,
)
from mars.sealing import has_user_text  # noqa: E402
from mars.topology import STAGE_GROUPS  # noqa: E402
from mars.v1 import events_pb2 as ev  # noqa: E402
from mars.v1 import services_pb2 as svc  # noqa: E402
from mars.v1 import services_pb2_grpc as svc_grpc  # noqa: E402
from mars_stack import stack_kafka_options  # noqa: E402

TENANT = "fuzz"
ARMS = ("standin-short", "standin-long")
#: The stage topics and the event type each carries.
TOPIC_TYPES: dict[str, type[Message]] = {
    TOPIC_RECEIVED: ev.TurnReceived,
    TOPIC_STATE: ev.StateEstimated,
    TOPIC_VIEW: ev.ViewBuilt,
    TOPIC_ROUTED: ev.Routed,
    TOPIC_GENERATED: ev.Generated,
    TOPIC_JUDGED: ev.Judged,
    TOPIC_FEEDBACK: ev.Feedback,
}
#: Stage consumer groups reading each topic: each of them must dead-letter a malformed record.
READERS: dict[str, list[str]] = {
    t: [g.name for g in STAGE_GROUPS if t in g.topics] for t in (*TOPIC_TYPES, TOPIC_DEAD_LETTER)
}
#: Topics whose outputs a replayed turn must not repeat (each answered turn has exactly one event there).
OUTPUT_TOPICS = (TOPIC_STATE, TOPIC_VIEW, TOPIC_ROUTED, TOPIC_GENERATED, TOPIC_JUDGED, TOPIC_MEMORY_COMMITTED)
#: Records the broker takes at most (message.max.bytes, 1 MiB by default), less room for the rest.
HUGE_MAX_CHARS = 1_000_000
BAD_CODES = ("INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED")


# ---- events ---------------------------------------------------------------------------------------------


def envelope(user: str, seq: int = 1, turn_id: str | None = None) -> ev.TurnEnvelope:
    return ev.TurnEnvelope(
        turn_id=turn_id or f"fuzz-{uuid.uuid4().hex}",
        tenant=TENANT,
        user_id=user,
        session_id="s",
        seq=seq,
        received_at_ms=int(time.time() * 1000),
        schema_version=SCHEMA_VERSION,
    )


def session_state() -> ev.SessionState:
    s = ev.SessionState(
        action=ev.MATCH,
        query_type=ev.DYNAMIC,
        phase=ev.EXPLORE,
        retrieval_scope=ev.GLOBAL,
        top_k_hint=5,
        lens_recommendation=3,
    )
    s.taxonomy.need_memory = 1
    return s


def valid_event(topic: str, turn: ev.TurnEnvelope, text: str = "How do I plan a ferry trip?") -> Message:
    """A plausible event of the topic's type for `turn` (what the stage before would have published)."""
    state = session_state()
    block = ev.MemoryBlock(block_id="b1", kind=ev.RECENT_TURN, text="earlier: ferry times", score=0.5)
    view = ev.CandidateView(blocks=[block], load=ev.ViewLoad(num_blocks=1, estimated_tokens=8), policy="mars")
    if topic == TOPIC_RECEIVED:
        return ev.TurnReceived(turn=turn, text=text)
    if topic == TOPIC_STATE:
        return ev.StateEstimated(turn=turn, text=text, state=state, latency_ms=1.0)
    if topic == TOPIC_VIEW:
        return ev.ViewBuilt(turn=turn, text=text, state=state, view=view, latency_ms=1.0)
    if topic == TOPIC_ROUTED:
        return ev.Routed(
            turn=turn,
            text=text,
            state=state,
            view=view,
            chosen_arm=ARMS[0],
            fallback_order=[ARMS[1]],
            propensity=1.0,
            policy_id=f"user:{turn.tenant}/{turn.user_id}",
        )
    if topic == TOPIC_GENERATED:
        return ev.Generated(
            turn=turn,
            status=ev.OK,
            model=ARMS[0],
            text="Take the 9:00 ferry.",
            query=text,
            state=state,
            usage=ev.Usage(input_tokens=10, output_tokens=5),
            cost_usd=0.0001,
            packed_blocks=[block],
        )
    if topic == TOPIC_JUDGED:
        return ev.Judged(turn=turn, arm=ARMS[0], utility=0.5, reward=0.5, judge="fuzz")
    if topic == TOPIC_FEEDBACK:
        return ev.Feedback(turn=turn, rating=0.5, comment="fine")
    raise ValueError(topic)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, data: bytes) -> bytes:
    """A length-delimited field, encoded by hand (so it can hold bytes protobuf would refuse to write)."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def key_of(turn: ev.TurnEnvelope) -> bytes:
    return f"{turn.tenant}/{turn.user_id}".encode()


@dataclass
class Case:
    kind: str
    topic: str
    key: bytes | None
    payload: bytes = field(repr=False)
    #: Every stage group reading the topic must dead-letter it, with a reason holding one of `words`.
    must_dead_letter: bool
    words: tuple[str, ...] = ()
    turn_id: str = ""
    partition: int = -1
    offset: int = -1
    refused: str = ""  # the broker would not take it (e.g. over its record size limit)


#: Reason words for records that are not even a decodable event of their topic's type.
UNDECODABLE = ("decode", "envelope", "key", "schema_version", "seq", "nul", "control character")


def texts(huge: bool = True) -> st.SearchStrategy[str]:
    """Arbitrary unicode (NUL included), awkward fixed strings, and now and then a huge one."""
    plain = st.text(max_size=40)
    special = st.sampled_from(
        ["", " ", "\x00", "a\x00b", "\u202e\u200b", "'; DROP TABLE x; --", "%s %n {}", "😀" * 5, "\ufeff"]
    )
    options = [plain, plain, plain, plain, plain, plain, special, special]
    if huge:
        options.append(
            st.builds(
                lambda n, unit: (unit * (n // len(unit) + 1))[:n],
                st.integers(10_000, 300_000),
                st.sampled_from(["x", "é", "word ", "\x00", "日本"]),
            )
        )
    return st.one_of(*options)


def _scalar(f: FieldDescriptor, depth: int, huge: bool) -> st.SearchStrategy[Any]:
    t = f.type
    if t == FieldDescriptor.TYPE_STRING:
        return texts(huge)
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        width = 64 if t == FieldDescriptor.TYPE_DOUBLE else 32
        return st.one_of(
            st.floats(width=width),
            st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308 if width == 64 else 3e38]),
        )
    if t == FieldDescriptor.TYPE_ENUM:
        return st.one_of(
            st.sampled_from([v.number for v in f.enum_type.values]), st.integers(-(2**31), 2**31 - 1)
        )
    if t == FieldDescriptor.TYPE_MESSAGE:
        return messages(f.message_type, depth + 1, huge)
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        bound = 2**31
        return st.one_of(st.integers(-bound, bound - 1), st.sampled_from([0, -1, 1, -bound, bound - 1]))
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return st.integers(0, 2**32 - 1)
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1)
    bound = 2**63
    return st.one_of(st.integers(-bound, bound - 1), st.sampled_from([0, -1, 1, -bound, bound - 1]))


def _is_map(f: FieldDescriptor) -> bool:
    return f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type.GetOptions().map_entry


@st.composite
def messages(draw: st.DrawFn, descriptor: Descriptor, depth: int = 0, huge: bool = True) -> Message:
    """Any message of the type: each field set or not; strings, numbers, enums, repeated fields and maps
    drawn from the awkward ends of their types; nested messages down to depth 3."""
    msg = GetMessageClass(descriptor)()
    if depth > 3:
        return msg
    for f in descriptor.fields:
        if not draw(st.booleans()):
            continue
        if _is_map(f):
            key_f, value_f = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            entries = draw(
                st.dictionaries(_scalar(key_f, depth, False), _scalar(value_f, depth, huge), max_size=4)
            )
            target = getattr(msg, f.name)
            for k, v in entries.items():
                if value_f.type == FieldDescriptor.TYPE_MESSAGE:
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif f.is_repeated:
            values = draw(st.lists(_scalar(f, depth, huge), max_size=4 if depth else 6))
            target = getattr(msg, f.name)
            for v in values:
                if f.type == FieldDescriptor.TYPE_MESSAGE:
                    target.add().CopyFrom(v)
                else:
                    target.append(v)
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            getattr(msg, f.name).CopyFrom(draw(_scalar(f, depth, huge)))
        else:
            setattr(msg, f.name, draw(_scalar(f, depth, huge)))
    return msg


_LENGTH_DELIMITED = 2
_WIRE = {
    **dict.fromkeys(
        (
            FieldDescriptor.TYPE_INT32,
            FieldDescriptor.TYPE_INT64,
            FieldDescriptor.TYPE_UINT32,
            FieldDescriptor.TYPE_UINT64,
            FieldDescriptor.TYPE_SINT32,
            FieldDescriptor.TYPE_SINT64,
            FieldDescriptor.TYPE_BOOL,
            FieldDescriptor.TYPE_ENUM,
        ),
        0,
    ),
    **dict.fromkeys(
        (FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64, FieldDescriptor.TYPE_DOUBLE), 1
    ),
    **dict.fromkeys(
        (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE), 2
    ),
    **dict.fromkeys(
        (FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32, FieldDescriptor.TYPE_FLOAT), 5
    ),
}


def _wire(f: FieldDescriptor) -> int:
    if f.is_repeated and f.is_packed:
        return _LENGTH_DELIMITED  # proto3 packs repeated scalars
    return _WIRE[f.type]


def _clashes(source: Message, target_type: type[Message]) -> bool:
    """Whether a populated field of `source` has a number the target type knows with another wire type (so
    the record cannot be read as the target type; otherwise protobuf reads it as one, silently). A repeated
    scalar is read packed or not."""
    target = target_type.DESCRIPTOR.fields_by_number
    for f, _ in source.ListFields():
        other = target.get(f.number)
        if other is not None and _wire(f) not in {_WIRE[other.type], _wire(other)}:
            return True
    return False


def _has_text_to_open(event: Message) -> bool:
    """Whether a sealed `event` has a non-empty user-text field (one that must open with the key)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from mars import sealing

    copy = type(event)()
    copy.CopyFrom(event)
    try:
        sealing.unseal(copy, AESGCM(sealing.new_key()))
    except sealing.SealError:
        return True
    return False


@dataclass
class Context:
    """What the generator draws from: earlier answered turns (for replays) and fresh user names."""

    replays: list[tuple[str, bytes | None, bytes, str]] = field(default_factory=list)
    #: A real user's data key (from the warm-up turns' envelopes); "" where events travel unsealed.
    data_key_id: str = ""
    #: Seals an event with its user's data key, as the ingress would (None where the stack does not seal):
    #: the services of a stack that seals take no plaintext text, so events that must reach a handler's own
    #: checks (numbers, NUL or huge text, fuzzed bodies) go sealed, and the `unsealed` kind goes without.
    seal: Callable[[Message], Message] | None = None

    def user(self) -> str:
        # Of one length: what the strategy draws (a cut inside the envelope) must not depend on it.
        return f"fz-{uuid.uuid4().hex[:12]}"


KINDS = (
    "random_bytes",
    "truncated",
    "wrong_type",
    "invalid_utf8",
    "nul_in_id",
    "bad_schema",
    "bad_seq",
    "missing_ids",
    "key_mismatch",
    "bad_numbers",
    "nul_text",
    "huge_text",
    "fuzzed_body",
    "replay",
    "deadletter_garbage",
    "bad_seal",
    "unsealed",
    "unknown_key",
)


@st.composite
def cases(draw: st.DrawFn, ctx: Context, kind: str) -> Case:
    topic = draw(st.sampled_from(sorted(TOPIC_TYPES)))
    user = ctx.user()
    turn = envelope(user)
    event = valid_event(topic, turn)
    key: bytes | None = key_of(turn)

    def case(payload: bytes, must: bool, words: tuple[str, ...] = (), **kw: Any) -> Case:
        return Case(kind, kw.pop("topic", topic), kw.pop("key", key), payload, must, words, turn.turn_id)

    def sealed(e: Message) -> bytes:
        """`e` as the ingress would publish it on a stack that seals (as it is elsewhere)."""
        return (ctx.seal(e) if ctx.seal is not None else e).SerializeToString()

    if kind == "random_bytes":
        payload = draw(st.binary(min_size=1, max_size=512))
        return case(payload, True, UNDECODABLE, key=draw(st.one_of(st.none(), st.binary(max_size=16))))
    if kind == "truncated":
        raw = event.SerializeToString()
        head = len(_field(1, turn.SerializeToString()))  # cut inside field 1 (the envelope): never whole
        return case(raw[: draw(st.integers(1, head - 1))], True, ("decode",))
    if kind == "wrong_type":
        source_topic = draw(st.sampled_from(sorted(t for t in TOPIC_TYPES if t != topic)))
        source = valid_event(source_topic, turn)
        clash = _clashes(source, TOPIC_TYPES[topic])
        # A compatible encoding reads as a (strange) event of the topic's type: handled or dead-lettered.
        return case(source.SerializeToString(), clash, ("wire type", "decode"))
    if kind == "invalid_utf8":
        bad = draw(
            st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"a\x80b"])
        )
        strings = [
            f.number for f in TOPIC_TYPES[topic].DESCRIPTOR.fields if f.type == FieldDescriptor.TYPE_STRING
        ]
        number = draw(st.sampled_from([0, *strings]))
        if number == 0:  # inside the envelope: its session_id (field 4)
            inner = turn.SerializeToString() + _field(4, bad)
            payload = _field(1, inner) + event.SerializeToString()[len(_field(1, turn.SerializeToString())) :]
        else:  # a string field of the event itself
            payload = event.SerializeToString() + _field(number, bad)
        return case(payload, True, ("decode",))
    if kind == "nul_in_id":
        name = draw(st.sampled_from(["tenant", "user_id", "turn_id", "session_id"]))
        setattr(event.turn, name, draw(st.sampled_from(["\x00", "a\x00", "\x00b\x00"])))  # type: ignore[attr-defined]
        return case(event.SerializeToString(), True, ("nul",), key=key_of(event.turn))  # type: ignore[attr-defined]
    if kind == "bad_schema":
        event.turn.schema_version = draw(  # type: ignore[attr-defined]
            st.integers(-(2**31), 2**31 - 1).filter(lambda v: v != SCHEMA_VERSION)
        )
        return case(event.SerializeToString(), True, ("schema_version",))
    if kind == "bad_seq":
        event.turn.seq = draw(st.integers(-(2**63), 0))  # type: ignore[attr-defined]
        return case(event.SerializeToString(), True, ("seq",))
    if kind == "missing_ids":
        names = draw(st.lists(st.sampled_from(["tenant", "user_id", "turn_id"]), min_size=1, unique=True))
        for name in names:
            event.turn.ClearField(name)  # type: ignore[attr-defined]
        return case(event.SerializeToString(), True, ("missing",), key=key_of(event.turn))  # type: ignore[attr-defined]
    if kind == "key_mismatch":
        other = draw(
            st.one_of(
                st.none(),
                st.just(f"{TENANT}/someone-else".encode()),
                st.just(user.encode()),
                st.binary(max_size=24).filter(lambda b: b != key),
            )
        )
        return case(event.SerializeToString(), True, ("key",), key=other)
    if kind == "bad_numbers":
        bad = draw(st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -1e300, -5.0, 7.0]))
        if topic == TOPIC_JUDGED:
            bad = draw(st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -1e300, 7.0]))  # -5 is a reward
            event.reward = bad  # type: ignore[attr-defined]
            # The router reads the reward; the ingress's outcome group the costs (a tenant's spend).
            event.judge_cost_usd = draw(st.sampled_from([math.nan, math.inf, -math.inf, -1.0]))  # type: ignore[attr-defined]
            return case(sealed(event), True, ("reward", "cost"))
        if topic == TOPIC_FEEDBACK:
            event.rating = bad  # type: ignore[attr-defined]
            return case(sealed(event), True, ("rating",))
        # Elsewhere numbers the stage reads: scores, costs, confidences, features.
        if topic in (TOPIC_VIEW, TOPIC_ROUTED):
            event.view.load.max_retrieval_score = bad  # type: ignore[attr-defined]
            event.view.blocks[0].score = bad  # type: ignore[attr-defined]
        if topic == TOPIC_ROUTED:
            event.propensity = bad  # type: ignore[attr-defined]
            event.cascade_min_logprob = bad  # type: ignore[attr-defined]
        if topic == TOPIC_GENERATED:
            event.cost_usd = bad  # type: ignore[attr-defined]
            event.propensity = bad  # type: ignore[attr-defined]
            event.features.extend([bad] * 3)  # type: ignore[attr-defined]
        if topic in (TOPIC_STATE, TOPIC_VIEW, TOPIC_ROUTED, TOPIC_GENERATED):
            event.state.lens_confidence = bad  # type: ignore[attr-defined]
            event.state.top_k_hint = draw(st.sampled_from([-(2**31), -1, 0, 2**31 - 1]))  # type: ignore[attr-defined]
        return case(sealed(event), False)
    if kind == "nul_text":
        text = draw(st.sampled_from(["\x00", "ferry\x00times", "\x00\x00 plan a trip \x00"]))
        event = valid_event(topic, turn, text)
        if topic == TOPIC_GENERATED:
            event.text = text  # type: ignore[attr-defined]
        if topic == TOPIC_FEEDBACK:
            event.comment = text  # type: ignore[attr-defined]
        return case(sealed(event), False)
    if kind == "huge_text":
        # Bytes of UTF-8; sealed text grows by a third (base64), and must still fit the broker's record.
        size = draw(st.integers(100_000, HUGE_MAX_CHARS if ctx.seal is None else HUGE_MAX_CHARS * 7 // 10))
        unit = draw(st.sampled_from(["x", "word ", "é"]))
        chars = size // len(unit.encode()) * len(unit)
        text = (unit * (chars // len(unit) + 1))[:chars]
        event = valid_event(topic, turn, text)
        if topic == TOPIC_GENERATED:
            event.text = text[: len(text) // 2]  # type: ignore[attr-defined]
            event.query = text[: len(text) // 2]  # type: ignore[attr-defined]
        if topic == TOPIC_FEEDBACK:
            event.comment = text  # type: ignore[attr-defined]
        if topic == TOPIC_JUDGED:
            event.arm = text  # type: ignore[attr-defined]
        return case(sealed(event), False)
    if kind == "fuzzed_body":
        body = draw(messages(TOPIC_TYPES[topic].DESCRIPTOR, huge=False))
        body.turn.CopyFrom(turn)  # type: ignore[attr-defined]
        return case(sealed(body), False)
    if kind == "replay":
        r_topic, r_key, r_payload, r_turn = draw(st.sampled_from(ctx.replays))
        return Case(kind, r_topic, r_key, r_payload, False, (), r_turn)
    if kind == "bad_seal":
        # Claims a real data key, but its text fields are not that key's ciphertext (plaintext, or another
        # value's), and the key is another user's: dead-lettered as unsealable wherever the event has text to
        # open (the key's owner is checked first, where the build does).
        event.turn.data_key_id = ctx.data_key_id  # type: ignore[attr-defined]
        words = ("does not open", "is not the key of the turn's tenant and user")
        return case(event.SerializeToString(), _has_text_to_open(event), words)
    if kind == "unsealed":
        # User text without a data key, on a stack that seals: whoever may write the topic could plant it
        # for any user, so every reader dead-letters it, naming the missing seal. (Text-free types pass.)
        return case(event.SerializeToString(), has_user_text(TOPIC_TYPES[topic]), ("unsealed",))
    if kind == "unknown_key":
        # A key that does not exist is a forgotten user's: the event is dropped, nothing to dead-letter.
        event.turn.data_key_id = draw(st.sampled_from([uuid.uuid4().hex[:24], "x" * 200]))  # type: ignore[attr-defined]
        return case(event.SerializeToString(), False)
    # deadletter_garbage: ingress reads the dead-letter topic; it must shrug off anything there.
    letter = draw(messages(ev.DeadLetter.DESCRIPTOR, huge=False))
    payload = draw(st.one_of(st.just(letter.SerializeToString()), st.binary(max_size=256)))
    return Case(kind, TOPIC_DEAD_LETTER, draw(st.one_of(st.none(), st.binary(max_size=16))), payload, False)


def _generate_cases(strategy: st.SearchStrategy[Case], n: int, rng_seed: int) -> list[Case]:
    out: list[Case] = []

    @seed(rng_seed)
    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(c=strategy)
    def collect(c: Case) -> None:
        out.append(c)

    collect()
    return out


def draw_cases(n: int, ctx: Context, rng_seed: int) -> list[Case]:
    """n cases drawn by hypothesis, about as many of each kind (generation only: the checks run after all
    of them were sent). A kind with few distinct shapes is drawn again under another seed until it has its
    share (every case has fresh ids anyway)."""
    kinds = [
        k
        for k in KINDS
        if (k != "replay" or ctx.replays)
        and (k != "bad_seal" or ctx.data_key_id)
        and (k != "unsealed" or ctx.seal is not None)
    ]
    out: list[Case] = []
    for k, kind in enumerate(kinds):
        share = n // len(kinds) + (1 if k < n % len(kinds) else 0)
        mine: list[Case] = []
        for attempt in range(100):
            if len(mine) >= share:
                break
            mine += _generate_cases(cases(ctx, kind), share - len(mine), rng_seed * 1000 + k * 100 + attempt)
        out += mine[:share]
    # Interleaved, so the kinds reach the consumers mixed rather than one kind after another.
    return [c for _, c in sorted(enumerate(out), key=lambda ic: (ic[0] * 7919) % max(1, len(out)))]


# ---- Kafka I/O ------------------------------------------------------------------------------------------


async def send_records(bootstrap: str, records: Sequence[Case]) -> None:
    """Send every case (in order), filling in where it landed, or why the broker refused it."""
    producer = AIOKafkaProducer(
        **stack_kafka_options(bootstrap),
        enable_idempotence=False,
        max_request_size=4 * 1024 * 1024,
        linger_ms=5,
    )
    await producer.start()
    try:
        futures = []
        for c in records:
            futures.append(await producer.send(c.topic, c.payload, key=c.key))
        for c, fut in zip(records, futures, strict=True):
            try:
                meta = await fut
            except Exception as exc:  # e.g. over the broker's record size limit
                c.refused = repr(exc)
            else:
                c.partition, c.offset = meta.partition, meta.offset
    finally:
        await producer.stop()


async def read_topics(bootstrap: str, topics: Sequence[str], idle_s: float = 1.5) -> dict[str, list[Any]]:
    """Every record of each topic, from the beginning, until the topics have been idle for `idle_s`."""
    consumer = AIOKafkaConsumer(
        **stack_kafka_options(bootstrap),
        enable_auto_commit=False,
        fetch_max_wait_ms=50,
        max_partition_fetch_bytes=4 * 1024 * 1024,
    )
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()
        tps = [TopicPartition(t, p) for t in topics for p in sorted(consumer.partitions_for_topic(t) or ())]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out: dict[str, list[Any]] = {t: [] for t in topics}
        last = time.monotonic()
        while time.monotonic() - last < idle_s:
            batch = await consumer.getmany(timeout_ms=200)
            for tp, records in batch.items():
                out[tp.topic].extend(records)
                if records:
                    last = time.monotonic()
        return out
    finally:
        await consumer.stop()


def _parse(cls: type[Message], raw: bytes | None) -> Message | None:
    try:
        return cls.FromString(raw or b"")
    except Exception:
        return None


async def total_lag(bootstrap: str) -> dict[str, int]:
    from mars_tools.deploy.lag import fetch_lag

    lags = await fetch_lag(stack_kafka_options(bootstrap))
    return {f"{lag.group}:{lag.topic}": int(lag.lag or 0) for lag in lags if lag.lag}


def wait_lag_zero(bootstrap: str, timeout_s: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        lag = asyncio.run(total_lag(bootstrap))
        if not lag or time.monotonic() > deadline:
            return lag
        time.sleep(1.0)


# ---- consumer fuzzing -----------------------------------------------------------------------------------


@dataclass
class ConsumerReport:
    events: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    refused_by_broker: int = 0
    must_dead_letter: int = 0
    dead_lettered: int = 0
    tolerated_dead_lettered: int = 0
    tolerated_handled: int = 0
    dead_letters: int = 0
    not_dead_lettered: list[str] = field(default_factory=list)
    vague_reasons: list[str] = field(default_factory=list)
    handler_failures: list[str] = field(default_factory=list)
    duplicate_effects: list[str] = field(default_factory=list)
    valid_turns: int = 0
    unanswered: list[str] = field(default_factory=list)
    lag: dict[str, int] = field(default_factory=dict)
    crashes: list[str] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    #: Why events that were not malformed as such (tolerated kinds) were dead-lettered, by kind.
    tolerated_reasons: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def failures(self) -> dict[str, int]:
        return {
            "crashes": len(self.crashes),
            "not_dead_lettered": len(self.not_dead_lettered),
            "vague_reasons": len(self.vague_reasons),
            "handler_failures": len(self.handler_failures),
            "duplicate_effects": len(self.duplicate_effects),
            "unanswered": len(self.unanswered),
            "lag": sum(self.lag.values()),
        }


def send_valid_turns(
    bootstrap: str, n: int, seal: Callable[[Message], Message] | None = None
) -> list[ev.TurnReceived]:
    """n valid turns of fresh users, sealed with `seal` where the stack seals (as the ingress would)."""
    turns = [
        ev.TurnReceived(
            turn=envelope(f"valid-{uuid.uuid4().hex[:8]}"), text=f"Plan trip number {i} by ferry."
        )
        for i in range(n)
    ]
    cases_ = [
        Case("valid", TOPIC_RECEIVED, key_of(t.turn), (seal(t) if seal else t).SerializeToString(), False)
        for t in turns
    ]
    asyncio.run(send_records(bootstrap, cases_))
    return turns


def wait_answered(bootstrap: str, turn_ids: set[str], timeout_s: float) -> set[str]:
    """The turn ids among `turn_ids` that got an OK answer and a judgement within the timeout."""
    deadline = time.monotonic() + timeout_s
    done: set[str] = set()
    while True:
        log = asyncio.run(read_topics(bootstrap, [TOPIC_GENERATED, TOPIC_JUDGED], idle_s=0.5))
        answered = {
            g.turn.turn_id
            for r in log[TOPIC_GENERATED]
            if (g := _parse(ev.Generated, r.value)) is not None and g.status == ev.OK  # type: ignore[attr-defined]
        }
        judged = {j.turn.turn_id for r in log[TOPIC_JUDGED] if (j := _parse(ev.Judged, r.value)) is not None}  # type: ignore[attr-defined]
        done = turn_ids & answered & judged
        if done == turn_ids or time.monotonic() > deadline:
            return done
        time.sleep(1.0)


def fuzz_consumers(
    stack: Any, n: int, rng_seed: int = 1, log: Callable[[str], None] = print, valid_after: int = 5
) -> ConsumerReport:
    """Warm up (a few valid turns, to replay later), send n fuzz cases, then valid turns; check."""
    import psycopg

    started = time.monotonic()
    bootstrap = stack.env["MARS_KAFKA_BOOTSTRAP"]
    report = ConsumerReport()
    exits_before = len([e for e in stack.events if e.kind == "exited"])

    keys = stack.keyring()
    seal = keys.seal if keys is not None else None
    warm = send_valid_turns(bootstrap, 3, seal)
    warm_ids = {t.turn.turn_id for t in warm}
    got = wait_answered(bootstrap, warm_ids, 120)
    if got != warm_ids:
        raise RuntimeError(f"warm-up turns were not answered: {sorted(warm_ids - got)}")
    topics = asyncio.run(read_topics(bootstrap, [TOPIC_RECEIVED, *OUTPUT_TOPICS[:-1], TOPIC_FEEDBACK]))
    ctx = Context(seal=seal)
    for topic, records in topics.items():
        for r in records:
            parsed = _parse(TOPIC_TYPES.get(topic, ev.TurnReceived), r.value)
            turn_id = parsed.turn.turn_id if parsed is not None else ""  # type: ignore[attr-defined]
            if turn_id in warm_ids:
                ctx.replays.append((topic, r.key, r.value, turn_id))

    if keys is not None:  # a real user's data key, for events that misuse it
        ctx.data_key_id = keys.for_user(TENANT, "fz-key-owner")
    log(f"drawing {n} fuzz events")
    fuzz = draw_cases(n, ctx, rng_seed)
    report.events = len(fuzz)
    report.by_kind = dict(Counter(c.kind for c in fuzz))
    log(f"sending {len(fuzz)} fuzz events: {report.by_kind}")
    asyncio.run(send_records(bootstrap, fuzz))
    report.refused_by_broker = sum(1 for c in fuzz if c.refused)

    valid = send_valid_turns(bootstrap, valid_after, seal)
    report.valid_turns = len(valid)
    valid_ids = {t.turn.turn_id for t in valid}
    log(f"sent {valid_after} valid turns after the storm; waiting for their answers")
    got = wait_answered(bootstrap, valid_ids, 180)
    report.unanswered = sorted(valid_ids - got)

    log("waiting for every stage group to commit everything")
    report.lag = wait_lag_zero(bootstrap, 120)

    everything = asyncio.run(read_topics(bootstrap, [TOPIC_DEAD_LETTER, *OUTPUT_TOPICS]))
    letters: dict[tuple[str, int, int], list[ev.DeadLetter]] = defaultdict(list)
    for r in everything[TOPIC_DEAD_LETTER]:
        letter = _parse(ev.DeadLetter, r.value)
        if isinstance(letter, ev.DeadLetter) and letter.source_topic:
            letters[(letter.source_topic, letter.partition, letter.offset)].append(letter)
            report.dead_letters += 1
    reasons: Counter[str] = Counter()
    tolerated: Counter[str] = Counter()
    for c in fuzz:
        if c.refused:
            continue
        got_letters = letters.get((c.topic, c.partition, c.offset), [])
        for letter in got_letters:
            reasons[letter.reason.split(":")[0][:60]] += 1
            if letter.reason.startswith("handler failed"):
                report.handler_failures.append(
                    f"{c.kind} on {c.topic}: {letter.consumer}: {letter.reason[:200]}"
                )
        if not c.must_dead_letter:
            for letter in got_letters:
                tolerated[f"{c.kind} on {c.topic}: {letter.reason[:90]}"] += 1
            if got_letters:
                report.tolerated_dead_lettered += 1
            else:
                report.tolerated_handled += 1
            continue
        report.must_dead_letter += 1
        by_group = {letter.consumer: letter for letter in got_letters}
        missing = [g for g in READERS[c.topic] if g not in by_group]
        if missing:
            report.not_dead_lettered.append(
                f"{c.kind} on {c.topic}@{c.partition}/{c.offset}: none from {missing}"
            )
            continue
        report.dead_lettered += 1
        for g in READERS[c.topic]:
            reason = by_group[g].reason.lower()
            if not reason or not any(w in reason for w in c.words):
                report.vague_reasons.append(f"{c.kind} on {c.topic} ({g}): {by_group[g].reason[:200]!r}")
    report.reasons = dict(reasons.most_common())
    report.tolerated_reasons = dict(tolerated.most_common())

    # Replays: one output event per stage for each warm turn (counting what we re-sent ourselves).
    resent = Counter((c.topic, c.turn_id) for c in fuzz if c.kind == "replay" and not c.refused)
    for topic in OUTPUT_TOPICS:
        cls = TOPIC_TYPES.get(topic, ev.MemoryCommitted)
        counts = Counter(
            p.turn.turn_id  # type: ignore[attr-defined]
            for r in everything[topic]
            if (p := _parse(cls, r.value)) is not None and p.turn.turn_id in warm_ids  # type: ignore[attr-defined]
        )
        for turn_id in warm_ids:
            extra = counts[turn_id] - resent[(topic, turn_id)] - 1
            if extra:
                report.duplicate_effects.append(f"{topic}: turn {turn_id} has {extra:+d} events")
    with psycopg.connect(stack.env["MARS_POSTGRES_DSN"]) as conn:
        for table in ("router_ledger", "memory_records"):
            for turn_id, count in conn.execute(
                f"SELECT turn_id, count(*) FROM {table} WHERE turn_id = ANY(%s) GROUP BY turn_id",
                (sorted(warm_ids),),
            ).fetchall():
                if count != 1:
                    report.duplicate_effects.append(f"{table}: turn {turn_id} has {count} rows")

    report.crashes = [f"{e.name}: {e.detail}" for e in stack.events if e.kind == "exited"][exits_before:]
    report.crashes += [f"{name}: not running" for name, alive in stack.alive() if not alive]
    report.wall_s = time.monotonic() - started
    return report


# ---- RPC fuzzing ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rpc:
    service: str
    method: str
    request: type[Message]
    stub: Callable[[grpc.Channel], Any]
    #: Makes a request plausible enough to pass the first checks (valid ids, a known arm, ...).
    plausible: Callable[[Message, int], None] = lambda m, i: None


def _ids(m: Message, i: int) -> None:
    m.tenant = TENANT  # type: ignore[attr-defined]
    m.user_id = f"rpc-{i % 7}"  # type: ignore[attr-defined]


def _text(m: Message, i: int) -> None:
    if not m.text.strip():  # type: ignore[attr-defined]
        m.text = "plan a ferry trip"  # type: ignore[attr-defined]


def _generate(m: Message, i: int) -> None:
    m.arm = ARMS[i % 2]  # type: ignore[attr-defined]
    _text(m, i)
    m.max_tokens = min(max(m.max_tokens, 0), 64)  # type: ignore[attr-defined]


def _score(m: Message, i: int) -> None:
    m.status = ev.OK  # type: ignore[attr-defined]
    m.model = ARMS[i % 2]  # type: ignore[attr-defined]


INTERNAL_RPCS = (
    Rpc("state", "Estimate", svc.EstimateRequest, svc_grpc.StateEstimatorStub, _text),
    Rpc("memory", "BuildView", svc.BuildViewRequest, svc_grpc.MemoryStub, _ids),
    Rpc("memory", "DescribeIndex", svc.DescribeIndexRequest, svc_grpc.MemoryStub, _ids),
    Rpc("router", "Route", svc.RouteRequest, svc_grpc.RouterStub, _ids),
    Rpc("router", "GetPolicy", svc.PolicyRequest, svc_grpc.RouterStub, _ids),
    Rpc("router", "ResetPolicy", svc.PolicyRequest, svc_grpc.RouterStub, _ids),
    Rpc("dispatch", "Generate", svc.GenerateRequest, svc_grpc.DispatchStub, _generate),
    Rpc("dispatch", "ListModels", svc.Empty, svc_grpc.DispatchStub),
    Rpc("judge", "Score", ev.Generated, svc_grpc.JudgeStub, _score),
)


def _turn_request(m: Message, i: int) -> None:
    _ids(m, i)
    _text(m, i)
    m.options.clear()  # type: ignore[attr-defined]


INGRESS_RPCS = (
    Rpc("ingress", "SendTurn", svc.TurnRequest, svc_grpc.IngressStub, _turn_request),
    Rpc("ingress", "SubmitFeedback", svc.FeedbackRequest, svc_grpc.IngressStub, _ids),
)


@dataclass
class RpcReport:
    requests: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    by_method: dict[str, dict[str, int]] = field(default_factory=dict)
    bad: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def failures(self) -> dict[str, int]:
        return {"bad_statuses": len(self.bad), "crashes": len(self.crashes)}


def call_once(
    rpc: Rpc,
    channel: grpc.Channel,
    request: Message,
    timeout_s: float,
    metadata: Sequence[tuple[str, str]] = (),
) -> tuple[str, str]:
    method = getattr(rpc.stub(channel), rpc.method)
    try:
        method(request, timeout=timeout_s, metadata=list(metadata) or None)
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""  # type: ignore[attr-defined]
    return "OK", ""


def fuzz_rpc(
    stack: Any,
    rpc: Rpc,
    n: int,
    report: RpcReport,
    rng_seed: int = 1,
    strict: bool = False,
    timeout_s: float = 30.0,
    metadata: Sequence[tuple[str, str]] = (),
) -> None:
    """n hypothesis-drawn requests to one method. `strict`: the first INTERNAL / UNKNOWN /
    DEADLINE_EXCEEDED fails at once and hypothesis shrinks it to the smallest request that does it."""
    channel = grpc.insecure_channel(
        stack.addr(rpc.service), options=[("grpc.max_send_message_length", 64 * 1024 * 1024)]
    )
    if rpc.service == "ingress" and not metadata:
        channel = ingress_channel(stack, channel)
    elif rpc.service != "ingress":
        channel = stage_channel(stack, channel)
    codes = report.by_method.setdefault(f"{rpc.service}.{rpc.method}", {})
    counter = iter(range(10**9))

    @seed(rng_seed)
    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate, Phase.shrink] if strict else [Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(request=messages(rpc.request.DESCRIPTOR), plausible=st.booleans())
    def one(request: Message, plausible: bool) -> None:
        i = next(counter)
        if plausible:
            rpc.plausible(request, i)
        code, details = call_once(rpc, channel, request, timeout_s, metadata)
        codes[code] = codes.get(code, 0) + 1
        report.codes[code] = report.codes.get(code, 0) + 1
        report.requests += 1
        if code in BAD_CODES:
            what = f"{rpc.service}.{rpc.method} -> {code}: {details[:300]!r}"
            report.bad.append(what)
            if strict:
                raise AssertionError(f"{what}\nrequest: {str(request)[:2000]}")

    try:
        if not rpc.request.DESCRIPTOR.fields:  # nothing to vary (Empty): the same request n times
            for _ in range(n):
                code, details = call_once(rpc, channel, rpc.request(), timeout_s, metadata)
                codes[code] = codes.get(code, 0) + 1
                report.codes[code] = report.codes.get(code, 0) + 1
                report.requests += 1
                if code in BAD_CODES:
                    report.bad.append(f"{rpc.service}.{rpc.method} -> {code}: {details[:300]!r}")
        else:
            one()
    finally:
        channel.close()


def stage_channel(stack: Any, plain: grpc.Channel) -> grpc.Channel:
    """A channel to a stage service that carries the operator's service identity, where this build has
    identities (mars.identity), so the requests reach the handlers; the plain channel otherwise."""
    try:
        from mars.identity import with_identity  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return plain
    caller = getattr(stack, "caller", None)
    return with_identity(plain, caller("operator") if caller is not None else None)  # type: ignore[no-any-return]


def ingress_channel(stack: Any, plain: grpc.Channel) -> grpc.Channel:
    """A channel to the public ingress that presents an API key of the fuzz tenant, where this build has
    API keys (mars.auth); the plain channel otherwise (or with --metadata KEY=VALUE for other schemes)."""
    try:
        from mars.auth import mint_key  # type: ignore[import-not-found, unused-ignore]
        from mars_ingress.client import ingress_channel as keyed  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return plain
    plain.close()
    key = mint_key(stack.env["MARS_POSTGRES_DSN"], TENANT, None, label="fuzz").key
    return keyed(stack.addr("ingress"), key)  # type: ignore[no-any-return]


def fuzz_rpcs(
    stack: Any,
    n: int,
    rpcs: Sequence[Rpc] = INTERNAL_RPCS,
    rng_seed: int = 1,
    strict: bool = False,
    log: Callable[[str], None] = print,
    metadata: Sequence[tuple[str, str]] = (),
) -> RpcReport:
    started = time.monotonic()
    report = RpcReport()
    exits_before = len([e for e in stack.events if e.kind == "exited"])
    per = max(1, n // len(rpcs))
    for k, rpc in enumerate(rpcs):
        count = per + (1 if k < n - per * len(rpcs) else 0)
        log(f"{rpc.service}.{rpc.method}: {count} requests")
        fuzz_rpc(stack, rpc, count, report, rng_seed + k, strict, metadata=metadata)
    report.crashes = [f"{e.name}: {e.detail}" for e in stack.events if e.kind == "exited"][exits_before:]
    report.crashes += [f"{name}: not running" for name, alive in stack.alive() if not alive]
    report.wall_s = time.monotonic() - started
    return report


# ---- command line ---------------------------------------------------------------------------------------


def start_stack(workdir: Path | None, log: Callable[[str], None]) -> Any:
    from mars_stack import LocalStack, StackSettings

    settings = StackSettings(
        workdir=workdir,
        model_pool=REPO / "config" / "models.standin.yaml",
        llm="standin",
        extra_env={
            "MARS_INGRESS_TURN_TIMEOUT_S": "60",
            "MARS_GATEWAY_TURN_TIMEOUT_S": "60",
            "MARS_MEMORY_READ_YOUR_WRITES_WAIT_S": "5",
        },
    )
    return LocalStack(settings).start(progress=log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--events", type=int, default=1000, help="fuzz events for the consumers (0: none)")
    parser.add_argument("--requests", type=int, default=10000, help="fuzz requests for the RPCs (0: none)")
    parser.add_argument(
        "--rpcs", choices=("internal", "ingress"), default="internal", help="which gRPC services to fuzz"
    )
    parser.add_argument(
        "--metadata", action="append", default=[], metavar="KEY=VALUE", help="gRPC metadata on every call"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--workdir", type=Path, help="keep the stack's data and logs here")
    args = parser.parse_args(argv)
    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[fuzz {time.monotonic() - started:6.1f}s] {msg}", flush=True)

    stack = start_stack(args.workdir, log)
    out: dict[str, Any] = {}
    failures: dict[str, int] = {}
    try:
        if args.events:
            consumers = fuzz_consumers(stack, args.events, args.seed, log)
            out["consumers"] = {**asdict(consumers), "failures": consumers.failures}
            failures.update({f"consumers.{k}": v for k, v in consumers.failures.items()})
            log(
                f"consumers: {consumers.events} events ({consumers.refused_by_broker} refused by the broker), "
                f"{consumers.must_dead_letter} malformed -> {consumers.dead_lettered} dead-lettered by every "
                f"reader; tolerated: {consumers.tolerated_handled} handled, {consumers.tolerated_dead_lettered} "
                f"dead-lettered; {consumers.dead_letters} dead letters in all; valid turns after: "
                f"{consumers.valid_turns - len(consumers.unanswered)}/{consumers.valid_turns} answered"
            )
            log(f"consumers: reasons {json.dumps(consumers.reasons)}")
        if args.requests:
            rpcs = INTERNAL_RPCS if args.rpcs == "internal" else INGRESS_RPCS
            metadata = [tuple(m.split("=", 1)) for m in args.metadata]
            report = fuzz_rpcs(stack, args.requests, rpcs, args.seed, log=log, metadata=metadata)  # type: ignore[arg-type]
            out["rpcs"] = {**asdict(report), "failures": report.failures}
            failures.update({f"rpcs.{k}": v for k, v in report.failures.items()})
            log(f"rpcs: {report.requests} requests in {report.wall_s:.0f}s, statuses {report.codes}")
            for method, codes in report.by_method.items():
                log(f"  {method}: {codes}")
    finally:
        stack.stop()
    out["failures"] = failures
    out["wall_s"] = time.monotonic() - started
    for name, value in failures.items():
        log(f"{name}: {value}")
    for section in ("consumers", "rpcs"):
        for key in (
            "not_dead_lettered",
            "vague_reasons",
            "handler_failures",
            "duplicate_effects",
            "bad",
            "crashes",
        ):
            for line in out.get(section, {}).get(key, [])[:10]:
                log(f"  {section}.{key}: {line}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0 if not any(failures.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
