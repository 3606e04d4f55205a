"""`mars bench locomo`: evidence recall on LoCoMo at turn and session level, by question category.

Each conversation is written to memory turn by turn (a turn is one chunk, with the session date); every
question then retrieves from the whole conversation, as questions are asked after it. Turn-level recall@k
is the share of a question's evidence turns among the top-k turns; session-level recall@k the share of its
evidence sessions among the top-k sessions (sessions ranked by their best turn).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mars.retrieval.embedder import Embedder
from mars.retrieval.hybrid import POLICY_CONFIGS, HybridMemory, chunk_pieces, embed_chunks
from mars.retrieval.ranker import LearnedRanker, load_ranker
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

_EVIDENCE = re.compile(r"D(\d+):(\d+)")
_SESSION_KEY = re.compile(r"^session_(\d+)$")
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
TURN_KS = (5, 10, 20)
SESSION_KS = (1, 3, 5)


@dataclass(frozen=True)
class LocomoTurn:
    dia_id: str
    session: int
    position: int
    text: str


@dataclass(frozen=True)
class LocomoQuestion:
    question: str
    category: int
    evidence: frozenset[str]  # "D<session>:<turn>"


@dataclass
class Conversation:
    sample_id: str
    turns: list[LocomoTurn]
    questions: list[LocomoQuestion]


def parse_evidence(raw: Any) -> frozenset[str]:
    """Lenient: a few evidence ids are malformed ("D8:6; D9:17", "D:11:26"); take every D<n>:<m> found."""
    items = raw if isinstance(raw, list) else [raw]
    return frozenset(f"D{s}:{t}" for item in items for s, t in _EVIDENCE.findall(str(item)))


def load_locomo(path: str | Path) -> list[Conversation]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    out: list[Conversation] = []
    for conv in data:
        c = conv["conversation"]
        sessions = sorted((int(m.group(1)), k) for k in c if (m := _SESSION_KEY.match(k)))
        turns: list[LocomoTurn] = []
        for n, key in sessions:
            date = c.get(f"session_{n}_date_time", "")
            for t in c[key]:
                text = f"[{date}] {t.get('speaker', '')}: {t.get('text', '')}"
                if t.get("blip_caption"):
                    text += f" (shares a photo: {t['blip_caption']})"
                turns.append(LocomoTurn(str(t["dia_id"]), n, len(turns), text))
        questions = [
            LocomoQuestion(
                str(q["question"]), int(q.get("category", 0)), parse_evidence(q.get("evidence", []))
            )
            for q in conv.get("qa", [])
        ]
        out.append(
            Conversation(str(conv.get("sample_id", len(out))), turns, [q for q in questions if q.evidence])
        )
    return out


def session_of(dia_id: str) -> int:
    m = _EVIDENCE.match(dia_id)
    return int(m.group(1)) if m else -1


def score_question(ranked_turns: list[str], evidence: frozenset[str]) -> dict[str, float]:
    """Turn and session evidence recall at the benchmark's ks."""
    if not evidence:
        raise ValueError("a question without evidence cannot be scored")
    out: dict[str, float] = {}
    for k in TURN_KS:
        out[f"turn@{k}"] = len(evidence & set(ranked_turns[:k])) / len(evidence)
    sessions: list[int] = []
    for dia in ranked_turns:
        s = session_of(dia)
        if s not in sessions:
            sessions.append(s)
    gold_sessions = {session_of(e) for e in evidence}
    for k in SESSION_KS:
        out[f"session@{k}"] = len(gold_sessions & set(sessions[:k])) / len(gold_sessions)
    return out


def conversation_memory(conv: Conversation, stored: Embedder, queries: Embedder | None = None) -> HybridMemory:
    """The conversation's memory as the bench ranks it: each turn a group, the mars fusion without the
    recency prior (LoCoMo questions come after the whole conversation: no recency, no conversation context)."""
    config = replace(POLICY_CONFIGS["mars"], recency_weight=0.0)
    memory = HybridMemory(stored, config, query_embedder=queries)
    max_words = config.max_chunk_words
    vectors = embed_chunks(stored, [t.text for t in conv.turns], max_words)  # one batched pass
    offset = 0
    for turn in conv.turns:
        n = len(chunk_pieces([turn.text], max_words))
        memory.add_group(turn.dia_id, turn.position, [turn.text], vectors[offset : offset + n])
        offset += n
    return memory


def run(
    conversations: list[Conversation],
    embedder: Embedder,
    console: Console,
    stored_embedder: Embedder | None = None,
    ranker: LearnedRanker | None = None,
    ranked: dict[int, list[dict[str, float]]] | None = None,
) -> dict[int, list[dict[str, float]]]:
    """Per question category, each question's scores. `stored_embedder` embeds the turns (default:
    `embedder`, which embeds the questions). With `ranker`, `ranked` gets the same questions' scores with
    the fused top 50 re-ordered by it (same memory, same run)."""
    stored = stored_embedder or embedder
    by_category: dict[int, list[dict[str, float]]] = defaultdict(list)
    with Progress(console=console) as progress:
        task = progress.add_task("conversations", total=len(conversations))
        for conv in conversations:
            memory = conversation_memory(conv, stored, embedder)
            for q in conv.questions:
                fused = [key for key, _ in memory.rank_groups(q.question, (), len(conv.turns))]
                by_category[q.category].append(score_question(fused, q.evidence))
                if ranker is not None and ranked is not None:
                    order = memory.rank_groups(q.question, (), len(conv.turns), ranker=ranker)
                    ranked.setdefault(q.category, []).append(score_question([k for k, _ in order], q.evidence))
            progress.update(task, advance=1)
    return by_category


def category_report(
    results: dict[int, list[dict[str, float]]], title: str
) -> tuple[Table, dict[str, dict[str, float]]]:
    """Mean recall per question category and over all but the adversarial one, as a table and as data."""
    keys = [f"turn@{k}" for k in TURN_KS] + [f"session@{k}" for k in SESSION_KS]
    table = Table(title=title)
    for col in ("category", "n", *keys):
        table.add_column(col)
    report: dict[str, dict[str, float]] = {}

    def add_row(label: str, rows: list[dict[str, float]]) -> None:
        means = {k: (sum(r[k] for r in rows) / len(rows) if rows else 0.0) for k in keys}
        report[label] = {"n": len(rows), **means}
        table.add_row(label, str(len(rows)), *(f"{means[k]:.4f}" for k in keys))

    for cat in sorted(results):
        add_row(f"{cat} {CATEGORIES.get(cat, '?')}", results[cat])
    add_row("all but adversarial", [r for c, rows in results.items() if c != 5 for r in rows])
    return table, report


def add_locomo_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("locomo", help="LoCoMo evidence recall at turn and session level, by category")
    p.add_argument("--data", required=True, help="a LoCoMo JSON file (list of conversations)")
    p.add_argument("--out", help="write results as JSON here")
    p.add_argument(
        "--embedding-precision",
        choices=("fp32", "int8"),
        default="fp32",
        help="fp32 (default) or int8 ONNX weights (MARS_MEMORY_EMBEDDING_PRECISION of the memory service)",
    )
    p.add_argument(
        "--stored-precision",
        choices=("fp32", "int8"),
        help="weights that embed the turns alone (a measurement: the memory service has one precision; "
        "default: --embedding-precision); the questions keep --embedding-precision",
    )
    p.add_argument(
        "--ranker",
        action="store_true",
        help="also rank every question with the packaged learned ranker (mars train ranker) and print its table "
        "beside the fused one (same memory, same run)",
    )
    p.set_defaults(func=cmd_locomo)


def cmd_locomo(args: argparse.Namespace) -> int:
    console = Console(width=None if sys.stdout.isatty() else 160)
    path = Path(args.data)
    if not path.is_file():
        console.print(f"[red]--data {path} is not a file[/]")
        return 2
    conversations = load_locomo(path)
    from mars.retrieval.embedder import load_embedder

    embedder = load_embedder(precision=args.embedding_precision)
    stored = None
    if args.stored_precision and args.stored_precision != args.embedding_precision:
        stored = load_embedder(precision=args.stored_precision)
    ranker = None
    if args.ranker:
        ranker, why = load_ranker()
        if ranker is None:
            console.print(f"[red]--ranker: no usable ranker ({why})[/]")
            return 2
    ranked: dict[int, list[dict[str, float]]] = {}
    results = run(conversations, embedder, console, stored, ranker, ranked)
    table, report = category_report(
        results, f"LoCoMo evidence recall ({len(conversations)} conversations, policy mars)"
    )
    console.print(table)
    written: Mapping[str, object] = report
    if ranker is not None:
        table, ranked_report = category_report(
            ranked,
            f"the same, fused top 50 re-ordered by the learned ranker {ranker.version} "
            "(the packaged one saw these questions at weight 0.01: in-sample)",
        )
        console.print(table)
        written = {"fused": report, "ranker": ranked_report}
    if args.out:
        Path(args.out).write_text(json.dumps(written, indent=2))
    return 0
