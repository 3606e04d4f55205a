"""`mars demo` and `mars send`: turns to a running ingress, and the caller flags every client command shares."""

from __future__ import annotations

import argparse
import time

from mars_tools.settings import ToolSettings
from mars_tools.terminal import console


def tenant_of(args: argparse.Namespace) -> str:
    """--tenant, else "" with a key (the ingress takes the key's tenant), else the command's default."""
    return str(args.tenant or ("" if args.api_key else args.default_tenant))


def caller_args(p: argparse.ArgumentParser, default_tenant: str) -> None:
    """--target, --api-key and --tenant, from the environment the local stack writes (stack.env)."""
    defaults = ToolSettings()
    p.add_argument(
        "--target",
        default=defaults.ingress_addr,
        help="ingress host:port",
    )
    p.add_argument(
        "--api-key",
        default=defaults.api_key,
        help="the tenant's API key, sent as 'authorization: Bearer <key>' (default: $MARS_API_KEY, which "
        "the local stack writes to stack.env; `mars tenant create` issues keys)",
    )
    p.add_argument(
        "--tenant",
        default=defaults.tenant,
        help="tenant to send as; must be the key's (default: $MARS_TENANT, else the key's tenant, "
        f"else {default_tenant} when no key is sent)",
    )
    p.set_defaults(default_tenant=default_tenant)


def cmd_demo(args: argparse.Namespace) -> int:
    from mars_tools.demo import judged_rewards, play, render

    started_ms = int(time.time() * 1000)
    rows = play(args.target, tenant=tenant_of(args), max_tokens=args.max_tokens, api_key=args.api_key)
    turn_ids = [r.reply.turn_id for r in rows if r.reply]
    rewards = (
        judged_rewards(args.bootstrap, turn_ids, started_ms, args.topic_prefix) if args.bootstrap else {}
    )
    render(rows, console, rewards)
    return 0 if all(r.reply for r in rows) else 1


def cmd_send(args: argparse.Namespace) -> int:
    import grpc
    from mars.v1 import services_pb2 as svc
    from mars.v1 import services_pb2_grpc as svc_grpc
    from mars_ingress.client import ingress_channel

    with ingress_channel(args.target, args.api_key) as channel:
        stub = svc_grpc.IngressStub(channel)
        try:
            reply = stub.SendTurn(
                svc.TurnRequest(
                    tenant=tenant_of(args), user_id=args.user, session_id=args.session, text=args.text
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


def add_demo_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="play the demo conversation against a running ingress")
    caller_args(p, "demo")
    defaults = ToolSettings()
    p.add_argument(
        "--bootstrap",
        default=defaults.kafka_bootstrap or None,
        help="the pipeline's Kafka, to show each turn's reward from its judged event (default: "
        "$MARS_KAFKA_BOOTSTRAP; none: no rewards)",
    )
    p.add_argument(
        "--topic-prefix",
        default=defaults.topic_prefix,
        help="the pipeline's topic prefix (default: $MARS_TOPIC_PREFIX or none)",
    )
    p.add_argument("--max-tokens", type=int, default=48)
    p.set_defaults(func=cmd_demo)


def add_send_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("send", help="send one turn to a running ingress and print the answer")
    p.add_argument("text", help="the user turn")
    caller_args(p, "default")
    p.add_argument("--user", default="cli-user")
    p.add_argument("--session", default="cli")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the answer")
    p.set_defaults(func=cmd_send)
