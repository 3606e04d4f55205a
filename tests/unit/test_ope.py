"""Off-policy estimators on data with a known answer, and on the router simulator."""

from __future__ import annotations

import numpy as np
import pytest
from mars.domain import ope
from mars.domain.ope import LoggedStep, evaluate


def _log(n: int, seed: int) -> tuple[list[LoggedStep], np.ndarray]:
    """Uniform-random logging over 3 arms; reward = theta[a] . x + noise."""
    rng = np.random.default_rng(seed)
    theta = np.array([[0.2, 0.5, 0.1], [0.6, 0.1, 0.0], [0.3, 0.3, 0.3]])
    steps = []
    for _ in range(n):
        x = np.concatenate([[1.0], rng.uniform(0, 1, 2)])
        a = int(rng.integers(3))
        steps.append(LoggedStep(x, a, 1 / 3, float(theta[a] @ x + rng.normal(0, 0.1))))
    return steps, theta


def test_estimators_recover_a_fixed_arm_value() -> None:
    steps, theta = _log(3000, 0)
    truth = float(theta[1] @ np.array([1.0, 0.5, 0.5]))  # E[x] = (1, .5, .5)
    result = evaluate(steps, lambda x: np.array([0.0, 1.0, 0.0]), 3, bootstrap=300)
    for est in (result.ips, result.snips, result.dr):
        assert est.low <= est.value <= est.high
        assert est.covers(truth) and abs(est.value - truth) < 0.05
    assert result.dr.high - result.dr.low < result.ips.high - result.ips.low  # DR has lower variance
    assert (result.used, result.skipped) == (3000, 0)


def test_uniform_target_on_uniform_log_is_the_mean_reward() -> None:
    steps, _ = _log(500, 1)
    result = evaluate(steps, lambda x: np.full(3, 1 / 3), 3, bootstrap=50)
    assert result.ips.value == pytest.approx(np.mean([s.reward for s in steps]))


def test_unknown_propensities_are_skipped_and_counted() -> None:
    steps, _ = _log(200, 2)
    steps += [LoggedStep(np.ones(3), 0, 0.0, 1.0)] * 5
    assert evaluate(steps, lambda x: np.full(3, 1 / 3), 3, bootstrap=20).skipped == 5
    with pytest.raises(ValueError, match="no logged step has a known propensity"):
        evaluate([LoggedStep(np.ones(3), 0, 0.0, 1.0)], lambda x: np.full(3, 1 / 3), 3)


def test_simulator_log_estimates_match_the_true_value() -> None:
    from mars_tools.bench.ope import fixed, log_run, true_value

    steps = log_run(3000, 0.5, seed=3, epsilon=0.3)
    assert all(0 < s.propensity <= 1 for s in steps)
    target = fixed("qwen2.5-72b")
    truth = true_value(target, 0.5, 10_000, seed=99)
    result = evaluate(steps, target, 4, bootstrap=200)
    assert abs(result.dr.value - truth) < 0.03 and abs(result.snips.value - truth) < 0.03


def test_bca_matches_percentile_for_symmetric_data_and_shifts_right_for_skewed_means() -> None:
    rng = np.random.default_rng(3)

    def intervals(data: np.ndarray) -> tuple[tuple[float, float], tuple[float, float]]:
        n = len(data)
        boot = np.array([data[rng.integers(0, n, n)].mean() for _ in range(2000)])
        jack = (data.sum() - data) / (n - 1)
        pct = tuple(float(v) for v in np.percentile(boot, [2.5, 97.5]))
        return pct, ope.bca_interval(float(data.mean()), boot, jack)  # type: ignore[return-value]

    pct, bca = intervals(rng.normal(0.0, 1.0, 400))
    assert abs(bca[0] - pct[0]) < 0.02 and abs(bca[1] - pct[1]) < 0.02
    # A right-skewed sample (importance-weighted rewards look like this): BCa moves both ends up.
    pct, bca = intervals(rng.exponential(1.0, 60) ** 2)
    assert bca[0] > pct[0] and bca[1] > pct[1]
    assert bca[0] < bca[1]
