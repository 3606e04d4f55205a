"""RealMem session-retrieval benchmark core: loader, online replay, strict scorer, aggregation, baselines.

Follows shared/bench/realmem/PROTOCOL.md (written from the official RealMemBench code):

* Unit of retrieval = one whole session, named by its ``session_uuid``.
* Timeline = list order of ``dialogues``. For each session, every scored query in it is answered first,
  from the sessions before it (the pool), and only then is the whole session added to memory.
* Scored queries = ``is_query`` User turns whose immediately following Assistant turn cites known sessions in
  ``memory_session_uuids`` (fallback ``memory_used[*].session_uuid``).
* Metrics = recall_any@k, recall_all@k and ndcg_any@k with the LongMemEval discount (ranks 1 and 2 weigh 1,
  rank j >= 2 weighs 1/log2(j)); IDCG over min(|G|, k) ones; gold outside the pool stays in G.
* Strict deviations from the official scorer: an id outside the pool (unknown or future) keeps its slot,
  counts as non-relevant and is flagged as a leak; a repeated id keeps its first occurrence, later copies
  are non-relevant slots; a query without a prediction scores 0.

Retrievers see only text, time and order: the loader keeps no topic, category or session identifier, and
``replay`` hands each query to the retriever with its gold set blanked.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mars.domain.bm25 import BM25Index

FILE_SUFFIX = "_dialogues_256k.json"
DEFAULT_KS: tuple[int, ...] = (5, 10, 20)
METRICS: tuple[str, ...] = ("recall_any", "recall_all", "ndcg_any")


# --------------------------------------------------------------------------------------------- data model


@dataclass(frozen=True)
class Turn:
    speaker: str
    text: str


@dataclass(frozen=True)
class Session:
    uuid: str
    position: int
    time: str
    turns: tuple[Turn, ...]

    @property
    def text(self) -> str:
        """All turns, speaker-prefixed, one per line: "User: ...\\nAssistant: ..."."""
        return "\n".join(f"{t.speaker}: {t.text}" for t in self.turns)


@dataclass(frozen=True)
class Query:
    persona: str
    query_id: str
    text: str
    session_position: int
    gold: frozenset[str]
    previous_user_text: str | None
    time: str
    #: Every user turn of the query's session before it, oldest first (the live conversation context).
    session_user_turns: tuple[str, ...] = ()


@dataclass
class Persona:
    name: str
    sessions: list[Session]
    queries: list[Query]

    def pool(self, session_position: int) -> frozenset[str]:
        """Candidate pool for a query in the session at `session_position`: the sessions before it."""
        return frozenset(s.uuid for s in self.sessions[:session_position])


def persona_name_from_path(path: str | os.PathLike[str]) -> str:
    name = Path(path).name
    if name.endswith(FILE_SUFFIX):
        return name[: -len(FILE_SUFFIX)]
    return Path(path).stem


def _gold_from_answer(turn: Mapping[str, Any], known: Mapping[str, int]) -> frozenset[str]:
    """Gold sessions cited by an Assistant turn: memory_session_uuids, else memory_used[*].session_uuid."""
    cited: list[Any] = list(turn.get("memory_session_uuids") or [])
    if not cited:
        cited = [m.get("session_uuid") for m in (turn.get("memory_used") or []) if isinstance(m, Mapping)]
    return frozenset(u for u in cited if isinstance(u, str) and u in known)


def parse_persona(name: str, data: Mapping[str, Any]) -> Persona:
    """Build a Persona from a decoded ``*_dialogues_256k.json`` object."""
    raw_sessions: list[Mapping[str, Any]] = list(data["dialogues"])
    known: dict[str, int] = {}
    for pos, raw in enumerate(raw_sessions):
        uuid = str(raw["session_uuid"])
        if uuid in known:
            raise ValueError(f"{name}: duplicate session_uuid {uuid!r}")
        known[uuid] = pos

    sessions: list[Session] = []
    queries: list[Query] = []
    seen_ids: set[str] = set()
    for pos, raw in enumerate(raw_sessions):
        raw_turns: list[Mapping[str, Any]] = list(raw.get("dialogue_turns") or [])
        time = str(raw.get("current_time") or "")
        uuid = str(raw["session_uuid"])
        sessions.append(
            Session(
                uuid=uuid,
                position=pos,
                time=time,
                turns=tuple(Turn(str(t.get("speaker", "")), str(t.get("content") or "")) for t in raw_turns),
            )
        )
        previous_user: str | None = None
        earlier_user: list[str] = []
        for j, t in enumerate(raw_turns):
            if t.get("speaker") != "User":
                continue
            text = str(t.get("content") or "")
            if t.get("is_query") is True:
                nxt = raw_turns[j + 1] if j + 1 < len(raw_turns) else None
                gold = (
                    _gold_from_answer(nxt, known)
                    if nxt and nxt.get("speaker") == "Assistant"
                    else frozenset()
                )
                if gold:
                    qid = t.get("query_id")
                    query_id = str(qid) if qid else f"{uuid}#{j}"
                    if query_id in seen_ids:
                        raise ValueError(f"{name}: duplicate query_id {query_id!r}")
                    seen_ids.add(query_id)
                    queries.append(
                        Query(
                            persona=name,
                            query_id=query_id,
                            text=text.strip(),
                            session_position=pos,
                            gold=gold,
                            previous_user_text=previous_user,
                            time=time,
                            session_user_turns=tuple(earlier_user),
                        )
                    )
            previous_user = text
            earlier_user.append(text)
    return Persona(name=name, sessions=sessions, queries=queries)


def load_persona(path: str | os.PathLike[str]) -> Persona:
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    return parse_persona(persona_name_from_path(path), data)


def load_personas(directory: str | os.PathLike[str]) -> list[Persona]:
    """Every ``*_dialogues_256k.json`` in `directory`, sorted by persona name."""
    return [load_persona(p) for p in sorted(Path(directory).glob(f"*{FILE_SUFFIX}"))]


def load_selected_personas(
    directory: str | os.PathLike[str], names: Sequence[str] | None = None
) -> list[Persona]:
    """The personas of `directory` (only `names` when given); ValueError saying what is wrong otherwise."""
    if not Path(directory).is_dir():
        raise ValueError(f"--data {directory} is not a folder")
    personas = load_personas(directory)
    if names:
        unknown = set(names) - {p.name for p in personas}
        if unknown:
            raise ValueError(f"unknown persona(s): {', '.join(sorted(unknown))}")
        personas = [p for p in personas if p.name in set(names)]
    if not personas:
        raise ValueError(f"no *{FILE_SUFFIX} files in {directory}")
    return personas


# ------------------------------------------------------------------------------------------------ scorer


def _discount(rank: int) -> float:
    """LongMemEval discount: rank 1 -> 1, rank j >= 2 -> 1/log2(j) (so rank 2 also weighs 1)."""
    return 1.0 if rank <= 1 else 1.0 / math.log2(rank)


@dataclass(frozen=True)
class QueryScore:
    recall_any: dict[int, float]
    recall_all: dict[int, float]
    ndcg_any: dict[int, float]
    leaks: int = 0
    duplicates: int = 0
    missing: bool = False
    leaked: tuple[str, ...] = ()

    def get(self, metric: str, k: int) -> float:
        values: dict[int, float] = getattr(self, metric)
        return values[k]


def score_query(
    retrieved: Sequence[str] | None,
    gold: frozenset[str],
    pool: frozenset[str],
    ks: Sequence[int] = DEFAULT_KS,
) -> QueryScore:
    """Strict per-query scores.

    A slot is relevant iff its id is in `gold`, in `pool` and not a repeat of an earlier slot. Ids outside the
    pool (leaks) and repeats keep their slot but count as non-relevant. Leaks and duplicates are counted over
    the whole retrieved list. ``None`` (no prediction) scores 0 everywhere and is marked missing.
    """
    if retrieved is None:
        zero = {k: 0.0 for k in ks}
        return QueryScore(dict(zero), dict(zero), dict(zero), missing=True)
    rel: list[bool] = []
    seen: set[str] = set()
    leaked: list[str] = []
    duplicates = 0
    for rid in retrieved:
        if rid in seen:
            duplicates += 1
            rel.append(False)
            continue
        seen.add(rid)
        if rid not in pool:
            leaked.append(rid)
            rel.append(False)
            continue
        rel.append(rid in gold)
    recall_any: dict[int, float] = {}
    recall_all: dict[int, float] = {}
    ndcg_any: dict[int, float] = {}
    for k in ks:
        hits = sum(rel[:k])
        recall_any[k] = 1.0 if hits > 0 else 0.0
        recall_all[k] = 1.0 if gold and hits == len(gold) else 0.0
        dcg = sum(_discount(j) for j, r in enumerate(rel[:k], start=1) if r)
        idcg = sum(_discount(j) for j in range(1, min(len(gold), k) + 1))
        ndcg_any[k] = dcg / idcg if idcg > 0 else 0.0
    return QueryScore(recall_any, recall_all, ndcg_any, len(leaked), duplicates, False, tuple(leaked))


# ------------------------------------------------------------------------------------------- aggregation


def metric_keys(ks: Sequence[int] = DEFAULT_KS) -> list[str]:
    return [f"{m}@{k}" for m in METRICS for k in ks]


@dataclass(frozen=True)
class Summary:
    """Mean metrics over some queries (or personas), keyed "recall_all@20" etc., plus integrity counters."""

    n: int
    values: dict[str, float]
    leaks: int = 0
    duplicates: int = 0
    missing: int = 0


def summarize(scores: Sequence[QueryScore], ks: Sequence[int] = DEFAULT_KS) -> Summary:
    """Plain mean over queries (0.0 for an empty list)."""
    n = len(scores)
    values = {f"{m}@{k}": (sum(s.get(m, k) for s in scores) / n if n else 0.0) for m in METRICS for k in ks}
    return Summary(
        n=n,
        values=values,
        leaks=sum(s.leaks for s in scores),
        duplicates=sum(s.duplicates for s in scores),
        missing=sum(1 for s in scores if s.missing),
    )


def macro_average(summaries: Sequence[Summary]) -> Summary:
    """Unweighted mean of persona summaries; n, leaks, duplicates and missing are totals."""
    keys = list(summaries[0].values) if summaries else []
    m = len(summaries)
    return Summary(
        n=sum(s.n for s in summaries),
        values={key: sum(s.values[key] for s in summaries) / m for key in keys},
        leaks=sum(s.leaks for s in summaries),
        duplicates=sum(s.duplicates for s in summaries),
        missing=sum(s.missing for s in summaries),
    )


@dataclass
class Results:
    per_persona: dict[str, Summary]
    macro: Summary
    pooled: Summary
    scores: dict[str, dict[str, QueryScore]] = field(default_factory=dict)  # persona -> query_id -> score
    ks: tuple[int, ...] = DEFAULT_KS


def aggregate(
    scores_by_persona: Mapping[str, Sequence[QueryScore]], ks: Sequence[int] = DEFAULT_KS
) -> Results:
    """Per-persona means, persona-macro (unweighted mean of persona means) and query-pooled micro means."""
    per = {name: summarize(list(sc), ks) for name, sc in scores_by_persona.items()}
    pooled = summarize([s for sc in scores_by_persona.values() for s in sc], ks)
    return Results(per_persona=per, macro=macro_average(list(per.values())), pooled=pooled, ks=tuple(ks))


def _align(cells: Sequence[str], widths: Sequence[int]) -> str:
    """First column left-aligned, the rest right-aligned."""
    return "  ".join(
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )


def format_table(results: Results, title: str | None = None) -> str:
    """Plain-text table: one row per persona, then macro and pooled; 4-decimal means."""
    keys = metric_keys(results.ks)
    headers = ["persona", "n", *keys, "leaks", "dups", "missing"]
    labelled = [(name, results.per_persona[name]) for name in sorted(results.per_persona)]
    labelled += [("macro", results.macro), ("pooled", results.pooled)]
    rows = [
        [
            label,
            str(s.n),
            *(f"{s.values[k]:.4f}" for k in keys),
            str(s.leaks),
            str(s.duplicates),
            str(s.missing),
        ]
        for label, s in labelled
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = [title] if title else []
    lines.append(_align(headers, widths))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(_align(r, widths) for r in rows)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ replay


class Retriever(Protocol):
    def add_session(self, session: Session) -> None: ...

    def retrieve(self, query: Query, k: int) -> list[str]: ...


def prepare_for(retriever: Retriever, query: Query) -> None:
    """Work a live memory service did at the query's earlier turns (embedding each user turn as it
    arrived); a retriever may define `prepare(query)` for it, called before the timed `retrieve`."""
    prepare = getattr(retriever, "prepare", None)
    if prepare is not None:
        prepare(query)


@dataclass(frozen=True)
class Prediction:
    persona: str
    query_id: str
    retrieved: list[str]

    def to_json(self) -> str:
        return json.dumps(
            {"persona": self.persona, "query_id": self.query_id, "retrieved": list(self.retrieved)}
        )

    @classmethod
    def from_json(cls, line: str) -> Prediction:
        obj = json.loads(line)
        retrieved = obj["retrieved"]
        if not isinstance(retrieved, list) or not all(isinstance(r, str) for r in retrieved):
            raise ValueError(f"retrieved must be a list of strings: {line[:200]!r}")
        return cls(persona=str(obj["persona"]), query_id=str(obj["query_id"]), retrieved=retrieved)


def predictions_to_jsonl(predictions: Iterable[Prediction]) -> str:
    return "".join(p.to_json() + "\n" for p in predictions)


def predictions_from_jsonl(text: str) -> list[Prediction]:
    return [Prediction.from_json(line) for line in text.splitlines() if line.strip()]


def write_predictions(path: str | os.PathLike[str], predictions: Iterable[Prediction]) -> None:
    Path(path).write_text(predictions_to_jsonl(predictions), encoding="utf-8")


def read_predictions(path: str | os.PathLike[str]) -> list[Prediction]:
    return predictions_from_jsonl(Path(path).read_text(encoding="utf-8"))


def replay(
    persona: Persona,
    retriever: Retriever,
    k: int = 20,
    progress: Callable[[int], None] | None = None,
) -> list[Prediction]:
    """Online replay in list order: answer each session's scored queries from earlier sessions, then add it.

    The retriever gets each query with its gold set blanked. `progress` is called with the number of sessions
    added so far, after each one.
    """
    by_session: dict[int, list[Query]] = {}
    for q in persona.queries:
        by_session.setdefault(q.session_position, []).append(q)
    out: list[Prediction] = []
    for i, session in enumerate(persona.sessions):
        for q in by_session.get(i, []):
            blind = dataclasses.replace(q, gold=frozenset())
            prepare_for(retriever, blind)
            out.append(Prediction(persona.name, q.query_id, list(retriever.retrieve(blind, k))))
        retriever.add_session(session)
        if progress is not None:
            progress(i + 1)
    return out


def evaluate(
    personas: Sequence[Persona], predictions: Iterable[Prediction], ks: Sequence[int] = DEFAULT_KS
) -> Results:
    """Score predictions against the data: pool = sessions before the query's session; missing scores 0.

    Predictions for personas not in `personas` are ignored; an unknown query_id of a given persona or a second
    prediction for the same query raises ValueError.
    """
    known = {p.name: {q.query_id for q in p.queries} for p in personas}
    table: dict[tuple[str, str], list[str]] = {}
    for pred in predictions:
        if pred.persona not in known:
            continue
        if pred.query_id not in known[pred.persona]:
            raise ValueError(f"unknown query {pred.persona}/{pred.query_id}")
        key = (pred.persona, pred.query_id)
        if key in table:
            raise ValueError(f"duplicate prediction for {pred.persona}/{pred.query_id}")
        table[key] = list(pred.retrieved)
    scores: dict[str, dict[str, QueryScore]] = {}
    for p in personas:
        scores[p.name] = {
            q.query_id: score_query(table.get((p.name, q.query_id)), q.gold, p.pool(q.session_position), ks)
            for q in p.queries
        }
    results = aggregate({name: list(sc.values()) for name, sc in scores.items()}, ks)
    results.scores = scores
    return results


# --------------------------------------------------------------------------------------------- baselines

_WORD = re.compile(r"\w+")


def word_tokens(text: str) -> list[str]:
    """Lowercase \\w+ tokens; no stopwords, no stemming."""
    return _WORD.findall(text.lower())


class RecentRetriever:
    """Earlier sessions, most recent first."""

    def __init__(self) -> None:
        self._uuids: list[str] = []

    def add_session(self, session: Session) -> None:
        self._uuids.append(session.uuid)

    def retrieve(self, query: Query, k: int) -> list[str]:
        return self._uuids[::-1][:k]


class SessionBM25Retriever:
    """Okapi BM25 over whole session text, online: IDF and avgdl over the sessions added so far
    (mars.domain.bm25, with the protocol baseline's k1 1.2, b 0.75 and plain lowercase word tokens).
    Only sessions sharing a query term are returned, ranked by score, ties by the earlier session.
    """

    def __init__(
        self,
        k1: float = 1.2,
        b: float = 0.75,
        tokenizer: Callable[[str], list[str]] = word_tokens,
    ) -> None:
        self._index = BM25Index(k1=k1, b=b, tokenizer=tokenizer)
        self._uuids: list[str] = []

    def add_session(self, session: Session) -> None:
        self._index.add(session.text)
        self._uuids.append(session.uuid)

    def scores(self, text: str) -> dict[int, float]:
        return self._index.scores(text)

    def retrieve(self, query: Query, k: int) -> list[str]:
        return [self._uuids[i] for i, _ in self._index.search(query.text, k)]


# ---------------------------------------------------------------------------------------------------- CLI
