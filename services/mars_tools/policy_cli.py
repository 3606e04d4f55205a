"""`mars policy create|list|show|diff|activate|shadow|compare|promote|rollback|canary`: the router's policy
versions.

A version is an immutable routing config of a tenant's (algorithm and parameters, feature set, lambda, arms;
mars.domain.policy_versions), kept by the router in the pipeline's Postgres (MARS_POSTGRES_DSN or
--postgres-dsn). One version is live per tenant (none: the router's own settings, the implicit "default");
one may run in shadow beside it, deciding every turn without answering. `compare` judges the shadow from
the log; `promote` makes it live, `rollback` goes back. `canary` routes a share of the sessions by a version
and lets the router promote or roll it back by a sequential test (mars.domain.rollout), with the evidence
in the audit row. Every router replica routes by a change within
MARS_ROUTER_POLICY_CONFIG_TTL_S (0.5 s). The operations are mars_router.policy_admin's; this is the terminal.
"""

from __future__ import annotations

import argparse
import getpass
import json
from dataclasses import asdict
from typing import Any

from mars.domain.ope import LoggedEvaluation, evaluate_logged
from mars.domain.policy_versions import (
    ALGORITHMS,
    DEFAULT_VERSION,
    FEATURE_SETS,
    PARAMS,
    PolicyConfig,
    PolicyConfigError,
    diff,
    from_router_settings,
)
from mars.domain.rollout import RolloutState
from mars.model_pool import load_pool
from mars_router import policy_admin as admin
from mars_router.settings import RouterSettings
from rich.markup import escape
from rich.table import Table

from mars_tools.admin_cli import SettingsError, add_postgres_dsn_arg, load_settings
from mars_tools.terminal import console

EXIT_FAILED, EXIT_BAD_INPUT = 1, 2


def _connect(args: argparse.Namespace) -> Any:
    import psycopg

    dsn = load_settings(postgres_dsn=args.postgres_dsn).postgres_dsn
    conn = psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    found = conn.execute("SELECT to_regclass('router_policy_versions') IS NOT NULL").fetchone()
    if not found or not found[0]:
        conn.close()
        raise SettingsError(
            "the router's policy tables are missing: run `mars migrate` (or start the router) first"
        )
    return conn


def _run(args: argparse.Namespace, action: Any) -> int:
    try:
        with _connect(args) as conn:
            return int(action(conn))
    except (SettingsError, ValueError, OSError) as exc:  # PolicyAdminError, PolicyConfigError; a file unread
        console.print(f"[red]{escape(str(exc))}[/]")
        return EXIT_BAD_INPUT
    except Exception as exc:  # Postgres away or refusing: one line, not a traceback
        console.print(f"[red]Postgres refused: {type(exc).__name__}: {escape(str(exc))}[/]")
        return EXIT_FAILED


def _pool_arms(args: argparse.Namespace) -> list[str]:
    path = args.model_pool or RouterSettings().model_pool
    return list(load_pool(path).arms)


def _config_from_args(args: argparse.Namespace) -> PolicyConfig:
    if args.from_file:
        with open(args.from_file, encoding="utf-8") as f:
            return PolicyConfig.from_dict(json.load(f))
    if not args.algorithm or not args.arms:
        raise PolicyConfigError("give --algorithm and --arms (or --from-file)")
    params: dict[str, float] = {}
    for item in args.param or []:
        name, sep, value = item.partition("=")
        try:
            params[name.strip()] = float(value)
        except ValueError:
            raise PolicyConfigError(f"--param {item!r}: expected NAME=NUMBER") from None
        if not sep:
            raise PolicyConfigError(f"--param {item!r}: expected NAME=NUMBER")
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    return PolicyConfig(args.algorithm, arms, params, args.feature_set, args.lam)


def cmd_create(args: argparse.Namespace) -> int:
    def action(conn: Any) -> int:
        cfg = _config_from_args(args)
        same = [
            v.version for v in admin.list_versions(conn, args.tenant) if v.content_hash == cfg.content_hash()
        ]
        row = admin.create_version(
            conn, args.tenant, cfg, _pool_arms(args), args.id, args.note or "", args.actor
        )
        console.print(
            f"created {args.tenant} {row.version} ({row.content_hash[:12]}): {cfg.canonical_json()}"
        )
        if same:
            console.print(f"[yellow]note: the same config as {', '.join(same)}[/]")
        return 0

    return _run(args, action)


def _params_text(config: PolicyConfig) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(config.params.items()))


def cmd_list(args: argparse.Namespace) -> int:
    def action(conn: Any) -> int:
        if not args.tenant:
            table = Table(title="tenants with policy versions", title_justify="left")
            for col in ("tenant", "versions", "live", "shadow"):
                table.add_column(col)
            for tenant in admin.tenants(conn):
                r = admin.roles(conn, tenant)
                table.add_row(
                    tenant, str(len(admin.list_versions(conn, tenant))), r["live"], r.get("shadow", "")
                )
            console.print(table)
            return 0
        versions = admin.list_versions(conn, args.tenant)
        if not versions:
            raise admin.PolicyAdminError(
                f"tenant {args.tenant!r} has no policy versions: it routes by the router's settings (default)"
            )
        by_version = {v: role for role, v in admin.roles(conn, args.tenant).items()}
        table = Table(title=f"policy versions of {args.tenant}", title_justify="left")
        for col in (
            "version",
            "role",
            "algorithm",
            "params",
            "features",
            "lambda",
            "arms",
            "hash",
            "created",
            "note",
        ):
            table.add_column(col)
        if by_version.get(DEFAULT_VERSION) == "live":
            table.add_row(DEFAULT_VERSION, "live", "(router settings)", "", "", "", "", "", "", "")
        for v in versions:
            c = v.config
            table.add_row(
                v.version,
                by_version.get(v.version, ""),
                c.algorithm,
                _params_text(c),
                c.feature_set,
                "judge's" if c.lambda_cost is None else f"{c.lambda_cost:g}",
                ",".join(c.arms),
                v.content_hash[:12],
                f"{v.created_at:%Y-%m-%d %H:%M}",
                v.note,
            )
        console.print(table)
        return 0

    return _run(args, action)


def _default_config(args: argparse.Namespace) -> PolicyConfig | None:
    s = RouterSettings()
    return from_router_settings(s.routing_policy, _pool_arms(args), s.alpha, s.ridge, s.epsilon, s.thompson_v)


def _config_of(conn: Any, args: argparse.Namespace, version: str) -> PolicyConfig:
    if version == DEFAULT_VERSION:
        config = _default_config(args)
        if config is None:
            raise admin.PolicyAdminError(
                "the router's routing policy (MARS_ROUTER_ROUTING_POLICY) is not a bandit"
            )
        return config
    row = admin.get_version(conn, args.tenant, version)
    assert row is not None
    return row.config


def cmd_show(args: argparse.Namespace) -> int:
    def action(conn: Any) -> int:
        config = _config_of(conn, args, args.version)
        held = [role for role, v in admin.roles(conn, args.tenant).items() if v == args.version]
        console.print(f"{args.tenant} {args.version} ({', '.join(held) or 'no role'}):")
        print(json.dumps(config.to_dict(), indent=2), flush=True)
        console.print(f"content hash {config.content_hash()}")
        for c in admin.changes(conn, args.tenant, args.history):
            console.print(
                f"  #{c.change_id} {c.changed_at:%Y-%m-%d %H:%M:%S} {c.action} {c.role} "
                f"{c.from_version or '-'} -> {c.to_version or '-'} by {c.actor or '?'} {json.dumps(c.evidence)[:160]}",
                soft_wrap=True,
            )
        return 0

    return _run(args, action)


def cmd_diff(args: argparse.Namespace) -> int:
    def action(conn: Any) -> int:
        changed = diff(_config_of(conn, args, args.old), _config_of(conn, args, args.new))
        if not changed:
            console.print(f"{args.old} and {args.new} are the same config")
            return 0
        table = Table(title=f"{args.tenant}: {args.old} -> {args.new}", title_justify="left")
        for col in ("field", args.old, args.new):
            table.add_column(col)
        for name, (old, new) in changed.items():
            table.add_row(name, json.dumps(old), json.dumps(new))
        console.print(table)
        return 0

    return _run(args, action)


def _said(change: admin.Change) -> int:
    """Print a change as done; exit 0."""
    console.print(
        f"{change.action}: {change.role or 'version'} {change.from_version or '(none)'} -> "
        f"{change.to_version or '(none)'} (change #{change.change_id}); every router replica follows within "
        "MARS_ROUTER_POLICY_CONFIG_TTL_S"
    )
    return 0


def cmd_activate(args: argparse.Namespace) -> int:
    return _run(
        args, lambda conn: _said(admin.activate(conn, args.tenant, args.version, args.actor, args.reason))
    )


def cmd_shadow(args: argparse.Namespace) -> int:
    if bool(args.version) == bool(args.off):
        console.print("[red]give a VERSION to run in shadow, or --off to stop the shadow[/]")
        return EXIT_BAD_INPUT
    version = None if args.off else args.version
    return _run(
        args, lambda conn: _said(admin.set_shadow(conn, args.tenant, version, args.actor, args.reason))
    )


def comparison(conn: Any, tenant: str, version: str, bootstrap: int, limit: int) -> LoggedEvaluation | None:
    rows, arms = admin.logged_comparison(conn, tenant, version, limit)
    if not rows:
        return None
    return evaluate_logged(rows, len(arms), bootstrap=bootstrap)


def _evidence(result: LoggedEvaluation, version: str) -> dict[str, Any]:
    return {"candidate": version, **asdict(result)}


def cmd_compare(args: argparse.Namespace) -> int:
    def action(conn: Any) -> int:
        current = admin.roles(conn, args.tenant)
        version = args.version or current.get("shadow")
        if version is None:
            raise admin.PolicyAdminError(
                f"tenant {args.tenant} has no shadow version; name the VERSION to compare"
            )
        admin.get_version(conn, args.tenant, version)
        result = comparison(conn, args.tenant, version, args.bootstrap, args.limit)
        if result is None:
            console.print(f"[yellow]no judged turns of {args.tenant} with a {version} shadow decision yet[/]")
            return EXIT_FAILED
        if args.json:
            print(json.dumps(_evidence(result, version)), flush=True)
            return 0
        console.print(
            f"{args.tenant}: {version} (candidate) against the live policy on {result.turns} judged turns "
            f"({result.skipped} left out: unknown live propensity)"
        )
        for name, est in (
            ("live (logged)", result.live),
            (f"{version} SNIPS", result.snips),
            (f"{version} DR", result.dr),
        ):
            console.print(f"  {name:<18} {est.value:8.4f}  95% [{est.low:.4f}, {est.high:.4f}]")
        console.print(
            f"  turns {result.turns}, matched (candidate chose the live arm) {result.matched}, "
            f"effective sample size {result.ess:.1f}"
        )
        console.print(
            "  SNIPS rests on the matched turns; DR adds a reward model's value of the candidate's arm on the "
            "others (extrapolated where the live policy never plays that arm)."
        )
        return 0

    return _run(args, action)


def cmd_promote(args: argparse.Namespace) -> int:
    def action(conn: Any) -> int:
        evidence: dict[str, Any] = {"reason": args.reason}
        candidate = admin.roles(conn, args.tenant).get(args.role)
        if candidate is not None and args.role == "shadow":
            result = comparison(conn, args.tenant, candidate, args.bootstrap, 100_000)
            if result is not None:
                evidence |= _evidence(result, candidate)
        runs = admin.rollouts(conn, args.tenant, 1) if args.role == "canary" else []
        if runs and runs[0].decided_at is None and runs[0].evidence:  # where the open run's test stood
            evidence |= {"canary_run": runs[0].rollout_id, "rollout": runs[0].evidence}
        return _said(admin.promote(conn, args.tenant, args.role, args.actor, evidence))

    return _run(args, action)


def cmd_rollback(args: argparse.Namespace) -> int:
    return _run(args, lambda conn: _said(admin.rollback(conn, args.tenant, args.actor, args.reason)))


def _common(p: argparse.ArgumentParser, tenant: bool = True) -> None:
    add_postgres_dsn_arg(p)
    if tenant:
        p.add_argument("tenant", help="the tenant whose routing policy this is")


def _login() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name in a bare container
        return ""


def _change_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reason", default="", help="why (kept in the audit row, router_policy_changes)")
    p.add_argument("--actor", default=_login(), help="who (default: the login name)")


def _create_args(p: argparse.ArgumentParser) -> None:
    algos = ", ".join(f"{a} ({', '.join(PARAMS[a])})" for a in ALGORITHMS)
    p.add_argument("--algorithm", choices=list(ALGORITHMS), help=f"the bandit; parameters: {algos}")
    p.add_argument(
        "--param", action="append", metavar="NAME=NUMBER", help="a parameter (repeat); omitted: its default"
    )
    p.add_argument(
        "--feature-set",
        default="state",
        choices=list(FEATURE_SETS),
        help="state features or the query embedding",
    )
    p.add_argument(
        "--lambda",
        dest="lam",
        type=float,
        help="cost weight of the reward u - lambda*C (default: the judge's)",
    )
    p.add_argument("--arms", help="comma-separated arms, all in the model pool; the first wins ties")
    p.add_argument(
        "--from-file", help="a JSON config instead: {algorithm, params, feature_set, lambda, arms}"
    )
    p.add_argument("--id", help="the version id (default: v<N>, the next number)")
    p.add_argument("--note", help="a note shown by list")
    p.add_argument("--model-pool", help="the pool the arms must be in (default: MARS_ROUTER_MODEL_POOL)")
    p.add_argument("--actor", default=_login(), help="who (default: the login name)")


def add_policy_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    policy = sub.add_parser(
        "policy",
        help="the router's policy versions per tenant: create, shadow, compare, promote, roll back, canary",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit 0 on success, 1 when Postgres failed (or compare has no turns), 2 for bad input "
        "(an unknown tenant or version, a bad parameter, a role a version cannot take).",
    )
    psub = policy.add_subparsers(dest="policy_cmd", required=True)
    _add_version_commands(psub)
    _add_role_commands(psub)
    _add_canary_command(psub)


def _add_canary_command(psub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = psub.add_parser(
        "canary",
        help="start a canary run of VERSION (a share of sessions routed by it; promoted or rolled back by the "
        "sequential test), --stop it, or --status",
        description="The router routes MARS_ROUTER_ROLLOUT_SHARE of TENANT's sessions (a stable hash of the "
        "session, so a session never changes side) by VERSION, the others by the live version, and adds each "
        "judged turn to an always-valid sequential test (mars.domain.rollout). The first decision is acted on "
        "by the router: promote (VERSION becomes live) or roll back (a guardrail or the test), with the "
        "evidence in the audit row, a row in router_rollouts and a PolicyDecision event on mars.control.",
    )
    _common(p)
    p.add_argument("version", nargs="?", help="the candidate (not the live version)")
    p.add_argument("--stop", action="store_true", help="stop the open canary run (live stays)")
    p.add_argument("--status", action="store_true", help="show the tenant's canary runs and their evidence")
    _change_args(p)
    p.set_defaults(func=cmd_canary)


def _show_rollouts(conn: Any, tenant: str) -> int:
    runs = admin.rollouts(conn, tenant)
    if not runs:
        console.print(f"tenant {escape(tenant)} has had no canary run")
        return 0
    table = Table("run", "live", "candidate", "started", "turns", "decision", "rule", "statistic / boundary")
    for r in runs:
        evidence = r.evidence or {}
        stat = (
            f"{evidence.get('statistic', 0.0):.2f} / {evidence.get('boundary', 0.0):.2f}" if evidence else ""
        )
        table.add_row(
            str(r.rollout_id),
            r.live_version,
            r.candidate_version,
            f"{r.started_at:%Y-%m-%d %H:%M:%S}",
            str(r.turns),
            r.decision or "(open)",
            r.rule or "",
            stat,
        )
    console.print(table)
    return 0


def cmd_canary(args: argparse.Namespace) -> int:
    if args.status:
        return _run(args, lambda conn: _show_rollouts(conn, args.tenant))
    if bool(args.version) == bool(args.stop):
        console.print("[red]give a VERSION to start a canary run, --stop to stop it, or --status[/]")
        return EXIT_BAD_INPUT
    version = None if args.stop else args.version
    initial = RolloutState().to_dict()
    return _run(
        args,
        lambda conn: _said(admin.set_canary(conn, args.tenant, version, initial, args.actor, args.reason)),
    )


def _add_version_commands(psub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """create, list, show, diff: the versions themselves."""
    p = psub.add_parser(
        "create",
        help="store a new immutable version of TENANT's routing config",
        description="Stores a validated config as a new version (not live: activate or shadow it). Parameters "
        "outside their range, unknown parameters and arms outside the model pool are refused.",
    )
    _common(p)
    _create_args(p)
    p.set_defaults(func=cmd_create)

    p = psub.add_parser(
        "list", help="TENANT's versions with their roles (no TENANT: every tenant with versions)"
    )
    add_postgres_dsn_arg(p)
    p.add_argument("tenant", nargs="?", help="the tenant (omit for all tenants)")
    p.set_defaults(func=cmd_list)

    p = psub.add_parser("show", help="one version's config, hash and roles, and the tenant's recent changes")
    _common(p)
    p.add_argument("version", help="a version id, or 'default' (the router's settings)")
    p.add_argument("--history", type=int, default=10, help="how many recent changes to print (default 10)")
    p.add_argument("--model-pool", help="the pool 'default' routes over (default: MARS_ROUTER_MODEL_POOL)")
    p.set_defaults(func=cmd_show)

    p = psub.add_parser("diff", help="the fields two versions differ in")
    _common(p)
    p.add_argument("old", help="a version id or 'default'")
    p.add_argument("new", help="a version id or 'default'")
    p.add_argument("--model-pool", help="the pool 'default' routes over (default: MARS_ROUTER_MODEL_POOL)")
    p.set_defaults(func=cmd_diff)


def _add_role_commands(psub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """activate, shadow, compare, promote, rollback: which version does what, and the evidence."""
    p = psub.add_parser(
        "activate",
        help="make VERSION live for TENANT now, without a shadow run ('default': the router's settings)",
    )
    _common(p)
    p.add_argument("version", help="the version to make live")
    _change_args(p)
    p.set_defaults(func=cmd_activate)

    p = psub.add_parser(
        "shadow",
        help="run VERSION beside the live one on every turn (logged, never answering), or --off",
        description="The shadow decides every turn of TENANT beside the live version; its choice, propensity "
        "and score are on the Routed event and in router_shadow_decisions. It learns from the matched turns "
        "only (where it chose the arm whose reward was observed), in the live update's transaction.",
    )
    _common(p)
    p.add_argument("version", nargs="?", help="the version to run in shadow (not the live one)")
    p.add_argument("--off", action="store_true", help="stop the shadow")
    _change_args(p)
    p.set_defaults(func=cmd_shadow)

    p = psub.add_parser(
        "compare",
        help="estimate the shadow's value against the live policy from the log (SNIPS, DR, ESS)",
        description="From the judged turns the shadow decided beside the live policy: the live policy's mean "
        "reward, the candidate's SNIPS and doubly robust estimates with BCa 95% intervals, the number of "
        "turns and the effective sample size of the importance weights (mars.domain.ope.evaluate_logged).",
    )
    _common(p)
    p.add_argument("version", nargs="?", help="the candidate (default: the current shadow)")
    p.add_argument("--bootstrap", type=int, default=500, help="bootstrap resamples for the intervals")
    p.add_argument("--limit", type=int, default=100_000, help="the most recent turns to use")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(func=cmd_compare)

    p = psub.add_parser(
        "promote",
        help="make the shadow (or canary) version live; the comparison goes in the audit row",
    )
    _common(p)
    p.add_argument("--role", default="shadow", choices=["shadow", "canary"], help="which candidate")
    p.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples of the evidence")
    _change_args(p)
    p.set_defaults(func=cmd_promote)

    p = psub.add_parser(
        "rollback",
        help="return TENANT to the version live before the current one (from the audit trail)",
    )
    _common(p)
    _change_args(p)
    p.set_defaults(func=cmd_rollback)
