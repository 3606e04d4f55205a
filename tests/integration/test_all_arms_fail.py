"""When every arm fails the caller gets UNAVAILABLE and the turn is recorded as failed, never dropped."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from conftest import ingress_stub, query, read_topic, start_stack, wait_for
from mars.config import TOPIC_GENERATED
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_stack import LocalStack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def broken_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    # The memory service also gets an embedding model path that does not exist: it must keep serving.
    s = start_stack(
        tmp_path_factory.mktemp("broken"),
        "models.broken.yaml",
        start_llm=False,
        service_env={"memory": {"MARS_MEMORY_EMBEDDING_MODEL": "/nonexistent/embedding-model"}},
    )
    try:
        yield s
    finally:
        s.stop()


def test_all_arms_failing_is_unavailable_and_recorded(broken_stack: LocalStack) -> None:
    stub = ingress_stub(broken_stack, "t")
    for n in (1, 2):
        with pytest.raises(grpc.RpcError) as info:
            stub.SendTurn(
                svc.TurnRequest(tenant="t", user_id="u", session_id="s", text=f"question {n}"), timeout=60
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        details = info.value.details() or ""
        assert "broken-a" in details and "broken-b" in details
        # The caller gets the arms and a reference, never the upstream's errors or addresses.
        assert "reference " in details
        for internal in ("http", "127.0.0.1", ":9", "Error", "Exception", "Traceback", "refused"):
            assert internal not in details, details

    rows = query(
        broken_stack, "SELECT seq, status, error FROM ingress_turns WHERE user_id = 'u' ORDER BY seq"
    )
    assert [(r[0], r[1]) for r in rows] == [(1, "FAILED"), (2, "FAILED")]
    generated = [
        ev.Generated.FromString(r.value)
        for r in read_topic(broken_stack.env["MARS_KAFKA_BOOTSTRAP"], TOPIC_GENERATED)
    ]
    assert [g.status for g in generated] == [ev.FAILED, ev.FAILED]
    assert all([a.arm for a in g.attempts] == ["broken-a", "broken-b"] for g in generated)
    # A failed turn still advances memory's applied seq, so the next turn's view is not held up.
    wait_for(
        lambda: query(broken_stack, "SELECT applied_seq FROM memory_progress WHERE user_id = 'u'") == [(2,)],
        what="memory progress",
    )
    assert query(broken_stack, "SELECT count(*) FROM memory_records WHERE user_id = 'u'")[0][0] == 0
    assert query(broken_stack, "SELECT count(*) FROM router_ledger")[0][0] == 0


def test_memory_without_embedder_reports_dense_down_and_keeps_serving(broken_stack: LocalStack) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(broken_stack.addr("memory")))
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health.Check(health_pb2.HealthCheckRequest(service="mars.v1.Memory"), timeout=5).status == serving
    dense = health.Check(health_pb2.HealthCheckRequest(service="mars.v1.Memory.dense"), timeout=5)
    assert dense.status == health_pb2.HealthCheckResponse.NOT_SERVING
    view = svc_grpc.MemoryStub(broken_stack.channel("memory")).BuildView(
        svc.BuildViewRequest(tenant="t", user_id="nobody", text="hello", state=ev.SessionState()), timeout=10
    )
    assert list(view.blocks) == []
