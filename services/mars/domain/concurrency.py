"""Admission by an adaptive concurrency limit, with fair shares per tenant.

A pipeline that is offered more turns than it can answer queues them: every stage's backlog grows, each
admitted turn waits behind the ones before it, and callers wait out their deadline for an error. Shedding
the excess at the door keeps the admitted turns fast and answers the rest at once.

The limit follows the pipeline's real capacity from one signal, the time a turn spends in MARS (its
end-to-end time minus the model calls'): when it grows past `tolerance` times its no-load value, turns are
queueing somewhere and the limit shrinks (multiplicatively); while it stays near no-load and the limit is
what holds turns back, the limit grows (additively). This is AIMD on a latency target anchored to the
no-load time, as in TCP Vegas and Netflix's concurrency-limits (`VegasLimit`, `AIMDLimit`), shrinking by
how far past the tolerance a window went (`Gradient2Limit`). The anchor
is a windowed minimum of per-window medians, so one lucky fast turn does not set it and a sustained
overload cannot drag it up (the limit keeps the admitted turns near no-load, so the window keeps seeing
no-load medians).

Fairness (`FairAdmission`): within the limit a tenant may hold at most its share of the slots when the
limit is full (the shares of the tenants with turns in flight, by weight), as in concurrency-limits'
partitioned limiter: a burst of one tenant fills free slots, but once the limit is reached, a tenant under
its share still gets in and the one over its share is refused, so no tenant starves another.

A stall is not an overload: when turns are in flight and none has finished for `stall_s` (a stage is
restarting, a broker is electing), nothing is shed. Those turns will be answered when the stage is back,
within their deadline; shedding them would fail turns that a waiting caller gets answered. Overload is the
pipeline finishing turns at its capacity while more arrive, and that is what the limit sheds.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol


def _check_bounds(initial: int, min_limit: int, max_limit: int, backoff: float) -> None:
    """What every limit's settings need: 1 <= min_limit <= initial <= max_limit, and a backoff in (0, 1)."""
    if not 1 <= min_limit <= initial <= max_limit:
        raise ValueError("need 1 <= min_limit <= initial <= max_limit")
    if not 0.0 < backoff < 1.0:
        raise ValueError("backoff must be in (0, 1)")


def _backed_off(limit: float, min_limit: int, backoff: float) -> float:
    """A limit after a turn that ran out of time: `backoff` times it, never below `min_limit`."""
    return max(float(min_limit), limit * backoff)


@dataclass(frozen=True)
class LimitSettings:
    """The limiter's constants; the ingress reads them from its settings (MARS_ADMISSION_*)."""

    initial: int = 16
    min_limit: int = 2
    max_limit: int = 256
    #: A window's median pipeline time above tolerance x the no-load time means turns are queueing.
    tolerance: float = 2.0
    #: The limit grows only after a window whose median stayed below grow_below x the no-load time; between
    #: that and the tolerance it holds (a dead band, as Vegas's alpha and beta: a limit that grows until it
    #: overshoots and is cut oscillates, and its admitted turns' p99 is set by the overshoots). None: the
    #: tolerance (no band).
    grow_below: float | None = None
    #: The limit's factor after a queueing window or a turn that ran out of time.
    backoff: float = 0.9
    #: Completed turns per decision.
    window: int = 16
    #: How long a no-load measurement stays the anchor (two half-windows rotate, so between this and half).
    noload_window_s: float = 120.0

    def __post_init__(self) -> None:
        _check_bounds(self.initial, self.min_limit, self.max_limit, self.backoff)
        if self.tolerance <= 1.0:
            raise ValueError("tolerance must be above 1")
        if self.grow_below is not None and not 1.0 < self.grow_below <= self.tolerance:
            raise ValueError("grow_below must be above 1 and at most the tolerance")
        if self.window < 1 or self.noload_window_s <= 0:
            raise ValueError("window must be >= 1 and noload_window_s > 0")


class _WindowedMin:
    """The minimum over the last `span_s` seconds, kept in two rotating half-spans (O(1) memory)."""

    def __init__(self, span_s: float, clock: Callable[[], float]) -> None:
        self._half = span_s / 2
        self._clock = clock
        self._started = clock()
        self._current = math.inf
        self._previous = math.inf

    def add(self, value: float) -> None:
        self._rotate()
        self._current = min(self._current, value)

    def value(self) -> float:
        self._rotate()
        return min(self._current, self._previous)

    def _rotate(self) -> None:
        elapsed = self._clock() - self._started
        if elapsed < self._half:
            return
        # One half-span on: the current becomes the previous; two or more: both are stale.
        self._previous = self._current if elapsed < 2 * self._half else math.inf
        self._current = math.inf
        self._started = self._clock()


class AdaptiveLimit:
    """How many turns may be in the pipeline at once (see the module's docstring)."""

    def __init__(
        self, settings: LimitSettings | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings or LimitSettings()
        self._limit = float(self.settings.initial)
        self._noload = _WindowedMin(self.settings.noload_window_s, clock)
        self._samples: list[float] = []
        self._peak_inflight = 0

    @property
    def limit(self) -> int:
        return int(self._limit)

    @property
    def noload_ms(self) -> float:
        """The anchor (inf before the first full window)."""
        return self._noload.value()

    def on_sample(self, pipeline_ms: float, inflight: int, turn_ms: float | None = None) -> None:
        """A turn finished after `pipeline_ms` in MARS, with `inflight` turns in flight as it finished
        (`turn_ms`, its whole time, is not this limit's signal)."""
        if not math.isfinite(pipeline_ms) or pipeline_ms < 0:
            return
        self._samples.append(pipeline_ms)
        self._peak_inflight = max(self._peak_inflight, inflight)
        if len(self._samples) < self.settings.window:
            return
        median = statistics.median(self._samples)
        peak = self._peak_inflight
        self._samples.clear()
        self._peak_inflight = 0
        noload = self._noload.value()
        self._noload.add(median)
        s = self.settings
        if median > s.tolerance * min(noload, median):
            # Shrink by how far past the tolerance the window went (as Gradient2 does), by at least
            # `backoff` and at most half: a limit far too high comes down in one or two windows, not ten.
            factor = max(0.5, min(s.backoff, s.tolerance * noload / median))
            self._limit = max(float(s.min_limit), self._limit * factor)
        elif peak >= self._limit - 1 and median <= (s.grow_below or s.tolerance) * min(noload, median):
            # Only a limit that held turns back grows: an idle pipeline proves nothing about more.
            self._limit = min(float(s.max_limit), self._limit + 1.0)

    def on_drop(self) -> None:
        """A turn ran out of time in the pipeline: back off at once."""
        self._limit = _backed_off(self._limit, self.settings.min_limit, self.settings.backoff)


@dataclass(frozen=True)
class ThroughputSettings:
    """The constants of `ThroughputLimit` (MARS_ADMISSION_* at the ingress)."""

    initial: int = 16
    min_limit: int = 2
    max_limit: int = 256
    #: The limit is gain x (the best answer rate) x (the shortest turn time): the turns the pipeline holds
    #: while it answers at its best, and (gain - 1) of that more, queued, so that no stage waits for work.
    gain: float = 1.5
    #: Answer rates are measured over buckets this long; the best is the highest of the last rate_window_s.
    bucket_s: float = 2.0
    rate_window_s: float = 10.0
    #: The shortest turn time is the lowest bucket p25 of the last time_window_s.
    time_window_s: float = 120.0
    #: The limit's factor after a turn that ran out of time.
    backoff: float = 0.9

    def __post_init__(self) -> None:
        _check_bounds(self.initial, self.min_limit, self.max_limit, self.backoff)
        if self.gain < 1.0:
            raise ValueError("gain must be at least 1")
        if min(self.bucket_s, self.rate_window_s, self.time_window_s) <= 0:
            raise ValueError("bucket_s, rate_window_s and time_window_s must be above 0")


class ThroughputLimit:
    """A limit from the pipeline's capacity rather than from a latency target: gain x the bandwidth-delay
    product (as BBR sizes its window: the best delivery rate of the last seconds times the shortest round
    trip). Both filters move slowly (a maximum and a minimum over windows), so the limit settles where the
    pipeline answers at its best instead of climbing until it overshoots and being cut (AIMD's saw-tooth,
    whose overshoots set the admitted turns' p99). A turn's time here is its whole time in flight (the
    model call included: it holds its slot throughout).

    Only a bucket in which the limit held turns back moves the limit: a pipeline offered less than its
    capacity answers at the offered rate, which says nothing about what it could answer. While the limit
    binds and the pipeline keeps up, the rate follows the limit and the limit grows by up to `gain` per
    bucket; once the rate stops growing with it, the limit settles at gain x rate x shortest time."""

    def __init__(
        self, settings: ThroughputSettings | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings or ThroughputSettings()
        self._clock = clock
        self._limit = float(self.settings.initial)
        self._shortest = _WindowedMin(self.settings.time_window_s, clock)
        self._rates: list[tuple[float, float]] = []  # (bucket end, answers per second)
        self._bucket_start = clock()
        self._times: list[float] = []
        self._peak_inflight = 0

    @property
    def limit(self) -> int:
        # Rounded up: a target of 2.9 slots held at 2 would measure the rate of 2 and never grow.
        return math.ceil(self._limit - 1e-9)

    @property
    def best_rate(self) -> float:
        return max((r for _, r in self._rates), default=0.0)

    @property
    def shortest_ms(self) -> float:
        return self._shortest.value()

    def on_sample(self, pipeline_ms: float, inflight: int, turn_ms: float | None = None) -> None:
        """A turn was answered after `turn_ms` in flight (`pipeline_ms` of it in MARS), with `inflight`
        turns in flight as it finished."""
        spent = turn_ms if turn_ms is not None else pipeline_ms
        if not math.isfinite(spent) or spent < 0:
            return
        self._times.append(spent)
        self._peak_inflight = max(self._peak_inflight, inflight)
        now = self._clock()
        if now - self._bucket_start >= self.settings.bucket_s:
            self._close_bucket(now)

    def _close_bucket(self, now: float) -> None:
        s = self.settings
        rate = len(self._times) / (now - self._bucket_start)
        ordered = sorted(self._times)
        self._shortest.add(ordered[len(ordered) // 4])
        binding = self._peak_inflight >= self._limit - 1
        self._times.clear()
        self._peak_inflight = 0
        self._bucket_start = now
        if not binding:
            return
        self._rates = [(t, r) for t, r in self._rates if now - t < s.rate_window_s]
        self._rates.append((now, rate))
        target = s.gain * self.best_rate * self.shortest_ms / 1000.0
        self._limit = min(float(s.max_limit), max(float(s.min_limit), target))

    def on_drop(self) -> None:
        """A turn ran out of time in the pipeline: back off at once."""
        self._limit = _backed_off(self._limit, self.settings.min_limit, self.settings.backoff)


@dataclass(frozen=True)
class GradientSettings:
    """The constants of `GradientLimit` (MARS_INGRESS_ADMISSION_* at the ingress)."""

    initial: int = 16
    min_limit: int = 2
    max_limit: int = 256
    #: A window's median time in MARS above tolerance x the long-term time shrinks the limit.
    tolerance: float = 2.0
    #: Completed turns per decision.
    window: int = 16
    #: Windows the long-term time averages over (an exponential mean): the level it follows, slowly.
    long_windows: int = 30
    #: The share of each decision's new limit taken (the rest is the old one): a damped step.
    smoothing: float = 0.2
    #: The limit's factor after a turn that ran out of time.
    backoff: float = 0.9

    def __post_init__(self) -> None:
        _check_bounds(self.initial, self.min_limit, self.max_limit, self.backoff)
        if self.tolerance <= 1.0:
            raise ValueError("tolerance must be above 1")
        if self.window < 1 or self.long_windows < 1:
            raise ValueError("window and long_windows must be >= 1")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError("smoothing must be in (0, 1]")


class GradientLimit:
    """A latency limit anchored on the time turns take under the load of the last minute or so, not on the
    no-load time (Netflix concurrency-limits' Gradient2Limit). `AdaptiveLimit` compares each window with the
    fastest window of two minutes; where the stages share a few cores, turns at a moderate load already take
    twice that (CPU contention, not queueing), so it shed below capacity. Here the reference is an
    exponential mean, over `long_windows`, of the medians of the windows in which the limit did not bind
    (fewer than half its slots taken): the time turns take at the present load without a queue at the door.
    While the limit binds, a window above tolerance x the reference shrinks it by the ratio (at most by
    half), and any other grows it by a queue allowance (the square root of the limit), each step damped by
    `smoothing`. A reference far above the recent windows (the load fell) decays toward them quickly."""

    def __init__(self, settings: GradientSettings | None = None) -> None:
        self.settings = settings or GradientSettings()
        self._limit = float(self.settings.initial)
        self._long_ms: float | None = None
        self._samples: list[float] = []
        self._peak_inflight = 0

    @property
    def limit(self) -> int:
        return int(self._limit)

    @property
    def long_ms(self) -> float | None:
        """The reference time (None before the first window)."""
        return self._long_ms

    def on_sample(self, pipeline_ms: float, inflight: int, turn_ms: float | None = None) -> None:
        """A turn finished after `pipeline_ms` in MARS, with `inflight` turns in flight as it finished."""
        if not math.isfinite(pipeline_ms) or pipeline_ms < 0:
            return
        self._samples.append(pipeline_ms)
        self._peak_inflight = max(self._peak_inflight, inflight)
        if len(self._samples) < self.settings.window:
            return
        short = max(1e-3, statistics.median(self._samples))
        peak = self._peak_inflight
        self._samples.clear()
        self._peak_inflight = 0
        s = self.settings
        binding = peak >= self._limit / 2
        if self._long_ms is None or not binding:
            # The reference follows the windows the limit did not hold back only: under overload it stays
            # at the last level turns had without a queue at the door, so the admitted turns' time is held
            # within `tolerance` of it instead of creeping up with the queue.
            long = (
                short if self._long_ms is None else self._long_ms + (short - self._long_ms) / s.long_windows
            )
            if long > 2 * short:
                long = max(short, 0.9 * long)  # the load fell: do not hold the old level as the reference
            self._long_ms = long
        if not binding:
            return  # a limit with half its slots free says nothing about more or fewer
        gradient = max(0.5, min(1.0, s.tolerance * self._long_ms / short))
        target = self._limit * gradient + math.sqrt(self._limit)
        stepped = self._limit * (1 - s.smoothing) + target * s.smoothing
        self._limit = min(float(s.max_limit), max(float(s.min_limit), stepped))

    def on_drop(self) -> None:
        """A turn ran out of time in the pipeline: back off at once."""
        self._limit = _backed_off(self._limit, self.settings.min_limit, self.settings.backoff)


class ConcurrencyLimit(Protocol):
    """What `FairAdmission` needs of a limit (`AdaptiveLimit`, `ThroughputLimit`, `GradientLimit`)."""

    @property
    def limit(self) -> int: ...

    def on_sample(self, pipeline_ms: float, inflight: int, turn_ms: float | None = None) -> None: ...

    def on_drop(self) -> None: ...


@dataclass(frozen=True)
class Shed:
    """A refused turn: why, and when to try again."""

    message: str
    retry_after_ms: int


class FairAdmission:
    """Slots of a `ConcurrencyLimit`, shared fairly by tenant (see the module's docstring).

    `try_acquire` answers at once; every acquired slot must be released (`release`) exactly once."""

    def __init__(
        self,
        limit: ConcurrencyLimit,
        weights: Mapping[str, float] | None = None,
        retry_after_ms: int = 1000,
        stall_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        if stall_s <= 0:
            raise ValueError("stall_s must be above 0")
        self._limit = limit
        self._stall_s = stall_s
        self._clock = clock
        self._jitter = jitter
        #: When a turn last finished, or the pipeline last went from idle to busy.
        self._progress_at = clock()
        self._weights = dict(weights or {})
        bad = sorted(t for t, w in self._weights.items() if not (math.isfinite(w) and w > 0))
        if bad:
            raise ValueError(f"tenant weights must be positive numbers: {', '.join(bad)}")
        self._retry_after_ms = retry_after_ms
        self._inflight: dict[str, int] = {}
        self._total = 0

    @property
    def inflight(self) -> int:
        return self._total

    @property
    def limit(self) -> int:
        return self._limit.limit

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def share(self, tenant: str) -> int:
        """The slots `tenant` is sure of while the limit is full: its weight's part of the limit among the
        tenants with turns in flight (itself included), at least one."""
        active = set(self._inflight) | {tenant}
        total_weight = sum(self.weight(t) for t in active)
        return max(1, math.floor(self._limit.limit * self.weight(tenant) / total_weight))

    def retry_after_ms(self) -> int:
        """The wait a shed turn is told: the configured one spread over 0.5x to 1.5x, so that the turns of a
        burst, shed together, do not all come back at the same instant and meet a full limit again."""
        return round(self._retry_after_ms * (0.5 + self._jitter()))

    def stalled(self) -> bool:
        """Turns in flight and none finished for stall_s."""
        return self._total > 0 and self._clock() - self._progress_at >= self._stall_s

    def try_acquire(self, tenant: str, enforce: bool = True) -> Shed | None:
        """None when the turn may go in (its slot is taken), else why not. `enforce=False` takes the slot
        anyway: the limit learns and counts, and sheds nothing."""
        held = self._inflight.get(tenant, 0)
        if self._total == 0:
            self._progress_at = self._clock()
        elif (
            enforce and self._total >= self._limit.limit and held >= self.share(tenant) and not self.stalled()
        ):
            return Shed(
                f"MARS is at capacity ({self._total} turns in flight, limit {self._limit.limit}); "
                f"tenant {tenant!r} holds {held} (its share {self.share(tenant)})",
                self.retry_after_ms(),
            )
        self._inflight[tenant] = held + 1
        self._total += 1
        return None

    def release(
        self,
        tenant: str,
        pipeline_ms: float | None = None,
        dropped: bool = False,
        turn_ms: float | None = None,
    ) -> None:
        """Give back a slot; `pipeline_ms` is the turn's time in MARS when it was answered (`turn_ms` its
        whole time), `dropped` when it ran out of time (neither: it ended with no verdict on capacity, e.g.
        a refusal or a cancel)."""
        held = self._inflight.get(tenant, 0)
        if held <= 0:
            raise ValueError(f"tenant {tenant!r} holds no slot")
        inflight = self._total
        if held == 1:
            del self._inflight[tenant]
        else:
            self._inflight[tenant] = held - 1
        self._total -= 1
        if dropped or pipeline_ms is not None:
            self._progress_at = self._clock()
        if dropped:
            self._limit.on_drop()
        elif pipeline_ms is not None:
            self._limit.on_sample(pipeline_ms, inflight, turn_ms)
