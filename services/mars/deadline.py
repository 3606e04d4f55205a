"""A turn's deadline on the answer path: work for a turn whose caller has stopped waiting is skipped.

The ingress stamps every turn with `TurnEnvelope.deadline_ms` (epoch ms; 0 = none) and answers
DEADLINE_EXCEEDED when it passes. Under overload, stages work through a backlog of such turns, and every
millisecond spent on one is taken from a turn whose caller still waits. So each answer-path stage checks the
deadline first and, past it, passes the turn on without its work: state without the controller call, memory
an empty view without retrieval or the read-your-writes wait, the router no decision, dispatch no model call
(its Generated is FAILED, "deadline passed"). The turn still flows to its end, so the memory writer advances
the user's applied seq (the user's next view does not wait for it), the ingress records the failure, and
the judge rewards nothing. Counted as `mars.stage.expired` by stage.
"""

from __future__ import annotations

import logging
import time

from mars import metrics
from mars.v1 import events_pb2 as ev

log = logging.getLogger(__name__)


def passed(turn: ev.TurnEnvelope, stage: str, now_ms: float | None = None) -> bool:
    """True (counted and logged) when `turn`'s deadline passed before `stage` took it."""
    if not turn.deadline_ms:
        return False
    now = time.time() * 1000 if now_ms is None else now_ms
    late_ms = now - turn.deadline_ms
    if late_ms <= 0:
        return False
    log.info(
        "turn %s reached %s %.0f ms after its deadline: passed on without the work",
        turn.turn_id,
        stage,
        late_ms,
    )
    metrics.record_expired(stage)
    return True


def note(stage: str) -> str:
    """What a turn skipped this way says of itself (Generated.error)."""
    return f"the turn's deadline passed before the {stage} stage"
