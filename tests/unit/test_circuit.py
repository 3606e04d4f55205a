"""Circuit breaker transitions with a hand-driven clock."""

from __future__ import annotations

import pytest
from mars.domain.circuit import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_threshold_consecutive_failures_only() -> None:
    clock = Clock()
    cb = CircuitBreaker(failure_threshold=3, reset_after_s=10, clock=clock)
    cb.record_failure()
    cb.record_failure()
    cb.record_success()  # a success resets the streak
    cb.record_failure()
    cb.record_failure()
    assert cb.state == "closed" and cb.allow()
    cb.record_failure()
    assert cb.state == "open" and not cb.allow()


def test_half_open_lets_one_trial_through_and_closes_on_success() -> None:
    clock = Clock()
    cb = CircuitBreaker(failure_threshold=1, reset_after_s=10, clock=clock)
    cb.record_failure()
    clock.now = 9.9
    assert not cb.allow()
    clock.now = 10.0
    assert cb.state == "half_open"
    assert cb.allow() and not cb.allow()  # one trial at a time
    cb.record_success()
    assert cb.state == "closed" and cb.allow() and cb.allow()


def test_failed_trial_reopens_for_a_full_pause() -> None:
    clock = Clock()
    cb = CircuitBreaker(failure_threshold=2, reset_after_s=5, clock=clock)
    cb.record_failure()
    cb.record_failure()
    clock.now = 6
    assert cb.allow()
    cb.record_failure()
    assert cb.state == "open"
    clock.now = 10.9
    assert not cb.allow()
    clock.now = 11.0
    assert cb.allow()


def test_released_trial_frees_the_slot_without_reopening() -> None:
    """A trial that ends with no verdict (the caller's deadline, a cancelled caller) must not leave the
    circuit waiting for a verdict that never comes: the next call becomes the trial."""
    clock = Clock()
    cb = CircuitBreaker(failure_threshold=1, reset_after_s=5, clock=clock)
    cb.record_failure()
    clock.now = 5
    assert cb.allow() and not cb.allow()
    cb.release()
    assert cb.state == "half_open" and cb.allow()
    cb.record_success()
    assert cb.state == "closed"


def test_release_counts_nothing_and_keeps_the_streak() -> None:
    cb = CircuitBreaker(failure_threshold=2, reset_after_s=5, clock=Clock())
    cb.record_failure()
    cb.release()
    assert cb.state == "closed"
    cb.record_failure()  # the streak was not reset by the release: two failures in a row open it
    assert cb.state == "open"


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError):
        CircuitBreaker(reset_after_s=0)
