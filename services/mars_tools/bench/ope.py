"""`mars bench ope`: off-policy estimates checked against the router simulator, where the truth is known.

Per seed: an epsilon-greedy router (learning online, propensities logged as on the routed event) plays
`--turns` simulated turns; from that log IPS, SNIPS and DR estimate the value of target policies it did
not run — a frozen greedy LinUCB trained on another run, always-Qwen2.5-72B, and uniform random — and each
estimate's 95% bootstrap interval is checked against the target's true value (mean expected reward over
`--truth-turns` fresh turns of the same environment). Prints per estimator the share of seeds whose
interval covers the truth and the mean absolute error.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from mars.domain.bandits import EpsilonGreedyRouting, LinUCBRouting
from mars.domain.features import FEATURE_DIM
from mars.domain.linucb import ArmModel
from mars.domain.ope import LoggedStep, TargetPolicy, evaluate
from rich.console import Console
from rich.progress import Progress

from mars_tools.bench.router_sim import NOISE, POOL, draw_turn

ARMS = [a.name for a in POOL]


def log_run(turns: int, lam: float, seed: int, epsilon: float) -> list[LoggedStep]:
    """The log of an epsilon-greedy router on the simulator: x, arm, propensity, observed reward."""
    env = np.random.default_rng(seed)
    policy = EpsilonGreedyRouting(ARMS, FEATURE_DIM, epsilon=epsilon, seed=seed + 1)
    models = {a: ArmModel.cold(FEATURE_DIM) for a in ARMS}
    steps = []
    for t in range(turns):
        turn = draw_turn(env, depth=1 + t % 12)
        decision = policy.decide(turn.x, models)
        i = ARMS.index(decision.arm)
        observed = float(np.clip(turn.expected_quality[i] + env.normal(0, NOISE), 0, 1))
        reward = observed - lam * float(turn.cost[i])
        models[decision.arm] = policy.update(models[decision.arm], turn.x, reward)
        steps.append(LoggedStep(turn.x, i, decision.propensity, reward))
    return steps


def trained_greedy(turns: int, lam: float, seed: int) -> TargetPolicy:
    """A LinUCB trained on its own simulated run, then frozen and played greedily (alpha 0)."""
    env = np.random.default_rng(seed)
    learner = LinUCBRouting(ARMS, FEATURE_DIM)
    models = {a: ArmModel.cold(FEATURE_DIM) for a in ARMS}
    for t in range(turns):
        turn = draw_turn(env, depth=1 + t % 12)
        arm = learner.decide(turn.x, models).arm
        i = ARMS.index(arm)
        observed = float(np.clip(turn.expected_quality[i] + env.normal(0, NOISE), 0, 1))
        models[arm] = learner.update(models[arm], turn.x, observed - lam * float(turn.cost[i]))
    thetas = np.array([models[a].theta() for a in ARMS])

    def pi(x: np.ndarray) -> np.ndarray:
        out = np.zeros(len(ARMS))
        out[int(np.argmax(thetas @ x))] = 1.0
        return out

    return pi


def fixed(arm: str) -> TargetPolicy:
    one_hot = np.eye(len(ARMS))[ARMS.index(arm)]
    return lambda x: one_hot


def uniform(x: np.ndarray) -> np.ndarray:
    return np.full(len(ARMS), 1.0 / len(ARMS))


def _phi(z: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def _cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2)))


def expected_observed_quality(q: np.ndarray, sigma: float = NOISE) -> np.ndarray:
    """E[clip(q + N(0, sigma^2), 0, 1)]: the mean of what the log records (clipping moves it off q near
    0 and 1), so the truth is the value of the same quantity the estimators see."""
    a, b = (0.0 - q) / sigma, (1.0 - q) / sigma
    return q * (_cdf(b) - _cdf(a)) + sigma * (_phi(a) - _phi(b)) + (1.0 - _cdf(b))


def true_value(target: TargetPolicy, lam: float, turns: int, seed: int) -> float:
    """The target's expected reward per turn on fresh turns of the same environment."""
    env = np.random.default_rng(seed)
    total = 0.0
    for t in range(turns):
        turn = draw_turn(env, depth=1 + t % 12)
        expected = expected_observed_quality(turn.expected_quality) - lam * turn.cost
        total += float(target(turn.x) @ expected)
    return total / turns


def targets(lam: float, seed: int, train_turns: int) -> dict[str, TargetPolicy]:
    return {
        "linucb-frozen": trained_greedy(train_turns, lam, seed + 50_000),
        "fixed:qwen2.5-72b": fixed("qwen2.5-72b"),
        "random": uniform,
    }


def cmd_ope(args: argparse.Namespace) -> int:
    console = Console(soft_wrap=True)
    if args.seeds < 1 or args.turns < 100:
        console.print("[red]--seeds must be >= 1 and --turns >= 100[/]")
        return 2
    rows: dict[str, dict[str, list[float]]] = {}
    with Progress(console=console) as progress:
        task = progress.add_task("seeds", total=args.seeds)
        for seed in range(args.seeds):
            steps = log_run(args.turns, args.lam, seed, args.epsilon)
            for name, target in targets(args.lam, seed, args.train_turns).items():
                truth = true_value(target, args.lam, args.truth_turns, seed + 90_000)
                result = evaluate(steps, target, len(ARMS), bootstrap=args.bootstrap, seed=seed)
                for est_name, est in (("ips", result.ips), ("snips", result.snips), ("dr", result.dr)):
                    row = rows.setdefault(f"{name} / {est_name}", {"covered": [], "abs_error": []})
                    row["covered"].append(float(est.covers(truth)))
                    row["abs_error"].append(abs(est.value - truth))
            progress.advance(task)
    console.print(
        f"OPE on the router simulator: {args.seeds} seeds, {args.turns} logged turns each "
        f"(epsilon-greedy, epsilon {args.epsilon}), lambda {args.lam}"
    )
    console.print(f"{'target / estimator':<32}{'95% CI covers truth':>22}{'mean |error|':>14}")
    report = {}
    for name, row in rows.items():
        coverage = float(np.mean(row["covered"]))
        error = float(np.mean(row["abs_error"]))
        report[name] = {"coverage": coverage, "mean_abs_error": error}
        console.print(f"{name:<32}{coverage:>22.2f}{error:>14.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
        console.print(f"results written to {args.out}")
    return 0


def add_ope_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "ope",
        help="off-policy estimators (IPS, SNIPS, DR) checked against the router simulator's true values",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seeds", type=int, default=20, help="independent logs (default 20)")
    p.add_argument("--turns", type=int, default=3000, help="logged turns per seed (default 3000)")
    p.add_argument("--epsilon", type=float, default=0.3, help="logging policy exploration (default 0.3)")
    p.add_argument(
        "--lam",
        type=float,
        default=50.0,
        help="cost weight lambda per USD, as MARS_JUDGE_LAMBDA_COST (default 50: a cent weighs half a quality point)",
    )
    p.add_argument("--train-turns", type=int, default=2000, help="turns to train the frozen LinUCB target")
    p.add_argument("--truth-turns", type=int, default=20000, help="fresh turns for each true value")
    p.add_argument("--bootstrap", type=int, default=300, help="bootstrap resamples (default 300)")
    p.add_argument("--out", help="write coverage and errors as JSON here")
    p.set_defaults(func=cmd_ope)
