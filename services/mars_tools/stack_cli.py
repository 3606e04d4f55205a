"""`mars run` and `mars stack`: the local stack (broker, Postgres, LLM server, services) on this machine."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from pathlib import Path

from mars_tools.settings import ToolSettings
from mars_tools.terminal import console


def _start_stack(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from mars_stack import LocalStack, StackSettings
    from mars_stack.credentials import CALLER_TLS_VARS

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
        from mars_tools.demo import judged_rewards, play, render

        console.print("playing the demo conversation (2 users x 2 sessions) through the gRPC ingress")
        started_ms = int(time.time() * 1000)
        # The stack created tenant demo and its key (stack.env: MARS_TENANT, MARS_API_KEY).
        rows = play(
            stack.addr("ingress"),
            tenant=stack.env.get("MARS_TENANT", "demo"),
            max_tokens=args.max_tokens,
            api_key=stack.env.get("MARS_API_KEY", ""),
        )
        rewards = judged_rewards(
            stack.env["MARS_KAFKA_BOOTSTRAP"],
            [r.reply.turn_id for r in rows if r.reply],
            since_ms=started_ms,
            prefix=stack.settings.topic_prefix,
            kafka=stack.kafka_options(),  # the tools' login on the stack's broker
        )
        render(rows, console, rewards)
        if args.no_serve:
            return 0 if all(r.reply for r in rows) else 1
        return _serve_until_interrupted(stack)
    finally:
        console.print("stopping the local stack")
        stack.stop()


def _service_count(text: str) -> tuple[str, int]:
    name, _, count = text.partition("=")
    if not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"expected SERVICE=N with N >= 1, got {text!r}")
    return name.strip(), int(count)


def stack_args(p: argparse.ArgumentParser) -> None:
    """The flags `mars run` and `mars stack` share."""
    from mars_stack.settings import LauncherSettings

    defaults, launcher = ToolSettings(), LauncherSettings()
    p.add_argument("--workdir", help="folder for data and logs (default: a new temporary folder)")
    p.add_argument(
        "--partitions", type=int, default=3, help="partition count shared by all topics (default 3)"
    )
    p.add_argument(
        "--model-pool",
        default=defaults.model_pool or "config/models.local.yaml",
        help="model pool YAML (default: config/models.local.yaml, the local SmolLM2 arms)",
    )
    p.add_argument(
        "--broker",
        choices=("kafka", "tansu"),
        default=launcher.broker or None,
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
        default=defaults.topic_prefix,
        help="put in front of every topic name, e.g. run7. (default: none)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS on every service's gRPC port, from a local CA made in the work directory; the "
        "callers' certificate settings (MARS_TLS_*) go to stack.env",
    )



def add_run_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "run", help="start the local stack, play the demo, print a per-turn table, keep serving"
    )
    stack_args(p)
    p.add_argument("--max-tokens", type=int, default=48, help="answer length cap for demo turns (default 48)")
    p.add_argument(
        "--no-serve", action="store_true", help="stop after the demo instead of serving until Ctrl-C"
    )
    p.set_defaults(func=cmd_run)



def add_stack_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "stack", help="start the local stack (broker, Postgres, LLM server, services) until Ctrl-C"
    )
    stack_args(p)
    p.set_defaults(func=cmd_stack)

