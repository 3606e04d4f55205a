"""What API-key verification costs the ingress per call: p50 / p99 of `KeyVerifier.verify` cold (every
call a Postgres lookup: the cache TTL at 0, or the first call of a key after its entry expired) and
cached (a SHA-256 and a dict lookup), on a Postgres of its own from the local launcher.

    .venv/bin/python load-tests/auth_bench.py [--keys 200] [--calls 5000]

The turn-level A/B (the whole answer path with MARS_INGRESS_AUTH_REQUIRED=true against false) is the load harness:

    .venv/bin/python load-tests/load.py --no-litellm --no-floor --rates 10 --seconds 30 \\
        --service-env MARS_INGRESS_AUTH_REQUIRED=false
    .venv/bin/python load-tests/load.py --no-litellm --no-floor --rates 10 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(dsn: str, keys: int, calls: int) -> dict[str, dict[str, float]]:
    import psycopg
    from mars import auth, db

    with psycopg.connect(dsn, autocommit=True) as conn:
        auth.ensure_schema(conn)
        issued = [auth.issue(conn, f"bench-{i % 20}", label="auth bench").key for i in range(keys)]
    pool = await db.open_pool(dsn)
    try:
        out: dict[str, dict[str, float]] = {}
        for name, ttl in (("cold", 0.0), ("cached", 3600.0)):
            verifier = auth.KeyVerifier(auth.pool_lookup(pool), ttl_s=ttl)
            for key in issued:  # warm the pool's connections (and, cached, every key's entry)
                await verifier.verify(key)
            took = []
            for i in range(calls):
                key = issued[i % len(issued)]
                started = time.perf_counter()
                await verifier.verify(key)
                took.append((time.perf_counter() - started) * 1000)
            out[name] = {"p50_ms": pct(took, 0.5), "p99_ms": pct(took, 0.99), "max_ms": max(took)}
        bad = auth.KeyVerifier(auth.pool_lookup(pool), ttl_s=0.0)
        took = []
        for _ in range(min(calls, 1000)):
            wrong = auth.generate_key().key
            started = time.perf_counter()
            try:
                await bad.verify(wrong)
            except auth.Unauthenticated:
                pass
            took.append((time.perf_counter() - started) * 1000)
        out["unknown key"] = {"p50_ms": pct(took, 0.5), "p99_ms": pct(took, 0.99), "max_ms": max(took)}
        return out
    finally:
        await pool.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--keys", type=int, default=200, help="keys issued (over 20 tenants)")
    parser.add_argument("--calls", type=int, default=5000, help="verifications measured per case")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(REPO / "infra"), str(REPO / "services")]
    from mars_stack import LocalStack, StackSettings

    stack = LocalStack(
        StackSettings(
            workdir=Path(tempfile.mkdtemp(prefix="mars-auth-bench-")),
            start_llm=False,
            start_broker=False,
            services=(),
        )
    ).start()
    try:
        out = asyncio.run(measure(stack.env["MARS_POSTGRES_DSN"], args.keys, args.calls))
    finally:
        stack.stop()
    print(f"API-key verification, {args.calls} calls over {args.keys} keys:")
    for name, row in out.items():
        print(
            f"  {name:12s} p50 {row['p50_ms']:.3f} ms  p99 {row['p99_ms']:.3f} ms  max {row['max_ms']:.3f} ms"
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
