import numpy as np
import pytest
from mars.bench.router_sim import policies, simulate
from mars.domain.bandits import (
    EpsilonGreedyRouting,
    FixedArmRouting,
    LinearThompsonRouting,
    LinUCBRouting,
    RandomRouting,
)
from mars.domain.linucb import ArmModel

ARMS = ["a", "b", "c"]
DIM = 3


def models() -> dict[str, ArmModel]:
    return {a: ArmModel.cold(DIM, 1.0) for a in ARMS}


def test_fixed_and_random_propensities() -> None:
    x = np.ones(DIM)
    assert FixedArmRouting(ARMS, DIM, "b").decide(x, models()).arm == "b"
    with pytest.raises(ValueError):
        FixedArmRouting(ARMS, DIM, "z")
    d = RandomRouting(ARMS, DIM, seed=1).decide(x, models())
    assert d.arm in ARMS and d.propensity == pytest.approx(1 / 3)


def test_epsilon_greedy_propensity_matches_its_distribution() -> None:
    m = models()
    policy = EpsilonGreedyRouting(ARMS, DIM, epsilon=0.3, seed=0)
    x = np.array([1.0, 0.0, 0.0])
    m["c"] = policy.update(m["c"], x, 1.0)  # c becomes the greedy arm
    picks = [policy.decide(x, m) for _ in range(4000)]
    share_c = sum(d.arm == "c" for d in picks) / len(picks)
    greedy_p = next(d.propensity for d in picks if d.arm == "c")
    assert greedy_p == pytest.approx(0.7 + 0.3 / 3)
    assert share_c == pytest.approx(greedy_p, abs=0.03)
    with pytest.raises(ValueError):
        EpsilonGreedyRouting(ARMS, DIM, epsilon=1.5)


def test_linucb_and_thompson_learn_the_better_arm() -> None:
    rng = np.random.default_rng(0)
    for policy in (LinUCBRouting(ARMS, DIM), LinearThompsonRouting(ARMS, DIM, v=0.2, seed=3)):
        m = models()
        for _ in range(300):
            x = np.abs(rng.normal(size=DIM))
            arm = policy.decide(x, m).arm
            reward = {"a": 0.2, "b": 0.8, "c": 0.5}[arm] + rng.normal(0, 0.05)
            m[arm] = policy.update(m[arm], x, reward)
        late = [policy.decide(np.abs(rng.normal(size=DIM)), m).arm for _ in range(50)]
        assert late.count("b") >= 45


def test_simulator_oracle_has_no_regret_and_learning_beats_random() -> None:
    make = policies()
    oracle = simulate(make["oracle"], 400, 0.5, seed=0)
    assert oracle.regret == 0.0
    linucb = simulate(make["linucb"], 400, 0.5, seed=0)
    random = simulate(make["random"], 400, 0.5, seed=0)
    assert linucb.last_quarter_regret < random.last_quarter_regret / 3
    assert sum(linucb.shares.values()) == pytest.approx(1.0)


def test_query_features_are_deterministic_scale_free_and_bias_only_when_empty() -> None:
    from mars.domain.features import QUERY_FEATURE_DIM, query_features

    e = np.random.default_rng(3).normal(size=384)
    x = query_features(e)
    assert x.shape == (QUERY_FEATURE_DIM,) and x[0] == 1.0
    np.testing.assert_allclose(x, query_features(5.0 * e))  # only the direction matters
    np.testing.assert_array_equal(x, query_features(list(e)))  # same projection every call
    assert query_features([]).tolist() == [1.0] + [0.0] * (QUERY_FEATURE_DIM - 1)
    # Johnson-Lindenstrauss: similar queries stay closer than unrelated ones.
    near = query_features(e + np.random.default_rng(4).normal(scale=0.1, size=384))
    far = query_features(np.random.default_rng(5).normal(size=384))
    assert np.linalg.norm(x[1:] - near[1:]) < np.linalg.norm(x[1:] - far[1:])


def test_state_features_beat_the_query_embedding_baseline() -> None:
    from mars.domain.bandits import make_routing_policy, uses_query_features

    assert uses_query_features("query-linucb") and not uses_query_features("linucb")
    make_routing_policy("query-linucb", ["a", "b"], 33)  # a known name
    make = policies()
    state = simulate(make["linucb"], 1500, 0.5, seed=1)
    query = simulate(make["query-linucb"], 1500, 0.5, seed=1, query=True)
    random = simulate(make["random"], 1500, 0.5, seed=1)
    # The query's wording carries the phase, so it learns; the view load is invisible to it, so it
    # stays behind the state-feature policy.
    assert random.reward < query.reward < state.reward
