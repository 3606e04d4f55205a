"""The ingress's load shedding: each turn takes a slot of the adaptive concurrency limit
(mars.domain.concurrency) once its key, scope and fields pass and before its budgets and quotas are read or
charged, and gives it back with what the turn taught about capacity. A turn beyond the limit gets
RESOURCE_EXHAUSTED at once, with `retry-after-ms`, instead of queueing in the pipeline until its deadline."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
from mars import metrics
from mars.domain.concurrency import (
    AdaptiveLimit,
    ConcurrencyLimit,
    FairAdmission,
    GradientLimit,
    GradientSettings,
    LimitSettings,
    ThroughputLimit,
    ThroughputSettings,
)

from mars_ingress.admission import TurnFailed
from mars_ingress.settings import IngressSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slot:
    """A turn's place within the limit: the tenant it counts for."""

    tenant: str


def _limit(settings: IngressSettings) -> ConcurrencyLimit:
    """The limit MARS_INGRESS_ADMISSION_ALGORITHM names, from its MARS_ADMISSION_* settings."""
    bounds = {
        "initial": settings.admission_initial_limit,
        "min_limit": settings.admission_min_limit,
        "max_limit": settings.admission_max_limit,
    }
    if settings.admission_algorithm == "throughput":
        return ThroughputLimit(ThroughputSettings(**bounds, gain=settings.admission_gain))
    if settings.admission_algorithm == "gradient":
        return GradientLimit(
            GradientSettings(
                **bounds, tolerance=settings.admission_tolerance, window=settings.admission_window
            )
        )
    return AdaptiveLimit(
        LimitSettings(
            **bounds,
            tolerance=settings.admission_tolerance,
            grow_below=settings.admission_grow_below,
            window=settings.admission_window,
        )
    )


class Capacity:
    def __init__(self, settings: IngressSettings) -> None:
        self.enabled = settings.admission_limit
        try:
            self.gate = FairAdmission(
                _limit(settings),
                settings.admission_tenant_weights,
                settings.admission_retry_after_ms,
                settings.admission_stall_s,
            )
        except ValueError as exc:
            raise ValueError(f"MARS_ADMISSION_* settings: {exc}") from None
        # Reported with the limit off too: the turns in flight, and the limit it would hold.
        metrics.watch_admission(self.gate)

    def enter(self, tenant: str, label: str) -> Slot:
        """The turn's slot; TurnFailed RESOURCE_EXHAUSTED when there is none (never with the limit off).
        `label` is the authenticated tenant ("" without one): a caller-chosen name is never a label."""
        shed = self.gate.try_acquire(tenant, enforce=self.enabled)
        if shed is not None:
            metrics.record_shed(label)
            raise TurnFailed(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{shed.message}; try again in {shed.retry_after_ms} ms",
                # retry-after-ms for callers; grpc-retry-pushback-ms for gRPC's own retries (mars_ingress.client).
                trailing=(
                    ("retry-after-ms", str(shed.retry_after_ms)),
                    ("grpc-retry-pushback-ms", str(shed.retry_after_ms)),
                ),
            )
        return Slot(tenant)

    def leave(
        self, slot: Slot, pipeline_ms: float | None, exc: BaseException | None, turn_ms: float | None = None
    ) -> None:
        """Give the slot back: an answered turn's time in MARS is a sample, a turn out of time is a drop,
        anything else (a model failure, a cancel) says nothing about the pipeline's capacity."""
        dropped = getattr(exc, "code", None) == grpc.StatusCode.DEADLINE_EXCEEDED
        answered = exc is None
        before = self.gate.limit
        self.gate.release(
            slot.tenant, pipeline_ms if answered else None, dropped, turn_ms if answered else None
        )
        if self.enabled and self.gate.limit != before:
            # At most once per decision window: what an operator reads to see the limit settle.
            log.info("admission limit %d -> %d (%d in flight)", before, self.gate.limit, self.gate.inflight)
