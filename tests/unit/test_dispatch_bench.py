"""`mars bench dispatch` runs against its local OpenAI-compatible server and measures both paths."""

from __future__ import annotations

import argparse
import asyncio

from mars_tools.bench.dispatch import _run
from rich.console import Console


def test_dispatch_bench_times_direct_and_dispatched_calls() -> None:
    args = argparse.Namespace(calls=20, warmup=2, blocks=3, words=20, tokenizer=None, fresh=True)
    times = asyncio.run(_run(args, Console()))
    assert len(times["direct"]) == len(times["dispatch"]) == 20
    assert all(t > 0 for t in times["direct"] + times["dispatch"])
