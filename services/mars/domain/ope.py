"""Off-policy evaluation of routing policies from the routed/judged log (logged propensities).

Each logged step holds the context x the router saw, the arm it played, that arm's probability under the
logging policy (`Routed.propensity`) and the reward. For a target policy with arm probabilities pi(a|x):

- IPS:   V = mean( pi(a_i|x_i) / p_i * r_i )
- SNIPS: V = sum( w_i r_i ) / sum( w_i ),  w_i = pi(a_i|x_i) / p_i  (self-normalised: lower variance)
- DR:    V = mean( sum_a pi(a|x_i) q(x_i, a) + w_i (r_i - q(x_i, a_i)) ), with q a per-arm ridge regression
         of the reward on x, cross-fitted on the other half of the log (the direct method corrected by
         IPS on its residuals)

with bias-corrected and accelerated (BCa) bootstrap 95% intervals: importance weights make IPS-type
estimates skewed, and plain percentile intervals then run narrow (measured on the router simulator).
Steps with propensity 0 (unknown, e.g. Thompson sampling) carry no information for IPS and are left out
and counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

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


def fit_reward_model(
    xs: np.ndarray,
    arms: np.ndarray,
    r: np.ndarray,
    n_arms: int,
    ridge: float = 1.0,
    counts: np.ndarray | None = None,
) -> np.ndarray:
    """theta[a] of a per-arm ridge regression r ~ x (the DR direct-method term); `counts` weighs each step
    (a bootstrap resample as multiplicities)."""
    c = np.ones(len(r)) if counts is None else counts
    theta = np.zeros((n_arms, xs.shape[1]))
    for a in range(n_arms):
        sel = arms == a
        xa, ca = xs[sel], c[sel]
        gram = ridge * np.eye(xs.shape[1]) + (xa * ca[:, None]).T @ xa
        theta[a] = np.linalg.solve(gram, xa.T @ (ca * r[sel]))
    return theta


def cross_fitted_q(
    xs: np.ndarray,
    arms: np.ndarray,
    r: np.ndarray,
    n_arms: int,
    ridge: float = 1.0,
    counts: np.ndarray | None = None,
) -> np.ndarray:
    """q(x_i, a) for every step and arm, each half of the log predicted by a model fitted on the other half,
    so no step's own reward shapes the model that corrects it."""
    n = len(r)
    c = np.ones(n) if counts is None else counts
    half = n // 2
    if half < 1:
        return xs @ fit_reward_model(xs, arms, r, n_arms, ridge, c).T
    fold = np.arange(n) < half
    q = np.empty((n, n_arms))
    q[fold] = xs[fold] @ fit_reward_model(xs, arms, r, n_arms, ridge, np.where(fold, 0.0, c)).T
    q[~fold] = xs[~fold] @ fit_reward_model(xs, arms, r, n_arms, ridge, np.where(fold, c, 0.0)).T
    return q


def _point_estimates(
    w: np.ndarray, r: np.ndarray, q_logged: np.ndarray, q_target: np.ndarray, c: np.ndarray
) -> tuple[float, float, float]:
    """The three estimates over steps weighted by multiplicities `c` (all ones for the log itself)."""
    total = float(np.sum(c))
    ips = float(np.sum(c * w * r)) / total
    mass = float(np.sum(c * w))
    snips = float(np.sum(c * w * r)) / mass if mass > 0 else 0.0
    dr = float(np.sum(c * (q_target + w * (r - q_logged)))) / total
    return ips, snips, dr


def _jackknife(
    w: np.ndarray, r: np.ndarray, q_logged: np.ndarray, q_target: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Leave-one-out values of the three estimates (closed forms: each is a mean or a ratio of sums)."""
    n = len(w)
    z = w * r
    d = q_target + w * (r - q_logged)
    ips = (z.sum() - z) / (n - 1)
    denom = w.sum() - w
    snips = np.divide(z.sum() - z, denom, out=np.zeros(n), where=denom > 0)
    dr = (d.sum() - d) / (n - 1)
    return ips, snips, dr


def bca_interval(
    point: float, samples: np.ndarray, jackknife: np.ndarray, level: float = 0.95
) -> tuple[float, float]:
    """Efron's BCa interval from bootstrap `samples` and leave-one-out `jackknife` values: the percentile
    interval shifted for the bootstrap's median bias (z0) and its skewness (acceleration a)."""
    nd = NormalDist()
    b = len(samples)
    below = (np.sum(samples < point) + 0.5 * np.sum(samples == point)) / b
    z0 = nd.inv_cdf(min(max(below, 1.0 / (b + 1)), b / (b + 1.0)))
    dev = jackknife.mean() - jackknife
    spread = float(np.sum(dev**2))
    a = float(np.sum(dev**3)) / (6.0 * spread**1.5) if spread > 0 else 0.0
    alpha = (1.0 - level) / 2.0
    qs = []
    for tail in (alpha, 1.0 - alpha):
        z = z0 + nd.inv_cdf(tail)
        qs.append(nd.cdf(z0 + z / (1.0 - a * z)))
    lo, hi = np.percentile(samples, [100.0 * qs[0], 100.0 * qs[1]])
    return float(lo), float(hi)


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
    n = len(known)
    ones = np.ones(n)
    rows = np.arange(n)

    def estimates(counts: np.ndarray) -> tuple[float, float, float]:
        # The reward model is refitted on every resample: its estimation error is part of DR's spread.
        q = cross_fitted_q(xs, arms, r, n_arms, ridge, counts)
        return _point_estimates(w, r, q[rows, arms], np.sum(pi * q, axis=1), counts)

    q_all = cross_fitted_q(xs, arms, r, n_arms, ridge)
    q_logged = q_all[rows, arms]
    q_target = np.sum(pi * q_all, axis=1)
    point = _point_estimates(w, r, q_logged, q_target, ones)
    rng = np.random.default_rng(seed)
    samples = np.empty((bootstrap, 3))
    for b in range(bootstrap):
        samples[b] = estimates(np.bincount(rng.integers(0, n, n), minlength=n).astype(float))
    jack = _jackknife(w, r, q_logged, q_target) if n > 1 else (np.array(point[:1]),) * 3
    ests = [Estimate(point[i], *bca_interval(point[i], samples[:, i], jack[i])) for i in range(3)]
    return OpeResult(ests[0], ests[1], ests[2], used=n, skipped=len(steps) - n)
