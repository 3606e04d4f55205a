"""`mars bench memory-load`: the memory index at scale — search latency at 1M vectors over 10k users,
write-to-searchable latency, and ingest throughput against the raw embedder in the same run."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from mars.retrieval.dense import ShardedDenseIndex, gpu_count
from rich.console import Console
from rich.progress import Progress


def add_memory_load_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "memory-load",
        help="synthetic scale test of the memory index (search p50/p99, write-to-searchable, ingest ratio)",
        description="Fills per-user exact FAISS indexes with random unit vectors (embedding excluded), then "
        "measures search and write-to-searchable latency; separately embeds real-looking turn texts with the "
        "default embedder, raw and through the ingest path, and prints the throughput ratio.",
    )
    p.add_argument("--vectors", type=int, default=1_000_000, help="total vectors (default 1,000,000)")
    p.add_argument("--users", type=int, default=10_000, help="users sharing them (default 10,000)")
    p.add_argument("--dim", type=int, default=384, help="vector dimension (default 384, MiniLM)")
    p.add_argument("--searches", type=int, default=20_000, help="timed searches (default 20,000)")
    p.add_argument(
        "--writes", type=int, default=5_000, help="timed write-to-searchable probes (default 5,000)"
    )
    p.add_argument(
        "--ingest-texts", type=int, default=1_024, help="texts for the ingest ratio (default 1,024)"
    )
    p.add_argument("--k", type=int, default=8, help="neighbours per search (default 8)")
    p.add_argument(
        "--device",
        choices=["cpu", "gpu"],
        default="cpu",
        help="FAISS on the CPU (default, as in the memory service) or on the GPU (needs a faiss GPU build)",
    )
    p.add_argument("--no-ingest", action="store_true", help="skip the embedder ingest-ratio part")
    p.set_defaults(func=cmd_memory_load)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000.0, q))


def cmd_memory_load(args: argparse.Namespace) -> int:
    console = Console()
    if args.vectors < args.users or args.users <= 0:
        console.print("[red]--vectors must be at least --users, and --users positive[/]")
        return 2
    if args.device == "gpu" and gpu_count() == 0:
        console.print("[red]--device gpu needs a CUDA GPU and a faiss GPU build (faiss sees no GPU here)[/]")
        return 2
    rng = np.random.default_rng(7)
    index = ShardedDenseIndex(args.dim, use_gpu=args.device == "gpu")
    per_user = args.vectors // args.users
    batch_users = 250
    t0 = time.perf_counter()
    with Progress(console=console) as progress:
        task = progress.add_task("filling indexes", total=args.users)
        next_id = 0
        for start in range(0, args.users, batch_users):
            users = range(start, min(args.users, start + batch_users))
            block = rng.standard_normal((len(users) * per_user, args.dim), dtype=np.float32)
            block /= np.linalg.norm(block, axis=1, keepdims=True)
            for j, user in enumerate(users):
                ids = np.arange(next_id, next_id + per_user, dtype=np.int64)
                index.owner(user).add(ids, block[j * per_user : (j + 1) * per_user])
                next_id += per_user
            progress.update(task, advance=len(users))
    fill_s = time.perf_counter() - t0
    console.print(
        f"{index.total:,} vectors over {len(index):,} users in {fill_s:.1f}s (GPU: {index.owner(0).on_gpu})"
    )

    queries = rng.standard_normal((args.searches, args.dim), dtype=np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    users = rng.integers(0, args.users, size=args.searches)
    search: list[float] = []
    for q, u in zip(queries, users, strict=True):
        t = time.perf_counter()
        index.search(int(u), q, args.k)
        search.append(time.perf_counter() - t)

    writes: list[float] = []
    for i in range(args.writes):
        u = int(rng.integers(0, args.users))
        v = rng.standard_normal(args.dim, dtype=np.float32)
        v /= np.linalg.norm(v)
        t = time.perf_counter()
        index.owner(u).add(np.array([10**12 + i], dtype=np.int64), v[None, :])
        hit = index.search(u, v, 1)
        writes.append(time.perf_counter() - t)
        if not hit or hit[0][0] != 10**12 + i:
            console.print("[red]a written vector was not immediately searchable[/]")
            return 1

    console.print(
        f"search ({args.k}-NN in one user's index, embedding excluded): "
        f"p50 {_pct(search, 50):.3f} ms, p99 {_pct(search, 99):.3f} ms over {len(search):,} searches"
    )
    console.print(
        f"write-to-searchable: p50 {_pct(writes, 50):.3f} ms, p99 {_pct(writes, 99):.3f} ms "
        f"over {len(writes):,} writes"
    )
    if not args.no_ingest:
        _ingest_ratio(args, console)
    return 0


def _ingest_ratio(args: argparse.Namespace, console: Console) -> None:
    from mars.retrieval.embedder import load_embedder
    from mars.retrieval.hybrid import HybridMemory

    embedder = load_embedder()
    words = "plan trip budget poem revise garden recipe code bug meeting summary draft travel music".split()
    rng = np.random.default_rng(3)
    texts = [
        "User: " + " ".join(rng.choice(words, 12)) + "\nAssistant: " + " ".join(rng.choice(words, 40))
        for _ in range(args.ingest_texts)
    ]
    embedder.encode(texts[:32])  # warm-up
    t = time.perf_counter()
    embedder.encode(texts)
    raw = len(texts) / (time.perf_counter() - t)
    # The ingest path: chunking, batched embedding, FAISS + BM25 insertion, group bookkeeping.
    memory = HybridMemory(embedder, use_gpu=args.device == "gpu")
    t = time.perf_counter()
    from mars.retrieval.hybrid import chunk_pieces, embed_chunks

    batch = 64
    for start in range(0, len(texts), batch):
        part = texts[start : start + batch]
        vectors = embed_chunks(embedder, part, memory.config.max_chunk_words)
        offset = 0
        for i, text in enumerate(part):
            n = len(chunk_pieces([text], memory.config.max_chunk_words))
            memory.add_group(f"r{start + i}", start + i, [text], vectors[offset : offset + n])
            offset += n
    ingest = len(texts) / (time.perf_counter() - t)
    console.print(
        f"ingest: {ingest:,.0f} texts/s through chunking + embedding + index vs raw embedder {raw:,.0f} texts/s "
        f"(ratio {ingest / raw:.2f})"
    )


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m mars_tools.bench.memory_load`), needing only faiss, numpy and rich: how the
    GPU node check runs it without the whole service stack installed."""
    parser = argparse.ArgumentParser(prog="python -m mars_tools.bench.memory_load")
    add_memory_load_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["memory-load", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
