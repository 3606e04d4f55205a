"""`mars bench realmem-lopo`: an honest, leave-one-persona-out figure for the `mars` fusion on RealMem.

The `mars` fusion weights (POLICY_CONFIGS["mars"]) were tuned on the same RealMem personas they are
reported on, so that figure is optimistic. Here a grid of fusion configurations around the tuned values is
scored once per persona (one replay per persona: the memory's content does not depend on the fusion, so
every configuration ranks the same memory at each query); then, for each held-out persona, the
configuration with the best score on the *other* personas is chosen and scored on the held-out one. The
macro average over held-out personas is the leave-one-persona-out (LOPO) figure; the in-sample figure of the
configuration best on all personas is reported beside it.

Selection objective: mean of persona-macro recall_all@20 and ndcg_any@20 (the two headline columns).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from mars.retrieval.embedder import Embedder
from mars.retrieval.hybrid import POLICY_CONFIGS, HybridConfig
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mars_tools.bench.policies import CachingEmbedder, HybridSessionRetriever
from mars_tools.bench.realmem import Persona, Prediction, Query, evaluate, load_selected_personas, replay

#: Metric keys whose mean is the selection objective.
OBJECTIVE_KEYS: tuple[str, ...] = ("recall_all@20", "ndcg_any@20")
#: Conversation turns used as secondary queries, as the `mars` policy uses them (bench/policies.py).
CONTEXT_TURNS = 3
TUNED = POLICY_CONFIGS["mars"]

#: persona -> metric key ("recall_all@20", ...) -> persona mean.
PersonaScores = Mapping[str, Mapping[str, float]]


# ------------------------------------------------------------------------------------------------- grid


def _config_name(cfg: HybridConfig) -> str:
    return (
        f"rec{cfg.recency_weight:g}_prf{cfg.prf_weight:g}_ctx{cfg.context_weight:g}"
        f"_cen{cfg.centroid_weight:g}_k{cfg.rrf_k:g}"
    )


#: Multiples of each tuned weight in the full grid: off, half and tuned.
FULL_LEVELS: tuple[float, ...] = (0.0, 0.5, 1.0)


def fusion_grid(size: str = "full") -> dict[str, HybridConfig]:
    """Fusion configurations around the tuned `mars` values, named by their settings, in grid order.

    `full`: recency, PRF, context and centroid weights each at FULL_LEVELS x tuned, rrf_k at {30, 60}
    (prf_top stays the tuned 3): 162 configurations, the tuned one among them; 40 minutes for the 7 RealMem
    personas on the shared 2-core machine, embedding included. `small` (tests): recency {0, tuned} x rrf_k
    {30, 60}.
    Memory-level settings (BM25 k1/b, chunk size) stay the tuned ones, so one memory per persona serves
    every configuration.
    """
    if size == "small":
        points = [
            replace(TUNED, recency_weight=r, rrf_k=k)
            for r, k in itertools.product((0.0, TUNED.recency_weight), (30.0, 60.0))
        ]
    elif size == "full":

        def levels(tuned: float) -> list[float]:
            return [m * tuned for m in FULL_LEVELS]

        points = [
            replace(TUNED, recency_weight=r, prf_weight=p, context_weight=c, centroid_weight=z, rrf_k=k)
            for r, p, c, z, k in itertools.product(
                levels(TUNED.recency_weight),
                levels(TUNED.prf_weight),
                levels(TUNED.context_weight),
                levels(TUNED.centroid_weight),
                (30.0, 60.0),
            )
        ]
    else:
        raise ValueError(f"unknown grid {size!r}; known: small, full")
    return {_config_name(c): c for c in points}


def tuned_name(grid: Mapping[str, HybridConfig]) -> str | None:
    """The grid's name for POLICY_CONFIGS["mars"], if the grid holds it."""
    return next((name for name, cfg in grid.items() if cfg == TUNED), None)


# -------------------------------------------------------------------------------- LOPO selection (pure)


def objective(values: Mapping[str, float]) -> float:
    """Mean of the OBJECTIVE_KEYS metrics."""
    return sum(values[k] for k in OBJECTIVE_KEYS) / len(OBJECTIVE_KEYS)


def macro(per_persona: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Unweighted mean over personas of each metric (persona-macro, as the RealMem table reports)."""
    keys = list(per_persona[0])
    return {k: sum(v[k] for v in per_persona) / len(per_persona) for k in keys}


@dataclass(frozen=True)
class Fold:
    held_out: str
    chosen: str
    #: Objective of the chosen configuration, persona-macro over the other personas.
    train_objective: float
    #: The chosen configuration's metrics on the held-out persona.
    held_out_values: dict[str, float]


@dataclass(frozen=True)
class LopoResult:
    folds: list[Fold]
    #: Macro over held-out personas of each fold's held-out metrics: the LOPO figure.
    lopo_macro: dict[str, float]
    #: The configuration with the best objective on all personas, and its (in-sample) macro metrics.
    in_sample_best: str
    in_sample_macro: dict[str, float]


def leave_one_persona_out(scores: Mapping[str, PersonaScores]) -> LopoResult:
    """LOPO selection from per-persona scores, `scores[config][persona][metric]`.

    For each persona, the configuration with the highest objective macro-averaged over the other personas is
    chosen (ties: the earlier configuration in `scores`' order) and its metrics on the held-out persona are
    kept. ValueError when there are fewer than two personas or configurations disagree on the persona set.
    """
    if not scores:
        raise ValueError("no configurations to choose from")
    configs = list(scores)
    personas = sorted(scores[configs[0]])
    for name in configs:
        if sorted(scores[name]) != personas:
            raise ValueError(f"configuration {name!r} was scored on other personas than {configs[0]!r}")
    if len(personas) < 2:
        raise ValueError(
            f"leave-one-persona-out needs at least 2 personas, got {len(personas)} ({', '.join(personas)}): "
            "with one persona there is nothing left to choose a configuration on"
        )

    def macro_objective(name: str, among: Sequence[str]) -> float:
        return sum(objective(scores[name][p]) for p in among) / len(among)

    folds: list[Fold] = []
    for held_out in personas:
        train = [p for p in personas if p != held_out]
        # max() keeps the first of equal values: ties go to the earlier configuration.
        chosen = max(configs, key=lambda name: macro_objective(name, train))
        folds.append(Fold(held_out, chosen, macro_objective(chosen, train), dict(scores[chosen][held_out])))
    best = max(configs, key=lambda name: macro_objective(name, personas))
    return LopoResult(
        folds=folds,
        lopo_macro=macro([f.held_out_values for f in folds]),
        in_sample_best=best,
        in_sample_macro=macro([scores[best][p] for p in personas]),
    )


# ------------------------------------------------------------------------------------- grid evaluation


class GridRetriever(HybridSessionRetriever):
    """The `mars` retriever (same memory, same conversation context) ranking each query under every grid
    configuration; `retrieve` answers with the first configuration's ranking so `replay` can drive it."""

    def __init__(
        self,
        embedder: Embedder,
        grid: Mapping[str, HybridConfig],
        query_embedder: Embedder | None = None,
    ) -> None:
        if not grid:
            raise ValueError("empty grid")
        first = next(iter(grid.values()))
        super().__init__(embedder, first, CONTEXT_TURNS, query_embedder=query_embedder)
        self._grid = dict(grid)
        self.rankings: dict[str, dict[str, list[str]]] = {name: {} for name in grid}

    def retrieve(self, query: Query, k: int) -> list[str]:
        context = self._context(query)
        for name, cfg in self._grid.items():
            ranked = self._memory.rank_groups(query.text, context, k, config=cfg)
            self.rankings[name][query.query_id] = [key for key, _ in ranked]
        return self.rankings[next(iter(self._grid))][query.query_id]

    def predictions(self, persona: str, name: str) -> list[Prediction]:
        return [Prediction(persona, qid, ids) for qid, ids in self.rankings[name].items()]


def grid_scores(
    personas: Sequence[Persona],
    grid: Mapping[str, HybridConfig],
    embedder: Embedder,
    query_embedder: Embedder | None = None,
    k: int = 20,
    progress: Callable[[str, int], None] | None = None,
    after_persona: Callable[[str], None] | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """`scores[config][persona][metric]`: each persona replayed once (`replay`, the strict scorer of
    `evaluate`), every configuration ranking at each query. `progress(persona, sessions_done)`."""
    scores: dict[str, dict[str, dict[str, float]]] = {name: {} for name in grid}
    for persona in personas:
        retriever = GridRetriever(embedder, grid, query_embedder)
        advance = None if progress is None else (lambda done, p=persona.name: progress(p, done))
        replay(persona, retriever, k, progress=advance)
        for name in grid:
            results = evaluate([persona], retriever.predictions(persona.name, name))
            scores[name][persona.name] = results.per_persona[persona.name].values
        if after_persona is not None:
            after_persona(persona.name)
    return scores


# ---------------------------------------------------------------------------------------------------- CLI


def add_realmem_lopo_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "realmem-lopo",
        help="leave-one-persona-out figure for the mars fusion on RealMem (choose weights on the others)",
        description="Scores a grid of fusion configurations around the tuned `mars` weights on every "
        "persona (each persona replayed once, as in `mars bench realmem`, strict scorer), then for each "
        "held-out persona chooses the configuration best on the other personas (objective: mean of "
        "persona-macro R_all@20 and nDCG@20) and scores it on the held-out one. Prints each fold's choice, "
        "the LOPO macro figure, the in-sample figure of the configuration best on all personas, and the "
        "tuned `mars` configuration's in-sample figure. Needs at least 2 personas. The full grid (162 "
        "configurations) took 40 minutes on a shared 2-core machine, embedding every session included "
        "(share --cache-dir with `mars bench realmem` to embed once).",
    )
    p.add_argument("--data", required=True, help="folder holding *_dialogues_256k.json (at least 2 personas)")
    p.add_argument(
        "--personas", nargs="*", help="only these personas (file name before _dialogues_256k.json)"
    )
    p.add_argument(
        "--grid",
        default="full",
        choices=["small", "full"],
        help="full (default): recency/PRF/context/centroid weights at {0, 0.5, 1} x tuned, "
        "rrf_k {30, 60} (162 configs); small: recency {0, tuned} x rrf_k {30, 60} "
        "(4 configs, for tests)",
    )
    p.add_argument(
        "--out", help="write per-persona scores of every configuration, the folds and figures here"
    )
    p.add_argument("--cache-dir", help="cache chunk embeddings here (share it with `mars bench realmem`)")
    p.add_argument(
        "--query-max-tokens",
        type=int,
        default=None,
        help="query window of the embedder (default: the model's, as `mars bench realmem` and the memory "
        "service; the fusion weights were tuned at 128)",
    )
    p.add_argument(
        "--embedding-backend",
        default="auto",
        choices=["auto", "onnx", "torch"],
        help="embedder runtime (default auto)",
    )
    p.set_defaults(func=cmd_realmem_lopo)


def cmd_realmem_lopo(args: argparse.Namespace) -> int:
    # A pipe or log gets wide tables (configuration names are long) rather than rich's 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 180)
    try:
        personas = load_selected_personas(args.data, args.personas)
        if len(personas) < 2:
            raise ValueError(
                f"leave-one-persona-out needs at least 2 personas; {args.data} gives "
                f"{len(personas)} ({', '.join(p.name for p in personas)}): with one persona there is "
                "nothing left to choose a configuration on"
            )
        if args.out and not Path(args.out).parent.is_dir():
            raise ValueError(f"--out: folder {Path(args.out).parent} does not exist")
        if args.query_max_tokens is not None and args.query_max_tokens < 1:
            raise ValueError("--query-max-tokens must be at least 1")
    except ValueError as exc:
        console.print(f"[red]{exc}[/]", soft_wrap=True)
        return 2
    grid = fusion_grid(args.grid)
    from mars.retrieval.embedder import load_embedder

    embedder = CachingEmbedder(load_embedder(backend=args.embedding_backend), args.cache_dir)
    query_embedder = load_embedder(backend=args.embedding_backend, max_seq_length=args.query_max_tokens)
    n_queries = sum(len(p.queries) for p in personas)
    console.print(
        f"{len(personas)} personas, {n_queries} scored queries; {len(grid)} fusion configurations "
        f"({args.grid} grid)"
    )
    t0 = time.perf_counter()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        tasks = {p.name: progress.add_task(p.name, total=len(p.sessions)) for p in personas}
        scores = grid_scores(
            personas,
            grid,
            embedder,
            query_embedder,
            progress=lambda name, done: progress.update(tasks[name], completed=done),
            # Keep embeddings of finished personas even if a long first run is interrupted.
            after_persona=lambda _name: embedder.save(),
        )
    wall_s = time.perf_counter() - t0
    result = leave_one_persona_out(scores)
    tuned = tuned_name(grid)
    console.print(_folds_table(result, scores, tuned))
    console.print(_figures_table(result, scores, tuned))
    console.print(f"{len(grid)} configurations x {len(personas)} personas in {wall_s:.0f} s")
    if args.out:
        report = {
            "objective": f"mean of persona-macro {' and '.join(OBJECTIVE_KEYS)}",
            "grid_size": args.grid,
            "grid": {name: asdict(cfg) for name, cfg in grid.items()},
            "tuned_config": tuned,
            "folds": [asdict(f) for f in result.folds],
            "lopo_macro": result.lopo_macro,
            "in_sample_best": {"config": result.in_sample_best, "macro": result.in_sample_macro},
            "tuned_in_sample": None
            if tuned is None
            else {"config": tuned, "macro": macro(list(scores[tuned].values()))},
            "scores": scores,
            "personas": [p.name for p in personas],
            "queries": n_queries,
            "wall_s": wall_s,
        }
        Path(args.out).write_text(json.dumps(report, indent=2))
        console.print(f"results written to {args.out}")
    return 0


def _folds_table(result: LopoResult, scores: Mapping[str, PersonaScores], tuned: str | None) -> Table:
    table = Table(title="leave-one-persona-out folds (held-out persona's scores)")
    for col in ("held out", "chosen on the others", "train obj.", "R_all@20", "nDCG@20"):
        table.add_column(col, justify="left" if col in ("held out", "chosen on the others") else "right")
    if tuned is not None:
        table.add_column("tuned R_all@20", justify="right")
        table.add_column("tuned nDCG@20", justify="right")
    for f in result.folds:
        row = [
            f.held_out,
            f.chosen,
            f"{f.train_objective:.4f}",
            f"{f.held_out_values['recall_all@20']:.4f}",
            f"{f.held_out_values['ndcg_any@20']:.4f}",
        ]
        if tuned is not None:
            mine = scores[tuned][f.held_out]
            row += [f"{mine['recall_all@20']:.4f}", f"{mine['ndcg_any@20']:.4f}"]
        table.add_row(*row)
    return table


def _figures_table(result: LopoResult, scores: Mapping[str, PersonaScores], tuned: str | None) -> Table:
    keys = ["recall_all@5", "recall_all@10", "recall_all@20", "recall_any@20", "ndcg_any@10", "ndcg_any@20"]
    table = Table(title="persona-macro")
    table.add_column("figure")
    for k in keys:
        table.add_column(k, justify="right")
    rows: list[tuple[str, Mapping[str, float]]] = [("LOPO (chosen on the other personas)", result.lopo_macro)]
    rows.append((f"in-sample best on all: {result.in_sample_best}", result.in_sample_macro))
    if tuned is not None:
        rows.append((f"in-sample tuned mars: {tuned}", macro(list(scores[tuned].values()))))
    for label, values in rows:
        table.add_row(label, *(f"{values[k]:.4f}" for k in keys))
    return table
