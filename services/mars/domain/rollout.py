"""Safe policy changes (issue 47): the canary's always-valid stopping rule and its guardrails.

A canary routes a share p of sessions (`in_canary`: a stable hash, so a session is never split) with a
candidate policy and the others with the live one. After every turn, `observe` adds the turn and `decide`
answers PROMOTE, ROLLBACK, CONTINUE or UNDECIDED with its evidence, valid whenever the caller looks.

The test. Turn t (Z_t = 1 on a canary turn) adds the augmented inverse-propensity term

    D_t = Z_t (R_t - m_c) / p - (1 - Z_t) (R_t - m_l) / (1 - p) + (m_c - m_l)

with m_c, m_l the arms' mean rewards before turn t. Since m_c, m_l are fixed before the turn,
E[D_t | past] = mu_c - mu_l whatever they are; they only take the arms' levels out of the variance
(Waudby-Smith et al. 2024, "Anytime-valid off-policy inference for contextual bandits"). On the running mean
of the D_t sits the two-sided normal-mixture confidence sequence (Robbins' mixture; Howard et al. 2021,
"Time-uniform, nonparametric, nonasymptotic confidence sequences") with the variance estimated from
the data (Waudby-Smith et al. 2021, "Time-uniform central limit theory and asymptotic confidence sequences"):

    mean_t ± sd_t * B(t) / t,    B(t) = sqrt((t + rho) * log((t + rho) / (rho * alpha^2)))

It holds at every t at once, so any stopping time is valid (asymptotically: the variance is estimated;
`tests/unit/test_rollout.py` measures the coverage). rho sets where the CS is tightest: at the turn count
where a difference of `expected_effect` (reward sd `reward_sd` per arm) would just be detected.
PROMOTE when the CS lies above 0 (and no guardrail's estimate is past its limit: the promotion waits),
ROLLBACK when below, UNDECIDED at `max_turns`, else CONTINUE; the chance
of ever promoting a candidate that is not better is at most alpha (about alpha/2: the boundary is symmetric).

Guardrails roll back at once and are checked first, each a CS of the same kind at `guardrail_alpha`, tight
at the end of the warm-up, so noise (heavy-tailed costs included) does not trip them:
- failure: CS on failure-rate(candidate) - failure-rate(live) lies above `max_failure_excess`;
- cost: CS on cost(candidate) - `max_cost_ratio` * cost(live) per turn lies above 0;
- utility: CS on the candidate's mean judge utility lies below `min_utility`.
Nothing is decided before each arm has `warmup_turns` turns. Sessions are treated as independent turns.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from functools import cached_property
from typing import Any


class Decision(StrEnum):
    CONTINUE = "continue"
    PROMOTE = "promote"
    ROLLBACK = "rollback"
    UNDECIDED = "undecided"


class Rule(StrEnum):
    """Which rule gave the decision (the evidence's `reason`)."""

    WARMUP = "warm-up"
    FAILURE_GUARDRAIL = "failure guardrail"
    COST_GUARDRAIL = "cost guardrail"
    UTILITY_GUARDRAIL = "utility guardrail"
    BETTER = "reward CS above 0"
    HELD = "reward CS above 0, held: a guardrail's estimate is past its limit"
    WORSE = "reward CS below 0"
    INCONCLUSIVE = "reward CS covers 0"
    CAP = "turn cap reached"


def mixture_k(alpha: float) -> float:
    """k with rho = t/k making B(t)/t smallest at t: the root of k = 2 log(1/alpha) + log(1 + k)."""
    k = 2 * math.log(1 / alpha)
    for _ in range(50):
        k = 2 * math.log(1 / alpha) + math.log1p(k)
    return k


def mixture_rho(tight_at: float, alpha: float) -> float:
    """The mixing parameter (in turns) that makes the CS tightest at `tight_at` turns."""
    return tight_at / mixture_k(alpha)


def mixture_boundary(t: int, rho: float, alpha: float) -> float:
    """B(t): the normal-mixture boundary on the standardised sum (sum / sd) at t turns."""
    return math.sqrt((t + rho) * math.log((t + rho) / (rho * alpha * alpha)))


@dataclass(frozen=True)
class RolloutConfig:
    #: Level of the reward test: the CS covers the true difference at all times with probability 1 - alpha.
    alpha: float = 0.05
    #: Share of sessions the candidate routes (p).
    canary_share: float = 0.5
    #: Total turns (both arms) after which an open test ends UNDECIDED.
    max_turns: int = 10_000
    #: Turns each arm needs before any decision, guardrails included.
    warmup_turns: int = 100
    #: Reward difference the test is tuned for, and a guess at the reward's sd per arm (they only place
    #: the CS's tightest point; the variance used is estimated from the data).
    expected_effect: float = 0.05
    reward_sd: float = 0.2
    #: Level of each guardrail's CS (a false guardrail rollback of a good candidate is at most this each).
    guardrail_alpha: float = 0.01
    #: Failure guardrail: the candidate's failure rate may exceed live's by this much.
    max_failure_excess: float = 0.02
    #: Cost guardrail: the candidate's cost per turn may be this many times live's.
    max_cost_ratio: float = 1.5
    #: Utility guardrail: the floor on the candidate's mean judge utility (None: off).
    min_utility: float | None = 0.4

    def __post_init__(self) -> None:
        problems = []
        if not 0 < self.alpha < 1 or not 0 < self.guardrail_alpha < 1:
            problems.append("alpha and guardrail_alpha must be in (0, 1)")
        if not 0 < self.canary_share < 1:
            problems.append("canary_share must be in (0, 1)")
        if self.warmup_turns < 2 or self.max_turns < 2 * self.warmup_turns:
            problems.append("warmup_turns must be >= 2 and max_turns >= 2 * warmup_turns")
        if self.expected_effect <= 0 or self.reward_sd <= 0:
            problems.append("expected_effect and reward_sd must be > 0")
        if self.max_failure_excess < 0 or self.max_cost_ratio <= 0:
            problems.append("max_failure_excess must be >= 0 and max_cost_ratio > 0")
        if problems:
            raise ValueError("invalid rollout config: " + "; ".join(problems))

    @cached_property
    def rho(self) -> float:
        """The reward test's mixing parameter: tightest where a difference of expected_effect is detected."""
        p = self.canary_share
        sd = self.reward_sd * math.sqrt(1 / p + 1 / (1 - p))  # sd of D_t
        k = mixture_k(self.alpha)
        tight_at = (sd / self.expected_effect) ** 2 * (1 + 1 / k) * math.log((1 + k) / self.alpha**2)
        return max(tight_at, 2 * self.warmup_turns) / k

    @cached_property
    def guardrail_rho(self) -> float:
        """Guardrails are tightest at the end of the warm-up: gross harm is stopped early."""
        tight_at = self.warmup_turns / min(self.canary_share, 1 - self.canary_share)
        return mixture_rho(tight_at, self.guardrail_alpha)


@dataclass(slots=True)
class RunningSum:
    """Running sum and sum of squares of one test's per-turn terms D_t."""

    t: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, d: float) -> None:
        self.t += 1
        self.total += d
        self.squares += d * d

    def mean(self) -> float:
        return self.total / self.t if self.t else 0.0

    def sd(self) -> float:
        if self.t < 2:
            return 0.0
        return math.sqrt(max(0.0, (self.squares - self.total * self.total / self.t) / (self.t - 1)))

    def bounds(self, rho: float, alpha: float) -> tuple[float, float]:
        """The CS at the current t (a point when t < 2: no variance yet; the warm-up never acts on it)."""
        if self.t == 0:
            return (-math.inf, math.inf)
        mean = self.total / self.t
        margin = self.sd() * mixture_boundary(self.t, rho, alpha) / self.t
        return (mean - margin, mean + margin)


@dataclass(slots=True)
class ArmStats:
    """Running sums for one arm (live or candidate): cheap to update per turn."""

    n: int = 0
    reward_sum: float = 0.0
    reward_squares: float = 0.0
    failures: int = 0
    cost_sum: float = 0.0
    cost_squares: float = 0.0
    #: Turns with a judge utility, and its sums.
    judged: int = 0
    utility_sum: float = 0.0
    utility_squares: float = 0.0

    def add(self, reward: float, cost: float, failed: bool, utility: float | None) -> None:
        self.n += 1
        self.reward_sum += reward
        self.reward_squares += reward * reward
        self.failures += int(failed)
        self.cost_sum += cost
        self.cost_squares += cost * cost
        if utility is not None:
            self.judged += 1
            self.utility_sum += utility
            self.utility_squares += utility * utility

    def mean_reward(self) -> float:
        return self.reward_sum / self.n if self.n else 0.0

    def mean_cost(self) -> float:
        return self.cost_sum / self.n if self.n else 0.0

    def failure_rate(self) -> float:
        return self.failures / self.n if self.n else 0.0

    def mean_utility(self) -> float | None:
        return self.utility_sum / self.judged if self.judged else None

    def utility_sequence(self) -> RunningSum:
        return RunningSum(self.judged, self.utility_sum, self.utility_squares)


def _aipw(canary: bool, value: float, m_c: float, m_l: float, p: float) -> float:
    """One turn's term D_t for the difference (candidate - live) of a quantity with predictable means."""
    if canary:
        return (value - m_c) / p + m_c - m_l
    return -(value - m_l) / (1 - p) + m_c - m_l


def _means(live: ArmStats, cand: ArmStats, m_l: float, m_c: float) -> tuple[float, float]:
    """The arms' means so far (candidate, live); an arm with no turn yet borrows the other's (any value
    fixed before the turn keeps D_t unbiased)."""
    if not cand.n:
        m_c = m_l if live.n else 0.0
    if not live.n:
        m_l = m_c
    return m_c, m_l


@dataclass(slots=True)
class RolloutState:
    """What a canary has seen: the arms' sums and the three tests' sums. `to_dict`/`from_dict` store it."""

    live: ArmStats = field(default_factory=ArmStats)
    candidate: ArmStats = field(default_factory=ArmStats)
    reward_test: RunningSum = field(default_factory=RunningSum)
    failure_test: RunningSum = field(default_factory=RunningSum)
    cost_test: RunningSum = field(default_factory=RunningSum)

    def observe(
        self,
        config: RolloutConfig,
        *,
        canary: bool,
        reward: float,
        cost: float,
        failed: bool = False,
        utility: float | None = None,
    ) -> None:
        """Add one turn: routed by the candidate (`canary`) or the live policy; cost in USD."""
        p, ratio, live, cand = config.canary_share, config.max_cost_ratio, self.live, self.candidate
        m_c, m_l = _means(live, cand, live.mean_reward(), cand.mean_reward())
        self.reward_test.add(_aipw(canary, reward, m_c, m_l, p))
        m_c, m_l = _means(live, cand, live.failure_rate(), cand.failure_rate())
        self.failure_test.add(_aipw(canary, float(failed), m_c, m_l, p))
        # Cost: candidate - ratio * live, so a live turn's value and the live mean are scaled by the ratio.
        m_c, m_l = _means(live, cand, ratio * live.mean_cost(), cand.mean_cost())
        self.cost_test.add(_aipw(canary, cost if canary else ratio * cost, m_c, m_l, p))
        (cand if canary else live).add(reward, cost, failed, utility)

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {f.name: asdict(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, float]]) -> RolloutState:
        return cls(
            live=ArmStats(**data["live"]),  # type: ignore[arg-type]
            candidate=ArmStats(**data["candidate"]),  # type: ignore[arg-type]
            reward_test=RunningSum(**data["reward_test"]),  # type: ignore[arg-type]
            failure_test=RunningSum(**data["failure_test"]),  # type: ignore[arg-type]
            cost_test=RunningSum(**data["cost_test"]),  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class Evidence:
    """A decision and what it rests on: an event on mars.control, a row, a dashboard point."""

    decision: Decision
    reason: Rule
    alpha: float
    turns_live: int
    turns_candidate: int
    #: The reward test: mean of D_t (candidate - live), its CS, and the standardised sum (sum / sd) with
    #: the boundary B(t) it is compared with (PROMOTE above +boundary, ROLLBACK below -boundary).
    mean_difference: float
    cs_low: float
    cs_high: float
    statistic: float
    boundary: float
    reward_live: float
    reward_candidate: float
    cost_live: float
    cost_candidate: float
    failure_rate_live: float
    failure_rate_candidate: float
    utility_live: float | None
    utility_candidate: float | None
    #: The guardrails' CS ends: failure-rate excess (low), cost - ratio * live cost (low), utility (high).
    failure_excess_low: float
    cost_excess_low: float
    utility_high: float | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (the CS ends are finite once both arms have turns)."""
        out = asdict(self)
        out["decision"], out["reason"] = self.decision.value, self.reason.value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Evidence:
        return cls(**{**data, "decision": Decision(data["decision"]), "reason": Rule(data["reason"])})


def _guardrail_estimates_past_limits(state: RolloutState, config: RolloutConfig) -> bool:
    """A promotion waits while a guardrail's point estimate is past its limit (its CS not yet clear of
    it): a candidate that wins on reward is not promoted on the way to a guardrail rollback. Waiting never
    makes a promotion wrong (the CS holds at any later time); it only delays it."""
    utility = state.candidate.mean_utility()
    return (
        state.failure_test.mean() > config.max_failure_excess
        or state.cost_test.mean() > 0
        or (config.min_utility is not None and utility is not None and utility < config.min_utility)
    )


def _rule(
    state: RolloutState,
    config: RolloutConfig,
    low: float,
    high: float,
    guards: tuple[float, float, float | None],
) -> Rule:
    failure_low, cost_low, utility_high = guards
    if min(state.live.n, state.candidate.n) >= config.warmup_turns:
        if failure_low > config.max_failure_excess:
            return Rule.FAILURE_GUARDRAIL
        if cost_low > 0:
            return Rule.COST_GUARDRAIL
        if config.min_utility is not None and utility_high is not None and utility_high < config.min_utility:
            return Rule.UTILITY_GUARDRAIL
        if low > 0:
            return Rule.HELD if _guardrail_estimates_past_limits(state, config) else Rule.BETTER
        if high < 0:
            return Rule.WORSE
        rule = Rule.INCONCLUSIVE
    else:
        rule = Rule.WARMUP
    return Rule.CAP if state.reward_test.t >= config.max_turns else rule


_DECISION = {
    Rule.WARMUP: Decision.CONTINUE,
    Rule.INCONCLUSIVE: Decision.CONTINUE,
    Rule.HELD: Decision.CONTINUE,
    Rule.FAILURE_GUARDRAIL: Decision.ROLLBACK,
    Rule.COST_GUARDRAIL: Decision.ROLLBACK,
    Rule.UTILITY_GUARDRAIL: Decision.ROLLBACK,
    Rule.WORSE: Decision.ROLLBACK,
    Rule.BETTER: Decision.PROMOTE,
    Rule.CAP: Decision.UNDECIDED,
}


def decide(state: RolloutState, config: RolloutConfig) -> Evidence:
    """The decision now, with its evidence. A caller stops the canary at the first decision that is not
    CONTINUE (looking again later is still valid, but the first one is the stopping rule's)."""
    test = state.reward_test
    low, high = test.bounds(config.rho, config.alpha)
    g_rho, g_alpha = config.guardrail_rho, config.guardrail_alpha
    failure_low = state.failure_test.bounds(g_rho, g_alpha)[0]
    cost_low = state.cost_test.bounds(g_rho, g_alpha)[0]
    utility = state.candidate.utility_sequence()
    utility_high = utility.bounds(g_rho, g_alpha)[1] if utility.t >= 2 else None
    rule = _rule(state, config, low, high, (failure_low, cost_low, utility_high))
    sd = test.sd()
    live, cand = state.live, state.candidate
    return Evidence(
        decision=_DECISION[rule],
        reason=rule,
        alpha=config.alpha,
        turns_live=live.n,
        turns_candidate=cand.n,
        mean_difference=test.mean(),
        cs_low=low,
        cs_high=high,
        statistic=test.total / sd if sd > 0 else 0.0,
        boundary=mixture_boundary(test.t, config.rho, config.alpha),
        reward_live=live.mean_reward(),
        reward_candidate=cand.mean_reward(),
        cost_live=live.mean_cost(),
        cost_candidate=cand.mean_cost(),
        failure_rate_live=live.failure_rate(),
        failure_rate_candidate=cand.failure_rate(),
        utility_live=live.mean_utility(),
        utility_candidate=cand.mean_utility(),
        failure_excess_low=failure_low,
        cost_excess_low=cost_low,
        utility_high=utility_high,
    )


def in_canary(tenant: str, session_id: str, share: float, salt: str = "") -> bool:
    """Is this session routed by the candidate? A stable hash (sha256, not Python's salted `hash`) of the
    tenant, session and salt (e.g. the candidate's version, so each canary draws its own sessions): the
    same answer for every turn of the session, in every process and replica."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"canary share must be in [0, 1], got {share}")
    digest = hashlib.sha256(f"{salt}\x1f{tenant}\x1f{session_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < share * 2**64
