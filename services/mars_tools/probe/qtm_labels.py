"""`mars probe qtm-labels`: how often each QTM backend gets each Table 5 field right on a hand-labelled set
of user turns (services/mars_state/qtm/labels/turns.jsonl, labelled by its GUIDE.md).

Each turn is estimated with the active context the state service would hold if the earlier turns had been
labelled right: the persona's user turns since the last gold NEW_TOPIC, across sessions, newest last (at
most CONTEXT_TURNS). So a field's accuracy measures that field, not the consequences of an earlier mistake.
`--agreement FILE` instead compares a second annotator's labels of the set's turns with the set's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mars_state.qtm.labelled import (
    DEFAULT_LABELS,
    FIELDS,
    LabelledTurn,
    accuracy_header,
    accuracy_row,
    read_labelled,
    state_labels,
)
from rich.console import Console
from rich.progress import Progress

from mars_tools.probe.common import percentile


@dataclass
class FieldScore:
    right: int = 0
    total: int = 0

    @property
    def accuracy(self) -> float:
        return self.right / self.total if self.total else 0.0


def score(gold: Sequence[dict[str, str]], predicted: Sequence[dict[str, str]]) -> dict[str, Any]:
    """Accuracy per field, and per field the confusion counts "gold->predicted"."""
    fields = {f: FieldScore() for f in FIELDS}
    confusion: dict[str, Counter[str]] = {f: Counter() for f in FIELDS}
    for g, p in zip(gold, predicted, strict=True):
        for f in FIELDS:
            fields[f].total += 1
            fields[f].right += g[f] == p[f]
            confusion[f][f"{g[f]}->{p[f]}"] += 1
    return {
        "accuracy": {f: s.accuracy for f, s in fields.items()},
        "confusion": {f: dict(c.most_common()) for f, c in confusion.items()},
    }


async def _run_config(
    config: Any, llm_url: str, turns: Sequence[LabelledTurn], console: Console
) -> dict[str, Any]:
    est = config.estimator(llm_url)
    predicted: list[dict[str, str]] = []
    latencies: list[float] = []
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(config.label(), total=len(turns))
            for t in turns:
                started = time.perf_counter()
                state = await est.estimate(t.text, list(t.context), t.opens_session)
                latencies.append((time.perf_counter() - started) * 1000)
                predicted.append(state_labels(state))
                progress.advance(task)
    finally:
        await est.aclose()
    result = score([t.labels for t in turns], predicted)
    result["latency_ms"] = {"p50": percentile(latencies, 0.5), "p99": percentile(latencies, 0.99)}
    result["outcomes"] = dict(est.counts)
    return result


def agreement(gold: Sequence[LabelledTurn], other: Sequence[LabelledTurn]) -> dict[str, Any]:
    """Per field, how often a second annotator's labels of some of the set's turns agree with the set's
    (matched by persona, session, index and text); ValueError when a turn of `other` is not in the set."""
    by_key = {(t.persona, t.session, t.index, t.text): t for t in gold}
    matched = []
    for t in other:
        found = by_key.get((t.persona, t.session, t.index, t.text))
        if found is None:
            raise ValueError(f"{t.session}#{t.index} of the second annotation is not a turn of the set")
        matched.append((found.labels, t.labels))
    return {"turns": len(matched), **score([g for g, _ in matched], [o for _, o in matched])}


def cmd_probe_labels(args: argparse.Namespace) -> int:
    from mars_tools.probe.common import ControllerConfig, LocalLlm

    console = Console(soft_wrap=True)
    path = Path(args.labels)
    if args.agreement:
        try:
            _, gold = read_labelled(path)
            _, other = read_labelled(Path(args.agreement))
            result = agreement(gold, other)
        except ValueError as exc:  # LabelError too
            console.print(f"[red]{exc}[/]")
            return 2
        console.print(f"{result['turns']} turns labelled again by a second annotator ({args.agreement})")
        console.print(accuracy_header("agreement with the set"))
        console.print(accuracy_row("second annotator", result["accuracy"]))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        return 0
    try:
        configs = [ControllerConfig.parse(spec) for spec in args.configs]
        _, turns = read_labelled(path)
    except ValueError as exc:  # LabelError too
        console.print(f"[red]{exc}[/]")
        return 2
    if args.personas:
        turns = [t for t in turns if t.persona in set(args.personas)]
    if not turns:
        console.print(f"[red]no labelled turns in {path}{' for those personas' if args.personas else ''}[/]")
        return 2
    report: dict[str, Any] = {}
    with LocalLlm(configs, console) as llm:
        for config in configs:
            report[config.label()] = asyncio.run(_run_config(config, llm.url, turns, console))
    personas = len({t.persona for t in turns})
    console.print(f"{len(turns)} labelled turns of {personas} personas ({path})")
    console.print(accuracy_header("backend") + f"{'p50 ms':>9}{'p99 ms':>9}")
    for label, r in report.items():
        latency = r["latency_ms"]
        console.print(accuracy_row(label, r["accuracy"]) + f"{latency['p50']:>9.2f}{latency['p99']:>9.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"turns": len(turns), "personas": personas, **report}, indent=2))
        console.print(f"results written to {args.out}")
    return 0


def add_labels_parser(probe_sub: argparse._SubParsersAction, config_help: str) -> None:  # type: ignore[type-arg]
    p = probe_sub.add_parser(
        "qtm-labels",
        help="accuracy of each QTM backend per Table 5 field on the hand-labelled turn set",
        description="Estimates every turn of a labelled set (default: the repository's, with its GUIDE.md) "
        "with each controller config, given the gold active thread as context, and prints the accuracy of "
        "action, query type, phase, memory need, memory span, retrieval scope and ambiguity, with latency.",
    )
    p.add_argument(
        "--labels", default=str(DEFAULT_LABELS), help="labelled turns as JSON lines (default: %(default)s)"
    )
    p.add_argument("--configs", nargs="+", default=["rules"], help=config_help)
    p.add_argument("--personas", nargs="*", help="only these personas of the set")
    p.add_argument("--out", help="write accuracies, confusions and latencies as JSON here")
    p.add_argument(
        "--agreement",
        metavar="FILE",
        help="instead of running controllers, compare a second annotator's labels of the set's turns (e.g. "
        f"{DEFAULT_LABELS.parent / 'second-annotator.jsonl'}) with the set's: the agreement per field, a "
        "ceiling for any controller",
    )
    p.set_defaults(func=cmd_probe_labels)
