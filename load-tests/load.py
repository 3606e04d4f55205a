"""Open-loop load: MARS beside the LiteLLM proxy, both on the same stand-in LLM upstream.

    .venv/bin/python load-tests/load.py --rates 10,25,50,100 --seconds 60 --json OUT [--no-litellm]

Each rate sends turns on a fixed schedule (open loop: a turn leaves on time whatever happened to the
ones before it) for `--seconds`, over `--users` users, from this process; the systems under test run
as their own processes. The upstream is `mars_stack.standin_llm`, answering after a fixed
`--latency-ms` (the one test double: it stands in for the LLM so the numbers are the systems' own).

Per rate and system: achieved rate, errors (of them: shed at the door, with the p99 wait for the refusal,
and timed out), end-to-end p50 / p99 / max, and overhead p50 / p99, where
overhead = end-to-end minus the time spent in the model call (MARS: the dispatch attempts' measured
call time from the reply; LiteLLM: the upstream's fixed latency). OUT is
{"mars": [ROW...], "litellm": [ROW...]}.

LiteLLM runs from its own virtual environment (`make litellm` creates load-tests/.venv-litellm);
`--no-litellm` measures MARS alone.

The ingress's load shedding (mars_ingress.capacity, off by default) is measured with
`--service-env MARS_INGRESS_ADMISSION_LIMIT=true`.

`--kafka-security both` measures what the broker's SASL_SSL (per-service SCRAM logins over TLS, ACLs; the
local stack's default) costs: MARS alone, once with a plaintext broker and once with SASL_SSL, one after
the other in this session, then the two side by side per rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LITELLM_VENV = REPO / "load-tests" / ".venv-litellm"
MASTER_KEY = "sk-mars-load-" + "0" * 32
sys.path.insert(0, str(Path(__file__).resolve().parent))  # decompose.py beside this file
import cpu_profile  # noqa: E402
import decompose  # noqa: E402
import pg_statements  # noqa: E402

TENANT = "load"
WORDS = "ferry budget hotel museum recipe garden invoice violin passport bicycle concert telescope".split()


@dataclass
class Sample:
    e2e_s: float
    model_s: float
    ok: bool
    error: str = ""
    turn_id: str = ""


@dataclass
class Row:
    rate: float
    achieved: float
    sent: int
    errors: int
    e2e_p50_ms: float
    e2e_p99_ms: float
    e2e_max_ms: float
    overhead_p50_ms: float
    overhead_p99_ms: float
    error_kinds: dict[str, int] = field(default_factory=dict)
    #: Turns shed at the door (RESOURCE_EXHAUSTED: MARS's concurrency limit, or LiteLLM's HTTP 429), how
    #: long the slowest of them waited for the refusal (p99), and turns that ran out of time.
    rejected: int = 0
    #: Errors that were neither a refusal nor a timeout.
    failed: int = 0
    rejected_p99_ms: float = float("nan")
    timed_out: int = 0
    #: CPU ms per turn sent, per process of the system (and the load generator), and cores busy in all.
    cpu_ms_per_turn: dict[str, float] = field(default_factory=dict)
    cores_busy: float = 0.0
    #: The system's CPU (its processes, not the load generator) per turn answered: what a turn it admitted
    #: and answered cost, refused and failed turns' work included.
    cpu_ms_per_answered: float = float("nan")
    #: Postgres statements per turn, by the service owning each statement's table (MARS only).
    pg_statements: dict[str, Any] = field(default_factory=dict)


#: How a shed turn and a turn out of time show in Sample.error (gRPC code names, HTTP statuses).
REFUSALS = ("RESOURCE_EXHAUSTED", "HTTP 429")
TIMEOUTS = ("DEADLINE_EXCEEDED", "timeout")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarise(rate: float, seconds: float, samples: list[Sample], elapsed_s: float) -> Row:
    ok = [s for s in samples if s.ok]
    kinds: dict[str, int] = {}
    for s in samples:
        if not s.ok:
            kinds[s.error] = kinds.get(s.error, 0) + 1
    e2e = [1000 * s.e2e_s for s in ok]
    over = [1000 * (s.e2e_s - s.model_s) for s in ok]
    refused = [1000 * s.e2e_s for s in samples if s.error in REFUSALS]
    return Row(
        rate=rate,
        achieved=len(ok) / max(elapsed_s, 1e-9),
        sent=len(samples),
        errors=len(samples) - len(ok),
        e2e_p50_ms=percentile(e2e, 0.5),
        e2e_p99_ms=percentile(e2e, 0.99),
        e2e_max_ms=max(e2e, default=float("nan")),
        overhead_p50_ms=percentile(over, 0.5),
        overhead_p99_ms=percentile(over, 0.99),
        error_kinds=kinds,
        rejected=len(refused),
        rejected_p99_ms=percentile(refused, 0.99),
        timed_out=sum(n for kind, n in kinds.items() if kind in TIMEOUTS),
        failed=sum(n for kind, n in kinds.items() if kind not in TIMEOUTS and kind not in REFUSALS),
    )


async def open_loop(
    send: Any, rate: float, seconds: float, users: int, seed: int
) -> tuple[list[Sample], float]:
    """Fire `send(user, text)` at `rate` per second for `seconds`; the elapsed time runs until the last
    answer, so `achieved` falls when the system falls behind."""
    rng = random.Random(seed)
    samples: list[Sample] = []
    tasks = []
    start = time.monotonic()
    for i in range(max(1, int(rate * seconds))):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        text = f"question {i}: what about the {rng.choice(WORDS)} and the {rng.choice(WORDS)}?"
        tasks.append(asyncio.create_task(send(f"u{i % users:03d}", text)))
    samples = list(await asyncio.gather(*tasks))
    return samples, time.monotonic() - start


def mars_sender(target: str, timeout_s: float, api_key: str) -> tuple[Any, Any]:
    import grpc
    from mars.v1 import services_pb2 as svc
    from mars.v1 import services_pb2_grpc as svc_grpc
    from mars_ingress.client import aio_ingress_channel

    # No retries by gRPC itself (mars_ingress.client sends a shed turn again): every refusal is counted as it came.
    channel = aio_ingress_channel(target, api_key, options=[("grpc.enable_retries", 0)])
    stub = svc_grpc.IngressStub(channel)

    async def send(user: str, text: str) -> Sample:
        started = time.monotonic()
        try:
            reply = await stub.SendTurn(
                svc.TurnRequest(tenant=TENANT, user_id=user, text=text, options={"max_tokens": "32"}),
                timeout=timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            return Sample(time.monotonic() - started, 0.0, False, exc.code().name)
        model_s = sum(a.latency_ms for a in reply.attempts) / 1000
        return Sample(time.monotonic() - started, model_s, True, turn_id=reply.turn_id)

    return send, channel


def litellm_sender(base_url: str, upstream_s: float, timeout_s: float) -> tuple[Any, Any]:
    import httpx

    connections = 512
    client = httpx.AsyncClient(
        base_url=base_url, timeout=timeout_s, limits=httpx.Limits(max_connections=connections)
    )
    # Requests beyond the connection limit wait here, not in httpcore's pool: its queue is scanned per
    # request, and with thousands queued (an overloaded peer) the generator itself used a whole core.
    # The time waited here counts in the request's latency, as it would for a client.
    slots = asyncio.Semaphore(connections)

    async def send(user: str, text: str) -> Sample:
        started = time.monotonic()
        try:
            # The whole request within the deadline, as MARS's gRPC calls are.
            async with asyncio.timeout(timeout_s), slots:
                return await _post(started, user, text)
        except TimeoutError:
            return Sample(time.monotonic() - started, upstream_s, False, "timeout")

    async def _post(started: float, user: str, text: str) -> Sample:
        try:
            resp = await client.post(
                "/v1/chat/completions",
                json={"model": "standin", "messages": [{"role": "user", "content": text}], "max_tokens": 32},
                headers={"Authorization": f"Bearer {MASTER_KEY}"},
            )
            ok = resp.status_code == 200
            error = "" if ok else f"HTTP {resp.status_code}"
        except httpx.HTTPError as exc:
            ok, error = False, type(exc).__name__
        return Sample(time.monotonic() - started, upstream_s, ok, error)

    return send, client


def start_litellm(upstream_url: str, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    from mars_stack.readiness import free_port, tcp_open, wait_until

    exe = LITELLM_VENV / "bin" / "litellm"
    if not exe.exists():
        raise SystemExit(
            f"LiteLLM is not installed: run `make litellm` (creates {LITELLM_VENV}) or pass --no-litellm"
        )
    port = free_port()
    config = workdir / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: standin\n"
        "    litellm_params:\n"
        "      model: openai/standin\n"
        f"      api_base: {upstream_url}/v1\n"
        "      api_key: sk-local\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
    )
    log = (workdir / "litellm.log").open("ab")
    # A master key as a deployment would have (the proxy refuses to start without one); the load sends it.
    env = {
        **os.environ,
        "LITELLM_LOG": "ERROR",
        "LITELLM_TELEMETRY": "False",
        "LITELLM_MASTER_KEY": MASTER_KEY,
    }
    proc = subprocess.Popen(
        [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    wait_until(lambda: tcp_open(port), 120, "LiteLLM proxy", proc, workdir / "litellm.log")
    return proc, f"http://127.0.0.1:{port}"


async def run_rates(
    args: argparse.Namespace,
    rates: list[float],
    ingress: str,
    litellm_url: str,
    out: dict[str, list[Any]],
    windows: list[tuple[float, float, float]],
    sessions: dict[str, dict[str, int]],
) -> None:
    """Every rate for each system in turn; `windows` gets MARS's (rate, first send, last send) in epoch
    seconds, to cut the spans by rate. Each row also gets the CPU milliseconds per turn of every process
    of the system (`sessions[system]`: name -> session leader pid) and of this load generator."""
    send, channel = mars_sender(ingress, args.timeout_s, args.api_key)
    systems: list[tuple[str, Any]] = []
    client = None
    if litellm_url:
        lsend, client = litellm_sender(litellm_url, args.latency_ms / 1000, args.timeout_s)
        systems.append(("litellm", lsend))
    # MARS last: a rate it cannot keep up with leaves a backlog that would run beside the peer's rates.
    systems.append(("mars", send))
    try:
        for system, sender in systems:
            print(f"[load] {system}: warm-up {args.warmup_s:g}s at {rates[0]:g}/s", flush=True)
            await open_loop(sender, rates[0], args.warmup_s, args.users, seed=0)
            for k, rate in enumerate(rates):
                if k:  # each rate starts on an idle system, not on the backlog of an overloaded one
                    waited = await asyncio.to_thread(decompose.wait_idle, sessions[system])
                    if waited > 5:
                        print(
                            f"[load] {system}: waited {waited:.0f}s for the last rate's backlog", flush=True
                        )
                since = time.time()
                spies = []
                if args.profile and system == "mars" and rate == args.profile_rate:
                    spies = cpu_profile.start(sessions[system], args.seconds, args.profile, f"{rate:g}")
                if system == "mars" and args.postgres_dsn:
                    await asyncio.to_thread(pg_statements.reset, args.postgres_dsn)
                cpu0, own0 = decompose.cpu_seconds(sessions[system]), time.process_time()
                samples, elapsed = await open_loop(sender, rate, args.seconds, args.users, seed=k + 1)
                cpu1, own1 = decompose.cpu_seconds(sessions[system]), time.process_time()
                for spy in spies:
                    await asyncio.to_thread(spy.wait, 60)
                if system == "mars":
                    windows.append((rate, since, time.time()))  # the next rate starts after this
                row = summarise(rate, args.seconds, samples, elapsed)
                turns = max(1, len(samples))
                row.cpu_ms_per_turn = {n: 1000 * (cpu1[n] - cpu0[n]) / turns for n in cpu0}
                row.cpu_ms_per_turn["load generator"] = 1000 * (own1 - own0) / turns
                row.cores_busy = (sum(cpu1.values()) - sum(cpu0.values()) + own1 - own0) / elapsed
                answered = len(samples) - row.errors
                if answered:
                    row.cpu_ms_per_answered = 1000 * (sum(cpu1.values()) - sum(cpu0.values())) / answered
                if system == "mars" and args.postgres_dsn:
                    row.pg_statements = await asyncio.to_thread(
                        pg_statements.per_turn, args.postgres_dsn, len(samples)
                    )
                out[system].append(row.__dict__)
                print(
                    f"[load] {system} {rate:g}/s: p50 {row.e2e_p50_ms:.1f} ms, {row.errors} errors",
                    flush=True,
                )
    finally:
        await channel.close()
        if client is not None:
            await client.aclose()


def print_table(system: str, rows: list[Row]) -> None:
    print(f"\n{system}")
    print(
        f"{'rate':>6s} {'achieved':>9s} {'shed':>6s} {'shed p99':>9s} {'failed':>7s} {'timeout':>7s} "
        f"{'e2e p50':>9s} {'e2e p99':>9s} {'e2e max':>9s} {'ovh p50':>9s} {'ovh p99':>9s} {'CPU/ans':>8s}"
    )
    for r in rows:
        print(
            f"{r.rate:6g} {r.achieved:9.1f} {r.rejected:6d} {r.rejected_p99_ms:9.1f} {r.failed:7d} "
            f"{r.timed_out:7d} {r.e2e_p50_ms:9.1f} {r.e2e_p99_ms:9.1f} {r.e2e_max_ms:9.1f} "
            f"{r.overhead_p50_ms:9.1f} {r.overhead_p99_ms:9.1f} {r.cpu_ms_per_answered:8.1f}"
        )
    print(
        "(achieved: answered per second; ovh: end-to-end minus the model call, answered turns; CPU/ans: the"
    )
    print(" system's CPU ms per answered turn)")
    print("CPU ms per turn (cores busy in all)")
    for r in rows:
        parts = ", ".join(f"{n} {v:.1f}" for n, v in sorted(r.cpu_ms_per_turn.items(), key=lambda kv: -kv[1]))
        print(f"{r.rate:6g}/s ({r.cores_busy:.2f} cores): {parts}")


def plot(out: dict[str, Any], path: Path) -> None:
    """Against offered load, both systems: answered and refused turns per second (left), and the answered
    turns' overhead p50 and p99 (right, log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (done, ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    top = 1.0
    for system, color in (("mars", "tab:red"), ("litellm", "tab:blue")):
        rows = out.get(system) or []
        if not rows:
            continue
        rates = [r["rate"] for r in rows]
        top = max(top, *rates)
        done.plot(rates, [r["achieved"] for r in rows], "o-", color=color, label=f"{system} answered/s")
        shed = [r.get("rejected", 0) / max(r["sent"], 1) * r["rate"] for r in rows]
        done.plot(rates, shed, "v:", color=color, label=f"{system} refused/s")
        ax.plot(rates, [r["overhead_p50_ms"] for r in rows], "o-", color=color, label=f"{system} p50")
        ax.plot(rates, [r["overhead_p99_ms"] for r in rows], "s--", color=color, label=f"{system} p99")
    done.plot([0, top], [0, top], color="grey", alpha=0.4, label="offered")
    done.set_xlabel("offered load (turns/s)")
    done.set_ylabel("turns per second")
    done.grid(True, alpha=0.3)
    done.legend()
    done.set_title("answered and refused")
    ax.set_xlabel("offered load (turns/s)")
    ax.set_ylabel("overhead (ms, end-to-end minus model call)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title("overhead of the answered turns")
    fig.suptitle("MARS vs LiteLLM proxy against offered load")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _without(argv: list[str], option: str) -> list[str]:
    """`argv` without `option` and its value (either `--opt v` or `--opt=v`)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            out.append(a)
    return out


def compare_kafka_security(argv: list[str], args: argparse.Namespace) -> int:
    """MARS alone on a plaintext broker, then on SASL_SSL (fresh stacks, same session, same rates), and
    the difference per rate: end-to-end and overhead percentiles, and the services' CPU per turn."""
    import tempfile

    base = _without(_without(_without(argv, "--kafka-security"), "--json"), "--workdir")
    if "--no-litellm" not in base:
        base.append("--no-litellm")
    rows: dict[str, list[dict[str, Any]]] = {}
    folder = Path(tempfile.mkdtemp(prefix="mars-load-security-"))
    for security in ("plaintext", "sasl_ssl"):
        print(f"\n[load] ===== MARS with a {security} broker =====", flush=True)
        out_file = folder / f"{security}.json"
        code = main([*base, "--kafka-security", security, "--json", str(out_file)])
        if code:
            return code
        rows[security] = json.loads(out_file.read_text())["mars"]
    plain = {r["rate"]: r for r in rows["plaintext"]}
    print("\nWhat SASL_SSL costs (plaintext -> sasl_ssl; ms; CPU: the services' ms per turn)")
    print(
        f"{'rate':>6s} {'e2e p50':>17s} {'e2e p99':>17s} {'ovh p50':>17s} {'ovh p99':>17s} {'CPU/turn':>17s} "
        f"{'errors':>9s}"
    )
    compared = []
    for r in rows["sasl_ssl"]:
        p = plain.get(r["rate"])
        if p is None:
            continue

        def cpu(row: dict[str, Any]) -> float:
            return sum(v for k, v in row["cpu_ms_per_turn"].items() if k != "load generator")

        pair = {
            "rate": r["rate"],
            **{
                f"{k}_{side}": row[k]
                for k in ("e2e_p50_ms", "e2e_p99_ms", "overhead_p50_ms", "overhead_p99_ms", "errors")
                for side, row in (("plaintext", p), ("sasl_ssl", r))
            },
            "cpu_ms_per_turn_plaintext": cpu(p),
            "cpu_ms_per_turn_sasl_ssl": cpu(r),
        }
        compared.append(pair)
        cells = [
            f"{pair[k + '_plaintext']:7.1f} -> {pair[k + '_sasl_ssl']:7.1f}"
            for k in ("e2e_p50_ms", "e2e_p99_ms", "overhead_p50_ms", "overhead_p99_ms", "cpu_ms_per_turn")
        ]
        print(f"{r['rate']:6g} {' '.join(f'{c:>17s}' for c in cells)} {p['errors']:>4d}/{r['errors']:<4d}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"runs": rows, "compared": compared}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rates", default="10,25,50,100", help="turns per second, comma-separated")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds per rate (default 60)")
    parser.add_argument("--users", type=int, default=50)
    parser.add_argument(
        "--latency-ms", type=float, default=50.0, help="the stand-in upstream's fixed latency"
    )
    parser.add_argument("--timeout-s", type=float, default=30.0, help="each request's deadline")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="seconds at the first rate, not counted")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-litellm", action="store_true", help="measure MARS alone")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument(
        "--no-trace",
        action="store_true",
        help="run MARS without spans (no per-hop decomposition; measures what tracing itself costs)",
    )
    parser.add_argument(
        "--trace-sample",
        type=float,
        default=0.1,
        help="share of turns traced for the decomposition (MARS_TRACE_SAMPLE_RATIO; default 0.1: tracing every "
        "turn to files costs the services CPU a deployment without exporters does not spend)",
    )
    parser.add_argument("--no-floor", action="store_true", help="skip measuring the floor parts")
    parser.add_argument(
        "--floor-count",
        type=int,
        default=200,
        help="samples of each floor part (default 200; the test suite's short run takes fewer)",
    )
    parser.add_argument(
        "--window-s",
        type=float,
        default=0.0,
        help="also report MARS's server overhead p50 / p99 per window of this many seconds (a soak's drift)",
    )
    parser.add_argument("--plot", type=Path, help="write a PNG of overhead against offered load")
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="record every MARS service with py-spy during one rate (--profile-rate) into DIR and print "
        "where each spends its CPU (load-tests/cpu_profile.py)",
    )
    parser.add_argument(
        "--profile-rate", type=float, help="the rate to profile (default: the first of --rates)"
    )
    parser.add_argument(
        "--kafka-security",
        choices=("sasl_ssl", "plaintext", "both"),
        default="sasl_ssl",
        help="the local broker's client listener (default sasl_ssl, as the stack runs it); both: MARS alone "
        "on each, then what SASL_SSL costs per turn",
    )
    parser.add_argument(
        "--service-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of every MARS service, e.g. MARS_MEMORY_EMBEDDING_PRECISION=int8 (repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--rates must be numbers separated by commas, got {args.rates!r}")
    if not rates or any(r <= 0 for r in rates) or args.seconds <= 0:
        parser.error("rates and --seconds must be positive")
    if not 0 < args.trace_sample <= 1:
        parser.error(f"--trace-sample is a share of turns in (0, 1], got {args.trace_sample:g}")
    if args.floor_count < 1:
        parser.error(f"--floor-count must be at least 1, got {args.floor_count}")
    if args.kafka_security == "both":
        return compare_kafka_security(argv if argv is not None else sys.argv[1:], args)
    if args.profile_rate is None:
        args.profile_rate = rates[0]
    elif args.profile_rate not in rates:
        parser.error(f"--profile-rate {args.profile_rate:g} is not one of --rates")
    if args.profile and not cpu_profile.PY_SPY.exists():
        parser.error(f"--profile needs py-spy ({cpu_profile.PY_SPY}): make install")
    service_env = {}
    for item in args.service_env:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("MARS_"):
            parser.error(f"--service-env takes MARS_KEY=VALUE, got {item!r}")
        service_env[key] = value

    sys.path[:0] = [str(REPO / "infra"), str(REPO / "services")]
    import signal
    import tempfile

    # Stopped with SIGTERM (a CI timeout, kill): unwind, so the stack and the proxy are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from mars_stack import LocalStack, StackSettings

    out: dict[str, Any] = {"mars": [], "litellm": []}
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="mars-load-"))
    trace_dir = None if args.no_trace else workdir / "traces"
    stack = LocalStack(
        StackSettings(
            workdir=workdir,
            model_pool=REPO / "config" / "models.standin.yaml",
            llm="standin",
            standin_latency_ms=args.latency_ms,
            trace_dir=trace_dir,
            kafka_security=args.kafka_security,
            postgres_settings=pg_statements.SERVER_SETTINGS,
            extra_env={
                "MARS_INGRESS_TURN_TIMEOUT_S": str(args.timeout_s), "MARS_GATEWAY_TURN_TIMEOUT_S": str(args.timeout_s),
                "MARS_TRACE_BATCH": "true",
                "MARS_TRACE_SAMPLE_RATIO": str(args.trace_sample),
                **service_env,
            },
        )
    ).start(progress=lambda m: print(f"[load] {m}", flush=True))
    litellm = None
    windows: list[tuple[float, float, float]] = []
    try:
        from mars.auth import mint_key

        # The turns' tenant and its key (with MARS_INGRESS_AUTH_REQUIRED=false the ingress ignores it).
        args.api_key = mint_key(stack.env["MARS_POSTGRES_DSN"], TENANT, label="load harness").key
        args.postgres_dsn = stack.env["MARS_POSTGRES_DSN"]
        pg_statements.enable(args.postgres_dsn)
        litellm_url = ""
        if not args.no_litellm:
            litellm, litellm_url = start_litellm(stack.env["MARS_LOCAL_LLM_URL"], stack.workdir)
        sessions = {
            "mars": {p.name: p.popen.pid for p in stack.procs if p.name != "llm"},
            "litellm": {"litellm": litellm.pid} if litellm is not None else {},
        }
        asyncio.run(run_rates(args, rates, stack.addr("ingress"), litellm_url, out, windows, sessions))
        if not args.no_floor:
            decompose.wait_idle(sessions["mars"])
            print(
                "[load] measuring the floor (bare hop, embedding, search, Postgres transaction)", flush=True
            )
            out["floor"] = decompose.measure_floor(
                stack.env["MARS_KAFKA_BOOTSTRAP"], stack.env, stack.env["MARS_POSTGRES_DSN"], args.floor_count
            )
        if trace_dir is not None:
            time.sleep(1.5)  # the services write spans in batches every 0.5 s
            spans = decompose.read_spans(trace_dir)
            out["decomposition"] = [
                {"rate": rate, "since": since, "until": until, **decompose.decompose(spans, since, until)}
                for rate, since, until in windows
            ]
            if args.window_s > 0:
                for cut in out["decomposition"]:
                    cut["windows"] = decompose.by_window(spans, cut["since"], cut["until"], args.window_s)
                    print(
                        f"[load] {cut['rate']:g}/s server overhead per {args.window_s:g}s window (p50 / p99 ms):"
                    )
                    for w in cut["windows"]:
                        print(
                            f"  +{w['from_s']:5.0f}s  {w['turns']:5d} turns  {w['p50_ms']:7.1f} / {w['p99_ms']:7.1f}"
                        )
    finally:
        if litellm is not None:
            litellm.terminate()
            litellm.wait(timeout=15)
        stack.stop()
    for system in ("mars", "litellm"):
        if out[system]:
            print_table(system, [Row(**r) for r in out[system]])
    decompose.print_decomposition(out.get("decomposition", []), out.get("floor"))
    for r in out["mars"]:
        if r.get("pg_statements"):
            pg_statements.print_report(r["pg_statements"], r["rate"])
    if args.profile:
        label = f"{args.profile_rate:g}"
        out["profile"] = cpu_profile.summarise_folder(args.profile, label)
        row = next((r for r in out["mars"] if r["rate"] == args.profile_rate), {})
        print(f"\n[load] where the services spend their CPU at {label}/s (py-spy, busy samples):")
        cpu_profile.print_summary(out["profile"], row.get("cpu_ms_per_turn", {}))
    if args.plot:
        plot(out, args.plot)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
