"""What one embedding of a stored pair costs the memory service, one by one against batched, per precision.

    .venv/bin/python load-tests/embed_bench.py --data ../shared/bench/locomo/locomo7.json \\
        [--pairs 128] [--batches 4,8,16] [--precisions fp32,int8] [--threads 1] [--repeat 2] [--json OUT]

A pair is three consecutive LoCoMo turns joined as the memory service joins a user turn and its answer
(about 90 tokens), drawn with a fixed seed. Each precision embeds every pair one ONNX run at a time, then in
batches of each size (padded to the batch's longest pair, as `OnnxEmbedder.encode` does), `--repeat` times.
Prints ms per pair, the batch's speed against one by one measured in the same pass, the largest
difference between a batched and a single vector, and each precision's mean cosine to fp32's vectors.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
from mars.retrieval.embedder import PRECISIONS, OnnxEmbedder
from mars_tools.bench.locomo import load_locomo
from rich.console import Console
from rich.table import Table


def sample_pairs(path: str, n: int, seed: int = 1) -> list[str]:
    """`n` stored-pair-sized texts: three consecutive turns of one conversation each, drawn with `seed`."""
    texts = [[t.text for t in conv.turns] for conv in load_locomo(path)]
    starts = [(c, i) for c, turns in enumerate(texts) for i in range(len(turns) - 2)]
    if not starts:
        raise SystemExit(f"{path}: no conversation with three turns")
    rng = random.Random(seed)
    picked = rng.sample(starts, min(n, len(starts)))
    return [f"{texts[c][i]}\n{texts[c][i + 1]} {texts[c][i + 2]}" for c, i in picked]


def time_pass(embedder: OnnxEmbedder, pairs: list[str], batch: int) -> tuple[float, np.ndarray]:
    """Seconds per pair, and the vectors, embedding `pairs` in runs of `batch`."""
    started = time.perf_counter()
    out = np.vstack([embedder.encode(pairs[i : i + batch]) for i in range(0, len(pairs), batch)])
    return (time.perf_counter() - started) / len(pairs), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a LoCoMo JSON file (list of conversations)")
    ap.add_argument("--pairs", type=int, default=128, help="pairs embedded per pass (default 128)")
    ap.add_argument("--batches", default="4,8,16", help="batch sizes beside one by one (default 4,8,16)")
    ap.add_argument("--precisions", default="fp32,int8", help=f"of {', '.join(PRECISIONS)} (default both)")
    ap.add_argument("--threads", type=int, default=1, help="ONNX intra-op threads (the memory service: 1)")
    ap.add_argument("--repeat", type=int, default=2, help="passes per precision (default 2)")
    ap.add_argument("--json", help="write the rows as JSON here")
    args = ap.parse_args()
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if unknown := [p for p in precisions if p not in PRECISIONS]:
        ap.error(f"--precisions: unknown {unknown}; choose from {PRECISIONS}")
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        ap.error("--batches: comma-separated whole numbers")
    if any(b < 1 for b in batches) or args.pairs < 1 or args.repeat < 1 or args.threads < 1:
        ap.error("--pairs, --batches, --threads and --repeat must be at least 1")
    console = Console()
    pairs = sample_pairs(args.data, args.pairs)
    rows: list[dict[str, object]] = []
    reference: np.ndarray | None = None
    tokens_mean = 0.0
    for precision in precisions:
        embedder = OnnxEmbedder(threads=args.threads, precision=precision)
        if not tokens_mean:  # every precision tokenises alike
            tokens_mean = float(np.mean([len(embedder._tokenizer(p)["input_ids"]) for p in pairs]))
        embedder.encode(pairs[:4])  # warm-up: the session's first run allocates
        for rep in range(args.repeat):
            single_s, single = time_pass(embedder, pairs, 1)
            if reference is None:
                reference = single
            cosine = float(np.mean(np.sum(single * reference, axis=1)))
            rows.append(_row(precision, rep, 1, single_s, 1.0, 0.0, cosine, tokens_mean))
            for batch in batches:
                seconds, vectors = time_pass(embedder, pairs, batch)
                diff = float(np.abs(vectors - single).max())
                rows.append(_row(precision, rep, batch, seconds, single_s / seconds, diff, cosine, tokens_mean))
    table = Table(title=f"{len(pairs)} pairs, {args.threads} thread(s), tokens mean {tokens_mean:.1f}")
    for column in ("precision", "pass", "batch", "ms / pair", "speed vs one by one", "max |diff|", "cos to fp32"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            str(r["precision"]), str(r["pass"]), str(r["batch"]), f"{r['ms_per_pair']:.2f}",
            f"{r['speed']:.2f}x", f"{r['max_diff']:.1e}", f"{r['cosine_to_first']:.4f}",
        )
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _row(
    precision: str, rep: int, batch: int, seconds: float, speed: float, diff: float, cosine: float, tokens_mean: float
) -> dict[str, object]:
    return {
        "precision": precision,
        "pass": rep + 1,
        "batch": batch,
        "ms_per_pair": seconds * 1000,
        "speed": speed,
        "max_diff": diff,
        "cosine_to_first": cosine,
        "tokens_mean": tokens_mean,
    }


if __name__ == "__main__":
    raise SystemExit(main())
