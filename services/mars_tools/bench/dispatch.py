"""`mars bench dispatch`: what dispatch adds over calling the same OpenAI-compatible endpoint directly.

A minimal local OpenAI-compatible server answers every chat completion at once (so model time does not
drown the measurement). Each round makes one direct call (the same messages, posted with a pooled
httpx client) and one call through `Dispatcher.generate` (packing by Eq. 13 with the model's token
counter, circuit breaker, the same pooled client, response parsing, usage and cost, the Generated
event); rounds alternate so both see the same machine state. Prints p50 / p99 of each and of the
difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import numpy as np
from mars.domain.packing import input_budget, pack_view
from mars.domain.text import estimate_tokens
from mars.model_pool import ModelPool, ModelSpec
from mars.v1 import events_pb2 as ev
from rich.console import Console

_BODY = json.dumps(
    {
        "id": "bench",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "A short answer."}}],
        "usage": {"prompt_tokens": 400, "completion_tokens": 4, "total_tokens": 404},
    }
).encode()


async def _serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """HTTP/1.1 keep-alive: read a request (headers + Content-Length body), answer the canned completion."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if length:
                await reader.readexactly(length)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(_BODY)).encode()
                + b"\r\n\r\n"
                + _BODY
            )
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionResetError):
        pass
    finally:
        writer.close()


def _view(blocks: int, words: int, salt: int = 0) -> tuple[ev.CandidateView, ev.SessionState]:
    state = ev.SessionState(action=ev.MATCH, phase=ev.REVISE, top_k_hint=5, lens_recommendation=3)
    state.taxonomy.need_memory = 1
    view = ev.CandidateView()
    text = " ".join(f"word{i % 97}" for i in range(words)) + f" turn{salt}"
    view.blocks.add(block_id="active", kind=ev.ACTIVE_STATE, text="Active thread: " + text, score=1.0)
    for i in range(blocks):
        view.blocks.add(
            block_id=f"h{i}", kind=ev.RETRIEVED_HISTORY, text=f"User: {text}", score=1.0 / (i + 1)
        )
    return view, state


async def _run(args: argparse.Namespace, console: Console) -> dict[str, list[float]]:
    from mars_dispatch.clients import ModelClients
    from mars_dispatch.dispatcher import Dispatcher
    from mars_dispatch.settings import DispatchSettings

    server = await asyncio.start_server(_serve_connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    spec = ModelSpec(
        name="bench",
        base_url=f"http://127.0.0.1:{port}/v1",
        context_window=8192,
        output_reserve=256,
        safety_margin=128,
        input_price_per_m=0.05,
        output_price_per_m=0.10,
        tokenizer=args.tokenizer,
    )
    pool = ModelPool(models=[spec])
    clients = ModelClients(pool, retries=0)
    dispatcher = Dispatcher(pool, clients, DispatchSettings())
    direct_client = httpx.AsyncClient(base_url=spec.base_url, timeout=30)
    query = "Make the second paragraph shorter and keep the tone."
    budget = input_budget(spec.context_window, spec.output_reserve, spec.safety_margin)
    out: dict[str, list[float]] = {"direct": [], "dispatch": []}
    try:
        for i in range(args.warmup + args.calls):
            # --fresh: new block texts every round, so no token count is reused from an earlier turn.
            view, state = _view(args.blocks, args.words, i if args.fresh else 0)
            # The direct call's messages, built untimed with the estimate (same text, no cache warmed).
            body = {
                "model": spec.model,
                "messages": pack_view(view, query, state, budget, estimate_tokens).messages,
                "max_tokens": 64,
                "temperature": 0.0,
            }
            t0 = time.perf_counter()
            resp = await direct_client.post("/chat/completions", json=body)
            resp.json()
            t1 = time.perf_counter()
            generated = await dispatcher.generate(["bench"], query, state, view, 64)
            t2 = time.perf_counter()
            if generated.status != ev.OK:
                raise RuntimeError(f"dispatch failed against the local server: {generated.error}")
            if i >= args.warmup:
                out["direct"].append((t1 - t0) * 1000)
                out["dispatch"].append((t2 - t1) * 1000)
    finally:
        await direct_client.aclose()
        await clients.close()
        server.close()
        await server.wait_closed()
    return out


def cmd_dispatch(args: argparse.Namespace) -> int:
    console = Console(soft_wrap=True)
    if args.calls < 10:
        console.print("[red]--calls must be at least 10[/]")
        return 2
    times = asyncio.run(_run(args, console))
    direct, through = np.asarray(times["direct"]), np.asarray(times["dispatch"])
    diff = through - direct
    console.print(
        f"{len(direct)} calls, view of {args.blocks + 1} blocks x {args.words} words, "
        f"token counter {args.tokenizer or 'estimate'}, {'fresh' if args.fresh else 'recurring'} memory text"
    )
    for name, values in (("direct call", direct), ("through dispatch", through), ("dispatch overhead", diff)):
        console.print(
            f"{name:<18} p50 {np.percentile(values, 50):.3f} ms  p99 {np.percentile(values, 99):.3f} ms"
        )
    return 0


def add_dispatch_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "dispatch",
        help="dispatch overhead over a direct call to the same local OpenAI-compatible endpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--calls", type=int, default=2000, help="timed rounds (default 2000)")
    p.add_argument("--warmup", type=int, default=100, help="untimed rounds first (default 100)")
    p.add_argument("--blocks", type=int, default=8, help="retrieved-history blocks in the view (default 8)")
    p.add_argument("--words", type=int, default=60, help="words per block (default 60)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="token counter for packing, as in the model pool (gguf:PATH, hf:PATH); default the estimate",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="new memory text every round (no token count reused across turns; the worst case)",
    )
    p.set_defaults(func=cmd_dispatch)
