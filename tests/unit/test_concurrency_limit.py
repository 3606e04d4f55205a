"""The adaptive concurrency limit and its fair shares (mars.domain.concurrency): pure logic, a fake clock."""

from __future__ import annotations

import math
from typing import Any

import pytest
from mars.domain.concurrency import (
    AdaptiveLimit,
    FairAdmission,
    GradientLimit,
    GradientSettings,
    LimitSettings,
    ThroughputLimit,
    ThroughputSettings,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _windows(limit: AdaptiveLimit, ms: float, inflight: int, n: int = 1) -> None:
    for _ in range(n * limit.settings.window):
        limit.on_sample(ms, inflight)


def test_a_limit_that_holds_turns_back_at_no_load_latency_grows_by_one_per_window() -> None:
    limit = AdaptiveLimit(LimitSettings(initial=10, window=4), clock=Clock())
    for _ in range(3):
        _windows(limit, 40.0, inflight=limit.limit)
    assert limit.limit == 13
    _windows(limit, 40.0, inflight=limit.limit - 2)  # slots to spare: the limit held nothing back
    assert limit.limit == 13


def test_an_idle_pipeline_does_not_grow_the_limit() -> None:
    limit = AdaptiveLimit(LimitSettings(initial=10, window=4), clock=Clock())
    _windows(limit, 40.0, inflight=2, n=5)
    assert limit.limit == 10


def test_queueing_past_the_tolerance_shrinks_the_limit_down_to_its_floor() -> None:
    limit = AdaptiveLimit(
        LimitSettings(initial=20, min_limit=3, window=4, tolerance=2.0, backoff=0.5), Clock()
    )
    _windows(limit, 40.0, inflight=1)  # anchors no-load at 40 ms
    _windows(limit, 79.0, inflight=20)  # within 2x: grows
    assert limit.limit == 21
    _windows(limit, 81.0, inflight=20)
    assert limit.limit == 10
    _windows(limit, 500.0, inflight=20, n=5)
    assert limit.limit == 3


def test_between_grow_below_and_the_tolerance_the_limit_holds() -> None:
    limit = AdaptiveLimit(LimitSettings(initial=10, window=4, tolerance=2.5, grow_below=2.0), Clock())
    _windows(limit, 40.0, inflight=1)  # no-load 40 ms: grows below 80, holds to 100, shrinks past it
    _windows(limit, 70.0, inflight=10)
    assert limit.limit == 11
    _windows(limit, 90.0, inflight=11, n=4)  # in the band: neither up nor down, window after window
    assert limit.limit == 11
    _windows(limit, 110.0, inflight=11)
    assert limit.limit == 9  # past the tolerance: by 0.9 (11 * 0.9 = 9.9)
    # Without a band the same windows grow it: it climbs until it overshoots and is cut.
    plain = AdaptiveLimit(LimitSettings(initial=10, window=4, tolerance=2.5), Clock())
    _windows(plain, 40.0, inflight=1)
    for _ in range(4):
        _windows(plain, 90.0, inflight=plain.limit)
    assert plain.limit == 14


def test_the_further_past_the_tolerance_the_harder_the_limit_shrinks_at_most_by_half() -> None:
    limit = AdaptiveLimit(
        LimitSettings(initial=40, min_limit=1, window=4, tolerance=2.0, backoff=0.9), Clock()
    )
    _windows(limit, 40.0, inflight=1)  # no-load 40 ms: the tolerance ends at 80
    _windows(limit, 85.0, inflight=40)
    assert limit.limit == 36  # just past it: the backoff, 0.9
    _windows(limit, 120.0, inflight=36)
    assert limit.limit == 24  # 1.5x past it: by 80/120
    _windows(limit, 400.0, inflight=24)
    assert limit.limit == 12  # 5x past it: by half, no more


def test_one_fast_turn_does_not_set_the_anchor_a_window_median_does() -> None:
    limit = AdaptiveLimit(LimitSettings(initial=20, window=5), clock=Clock())
    for ms in (1.0, 50.0, 50.0, 50.0, 50.0):
        limit.on_sample(ms, 1)
    assert limit.noload_ms == 50.0
    _windows(limit, 90.0, inflight=20)
    assert limit.limit == 21  # 90 < 2 x 50: no backoff, as a 1 ms anchor would have caused


def test_the_anchor_is_forgotten_after_its_window() -> None:
    clock = Clock()
    limit = AdaptiveLimit(LimitSettings(initial=20, window=2, noload_window_s=10.0), clock)
    _windows(limit, 30.0, inflight=1)
    clock.now = 6.0
    _windows(limit, 100.0, inflight=1)
    assert limit.noload_ms == 30.0
    clock.now = 12.0
    assert limit.noload_ms == 100.0
    clock.now = 30.0
    assert limit.noload_ms == float("inf")


def test_a_turn_out_of_time_backs_off_at_once_and_bad_samples_are_ignored() -> None:
    limit = AdaptiveLimit(LimitSettings(initial=20, window=1, backoff=0.5), Clock())
    limit.on_drop()
    assert limit.limit == 10
    for bad in (float("nan"), float("inf"), -1.0):
        limit.on_sample(bad, 10)
    assert limit.limit == 10 and limit.noload_ms == float("inf")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(min_limit=0),
        dict(initial=1, min_limit=2),
        dict(tolerance=1.0),
        dict(backoff=1.0),
        dict(window=0),
        dict(grow_below=1.0),
        dict(tolerance=2.0, grow_below=2.5),
    ],
)
def test_settings_refuse_what_cannot_work(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LimitSettings(**kwargs)  # type: ignore[arg-type]


def _admission(limit: int, **kw: object) -> FairAdmission:
    return FairAdmission(AdaptiveLimit(LimitSettings(initial=limit, min_limit=1, window=1000)), **kw)  # type: ignore[arg-type]


def test_a_burst_fills_the_free_slots_and_the_next_turn_is_shed_with_a_retry_hint() -> None:
    jitter = iter([0.0, 0.5, 0.999])
    gate = _admission(4, retry_after_ms=250, jitter=lambda: next(jitter))
    assert all(gate.try_acquire("a") is None for _ in range(4))
    hints = [gate.try_acquire("a") for _ in range(3)]
    # Spread over 0.5x to 1.5x: a burst shed together does not come back together.
    assert [h.retry_after_ms for h in hints if h is not None] == [125, 250, 375]
    shed = hints[0]
    assert shed is not None
    assert "limit 4" in shed.message and gate.inflight == 4


def test_a_tenant_under_its_share_gets_in_past_a_full_limit_and_the_burster_does_not() -> None:
    gate = _admission(4)
    for _ in range(4):
        assert gate.try_acquire("burst") is None
    assert gate.try_acquire("quiet") is None  # its share of 4 among two tenants is 2
    assert gate.try_acquire("quiet") is None
    assert gate.try_acquire("quiet") is not None
    assert gate.try_acquire("burst") is not None
    # The burster gives slots back; while it is over its share and the limit is full, it stays out.
    gate.release("burst")
    assert gate.try_acquire("burst") is not None
    gate.release("burst")
    gate.release("burst")
    assert gate.try_acquire("burst") is None  # 4 in flight: 2 each, the burster at its share again


def test_weights_divide_the_limit() -> None:
    gate = _admission(6, weights={"gold": 2.0})
    for _ in range(6):
        assert gate.try_acquire("free") is None
    assert gate.share("gold") == 4
    assert [gate.try_acquire("gold") is None for _ in range(5)] == [True, True, True, True, False]


def test_releases_feed_the_limit_and_an_unheld_release_is_an_error() -> None:
    limit = AdaptiveLimit(LimitSettings(initial=4, min_limit=1, window=2, backoff=0.5))
    gate = FairAdmission(limit)
    for _ in range(4):
        gate.try_acquire("a")
    gate.release("a", pipeline_ms=40.0)
    gate.release("a", pipeline_ms=40.0)  # a full window with 4 in flight at start: grows
    assert gate.limit == 5
    gate.release("a", dropped=True)
    assert gate.limit == 2
    gate.release("a")  # no verdict: nothing learnt
    assert gate.limit == 2 and gate.inflight == 0
    with pytest.raises(ValueError):
        gate.release("a")


def test_tenant_weights_must_be_positive() -> None:
    with pytest.raises(ValueError, match="acme"):
        FairAdmission(AdaptiveLimit(), {"acme": 0.0, "ok": 1.0})


def test_a_stalled_pipeline_sheds_nothing_until_a_turn_finishes_again() -> None:
    clock = Clock()
    gate = FairAdmission(
        AdaptiveLimit(LimitSettings(initial=2, min_limit=1, window=1000)), stall_s=2.0, clock=clock
    )
    assert gate.try_acquire("a") is None and gate.try_acquire("a") is None
    clock.now = 1.9
    assert gate.try_acquire("a") is not None  # busy, finishing nothing for 1.9 s: still at the limit
    clock.now = 2.0
    assert gate.stalled()
    assert gate.try_acquire("a") is None  # nothing finished for 2 s: turns wait for the stage
    assert gate.inflight == 3
    gate.release("a", pipeline_ms=40.0)  # the stage is back
    assert not gate.stalled() and gate.try_acquire("a") is not None


def test_an_idle_pipeline_is_not_stalled_when_its_first_turn_arrives() -> None:
    clock = Clock()
    gate = FairAdmission(
        AdaptiveLimit(LimitSettings(initial=1, min_limit=1, window=1000)), stall_s=2.0, clock=clock
    )
    clock.now = 100.0  # idle for long: the first turn starts the clock
    assert gate.try_acquire("a") is None
    assert not gate.stalled() and gate.try_acquire("a") is not None


def test_unenforced_the_limit_counts_and_learns_and_sheds_nothing() -> None:
    gate = _admission(2)
    assert all(gate.try_acquire("a", enforce=False) is None for _ in range(5))
    assert gate.inflight == 5


def _bucket(limit: ThroughputLimit, clock: Clock, rate: float, turn_ms: float, inflight: int) -> None:
    """One bucket of answered turns at `rate` per second, each `turn_ms` in flight."""
    n = round(rate * limit.settings.bucket_s)
    for i in range(n):
        clock.now += limit.settings.bucket_s / n + (1e-9 if i == n - 1 else 0.0)  # the last one closes it
        limit.on_sample(turn_ms / 2, inflight, turn_ms)


def test_a_throughput_limit_below_its_capacity_grows_by_the_gain_and_settles_at_the_capacity() -> None:
    clock = Clock()
    limit = ThroughputLimit(ThroughputSettings(initial=2, gain=1.5, bucket_s=1.0), clock)
    _bucket(limit, clock, rate=8, turn_ms=100.0, inflight=1)  # not binding: the shortest time, no move
    assert limit.limit == 2 and limit.shortest_ms == 100.0
    seen = []
    for _ in range(12):
        # The pipeline answers limit / 0.1 s per second, up to its capacity of 40 per second.
        rate = min(limit.limit / 0.1, 40.0)
        _bucket(limit, clock, rate=rate, turn_ms=100.0, inflight=limit.limit)
        seen.append(limit.limit)
    assert seen[:2] == [3, 5]  # 1.5 x (limit / 0.1 s) x 0.1 s, rounded up
    # Then gain x capacity x shortest time, and it stays there.
    assert seen[2:] == [math.ceil(1.5 * 40 * 0.1)] * 10


def test_a_throughput_limit_that_holds_nothing_back_does_not_move() -> None:
    clock = Clock()
    limit = ThroughputLimit(ThroughputSettings(initial=16, bucket_s=1.0), clock)
    for _ in range(5):
        _bucket(limit, clock, rate=10, turn_ms=100.0, inflight=3)
    assert limit.limit == 16 and limit.best_rate == 0.0  # what an idle pipeline answers proves nothing


def test_a_throughput_limit_follows_a_capacity_that_drops_within_the_rate_window() -> None:
    clock = Clock()
    limit = ThroughputLimit(ThroughputSettings(initial=10, gain=1.5, bucket_s=1.0, rate_window_s=5.0), clock)
    _bucket(limit, clock, rate=5, turn_ms=100.0, inflight=1)
    for _ in range(3):
        _bucket(limit, clock, rate=40, turn_ms=150.0, inflight=limit.limit)
    assert limit.limit == 6
    for _ in range(6):  # a stage lost half its capacity: the best rate of the last 5 s falls to 20
        _bucket(limit, clock, rate=20, turn_ms=300.0, inflight=limit.limit)
    assert limit.limit == 3
    limit.on_drop()
    assert limit.limit == 3 and limit._limit == pytest.approx(2.7)  # 3 x 0.9, rounded up


def test_fair_admission_gives_a_throughput_limit_the_turns_whole_time() -> None:
    clock = Clock()
    limit = ThroughputLimit(ThroughputSettings(initial=2, min_limit=1, bucket_s=1.0), clock)
    gate = FairAdmission(limit, clock=clock)
    for _ in range(4):
        assert gate.try_acquire("a") is None
        clock.now += 0.1
        gate.release("a", pipeline_ms=30.0, turn_ms=120.0)
    clock.now += 1.0
    assert gate.try_acquire("a") is None
    gate.release("a", pipeline_ms=30.0, turn_ms=120.0)
    assert limit.shortest_ms == 120.0


@pytest.mark.parametrize(
    "bad", [dict(gain=0.9), dict(min_limit=0), dict(bucket_s=0.0), dict(backoff=1.0), dict(initial=300)]
)
def test_throughput_settings_refuse_nonsense(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ThroughputSettings(**bad)


def _gradient_window(limit: GradientLimit, ms: float, inflight: int) -> None:
    for _ in range(limit.settings.window):
        limit.on_sample(ms, inflight)


def test_a_gradient_limit_takes_a_sustained_level_without_a_queue_as_its_reference_and_does_not_shed_at_it() -> (
    None
):
    gradient = GradientLimit(GradientSettings(initial=16, window=4, long_windows=4))
    adaptive = AdaptiveLimit(LimitSettings(initial=16, window=4))
    for limit in (gradient, adaptive):
        for _ in range(4):
            limit.on_sample(50.0, 2)  # light load: the limit does not bind
        for _ in range(40 * 4):  # a moderate load, three times as slow (contention, not a queue)
            limit.on_sample(150.0, 4)
    assert gradient.long_ms is not None and math.isclose(gradient.long_ms, 150.0, rel_tol=0.01)
    assert gradient.limit == 16
    assert adaptive.limit == adaptive.settings.min_limit  # anchored on the 50 ms: it sheds at this load
    for _ in range(5):  # the same level with the limit binding: it grows
        _gradient_window(gradient, 150.0, inflight=16)
    assert gradient.limit > 16


def test_a_gradient_limit_shrinks_under_a_queue_and_its_reference_does_not_follow_the_queue_up() -> None:
    limit = GradientLimit(GradientSettings(initial=32, window=4, long_windows=4, tolerance=2.0))
    for _ in range(5):
        _gradient_window(limit, 100.0, inflight=4)
    before = limit.limit
    for _ in range(30):  # overload: the limit binds and turns take 5x the reference
        _gradient_window(limit, 500.0, inflight=limit.limit)
    assert limit.long_ms is not None and math.isclose(limit.long_ms, 100.0, rel_tol=0.01)
    assert limit.limit < before / 2
    assert limit.limit >= limit.settings.min_limit


def test_a_gradient_reference_far_above_the_load_decays_to_it_quickly_and_drops_back_off() -> None:
    limit = GradientLimit(GradientSettings(initial=8, window=4, long_windows=100))
    _gradient_window(limit, 400.0, inflight=1)
    for _ in range(30):  # the load fell: the reference must not stay at 400 for 100 windows
        _gradient_window(limit, 50.0, inflight=1)
    assert limit.long_ms is not None and limit.long_ms < 110.0
    limit.on_drop()
    assert limit.limit == int(8 * limit.settings.backoff)
    limit.on_sample(float("nan"), 8)
    limit.on_sample(-1.0, 8)
    assert limit.limit == int(8 * limit.settings.backoff)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tolerance": 1.0},
        {"min_limit": 5, "initial": 4},
        {"long_windows": 0},
        {"smoothing": 0.0},
        {"backoff": 1.0},
    ],
)
def test_gradient_settings_refuse_what_cannot_work(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        GradientSettings(**kwargs)  # type: ignore[arg-type]
