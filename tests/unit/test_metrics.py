"""mars.metrics: every instrument recorded where the services record it and read back through an in-memory
reader (bound the way setup_telemetry binds the service's MeterProvider); labels bounded, never per user."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from aiokafka import ConsumerRecord, TopicPartition
from mars import metrics
from mars.auth import Principal
from mars.bus.codec import PoisonEvent, event_key
from mars.bus.consumer import StageConsumer
from mars.bus.delivery import Subscription
from mars.bus.offsets import PartitionTrack
from mars.bus.producer import EventProducer
from mars.config import TOPIC_GENERATED, TOPIC_RECEIVED, ServiceSettings
from mars.domain.circuit import CircuitBreaker
from mars.domain.memory_policy import MemoryRecord
from mars.model_pool import ModelPool, ModelSpec
from mars.telemetry import setup_telemetry
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars_dispatch.clients import Completion, GenerationError
from mars_dispatch.dispatcher import Dispatcher
from mars_dispatch.settings import DispatchSettings
from mars_ingress.admission import Admission, TurnFailed
from mars_ingress.budgets import BudgetRow, Use
from mars_ingress.settings import IngressSettings
from mars_judge.service import count_costs
from mars_memory.write_behind import WriteBehind
from mars_state.qtm.guard import GuardedEstimator
from mars_state.spec import ESTIMATES, SPEC
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

FORBIDDEN_LABELS = {"user", "user_id", "session_id", "session", "turn_id", "turn"}


@pytest.fixture
def reader(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemoryMetricReader]:
    """The instruments bound to a fresh provider for one test (as setup_telemetry binds them), the
    previous ones back afterwards."""
    monkeypatch.setattr(metrics, "_current", metrics.instruments())
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics.bind(provider)
    try:
        yield reader
    finally:
        provider.shutdown()


def points(reader: InMemoryMetricReader, name: str) -> list[tuple[dict[str, Any], Any]]:
    """(attributes, point) of every data point of metric `name`."""
    data = reader.get_metrics_data()
    out: list[tuple[dict[str, Any], Any]] = []
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    out.extend((dict(p.attributes or {}), p) for p in m.data.data_points)
    return out


def all_label_names(reader: InMemoryMetricReader) -> set[str]:
    data = reader.get_metrics_data()
    names: set[str] = set()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    names |= set(p.attributes or {})
    return names


def test_turns_count_by_status_and_tenant_with_a_bounded_status(reader: InMemoryMetricReader) -> None:
    metrics.record_turn("answered", "acme", 120.0)
    metrics.record_turn("answered", "acme", 80.0)
    metrics.record_turn("rejected", "")
    metrics.record_turn("something new", "acme")  # not a known status: counted as error
    turns = {(a["status"], a["tenant"]): p.value for a, p in points(reader, "mars.turns")}
    assert turns == {("answered", "acme"): 2, ("rejected", ""): 1, ("error", "acme"): 1}
    durations = points(reader, "mars.turn.duration")
    assert [(a, p.count, p.sum) for a, p in durations] == [({"status": "answered"}, 2, 200.0)]


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (_Refused(grpc.StatusCode.DEADLINE_EXCEEDED), "timed_out"),
        (_Refused(grpc.StatusCode.UNAVAILABLE), "failed"),
        (_Refused(grpc.StatusCode.UNAUTHENTICATED), "rejected"),
        (_Refused(grpc.StatusCode.RESOURCE_EXHAUSTED), "rejected"),
        (_Refused(grpc.StatusCode.INTERNAL), "error"),
        (ValueError("text is empty"), "invalid"),
        (asyncio.CancelledError(), "cancelled"),
        (TimeoutError(), "timed_out"),
        (RuntimeError("defect"), "error"),
    ],
)
def test_turn_status_of_an_exception(exc: BaseException, status: str) -> None:
    assert metrics.turn_status(exc) == status
    assert status in metrics.TURN_STATUSES


async def _consumer(handler: Any, attempts: int = 2) -> tuple[StageConsumer, list[str]]:
    """A StageConsumer on the received topic (its Kafka consumer never started: no broker) whose dead
    letters are collected."""
    letters: list[str] = []
    settings = ServiceSettings(handler_attempts=attempts, uvloop=False)
    producer = EventProducer.__new__(EventProducer)
    producer.keyring = None  # a stack without a master key: plaintext events are taken

    async def dead_letter(record: Any, reason: str, consumer: str, turn_id: str) -> None:
        letters.append(reason)

    producer.dead_letter = dead_letter  # type: ignore[method-assign]
    consumer = StageConsumer(
        settings, producer, SPEC, ESTIMATES, [Subscription(TOPIC_RECEIVED, ev.TurnReceived, handler)]
    )
    await consumer._consumer.stop()  # closed, never started
    return consumer, letters


def _record(text: str = "hi", value: bytes | None = None, offset: int = 0) -> ConsumerRecord[bytes, bytes]:
    turn = ev.TurnEnvelope(turn_id="t1", tenant="acme", user_id="u1", session_id="s", seq=1, schema_version=1)
    payload = ev.TurnReceived(turn=turn, text=text).SerializeToString() if value is None else value
    return ConsumerRecord(
        topic=TOPIC_RECEIVED,
        partition=0,
        offset=offset,
        timestamp=int(time.time() * 1000) - 250,
        timestamp_type=0,
        key=event_key(turn),
        value=payload,
        checksum=None,
        serialized_key_size=0,
        serialized_value_size=len(payload),
        headers=[],
    )


def test_stage_handler_calls_are_timed_by_outcome_and_dead_letters_counted_by_kind(
    reader: InMemoryMetricReader,
) -> None:
    calls: list[str] = []

    async def handler(event: ev.TurnReceived) -> None:
        calls.append(event.text)
        if event.text == "poison":
            raise PoisonEvent("the stage refuses this")
        if event.text == "broken":
            raise RuntimeError("a defect")
        await asyncio.sleep(0.01)

    async def main() -> list[str]:
        consumer, letters = await _consumer(handler, attempts=2)
        await consumer._handle(_record("fine"))
        await consumer._handle(_record("poison"))
        await consumer._handle(_record("broken"))  # fails twice: retried once, then dead-lettered
        await consumer._handle(_record(value=b"\xff\xfe not a protobuf"))  # never reaches the handler
        track = PartitionTrack()
        track.fetched(5)
        await consumer._handle_after(
            None, _record("fine", offset=5), TopicPartition(TOPIC_RECEIVED, 0), track
        )
        return letters

    letters = asyncio.run(main())
    assert calls == ["fine", "poison", "broken", "broken", "fine"] and len(letters) == 3
    durations = {a["outcome"]: p for a, p in points(reader, "mars.stage.duration")}
    assert {a["group"] for a, _ in points(reader, "mars.stage.duration")} == {"mars-state"}
    assert {a["topic"] for a, _ in points(reader, "mars.stage.duration")} == {TOPIC_RECEIVED}
    assert {k: p.count for k, p in durations.items()} == {"ok": 2, "dead_lettered": 2, "retried": 1}
    assert durations["ok"].sum >= 20  # two calls of at least 10 ms each
    kinds = {a["reason_kind"]: p.value for a, p in points(reader, "mars.dead_letters")}
    assert kinds == {"rejected": 1, "handler_failed": 1, "undecodable": 1}
    (delay_attrs, delay), *_ = points(reader, "mars.stage.queue_delay")
    assert delay_attrs == {"group": "mars-state", "topic": TOPIC_RECEIVED}
    assert delay.count == 1 and delay.sum >= 250  # the record was published 250 ms before


def test_consumer_lag_from_its_own_view_of_high_watermarks_and_open_records(
    reader: InMemoryMetricReader,
) -> None:
    async def handler(_: object) -> None:
        return None

    async def main() -> StageConsumer:
        consumer, _ = await _consumer(handler)
        return consumer

    consumer = asyncio.run(main())
    t = TopicPartition
    states = {
        # 3 records open from offset 7 (fetched, unfinished) of 12 published: 5 behind
        t(TOPIC_RECEIVED, 0): SimpleNamespace(highwater=12, has_valid_position=True, position=10),
        # nothing open: position 4 of 6
        t(TOPIC_RECEIVED, 1): SimpleNamespace(highwater=6, has_valid_position=True, position=4),
        # never fetched: no high watermark, left out
        t(TOPIC_RECEIVED, 2): SimpleNamespace(highwater=None, has_valid_position=False, position=None),
    }
    assignment = SimpleNamespace(state_value=states.get)
    consumer._consumer = SimpleNamespace(  # type: ignore[assignment]
        _subscription=SimpleNamespace(subscription=SimpleNamespace(assignment=assignment)),
        assignment=lambda: set(states),
    )
    track = consumer._tracks.setdefault(t(TOPIC_RECEIVED, 0), PartitionTrack())
    for offset in (7, 8, 9):
        track.fetched(offset)
    consumer._lag = consumer._lag_now()
    assert consumer.lag_snapshot() == {("mars-state", TOPIC_RECEIVED): 5 + 2}
    lag = points(reader, "mars.consumer.lag")
    assert [(a, p.value) for a, p in lag] == [({"group": "mars-state", "topic": TOPIC_RECEIVED}, 7)]
    del consumer  # dropped: no longer reported
    assert points(reader, "mars.consumer.lag") == []


def test_costs_by_tenant_and_component_without_the_user(reader: InMemoryMetricReader) -> None:
    turn = ev.TurnEnvelope(turn_id="t1", tenant="acme", user_id="u1", session_id="s1")
    count_costs(ev.Judged(turn=turn, cost_usd=0.002, controller_cost_usd=0.0001, judge_cost_usd=0.0003))
    count_costs(ev.Judged(turn=turn, cost_usd=0.001))
    costs = {(a["tenant"], a["component"]): p.value for a, p in points(reader, "mars.cost.usd")}
    assert costs == pytest.approx(
        {("acme", "generator"): 0.003, ("acme", "controller"): 0.0001, ("acme", "judge"): 0.0003}
    )
    assert all(set(a) == {"tenant", "component"} for a, _ in points(reader, "mars.cost.usd"))


def test_qtm_outcomes_by_outcome_and_backend(reader: InMemoryMetricReader) -> None:
    asyncio.run(GuardedEstimator(None).estimate("hello there", []))
    outcomes = [(a, p.value) for a, p in points(reader, "mars.qtm.outcomes")]
    assert outcomes == [({"outcome": "rules", "backend": "rules"}, 1)]


def _spec(name: str) -> ModelSpec:
    return ModelSpec(
        name=name,
        base_url="http://127.0.0.1:9/v1",
        context_window=4096,
        output_reserve=64,
        safety_margin=32,
        input_price_per_m=1.0,
        output_price_per_m=1.0,
    )


class _Clients:
    async def complete(self, spec: ModelSpec, *args: object, **kw: object) -> Completion:
        if spec.name == "bad":
            raise GenerationError("HTTP 500")
        return Completion("Lisbon.", 10, 2, usage_estimated=False)


def test_dispatch_attempts_by_arm_and_outcome_and_circuit_states(reader: InMemoryMetricReader) -> None:
    pool = ModelPool(models=[_spec("bad"), _spec("good")])
    settings = DispatchSettings(circuit_failure_threshold=1, circuit_reset_s=30)
    dispatcher = Dispatcher(pool, _Clients(), settings)  # type: ignore[arg-type]
    now = [0.0]
    dispatcher.breakers = {name: CircuitBreaker(1, 30, clock=lambda: now[0]) for name in dispatcher.breakers}

    async def ask() -> ev.Generated:
        return await dispatcher.generate(["bad", "good"], "Where?", ev.SessionState(), ev.CandidateView(), 8)

    assert asyncio.run(ask()).model == "good"  # bad fails and opens its circuit
    assert asyncio.run(ask()).model == "good"  # bad's circuit is open
    attempts = {(a["arm"], a["outcome"]): p.value for a, p in points(reader, "mars.dispatch.attempts")}
    assert attempts == {("bad", "endpoint_error"): 1, ("bad", "circuit_open"): 1, ("good", "ok"): 2}
    states = {a["arm"]: p.value for a, p in points(reader, "mars.circuit.state")}
    assert states == {"bad": 2, "good": 0}
    now[0] = 31.0
    assert {a["arm"]: p.value for a, p in points(reader, "mars.circuit.state")} == {"bad": 1, "good": 0}


def test_no_instrument_has_a_per_user_label(reader: InMemoryMetricReader) -> None:
    """Whatever gets recorded, the label names are the bounded ones of the module's table."""
    metrics.record_turn("answered", "acme", 1.0)
    metrics.record_cost("acme", "generator", 0.1)
    metrics.record_dead_letter("mars-state", TOPIC_GENERATED, "nonsense")  # unknown kind: handler_failed
    metrics.record_dispatch_attempt("good", "ok")
    metrics.record_judge_outcome("ok")
    metrics.record_qtm_outcome("ok", "rules")
    labels = all_label_names(reader)
    assert labels and not labels & FORBIDDEN_LABELS, labels
    assert [a["reason_kind"] for a, _ in points(reader, "mars.dead_letters")] == ["handler_failed"]


class _Breakers:
    def __init__(self, breakers: dict[str, CircuitBreaker]) -> None:
        self.breakers = breakers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_setup_telemetry_binds_the_instruments_to_the_prometheus_endpoint() -> None:
    """The names Prometheus sees (what the README lists): units as suffixes, counters with _total."""
    port = _free_port()
    telemetry = setup_telemetry(
        "probe", ServiceSettings(metrics_port=port, grpc_host="127.0.0.1", uvloop=False)
    )
    source = _Breakers({"arm-x": CircuitBreaker()})
    metrics.watch_circuits(source)
    try:
        metrics.record_turn("answered", "acme", 5.0)
        metrics.record_cost("acme", "judge", 0.5)
        metrics.instruments().stage_duration.record(3.0, {"group": "g", "topic": "t", "outcome": "ok"})
        body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        telemetry.shutdown()
    names = {line.split("{")[0].split(" ")[0] for line in body.splitlines() if line.startswith("mars_")}
    assert {
        "mars_turns_total",
        "mars_turn_duration_milliseconds_bucket",
        "mars_cost_usd_USD_total",
        "mars_stage_duration_milliseconds_count",
    } <= names, sorted(names)
    # Each series once (a gauge's callback registered twice would report it twice).
    assert sum(ln.startswith('mars_circuit_state{arm="arm-x"') for ln in body.splitlines()) == 1


def test_the_memory_writers_embedding_backlog_is_a_gauge(reader: InMemoryMetricReader) -> None:
    async def scenario() -> None:
        def embed(records: Sequence[MemoryRecord]) -> list[np.ndarray]:
            return [np.zeros((1, 2), dtype=np.float32) for _ in records]

        async def store(vectors: list[tuple[str, np.ndarray]]) -> None:
            await asyncio.sleep(0)

        idle = WriteBehind(embed, store, max_pending=10)  # another store's writer in the process, idle
        metrics.watch_write_behind(idle)
        behind = WriteBehind(embed, store, max_pending=10)
        metrics.watch_write_behind(behind)
        for n in (1, 2):
            behind.submit(MemoryRecord(f"r{n}", "s", f"t{n}", n, "q", "a"), ("t", "u"))
        assert [p.value for _, p in points(reader, "mars.memory.embed_behind")] == [2]
        for _ in range(200):
            if behind.backlog == 0:
                break
            await asyncio.sleep(0.01)
        assert [p.value for _, p in points(reader, "mars.memory.embed_behind")] == [0]

    asyncio.run(scenario())


class _SpentBudgets:
    """A budget store whose user has spent a 10-token-per-minute budget (mars_ingress.budget_store's
    reads, without Postgres)."""

    async def rows(self, tenant: str, user_id: str, key_id: str | None) -> list[BudgetRow]:
        return [BudgetRow(tenant, user_id=user_id, tokens_per_minute=10)]

    async def uses(self, tenant: str, user: str | None, key: str | None) -> tuple[dict[str, Use], float]:
        return {"user": Use(recent_tokens=((999.0, 25.0),))}, 1000.0


def test_budget_refusals_by_tenant_and_kind_never_the_user_or_key(reader: InMemoryMetricReader) -> None:
    admission = Admission(IngressSettings(), pool=None)  # type: ignore[arg-type]
    admission._budgets = _SpentBudgets()  # type: ignore[assignment]
    principal = Principal(key_id="k1", tenant="acme")
    request = svc.TurnRequest(user_id="alice", text="hello")
    with pytest.raises(TurnFailed, match="user budget of 10 tokens/min reached"):
        asyncio.run(admission.admit(request, principal, admission.check(request, principal)))
    refused = [(a, p.value) for a, p in points(reader, "mars.budget.refused")]
    assert refused == [({"tenant": "acme", "budget": "user_tokens_per_minute"}, 1)]
