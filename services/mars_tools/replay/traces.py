"""Turn traces from the event log: every stage event of a turn joined by `turn_id`, and the summary users
read to see what the system decided and what it cost.

Input is a stream of raw records (topic, partition, offset, timestamp, value) — from live topics or an
exported log file. Nothing here crashes on bad input: records that do not decode, envelopes of an unknown
schema version, duplicated events and truncated file lines are counted in the summary, and a turn whose
stages are not all present is reported as incomplete (with the first stage it lacks), never folded into
the metrics of complete turns.
"""

from __future__ import annotations

import base64
import itertools
import json
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import DecodeError, Message
from mars.config import (
    SCHEMA_VERSION,
    TOPIC_GENERATED,
    TOPIC_JUDGED,
    TOPIC_RECEIVED,
    TOPIC_ROUTED,
    TOPIC_STATE,
    TOPIC_VIEW,
)
from mars.data_keys import SyncKeyring, is_sealed
from mars.sealing import SealError
from mars.v1 import events_pb2 as ev

#: The stages of a turn in pipeline order, with their topic and event type.
STAGES: tuple[tuple[str, str, type[Message]], ...] = (
    ("received", TOPIC_RECEIVED, ev.TurnReceived),
    ("state", TOPIC_STATE, ev.StateEstimated),
    ("view", TOPIC_VIEW, ev.ViewBuilt),
    ("routed", TOPIC_ROUTED, ev.Routed),
    ("generated", TOPIC_GENERATED, ev.Generated),
    ("judged", TOPIC_JUDGED, ev.Judged),
)
TOPICS: tuple[str, ...] = tuple(topic for _, topic, _ in STAGES)
_BY_TOPIC = {topic: (name, cls) for name, topic, cls in STAGES}


@dataclass(frozen=True)
class RawRecord:
    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    value: bytes

    def to_json(self) -> str:
        return json.dumps(
            {
                "topic": self.topic,
                "partition": self.partition,
                "offset": self.offset,
                "timestamp_ms": self.timestamp_ms,
                "value": base64.b64encode(self.value).decode(),
            }
        )


def records_from_lines(lines: Iterable[str], counts: Counter[str]) -> Iterator[RawRecord]:
    """Records of an exported log file; unreadable (e.g. truncated) lines are counted, not raised."""
    for line in lines:
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            yield RawRecord(
                str(obj["topic"]),
                int(obj["partition"]),
                int(obj["offset"]),
                int(obj["timestamp_ms"]),
                base64.b64decode(obj["value"], validate=True),
            )
        except (ValueError, KeyError, TypeError):
            counts["unreadable_lines"] += 1


@dataclass
class Trace:
    turn_id: str
    events: dict[str, Message] = field(default_factory=dict)
    timestamps: dict[str, int] = field(default_factory=dict)
    corrections: list[ev.Judged] = field(default_factory=list)
    #: Some of its text is still sealed (read without the data keys).
    sealed: bool = False

    @property
    def failed(self) -> bool:
        generated = self.events.get("generated")
        return isinstance(generated, ev.Generated) and generated.status != ev.OK

    @property
    def missing(self) -> str | None:
        """The first stage this turn lacks; a failed generation is complete without a judgement."""
        for name, _, _ in STAGES:
            if name == "judged" and self.failed:
                return None
            if name not in self.events:
                return name
        return None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"turn_id": self.turn_id, "complete": self.missing is None}
        if self.missing:
            out["missing"] = self.missing
        for name, msg in self.events.items():
            out[name] = MessageToDict(msg, preserving_proto_field_name=True)
        if self.corrections:
            out["corrections"] = [
                MessageToDict(c, preserving_proto_field_name=True) for c in self.corrections
            ]
        return out


class TraceBuilder:
    """`keyring` opens the sealed user text of events (mars.sealing); without one, text stays sealed
    (counted as sealed_records) and everything else reads the same. With one, the turns of forgotten users
    (their data key deleted) are left out and counted: `forgotten` holds their turn ids."""

    def __init__(self, keyring: SyncKeyring | None = None) -> None:
        self.traces: dict[str, Trace] = {}
        self.counts: Counter[str] = Counter()
        self.keyring = keyring
        self.forgotten: set[str] = set()

    def add(self, record: RawRecord) -> None:
        stage = _BY_TOPIC.get(record.topic)
        if stage is None:
            self.counts["other_topic_records"] += 1
            return
        name, cls = stage
        try:
            msg = cls.FromString(record.value)
        except DecodeError:
            self.counts["undecodable_records"] += 1
            return
        turn = msg.turn  # type: ignore[attr-defined]
        if not turn.turn_id:
            self.counts["records_without_turn_id"] += 1
            return
        if turn.schema_version != SCHEMA_VERSION:
            self.counts["unknown_schema_version"] += 1
            return
        if isinstance(msg, ev.Generated) and msg.imported:
            self.counts["imported_records"] += 1  # recorded history: no stage of the pipeline ran for it
            return
        if not self._open(msg, turn):
            return
        self.counts["records"] += 1
        trace = self.traces.setdefault(turn.turn_id, Trace(turn.turn_id))
        trace.sealed = trace.sealed or (self.keyring is None and is_sealed(msg))
        if isinstance(msg, ev.Judged) and msg.correction:
            if any(c.correction_id == msg.correction_id for c in trace.corrections):
                self.counts["duplicate_events"] += 1
            else:
                trace.corrections.append(msg)
            return
        if name in trace.events:
            self.counts["duplicate_events"] += 1  # at-least-once delivery: the first one counts
            return
        trace.events[name] = msg
        trace.timestamps[name] = record.timestamp_ms

    def _open(self, msg: Message, turn: ev.TurnEnvelope) -> bool:
        """Unseal `msg` in place; False (counted) when it must be left out."""
        if turn.turn_id in self.forgotten:
            self.counts["forgotten_records"] += 1
            return False
        if self.keyring is None:
            if is_sealed(msg):
                self.counts["sealed_records"] += 1  # no keys here: text stays sealed, the rest reads
            return True
        if turn.data_key_id and self.keyring.key(turn.data_key_id) is None:
            # Every event of the turn names the key, sealed or not (a judgement has no text): all go.
            self.counts["forgotten_records"] += 1
            self.forgotten.add(turn.turn_id)
            self.traces.pop(turn.turn_id, None)
            return False
        try:
            self.keyring.unseal(msg)
        except SealError:
            self.counts["unsealable_records"] += 1
            return False
        return True


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1 if q else 0)]


def summarize(builder: TraceBuilder) -> dict[str, Any]:
    """Turns, failures, fallbacks, stage latencies, the paper's two cost views, rewards and routing shares
    by state slice (paper Table 24) — over complete traces only; incomplete ones are counted apart."""
    traces = list(builder.traces.values())
    complete = [t for t in traces if t.missing is None]
    incomplete = Counter(t.missing for t in traces if t.missing is not None)
    answered = [t for t in complete if not t.failed]
    hops: dict[str, list[float]] = {}
    for t in complete:
        names = [n for n, _, _ in STAGES if n in t.timestamps]
        for prev, cur in itertools.pairwise(names):
            hops.setdefault(f"{prev}->{cur}", []).append(float(t.timestamps[cur] - t.timestamps[prev]))
    gen_cost = sum(t.events["generated"].cost_usd for t in complete)  # type: ignore[attr-defined]
    ctrl_cost = sum(t.events["state"].state.usage.cost_usd for t in complete)  # type: ignore[attr-defined]
    judge_cost = sum(t.events["judged"].judge_cost_usd for t in answered)  # type: ignore[attr-defined]
    rewards = [float(t.events["judged"].reward) for t in answered]  # type: ignore[attr-defined]
    utilities = [float(t.events["judged"].utility) for t in answered]  # type: ignore[attr-defined]
    fallbacks = sum(
        1
        for t in answered
        if len(t.events["generated"].attempts) > 1  # type: ignore[attr-defined]
    )
    return {
        "turns": len(traces),
        "complete": len(complete),
        # Turns of forgotten users (data key deleted): left out of everything below.
        "forgotten_turns": len(builder.forgotten),
        "incomplete": dict(incomplete),
        "failed": sum(t.failed for t in complete),
        "fallbacks": fallbacks,
        "corrections": sum(len(t.corrections) for t in traces),
        "records": dict(builder.counts),
        "stage_latency_ms": {
            hop: {"p50": _pct(v, 50), "p99": _pct(v, 99), "n": len(v)} for hop, v in sorted(hops.items())
        },
        "cost_usd": {
            "generation_controller": gen_cost + ctrl_cost,
            "feedback_inclusive": gen_cost + ctrl_cost + judge_cost,
            "generator": gen_cost,
            "controller": ctrl_cost,
            "judge": judge_cost,
        },
        "reward": {
            "mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "p50": _pct(rewards, 50),
            "mean_utility": sum(utilities) / len(utilities) if utilities else 0.0,
        },
        "routing_share": routing_shares(answered),
    }


def routing_shares(traces: list[Trace]) -> dict[str, dict[str, float]]:
    """Share of each answering model within a state slice: retrieval scope, phase, and the top third of
    turns by candidate-view tokens (paper Table 24)."""
    if not traces:
        return {}
    tokens = sorted(t.events["view"].view.load.estimated_tokens for t in traces)  # type: ignore[attr-defined]
    cut = tokens[(2 * len(tokens)) // 3] if len(tokens) >= 3 else tokens[-1] + 1
    slices: dict[str, Counter[str]] = {}
    for t in traces:
        state = t.events["routed"].state  # type: ignore[attr-defined]
        model = t.events["generated"].model  # type: ignore[attr-defined]
        view_tokens = t.events["view"].view.load.estimated_tokens  # type: ignore[attr-defined]
        keys = [
            f"scope={ev.RetrievalScope.Name(state.retrieval_scope)}",
            f"phase={ev.Phase.Name(state.phase)}",
        ]
        if view_tokens >= cut:
            keys.append("memory_tokens=top_third")
        for key in keys:
            slices.setdefault(key, Counter())[model] += 1
    return {
        key: {model: n / sum(counter.values()) for model, n in sorted(counter.items())}
        for key, counter in sorted(slices.items())
    }
