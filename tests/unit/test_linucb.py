import math

import numpy as np
import pytest
from mars.domain.linucb import ArmModel, LinUCBPolicy

ARMS = ["small", "medium", "large"]


def test_cold_start_bonus_is_alpha_times_norm() -> None:
    pol = LinUCBPolicy(ARMS, dim=4, alpha=0.8, ridge=1.0)
    x = np.array([1.0, 0.0, 1.0, 1.0])
    scores = pol.score(x, pol.cold_models())
    assert [s.arm for s in scores] == ARMS
    for s in scores:
        assert s.mean == 0.0
        assert s.bonus == pytest.approx(0.8 * math.sqrt(3.0))
        assert s.ucb == pytest.approx(s.bonus)


def test_ties_go_to_first_arm() -> None:
    pol = LinUCBPolicy(ARMS, dim=3)
    arm, _ = pol.choose(np.ones(3), {})
    assert arm == "small"


def test_sherman_morrison_matches_exact_inverse() -> None:
    rng = np.random.default_rng(0)
    pol = LinUCBPolicy(ARMS, dim=6, refactor_every=10**9)  # never refactor: pure rank-1 updates
    model = ArmModel.cold(6, 1.0)
    for _ in range(500):
        model = pol.update(model, rng.random(6), float(rng.random()))
    np.testing.assert_allclose(model.A_inv, np.linalg.inv(model.A), rtol=1e-8, atol=1e-10)
    assert model.pulls == 500


def test_refactor_resets_counter_and_is_exact() -> None:
    pol = LinUCBPolicy(ARMS, dim=3, refactor_every=5)
    model = ArmModel.cold(3, 1.0)
    x = np.array([1.0, 0.5, 0.0])
    for i in range(1, 6):
        model = pol.update(model, x, 1.0)
        assert model.updates_since_refactor == i % 5
    np.testing.assert_allclose(model.A_inv, np.linalg.inv(model.A))


def test_update_returns_new_model_and_only_chosen_arm_changes() -> None:
    pol = LinUCBPolicy(ARMS, dim=3)
    models = pol.cold_models()
    before = {a: (m.A.copy(), m.b.copy()) for a, m in models.items()}
    x = np.array([1.0, 0.0, 1.0])
    old = models["medium"]
    models["medium"] = pol.update(old, x, 0.7)
    assert models["medium"] is not old
    np.testing.assert_array_equal(old.A, before["medium"][0])  # input not mutated
    np.testing.assert_allclose(models["medium"].A, np.eye(3) + np.outer(x, x))
    np.testing.assert_allclose(models["medium"].b, 0.7 * x)
    assert models["medium"].reward_sum == pytest.approx(0.7)
    for arm in ("small", "large"):
        np.testing.assert_array_equal(models[arm].A, before[arm][0])
        np.testing.assert_array_equal(models[arm].b, before[arm][1])
    scores = {s.arm: s for s in pol.score(x, models)}
    assert scores["medium"].bonus < scores["small"].bonus
    assert scores["medium"].mean > 0


def test_bytes_round_trip() -> None:
    pol = LinUCBPolicy(ARMS, dim=5)
    model = ArmModel.cold(5, 1.0)
    rng = np.random.default_rng(1)
    for _ in range(7):
        model = pol.update(model, rng.random(5), 0.3)
    blob = model.to_bytes()
    back = ArmModel.from_bytes(blob, 5, pulls=model.pulls, reward_sum=model.reward_sum)
    np.testing.assert_array_equal(back.A, model.A)
    np.testing.assert_array_equal(back.A_inv, model.A_inv)
    np.testing.assert_array_equal(back.b, model.b)
    assert back.updates_since_refactor == model.updates_since_refactor == 7
    with pytest.raises(ValueError):
        ArmModel.from_bytes(blob, 4)


def test_wrong_feature_shape_rejected() -> None:
    pol = LinUCBPolicy(ARMS, dim=3)
    with pytest.raises(ValueError):
        pol.score(np.ones(4), {})


def test_learns_better_arm_on_linear_problem() -> None:
    rng = np.random.default_rng(42)
    dim = 4
    thetas = {"small": np.array([0.2, 0.6, 0.0, 0.0]), "large": np.array([0.2, 0.0, 0.6, 0.0])}
    pol = LinUCBPolicy(list(thetas), dim=dim)
    models = pol.cold_models()
    late_correct = 0
    for t in range(600):
        # Context: bias plus one of two mutually exclusive "state" features.
        x = np.zeros(dim)
        x[0] = 1.0
        x[1 + int(rng.integers(2))] = 1.0
        arm, _ = pol.choose(x, models)
        best = max(thetas, key=lambda a: float(thetas[a] @ x))
        if t >= 400:
            late_correct += arm == best
        reward = float(thetas[arm] @ x + rng.normal(0, 0.05))
        models[arm] = pol.update(models[arm], x, reward)
    assert late_correct / 200 > 0.9
