"""`mars replay run`: re-drive recorded turns through a pipeline configured differently and compare the
two runs side by side.

Without `--ingress`, replay run starts its own local stack (Tansu broker, Postgres, llama.cpp server, the
six services) with the configuration given by `--config` (a preset name such as recent-only, no-qtm-semantic,
random-routing, lambda-0.5 or fixed:<arm>, or a YAML/JSON/env file of MARS_* settings; repeatable, applied
in order) and `--set KEY=VALUE`, under its own topic prefix (default replay-<unix time>.), re-drives the
turns, reads its topics back, prints the recorded run and the re-drive side by side (turns, complete,
reward, cost, routing shares) and stops the stack.

With `--ingress HOST:PORT` the turns go to an already-running pipeline (with its own configuration) under
a tenant renamed with `--tenant-suffix`, so the re-drive starts from fresh memory and fresh routing
policies beside the original data; `--bootstrap` (and `--topic-prefix`) read its topics back for the
comparison.

Each user's turns keep their order. `--strict` sends one turn at a time and waits until its reward has
reached the router (the policy version moved) before the next: the paper's Algorithm 1 exactly, so the same
log, configuration and seed give identical decisions. A frozen router (MARS_ROUTER_POLICY_UPDATES=false, the
no-online-update preset) never moves its version and takes no reward in, so there is nothing to wait for.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from mars import data_keys, tls
from mars.data_keys import SyncKeyring
from mars.identity import CallerIdentity, with_identity
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_ingress.client import TenantChannels, TenantKeys
from rich.console import Console
from rich.progress import Progress

from mars_tools.private_files import open_private
from mars_tools.replay import presets
from mars_tools.replay.compare import comparison_table, only, read_back
from mars_tools.replay.readers import topic_prefix_arg
from mars_tools.replay.traces import RawRecord, TraceBuilder, records_from_lines, summarize
from mars_tools.settings import ToolSettings


@dataclass(frozen=True)
class RecordedTurn:
    turn_id: str
    tenant: str
    user_id: str
    session_id: str
    seq: int
    text: str
    options: dict[str, str]
    routed_arm: str
    answered_by: str


def recorded_turns(
    records: list[RawRecord], counts: Counter[str], keyring: SyncKeyring | None = None
) -> list[RecordedTurn]:
    """Complete recorded turns in log order (by user, then seq). A turn whose text is sealed and cannot be
    opened here (no `keyring`) is skipped and counted: its text cannot be sent again."""
    builder = TraceBuilder(keyring)
    for r in records:
        builder.add(r)
    counts.update(builder.counts)
    out = []
    for t in builder.traces.values():
        received, routed, generated = (
            t.events.get("received"),
            t.events.get("routed"),
            t.events.get("generated"),
        )
        if not isinstance(received, ev.TurnReceived) or not isinstance(routed, ev.Routed):
            counts["skipped_incomplete_turns"] += 1
            continue
        if t.sealed:
            counts["skipped_sealed_turns"] += 1
            continue
        turn = received.turn
        out.append(
            RecordedTurn(
                turn.turn_id,
                turn.tenant,
                turn.user_id,
                turn.session_id,
                turn.seq,
                received.text,
                dict(turn.options),
                routed.chosen_arm,
                generated.model if isinstance(generated, ev.Generated) else "",
            )
        )
    return sorted(out, key=lambda r: (r.tenant, r.user_id, r.seq))


def _policy(router: svc_grpc.RouterStub | None, tenant: str, user: str) -> svc.PolicyInfo:
    if router is None:
        return svc.PolicyInfo()
    return router.GetPolicy(svc.PolicyRequest(tenant=tenant, user_id=user), timeout=10)


def _policy_version(router: svc_grpc.RouterStub | None, tenant: str, user: str) -> int:
    return int(_policy(router, tenant, user).version)


def redrive(
    turns: list[RecordedTurn],
    ingress_addr: str,
    suffix: str,
    router_addr: str | None,
    reward_timeout_s: float,
    on_turn: Any = lambda: None,
    keys: TenantKeys | None = None,
    identity: CallerIdentity | None = None,
) -> list[dict[str, Any]]:
    """Send each turn as its tenant (+ suffix), with that tenant's key from `keys`. The router is internal:
    GetPolicy calls as `identity`, by default the replay identity in MARS_IDENTITY_CERT_FILE / _KEY_FILE."""
    channels = TenantChannels(ingress_addr, keys or TenantKeys())
    caller = identity if identity is not None else CallerIdentity.from_env()
    router = svc_grpc.RouterStub(with_identity(tls.channel(router_addr), caller)) if router_addr else None
    try:
        return _redrive(turns, channels, suffix, router, reward_timeout_s, on_turn)
    finally:
        channels.close()


def _redrive(
    turns: list[RecordedTurn],
    channels: TenantChannels,
    suffix: str,
    router: svc_grpc.RouterStub | None,
    reward_timeout_s: float,
    on_turn: Any,
) -> list[dict[str, Any]]:
    rows = []
    for t in turns:
        tenant = t.tenant + suffix
        ingress = channels.stub(tenant, svc_grpc.IngressStub)
        policy = _policy(router, tenant, t.user_id)
        before = int(policy.version)
        row: dict[str, Any] = {
            "recorded_turn_id": t.turn_id,
            "user_id": t.user_id,
            "seq": t.seq,
            "recorded_arm": t.routed_arm,
            "recorded_answered_by": t.answered_by,
        }
        try:
            reply = ingress.SendTurn(
                svc.TurnRequest(
                    tenant=tenant, user_id=t.user_id, session_id=t.session_id, text=t.text, options=t.options
                ),
                timeout=300,
            )
        except grpc.RpcError as exc:
            row.update(error=f"{exc.code().name}: {exc.details()}")  # type: ignore[attr-defined]
            rows.append(row)
            on_turn()
            continue
        row.update(
            turn_id=reply.turn_id,
            arm=reply.attempts[0].arm if reply.attempts else reply.model,
            answered_by=reply.model,
            text=reply.text,
            cost_usd=reply.cost_usd,
        )
        if router is not None and not policy.frozen:
            # Strict mode: the next turn may only be decided once this turn's reward is in the policy
            # (a frozen policy takes no reward in: its decisions do not depend on when rewards arrive).
            deadline = time.monotonic() + reward_timeout_s
            while _policy_version(router, tenant, t.user_id) <= before:
                if time.monotonic() > deadline:
                    row["reward_wait"] = "timed out"
                    break
                time.sleep(0.05)
        rows.append(row)
        on_turn()
    return rows


def _pool_names() -> set[str]:
    """The names of the model pool setting (the router's, dispatch's and the gateway's)."""
    from mars import topology

    return set(topology.field_env("model_pool", ""))


def _start_stack(overrides: dict[str, str], prefix: str, model_pool: str | None, console: Console) -> Any:
    from mars_stack import LocalStack, StackSettings
    from mars_stack.stack_settings import DEFAULT_POOL

    env = dict(overrides)
    given = [env.pop(name) for name in sorted(_pool_names() & set(env))]  # the stack's pool, for all of them
    pool = Path(given[0] if given else model_pool or DEFAULT_POOL).resolve()
    settings = StackSettings(model_pool=pool, topic_prefix=prefix, extra_env=env)
    stack = LocalStack(settings)
    with console.status("starting the replay stack") as status:
        stack.start(progress=lambda msg: status.update(f"replay stack: {msg}"))
    console.print(f"replay stack up in {stack.workdir}, topic prefix {prefix!r}")
    return stack


def _check_fixed_arm(overrides: dict[str, str], model_pool: str | None) -> None:
    """fixed:<arm> must name an arm of the pool (read without expanding ${VAR}s, which the stack sets)."""
    policy = overrides.get("MARS_ROUTER_ROUTING_POLICY", "")
    if not policy.startswith(presets.FIXED_PREFIX):
        return
    import yaml
    from mars_stack.stack_settings import DEFAULT_POOL

    try:
        given = [overrides[name] for name in sorted(_pool_names() & set(overrides))]
        raw = yaml.safe_load(Path(given[0] if given else model_pool or DEFAULT_POOL).read_text())
        arms = [str(m["name"]) for m in raw["models"]]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return  # an unreadable pool is reported by the stack, with the file's own error
    if policy[len(presets.FIXED_PREFIX) :] not in arms:
        raise ValueError(f"{policy}: no such arm in the model pool (arms: {', '.join(arms)})")


def _write_traces(folder: Path, name: str, builder: TraceBuilder) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    # Traces hold the turns' opened text: the owner's alone (as `mars replay read --out`).
    with open_private(folder / f"{name}.jsonl") as fh:
        for trace in builder.traces.values():
            fh.write(json.dumps(trace.to_dict()) + "\n")


def _run_settings(args: argparse.Namespace, console: Console) -> tuple[dict[str, str], list[str]] | None:
    """The run's overrides and their labels, or None after printing why the arguments do not go together."""
    if args.strict and args.ingress and not args.router:
        console.print("[red]--strict with --ingress needs --router (to see each reward reach the policy)[/]")
        return None
    try:
        overrides, labels = presets.resolve(args.config or [], args.set or [])
        _check_fixed_arm(overrides, args.model_pool)
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        return None
    if args.ingress and overrides:
        console.print(
            "[red]--config/--set configure the pipeline replay run starts itself; "
            "a running pipeline (--ingress) keeps its own configuration[/]"
        )
        return None
    return overrides, labels


@dataclass
class _Recorded:
    turns: list[RecordedTurn]
    #: The recorded traces of those turns, to compare the re-driven ones with.
    original: TraceBuilder
    counts: Counter[str]


def _read_recorded(path: Path, limit: int | None, console: Console) -> _Recorded | None:
    counts: Counter[str] = Counter()
    with path.open(errors="replace") as fh:
        records = list(records_from_lines(fh, counts))
    keyring = data_keys.tool_keyring(lambda msg: console.print(f"[yellow]{msg}[/]"))
    turns = recorded_turns(records, counts, keyring)
    if limit:
        turns = turns[:limit]
    if not turns:
        console.print(f"[red]no complete recorded turns in {path}[/] ({dict(counts)})")
        return None
    original = TraceBuilder(keyring)
    for r in records:
        original.add(r)
    return _Recorded(turns, only(original, [t.turn_id for t in turns]), counts)


def _drive(
    args: argparse.Namespace,
    console: Console,
    turns: list[RecordedTurn],
    target: tuple[str, str | None],
    suffix: str,
    keys: TenantKeys,
    identity: CallerIdentity | None = None,
) -> list[dict[str, Any]]:
    ingress, router = target
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("re-driving", total=len(turns))
        return redrive(
            turns,
            ingress,
            suffix,
            router if args.strict else None,
            args.reward_timeout_s,
            lambda: progress.advance(task),
            keys,
            identity,
        )


def _drive_running(
    args: argparse.Namespace, console: Console, turns: list[RecordedTurn]
) -> tuple[list[dict[str, Any]], TraceBuilder | None, str, str]:
    """Re-drive through a running pipeline (--ingress): rows, the re-driven traces, tenant suffix, prefix."""
    prefix = args.topic_prefix or ""
    suffix = args.tenant_suffix or f"-replay-{int(time.time())}"
    # The renamed tenants are new: a key for each is created in the pipeline's Postgres when we can
    # reach it, else the one --api-key is sent for all (the ingress refuses tenants it is not for).
    keys = TenantKeys(args.api_key or "", args.postgres_dsn or "", label="mars replay run")
    rows = _drive(args, console, turns, (args.ingress, args.router), suffix, keys)
    redriven = None
    if args.bootstrap:
        redriven = read_back(args.bootstrap, prefix, [r["turn_id"] for r in rows if "turn_id" in r])
    return rows, redriven, suffix, prefix


def _drive_own_stack(
    args: argparse.Namespace, console: Console, turns: list[RecordedTurn], overrides: dict[str, str]
) -> tuple[list[dict[str, Any]], TraceBuilder | None, str, str] | None:
    """Re-drive through a stack of its own: fresh memory, policies and topics, so the tenants keep their
    names. None after printing why the stack did not start."""
    prefix = args.topic_prefix or f"replay-{int(time.time())}."
    suffix = args.tenant_suffix or ""
    try:
        stack = _start_stack(overrides, prefix, args.model_pool, console)
    except Exception as exc:
        console.print(f"[red]the replay stack did not start: {exc}[/]")
        return None
    try:
        keys = TenantKeys(postgres_dsn=stack.env["MARS_POSTGRES_DSN"], label="mars replay run")
        target = (stack.addr("ingress"), stack.addr("router"))
        rows = _drive(args, console, turns, target, suffix, keys, stack.caller("replay"))
        redriven = read_back(
            stack.env["MARS_KAFKA_BOOTSTRAP"],
            prefix,
            [r["turn_id"] for r in rows if "turn_id" in r],
            kafka=stack.kafka_options(),  # the replay stack's own broker and login, not the environment's
        )
    finally:
        console.print("stopping the replay stack")
        stack.stop()
    return rows, redriven, suffix, prefix


def _report(
    args: argparse.Namespace,
    console: Console,
    summary: dict[str, Any],
    rows: list[dict[str, Any]],
    original: TraceBuilder,
    redriven: TraceBuilder | None,
) -> None:
    if args.out:
        with open_private(args.out) as fh:
            fh.write("\n".join(json.dumps(r) for r in rows) + "\n")
    if redriven is not None:
        Console(soft_wrap=True).print(comparison_table(original, redriven, summary["config"]))
        if args.summary:
            full = dict(summary, recorded=summarize(original), redriven=summarize(redriven))
            Path(args.summary).write_text(json.dumps(full, indent=2))
        if args.traces:
            _write_traces(Path(args.traces), "recorded", original)
            _write_traces(Path(args.traces), "redriven", redriven)
    console.print(json.dumps(summary, indent=2))


def cmd_run(args: argparse.Namespace) -> int:
    console = Console(soft_wrap=True, stderr=True)
    path = Path(args.file)
    if not path.is_file():
        console.print(f"[red]no log file at {path}[/]")
        return 2
    chosen = _run_settings(args, console)
    if chosen is None:
        return 2
    overrides, labels = chosen
    recorded = _read_recorded(path, args.limit, console)
    if recorded is None:
        return 2
    if args.ingress:
        driven = _drive_running(args, console, recorded.turns)
    else:
        started = _drive_own_stack(args, console, recorded.turns, overrides)
        if started is None:
            return 1
        driven = started
    rows, redriven, suffix, prefix = driven
    done = [r for r in rows if "error" not in r]
    same = sum(r["arm"] == r["recorded_arm"] for r in done)
    summary: dict[str, Any] = {
        "turns": len(rows),
        "answered": len(done),
        "errors": len(rows) - len(done),
        "same_decision_as_recorded": same / len(done) if done else 0.0,
        "tenant_suffix": suffix,
        "topic_prefix": prefix,
        "config": " + ".join(labels) or "same configuration",
        "overrides": overrides,
        "log": dict(recorded.counts),
    }
    _report(args, console, summary, rows, recorded.original, redriven)
    return 0 if not summary["errors"] else 1


def add_run_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    defaults = ToolSettings()
    p = sub.add_parser(
        "run",
        help="re-drive recorded turns through a pipeline with another configuration; compare the two runs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="presets:\n"
        + "\n".join(f"  {p.name:17s} {p.description}" for p in presets.PRESETS.values())
        + f"\n  {presets.FIXED_PREFIX + '<arm>':17s} every turn to one arm of the model pool",
    )
    p.add_argument("--file", required=True, help="exported log file (`mars replay export`)")
    p.add_argument(
        "--config",
        action="append",
        metavar="PRESET|FILE",
        help="a preset name or a YAML/JSON/env file of MARS_* settings (repeatable, applied in order)",
    )
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="one MARS_* setting, applied after --config"
    )
    p.add_argument(
        "--model-pool",
        default=defaults.model_pool or None,
        help="model pool of the replay stack (default: $MARS_MODEL_POOL or config/models.local.yaml)",
    )
    p.add_argument(
        "--topic-prefix",
        type=topic_prefix_arg,
        help="the re-drive's topic prefix (default: replay-<unix time>.); with --ingress: the running "
        "pipeline's prefix, to read it back",
    )
    p.add_argument("--ingress", help="re-drive into this running pipeline's ingress HOST:PORT instead")
    p.add_argument("--router", help="with --ingress: its router HOST:PORT (needed by --strict)")
    p.add_argument("--bootstrap", help="with --ingress: its Kafka bootstrap servers, to compare the runs")
    p.add_argument(
        "--postgres-dsn",
        default=defaults.postgres_dsn or None,
        help="with --ingress: its Postgres, where an API key is created for each re-driven tenant "
        "(default: $MARS_POSTGRES_DSN)",
    )
    p.add_argument(
        "--api-key",
        default=defaults.api_key or None,
        help="with --ingress and no --postgres-dsn: the API key sent for every turn; it must be the "
        "re-driven tenant's (default: $MARS_API_KEY)",
    )
    p.add_argument(
        "--strict", action="store_true", help="one turn at a time, each reward applied before the next"
    )
    p.add_argument(
        "--tenant-suffix",
        help="appended to every tenant (default: -replay-<unix time> with --ingress, none otherwise)",
    )
    p.add_argument("--limit", type=int, help="only the first N recorded turns (by user, then seq)")
    p.add_argument(
        "--reward-timeout-s", type=float, default=60.0, help="strict mode: longest wait for a reward"
    )
    p.add_argument("--out", help="write one JSON line per re-driven turn here")
    p.add_argument("--summary", help="write both runs' summaries and the comparison settings as JSON here")
    p.add_argument("--traces", help="write recorded.jsonl and redriven.jsonl here (for `mars replay report`)")
    p.set_defaults(func=cmd_run)
