"""The `mars` command line: each command's parser lives in its own module, loaded only when needed.

`mars migrate` (a Helm hook) loads the migrate module alone, never the benchmarks' faiss or torch; `mars` and
`mars --help` load every command's parser to list them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mars_tools.terminal import console

#: Command -> "module:function" that adds its parser to the subcommands, in `mars --help` order.
COMMANDS: dict[str, str] = {
    "run": "mars_tools.stack_cli:add_run_parser",
    "stack": "mars_tools.stack_cli:add_stack_parser",
    "demo": "mars_tools.send_cli:add_demo_parser",
    "send": "mars_tools.send_cli:add_send_parser",
    "import-history": "mars_tools.history_cli:add_import_history_parser",
    "eval": "mars_tools.eval.cli:add_eval_parser",
    "bench": "mars_tools.bench.cli:add_bench_parser",
    "replay": "mars_tools.replay.cli:add_replay_parser",
    "probe": "mars_tools.probe.cli:add_probe_parser",
    "migrate": "mars_tools.admin_cli:add_migrate_parser",
    "topics": "mars_tools.admin_cli:add_topics_parser",
    "tenant": "mars_tools.tenant_cli:add_tenant_parser",
    "policy": "mars_tools.policy_cli:add_policy_parser",
    "forget-user": "mars_tools.forget_cli:add_forget_parser",
    "keys": "mars_tools.keys_cli:add_keys_parser",
    "identity": "mars_tools.identity_cli:add_identity_parser",
    "train": "mars_tools.train_cli:add_train_parser",
    "deploy": "mars_tools.deploy.cli:add_deploy_parser",
    "kube": "mars_tools.kube_cli:add_kube_parser",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `mars` parser: every command, or only `only` (whose module alone is imported)."""
    parser = argparse.ArgumentParser(
        prog="mars",
        description="MARS: memory-aware routing for long-running LLM assistants. "
        "One session state decides which memory a turn sees and which model answers it.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, target in COMMANDS.items():
        if only is None or name == only:
            module, _, function = target.partition(":")
            getattr(importlib.import_module(module), function)(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(command).parse_args(argv)
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
