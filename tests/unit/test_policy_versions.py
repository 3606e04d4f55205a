"""Policy versions, the pure part (mars.domain.policy_versions) and the comparison estimator
(mars.domain.ope.evaluate_logged): validation, a stable content hash, the diff, the bandit a config builds."""

from __future__ import annotations

import numpy as np
import pytest
from mars.domain.bandits import EpsilonGreedyRouting, LinearThompsonRouting, LinUCBRouting
from mars.domain.features import FEATURE_DIM, QUERY_FEATURE_DIM
from mars.domain.linucb import ArmModel
from mars.domain.ope import LoggedComparison, effective_sample_size, evaluate_logged
from mars.domain.policy_versions import (
    PolicyConfig,
    PolicyConfigError,
    diff,
    from_router_settings,
)

ARMS = ("small", "large")


def test_defaults_are_filled_and_the_hash_ignores_key_order_and_spelt_out_defaults() -> None:
    a = PolicyConfig("linucb", ARMS)
    b = PolicyConfig.from_dict(
        {"arms": ["small", "large"], "params": {"ridge": 1.0, "alpha": 0.8}, "algorithm": "linucb"}
    )
    assert dict(a.params) == {"alpha": 0.8, "ridge": 1.0}
    assert a.canonical_json() == b.canonical_json()
    assert a.content_hash() == b.content_hash()
    # The hash is of the content: pinned, so a change of the canonical form is a visible decision.
    assert a.canonical_json() == (
        '{"algorithm":"linucb","arms":["small","large"],"feature_set":"state","lambda":null,'
        '"params":{"alpha":0.8,"ridge":1.0}}'
    )
    assert len(a.content_hash()) == 64
    assert PolicyConfig("linucb", ARMS, {"alpha": 0.5}).content_hash() != a.content_hash()
    # Arm order is part of the policy (ties go to the first arm): another order, another version.
    assert PolicyConfig("linucb", ("large", "small")).content_hash() != a.content_hash()
    assert PolicyConfig.from_dict(a.to_dict()) == a


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"algorithm": "ucb2"}, "unknown algorithm 'ucb2'"),
        ({"params": {"alpha": -1}}, r"alpha=-1 is outside \[0, 100\]"),
        ({"params": {"alpha": float("nan")}}, "alpha=nan is outside"),
        ({"params": {"epsilon": 0.1}}, r"linucb has no parameter \['epsilon'\]"),
        ({"params": {"alpha": "high"}}, "must be a number"),
        ({"params": {"alpha": True}}, "must be a number"),
        ({"algorithm": "epsilon_greedy", "params": {"epsilon": 1.5}}, r"epsilon=1.5 is outside \[0, 1\]"),
        ({"algorithm": "thompson", "params": {"v": 0}}, "v=0 is outside"),
        ({"arms": ()}, "non-empty"),
        ({"arms": ("a", "a")}, "repeat"),
        ({"feature_set": "pixels"}, "unknown feature set"),
        ({"lambda_cost": -0.1}, "lambda -0.1"),
    ],
)
def test_bad_configs_are_refused_with_the_reason(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"algorithm": "linucb", "arms": ARMS, **kwargs}
    with pytest.raises(PolicyConfigError, match=message):
        PolicyConfig(**args)  # type: ignore[arg-type]


def test_from_dict_refuses_unknown_fields_and_arms_outside_the_pool() -> None:
    with pytest.raises(PolicyConfigError, match="unknown config fields"):
        PolicyConfig.from_dict({"algorithm": "linucb", "arms": ["small"], "gamma": 1})
    with pytest.raises(PolicyConfigError, match="needs algorithm and arms"):
        PolicyConfig.from_dict({"algorithm": "linucb"})
    with pytest.raises(PolicyConfigError, match="arms must be a list"):
        PolicyConfig.from_dict({"algorithm": "linucb", "arms": "small"})
    config = PolicyConfig("linucb", ("small", "huge"))
    config.check_arms(["small", "huge", "large"])
    with pytest.raises(PolicyConfigError, match=r"arms \['huge'\] are not in the model pool"):
        config.check_arms(["small", "large"])


def test_diff_names_each_changed_field() -> None:
    old = PolicyConfig("linucb", ARMS, {"alpha": 0.8})
    new = PolicyConfig("linucb", (*ARMS, "medium"), {"alpha": 0.5}, lambda_cost=0.01)
    assert diff(old, new) == {
        "arms": (["small", "large"], ["small", "large", "medium"]),
        "lambda": (None, 0.01),
        "params.alpha": (0.8, 0.5),
    }
    assert diff(old, old) == {}
    other = diff(old, PolicyConfig("thompson", ARMS))
    assert other["algorithm"] == ("linucb", "thompson")
    assert other["params.alpha"] == (0.8, None) and other["params.v"] == (None, 0.3)


def test_config_builds_its_bandit_over_its_arms_and_features() -> None:
    ucb = PolicyConfig("linucb", ARMS, {"alpha": 2.0}).routing_policy()
    assert isinstance(ucb, LinUCBRouting) and ucb.arms == ARMS
    x = np.ones(FEATURE_DIM)
    models = {a: ArmModel.cold(FEATURE_DIM) for a in ARMS}
    decision = ucb.decide(x, models)
    # Cold arms tie; the bonus is alpha * sqrt(x^T x): the config's alpha, not the default's.
    assert decision.scores[0].bonus == pytest.approx(2.0 * np.sqrt(FEATURE_DIM))
    eps = PolicyConfig("epsilon_greedy", ARMS, {"epsilon": 1.0}).routing_policy(seed=3)
    assert isinstance(eps, EpsilonGreedyRouting)
    assert eps.decide(x, models).propensity == pytest.approx(0.5)  # always exploring: 1/n
    ts = PolicyConfig("thompson", ("large",), feature_set="query").routing_policy(seed=1)
    assert isinstance(ts, LinearThompsonRouting) and ts.arms == ("large",) and ts.dim == QUERY_FEATURE_DIM


def test_router_settings_map_to_the_default_config() -> None:
    config = from_router_settings("eps-greedy", ARMS, 0.8, 2.0, 0.2, 0.3)
    assert config is not None and config.algorithm == "epsilon_greedy"
    assert dict(config.params) == {"epsilon": 0.2, "ridge": 2.0}
    query = from_router_settings("query-linucb", ARMS, 0.8, 1.0, 0.1, 0.3)
    assert query is not None and query.feature_set == "query"
    assert from_router_settings("fixed:small", ARMS, 0.8, 1.0, 0.1, 0.3) is None
    assert from_router_settings("cascade", ARMS, 0.8, 1.0, 0.1, 0.3) is None


def test_effective_sample_size() -> None:
    assert effective_sample_size(np.ones(10)) == pytest.approx(10.0)
    assert effective_sample_size(np.array([1.0, 0.0, 0.0])) == pytest.approx(1.0)
    assert effective_sample_size(np.zeros(3)) == 0.0


def test_evaluate_logged_recovers_a_better_candidate_from_a_stochastic_log() -> None:
    """A uniform-random live policy over two arms where arm 1 pays 0.8 and arm 0 pays 0.2: a candidate
    that always plays arm 1 is worth 0.8, the live policy 0.5; SNIPS and DR say so within their intervals,
    and the ESS is about the matched half."""
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(400):
        x = np.array([1.0, rng.uniform()])
        arm = int(rng.integers(2))
        reward = (0.8 if arm == 1 else 0.2) + rng.normal(0, 0.05)
        rows.append(LoggedComparison(x, arm, 0.5, reward, 1, 1.0))
    result = evaluate_logged(rows, n_arms=2, bootstrap=200)
    assert result.turns == 400 and result.skipped == 0
    assert result.live.covers(0.5) and not result.live.covers(0.8)
    assert result.snips.covers(0.8) and result.dr.covers(0.8)
    assert result.snips.low > result.live.high  # the evidence separates them
    assert result.matched == sum(r.arm == 1 for r in rows)
    assert result.ess == pytest.approx(result.matched)  # equal weights 1/0.5 on the matched turns
    with pytest.raises(ValueError, match="no logged turn has a known live propensity"):
        evaluate_logged([LoggedComparison(np.ones(2), 0, 0.0, 1.0, 0, 1.0)], n_arms=2)


class _Rows:
    """A stand-in pool whose one query answers `rows` (the roles of a tenant), counting the reads."""

    def __init__(self, rows: list[tuple[object, ...]]) -> None:
        self.rows = rows

    def connection(self) -> _Rows:
        return self

    async def __aenter__(self) -> _Rows:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def execute(self, sql: str, params: tuple[object, ...]) -> _Rows:
        return self

    async def fetchall(self) -> list[tuple[object, ...]]:
        return self.rows


def test_roles_are_read_once_per_ttl_and_an_unusable_version_routes_by_default() -> None:
    import asyncio

    from mars_router.versions import PolicyVersions

    now = [100.0]
    v1 = ("live", "v1", "linucb", {"alpha": 0.5, "ridge": 1.0}, "state", None, ["small", "large"])
    rows = _Rows([v1])
    versions = PolicyVersions(rows, 1.0, ["small", "large"], clock=lambda: now[0])  # type: ignore[arg-type]

    async def scenario() -> None:
        first = await versions.resolve("acme")
        assert (first.live_version, first.shadow_version) == ("v1", None)
        assert first.live is not None and first.live.params["alpha"] == 0.5
        rows.rows = [v1, ("shadow", "v2", "thompson", {}, "state", 0.01, ["large"])]
        now[0] += 0.99
        assert (await versions.resolve("acme")).shadow_version is None  # cached: not read again
        assert versions.reads == 1
        now[0] += 0.02
        second = await versions.resolve("acme")
        assert (
            second.shadow_version == "v2" and second.shadow is not None and second.shadow.lambda_cost == 0.01
        )
        assert versions.reads == 2
        # A version naming an arm this replica's pool lacks is never routed by: the live is "default".
        rows.rows = [("live", "v3", "linucb", {}, "state", None, ["huge"])]
        versions.invalidate("acme")
        assert (await versions.resolve("acme")).live_version == "default"

    asyncio.run(scenario())
