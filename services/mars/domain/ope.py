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
    pi = np.array([target(np.asarray(s.x)) for s in known])  # (n, arms)
    return _evaluate_arrays(known, pi, n_arms, bootstrap, seed, ridge, skipped=len(steps) - len(known))


def _evaluate_arrays(
    known: Sequence[LoggedStep],
    pi: np.ndarray,
    n_arms: int,
    bootstrap: int,
    seed: int,
    ridge: float,
    skipped: int,
) -> OpeResult:
    """`evaluate` over steps with known propensities and the target's arm probabilities per step."""
    xs = np.array([s.x for s in known])
    arms = np.array([s.arm for s in known])
    r = np.array([s.reward for s in known])
    p = np.array([s.propensity for s in known])
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
    return OpeResult(ests[0], ests[1], ests[2], used=n, skipped=skipped)


@dataclass(frozen=True)
class LoggedComparison:
    """One logged turn with a candidate (shadow) policy's decision beside the live one: the live arm, its
    propensity and reward, and the arm the candidate chose for the same context (and its propensity)."""

    x: np.ndarray
    arm: int
    propensity: float
    reward: float
    candidate_arm: int
    candidate_propensity: float


@dataclass(frozen=True)
class LoggedEvaluation:
    #: The live policy's own value on these turns (mean logged reward, normal 95% interval).
    live: Estimate
    snips: Estimate
    dr: Estimate
    #: Turns in the log, and those left out for an unknown (zero) live propensity.
    turns: int
    skipped: int
    #: Turns where the candidate chose the live policy's arm (weight > 0).
    matched: int
    #: Effective sample size of the importance weights, (sum w)^2 / sum w^2: the turns the estimate rests on.
    ess: float


def effective_sample_size(w: np.ndarray) -> float:
    """Kish's effective sample size of weights w: n for equal weights, 1 when one weight dominates."""
    sq = float(np.sum(w * w))
    return float(np.sum(w)) ** 2 / sq if sq > 0 else 0.0


def evaluate_logged(
    rows: Sequence[LoggedComparison], n_arms: int, bootstrap: int = 500, seed: int = 0, ridge: float = 1.0
) -> LoggedEvaluation:
    """SNIPS and DR estimates (BCa 95% intervals) of a candidate policy that ran in shadow, from the live
    log, with the live policy's value on the same turns and the weights' effective sample size.

    The candidate's arm probabilities are taken as the one-hot of the arm it drew on that turn: for a
    stochastic candidate that is an unbiased sample of pi(.|x) (its draw is independent of the live one's
    given x), so it needs no closed-form propensity (Thompson has none). The weight of a turn is then
    1{candidate arm = live arm} / live propensity. Under a deterministic live policy (LinUCB, propensity 1)
    SNIPS is the mean reward of the matched turns, and DR adds the reward model's value of the candidate's
    arm on the others: unmatched arms' rewards are extrapolated, never observed (say so with the numbers)."""
    known = [r for r in rows if r.propensity > 0]
    if not known:
        raise ValueError("no logged turn has a known live propensity: nothing to estimate from")
    steps = [LoggedStep(r.x, r.arm, r.propensity, r.reward) for r in known]
    pi = np.zeros((len(known), n_arms))
    pi[np.arange(len(known)), [r.candidate_arm for r in known]] = 1.0
    result = _evaluate_arrays(steps, pi, n_arms, bootstrap, seed, ridge, skipped=len(rows) - len(known))
    w = np.array([(r.candidate_arm == r.arm) / r.propensity for r in known])
    rewards = np.array([r.reward for r in known])
    mean = float(rewards.mean())
    half = (
        NormalDist().inv_cdf(0.975) * float(rewards.std(ddof=1)) / np.sqrt(len(rewards))
        if len(rewards) > 1
        else 0.0
    )
    return LoggedEvaluation(
        live=Estimate(mean, mean - half, mean + half),
        snips=result.snips,
        dr=result.dr,
        turns=len(rows),
        skipped=result.skipped,
        matched=int(np.count_nonzero(w)),
        ess=effective_sample_size(w),
    )
