"""A circuit breaker per model endpoint: stop sending turns to an endpoint that keeps failing, so they
fall back at once instead of each waiting out its timeout, and probe it again after a pause.

closed --(failure_threshold consecutive failures)--> open --(reset_after_s)--> half-open
half-open lets one trial call through: success closes the circuit, failure opens it again.

Every call `allow` lets through must end in exactly one of `record_success`, `record_failure` or `release`
(the call ended with no verdict on the endpoint, e.g. the caller's own deadline cut it or the caller went
away): an unresolved half-open trial would keep the circuit from ever closing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

CircuitState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 5,
        reset_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1 or reset_after_s <= 0:
            raise ValueError("failure_threshold must be >= 1 and reset_after_s > 0")
        self.failure_threshold = failure_threshold
        self.reset_after_s = reset_after_s
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._trial_in_flight = False

    @property
    def state(self) -> CircuitState:
        if self._opened_at is None:
            return "closed"
        if self._clock() - self._opened_at >= self.reset_after_s:
            return "half_open"
        return "open"

    def allow(self) -> bool:
        """May a call go through now? In half-open, only one trial at a time."""
        state = self.state
        if state == "closed":
            return True
        if state == "half_open" and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        return False

    def record_success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._trial_in_flight = False

    def release(self) -> None:
        """The call ended with no verdict on the endpoint: nothing is counted, the failure streak stands,
        and a half-open trial's slot is freed so that the next call becomes the trial."""
        self._trial_in_flight = False

    def record_failure(self) -> None:
        self._failures += 1
        if self._trial_in_flight or self._failures >= self.failure_threshold:
            # A failed trial re-opens for another full pause; so does reaching the threshold.
            self._opened_at = self._clock()
        self._trial_in_flight = False
