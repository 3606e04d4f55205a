"""`mars train qtm`: fit the learned QTM controller (mars.qtm.learned) on the labelled turn set, report its
leave-one-persona-out accuracy beside the rules', and write the model file the state service loads."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress

from mars.probe.qtm_labels import DEFAULT_LABELS, FIELDS, LabelledTurn, load_labelled, score
from mars.qtm.learned import DEFAULT_MODEL, HEADS, Embed, LearnedModel, featurize, state_json

console = Console(width=None if sys.stdout.isatty() else 160)

#: The version written into the model file (shown as the state's prompt_version).
MODEL_VERSION = "qtm-learned-v1"


def features_of(turns: Sequence[LabelledTurn], embed: Embed, progress: Progress | None = None) -> np.ndarray:
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
    """The learned state of each turn in the labelled set's terms (memory_span derived as the state is)."""
    out = []
    for row, t in zip(x, turns, strict=True):
        state = state_json(model.predict(row), t.text, t.context)
        out.append(
            {
                "action": state["action"],
                "query_type": state["query_type"],
                "phase": state["phase"],
                "need_memory": str(state["taxonomy"]["need_memory"]),
                "memory_span": state["taxonomy"]["memory_span"],
                "retrieval_scope": state["retrieval_scope"],
                "ambiguity": state["taxonomy"]["ambiguity"],
            }
        )
    return out


def leave_one_persona_out(x: np.ndarray, turns: Sequence[LabelledTurn], **fit: Any) -> list[dict[str, str]]:
    """Each persona's turns predicted by a model that never saw that persona."""
    predicted: list[dict[str, str] | None] = [None] * len(turns)
    for persona in sorted({t.persona for t in turns}):
        held = [i for i, t in enumerate(turns) if t.persona == persona]
        train = [i for i, t in enumerate(turns) if t.persona != persona]
        model = LearnedModel.fit(x[train], [turns[i].labels for i in train], **fit)
        for i, p in zip(held, predicted_fields(model, x[held], [turns[i] for i in held]), strict=True):
            predicted[i] = p
    return [p for p in predicted if p is not None]


def train(
    turns: Sequence[LabelledTurn], embed: Embed, lopo: bool, **fit: Any
) -> tuple[LearnedModel, dict[str, Any]]:
    """The model fitted on every turn, and the report: leave-one-persona-out accuracy (when `lopo`)."""
    with Progress(console=console, transient=True) as progress:
        x = features_of(turns, embed, progress)
    report: dict[str, Any] = {"turns": len(turns), "personas": len({t.persona for t in turns})}
    if lopo:
        report["lopo"] = score([t.labels for t in turns], leave_one_persona_out(x, turns, **fit))
    model = LearnedModel.fit(x, [t.labels for t in turns], **fit)
    report["train"] = score([t.labels for t in turns], predicted_fields(model, x, turns))
    return model, report


def cmd_train_qtm(args: argparse.Namespace) -> int:
    from mars.retrieval.embedder import LruEmbedder, load_embedder

    path = Path(args.labels)
    try:
        raw = path.read_bytes()
        turns = load_labelled(raw.decode().splitlines())
    except OSError as exc:
        console.print(f"[red]cannot read {path}: {exc.strerror}[/]")
        return 2
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    if len({t.persona for t in turns}) < 2 and args.lopo:
        console.print("[red]leave-one-persona-out needs turns of at least two personas[/]")
        return 2
    started = time.perf_counter()
    embed = LruEmbedder(load_embedder(cache_dir=args.embedding_cache_dir)).encode
    model, report = train(turns, embed, args.lopo, steps=args.steps, l2=args.l2)
    model.meta.update(
        version=MODEL_VERSION,
        labels_sha256=hashlib.sha256(raw).hexdigest(),
        turns=len(turns),
        steps=args.steps,
        l2=args.l2,
    )
    out = Path(args.out)
    model.save(out)
    seconds = time.perf_counter() - started
    console.print(
        f"{len(turns)} labelled turns of {report['personas']} personas; trained in {seconds:.1f}s; "
        f"model written to {out} ({out.stat().st_size:,} bytes)"
    )
    short = {"action": "action", "query_type": "qtype", "phase": "phase", "need_memory": "need",
             "memory_span": "span", "retrieval_scope": "scope", "ambiguity": "ambig"}  # fmt: skip
    console.print(f"{'accuracy':<28}" + "".join(f"{short[f]:>8}" for f in FIELDS))
    for name in ("lopo", "train"):
        if name in report:
            label = "leave-one-persona-out" if name == "lopo" else "on the training turns"
            console.print(f"{label:<28}" + "".join(f"{report[name]['accuracy'][f]:>8.3f}" for f in FIELDS))
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
        "thread, lexical cues, the rules' state), fits one softmax head per Table 5 decision (deterministic: "
        "full-batch gradient descent from zero), reports leave-one-persona-out accuracy (each persona scored "
        "by a model that never saw it) and writes the model fitted on every turn.",
    )
    p.add_argument(
        "--labels", default=str(DEFAULT_LABELS), help="labelled turns as JSON lines (default: %(default)s)"
    )
    p.add_argument("--out", default=str(DEFAULT_MODEL), help="model file to write (default: %(default)s)")
    p.add_argument(
        "--no-lopo", dest="lopo", action="store_false", help="skip the leave-one-persona-out report"
    )
    p.add_argument("--steps", type=int, default=400, help="gradient steps per head (default 400)")
    p.add_argument(
        "--l2",
        type=float,
        default=0.1,
        help="L2 penalty (default 0.1: the best leave-one-persona-out of 0.01-3)",
    )
    p.add_argument(
        "--embedding-cache-dir", help="folder of the embedder's ONNX exports (MARS_EMBEDDING_CACHE_DIR)"
    )
    p.add_argument("--report", help="write the accuracies and confusions as JSON here")
    p.set_defaults(func=cmd_train_qtm)


__all__ = ["HEADS", "add_train_parser", "train"]
