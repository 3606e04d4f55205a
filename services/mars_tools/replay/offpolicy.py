"""`mars replay ope --policy NAME`: what another routing policy would have earned on the logged traffic.

Every judged turn on the log is one logged step: the router's context features (`Routed.features`), the
arm it chose, that arm's logging probability (`Routed.propensity`) and the reward. A turn whose chosen arm
failed (dispatch fell back) counts with reward 0 for the chosen arm, as the router itself learns it.
Target policies:

- `fixed:<arm>`: always that arm;
- `uniform`: every arm of the pool alike;
- `greedy-model`: the arm a per-arm ridge reward model predicts best, fitted on the first half of the log
  and evaluated on the second half only (fitting and evaluating on the same turns would flatter it).

Estimates come from `mars.domain.ope` (IPS, SNIPS, DR with BCa bootstrap intervals). A deterministic
logging policy (plain LinUCB logs propensity 1) supports only targets that agree with it: the support
line says on how many steps the target's arm had a non-zero logging probability.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from mars.domain.ope import LoggedStep, OpeResult, TargetPolicy, evaluate, fit_reward_model
from mars.v1 import events_pb2 as ev
from rich.console import Console
from rich.table import Table

from mars_tools.replay.traces import Trace

POLICIES = ("fixed:<arm>", "uniform", "greedy-model")


@dataclass
class OpeLog:
    """The logged steps, the pool's arms (in first-seen order) and why other turns were left out."""

    steps: list[LoggedStep]
    arms: list[str]
    skipped: Counter[str] = field(default_factory=Counter)

    @property
    def mean_reward(self) -> float:
        return float(np.mean([s.reward for s in self.steps])) if self.steps else 0.0


def logged_steps(traces: Iterable[Trace]) -> OpeLog:
    """One step per turn with a routed and a judged event (or a failed generation), in log order."""
    arms: list[str] = []
    rows: list[tuple[list[float], str, float, float]] = []
    skipped: Counter[str] = Counter()
    for trace in traces:
        routed = trace.events.get("routed")
        if not isinstance(routed, ev.Routed):
            skipped["not routed"] += 1
            continue
        for score in routed.scores:
            if score.arm not in arms:
                arms.append(score.arm)
        if routed.chosen_arm not in arms:
            arms.append(routed.chosen_arm)
        judged = trace.events.get("judged")
        if isinstance(judged, ev.Judged):
            # The chosen arm earned the reward only if it answered; a fallback's reward is another arm's.
            reward = float(judged.reward) if judged.arm == routed.chosen_arm else 0.0
        elif trace.failed:
            reward = 0.0
        else:
            skipped["no judgement"] += 1
            continue
        rows.append((list(routed.features), routed.chosen_arm, float(routed.propensity), reward))
    dims = Counter(len(x) for x, *_ in rows)
    dim = dims.most_common(1)[0][0] if dims else 0
    steps = []
    for x, arm, propensity, reward in rows:
        if len(x) != dim or dim == 0:
            # Another routing policy's feature map (e.g. query-linucb) cannot share one reward model.
            skipped["other feature dimension"] += 1
            continue
        steps.append(LoggedStep(np.asarray(x, dtype=float), arms.index(arm), propensity, reward))
    return OpeLog(steps, arms, skipped)


def target_policy(name: str, log: OpeLog, ridge: float = 1.0) -> tuple[TargetPolicy, list[LoggedStep]]:
    """The target's arm probabilities and the steps to evaluate it on; ValueError for an unknown name."""
    k = len(log.arms)
    if name.startswith("fixed:"):
        arm = name.split(":", 1)[1]
        if arm not in log.arms:
            raise ValueError(f"arm {arm!r} is not on the log; arms: {', '.join(log.arms)}")
        one_hot = np.eye(k)[log.arms.index(arm)]
        return (lambda _x: one_hot), log.steps
    if name == "uniform":
        flat = np.full(k, 1.0 / k)
        return (lambda _x: flat), log.steps
    if name == "greedy-model":
        half = len(log.steps) // 2
        if half < 1:
            raise ValueError("greedy-model needs at least 2 logged steps")
        train = log.steps[:half]
        theta = fit_reward_model(
            np.array([s.x for s in train]),
            np.array([s.arm for s in train]),
            np.array([s.reward for s in train]),
            k,
            ridge,
        )

        def greedy(x: np.ndarray) -> np.ndarray:
            return np.eye(k)[int(np.argmax(theta @ x))]

        return greedy, log.steps[half:]
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")


def support(steps: list[LoggedStep], target: TargetPolicy) -> float:
    """Share of steps where the target puts weight on the logged arm with a known logging probability."""
    if not steps:
        return 0.0
    return float(np.mean([target(s.x)[s.arm] > 0 and s.propensity > 0 for s in steps]))


def cmd_ope(args: argparse.Namespace) -> int:
    from mars_tools.replay.readers import load_traces

    console = Console(soft_wrap=True)
    builder, rc = load_traces(args, console)
    if rc:
        return rc
    log = logged_steps(builder.traces.values())
    if not log.steps:
        console.print(f"[red]no judged, routed turns on the log ({dict(log.skipped)})[/]")
        return 1
    table = Table(
        title=f"Off-policy estimates on {len(log.steps)} logged turns (arms: {', '.join(log.arms)})"
    )
    for col in ("policy", "steps", "support", "IPS [95% CI]", "SNIPS [95% CI]", "DR [95% CI]"):
        table.add_column(col)
    report: dict[str, object] = {
        "logged_turns": len(log.steps),
        "logged_mean_reward": log.mean_reward,
        "skipped": dict(log.skipped),
        "arms": log.arms,
    }
    for name in args.policy:
        try:
            target, steps = target_policy(name, log)
            result: OpeResult = evaluate(
                steps, target, len(log.arms), bootstrap=args.resamples, seed=args.seed
            )
        except ValueError as exc:
            console.print(f"[red]{name}: {exc}[/]")
            return 2
        share = support(steps, target)
        cells = [f"{e.value:.4f} [{e.low:.4f}, {e.high:.4f}]" for e in (result.ips, result.snips, result.dr)]
        table.add_row(name, str(result.used), f"{share:.2f}", *cells)
        report[name] = {
            "steps": result.used,
            "skipped_unknown_propensity": result.skipped,
            "support": share,
            **{
                est: {"value": e.value, "low": e.low, "high": e.high}
                for est, e in (("ips", result.ips), ("snips", result.snips), ("dr", result.dr))
            },
        }
    console.print(table)
    console.print(
        f"logged policy's mean reward {log.mean_reward:.4f}; left out: {dict(log.skipped) or 'none'}. "
        "Low support means the log explored too little to say much about that policy."
    )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
        console.print(f"estimates written to {args.out}")
    return 0


def add_ope_parser(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    common: Callable[[argparse.ArgumentParser], None],
) -> None:
    p = sub.add_parser(
        "ope",
        help="off-policy value of another routing policy from the logged propensities (IPS, SNIPS, DR)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common(p)
    p.add_argument("--file", help="read this exported log file instead of the topics")
    p.add_argument(
        "--policy",
        nargs="+",
        required=True,
        help="target policies: fixed:<arm>, uniform, greedy-model (several at once)",
    )
    p.add_argument("--resamples", type=int, default=300, help="bootstrap resamples (default 300)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    p.add_argument("--out", help="write the estimates as JSON here")
    p.set_defaults(func=cmd_ope)
