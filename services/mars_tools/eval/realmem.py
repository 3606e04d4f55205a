"""`mars eval realmem`: RealMem through a running pipeline's ingress.

Each persona is one user, its timeline played in list order with the RealMem session uuid as the session
id, so memory grows exactly as the protocol says: a query can only be answered from sessions before it.
By default every recorded turn pair but the scored queries is imported as recorded (`Ingress.ImportHistory`,
through the memory service's normal commit path) and only the scored queries are sent (`SendTurn`); with
`--history send` every user turn is sent and memory holds the pipeline's own answers, as in a live
deployment. For each scored query the retrieval metrics of `shared/bench/realmem/PROTOCOL.md` are
recomputed from the view the pipeline logged: its pre-packing ranking of sessions (the query's own left
out; the stored-turn blocks in view order when it has none), scored with the strict scorer of `mars bench
realmem`. The answers are saved for an external judge.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc

from mars_tools.bench.realmem import Persona, Prediction, Query, Results, evaluate
from mars_tools.eval.driver import IngressDriver, PipelineTarget, SentTurn, distinct, failures, shown_sources


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
    driver: IngressDriver,
    persona: Persona,
    on_session: Callable[[int], None] = lambda _: None,
    import_history: bool = True,
) -> list[AnsweredQuery]:
    """Play `persona`'s timeline through the ingress; the scored queries with their answers.

    With `import_history` every recorded turn pair is imported as recorded (ImportHistory, in the order
    they happened, waiting until memory holds them before the next query), and only the scored queries
    are sent, with remember=false (the driver's options): memory then holds the recorded conversation,
    each query's recorded pair imported after it is asked. Without it every user turn is sent, answered
    and remembered by the pipeline."""
    by_session: dict[int, list[Query]] = {}
    for q in persona.queries:
        by_session.setdefault(q.session_position, []).append(q)
    answered: list[AnsweredQuery] = []
    recorded: list[svc.RecordedTurn] = []
    for session in persona.sessions:
        pending = {q.text: q for q in by_session.get(session.position, [])}
        turns = session.turns
        for j, turn in enumerate(turns):
            if turn.speaker != "User" or not turn.text.strip():
                continue
            nxt = turns[j + 1] if j + 1 < len(turns) and turns[j + 1].speaker == "Assistant" else None
            query = pending.pop(turn.text.strip(), None)
            if import_history and query is None:
                recorded.append(
                    svc.RecordedTurn(
                        session_id=session.uuid, user_text=turn.text, assistant_text=nxt.text if nxt else ""
                    )
                )
                continue
            if recorded:
                driver.import_history(recorded)
                recorded = []
            sent = driver.send(session.uuid, turn.text)
            if query is not None:
                answered.append(AnsweredQuery(query, sent, nxt.text if nxt else ""))
            if import_history:
                # The query was asked with remember=false: memory gets the recorded pair instead, as the
                # protocol's timeline holds it (the pipeline's own answer would stand in for the reply).
                recorded.append(
                    svc.RecordedTurn(
                        session_id=session.uuid, user_text=turn.text, assistant_text=nxt.text if nxt else ""
                    )
                )
        on_session(session.position + 1)
    return answered


def view_ranking(view: ev.CandidateView, own_session: str) -> list[str]:
    """The sessions a view ranked, best first, the query's own left out: the retrieval's pre-packing
    ranking when the view carries one, else the sessions of its stored-turn blocks in view order."""
    if view.ranking:
        return distinct(r.session_id for r in view.ranking if r.session_id != own_session)
    return distinct(b.source_session_id for b in shown_sources(view, exclude_session=own_session))


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
        ranking = view_ranking(view, a.sent.session_id)
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
    #: Recorded pairs newly imported (0 with --history send).
    pairs_imported: int = 0

    def write(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "predictions.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(p.to_json() + "\n" for p in self.predictions)
        with open(folder / "answers.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(a.to_json()) + "\n" for a in self.answered)
        summary = {
            "turns_sent": self.turns_sent,
            "turns_failed": self.turns_failed,
            "pairs_imported": self.pairs_imported,
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
    import_history: bool = True,
) -> RealMemEval:
    answered: list[AnsweredQuery] = []
    sent: list[SentTurn] = []
    imported = 0
    for persona in personas:
        with target.user(persona.name, sent) as driver:
            progress = functools.partial(on_session, persona.name)
            answered += drive_persona(driver, persona, progress, import_history)
            imported += driver.imported
    predictions, missing = predictions_from_views(answered, target.views(a.sent for a in answered))
    results = evaluate(personas, predictions)
    return RealMemEval(results, predictions, answered, len(sent), failures(sent), missing, imported)
