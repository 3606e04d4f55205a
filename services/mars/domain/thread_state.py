"""The active-thread state: what the user is working on in the current thread — its subject, the
constraints they stated, and the latest version of the artifact or plan (paper s_t^active, Eq. 12).

Updated from each committed turn of the thread; rendered as the ACTIVE_STATE block of the view."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from mars.domain.state_rules import detect_cues
from mars.domain.text import enum_name
from mars.v1 import events_pb2 as ev

MAX_CONSTRAINTS = 6
MAX_ARTIFACT_CHARS = 1200


@dataclass(frozen=True)
class ThreadState:
    title: str
    constraints: tuple[str, ...] = ()
    artifact: str = ""
    version: int = 0
    turns: int = 0
    #: seq of the last turn folded in, so a redelivered turn is not applied twice.
    last_seq: int = 0
    phases: tuple[str, ...] = ()


def new_thread(first_user_text: str) -> ThreadState:
    return ThreadState(title=" ".join(first_user_text.split())[:200])


def fold_turn(
    thread: ThreadState, seq: int, user_text: str, answer: str, state: ev.SessionState
) -> ThreadState:
    """Fold one answered turn into the thread state (idempotent by seq)."""
    if seq <= thread.last_seq:
        return thread
    constraints = thread.constraints
    if "constraint" in detect_cues(user_text):
        constraints = (*constraints, " ".join(user_text.split())[:300])[-MAX_CONSTRAINTS:]
    artifact, version = thread.artifact, thread.version
    # The answer is a new version of the artifact on the thread's first turn and whenever the user
    # revises, constrains or asks for the synthesis; exploratory or verification turns leave it.
    if answer.strip() and (thread.version == 0 or state.phase in (ev.REVISE, ev.CONSTRAIN, ev.SYNTHESIZE)):
        artifact, version = answer.strip()[:MAX_ARTIFACT_CHARS], thread.version + 1
    return replace(
        thread,
        constraints=constraints,
        artifact=artifact,
        version=version,
        turns=thread.turns + 1,
        last_seq=seq,
        phases=(*thread.phases, enum_name(ev.Phase, state.phase))[-4:],
    )


def render_active_state(thread: ThreadState) -> str:
    lines = [f"Active thread: {thread.title} ({thread.turns} turn(s) so far)."]
    if thread.constraints:
        lines.append("Constraints stated by the user:")
        lines.extend(f"- {c}" for c in thread.constraints)
    if thread.artifact:
        lines.append(f"Latest version (v{thread.version}):")
        lines.append(thread.artifact)
    return "\n".join(lines)


def thread_to_json(thread: ThreadState) -> dict[str, Any]:
    return asdict(thread)


def thread_from_json(data: dict[str, Any]) -> ThreadState:
    return ThreadState(
        title=str(data.get("title", "")),
        constraints=tuple(data.get("constraints", ())),
        artifact=str(data.get("artifact", "")),
        version=int(data.get("version", 0)),
        turns=int(data.get("turns", 0)),
        last_seq=int(data.get("last_seq", 0)),
        phases=tuple(data.get("phases", ())),
    )
