"""`mars bench rollout`: the canary's stopping rule and guardrails (mars.domain.rollout) on the router simulator.

The environment is `mars bench router`'s: its four arms with their Table 10 prices, its contexts and its hidden
quality model. A pool of `--pool` turns is drawn once from it (`draw_turn`); each canary turn picks a
context from the pool at random, the observed utility is the arm's expected quality plus N(0, 0.1) noise
clipped to [0, 1] (the simulator's), the reward is utility - lambda * cost, and each turn is a session of its
own that goes to the candidate with probability `--share`.

Policies (a simplification, for speed: fixed arm preferences, not LinUCB learning per turn). The simulator's
LinUCB learns to within 0.01 of the oracle's reward per turn, leaving no room for a candidate 0.1 better, so
the live policy is a fixed one, always Mixtral-8x7B (0.53 expected reward at lambda 0.002), and each
candidate plays live's arm except on a calibrated share f of its turns, where it plays:
- better by d: the context's best open-weight arm (0.71); f = d / 0.18, so the true effect is d exactly
  over the pool;
- worse by d: the context's worst open-weight arm; equal: the best on some turns and the worst on others,
  balanced to an effect of exactly 0 (a different policy of equal value, the test's null);
- failing arm: the better-by-0.05 candidate whose preferred arm fails 30% of the time (the turn is then
  answered by live's arm and counted failed); every arm also fails 1% of the time;
- costly: GPT-4o on f of its turns, f set for 3x live's cost per turn (better on reward at lambda 0.002).

Each run goes turn by turn through `RolloutState.observe` and `decide` (the code the router runs) until the
first decision or `--max-turns`. Printed per scenario: the true effect, the shares promoted, rolled back (by
the reward test and by a guardrail) and undecided, and the median and p90 total turns (both arms) to a
decision; then the false-promotion rate of the equal candidate with its Wilson 95% upper bound, against
alpha (the test promotes a candidate that is not better with probability at most alpha, about alpha/2).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from mars.domain.rollout import Decision, RolloutConfig, RolloutState, Rule, decide
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from mars_tools.bench.ope import expected_observed_quality
from mars_tools.bench.router_sim import NOISE, POOL, draw_turn
from mars_tools.stats import wilson_interval

ARMS = [a.name for a in POOL]
LIVE = ARMS.index("mixtral-8x7b")
COSTLY = ARMS.index("gpt-4o")
OPEN_WEIGHT = [i for i, a in enumerate(ARMS) if a != "gpt-4o"]
BACKGROUND_FAILURE, ARM_FAILURE, FAILING_EFFECT, COST_FACTOR = 0.01, 0.3, 0.05, 3.0


@dataclass(frozen=True)
class Environment:
    """The pool of simulator turns: per turn and arm, expected quality and cost (USD)."""

    quality: np.ndarray
    cost: np.ndarray
    lam: float

    @property
    def value(self) -> np.ndarray:
        """Expected reward per turn and arm (the mean of the clipped observed utility, minus cost)."""
        return np.asarray(expected_observed_quality(self.quality) - self.lam * self.cost)

    @property
    def best(self) -> np.ndarray:
        return np.asarray(OPEN_WEIGHT)[self.value[:, OPEN_WEIGHT].argmax(axis=1)]

    @property
    def worst(self) -> np.ndarray:
        return np.asarray(OPEN_WEIGHT)[self.value[:, OPEN_WEIGHT].argmin(axis=1)]


def build_environment(size: int, lam: float, seed: int = 2026) -> Environment:
    rng = np.random.default_rng(seed)
    turns = [draw_turn(rng, depth=1 + t % 12) for t in range(size)]
    return Environment(np.array([t.expected_quality for t in turns]), np.array([t.cost for t in turns]), lam)


@dataclass(frozen=True)
class Scenario:
    """A candidate: on a share of its turns it plays the best, worst or the costly arm instead of live's."""

    name: str
    f_best: float = 0.0
    f_worst: float = 0.0
    f_costly: float = 0.0
    #: Probability that a turn the candidate moved off live's arm fails (the failing-arm scenario).
    deviation_failure: float = 0.0


def scenarios(env: Environment, effects: list[float]) -> list[Scenario]:
    """The candidates, their shares calibrated on the pool so that each true effect is exact."""
    v = env.value
    rows = np.arange(len(v))
    gain = float(np.mean(v[rows, env.best] - v[:, LIVE]))
    loss = float(np.mean(v[:, LIVE] - v[rows, env.worst]))
    out = []
    for d in effects:
        if d > 0:
            out.append(Scenario(f"better {d:+g}", f_best=_share(d / gain)))
        elif d < 0:
            out.append(Scenario(f"worse {d:+g}", f_worst=_share(-d / loss)))
        else:
            out.append(Scenario("equal 0", f_best=0.3, f_worst=_share(0.3 * gain / loss)))
    out.append(Scenario("failing arm", f_best=_share(FAILING_EFFECT / gain), deviation_failure=ARM_FAILURE))
    live_cost = float(env.cost[:, LIVE].mean())
    costly = (COST_FACTOR - 1) * live_cost / float(env.cost[:, COSTLY].mean() - live_cost)
    out.append(Scenario("costly", f_costly=_share(costly)))
    return out


def _share(f: float) -> float:
    if not 0 <= f <= 1:
        raise ValueError(f"an effect this large needs the candidate off live's arm on {f:.0%} of its turns")
    return f


def truth(env: Environment, s: Scenario) -> dict[str, float]:
    """The candidate's true effect on the reward per turn, failure excess and cost ratio, over the pool."""
    v, c = env.value, env.cost
    rows = np.arange(len(v))
    dev = np.array([s.f_best, s.f_worst, s.f_costly])
    arms = np.stack([env.best, env.worst, np.full(len(v), COSTLY)], axis=1)
    served_value = (1 - s.deviation_failure) * v[rows[:, None], arms] + s.deviation_failure * v[:, [LIVE]]
    served_cost = (1 - s.deviation_failure) * c[rows[:, None], arms] + s.deviation_failure * c[:, [LIVE]]
    moved = dev.sum()
    effect = float(np.mean(served_value @ dev + (1 - moved) * v[:, LIVE] - v[:, LIVE]))
    cost = float(np.mean(served_cost @ dev + (1 - moved) * c[:, LIVE]))
    return {
        "effect": effect,
        "failure_excess": float(moved * s.deviation_failure * (1 - BACKGROUND_FAILURE)),
        "cost_ratio": cost / float(c[:, LIVE].mean()),
    }


def simulate(env: Environment, s: Scenario, config: RolloutConfig, seed: int) -> dict[str, Any]:
    """One canary: turns drawn up front with numpy, then fed one by one to observe/decide until a decision."""
    n = config.max_turns
    rng = np.random.default_rng(seed)
    j = rng.integers(len(env.quality), size=n)
    canary = rng.random(n) < config.canary_share
    u = rng.random(n)
    arm = np.full(n, LIVE)
    to_best = u < s.f_best
    to_worst = (u >= s.f_best) & (u < s.f_best + s.f_worst)
    to_costly = (u >= s.f_best + s.f_worst) & (u < s.f_best + s.f_worst + s.f_costly)
    arm[to_best], arm[to_worst], arm[to_costly] = env.best[j[to_best]], env.worst[j[to_worst]], COSTLY
    moved = canary & (to_best | to_worst | to_costly)
    arm_failed = moved & (rng.random(n) < s.deviation_failure)
    served = np.where(canary & ~arm_failed, arm, LIVE)  # a failed arm's turn is answered by live's arm
    utility = np.clip(env.quality[j, served] + rng.normal(0.0, NOISE, n), 0.0, 1.0)
    cost = env.cost[j, served]
    reward = utility - env.lam * cost
    failed = arm_failed | (rng.random(n) < BACKGROUND_FAILURE)
    state = RolloutState()
    rows = zip(
        canary.tolist(), reward.tolist(), cost.tolist(), failed.tolist(), utility.tolist(), strict=True
    )
    for c, r, k, f, ut in rows:
        state.observe(config, canary=c, reward=r, cost=k, failed=f, utility=ut)
        evidence = decide(state, config)
        if evidence.decision is not Decision.CONTINUE:
            break
    return {
        "decision": evidence.decision.value,
        "reason": evidence.reason.value,
        "turns": state.reward_test.t,
    }


_ENV: Environment | None = None


def _init_worker(env: Environment) -> None:
    global _ENV
    _ENV = env


def _run_one(s: Scenario, config: RolloutConfig, seed: int) -> dict[str, Any]:
    assert _ENV is not None
    return simulate(_ENV, s, config, seed)


def run_all(
    env: Environment, cases: list[Scenario], config: RolloutConfig, seeds: int, jobs: int, progress: Progress
) -> dict[str, list[dict[str, Any]]]:
    """Every scenario over seeds 0..seeds-1 (each scenario and seed its own stream), on `jobs` processes."""
    task = progress.add_task("canaries", total=len(cases) * seeds)
    results: dict[str, list[dict[str, Any]]] = {s.name: [] for s in cases}
    work = [(i, s, seed) for i, s in enumerate(cases) for seed in range(seeds)]
    if jobs == 1:
        for i, s, seed in work:
            results[s.name].append(simulate(env, s, config, 1_000_003 * i + seed))
            progress.advance(task)
        return results
    with ProcessPoolExecutor(jobs, initializer=_init_worker, initargs=(env,)) as pool:
        futures = {pool.submit(_run_one, s, config, 1_000_003 * i + seed): s.name for i, s, seed in work}
        for future in as_completed(futures):
            results[futures[future]].append(future.result())
            progress.advance(task)
    return results


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(runs)
    decisions = Counter(r["decision"] for r in runs)
    reasons = Counter(r["reason"] for r in runs)
    guardrail = sum(
        reasons[g.value] for g in (Rule.FAILURE_GUARDRAIL, Rule.COST_GUARDRAIL, Rule.UTILITY_GUARDRAIL)
    )
    decided = [r["turns"] for r in runs if r["decision"] in (Decision.PROMOTE.value, Decision.ROLLBACK.value)]
    promoted = decisions[Decision.PROMOTE.value]
    return {
        "runs": n,
        "promoted": promoted / n,
        "rolled_back": decisions[Decision.ROLLBACK.value] / n,
        "rolled_back_by_guardrail": guardrail / n,
        "undecided": decisions[Decision.UNDECIDED.value] / n,
        "reasons": dict(reasons),
        "turns_median": float(np.median(decided)) if decided else None,
        "turns_p90": float(np.percentile(decided, 90)) if decided else None,
        "promotion_wilson95": list(wilson_interval(promoted, n)),
    }


def _table(report: dict[str, Any], config: RolloutConfig, seeds: int) -> Table:
    table = Table(
        title=f"canary test, alpha {config.alpha}, share {config.canary_share}, cap {config.max_turns} turns, "
        f"{seeds} seeds per scenario"
    )
    for col in (
        "scenario",
        "true effect",
        "cost ratio",
        "promoted",
        "rolled back (guardrail)",
        "undecided",
        "turns median",
        "turns p90",
    ):
        table.add_column(col, justify="left" if col == "scenario" else "right")
    for name, row in report.items():
        t = row["truth"]
        table.add_row(
            name,
            f"{t['effect']:+.4f}",
            f"{t['cost_ratio']:.2f}",
            f"{row['promoted']:.3f}",
            f"{row['rolled_back']:.3f} ({row['rolled_back_by_guardrail']:.3f})",
            f"{row['undecided']:.3f}",
            "-" if row["turns_median"] is None else f"{row['turns_median']:.0f}",
            "-" if row["turns_p90"] is None else f"{row['turns_p90']:.0f}",
        )
    return table


def cmd_rollout(args: argparse.Namespace) -> int:
    console = Console(width=160)
    try:
        if args.seeds < 1 or args.jobs < 1 or args.pool < 100:
            raise ValueError("--seeds and --jobs must be at least 1 and --pool at least 100")
        config = RolloutConfig(alpha=args.alpha, canary_share=args.share, max_turns=args.max_turns)
        started = time.perf_counter()
        env = build_environment(args.pool, args.lam)
        cases = scenarios(env, args.effects)
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    with Progress(console=console) as progress:
        results = run_all(env, cases, config, args.seeds, args.jobs, progress)
    report = {
        s.name: {"truth": truth(env, s), "scenario": asdict(s), **summarise(results[s.name])} for s in cases
    }
    wall = time.perf_counter() - started
    console.print(_table(report, config, args.seeds))
    equal = report.get("equal 0")
    if equal is not None:
        k = round(equal["promoted"] * args.seeds)
        upper = equal["promotion_wilson95"][1]
        verdict = "at or below" if upper <= config.alpha else "NOT shown at or below"
        console.print(
            f"false promotion (equal candidate): {k}/{args.seeds} = {equal['promoted']:.3f}, Wilson 95% upper "
            f"bound {upper:.3f}: {verdict} alpha {config.alpha}"
        )
    console.print(f"lambda {args.lam}; {args.jobs} process(es); wall time {wall:.1f} s")
    if args.json:
        out = {
            "config": {k: v for k, v in asdict(config).items()},
            "lambda": args.lam,
            "seeds": args.seeds,
            "jobs": args.jobs,
            "wall_s": wall,
            "scenarios": report,
        }
        Path(args.json).write_text(json.dumps(out, indent=2))
        console.print(f"results written to {args.json}")
    return 0


def add_rollout_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "rollout",
        help="the canary's sequential test and guardrails on the router simulator (promote/rollback rates)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seeds", type=int, default=200, help="runs per scenario (default 200)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    p.add_argument(
        "--effects",
        type=float,
        nargs="+",
        default=[0.02, 0.05, 0.1, 0.0, -0.05],
        help="true reward effects of the candidates (default 0.02 0.05 0.1 0 -0.05); the failing-arm and "
        "costly candidates are always added",
    )
    p.add_argument("--alpha", type=float, default=0.05, help="level of the reward test (default 0.05)")
    p.add_argument("--share", type=float, default=0.5, help="canary share of sessions (default 0.5)")
    p.add_argument("--max-turns", type=int, default=10_000, help="turn cap, both arms (default 10000)")
    p.add_argument(
        "--lam",
        type=float,
        default=0.002,
        help="cost weight per USD, as MARS_JUDGE_LAMBDA_COST (default 0.002)",
    )
    p.add_argument(
        "--pool", type=int, default=20_000, help="simulator turns drawn as contexts (default 20000)"
    )
    p.add_argument("--json", help="write the results as JSON here")
    p.set_defaults(func=cmd_rollout)
