"""User feedback end to end (paper appendix G.1): per tenant it replaces or blends with the judge reward,
late feedback moves the applied reward by the difference exactly once, and feedback for a turn that is
not the caller's is refused."""

from __future__ import annotations

import time

import grpc
import pytest
from conftest import FEEDBACK_MODES, ingress_stub, query, wait_for
from mars.v1 import services_pb2 as svc
from mars_stack import LocalStack

pytestmark = pytest.mark.integration

MODES = FEEDBACK_MODES


@pytest.fixture(scope="module")
def fb_stack(standin_stack: LocalStack) -> LocalStack:
    """The stand-in stack shared with test_eval and test_replay (conftest.standin_stack): the rewards, not the
    answers' words, are under test; the judge's feedback modes (MODES), blend weight (0.25) and fb-blend's
    lambda (0.5)."""
    return standin_stack


def _turn(stack: LocalStack, tenant: str, user: str) -> str:
    stub = ingress_stub(stack, tenant)
    reply = stub.SendTurn(
        svc.TurnRequest(tenant=tenant, user_id=user, session_id="s", text="Suggest a name for my cat."),
        timeout=120,
    )
    wait_for(
        lambda: bool(query(stack, "SELECT 1 FROM router_ledger WHERE turn_id = %s", (reply.turn_id,))),
        60,
        "the judged reward to reach the router",
    )
    return reply.turn_id


def _feedback(
    stack: LocalStack, tenant: str, user: str, turn_id: str, rating: float = 0.0, thumbs: int = 0
) -> None:
    stub = ingress_stub(stack, tenant)
    assert stub.SubmitFeedback(
        svc.FeedbackRequest(tenant=tenant, user_id=user, turn_id=turn_id, rating=rating, thumbs=thumbs),
        timeout=10,
    ).accepted


def _corrections(stack: LocalStack, turn_id: str) -> dict[str, float]:
    rows = query(stack, "SELECT turn_id, reward FROM router_ledger WHERE turn_id LIKE %s", (f"{turn_id}#%",))
    return {str(k): float(v) for k, v in rows}


def _judged(stack: LocalStack, turn_id: str) -> tuple[float, float, float, float]:
    ((utility, cost, lam, applied),) = query(
        stack,
        "SELECT judge_utility, cost_usd, lambda_cost, applied_reward FROM judge_rewards WHERE turn_id = %s",
        (turn_id,),
    )
    return float(utility), float(cost), float(lam), float(applied)


def test_late_feedback_replaces_the_reward_by_the_difference_once(fb_stack: LocalStack) -> None:
    turn_id = _turn(fb_stack, "fb-replace", "u1")
    utility, cost, lam, first = _judged(fb_stack, turn_id)
    assert lam == 0.002 and first == pytest.approx(utility - lam * cost)  # judged before any feedback
    ((ledger_reward,),) = query(fb_stack, "SELECT reward FROM router_ledger WHERE turn_id = %s", (turn_id,))
    assert float(ledger_reward) == pytest.approx(first)

    _feedback(fb_stack, "fb-replace", "u1", turn_id, rating=0.2)
    wait_for(lambda: len(_corrections(fb_stack, turn_id)) == 1, 30, "the first correction")
    delta1 = _corrections(fb_stack, turn_id)[f"{turn_id}#feedback-1"]
    assert delta1 == pytest.approx((0.2 - lam * cost) - first)

    _feedback(fb_stack, "fb-replace", "u1", turn_id, rating=0.2)  # the same rating again: nothing to move
    _feedback(fb_stack, "fb-replace", "u1", turn_id, thumbs=1)  # thumbs up = 1.0
    wait_for(lambda: len(_corrections(fb_stack, turn_id)) == 2, 30, "the second correction")
    assert _judged(fb_stack, turn_id)[3] == pytest.approx(1.0 - lam * cost)
    # A marker after them: a user's feedback is handled in order (one key, one partition), so once the
    # marker's correction is applied, a correction for the repeated rating would have been applied too.
    _feedback(fb_stack, "fb-replace", "u1", turn_id, rating=0.5)
    wait_for(lambda: f"{turn_id}#feedback-3" in _corrections(fb_stack, turn_id), 30, "the marker's correction")
    got = _corrections(fb_stack, turn_id)
    assert set(got) == {f"{turn_id}#feedback-{n}" for n in (1, 2, 3)}
    assert got[f"{turn_id}#feedback-2"] == pytest.approx(1.0 - 0.2)
    assert got[f"{turn_id}#feedback-3"] == pytest.approx(0.5 - 1.0)


def test_blend_mode_and_log_mode(fb_stack: LocalStack) -> None:
    turn_id = _turn(fb_stack, "fb-blend", "u2")
    utility, cost, lam, first = _judged(fb_stack, turn_id)
    assert lam == 0.5  # this tenant's own cost weight; others use the default
    _feedback(fb_stack, "fb-blend", "u2", turn_id, rating=1.0)
    wait_for(lambda: len(_corrections(fb_stack, turn_id)) == 1, 30, "the blend correction")
    target = 0.75 * utility + 0.25 * 1.0 - lam * cost
    assert _corrections(fb_stack, turn_id)[f"{turn_id}#feedback-1"] == pytest.approx(target - first)

    logged = _turn(fb_stack, "fb-log", "u3")  # a tenant without a mode: feedback is only recorded
    _feedback(fb_stack, "fb-log", "u3", logged, rating=0.0)
    wait_for(
        lambda: bool(query(fb_stack, "SELECT 1 FROM judge_feedback WHERE turn_id = %s", (logged,))),
        30,
        "feedback row",
    )
    # A marker behind it: the same user's next turn, whose reward reaches the router through the same
    # topic and partition after any correction the feedback could have caused (_turn waits for it).
    _turn(fb_stack, "fb-log", "u3")
    assert _corrections(fb_stack, logged) == {}


def test_feedback_for_someone_elses_turn_is_refused(fb_stack: LocalStack) -> None:
    turn_id = _turn(fb_stack, "fb-replace", "owner")
    stub = ingress_stub(fb_stack, "fb-replace")
    for req, code in [
        (
            svc.FeedbackRequest(tenant="other", user_id="owner", turn_id=turn_id, rating=0.5),
            grpc.StatusCode.PERMISSION_DENIED,
        ),
        (  # another user's turn reads as no turn: no oracle on which turn ids exist
            svc.FeedbackRequest(tenant="fb-replace", user_id="intruder", turn_id=turn_id, rating=0.5),
            grpc.StatusCode.NOT_FOUND,
        ),
        (
            svc.FeedbackRequest(tenant="fb-replace", user_id="owner", turn_id="no-such-turn", rating=0.5),
            grpc.StatusCode.NOT_FOUND,
        ),
        (
            svc.FeedbackRequest(tenant="fb-replace", user_id="owner", turn_id=turn_id, thumbs=3),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            stub.SubmitFeedback(req, timeout=10)
        assert info.value.code() == code


def test_the_demo_reads_each_turns_reward_from_its_judged_event(fb_stack: LocalStack) -> None:
    # `mars run` / `mars demo` show rewards from the judge's events, not from the router's own table.
    from mars_tools.demo import judged_rewards

    since_ms = int(time.time() * 1000) - 1000
    turn_id = _turn(fb_stack, "demo-rewards", "u1")  # returns once the router has applied the reward
    rewards = judged_rewards(
        fb_stack.env["MARS_KAFKA_BOOTSTRAP"],
        [turn_id, "no-such-turn"],
        since_ms,
        wait_s=5,
        kafka=fb_stack.kafka_options(),
    )
    ((ledger,),) = query(fb_stack, "SELECT reward FROM router_ledger WHERE turn_id = %s", (turn_id,))
    assert rewards == {turn_id: pytest.approx(float(ledger))}
