"""Recorded history import (`Ingress.ImportHistory`): the pure part. Which turn id a recorded pair gets
(stable across imports, so importing again stores nothing new), where its threads start, the state it is
stored under, and the checks a request passes before anything is written."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from mars.auth import ID_PATTERN
from mars.domain.text import control_character
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc

#: Pairs one call may import (a larger history is sent in several calls, in order).
MAX_TURNS_PER_CALL = 2000
#: A recorded text (either side) may be this many times longer than a live turn's limit.
RECORDED_TEXT_FACTOR = 4
#: ControllerUsage.backend of an imported turn's state: no controller saw it.
IMPORTED_BACKEND = "imported"
#: User turns of the last imported thread written as the state service's active context (it keeps its
#: own MARS_STATE_CONTEXT_TURNS of them).
CONTEXT_TURNS = 20

class InvalidHistory(ValueError):
    """A request that imports nothing: the message says which pair and why."""


@dataclass(frozen=True)
class ImportedPair:
    turn_id: str
    key: str
    session_id: str
    user_text: str
    assistant_text: str
    #: First pair of a thread (the first of the call, and each change of session).
    new_thread: bool


def pair_keys(turns: Sequence[svc.RecordedTurn]) -> list[str]:
    """Each pair's key: the caller's, or one derived from its session, its texts and how many times that
    same pair came before in the call (so a repeated exchange stays two pairs, and the same call made again
    gives the same keys)."""
    seen: Counter[str] = Counter()
    keys: list[str] = []
    for turn in turns:
        if turn.key:
            keys.append(turn.key)
            continue
        digest = hashlib.sha256(
            "\x1f".join((turn.session_id, turn.user_text, turn.assistant_text)).encode()
        ).hexdigest()[:32]
        seen[digest] += 1
        keys.append(f"auto:{digest}:{seen[digest]}")
    return keys


def imported_turn_id(tenant: str, user_id: str, key: str) -> str:
    """The turn id of a user's pair with `key`: the same on every import, different for every user."""
    return "imp" + hashlib.sha256("\x1f".join((tenant, user_id, key)).encode()).hexdigest()[:29]


def _text_problem(text: str, limit: int) -> str | None:
    if not text.strip():
        return "is empty"
    if len(text) > limit:
        return f"has {len(text)} characters; the limit is {limit}"
    found = control_character(text)
    if found is not None:
        return f"contains the control character U+{ord(text[found]):04X} at position {found}"
    return None


def _pair_problem(turn: svc.RecordedTurn, max_text_chars: int) -> str | None:
    """What is wrong with a recorded pair's texts ("user_text is empty"), or None. Recorded text is memory,
    not a prompt: either side may run to RECORDED_TEXT_FACTOR times a live turn's limit (a pasted
    document); a user turn may have gone unanswered (empty assistant_text)."""
    limit = max_text_chars * RECORDED_TEXT_FACTOR
    problem = _text_problem(turn.user_text, limit)
    if problem is not None:
        return f"user_text {problem}"
    if turn.assistant_text:
        problem = _text_problem(turn.assistant_text, limit)
        if problem is not None:
            return f"assistant_text {problem}"
    return None


def check_history(
    tenant: str, user_id: str, turns: Sequence[svc.RecordedTurn], max_text_chars: int
) -> list[ImportedPair]:
    """The pairs of a request, or InvalidHistory naming the first bad one (nothing is imported then)."""
    if not turns:
        raise InvalidHistory("turns is empty: nothing to import")
    if len(turns) > MAX_TURNS_PER_CALL:
        raise InvalidHistory(
            f"{len(turns)} turns in one call; the limit is {MAX_TURNS_PER_CALL} (send the rest in later calls)"
        )
    keys = pair_keys(turns)
    first_at: dict[str, int] = {}
    pairs: list[ImportedPair] = []
    previous_session: str | None = None
    for i, (turn, key) in enumerate(zip(turns, keys, strict=True)):
        where = f"turns[{i}]"
        session = turn.session_id or "default"
        if not ID_PATTERN.match(session):
            raise InvalidHistory(f"{where}.session_id must match {ID_PATTERN.pattern}")
        problem = _pair_problem(turn, max_text_chars)
        if problem is not None:
            raise InvalidHistory(f"{where}.{problem}")
        if turn.key and (len(turn.key) > 200 or _text_problem(turn.key, 200) is not None):
            raise InvalidHistory(f"{where}.key must be 1..200 printable characters")
        if key in first_at:
            raise InvalidHistory(f"{where}.key {key!r} repeats turns[{first_at[key]}].key")
        first_at[key] = i
        pairs.append(
            ImportedPair(
                turn_id=imported_turn_id(tenant, user_id, key),
                key=key,
                session_id=session,
                user_text=turn.user_text,
                assistant_text=turn.assistant_text,
                new_thread=session != previous_session,
            )
        )
        previous_session = session
    return pairs


def imported_state(pair: ImportedPair, thread_depth: int) -> ev.SessionState:
    """The state an imported pair is stored under: a new thread at its start, the thread continued after
    (the memory writer opens and folds threads by it); the rest is the schema's neutral value."""
    return ev.SessionState(
        action=ev.NEW_TOPIC if pair.new_thread else ev.MATCH,
        usage=ev.ControllerUsage(backend=IMPORTED_BACKEND),
        thread_depth=thread_depth,
    )


def thread_depths(pairs: Sequence[ImportedPair]) -> list[int]:
    """Depth of each pair in its thread (1 at a thread's first pair)."""
    depths: list[int] = []
    for pair in pairs:
        depths.append(1 if pair.new_thread or not depths else depths[-1] + 1)
    return depths


def last_thread_context(pairs: Sequence[ImportedPair]) -> tuple[list[str], int]:
    """The user turns of the thread the import leaves active (the last CONTEXT_TURNS of them) and its depth."""
    start = max((i for i, p in enumerate(pairs) if p.new_thread), default=0)
    texts = [p.user_text for p in pairs[start:]]
    return texts[-CONTEXT_TURNS:], len(texts)


def text_digest(tenant: str, user_id: str, session_id: str, user_text: str) -> str:
    """A user turn's content digest within its session: how a turn that carries its conversation's earlier
    messages (`TurnRequest.history`) finds the ones MARS holds already, answered or imported."""
    return hashlib.sha256("\x1f".join((tenant, user_id, session_id, user_text)).encode()).hexdigest()[:32]


def unheld_turns(
    session_id: str, turns: Sequence[svc.RecordedTurn], digests: Sequence[str], held: Counter[str]
) -> list[svc.RecordedTurn]:
    """The earlier pairs of a turn's conversation that MARS does not hold, in order, each in the turn's
    session. `digests` are the turns' `text_digest`s, `held` counts the session's turns by digest: a user
    text sent n times and held m times has its first m occurrences taken as held (a repeated "yes" is each
    its own turn)."""
    left = Counter(held)
    out: list[svc.RecordedTurn] = []
    for turn, digest in zip(turns, digests, strict=True):
        if left[digest] > 0:
            left[digest] -= 1
            continue
        out.append(
            svc.RecordedTurn(
                session_id=session_id, user_text=turn.user_text, assistant_text=turn.assistant_text
            )
        )
    return out


def check_turn_history(turns: Sequence[svc.RecordedTurn], session_id: str, max_text_chars: int) -> None:
    """InvalidHistory naming the first bad pair of a turn's `history` (nothing is written then)."""
    if len(turns) > MAX_TURNS_PER_CALL:
        raise InvalidHistory(f"history has {len(turns)} pairs; the limit is {MAX_TURNS_PER_CALL}")
    for i, turn in enumerate(turns):
        if turn.session_id and turn.session_id != session_id:
            raise InvalidHistory(f"history[{i}].session_id differs from the turn's; leave it empty")
        if turn.key:
            raise InvalidHistory(f"history[{i}].key is not used here; leave it empty")
        problem = _pair_problem(turn, max_text_chars)
        if problem is not None:
            raise InvalidHistory(f"history[{i}].{problem}")
