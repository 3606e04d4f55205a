"""`mars train qtm`: fit the learned QTM controller (mars_state.qtm.learned) on the labelled turn set, report its
leave-one-persona-out accuracy beside the rules', and write the model file the state service loads."""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from mars.domain.state_rules import clamp_state, widen_session_opening
from mars_state.qtm.labelled import (
    DEFAULT_LABELS,
    LabelError,
    LabelledTurn,
    accuracy_header,
    accuracy_row,
    read_labelled,
    state_labels,
)
from mars_state.qtm.learned import (
    DEFAULT_MODEL,
    FIT_BALANCE,
    FIT_L2,
    FIT_STEPS,
    HEADS,
    Embed,
    LearnedModel,
    featurize,
    state_json,
)
from rich.progress import Progress

from mars_tools.probe.qtm_labels import score
from mars_tools.terminal import console
from mars_tools.train_ranker_cli import add_ranker_parser

#: The version written into the model file (shown as the state's prompt_version).
MODEL_VERSION = "qtm-learned-v2.1"


def features_of(
    turns: Sequence[LabelledTurn | SessionStart], embed: Embed, progress: Progress | None = None
) -> np.ndarray:
    task = progress.add_task("features", total=len(turns)) if progress is not None else None
    rows = []
    for t in turns:
        rows.append(featurize(t.text, t.context, embed))
        if progress is not None and task is not None:
            progress.advance(task)
    return np.stack(rows)


def predicted_fields(
    model: LearnedModel, x: np.ndarray, turns: Sequence[LabelledTurn]
) -> list[dict[str, str]]:
    """The learned state of each turn in the labelled set's terms, as the state service would give it:
    clamped, memory span derived, a session opening widened (mars_state.qtm.guard)."""
    out = []
    for row, t in zip(x, turns, strict=True):
        state = clamp_state(state_json(model.predict(row), t.text, t.context))
        if t.opens_session:
            widen_session_opening(state)
        out.append(state_labels(state))
    return out


def leave_one_persona_out(
    x: np.ndarray,
    turns: Sequence[LabelledTurn],
    extra: tuple[np.ndarray, Sequence[dict[str, str]]] | None = None,
    scored: Sequence[str] | None = None,
    progress: Progress | None = None,
    **fit: Any,
) -> list[dict[str, str] | None]:
    """Each persona's turns predicted by a model that never saw that persona (`extra`: more training rows,
    e.g. RealMem session starts, in every fold). With `scored`, only those personas are held out and
    predicted (the others train every fold); the rest of the list is None."""
    predicted: list[dict[str, str] | None] = [None] * len(turns)
    personas = sorted(set(scored) if scored else {t.persona for t in turns})
    task = progress.add_task("leave-one-persona-out", total=len(personas)) if progress is not None else None
    for persona in personas:
        held = [i for i, t in enumerate(turns) if t.persona == persona]
        train = [i for i, t in enumerate(turns) if t.persona != persona]
        rows, labels = x[train], [turns[i].labels for i in train]
        if extra is not None and len(extra[1]):
            rows, labels = np.concatenate([rows, extra[0]]), [*labels, *extra[1]]
        model = LearnedModel.fit(rows, labels, **fit)
        for i, p in zip(held, predicted_fields(model, x[held], [turns[i] for i in held]), strict=True):
            predicted[i] = p
        if progress is not None and task is not None:
            progress.advance(task)
    return predicted


@dataclass(frozen=True)
class SessionStart:
    """A RealMem project session's first user turn after the previous project session (action only)."""

    persona: str
    text: str
    context: tuple[str, ...]
    new_topic: bool


def realmem_starts(data: Path) -> list[SessionStart]:
    """Every project-session start of the RealMem persona files in `data` (mars probe qtm-boundaries')."""
    from mars_tools.probe.common import persona_files, project_boundaries

    return [
        SessionStart(b.persona, b.first_user_turn, b.previous_turns, b.new_task)
        for f in persona_files(data, None)
        for b in project_boundaries(f)
    ]


def _boundary_scores(gold: Sequence[bool], predicted: Sequence[bool]) -> dict[str, float]:
    from mars_tools.probe.common import precision_recall_f1

    pairs = list(zip(gold, predicted, strict=True))
    precision, recall, f1 = precision_recall_f1(
        sum(g and p for g, p in pairs), sum(p and not g for g, p in pairs), sum(g and not p for g, p in pairs)
    )
    return {"precision": precision, "recall": recall, "f1": f1, "starts": len(gold), "new_topic": sum(gold)}


def train(
    turns: Sequence[LabelledTurn],
    embed: Embed,
    lopo: bool,
    starts: Sequence[SessionStart] = (),
    scored: Sequence[str] | None = None,
    **fit: Any,
) -> tuple[LearnedModel, dict[str, Any]]:
    """The model fitted on every turn (and every RealMem session start, for the action head), and the report:
    leave-one-persona-out accuracy on the labelled set (on the `scored` personas only, when given) and, with
    `starts`, NEW_TOPIC precision/recall/F1 at the session starts of each RealMem persona by a model that
    never saw that persona."""
    labels = [t.labels for t in turns]
    start_labels = [{"action": "NEW_TOPIC" if s.new_topic else "MATCH"} for s in starts]
    report: dict[str, Any] = {"turns": len(turns), "personas": len({t.persona for t in turns})}
    with Progress(console=console, transient=True) as progress:
        x = features_of(turns, embed, progress)
        xs = features_of(starts, embed, progress) if starts else np.zeros((0, x.shape[1]))
        if lopo:
            held_out = leave_one_persona_out(
                x, turns, extra=(xs, start_labels), scored=scored, progress=progress, **fit
            )
            pairs = [(g, p) for g, p in zip(labels, held_out, strict=True) if p is not None]
            report["lopo"] = score([g for g, _ in pairs], [p for _, p in pairs])
            report["lopo"]["turns"] = len(pairs)
        if starts and lopo:
            predicted: list[bool] = []
            gold: list[bool] = []
            realmem = sorted({s.persona for s in starts})
            task = progress.add_task("RealMem leave-one-persona-out", total=len(realmem))
            for persona in realmem:
                held = [i for i, s in enumerate(starts) if s.persona == persona]
                kept = [i for i, s in enumerate(starts) if s.persona != persona]
                # Only the action head is scored here.
                action = LearnedModel.fit(
                    np.concatenate([x, xs[kept]]),
                    [*labels, *(start_labels[i] for i in kept)],
                    heads=("action",),
                    **fit,
                )
                predicted += [action.predict(xs[i])["action"][0] == "NEW_TOPIC" for i in held]
                gold += [starts[i].new_topic for i in held]
                progress.advance(task)
            report["realmem_lopo"] = _boundary_scores(gold, predicted)
    model = LearnedModel.fit(np.concatenate([x, xs]), [*labels, *start_labels], **fit)
    report["train"] = score(labels, predicted_fields(model, x, turns))
    return model, report


def cmd_train_qtm(args: argparse.Namespace) -> int:
    from mars.retrieval.embedder import LruEmbedder, load_embedder

    path = Path(args.labels)
    try:
        raw, turns = read_labelled(path)
    except LabelError as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    if len({t.persona for t in turns}) < 2 and args.lopo:
        console.print("[red]leave-one-persona-out needs turns of at least two personas[/]")
        return 2
    unknown = sorted(set(args.lopo_personas or ()) - {t.persona for t in turns})
    if unknown:
        console.print(f"[red]--lopo-personas: no labelled turns of {', '.join(unknown)}[/]")
        return 2
    starts: list[SessionStart] = []
    if args.realmem:
        try:
            starts = realmem_starts(Path(args.realmem))
        except (OSError, ValueError) as exc:
            console.print(f"[red]cannot read RealMem from {args.realmem}: {exc}[/]")
            return 2
    started = time.perf_counter()
    embed = LruEmbedder(load_embedder(cache_dir=args.embedding_cache_dir)).encode
    model, report = train(
        turns,
        embed,
        args.lopo,
        starts,
        scored=args.lopo_personas,
        steps=args.steps,
        l2=args.l2,
        balance=args.balance,
    )
    model.meta.update(
        version=MODEL_VERSION,
        labels_sha256=hashlib.sha256(raw).hexdigest(),
        turns=len(turns),
        realmem_starts=len(starts),
        steps=args.steps,
        l2=args.l2,
        balance=args.balance,
    )
    out = Path(args.out)
    model.save(out)
    seconds = time.perf_counter() - started
    console.print(
        f"{len(turns)} labelled turns of {report['personas']} personas; trained in {seconds:.1f}s; "
        f"model written to {out} ({out.stat().st_size:,} bytes)"
    )
    console.print(accuracy_header("accuracy"))
    for name in ("lopo", "train"):
        if name in report:
            label = (
                f"leave-one-persona-out ({report['lopo']['turns']})"
                if name == "lopo"
                else "on the training turns"
            )
            console.print(accuracy_row(label, report[name]["accuracy"]))
    if "realmem_lopo" in report:
        r = report["realmem_lopo"]
        console.print(
            f"NEW_TOPIC at {r['starts']} RealMem project-session starts ({r['new_topic']} new), "
            f"leave-one-persona-out: precision {r['precision']:.3f} recall {r['recall']:.3f} F1 {r['f1']:.3f}"
        )
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2))
    return 0


def add_train_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    train_p = sub.add_parser("train", help="train the learned parts of MARS")
    train_sub = train_p.add_subparsers(dest="train_cmd", required=True)
    p = train_sub.add_parser(
        "qtm",
        help="fit the learned QTM controller on the labelled turn set and write its model file",
        description="Computes each labelled turn's features (MiniLM embedding, similarity to the gold active "
        "thread, lexical cues, the rules' state, hashed word n-grams), fits one softmax head per Table 5 decision "
        "(deterministic: L-BFGS from zero weights), reports leave-one-persona-out accuracy (each persona scored "
        "by a model that never saw it) and writes the model fitted on every turn.",
    )
    p.add_argument(
        "--labels", default=str(DEFAULT_LABELS), help="labelled turns as JSON lines (default: %(default)s)"
    )
    p.add_argument("--out", default=str(DEFAULT_MODEL), help="model file to write (default: %(default)s)")
    p.add_argument(
        "--realmem",
        help="folder of RealMem persona files: their project-session starts also train the action head, and "
        "the report scores NEW_TOPIC there leave-one-persona-out",
    )
    p.add_argument(
        "--no-lopo", dest="lopo", action="store_false", help="skip the leave-one-persona-out report"
    )
    p.add_argument(
        "--lopo-personas",
        nargs="+",
        metavar="PERSONA",
        help="score leave-one-persona-out on these personas only (each still held out of its own fold; "
        "the others train every fold), e.g. the first-written p01 ... p12",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=FIT_STEPS,
        help="L-BFGS iterations per head at most (default %(default)s)",
    )
    p.add_argument(
        "--l2",
        type=float,
        default=FIT_L2,
        help="L2 penalty on the summed loss (default %(default)s: of 3, 10 and 30 the best leave-one-persona-out on "
        "p01-p12 over the heads together)",
    )
    p.add_argument(
        "--balance",
        type=float,
        default=FIT_BALANCE,
        help="weigh each class by its inverse frequency to this power (default %(default)s: of 0, 0.5 and 1 the best "
        "leave-one-persona-out on p01-p12; 1 weighs the classes equally, 0 by their counts)",
    )
    p.add_argument(
        "--embedding-cache-dir", help="folder of the embedder's ONNX exports (the services' MARS_MEMORY_EMBEDDING_CACHE_DIR)"
    )
    p.add_argument("--report", help="write the accuracies and confusions as JSON here")
    p.set_defaults(func=cmd_train_qtm)
    add_ranker_parser(train_sub)


__all__ = ["HEADS", "add_train_parser", "train"]
