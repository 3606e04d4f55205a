"""The two stages that ask an LLM themselves, against the real local llama.cpp server (SmolLM2,
schema-constrained JSON), on one stack of the state and judge services: the state service's controller
(every turn gets a valid state, the event says which backend answered) and the judge's rubric (every
judgement parses into the schema, carries its cost, and Eq. 17 holds); and the controller's fallback when
its endpoint is down, where health reports the degraded controller."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
from conftest import produce_raw, read_topic, start_stack, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc
from mars.bus.codec import event_key
from mars.config import SCHEMA_VERSION, TOPIC_RECEIVED, TOPIC_STATE
from mars.domain.reward import compose_utility
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_stack import LocalStack
from mars_stack.readiness import free_port
from mars_state.qtm.guard import UNHEALTHY_AFTER

pytestmark = pytest.mark.integration

CONTROLLER = "mars.v1.StateEstimator.controller"
#: A first turn, and a recall question with an active context: the prompt's two shapes. Each call takes SmolLM2
#: about 9 s on 2 cores; more turns of the same shapes would test the same code and grammar again.
TURNS = [
    ("Help me plan a three-day hiking trip in the Alps in late June.", []),
    ("When did I first mention the budget for the trip?", ["Make the second day shorter."]),
]


def _valid(st: ev.SessionState) -> None:
    assert st.action in (ev.MATCH, ev.NEW_TOPIC) and st.query_type != ev.QUERY_TYPE_UNSPECIFIED
    assert st.phase != ev.PHASE_UNSPECIFIED and st.retrieval_scope in (ev.LOCAL, ev.GLOBAL)
    assert st.top_k_hint in (3, 5, 8) and st.lens_recommendation in (0, 3) and st.lens_reason


def _health(stack: LocalStack, component: str) -> int:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(stack.addr("state")))
    return stub.Check(health_pb2.HealthCheckRequest(service=component), timeout=5).status


@pytest.fixture(scope="module")
def llm_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """The state service on the llama.cpp controller and the judge on its rubric, one llama.cpp server."""
    # Generous deadlines: SmolLM2 on 2 cores takes seconds per controller answer or judgement.
    state_env = {"MARS_STATE_QTM_BACKEND": "llamacpp", "MARS_STATE_QTM_DEADLINE_MS": "60000"}
    judge_env = {
        "MARS_JUDGE_BACKEND": "llamacpp",
        "MARS_JUDGE_DEADLINE_MS": "90000",
        "MARS_JUDGE_LAMBDA_COST": "0.5",
    }
    s = start_stack(
        tmp_path_factory.mktemp("llm-stages"),
        "models.test.yaml",
        services=("state", "judge"),
        service_env={"state": state_env, "judge": judge_env},
    )
    try:
        yield s
    finally:
        s.stop()


def test_the_server_runs_on_the_threads_it_is_given(llm_state: LocalStack) -> None:
    """The suite runs llama.cpp on one thread for generation and prompts alike (MARS_LLM_THREADS, set in
    tests/conftest.py): llama.cpp's own default for prompts is every core."""
    cmd = next(p.cmd for p in llm_state.procs if p.name == "llm")
    threads = os.environ["MARS_LLM_THREADS"]
    assert cmd[cmd.index("--n_threads") + 1] == cmd[cmd.index("--n_threads_batch") + 1] == threads


def test_llamacpp_controller_states_are_schema_valid(llm_state: LocalStack) -> None:
    stub = svc_grpc.StateEstimatorStub(llm_state.channel("state"))
    for text, context in TURNS:
        st = stub.Estimate(svc.EstimateRequest(text=text, active_context=context), timeout=90)
        _valid(st)
        # Parsed from the model's own JSON: no fallback, and the grammar leaves nothing to clamp except
        # what the guardrails deliberately rewrite.
        assert st.usage.backend == "llamacpp" and st.usage.llm_called and not st.usage.fallback_reason
        assert set(st.clamped_fields) <= {"action", "taxonomy.need_memory", "lens_recommendation"}
        assert st.usage.input_tokens > 100 and st.usage.output_tokens > 10 and not st.usage.usage_estimated
        assert st.usage.cost_usd > 0 and st.usage.prompt_version == "qtm-v1"
    assert _health(llm_state, CONTROLLER) == health_pb2.HealthCheckResponse.SERVING


def test_state_event_from_the_log_carries_the_controller_usage(llm_state: LocalStack) -> None:
    bootstrap = llm_state.env["MARS_KAFKA_BOOTSTRAP"]
    turn = ev.TurnEnvelope(
        turn_id=uuid.uuid4().hex,
        tenant="t",
        user_id="qtm-user",
        session_id="s",
        seq=1,
        received_at_ms=int(time.time() * 1000),
        schema_version=SCHEMA_VERSION,
    )
    received = ev.TurnReceived(turn=turn, text="Draft a short toast for my sister's wedding.")
    keys = llm_state.keyring()  # the stack's services take user text only sealed, as the ingress seals it
    produce_raw(
        bootstrap,
        TOPIC_RECEIVED,
        (keys.seal(received) if keys is not None else received).SerializeToString(),
        event_key(turn),
    )

    def state_events() -> list[ev.StateEstimated]:
        out = []
        for record in read_topic(bootstrap, TOPIC_STATE, idle_s=1.0):
            event = ev.StateEstimated.FromString(record.value)
            if event.turn.turn_id == turn.turn_id:
                out.append(event)
        return out

    wait_for(lambda: bool(state_events()), 120, "the state event")
    (event,) = state_events()
    _valid(event.state)
    assert event.state.usage.backend == "llamacpp" and not event.state.usage.fallback_reason
    assert event.state.thread_depth == 1


RUBRIC_CASES = [
    ("Plan two calm days in Lisbon.", "Day 1: Alfama and the castle. Day 2: Belem, tram 28.", ev.EXPLORE),
    ("Make day two shorter.", "Day 2: Belem tower only, back by noon.", ev.REVISE),
    ("Summarize the final plan.", "", ev.SYNTHESIZE),  # empty answer: never sent to the judge
]


def test_rubric_judgements_parse_and_compose(llm_state: LocalStack) -> None:
    stub = svc_grpc.JudgeStub(llm_state.channel("judge"))
    for query, answer, phase in RUBRIC_CASES:
        g = ev.Generated(status=ev.OK, query=query, text=answer, cost_usd=0.002, model="m")
        g.state.phase = phase
        g.state.taxonomy.need_memory = 1
        g.packed_blocks.add(block_id="b", text="User: calm Lisbon trip, budget 80 euros a day, likes trams.")
        j = stub.Score(g, timeout=120)
        if not answer:
            assert j.judge == "deterministic-v1" and j.utility == 0.0 and j.judge_cost_usd == 0.0
            continue
        assert j.judge == "rubric-judge-v1:llamacpp" and not j.judge_fallback_reason
        assert all(0.0 <= getattr(j.rubric, f.name) <= 5.0 for f in ev.RubricScores.DESCRIPTOR.fields)
        assert 0.0 <= j.judge_confidence <= 1.0
        assert j.judge_input_tokens > 100 and j.judge_output_tokens > 10
        assert j.judge_cost_usd == pytest.approx(
            (j.judge_input_tokens * 0.15 + j.judge_output_tokens * 0.60) / 1e6
        )
        *_, u = compose_utility(j.rubric, j.flags, j.coverage, j.final_step)
        assert j.utility == pytest.approx(u) and j.reward == pytest.approx(u - 0.5 * 0.002)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(llm_state.addr("judge")))
    status = health.Check(health_pb2.HealthCheckRequest(service="mars.v1.Judge.rubric"), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def down_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    # The controller endpoint is a port nobody listens on.
    env = {"MARS_STATE_QTM_BACKEND": "openai", "MARS_STATE_QTM_URL": f"http://127.0.0.1:{free_port()}/v1"}
    s = start_stack(
        tmp_path_factory.mktemp("qtm-down"),
        "models.test.yaml",
        start_llm=False,
        services=("state",),
        service_env={"state": env},
    )
    try:
        yield s
    finally:
        s.stop()


def test_controller_down_falls_back_to_rules_and_reports_degraded(down_state: LocalStack) -> None:
    stub = svc_grpc.StateEstimatorStub(down_state.channel("state"))
    assert _health(down_state, CONTROLLER) == health_pb2.HealthCheckResponse.SERVING
    for i in range(UNHEALTHY_AFTER + 1):  # the controller's health turns after this many failures in a row
        text, context = TURNS[i % len(TURNS)]
        st = stub.Estimate(svc.EstimateRequest(text=text, active_context=context), timeout=10)
        _valid(st)
        assert st.usage.fallback_reason == "endpoint_error" and st.usage.backend == "rules"
    wait_for(
        lambda: _health(down_state, CONTROLLER) == health_pb2.HealthCheckResponse.NOT_SERVING,
        10,
        "controller health to turn NOT_SERVING",
    )
    # The service itself keeps serving: turns are answered by the rules.
    assert _health(down_state, "mars.v1.StateEstimator") == health_pb2.HealthCheckResponse.SERVING
