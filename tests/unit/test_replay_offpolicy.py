"""`mars replay ope`: logged steps from traces, target policies, and estimates with a known answer."""

from __future__ import annotations

import numpy as np
import pytest
from mars.v1 import events_pb2 as ev
from mars_tools.replay.offpolicy import logged_steps, support, target_policy
from mars_tools.replay.traces import Trace

ARMS = ("small", "large")


def trace(
    turn: str,
    chosen: str,
    propensity: float,
    reward: float | None,
    answered_by: str | None = None,
    features: tuple[float, ...] = (1.0, 0.5),
    failed: bool = False,
) -> Trace:
    t = Trace(turn)
    t.events["routed"] = ev.Routed(
        features=list(features),
        scores=[ev.ArmScore(arm=a) for a in ARMS],
        chosen_arm=chosen,
        propensity=propensity,
    )
    if failed:
        t.events["generated"] = ev.Generated(status=ev.FAILED)
    if reward is not None:
        t.events["judged"] = ev.Judged(arm=answered_by or chosen, reward=reward)
    return t


def test_logged_steps_credit_only_the_chosen_arm_and_count_what_is_left_out() -> None:
    traces = [
        trace("t1", "small", 0.5, 0.8),
        trace("t2", "large", 0.5, 0.6, answered_by="small"),  # large failed, small answered: 0 for large
        trace("t3", "large", 0.5, None, failed=True),  # every arm failed: 0
        trace("t4", "small", 0.5, None),  # judgement not on the log yet
        trace("t5", "small", 0.5, 0.9, features=(1.0, 0.5, 0.1)),  # another feature map
        Trace("t6"),
    ]
    log = logged_steps(traces)
    assert log.arms == list(ARMS)
    assert [(s.arm, s.reward) for s in log.steps] == [(0, 0.8), (1, 0.0), (1, 0.0)]
    assert log.skipped == {"no judgement": 1, "other feature dimension": 1, "not routed": 1}


def test_ips_of_a_fixed_arm_on_a_uniform_log_is_twice_its_share_of_reward() -> None:
    rng = np.random.default_rng(0)
    traces = []
    for i in range(400):
        arm = ARMS[int(rng.integers(0, 2))]
        reward = 0.9 if arm == "large" else 0.3
        traces.append(trace(f"t{i}", arm, 0.5, reward, features=(1.0, float(rng.random()))))
    log = logged_steps(traces)
    target, steps = target_policy("fixed:large", log)
    from mars.domain.ope import evaluate

    result = evaluate(steps, target, len(log.arms), bootstrap=200)
    expected = sum(2.0 * s.reward for s in log.steps if s.arm == 1) / len(log.steps)
    assert result.ips.value == pytest.approx(expected)
    assert result.snips.value == pytest.approx(0.9)
    assert result.dr.low <= 0.9 <= result.dr.high
    assert support(steps, target) == pytest.approx(np.mean([s.arm == 1 for s in steps]))
    uniform, _ = target_policy("uniform", log)
    assert evaluate(steps, uniform, 2, bootstrap=50).snips.value == pytest.approx(log.mean_reward)
    greedy, held_out = target_policy("greedy-model", log)
    assert len(held_out) == 200 and held_out[0] is log.steps[200]
    # Large always earns more, so the model fitted on the first half always picks it.
    assert all(greedy(s.x)[1] == 1.0 for s in held_out)


def test_unknown_policies_and_arms_are_refused_with_the_known_names() -> None:
    log = logged_steps([trace("t1", "small", 1.0, 0.5)])
    with pytest.raises(ValueError, match="arms: small, large"):
        target_policy("fixed:medium", log)
    with pytest.raises(ValueError, match="known: fixed:<arm>, uniform, greedy-model"):
        target_policy("linucb", log)
    with pytest.raises(ValueError, match="at least 2"):
        target_policy("greedy-model", log)
