"""Every MARS metric instrument, defined once (`Instruments`). Services record through the `record_*`
helpers here or `instruments()`; nothing else creates instruments. Import the module, not an instrument:
`bind` replaces them.

`mars.telemetry.setup_telemetry` binds them to the service's MeterProvider (OTLP, the metric snapshots under
`MARS_TRACE_DIR/metrics/`, the Prometheus endpoint on `MARS_METRICS_PORT`); until then they are no-ops.

=======================  ================  ========  =====================================================
name                     kind              unit      labels                                      (recorded in)
=======================  ================  ========  =====================================================
mars.turns               counter           {turn}    status (TURN_STATUSES), tenant                  ingress
mars.turn.duration       histogram         ms        status                                          ingress
mars.stage.duration      histogram         ms        group, topic, outcome (STAGE_OUTCOMES)      every stage
mars.stage.queue_delay   histogram         ms        group, topic                                every stage
mars.dead_letters        counter           {record}  group, topic, reason_kind (DEAD_LETTER_KINDS)   stages
mars.consumer.lag        observable gauge  {record}  group, topic                                every stage
mars.cost.usd            counter           USD       tenant, component (COST_COMPONENTS)               judge
mars.qtm.outcomes        counter           {call}    outcome, backend                                  state
mars.judge.outcomes      counter           {turn}    outcome                                           judge
mars.circuit.state       observable gauge  1         arm (0 closed, 1 half-open, 2 open)            dispatch
mars.dispatch.attempts   counter           {attempt} arm, outcome (DISPATCH_OUTCOMES)               dispatch
mars.admission.shed      counter           {turn}    tenant                                          ingress
mars.budget.refused      counter           {turn}    tenant, budget (BUDGET_KINDS)                   ingress
mars.stage.expired       counter           {turn}    stage (EXPIRED_STAGES)                       answer path
mars.admission.limit     observable gauge  {turn}    (none: one series per ingress process)          ingress
mars.admission.inflight  observable gauge  {turn}    (none: one series per ingress process)          ingress
mars.memory.embed_behind observable gauge  {record}  (none: one series per memory process)           memory
=======================  ================  ========  =====================================================

Labels: `group` is the consumer group's name without the run's topic prefix (`mars.topology`, and
"ingress-replies" for each ingress replica's reply reader), `topic` the base topic name. Every label takes a
bounded set of values, except `tenant`: one series per tenant (and status or component), so a deployment
with very many tenants should aggregate it away in the collector (or drop the label there). Never a
user_id, session_id or turn_id label: per-user numbers are in Postgres (`judge_rewards`, `ingress_turns`).
The service is not a label either: it is the resource's `service.name` (Prometheus: `target_info` and the
scrape target). `mars.consumer.lag` covers the partitions a process holds: a group's lag is the sum over
its replicas. Prometheus names: dots become underscores, counters end in `_total`, and the unit is added
(`mars_stage_duration_milliseconds_bucket`, `mars_cost_usd_USD_total`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, Observation

log = logging.getLogger(__name__)

#: Histogram buckets in ms: from a Postgres write to a model call at the turn timeout.
DURATION_BUCKETS_MS: tuple[float, ...] = (
    1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000, 120_000,
)  # fmt: skip

# ---- label values ------------------------------------------------------------------------------------

#: How a turn ended for its caller. Anything else is counted as "error".
TURN_STATUSES = ("answered", "failed", "timed_out", "rejected", "invalid", "cancelled", "error")
#: What became of one stage handler call: done, dead-lettered (the record's own fault, or out of
#: attempts), failed and to be tried again, or dropped because its user was forgotten (data key gone).
STAGE_OUTCOMES = ("ok", "dead_lettered", "retried", "forgotten")
#: Why a record was dead-lettered, coarsely (the letter's reason has the details).
DEAD_LETTER_KINDS = (
    "undecodable",  # not a protobuf of the topic's type
    "unsealable",  # sealed text that does not open with its data key, or no master key to open it
    "unsealed",  # user text without a data key, read by a service that seals (it takes sealed text only)
    "invalid_envelope",  # envelope fields or the record key wrong
    "oversized_text",  # text over MARS_MAX_EVENT_TEXT_CHARS
    "rejected",  # the stage's handler refused the content (PoisonEvent)
    "output_too_large",  # the stage's output too large for the broker
    "data_refused",  # Postgres refused the event's data
    "handler_failed",  # the handler failed on every attempt
)
#: Cost components of a turn (appendix B.6): the generating arm, the QTM controller, the rubric judge.
COST_COMPONENTS = ("generator", "controller", "judge")
#: One arm attempt: answered; answered but escalated by the confidence cascade; the endpoint failed; the
#: turn's deadline cut the call; the circuit was open; the prompt did not fit the arm; the deadline had
#: passed before the call; a defect on our side.
DISPATCH_OUTCOMES = (
    "ok",
    "escalated",
    "endpoint_error",
    "deadline",
    "circuit_open",
    "no_fit",
    "deadline_passed",
    "error",
)
#: The answer-path stages that pass a turn on without their work once its deadline passed (mars.deadline).
EXPIRED_STAGES = ("state", "memory", "router", "dispatch")
#: The budget that refused a turn (mars_ingress.budgets.LABELS): its scope and kind, never whose it is.
BUDGET_KINDS = ("user_usd_per_day", "user_tokens_per_minute", "key_usd_per_day", "key_tokens_per_minute")
#: mars.circuit.state values.
CIRCUIT_VALUES = {"closed": 0, "half_open": 1, "open": 2}

# ---- what the observable gauges read -------------------------------------------------------------------


class LagSource(Protocol):
    def lag_snapshot(self) -> Mapping[tuple[str, str], int]:
        """Records behind per (group, topic), as last computed on the source's own event loop."""
        ...


class _HasState(Protocol):
    @property
    def state(self) -> str: ...


class CircuitSource(Protocol):
    @property
    def breakers(self) -> Mapping[str, _HasState]: ...


class _Watched:
    """Objects an observable gauge reads when metrics are collected (on the exporter's or the Prometheus
    server's thread), held weakly: a dropped consumer or dispatcher drops out by itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: weakref.WeakSet[object] = weakref.WeakSet()

    def add(self, item: object) -> None:
        with self._lock:
            self._items.add(item)

    def items(self) -> list[object]:
        with self._lock:
            return list(self._items)


_lag_sources = _Watched()
_circuit_sources = _Watched()
_admission_sources = _Watched()


def watch_consumer(source: LagSource) -> None:
    """Report `source.lag_snapshot()` as `mars.consumer.lag` from now on (while the source lives)."""
    _lag_sources.add(source)


def watch_circuits(source: CircuitSource) -> None:
    """Report the state of each of `source.breakers` (arm name -> CircuitBreaker, read at collection
    time) as `mars.circuit.state` from now on (while the source lives)."""
    _circuit_sources.add(source)


class AdmissionSource(Protocol):
    @property
    def limit(self) -> int: ...

    @property
    def inflight(self) -> int: ...


def watch_admission(source: AdmissionSource) -> None:
    """Report `source.limit` and `source.inflight` (the ingress's load shedding, read at collection time)
    as `mars.admission.limit` and `mars.admission.inflight` from now on (while the source lives)."""
    _admission_sources.add(source)


class WriteBehindSource(Protocol):
    @property
    def backlog(self) -> int: ...


_write_behind_sources = _Watched()


def watch_write_behind(source: WriteBehindSource) -> None:
    """Report `source.backlog` (stored pairs waiting for their embedding, read at collection time) as
    `mars.memory.embed_behind` from now on (while the source lives)."""
    _write_behind_sources.add(source)


def _observe(sources: _Watched, attribute: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
    """A gauge callback: the sum of `attribute` over the process's watched sources, as one observation. The
    gauge has no labels, so one observation per source would be one series written several times, and the
    last source read (an idle one, say) would win."""

    def observe(options: CallbackOptions) -> Iterable[Observation]:
        values: list[int] = []
        for source in sources.items():
            try:
                values.append(int(getattr(source, attribute)))
            except Exception:
                log.debug("%s unavailable", attribute, exc_info=True)
        return [Observation(sum(values))] if values else []

    return observe


def _observe_lag(options: CallbackOptions) -> Iterable[Observation]:
    out: list[Observation] = []
    for source in _lag_sources.items():
        try:
            snapshot = dict(source.lag_snapshot())  # type: ignore[attr-defined]
        except Exception:  # one source must not break the collection
            log.debug("lag snapshot failed", exc_info=True)
            continue
        out.extend(Observation(lag, {"group": g, "topic": t}) for (g, t), lag in snapshot.items())
    return out


def _observe_circuits(options: CallbackOptions) -> Iterable[Observation]:
    out: list[Observation] = []
    for source in _circuit_sources.items():
        try:
            breakers = list(source.breakers.items())  # type: ignore[attr-defined]
            out.extend(Observation(CIRCUIT_VALUES.get(b.state, 2), {"arm": arm}) for arm, b in breakers)
        except Exception:
            log.debug("circuit states unavailable", exc_info=True)
    return out


# ---- the instruments -----------------------------------------------------------------------------------


class Instruments:
    """Every instrument, made on one meter (the table above)."""

    def __init__(self, meter: Meter) -> None:
        self.turns = meter.create_counter(
            "mars.turns", unit="{turn}", description="turns by how they ended, per tenant"
        )
        self.turn_duration = meter.create_histogram(
            "mars.turn.duration",
            unit="ms",
            description="time from a turn's arrival at ingress to its reply or refusal, by status",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_MS,
        )
        self.stage_duration = meter.create_histogram(
            "mars.stage.duration",
            unit="ms",
            description="stage handler calls: time per call, by consumer group, topic and outcome",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_MS,
        )
        self.queue_delay = meter.create_histogram(
            "mars.stage.queue_delay",
            unit="ms",
            description="age of a record when its stage starts on it (now minus its Kafka timestamp)",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_MS,
        )
        self.dead_letters = meter.create_counter(
            "mars.dead_letters",
            unit="{record}",
            description="records dead-lettered, by consumer group, topic and reason kind",
        )
        self.consumer_lag = meter.create_observable_gauge(
            "mars.consumer.lag",
            callbacks=[_observe_lag],
            unit="{record}",
            description="records published and not yet finished by this process's consumer, per group and "
            "topic (its partitions' high watermark minus its first unfinished offset)",
        )
        self.cost_usd = meter.create_counter(
            "mars.cost.usd", unit="USD", description="per-turn costs by tenant and component"
        )
        self.qtm_outcomes = meter.create_counter(
            "mars.qtm.outcomes", unit="{call}", description="QTM calls by outcome and backend"
        )
        self.judge_outcomes = meter.create_counter(
            "mars.judge.outcomes", unit="{turn}", description="turn judgements by outcome"
        )
        self.circuit_state = meter.create_observable_gauge(
            "mars.circuit.state",
            callbacks=[_observe_circuits],
            unit="1",
            description="circuit breaker state per arm: 0 closed, 1 half-open, 2 open",
        )
        self.dispatch_attempts = meter.create_counter(
            "mars.dispatch.attempts", unit="{attempt}", description="arm attempts by arm and outcome"
        )
        self._add_overload_instruments(meter)
        self._add_rollout_instruments(meter)
        self.gateway_requests = meter.create_counter(
            "mars.gateway.requests", unit="{request}", description="HTTP gateway requests by route and status"
        )
        self.gateway_duration = meter.create_histogram(
            "mars.gateway.duration",
            unit="ms",
            description="the HTTP gateway's own time per request (everything but the ingress call), by route",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_MS,
        )

    def _add_rollout_instruments(self, meter: Meter) -> None:
        """Canary runs (mars_router.rollouts), per tenant and side ("live" or "canary"): judged turns by
        arm (the arms' shares), their rewards and costs (the means: sum over turns), and the reward test's
        statistic with the boundary it is compared with (promote above +boundary, roll back below -)."""
        self.rollout_turns = meter.create_counter(
            "mars.rollout.turns",
            unit="{turn}",
            description="judged turns of canary runs by tenant, role and arm",
        )
        self.rollout_reward = meter.create_up_down_counter(
            "mars.rollout.reward",
            unit="{reward}",
            description="sum of judged rewards in canary runs by tenant and role",
        )
        self.rollout_cost = meter.create_counter(
            "mars.rollout.cost.usd",
            unit="USD",
            description="generation cost in canary runs by tenant and role",
        )
        self.rollout_statistic = meter.create_gauge(
            "mars.rollout.statistic", description="a tenant's canary reward test: its standardised statistic"
        )
        self.rollout_boundary = meter.create_gauge(
            "mars.rollout.boundary",
            description="a tenant's canary reward test: the boundary B(t) at its turns",
        )

    def _add_overload_instruments(self, meter: Meter) -> None:
        """Load shedding at the ingress, expired turns on the answer path, and the memory writer's lag."""
        self.stage_expired = meter.create_counter(
            "mars.stage.expired",
            unit="{turn}",
            description="turns an answer-path stage passed on without its work: their deadline had passed",
        )
        self.admission_shed = meter.create_counter(
            "mars.admission.shed",
            unit="{turn}",
            description="turns refused at once because the pipeline was at its concurrency limit, per tenant",
        )
        self.budget_refused = meter.create_counter(
            "mars.budget.refused",
            unit="{turn}",
            description="turns refused by a budget per user or per key, per tenant and budget kind",
        )
        self.admission_limit = meter.create_observable_gauge(
            "mars.admission.limit",
            callbacks=[_observe(_admission_sources, "limit")],
            unit="{turn}",
            description="the ingress's adaptive concurrency limit: turns it lets into the pipeline at once",
        )
        self.admission_inflight = meter.create_observable_gauge(
            "mars.admission.inflight",
            callbacks=[_observe(_admission_sources, "inflight")],
            unit="{turn}",
            description="turns this ingress process has in the pipeline now",
        )
        self.memory_embed_behind = meter.create_observable_gauge(
            "mars.memory.embed_behind",
            callbacks=[_observe(_write_behind_sources, "backlog")],
            unit="{record}",
            description="stored pairs applied and waiting for their embedding (bounded: MARS_MEMORY_EMBED_BEHIND)",
        )


METER_NAME = "mars"
#: No-op until `bind` (not the global API's proxies: once setup_telemetry installed its provider globally,
#: they would register the observable gauges' callbacks on it a second time, and every gauge would be
#: reported twice).
_current = Instruments(metrics.NoOpMeter(METER_NAME))


def bind(provider: MeterProvider) -> Instruments:
    """Make every instrument anew on `provider` (setup_telemetry's, or a test's) and record there from now
    on. The global API's provider can be set once per process; this can be done again. Nothing is recorded
    before the first bind."""
    global _current
    _current = Instruments(provider.get_meter(METER_NAME))
    return _current


def instruments() -> Instruments:
    return _current


# ---- recording -------------------------------------------------------------------------------------------


def record_turn(status: str, tenant: str, duration_ms: float | None = None) -> None:
    """Count one turn that ended with `status` (one of TURN_STATUSES; `turn_status(exc)` maps an exception)
    for `tenant`: the authenticated tenant, "" for a turn refused before its tenant was established (a
    caller-chosen tenant name must not become a label). `duration_ms`: its time at ingress, when known."""
    if status not in TURN_STATUSES:
        status = "error"
    _current.turns.add(1, {"status": status, "tenant": tenant})
    if duration_ms is not None:
        _current.turn_duration.record(max(0.0, duration_ms), {"status": status})


#: gRPC status code names (grpc.StatusCode.X.name) to turn statuses.
_STATUS_OF_CODE = {
    "OK": "answered",
    "DEADLINE_EXCEEDED": "timed_out",
    "UNAVAILABLE": "failed",
    "INVALID_ARGUMENT": "invalid",
    "UNAUTHENTICATED": "rejected",
    "PERMISSION_DENIED": "rejected",
    "RESOURCE_EXHAUSTED": "rejected",
    "CANCELLED": "cancelled",
}


def turn_status(exc: BaseException) -> str:
    """The turn status for the exception a turn ended with: by its gRPC status code where it carries one
    (`code`, as ingress's TurnFailed does); else a ValueError is invalid input, a timeout timed_out, a
    cancellation (the caller went away) cancelled, anything else error."""
    name = getattr(getattr(exc, "code", None), "name", None)
    if isinstance(name, str):
        return _STATUS_OF_CODE.get(name, "error")
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    if isinstance(exc, TimeoutError):
        return "timed_out"
    if isinstance(exc, ValueError):
        return "invalid"
    return "error"


def record_expired(stage: str) -> None:
    if stage in EXPIRED_STAGES:
        _current.stage_expired.add(1, {"stage": stage})


def record_shed(tenant: str) -> None:
    """One turn shed at the concurrency limit, for the authenticated `tenant` ("" without one)."""
    _current.admission_shed.add(1, {"tenant": tenant})


def record_budget_refused(tenant: str, budget: str) -> None:
    """One turn refused by a budget of kind `budget` (BUDGET_KINDS) for the authenticated `tenant`: the
    user or key whose budget it was is never a label (the label rule above)."""
    if budget in BUDGET_KINDS:
        _current.budget_refused.add(1, {"tenant": tenant, "budget": budget})


def record_dead_letter(group: str, topic: str, reason_kind: str) -> None:
    if reason_kind not in DEAD_LETTER_KINDS:
        reason_kind = "handler_failed"
    _current.dead_letters.add(1, {"group": group, "topic": topic, "reason_kind": reason_kind})


def record_cost(tenant: str, component: str, usd: float) -> None:
    _current.cost_usd.add(usd, {"tenant": tenant, "component": component})


def record_qtm_outcome(outcome: str, backend: str) -> None:
    _current.qtm_outcomes.add(1, {"outcome": outcome, "backend": backend})


def record_judge_outcome(outcome: str) -> None:
    _current.judge_outcomes.add(1, {"outcome": outcome})


def record_gateway_request(route: str, status: int, own_ms: float) -> None:
    """`route` must be one of the gateway's own paths (or "other"): never a caller-chosen string."""
    _current.gateway_requests.add(1, {"route": route, "status": str(status)})
    _current.gateway_duration.record(own_ms, {"route": route})


def record_dispatch_attempt(arm: str, outcome: str) -> None:
    if outcome not in DISPATCH_OUTCOMES:
        outcome = "error"
    _current.dispatch_attempts.add(1, {"arm": arm, "outcome": outcome})


#: The sides of a canary run (mars_router.rollouts).
ROLLOUT_ROLES = ("live", "canary")


def record_rollout_turn(tenant: str, role: str, arm: str, reward: float, cost_usd: float) -> None:
    """A judged turn of a tenant's canary run, on its side (`role`): never a per-user label."""
    _current.rollout_turns.add(1, {"tenant": tenant, "role": role, "arm": arm})
    _current.rollout_reward.add(reward, {"tenant": tenant, "role": role})
    _current.rollout_cost.add(max(0.0, cost_usd), {"tenant": tenant, "role": role})


def record_rollout_test(tenant: str, statistic: float, boundary: float) -> None:
    _current.rollout_statistic.set(statistic, {"tenant": tenant})
    _current.rollout_boundary.set(boundary, {"tenant": tenant})
