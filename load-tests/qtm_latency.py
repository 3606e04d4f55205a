"""Per-turn time of the state controller on CPU, the learned model beside the rules, in one run.

    .venv/bin/python load-tests/qtm_latency.py [--model M] [--labels F] [--repeat 3] [--json OUT]

Every turn of the labelled set (mars_state.qtm.labelled) is estimated with its gold active thread, as the state
service would (GuardedEstimator: controller, clamping, guardrails). The MiniLM embeddings of the texts are
computed once beforehand (the service's LRU cache holds a thread's earlier turns, and the memory service has
the turn's own vector), so the learned row is the controller's own work: features, six heads, the guard.
Target (issue 17): p99 <= 3 ms per turn with embeddings cached. Prints p50 / p99 / max per backend.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from mars.retrieval.embedder import LruEmbedder, load_embedder
from mars_state.qtm.guard import GuardedEstimator
from mars_state.qtm.labelled import DEFAULT_LABELS, read_labelled
from mars_state.qtm.learned import DEFAULT_MODEL, LearnedController, LearnedModel
from mars_tools.probe.common import percentile
from rich.console import Console
from rich.progress import Progress


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=str(DEFAULT_MODEL), help="learned model file (default: the packaged one)"
    )
    ap.add_argument(
        "--labels", default=str(DEFAULT_LABELS), help="labelled turns (default: the repository's)"
    )
    ap.add_argument("--repeat", type=int, default=3, help="passes over the set per backend (default 3)")
    ap.add_argument("--json", help="write the numbers as JSON here")
    args = ap.parse_args()
    console = Console()
    _, turns = read_labelled(Path(args.labels))
    cache = LruEmbedder(load_embedder(), size=1_000_000)
    texts = sorted({t.text for t in turns} | {c for t in turns for c in t.context})
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("embedding the set once", total=len(texts))
        for i in range(0, len(texts), 32):
            cache.encode(texts[i : i + 32])
            progress.advance(task, len(texts[i : i + 32]))
    estimators = {
        "rules": GuardedEstimator(None),
        "learned": GuardedEstimator(LearnedController(LearnedModel.load(Path(args.model)), cache.encode)),
    }

    async def timed(est: GuardedEstimator) -> list[float]:
        times: list[float] = []
        for _ in range(args.repeat):
            for t in turns:
                started = time.perf_counter()
                await est.estimate(t.text, list(t.context), t.opens_session)
                times.append((time.perf_counter() - started) * 1000)
        return times

    result = {}
    for name, est in estimators.items():
        times = asyncio.run(timed(est))
        result[name] = {
            "turns": len(times),
            "p50_ms": percentile(times, 0.5),
            "p99_ms": percentile(times, 0.99),
            "max_ms": max(times),
        }
    console.print(f"{len(turns)} labelled turns x {args.repeat}, embeddings cached")
    console.print(f"{'backend':<10}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for name, r in result.items():
        console.print(f"{name:<10}{r['p50_ms']:>10.3f}{r['p99_ms']:>10.3f}{r['max_ms']:>10.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
