"""A connection's max-age GOAWAY spreads clients over the replicas; it must not cut a call short. Its grace
is the longest call the service allows: for the ingress a turn's timeout (before, the stop's 12 s failed every
turn over ~15 s with "UNAVAILABLE: max connection age" in the k8s e2e rolling updates)."""

from __future__ import annotations

from mars.runtime import STOP_GRACE_S, connection_age_grace_s
from mars_ingress.settings import IngressSettings
from mars_router.settings import RouterSettings


def test_the_ingress_lets_a_turn_run_its_whole_timeout_after_a_goaway() -> None:
    settings = IngressSettings(turn_timeout_s=60.0)
    assert connection_age_grace_s(settings) >= 60.0
    assert connection_age_grace_s(IngressSettings(turn_timeout_s=1.0)) == STOP_GRACE_S


def test_a_stage_service_keeps_the_stop_grace() -> None:
    assert connection_age_grace_s(RouterSettings()) == STOP_GRACE_S
