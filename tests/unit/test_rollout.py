"""The canary's stopping rule and guardrails (mars.domain.rollout): coverage of the confidence sequence over
many simulated runs, decisions on clear cases, each guardrail on its own case and not on heavy-tailed costs,
and the stable canary hash across processes."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable

import pytest
from fresh_process import across_processes
from mars.domain.rollout import (
    Decision,
    Evidence,
    RolloutConfig,
    RolloutState,
    Rule,
    decide,
    in_canary,
)

Draw = Callable[[random.Random], float]


def _uniform(r: random.Random) -> float:
    return r.uniform(0.2, 1.0)  # mean 0.6, known exactly


def _lognormal_cost(r: random.Random) -> float:
    return 0.001 * r.lognormvariate(0.0, 2.0)  # heavy tail: a few turns cost 100x the median


def _pareto_cost(r: random.Random) -> float:
    return 0.001 * r.paretovariate(1.5)  # infinite variance


def _run(
    seed: int,
    config: RolloutConfig,
    *,
    effect: float = 0.0,
    failures: tuple[float, float] = (0.01, 0.01),
    costs: tuple[Draw, Draw] = (_lognormal_cost, _lognormal_cost),
    candidate_utility: float | None = None,
) -> tuple[Evidence, bool]:
    """One canary until its first decision; also whether a plain threshold on the mean costs ever tripped."""
    r = random.Random(seed)
    state = RolloutState()
    naive_cost_trip = False
    evidence = decide(state, config)
    for _ in range(config.max_turns):
        canary = r.random() < config.canary_share
        reward = _uniform(r) + (effect if canary else 0.0)
        utility = reward
        if canary and candidate_utility is not None:
            utility = candidate_utility + r.uniform(-0.3, 0.3)
        state.observe(
            config,
            canary=canary,
            reward=reward,
            cost=costs[canary](r),
            failed=r.random() < failures[canary],
            utility=utility,
        )
        live, cand = state.live, state.candidate
        if min(live.n, cand.n) >= config.warmup_turns:
            naive_cost_trip |= cand.mean_cost() > config.max_cost_ratio * live.mean_cost()
        evidence = decide(state, config)
        if evidence.decision is not Decision.CONTINUE:
            break
    return evidence, naive_cost_trip


@pytest.mark.parametrize("effect", [0.0, 0.03])
def test_the_confidence_sequence_covers_the_true_difference_at_all_times(effect: float) -> None:
    """Time-uniform: the share of runs whose CS ever misses the truth after the warm-up is at most alpha
    (300 runs of 1500 turns; binomial sd at 5% is 1.3 points, so the margin is 2.3 sd)."""
    config = RolloutConfig()
    runs, misses = 300, 0
    for seed in range(runs):
        r = random.Random(seed)
        state = RolloutState()
        for _ in range(1500):
            canary = r.random() < 0.5
            state.observe(config, canary=canary, reward=_uniform(r) + (effect if canary else 0.0), cost=0.0)
            if min(state.live.n, state.candidate.n) >= config.warmup_turns:
                low, high = state.reward_test.bounds(config.rho, config.alpha)
                if not low <= effect <= high:
                    misses += 1
                    break
    assert misses / runs <= config.alpha + 0.03


def test_a_clearly_better_candidate_is_promoted_and_a_worse_one_rolled_back() -> None:
    config = RolloutConfig()
    for seed in range(20):
        better, _ = _run(seed, config, effect=0.1)
        assert (better.decision, better.reason) == (Decision.PROMOTE, Rule.BETTER)
        assert better.cs_low > 0 and better.statistic > better.boundary
        assert better.turns_live >= config.warmup_turns and better.turns_candidate >= config.warmup_turns
        worse, _ = _run(seed, config, effect=-0.1)
        assert (worse.decision, worse.reason) == (Decision.ROLLBACK, Rule.WORSE)
        assert worse.cs_high < 0 and worse.statistic < -worse.boundary


def test_an_equal_candidate_mostly_stays_undecided_until_the_cap() -> None:
    config = RolloutConfig(max_turns=3000)
    outcomes = Counter(_run(seed, config)[0].decision for seed in range(60))
    assert outcomes[Decision.UNDECIDED] >= 54  # at most 10% decided (alpha 5%, 60 runs)
    assert outcomes[Decision.PROMOTE] <= 4


def test_the_failure_guardrail_fires_on_a_failing_candidate_and_not_within_the_allowed_excess() -> None:
    config = RolloutConfig(max_turns=3000)
    for seed in range(10):
        evidence, _ = _run(seed, config, effect=0.05, failures=(0.01, 0.15))
        assert (evidence.decision, evidence.reason) == (Decision.ROLLBACK, Rule.FAILURE_GUARDRAIL)
        assert evidence.failure_excess_low > config.max_failure_excess
    fired = [_run(seed, config, failures=(0.01, 0.02))[0].reason for seed in range(30)]
    assert fired.count(Rule.FAILURE_GUARDRAIL) <= 1


def test_the_cost_guardrail_fires_on_a_costly_candidate() -> None:
    config = RolloutConfig(max_turns=3000)

    def costly(r: random.Random) -> float:
        return 3 * 0.001 * r.lognormvariate(0.0, 0.5)

    def cheap(r: random.Random) -> float:
        return 0.001 * r.lognormvariate(0.0, 0.5)

    for seed in range(10):
        evidence, _ = _run(seed, config, effect=0.05, costs=(cheap, costly))
        assert (evidence.decision, evidence.reason) == (Decision.ROLLBACK, Rule.COST_GUARDRAIL)
        assert evidence.cost_excess_low > 0 and evidence.cost_candidate > 2 * evidence.cost_live


@pytest.mark.parametrize("cost", [_lognormal_cost, _pareto_cost])
def test_no_guardrail_fires_on_an_equal_candidate_with_heavy_tailed_costs(cost: Draw) -> None:
    """The same cost distribution on both arms: a plain threshold (mean cost above ratio x live's after the
    warm-up) trips in many runs, the time-uniform test in (almost) none."""
    config = RolloutConfig(max_turns=3000)
    runs = [_run(seed, config, costs=(cost, cost)) for seed in range(60)]
    reasons = Counter(evidence.reason for evidence, _ in runs)
    assert (
        reasons[Rule.COST_GUARDRAIL] + reasons[Rule.FAILURE_GUARDRAIL] + reasons[Rule.UTILITY_GUARDRAIL] <= 1
    )
    assert sum(naive for _, naive in runs) >= 6


def test_the_utility_guardrail_fires_below_the_floor_and_can_be_turned_off() -> None:
    config = RolloutConfig(max_turns=3000)
    for seed in range(10):
        evidence, _ = _run(seed, config, candidate_utility=0.3)
        assert (evidence.decision, evidence.reason) == (Decision.ROLLBACK, Rule.UTILITY_GUARDRAIL)
        assert evidence.utility_high is not None and evidence.utility_high < 0.4
    off = RolloutConfig(max_turns=3000, min_utility=None)
    assert _run(0, off, candidate_utility=0.3)[0].reason is not Rule.UTILITY_GUARDRAIL


def test_nothing_is_decided_during_the_warm_up_even_on_gross_harm() -> None:
    config = RolloutConfig(warmup_turns=200)
    state = RolloutState()
    for t in range(300):
        state.observe(
            config, canary=t % 2 == 0, reward=0.0 if t % 2 == 0 else 1.0, cost=0.0, failed=t % 2 == 0
        )
        assert decide(state, config).reason is Rule.WARMUP
    for t in range(300, 400):
        state.observe(
            config, canary=t % 2 == 0, reward=0.0 if t % 2 == 0 else 1.0, cost=0.0, failed=t % 2 == 0
        )
    assert decide(state, config).reason is Rule.FAILURE_GUARDRAIL


def test_in_canary_is_the_same_in_fresh_processes_and_takes_about_its_share() -> None:
    code = (
        "import json; from mars.domain.rollout import in_canary; "
        "print(json.dumps([in_canary('acme', f's-{i}', 0.3, salt='v2') for i in range(500)]))"
    )
    first, second = across_processes(code)
    assert first == second
    assert first == [in_canary("acme", f"s-{i}", 0.3, salt="v2") for i in range(500)]
    shares = [sum(in_canary("acme", f"s-{i}", share) for i in range(10_000)) / 10_000 for share in (0.1, 0.5)]
    assert abs(shares[0] - 0.1) < 0.015 and abs(shares[1] - 0.5) < 0.025
    # Another salt (candidate version) or tenant draws other sessions; 0 and 1 are none and all.
    other = [in_canary("acme", f"s-{i}", 0.3, salt="v3") for i in range(500)]
    assert other != first
    assert not any(in_canary("acme", f"s-{i}", 0.0) for i in range(200))
    assert all(in_canary("acme", f"s-{i}", 1.0) for i in range(200))
    with pytest.raises(ValueError, match="canary share"):
        in_canary("acme", "s", 1.5)


def test_evidence_and_state_round_trip_through_json() -> None:
    config = RolloutConfig()
    evidence, _ = _run(3, config, effect=0.1)
    row = json.loads(json.dumps(evidence.to_dict()))
    assert row["decision"] == "promote" and row["reason"] == "reward CS above 0"
    assert Evidence.from_dict(row) == evidence
    r = random.Random(5)
    state = RolloutState()
    for _ in range(500):
        state.observe(config, canary=r.random() < 0.5, reward=r.random(), cost=r.random(), utility=r.random())
    restored = RolloutState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert restored == state and decide(restored, config) == decide(state, config)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha": 1.0}, "alpha"),
        ({"canary_share": 0.0}, "canary_share"),
        ({"warmup_turns": 600, "max_turns": 1000}, "max_turns"),
        ({"max_cost_ratio": 0.0}, "max_cost_ratio"),
    ],
)
def test_a_bad_config_is_refused_with_a_clear_message(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**kwargs)  # type: ignore[arg-type]
