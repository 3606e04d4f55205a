"""The `mars` command line: run the local stack with the demo, start the stack, send turns."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from rich.console import Console

# A pipe or CI log gets a wide table rather than rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() else 180)


def _rewards(dsn: str, turn_ids: list[str], wait_s: float = 30.0) -> dict[str, float]:
    """Rewards arrive after the answer (learning path); poll the router's ledger for a while."""
    import psycopg

    deadline = time.monotonic() + wait_s
    found: dict[str, float] = {}
    while time.monotonic() < deadline:
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(
                "SELECT turn_id, reward FROM router_ledger WHERE turn_id = ANY(%s)", (turn_ids,)
            )
            found = {r[0]: float(r[1]) for r in rows}
        if len(found) == len(turn_ids):
            break
        time.sleep(0.2)
    return found


def _tenant(args: argparse.Namespace) -> str:
    """--tenant, else "" with a key (the ingress takes the key's tenant), else the command's default."""
    return str(args.tenant or ("" if args.api_key else args.default_tenant))


def cmd_demo(args: argparse.Namespace) -> int:
    from mars.demo import play, render

    rows = play(args.target, tenant=_tenant(args), max_tokens=args.max_tokens, api_key=args.api_key)
    rewards = (
        _rewards(args.postgres_dsn, [r.reply.turn_id for r in rows if r.reply]) if args.postgres_dsn else {}
    )
    render(rows, console, rewards)
    return 0 if all(r.reply for r in rows) else 1


def _start_stack(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from mars_stack import LocalStack, StackSettings
    from mars_stack.stack import CALLER_TLS_VARS

    settings = StackSettings(
        workdir=Path(args.workdir) if args.workdir else None,
        partitions=args.partitions,
        model_pool=Path(args.model_pool).resolve(),
        topic_prefix=args.topic_prefix,
        broker=args.broker,
        replicas=args.replicas,
        replicas_of=dict(args.replicas_of or []),
        tls=args.tls,
        gateway=True,
    )
    stack = LocalStack(settings)
    with console.status("starting the local stack") as status:
        stack.start(progress=lambda msg: status.update(msg))
    console.print(f"[green]local stack up[/] in {stack.workdir} (logs in {stack.logdir})")
    for name, port in stack.ports.items():
        console.print(f"  {name:9s} 127.0.0.1:{port}")
    console.print(f"  settings written to {stack.workdir / 'stack.env'}")
    if stack.env.get("MARS_API_KEY"):
        console.print(
            f"  tenant {stack.env['MARS_TENANT']}: API key in stack.env (MARS_API_KEY); "
            f"`set -a; . {stack.workdir / 'stack.env'}` and `mars send` uses it"
        )
    if args.tls:
        # This process's own calls (the demo) are callers too: the client certificate settings.
        os.environ.update({k: stack.env[k] for k in CALLER_TLS_VARS})
        console.print("  mutual TLS on every service (local CA in tls/); health in plaintext on its own port")
    return stack


def _serve_until_interrupted(stack) -> int:  # type: ignore[no-untyped-def]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    gateway = stack.env.get("MARS_GATEWAY_URL")
    http = f" or OpenAI clients to {gateway}/v1 (the tenant's key as the API key)" if gateway else ""
    console.print(
        f"[bold]serving: send turns to the gRPC ingress at {stack.addr('ingress')}{http}; Ctrl-C stops[/]"
    )
    seen = 0
    try:
        while not stop.is_set():
            # The launcher restarts what dies (with backoff); say so, so a crash loop is visible.
            for event in stack.events[seen:]:
                colour = "red" if event.kind == "exited" else "yellow"
                console.print(f"[{colour}]{event.name} {event.kind} ({event.detail}); log: {stack.logdir}[/]")
            seen = len(stack.events)
            stop.wait(1.0)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_stack(args: argparse.Namespace) -> int:
    stack = _start_stack(args)
    try:
        return _serve_until_interrupted(stack)
    finally:
        console.print("stopping the local stack")
        stack.stop()


def cmd_run(args: argparse.Namespace) -> int:
    stack = _start_stack(args)
    try:
        from mars.demo import play, render

        console.print("playing the demo conversation (2 users x 2 sessions) through the gRPC ingress")
        # The stack created tenant demo and its key (stack.env: MARS_TENANT, MARS_API_KEY).
        rows = play(
            stack.addr("ingress"),
            tenant=stack.env.get("MARS_TENANT", "demo"),
            max_tokens=args.max_tokens,
            api_key=stack.env.get("MARS_API_KEY", ""),
        )
        rewards = _rewards(stack.env["MARS_POSTGRES_DSN"], [r.reply.turn_id for r in rows if r.reply])
        render(rows, console, rewards)
        if args.no_serve:
            return 0 if all(r.reply for r in rows) else 1
        return _serve_until_interrupted(stack)
    finally:
        console.print("stopping the local stack")
        stack.stop()


def cmd_send(args: argparse.Namespace) -> int:
    import grpc

    from mars.client import ingress_channel
    from mars.v1 import services_pb2 as svc
    from mars.v1 import services_pb2_grpc as svc_grpc

    with ingress_channel(args.target, args.api_key) as channel:
        stub = svc_grpc.IngressStub(channel)
        try:
            reply = stub.SendTurn(
                svc.TurnRequest(
                    tenant=_tenant(args), user_id=args.user, session_id=args.session, text=args.text
                ),
                timeout=args.timeout,
            )
        except grpc.RpcError as exc:
            console.print(f"[red]{exc.code().name}[/]: {exc.details()}")
            return 2
    console.print(
        f"[bold]{reply.model}[/] (turn {reply.turn_id}, seq {reply.seq}, {reply.latency_ms:.0f} ms)"
    )
    console.print(reply.text)
    return 0


def _service_count(text: str) -> tuple[str, int]:
    name, _, count = text.partition("=")
    if not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"expected SERVICE=N with N >= 1, got {text!r}")
    return name.strip(), int(count)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mars",
        description="MARS: memory-aware routing for long-running LLM assistants. "
        "One session state decides which memory a turn sees and which model answers it.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def stack_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--workdir", help="folder for data and logs (default: a new temporary folder)")
        p.add_argument(
            "--partitions", type=int, default=3, help="partition count shared by all topics (default 3)"
        )
        p.add_argument(
            "--model-pool",
            default=os.environ.get("MARS_MODEL_POOL", "config/models.local.yaml"),
            help="model pool YAML (default: config/models.local.yaml, the local SmolLM2 arms)",
        )
        p.add_argument(
            "--broker",
            choices=("kafka", "tansu"),
            default=os.environ.get("MARS_BROKER") or None,
            help="kafka (Apache Kafka, KRaft, on the local Java) or tansu; default: kafka wherever Java >= 17 "
            "is found, tansu otherwise",
        )
        p.add_argument(
            "--replicas",
            type=int,
            default=1,
            help="processes per service, in the same consumer groups (default 1)",
        )
        p.add_argument(
            "--replicas-of",
            type=_service_count,
            action="append",
            metavar="SERVICE=N",
            help="replicas of one service, e.g. --replicas-of memory=3 (repeatable; beats --replicas)",
        )
        p.add_argument(
            "--topic-prefix",
            default=os.environ.get("MARS_TOPIC_PREFIX", ""),
            help="put in front of every topic name, e.g. run7. (default: none)",
        )
        p.add_argument(
            "--tls",
            action="store_true",
            help="mutual TLS on every service's gRPC port, from a local CA made in the work directory; the "
            "callers' certificate settings (MARS_TLS_*) go to stack.env",
        )

    p = sub.add_parser(
        "run", help="start the local stack, play the demo, print a per-turn table, keep serving"
    )
    stack_args(p)
    p.add_argument("--max-tokens", type=int, default=48, help="answer length cap for demo turns (default 48)")
    p.add_argument(
        "--no-serve", action="store_true", help="stop after the demo instead of serving until Ctrl-C"
    )
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "stack", help="start the local stack (broker, Postgres, LLM server, services) until Ctrl-C"
    )
    stack_args(p)
    p.set_defaults(func=cmd_stack)

    def caller_args(p: argparse.ArgumentParser, default_tenant: str) -> None:
        p.add_argument(
            "--target",
            default=os.environ.get("MARS_INGRESS_ADDR", "127.0.0.1:50051"),
            help="ingress host:port",
        )
        p.add_argument(
            "--api-key",
            default=os.environ.get("MARS_API_KEY", ""),
            help="the tenant's API key, sent as 'authorization: Bearer <key>' (default: $MARS_API_KEY, which "
            "the local stack writes to stack.env; `mars tenant create` issues keys)",
        )
        p.add_argument(
            "--tenant",
            default=os.environ.get("MARS_TENANT", ""),
            help="tenant to send as; must be the key's (default: $MARS_TENANT, else the key's tenant, "
            f"else {default_tenant} when no key is sent)",
        )
        p.set_defaults(default_tenant=default_tenant)

    p = sub.add_parser("demo", help="play the demo conversation against a running ingress")
    caller_args(p, "demo")
    p.add_argument(
        "--postgres-dsn", default=os.environ.get("MARS_POSTGRES_DSN"), help="to show rewards (optional)"
    )
    p.add_argument("--max-tokens", type=int, default=48)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("send", help="send one turn to a running ingress and print the answer")
    p.add_argument("text", help="the user turn")
    caller_args(p, "default")
    p.add_argument("--user", default="cli-user")
    p.add_argument("--session", default="cli")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the answer")
    p.set_defaults(func=cmd_send)

    from mars.history_cli import add_import_history_parser

    add_import_history_parser(sub, caller_args)

    from mars.eval.cli import add_eval_parser

    add_eval_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks over real data (retrieval)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from mars.bench.cli import add_realmem_parser

    add_realmem_parser(bench_sub)
    from mars.bench.memory_load import add_memory_load_parser

    add_memory_load_parser(bench_sub)
    from mars.bench.locomo import add_locomo_parser

    add_locomo_parser(bench_sub)
    from mars.bench.router_sim import add_router_parser

    add_router_parser(bench_sub)
    from mars.bench.dispatch import add_dispatch_parser

    add_dispatch_parser(bench_sub)
    from mars.bench.ope import add_ope_parser

    add_ope_parser(bench_sub)
    from mars.bench.replay import add_replay_bench_parser

    add_replay_bench_parser(bench_sub)
    from mars.replay.cli import add_replay_parser

    add_replay_parser(sub)
    from mars.probe.qtm import add_probe_parser

    add_probe_parser(sub)
    from mars.admin_cli import add_migrate_parser, add_topics_parser

    add_migrate_parser(sub)
    add_topics_parser(sub)
    from mars.tenant_cli import add_tenant_parser

    add_tenant_parser(sub)
    from mars.forget_cli import add_forget_parser

    add_forget_parser(sub)
    from mars.keys_cli import add_keys_parser

    add_keys_parser(sub)
    from mars.qtm.train_cli import add_train_parser

    add_train_parser(sub)
    from mars.deploy.cli import add_deploy_parser

    add_deploy_parser(sub)
    from mars.kube_cli import add_kube_parser

    add_kube_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        sys.exit(args.func(args))
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        from mars_stack import StackError

        if not isinstance(exc, StackError):
            raise
        console.print(f"[red]the local stack could not start:[/] {exc}")
        sys.exit(2)
