"""Routing policies behind one interface: LinUCB (the paper's) and the baselines it is compared with.

Every policy keeps one ArmModel (A, A^-1, b) per arm, updated by the same ridge-regression step, so
policies differ only in how they choose; `decide` also returns the chosen arm's probability
(propensity), logged on the routed event for off-policy evaluation.

Reproducibility: `decide` takes an optional generator for the turn's draws. The router passes
`turn_rng(seed, draw_key(user_id, seq))` when MARS_ROUTER_ROUTING_SEED is set, so a stochastic policy's choice is
a function of (seed, turn, matrices) alone, not of the process or of what other turns drew before it;
without one a policy draws from its own generator (seeded at construction, or from OS entropy).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mars.domain.linucb import ArmModel, LinUCBPolicy
from mars.v1 import events_pb2 as ev


@dataclass(frozen=True)
class Decision:
    arm: str
    scores: list[ev.ArmScore]
    propensity: float


class RoutingPolicy(Protocol):
    arms: tuple[str, ...]

    def decide(
        self,
        x: np.ndarray,
        models: Mapping[str, ArmModel],
        penalties: Mapping[str, float] | None = None,
        rng: np.random.Generator | None = None,
    ) -> Decision: ...

    def update(self, model: ArmModel, x: np.ndarray, reward: float) -> ArmModel: ...


def draw_key(user_id: str, seq: int) -> str:
    """What a turn's seeded draws are keyed on: the user and the per-user seq that ingress assigns. Not
    turn_id: ingress mints a fresh one for every re-driven turn, while a user's seq repeats in a re-drive
    (also under a renamed tenant, which is why the tenant is not part of the key)."""
    return f"{user_id}/{seq}"


def turn_rng(seed: int, key: str) -> np.random.Generator:
    """A generator for one turn's draws: a stable hash of (seed, key) (not Python's salted `hash`), so
    the same turn draws the same numbers in any process, after a restart and in any order of turns."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))


class _RidgeBase:
    """Shared ridge-regression state and update (Eq. 11) for the baseline policies."""

    def __init__(self, arms: Sequence[str], dim: int, ridge: float = 1.0) -> None:
        self._linucb = LinUCBPolicy(arms, dim, alpha=0.0, ridge=ridge)
        self.arms = self._linucb.arms
        self.dim = dim

    def update(self, model: ArmModel, x: np.ndarray, reward: float) -> ArmModel:
        return self._linucb.update(model, x, reward)

    def _means(self, x: np.ndarray, models: Mapping[str, ArmModel]) -> list[ev.ArmScore]:
        return self._linucb.score(x, models)


class LinUCBRouting(_RidgeBase):
    """Eq. 15: argmax of theta^T x + alpha sqrt(x^T A^-1 x); deterministic, propensity 1."""

    def __init__(self, arms: Sequence[str], dim: int, alpha: float = 0.8, ridge: float = 1.0) -> None:
        super().__init__(arms, dim, ridge)
        self._ucb = LinUCBPolicy(arms, dim, alpha=alpha, ridge=ridge)

    def decide(
        self,
        x: np.ndarray,
        models: Mapping[str, ArmModel],
        penalties: Mapping[str, float] | None = None,
        rng: np.random.Generator | None = None,
    ) -> Decision:
        arm, scores = self._ucb.choose(x, models)
        if penalties:
            # Session affinity: a switch costs `penalty` UCB points; ties keep the pool order.
            for sc in scores:
                sc.ucb -= penalties.get(sc.arm, 0.0)
            best = scores[0]
            for sc in scores[1:]:
                if sc.ucb > best.ucb:
                    best = sc
            arm = best.arm
        return Decision(arm, scores, 1.0)


class FixedArmRouting(_RidgeBase):
    def __init__(self, arms: Sequence[str], dim: int, arm: str) -> None:
        super().__init__(arms, dim)
        if arm not in self.arms:
            raise ValueError(f"unknown arm {arm!r}")
        self._arm = arm

    def decide(
        self,
        x: np.ndarray,
        models: Mapping[str, ArmModel],
        penalties: Mapping[str, float] | None = None,
        rng: np.random.Generator | None = None,
    ) -> Decision:
        return Decision(self._arm, self._means(x, models), 1.0)


class RandomRouting(_RidgeBase):
    def __init__(self, arms: Sequence[str], dim: int, seed: int = 0) -> None:
        super().__init__(arms, dim)
        self._rng = np.random.default_rng(seed)

    def decide(
        self,
        x: np.ndarray,
        models: Mapping[str, ArmModel],
        penalties: Mapping[str, float] | None = None,
        rng: np.random.Generator | None = None,
    ) -> Decision:
        arm = self.arms[int((rng if rng is not None else self._rng).integers(len(self.arms)))]
        return Decision(arm, self._means(x, models), 1.0 / len(self.arms))


class EpsilonGreedyRouting(_RidgeBase):
    def __init__(self, arms: Sequence[str], dim: int, epsilon: float = 0.1, seed: int = 0) -> None:
        super().__init__(arms, dim)
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError("epsilon must be in [0, 1]")
        self._eps = epsilon
        self._rng = np.random.default_rng(seed)

    def decide(
        self,
        x: np.ndarray,
        models: Mapping[str, ArmModel],
        penalties: Mapping[str, float] | None = None,
        rng: np.random.Generator | None = None,
    ) -> Decision:
        scores = self._means(x, models)
        greedy = max(range(len(scores)), key=lambda i: (scores[i].mean, -i))
        n = len(self.arms)
        draws = rng if rng is not None else self._rng
        if draws.random() < self._eps:
            pick = int(draws.integers(n))
        else:
            pick = greedy
        propensity = self._eps / n + (1.0 - self._eps if pick == greedy else 0.0)
        return Decision(self.arms[pick], scores, propensity)


class LinearThompsonRouting(_RidgeBase):
    """Samples theta_a ~ N(A^-1 b, v^2 A^-1) per arm and plays the best sample (Agrawal & Goyal, 2013)."""

    def __init__(
        self, arms: Sequence[str], dim: int, v: float = 0.3, ridge: float = 1.0, seed: int = 0
    ) -> None:
        super().__init__(arms, dim, ridge)
        self._v = v
        self._rng = np.random.default_rng(seed)

    def decide(
        self,
        x: np.ndarray,
        models: Mapping[str, ArmModel],
        penalties: Mapping[str, float] | None = None,
        rng: np.random.Generator | None = None,
    ) -> Decision:
        scores = self._means(x, models)
        draws = rng if rng is not None else self._rng
        samples = []
        for arm in self.arms:
            model = models.get(arm) or ArmModel.cold(self.dim, self._linucb.ridge)
            # Sampling x^T theta directly: mean x^T theta_hat, variance v^2 x^T A^-1 x.
            var = max(float(x @ model.A_inv @ x), 0.0)
            samples.append(
                float(model.theta() @ x) + self._v * math.sqrt(var) * float(draws.standard_normal())
            )
        pick = int(np.argmax(samples))
        # The exact propensity has no closed form; log it as unknown (0) rather than guess.
        return Decision(self.arms[pick], scores, 0.0)


def make_routing_policy(
    name: str,
    arms: Sequence[str],
    dim: int,
    alpha: float = 0.8,
    ridge: float = 1.0,
    epsilon: float = 0.1,
    thompson_v: float = 0.3,
    seed: int | None = None,
) -> RoutingPolicy:
    """By name: linucb (default), thompson, eps-greedy, random, fixed:<arm>, or query-linucb (LinUCB over
    query-embedding features instead of the session state: the no-QTM / MetaLLM-style baseline; the
    caller passes QUERY_FEATURE_DIM and builds x with `query_features`)."""
    rng_seed = seed if seed is not None else int(np.random.SeedSequence().entropy % (2**31))  # type: ignore[operator]
    if name in ("linucb", "query-linucb"):
        return LinUCBRouting(arms, dim, alpha=alpha, ridge=ridge)
    if name == "thompson":
        return LinearThompsonRouting(arms, dim, v=thompson_v, ridge=ridge, seed=rng_seed)
    if name == "eps-greedy":
        return EpsilonGreedyRouting(arms, dim, epsilon=epsilon, seed=rng_seed)
    if name == "random":
        return RandomRouting(arms, dim, seed=rng_seed)
    if name.startswith("fixed:"):
        return FixedArmRouting(arms, dim, name.split(":", 1)[1])
    raise ValueError(
        f"unknown routing policy {name!r}: linucb, query-linucb, thompson, eps-greedy, random or fixed:<arm>"
    )


def uses_query_features(name: str) -> bool:
    """Policies that route from the query embedding rather than the state features."""
    return name == "query-linucb"
