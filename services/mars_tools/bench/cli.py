"""`mars bench ...`: retrieval benchmarks over real data (RealMem) with progress bars."""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from mars_tools.bench.policies import POLICIES, CachingEmbedder, make_retriever
from mars_tools.bench.realmem import (
    Prediction,
    evaluate,
    format_table,
    load_selected_personas,
    replay,
    write_predictions,
)


def add_realmem_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "realmem",
        help="replay RealMem personas through the memory write path and score session retrieval",
        description="Replays each persona file in list order; at every scored query retrieves from earlier "
        "sessions only (../shared/bench/realmem/PROTOCOL.md), writes one JSON line per query and prints "
        "per-persona, macro and pooled recall_any / recall_all / ndcg_any at 5, 10 and 20.",
    )
    p.add_argument("--data", required=True, help="folder holding *_dialogues_256k.json")
    p.add_argument(
        "--personas", nargs="*", help="only these personas (file name before _dialogues_256k.json)"
    )
    p.add_argument(
        "--policy", default="mars", choices=[*POLICIES, "all"], help="memory policy (default mars)"
    )
    p.add_argument(
        "--pred", required=True, help="predictions JSON lines to write (per policy with --policy all)"
    )
    p.add_argument("--out", help="write all results as JSON here")
    p.add_argument("--cache-dir", help="cache chunk embeddings here (speeds up re-runs)")
    p.add_argument("--k", type=int, default=20, help="ids retrieved per query (default 20)")
    p.add_argument(
        "--query-max-tokens",
        type=int,
        default=None,
        help="query window of the embedder (default: the model's, 256 word pieces for the default MiniLM, "
        "as the memory service embeds queries; chunks use 256)",
    )
    p.add_argument(
        "--embedding-backend",
        default="auto",
        choices=["auto", "onnx", "torch"],
        help="embedder runtime (default auto)",
    )
    p.add_argument(
        "--stored-precision",
        default="fp32",
        choices=["fp32", "int8"],
        help="weights that embed the stored turns alone (a measurement: the memory service has one precision, "
        "MARS_MEMORY_EMBEDDING_PRECISION); queries stay fp32. Give int8 runs a --cache-dir of their own: the cache "
        "is keyed by text",
    )
    p.set_defaults(func=cmd_realmem)
    # Registered beside `realmem` (mars_tools/cli.py adds the bench parsers): same data, an honest figure.
    from mars_tools.bench.realmem_lopo import add_realmem_lopo_parser

    add_realmem_lopo_parser(sub)


def cmd_realmem(args: argparse.Namespace) -> int:
    console = Console()
    try:
        personas = load_selected_personas(args.data, args.personas)
        if args.query_max_tokens is not None and args.query_max_tokens < 1:
            raise ValueError("--query-max-tokens must be at least 1")
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    policies = list(POLICIES) if args.policy == "all" else [args.policy]
    embedder = None
    query_embedder = None
    if any(p in ("mars", "mars-ranker", "hybrid", "semantic") for p in policies):
        from mars.retrieval.embedder import load_embedder

        stored = load_embedder(backend=args.embedding_backend, precision=args.stored_precision)
        embedder = CachingEmbedder(stored, args.cache_dir)
        query_embedder = load_embedder(backend=args.embedding_backend, max_seq_length=args.query_max_tokens)
    console.print(
        f"{len(personas)} personas, {sum(len(p.queries) for p in personas)} scored queries; policies: {', '.join(policies)}"
    )
    report: dict[str, object] = {}
    for policy in policies:
        preds: list[Prediction] = []
        latencies: list[float] = []
        ranker_costs: list[float] = []
        with Progress(
            TextColumn(f"[bold]{policy}[/] {{task.description}}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            for persona in personas:
                task = progress.add_task(persona.name, total=len(persona.sessions))
                try:
                    retriever = make_retriever(policy, embedder, query_embedder, ranker_costs)
                except ValueError as exc:
                    console.print(f"[red]{exc}[/]")
                    return 2
                timed = _Timed(retriever, latencies)
                advance = functools.partial(_advance, progress, task)
                preds += replay(persona, timed, args.k, progress=advance)
        if embedder is not None:
            embedder.save()
        pred_path = Path(args.pred) if len(policies) == 1 else Path(args.pred).with_suffix(f".{policy}.jsonl")
        write_predictions(pred_path, preds)
        results = evaluate(personas, preds)
        console.print(format_table(results, f"policy {policy}"), soft_wrap=True)
        latencies.sort()
        p50 = latencies[len(latencies) // 2] * 1000 if latencies else 0.0
        p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000 if latencies else 0.0
        console.print(
            f"retrieval latency per query: p50 {p50:.1f} ms, p99 {p99:.1f} ms; predictions in {pred_path}"
        )
        report[policy] = {
            "macro": results.macro.values,
            "pooled": results.pooled.values,
            "per_persona": {k: v.values for k, v in results.per_persona.items()},
            "latency_ms": {"p50": p50, "p99": p99},
        }
        if ranker_costs:
            costs = _percentiles(ranker_costs)
            console.print(
                f"ranker cost per query (signals, features and model, in the search): p50 {costs['p50']:.2f} ms, "
                f"p99 {costs['p99']:.2f} ms"
            )
            report[policy]["ranker_cost_ms"] = costs  # type: ignore[index]
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
        console.print(f"results written to {args.out}")
    return 0


def _percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50": ordered[len(ordered) // 2] * 1000,
        "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000,
    }


def _advance(progress: Progress, task: TaskID, sessions_done: int) -> None:
    progress.update(task, completed=sessions_done)


class _Timed:
    """Measures each retrieve call (the answer-path cost of a view's history search)."""

    def __init__(self, inner: object, sink: list[float]) -> None:
        self._inner = inner
        self._sink = sink

    def add_session(self, session: object) -> None:
        self._inner.add_session(session)  # type: ignore[attr-defined]

    def prepare(self, query: object) -> None:
        from mars_tools.bench.realmem import prepare_for

        prepare_for(self._inner, query)  # type: ignore[arg-type]

    def retrieve(self, query: object, k: int) -> list[str]:
        t0 = time.perf_counter()
        out: list[str] = self._inner.retrieve(query, k)  # type: ignore[attr-defined]
        self._sink.append(time.perf_counter() - t0)
        return out


def add_bench_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`mars bench` and its benchmarks."""
    from mars_tools.bench.dispatch import add_dispatch_parser
    from mars_tools.bench.locomo import add_locomo_parser
    from mars_tools.bench.memory_load import add_memory_load_parser
    from mars_tools.bench.ope import add_ope_parser
    from mars_tools.bench.replay import add_replay_bench_parser
    from mars_tools.bench.rollout import add_rollout_parser
    from mars_tools.bench.router_sim import add_router_parser

    bench = sub.add_parser("bench", help="benchmarks over real data (retrieval)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    add_realmem_parser(bench_sub)
    add_memory_load_parser(bench_sub)
    add_locomo_parser(bench_sub)
    add_router_parser(bench_sub)
    add_dispatch_parser(bench_sub)
    add_ope_parser(bench_sub)
    add_replay_bench_parser(bench_sub)
    add_rollout_parser(bench_sub)
