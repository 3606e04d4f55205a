"""The hand-labelled QTM turn set (labels/turns.jsonl, labelled by labels/GUIDE.md): its Table 5 fields
and values, and its loader, which gives each turn the gold active thread as context. Read by
`mars probe qtm-labels` (scoring) and `mars train qtm` (the learned controller)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mars.v1 import events_pb2 as ev

#: The labelled set kept in the repository.
DEFAULT_LABELS = Path(__file__).resolve().parent / "labels" / "turns.jsonl"
#: Earlier user turns shown as active context (the state service's default MARS_STATE_CONTEXT_TURNS).
CONTEXT_TURNS = 6

#: Field -> the allowed gold values (Table 5).
FIELDS: dict[str, tuple[str, ...]] = {
    "action": ("MATCH", "NEW_TOPIC"),
    "query_type": ("STATIC", "DYNAMIC", "TEMPORAL", "PROACTIVE"),
    "phase": ("EXPLORE", "CONSTRAIN", "REVISE", "SYNTHESIZE", "VERIFY"),
    "need_memory": ("0", "1"),
    "memory_span": ("NONE", "ACTIVE_THREAD", "CROSS_SESSION"),
    "retrieval_scope": ("LOCAL", "GLOBAL"),
    "ambiguity": ("LOW", "MEDIUM", "HIGH"),
}


#: Column headings of the per-field accuracy tables (`mars probe qtm-labels`, `mars train qtm`).
FIELD_COLUMNS = {"action": "action", "query_type": "qtype", "phase": "phase", "need_memory": "need",
                 "memory_span": "span", "retrieval_scope": "scope", "ambiguity": "ambig"}  # fmt: skip


def accuracy_header(first: str) -> str:
    return f"{first:<28}" + "".join(f"{FIELD_COLUMNS[f]:>8}" for f in FIELDS)


def accuracy_row(label: str, accuracy: dict[str, float]) -> str:
    return f"{label:<28}" + "".join(f"{accuracy[f]:>8.3f}" for f in FIELDS)


class LabelError(ValueError):
    """A labelled-set line that is not usable, with its line number."""


@dataclass(frozen=True)
class LabelledTurn:
    persona: str
    session: str
    index: int
    text: str
    labels: dict[str, str]
    #: The gold active thread before the turn, as the state service would hold it: the persona's user
    #: turns since the last gold NEW_TOPIC before this turn, across sessions (newest last).
    context: tuple[str, ...]

    @property
    def opens_session(self) -> bool:
        """The first turn of a session after earlier turns (as the state service tells it)."""
        return self.index == 0 and bool(self.context)


def load_labelled(lines: Iterable[str]) -> list[LabelledTurn]:
    """The labelled turns in file order, each with its gold active context. LabelError names the line of
    the first problem (bad JSON, a missing field, a value outside Table 5)."""
    raw: list[tuple[int, dict[str, Any]]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            labels = {k: str(obj["labels"][k]) for k in FIELDS}
            persona, session, text = str(obj["persona"]), str(obj["session"]), str(obj["text"])
            index = int(obj["index"])
        except (ValueError, KeyError, TypeError) as exc:
            raise LabelError(f"line {number}: {type(exc).__name__}: {exc}") from exc
        for field, value in labels.items():
            if value not in FIELDS[field]:
                raise LabelError(f"line {number}: {field}={value!r} is not one of {', '.join(FIELDS[field])}")
        raw.append(
            (number, {"persona": persona, "session": session, "index": index, "text": text, "labels": labels})
        )
    out: list[LabelledTurn] = []
    # One active thread per persona, across its sessions, as the state service keeps one per user: a
    # turn is seen with the thread before it (a NEW_TOPIC turn too: the switch is what it must detect).
    thread: dict[str, list[str]] = {}
    for _, item in sorted(
        raw, key=lambda r: (r[1]["persona"], _session_order(r[1]["session"]), r[1]["index"], r[0])
    ):
        active = thread.setdefault(item["persona"], [])
        context = tuple(active[-CONTEXT_TURNS:])
        out.append(
            LabelledTurn(
                item["persona"], item["session"], item["index"], item["text"], item["labels"], context
            )
        )
        if item["labels"]["action"] == "NEW_TOPIC":
            active.clear()
        active.append(item["text"])
    return out


def consistency_problems(turns: Sequence[LabelledTurn]) -> list[str]:
    """The labelling guide's consistency rules that `turns` (as `load_labelled` gives them) break, one line
    each naming the turn; empty when the set is consistent."""
    problems: list[str] = []
    seen_personas: set[str] = set()
    for t in turns:
        lab, where = t.labels, f"{t.session}#{t.index}"
        need, span, scope = lab["need_memory"], lab["memory_span"], lab["retrieval_scope"]
        if (span == "NONE") != (need == "0"):
            problems.append(f"{where}: rule 1: memory_span NONE iff need_memory 0 ({span}, {need})")
        if scope == "GLOBAL" and need != "1":
            problems.append(f"{where}: rule 1: GLOBAL scope needs memory")
        if (span == "CROSS_SESSION") != (scope == "GLOBAL"):
            problems.append(f"{where}: rule 2: CROSS_SESSION iff GLOBAL ({span}, {scope})")
        if lab["action"] == "NEW_TOPIC" and (lab["phase"] in ("REVISE", "VERIFY") or span == "ACTIVE_THREAD"):
            problems.append(f"{where}: rule 3: NEW_TOPIC with {lab['phase']} / {span}")
        if t.index == 0 and (
            span == "ACTIVE_THREAD" or (lab["action"] == "MATCH" and span != "CROSS_SESSION")
        ):
            problems.append(f"{where}: rule 4: a session's first turn is {lab['action']} / {span}")
        if t.persona not in seen_personas:
            seen_personas.add(t.persona)
            if lab["action"] != "NEW_TOPIC" or need != "0":
                problems.append(f"{where}: rule 5: a persona's first turn is NEW_TOPIC without memory")
    return problems


def _session_order(session: str) -> tuple[str, int]:
    """Sessions in time order: "p01-s10" after "p01-s9" (the number after the last "s")."""
    head, _, number = session.rpartition("s")
    return (head, int(number)) if number.isdigit() else (session, 0)


def read_labelled(path: Path) -> tuple[bytes, list[LabelledTurn]]:
    """The file's bytes (to fingerprint a training run) and its labelled turns; LabelError, with the path
    or the line, when it cannot be read or used."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise LabelError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        return raw, load_labelled(raw.decode().splitlines())
    except UnicodeDecodeError as exc:
        raise LabelError(f"{path} is not UTF-8 text") from exc


def state_labels(state: ev.SessionState) -> dict[str, str]:
    """A state in the labelled set's terms."""
    return {
        "action": ev.Action.Name(state.action),
        "query_type": ev.QueryType.Name(state.query_type),
        "phase": ev.Phase.Name(state.phase),
        "need_memory": str(state.taxonomy.need_memory),
        "memory_span": ev.MemorySpan.Name(state.taxonomy.memory_span),
        "retrieval_scope": ev.RetrievalScope.Name(state.retrieval_scope),
        "ambiguity": ev.Ambiguity.Name(state.taxonomy.ambiguity),
    }
