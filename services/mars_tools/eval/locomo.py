"""`mars eval locomo`: LoCoMo through a running pipeline's ingress.

Each conversation is one user. Its turns go into memory in order as user turns (one session id per LoCoMo
session, the date and speaker in the text, as `mars bench locomo` stores them): imported as recorded by
default (`Ingress.ImportHistory`, no replies), or sent and answered one by one (`--history send`); then
every question is sent in a session of its own. Evidence recall at turn and session level is recomputed from the view the
pipeline logged for each question: its stored-turn blocks in view order, each mapped back to the LoCoMo
dialogue id of the turn it came from. Blocks from anything else (an earlier question) keep their slot and
count as non-evidence. Answers are saved for an external judge.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mars.v1 import services_pb2 as svc

from mars_tools.bench.locomo import Conversation, LocomoQuestion, score_question
from mars_tools.eval.driver import IngressDriver, PipelineTarget, SentTurn, distinct, failures, shown_sources

QUESTION_SESSION = "questions"


@dataclass(frozen=True)
class AnsweredQuestion:
    sample_id: str
    question: LocomoQuestion
    sent: SentTurn

    def to_json(self) -> dict[str, Any]:
        return {
            "sample_id": self.sample_id,
            "question": self.question.question,
            "category": self.question.category,
            "evidence": sorted(self.question.evidence),
            "answer": self.sent.answer,
            "model": self.sent.model,
            "turn_id": self.sent.turn_id,
            "cost_usd": self.sent.cost_usd,
            "error": self.sent.error,
        }


@dataclass
class LocomoEval:
    by_category: dict[int, list[dict[str, float]]]
    answered: list[AnsweredQuestion]
    turns_sent: int
    turns_failed: int
    views_missing: int
    #: LoCoMo turns newly imported as recorded (0 with --history send).
    turns_imported: int = 0

    def write(self, folder: Path, report: dict[str, dict[str, float]]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "answers.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(a.to_json()) + "\n" for a in self.answered)
        summary = {
            "turns_sent": self.turns_sent,
            "turns_failed": self.turns_failed,
            "turns_imported": self.turns_imported,
            "questions": len(self.answered),
            "views_missing": self.views_missing,
            "by_category": report,
        }
        (folder / "results.json").write_text(json.dumps(summary, indent=2))


def truncate(conv: Conversation, max_sessions: int | None, max_questions: int | None) -> Conversation:
    """The conversation's first `max_sessions` sessions and the questions whose evidence lies within them."""
    turns = conv.turns if max_sessions is None else [t for t in conv.turns if t.session <= max_sessions]
    kept = {t.dia_id for t in turns}
    questions = [q for q in conv.questions if q.evidence <= kept]
    return Conversation(conv.sample_id, turns, questions[:max_questions] if max_questions else questions)


def drive_conversation(
    driver: IngressDriver,
    conv: Conversation,
    on_turn: Callable[[], None] = lambda: None,
    import_history: bool = True,
) -> tuple[dict[str, str], list[AnsweredQuestion]]:
    """The conversation into memory, then its questions; pipeline turn id -> dialogue id, and the answers.

    With `import_history` the turns are imported as recorded (ImportHistory: each turn a user text with no
    reply, keyed by its dialogue id); without it each is sent and answered by the pipeline."""
    dia_of: dict[str, str] = {}
    if import_history:
        recorded = [
            svc.RecordedTurn(session_id=f"session_{t.session}", user_text=t.text, key=t.dia_id)
            for t in conv.turns
        ]
        if recorded:
            turn_ids = driver.import_history(recorded)
            dia_of.update(zip(turn_ids, (t.dia_id for t in conv.turns), strict=True))
        for _ in conv.turns:
            on_turn()
    else:
        for turn in conv.turns:
            sent = driver.send(f"session_{turn.session}", turn.text)
            if sent.ok:
                dia_of[sent.turn_id] = turn.dia_id
            on_turn()
    answered = []
    for q in conv.questions:
        answered.append(AnsweredQuestion(conv.sample_id, q, driver.send(QUESTION_SESSION, q.question)))
        on_turn()
    return dia_of, answered


def run_eval(
    conversations: Sequence[Conversation],
    target: PipelineTarget,
    on_turn: Callable[[], None] = lambda: None,
    import_history: bool = True,
) -> LocomoEval:
    dia_of: dict[str, str] = {}
    answered: list[AnsweredQuestion] = []
    sent: list[SentTurn] = []
    imported = 0
    for conv in conversations:
        with target.user(conv.sample_id, sent) as driver:
            mapping, answers = drive_conversation(driver, conv, on_turn, import_history)
            imported += driver.imported
        dia_of.update(mapping)
        answered += answers
    views = target.views(a.sent for a in answered)
    by_category: dict[int, list[dict[str, float]]] = defaultdict(list)
    missing = 0
    for a in answered:
        view = views.get(a.sent.turn_id) if a.sent.ok else None
        if view is None:
            # Scored as retrieving nothing: a lost view must not vanish from the averages.
            missing += 1
            by_category[a.question.category].append(score_question([], a.question.evidence))
            continue
        ranked = distinct(
            dia_of.get(b.source_turn_id, f"other:{b.source_turn_id}") for b in shown_sources(view)
        )
        by_category[a.question.category].append(score_question(ranked, a.question.evidence))
    return LocomoEval(dict(by_category), answered, len(sent), failures(sent), missing, imported)
