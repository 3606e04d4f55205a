"""`mars eval realmem`: RealMem through a running pipeline's ingress.

Each persona is one user. Its sessions are sent in list order, every user turn as a `SendTurn` with the
RealMem session uuid as the session id, so memory grows exactly as the protocol's timeline says: a query
can only be answered from sessions sent before it. The memory then holds the pipeline's own answers (as
in a live deployment), not the recorded assistant replies. For each scored query the retrieval metrics of
`shared/bench/realmem/PROTOCOL.md` are recomputed from the view the pipeline logged: its stored-turn
blocks, in view order, give the ranking of source sessions (the query's own session left out), scored
with the strict scorer of `mars bench realmem`. The answers are saved for an external judge.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mars.bench.realmem import Persona, Prediction, Query, Results, evaluate
from mars.eval.driver import IngressDriver, PipelineTarget, SentTurn, distinct, failures, shown_sources


@dataclass(frozen=True)
class AnsweredQuery:
    query: Query
    sent: SentTurn
    reference_answer: str

    def to_json(self) -> dict[str, Any]:
        return {
            "persona": self.query.persona,
            "query_id": self.query.query_id,
            "query": self.query.text,
            "answer": self.sent.answer,
            "model": self.sent.model,
            "reference_answer": self.reference_answer,
            "turn_id": self.sent.turn_id,
            "cost_usd": self.sent.cost_usd,
            "latency_ms": round(self.sent.latency_ms, 1),
            "error": self.sent.error,
        }


def truncate(persona: Persona, max_sessions: int | None) -> Persona:
    """The persona's first `max_sessions` sessions and the scored queries inside them."""
    if max_sessions is None or max_sessions >= len(persona.sessions):
        return persona
    return dataclasses.replace(
        persona,
        sessions=persona.sessions[:max_sessions],
        queries=[q for q in persona.queries if q.session_position < max_sessions],
    )


def drive_persona(
    driver: IngressDriver, persona: Persona, on_session: Callable[[int], None] = lambda _: None
) -> list[AnsweredQuery]:
    """Send every user turn of `persona` in list order; the scored queries with their answers."""
    by_session: dict[int, list[Query]] = {}
    for q in persona.queries:
        by_session.setdefault(q.session_position, []).append(q)
    answered: list[AnsweredQuery] = []
    for session in persona.sessions:
        pending = {q.text: q for q in by_session.get(session.position, [])}
        turns = session.turns
        for j, turn in enumerate(turns):
            if turn.speaker != "User" or not turn.text.strip():
                continue
            sent = driver.send(session.uuid, turn.text)
            query = pending.pop(turn.text.strip(), None)
            if query is not None:
                nxt = turns[j + 1] if j + 1 < len(turns) and turns[j + 1].speaker == "Assistant" else None
                answered.append(AnsweredQuery(query, sent, nxt.text if nxt else ""))
        on_session(session.position + 1)
    return answered


def predictions_from_views(
    answered: Sequence[AnsweredQuery], views: dict[str, Any]
) -> tuple[list[Prediction], int]:
    """One prediction per query whose view was logged (ranked source sessions); and how many had none."""
    out: list[Prediction] = []
    missing = 0
    for a in answered:
        view = views.get(a.sent.turn_id) if a.sent.ok else None
        if view is None:
            missing += 1
            continue
        own = a.sent.session_id
        ranking = distinct(b.source_session_id for b in shown_sources(view, exclude_session=own))
        out.append(Prediction(a.query.persona, a.query.query_id, ranking))
    return out, missing


@dataclass
class RealMemEval:
    results: Results
    predictions: list[Prediction]
    answered: list[AnsweredQuery]
    turns_sent: int
    turns_failed: int
    views_missing: int

    def write(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "predictions.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(p.to_json() + "\n" for p in self.predictions)
        with open(folder / "answers.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(a.to_json()) + "\n" for a in self.answered)
        summary = {
            "turns_sent": self.turns_sent,
            "turns_failed": self.turns_failed,
            "scored_queries": len(self.answered),
            "views_missing": self.views_missing,
            "macro": self.results.macro.values,
            "pooled": self.results.pooled.values,
            "per_persona": {name: v.values for name, v in self.results.per_persona.items()},
        }
        (folder / "results.json").write_text(json.dumps(summary, indent=2, default=str))


def run_eval(
    personas: Sequence[Persona],
    target: PipelineTarget,
    on_session: Callable[[str, int], None] = lambda _p, _n: None,
) -> RealMemEval:
    answered: list[AnsweredQuery] = []
    sent: list[SentTurn] = []
    for persona in personas:
        with target.user(persona.name, sent) as driver:
            answered += drive_persona(driver, persona, functools.partial(on_session, persona.name))
    predictions, missing = predictions_from_views(answered, target.views(a.sent for a in answered))
    results = evaluate(personas, predictions)
    return RealMemEval(results, predictions, answered, len(sent), failures(sent), missing)
