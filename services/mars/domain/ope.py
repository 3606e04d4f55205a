"""Off-policy evaluation of routing policies from the routed/judged log (logged propensities).

Each logged step holds the context x the router saw, the arm it played, that arm's probability under the
logging policy (`Routed.propensity`) and the reward. For a target policy with arm probabilities pi(a|x):

- IPS:   V = mean( pi(a_i|x_i) / p_i * r_i )
- SNIPS: V = sum( w_i r_i ) / sum( w_i ),  w_i = pi(a_i|x_i) / p_i  (self-normalised: lower variance)
- DR:    V = mean( sum_a pi(a|x_i) q(x_i, a) + w_i (r_i - q(x_i, a_i)) ), with q a per-arm ridge regression
         of the reward on x, cross-fitted on the other half of the log (the direct method corrected by
         IPS on its residuals)

with percentile-bootstrap 95% intervals. Steps with propensity 0 (unknown, e.g. Thompson sampling) carry
no information for IPS and are left out and counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

#: pi(. | x) over the arms, in the log's arm order.
TargetPolicy = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class LoggedStep:
    x: np.ndarray
    arm: int
    propensity: float
    reward: float


@dataclass(frozen=True)
class Estimate:
    value: float
    low: float
    high: float

    def covers(self, truth: float) -> bool:
        return self.low <= truth <= self.high


@dataclass(frozen=True)
class OpeResult:
    ips: Estimate
    snips: Estimate
    dr: Estimate
    #: Steps used, and steps left out for an unknown (zero) propensity.
    used: int
    skipped: int


def fit_reward_model(steps: Sequence[LoggedStep], n_arms: int, ridge: float = 1.0) -> np.ndarray:
    """theta[a] of a per-arm ridge regression r ~ x (the DR direct-method term)."""
    dim = len(steps[0].x)
    theta = np.zeros((n_arms, dim))
    for a in range(n_arms):
        xs = np.array([s.x for s in steps if s.arm == a]).reshape(-1, dim)
        rs = np.array([s.reward for s in steps if s.arm == a])
        theta[a] = np.linalg.solve(ridge * np.eye(dim) + xs.T @ xs, xs.T @ rs)
    return theta


def _point_estimates(
    w: np.ndarray, r: np.ndarray, q_logged: np.ndarray, q_target: np.ndarray
) -> tuple[float, float, float]:
    ips = float(np.mean(w * r))
    snips = float(np.sum(w * r) / np.sum(w)) if np.sum(w) > 0 else 0.0
    dr = float(np.mean(q_target + w * (r - q_logged)))
    return ips, snips, dr


def evaluate(
    steps: Sequence[LoggedStep],
    target: TargetPolicy,
    n_arms: int,
    bootstrap: int = 500,
    seed: int = 0,
    ridge: float = 1.0,
) -> OpeResult:
    """IPS, SNIPS and DR estimates of the target policy's value with 95% bootstrap intervals."""
    known = [s for s in steps if s.propensity > 0]
    if not known:
        raise ValueError("no logged step has a known propensity: nothing to estimate from")
    xs = np.array([s.x for s in known])
    arms = np.array([s.arm for s in known])
    r = np.array([s.reward for s in known])
    p = np.array([s.propensity for s in known])
    pi = np.array([target(x) for x in xs])  # (n, arms)
    w = pi[np.arange(len(known)), arms] / p
    # Cross-fitting: each half's reward model is fitted on the other half, so no step's own reward
    # shapes the model that corrects it (keeps DR's interval honest).
    half = len(known) // 2
    q_all = np.empty((len(known), n_arms))
    if half >= 1:
        first, second = known[:half], known[half:]
        q_all[:half] = xs[:half] @ fit_reward_model(second, n_arms, ridge).T
        q_all[half:] = xs[half:] @ fit_reward_model(first, n_arms, ridge).T
    else:
        q_all[:] = xs @ fit_reward_model(known, n_arms, ridge).T
    q_logged = q_all[np.arange(len(known)), arms]
    q_target = np.sum(pi * q_all, axis=1)
    point = _point_estimates(w, r, q_logged, q_target)
    rng = np.random.default_rng(seed)
    samples = np.empty((bootstrap, 3))
    n = len(known)
    for b in range(bootstrap):
        idx = rng.integers(0, n, n)
        samples[b] = _point_estimates(w[idx], r[idx], q_logged[idx], q_target[idx])
    lo, hi = np.percentile(samples, [2.5, 97.5], axis=0)
    ests = [Estimate(point[i], float(lo[i]), float(hi[i])) for i in range(3)]
    return OpeResult(ests[0], ests[1], ests[2], used=n, skipped=len(steps) - n)
