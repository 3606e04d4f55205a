"""The judge service's rubric judge against the real local llama.cpp server: every judgement parses into
the schema (grammar-constrained JSON, then field validation), carries its cost, and Eq. 17 holds."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from conftest import start_stack
from grpc_health.v1 import health_pb2, health_pb2_grpc
from mars.domain.reward import compose_utility
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_stack import LocalStack

pytestmark = pytest.mark.integration

CASES = [
    ("Plan two calm days in Lisbon.", "Day 1: Alfama and the castle. Day 2: Belem, tram 28.", ev.EXPLORE),
    ("Make day two shorter.", "Day 2: Belem tower only, back by noon.", ev.REVISE),
    ("Summarize the final plan.", "", ev.SYNTHESIZE),  # empty answer: never sent to the judge
]


@pytest.fixture(scope="module")
def judge_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    env = {"MARS_JUDGE_BACKEND": "llamacpp", "MARS_JUDGE_DEADLINE_MS": "90000", "MARS_JUDGE_LAMBDA_COST": "0.5"}
    s = start_stack(
        tmp_path_factory.mktemp("judge"), "models.test.yaml", services=("judge",), service_env={"judge": env}
    )
    try:
        yield s
    finally:
        s.stop()


def test_rubric_judgements_parse_and_compose(judge_stack: LocalStack) -> None:
    stub = svc_grpc.JudgeStub(judge_stack.channel("judge"))
    for query, answer, phase in CASES:
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
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(judge_stack.addr("judge")))
    status = health.Check(health_pb2.HealthCheckRequest(service="mars.v1.Judge.rubric"), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
