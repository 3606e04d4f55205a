"""`mars eval realmem` and `mars eval locomo`: benchmarks driven through a running pipeline's ingress."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from mars.domain.turn_options import MAX_TOKENS_LIMIT, VIEW_TOKENS_LIMIT
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mars_tools.eval.driver import PipelineTarget
from mars_tools.replay.readers import topic_prefix_arg
from mars_tools.settings import ToolSettings


def _common(p: argparse.ArgumentParser) -> None:
    defaults = ToolSettings()
    p.add_argument(
        "--ingress",
        default=defaults.ingress_addr,
        help="the pipeline's ingress HOST:PORT (default: $MARS_INGRESS_ADDR or 127.0.0.1:50051)",
    )
    p.add_argument(
        "--bootstrap",
        default=defaults.kafka_bootstrap or "127.0.0.1:9092",
        help="its Kafka bootstrap servers, to read the logged views back",
    )
    p.add_argument(
        "--topic-prefix",
        type=topic_prefix_arg,
        default=defaults.topic_prefix,
        help="the pipeline's topic prefix (default: $MARS_TOPIC_PREFIX or none)",
    )
    p.add_argument("--tenant", help="tenant to send the turns as (default: eval-<unix time>, a fresh memory)")
    p.add_argument(
        "--postgres-dsn",
        default=defaults.postgres_dsn or None,
        help="the pipeline's Postgres: an API key for the tenant is created there (default: "
        "$MARS_POSTGRES_DSN; without it --api-key is sent)",
    )
    p.add_argument(
        "--api-key",
        default=defaults.api_key,
        help="without --postgres-dsn: the tenant's API key (default: $MARS_API_KEY); the tenant then "
        "defaults to $MARS_TENANT, the key's",
    )
    p.add_argument(
        "--max-tokens",
        type=_bounded(MAX_TOKENS_LIMIT),
        help=f"answer length cap sent with every turn (1..{MAX_TOKENS_LIMIT})",
    )
    p.add_argument(
        "--view-tokens",
        type=_bounded(VIEW_TOKENS_LIMIT),
        help="cap on the memory tokens packed into each prompt (the turn option view_tokens): shorter "
        "prompts, a faster run; the scored ranking is taken before packing, so it is the same",
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="seconds to wait for each answer")
    p.add_argument("--max-sessions", type=int, help="send only the first N sessions of each conversation")
    p.add_argument("--out", help="folder for results.json and answers.jsonl (for an external judge)")


def _bounded(limit: int) -> Callable[[str], int]:
    """argparse type of an integer turn option: the ingress accepts 1..limit."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if not 1 <= n <= limit:
            raise argparse.ArgumentTypeError(f"must be an integer in 1..{limit}, got {value!r}")
        return n

    return parse


def _target(args: argparse.Namespace) -> PipelineTarget:
    """The pipeline the arguments name; a fresh tenant unless one is given (with a key created in the
    pipeline's Postgres), else the key's tenant; views read from now on."""
    from mars.auth import mint_key

    if args.postgres_dsn:
        tenant = args.tenant or f"eval-{int(time.time())}"
        # An admin key: importing recorded history (mars eval realmem's default) takes one.
        api_key = mint_key(args.postgres_dsn, tenant, admin=True, label="mars eval").key
    else:
        tenant = args.tenant or ToolSettings().tenant or f"eval-{int(time.time())}"
        api_key = args.api_key
    options = {} if args.max_tokens is None else {"max_tokens": str(args.max_tokens)}
    if args.view_tokens is not None:
        options["view_tokens"] = str(args.view_tokens)
    if args.history == "import":
        # Scored turns are asked, not remembered: memory holds the recorded history (imported).
        options["remember"] = "false"
    return PipelineTarget(
        ingress=args.ingress,
        bootstrap=args.bootstrap,
        api_key=api_key,
        tenant=tenant,
        prefix=args.topic_prefix,
        options=options,
        timeout_s=args.timeout_s,
        since_ms=int(time.time() * 1000) - 1000,
    )


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )


def cmd_realmem(args: argparse.Namespace) -> int:
    from mars_tools.bench.realmem import format_table, load_selected_personas
    from mars_tools.eval.driver import HistoryImportFailed
    from mars_tools.eval.realmem import run_eval, truncate

    console = Console()
    try:
        personas = load_selected_personas(args.data, args.personas)
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    personas = [truncate(p, args.max_sessions) for p in personas]
    target = _target(args)
    console.print(
        f"{len(personas)} personas, {sum(len(p.sessions) for p in personas)} sessions, "
        f"{sum(len(p.queries) for p in personas)} scored queries -> {target.ingress} as tenant {target.tenant}"
        f" (history {'imported as recorded' if args.history == 'import' else 'sent turn by turn'})"
    )
    started = time.perf_counter()
    with _progress(console) as progress:
        tasks = {p.name: progress.add_task(p.name, total=len(p.sessions)) for p in personas}
        try:
            result = run_eval(
                personas,
                target,
                on_session=lambda name, n: progress.update(tasks[name], completed=n),
                import_history=args.history == "import",
            )
        except HistoryImportFailed as exc:
            console.print(f"[red]{exc}[/]")
            return 1
    console.print(
        format_table(result.results, "RealMem through the pipeline (views as logged)"), soft_wrap=True
    )
    console.print(
        f"turns sent {result.turns_sent}, failed {result.turns_failed}; recorded pairs imported "
        f"{result.pairs_imported}; scored queries {len(result.answered)}, without a logged view "
        f"{result.views_missing} (scored 0); {time.perf_counter() - started:.0f} s"
    )
    if args.out:
        result.write(Path(args.out))
        console.print(f"results, predictions and answers written to {args.out}")
    return 0


def cmd_locomo(args: argparse.Namespace) -> int:
    from mars_tools.bench.locomo import category_report, load_locomo
    from mars_tools.eval.driver import HistoryImportFailed
    from mars_tools.eval.locomo import run_eval, truncate

    console = Console()
    path = Path(args.data)
    if not path.is_file():
        console.print(f"[red]--data {path} is not a file[/]")
        return 2
    conversations = load_locomo(path)
    if args.conversations:
        unknown = set(args.conversations) - {c.sample_id for c in conversations}
        if unknown:
            console.print(f"[red]unknown conversation(s): {', '.join(sorted(unknown))}[/]")
            return 2
        conversations = [c for c in conversations if c.sample_id in set(args.conversations)]
    conversations = [truncate(c, args.max_sessions, args.max_questions) for c in conversations]
    target = _target(args)
    total = sum(len(c.turns) + len(c.questions) for c in conversations)
    console.print(
        f"{len(conversations)} conversations, {total} turns and questions -> {target.ingress} as tenant {target.tenant}"
    )
    with _progress(console) as progress:
        task = progress.add_task("turns", total=total)
        try:
            result = run_eval(
                conversations,
                target,
                on_turn=lambda: progress.update(task, advance=1),
                import_history=args.history == "import",
            )
        except HistoryImportFailed as exc:
            console.print(f"[red]{exc}[/]")
            return 1
    table, report = category_report(result.by_category, "LoCoMo evidence recall through the pipeline")
    console.print(table)
    console.print(
        f"turns sent {result.turns_sent}, failed {result.turns_failed}; turns imported {result.turns_imported}; "
        f"questions {len(result.answered)}, "
        f"without a logged view {result.views_missing} (scored 0)"
    )
    if args.out:
        result.write(Path(args.out), report)
        console.print(f"results and answers written to {args.out}")
    return 0


def add_eval_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ev = sub.add_parser(
        "eval", help="benchmarks through a running pipeline's gRPC ingress (metrics from the logged views)"
    )
    ev_sub = ev.add_subparsers(dest="eval", required=True)
    p = ev_sub.add_parser(
        "realmem",
        help="RealMem: personas' sessions in list order, scored queries answered, retrieval metrics from views",
    )
    p.add_argument("--data", required=True, help="folder of *_dialogues_256k.json files")
    p.add_argument(
        "--personas", nargs="+", help="only these personas (file name before _dialogues_256k.json)"
    )
    p.add_argument(
        "--history",
        choices=("import", "send"),
        default="import",
        help="import: store every turn pair but the scored queries as recorded (Ingress.ImportHistory; the "
        "tenant's key must be an admin key, as the one made with --postgres-dsn is) and send only the "
        "queries (default); send: send every user turn and store the pipeline's own answers",
    )
    _common(p)
    p.set_defaults(func=cmd_realmem)
    p = ev_sub.add_parser(
        "locomo", help="LoCoMo: conversations sent turn by turn, then questions; evidence recall from views"
    )
    p.add_argument("--data", required=True, help="a LoCoMo JSON file (list of conversations)")
    p.add_argument("--conversations", nargs="+", help="only these sample ids")
    p.add_argument("--max-questions", type=int, help="ask only the first N questions of each conversation")
    p.add_argument(
        "--history",
        choices=("import", "send"),
        default="import",
        help="import: store the conversation's turns as recorded (Ingress.ImportHistory, an admin key) and "
        "send only the questions (default); send: send every turn and let the pipeline answer it",
    )
    _common(p)
    p.set_defaults(func=cmd_locomo)
