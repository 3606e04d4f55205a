"""The OpenAI-compatible gateway's overhead over the gRPC ingress, measured in one run.

    .venv/bin/python load-tests/gateway_bench.py --rate 50 --seconds 30 --rounds 3 --json OUT

One local stack (stand-in LLM answering in a fixed `--latency-ms`, the gateway in front of the ingress).
Open-loop turns at `--rate` per second over `--users` users, in rounds that alternate the two ways in:
the gRPC ingress (SendTurn) and the gateway (POST /v1/chat/completions, one keep-alive aiohttp session), so
drift in the machine's load falls on both alike. Per way: end-to-end p50 / p99 over all rounds' OK calls,
and the gateway's overhead = its p50 / p99 minus the ingress's; and the gateway's own time per request
from its Server-Timing header (parsing, mapping, serializing: everything but the ingress call).
Target (issue 18): <= 2 ms p50, 5 ms p99 at 50 turns/s. Every number comes from this run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # load.py beside this file
from load import REPO, TENANT, Sample, mars_sender, open_loop, percentile


def gateway_sender(base_url: str, timeout_s: float, api_key: str, server_ms: list[float]) -> tuple[Any, Any]:
    """POST /v1/chat/completions as an OpenAI app would, on one pooled keep-alive aiohttp session; each
    reply's Server-Timing `gateway` duration (the gateway's own time, outside the ingress call) goes to
    `server_ms`."""
    import aiohttp

    session = aiohttp.ClientSession(
        base_url=base_url,
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        connector=aiohttp.TCPConnector(limit=256),
        headers={"Authorization": f"Bearer {api_key}"},
    )

    async def send(user: str, text: str) -> Sample:
        started = time.monotonic()
        payload = {
            "model": "mars",
            "user": user,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 32,
        }
        try:
            async with session.post("/v1/chat/completions", json=payload) as resp:
                body = await resp.json()
                status, timing = resp.status, resp.headers.get("server-timing", "")
        except (aiohttp.ClientError, TimeoutError) as exc:
            return Sample(time.monotonic() - started, 0.0, False, type(exc).__name__)
        e2e = time.monotonic() - started
        if status != 200:
            return Sample(e2e, 0.0, False, f"HTTP {status}")
        server_ms.append(float(timing.split("gateway;dur=")[1].split(",")[0]))
        model_s = sum(a.get("latency_ms", 0.0) for a in body["mars"]["attempts"]) / 1000
        return Sample(e2e, model_s, True, turn_id=body["mars"]["turn_id"])

    return send, session


def summary(samples: list[Sample]) -> dict[str, float]:
    ok = [s for s in samples if s.ok]
    e2e = [1000 * s.e2e_s for s in ok]
    return {
        "sent": len(samples),
        "errors": len(samples) - len(ok),
        "p50_ms": percentile(e2e, 0.5),
        "p99_ms": percentile(e2e, 0.99),
    }


async def compare(
    ingress: str,
    gateway_url: str,
    api_key: str,
    rate: float,
    seconds: float,
    rounds: int,
    users: int,
    warmup_s: float,
    timeout_s: float,
) -> dict[str, Any]:
    """Rounds alternating ingress and gateway at `rate`; the samples of each way over all rounds."""
    grpc_send, channel = mars_sender(ingress, timeout_s, api_key)
    server_ms: list[float] = []
    http_send, client = gateway_sender(gateway_url, timeout_s, api_key, server_ms)
    ways = {"ingress": grpc_send, "gateway": http_send}
    samples: dict[str, list[Sample]] = {w: [] for w in ways}
    try:
        for send in ways.values():  # warm both: connections, each user's first turn
            await open_loop(send, rate, warmup_s, users, seed=0)
        server_ms.clear()
        for r in range(rounds):
            order = list(ways) if r % 2 == 0 else list(reversed(ways))
            for way in order:
                got, _ = await open_loop(ways[way], rate, seconds, users, seed=r + 1)
                samples[way] += got
                row = summary(got)
                print(
                    f"[gateway-bench] round {r + 1} {way}: p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, "
                    f"{int(row['errors'])} errors",
                    flush=True,
                )
    finally:
        await channel.close()
        await client.close()
    out: dict[str, Any] = {w: summary(s) for w, s in samples.items()}
    out["overhead_p50_ms"] = out["gateway"]["p50_ms"] - out["ingress"]["p50_ms"]
    out["overhead_p99_ms"] = out["gateway"]["p99_ms"] - out["ingress"]["p99_ms"]
    out["gateway_server_p50_ms"] = percentile(server_ms, 0.5)
    out["gateway_server_p99_ms"] = percentile(server_ms, 0.99)
    out.update(rate=rate, seconds=seconds, rounds=rounds, users=users)
    return out


def print_result(out: dict[str, Any]) -> None:
    print(
        f"\ngateway vs gRPC ingress at {out['rate']:g} turns/s ({out['rounds']} rounds x {out['seconds']:g}s each)"
    )
    print(f"{'way':8s} {'sent':>6s} {'errors':>6s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for way in ("ingress", "gateway"):
        r = out[way]
        print(f"{way:8s} {r['sent']:6d} {r['errors']:6d} {r['p50_ms']:8.1f} {r['p99_ms']:8.1f}")
    print(f"gateway overhead: p50 {out['overhead_p50_ms']:+.1f} ms, p99 {out['overhead_p99_ms']:+.1f} ms")
    print(
        f"the gateway's own time (Server-Timing, outside the ingress call): p50 {out['gateway_server_p50_ms']:.2f} ms, "
        f"p99 {out['gateway_server_p99_ms']:.2f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rate", type=float, default=50.0, help="turns per second (default 50)")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds per round and way (default 30)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each sending both ways (default 3)")
    parser.add_argument("--users", type=int, default=50)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--latency-ms", type=float, default=50.0, help="the stand-in LLM's fixed latency")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.seconds <= 0 or args.rounds < 1:
        parser.error("--rate and --seconds must be positive and --rounds at least 1")

    sys.path[:0] = [str(REPO / "infra"), str(REPO / "services")]
    import signal
    import tempfile

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from mars.auth import mint_key
    from mars_stack import LocalStack, StackSettings

    stack = LocalStack(
        StackSettings(
            workdir=Path(tempfile.mkdtemp(prefix="mars-gw-bench-")),
            model_pool=REPO / "config" / "models.standin.yaml",
            llm="standin",
            standin_latency_ms=args.latency_ms,
            extra_env={
                "MARS_INGRESS_TURN_TIMEOUT_S": str(args.timeout_s),
                "MARS_GATEWAY_TURN_TIMEOUT_S": str(args.timeout_s),
            },
            gateway=True,
        )
    ).start(progress=lambda m: print(f"[gateway-bench] {m}", flush=True))
    try:
        key = mint_key(stack.env["MARS_POSTGRES_DSN"], TENANT, label="gateway bench").key
        out = asyncio.run(
            compare(
                stack.addr("ingress"),
                stack.env["MARS_GATEWAY_URL"],
                key,
                args.rate,
                args.seconds,
                args.rounds,
                args.users,
                args.warmup_s,
                args.timeout_s,
            )
        )
    finally:
        stack.stop()
    print_result(out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
