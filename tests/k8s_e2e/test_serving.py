"""Turns answered inside Kubernetes: the chart, installed with Helm with its default values (overriding only
the image, the GPU parts, small resource requests and a single broker's replication factor), serving on a
real node: pods in containers, readiness from gRPC health, Services through kube-proxy, names through
CoreDNS, Kafka and Postgres reached by Service name, identity on with the certificates the chart mints.

One release serves the session (conftest: `release` installs it); test_serving_faults.py runs after
this file. Figures go to the run's summary (conftest.REPORT).
"""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
from conftest import (
    COMPONENTS,
    INGRESS_OPTIONS,
    NAMESPACE,
    RELEASE,
    REPORT,
    TENANT,
    core,
    mars_cli,
    service_address,
)
from mars.config import TOPIC_VIEW
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_ingress.client import ingress_channel
from mars_stack import kube, serving_cluster

pytestmark = pytest.mark.k8s_e2e


def view_events(serving: serving_cluster.ServingCluster, turn_ids: set[str]) -> dict[str, ev.ViewBuilt]:
    """The views logged on the view topic for `turn_ids` (block text stays sealed: only ids are read)."""
    from mars_tools.replay.readers import read_topics

    async def read() -> dict[str, ev.ViewBuilt]:
        found: dict[str, ev.ViewBuilt] = {}
        async for record in read_topics(serving.kafka_bootstrap, (TOPIC_VIEW,)):
            event = ev.ViewBuilt.FromString(record.value)
            if event.turn.turn_id in turn_ids:
                found[event.turn.turn_id] = event
        return found

    views: dict[str, ev.ViewBuilt] = {}

    def all_logged() -> bool:
        views.update(asyncio.run(read()))
        return set(views) == turn_ids

    kube.wait_for(all_logged, 60, "the views of the turns on the log")
    return views


def router_rows(serving: serving_cluster.ServingCluster) -> tuple[int, int]:
    """(ledger rows, decisions) of the router's Postgres tables."""
    import psycopg

    with psycopg.connect(serving.postgres_dsn) as conn:
        ledger = conn.execute("SELECT count(*) FROM router_ledger").fetchone()
        decisions = conn.execute("SELECT count(*) FROM router_decisions").fetchone()
    assert ledger is not None and decisions is not None
    return int(ledger[0]), int(decisions[0])


# --- the release -----------------------------------------------------------------------------------------


def test_every_service_and_the_gateway_run_ready_on_the_real_node(
    serving: serving_cluster.ServingCluster, release: float, prometheus: object
) -> None:
    """(Prometheus starts here, to see every turn of the session: test_serving_metrics.py.)"""
    pods = core(serving).list_namespaced_pod(NAMESPACE).items
    running = [p for p in pods if p.status.phase == "Running"]
    by_component: dict[str, int] = {}
    for pod in running:
        assert pod.spec.node_name == serving.node.name, pod.metadata.name
        assert pod.status.pod_ip.startswith("10.88."), pod.status.pod_ip
        ready = {c.type: c.status for c in pod.status.conditions or []}.get("Ready")
        assert ready == "True", pod.metadata.name
        component = pod.metadata.labels["app.kubernetes.io/component"]
        by_component[component] = by_component.get(component, 0) + 1
    assert by_component == {c: 2 for c in COMPONENTS}, by_component
    # The hook Jobs ran in containers (the master key through the API server's Service) and completed.
    completed = {
        e.involved_object.name
        for e in core(serving).list_namespaced_event(NAMESPACE).items
        if e.involved_object.kind == "Job" and e.reason == "Completed"
    }
    jobs = {f"{RELEASE}-master-key", f"{RELEASE}-identity", f"{RELEASE}-migrate", f"{RELEASE}-topics"}
    assert jobs <= completed, completed
    assert core(serving).read_namespaced_secret(f"{RELEASE}-master-key", NAMESPACE).data
    # The identity Job made the CA (its key Secret for itself), the bundle and the in-cluster identities,
    # none of them Helm's (so no rollback brings an old one back).
    for name in ("identity-ca-key", "identity-ca", "identity-ingress", "identity-replay"):
        secret = core(serving).read_namespaced_secret(f"{RELEASE}-{name}", NAMESPACE)
        assert secret.data and (secret.metadata.labels or {}).get("app.kubernetes.io/managed-by") != "Helm", (
            name
        )


def test_deploy_status_shows_every_deployment_ready_and_the_lag(
    serving: serving_cluster.ServingCluster, release: float
) -> None:
    status = mars_cli(
        serving,
        "deploy",
        "status",
        "--release",
        RELEASE,
        "-n",
        NAMESPACE,
        "--bootstrap",
        serving.kafka_bootstrap,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    for component in COMPONENTS:
        assert f"{RELEASE}-{component}" in status.stdout, status.stdout
    assert "consumer-group lag" in status.stdout and "mars-memory-view" in status.stdout, status.stdout


def test_turns_through_the_ingress_service_remember_across_sessions(
    serving: serving_cluster.ServingCluster, api_key: str
) -> None:
    """SendTurn and Converse through the ingress Service; the second session's view holds the first
    session's turns; the router's Postgres rows move."""
    ledger_before, decisions_before = router_rows(serving)
    user = f"user-{uuid.uuid4().hex[:8]}"
    stub = svc_grpc.IngressStub(
        ingress_channel(service_address(serving, "ingress"), api_key, INGRESS_OPTIONS)
    )
    first_session = [
        "I am planning a zebra safari in Kenya for my family in August.",
        "Which zebra parks are best in the dry season?",
        "Set a budget of 3000 dollars for the zebra safari.",
    ]
    first = [
        stub.SendTurn(svc.TurnRequest(tenant=TENANT, user_id=user, session_id="s1", text=t), timeout=120)
        for t in first_session
    ]
    assert all(r.text and r.model.startswith("standin-") for r in first), first
    second_session = [
        "Remind me what budget we set for the zebra safari in Kenya.",
        "And which zebra parks did we pick for the dry season?",
    ]
    requests = iter(
        [svc.TurnRequest(tenant=TENANT, user_id=user, session_id="s2", text=t) for t in second_session]
    )
    second = [r for r in stub.Converse(requests, timeout=120) if not r.partial]
    assert len(second) == 2 and all(r.text for r in second), second
    REPORT.append(f"turns answered through the ingress Service: {len(first) + len(second)}")

    views = view_events(serving, {r.turn_id for r in second})
    first_ids = {r.turn_id for r in first}
    sources = {b.source_turn_id for v in views.values() for b in v.view.blocks}
    assert first_ids & sources, f"no turn of session s1 in session s2's views: {sources}"

    def moved() -> bool:
        ledger, decisions = router_rows(serving)
        return ledger >= ledger_before + 5 and decisions >= decisions_before + 5

    kube.wait_for(moved, 120, "the router's rows for the five turns")


def test_the_openai_client_through_the_gateway_service(
    serving: serving_cluster.ServingCluster, api_key: str
) -> None:
    import openai

    client = openai.OpenAI(
        base_url=f"http://{service_address(serving, 'gateway')}/v1", api_key=api_key, max_retries=0
    )
    models = [m.id for m in client.models.list()]
    assert models[0] == "mars" and {"standin-short", "standin-long"} <= set(models), models
    answered = 0
    for text in ("Plan three days in Kyoto.", "Make day two less busy."):
        completion = client.chat.completions.create(
            model="mars",
            user="gateway-user",
            metadata={"session_id": "kyoto"},
            messages=[{"role": "user", "content": text}],
            max_tokens=16,
        )
        assert completion.choices[0].message.content
        assert completion.model in {"standin-short", "standin-long"}
        answered += 1
    REPORT.append(f"turns answered through the gateway Service (openai client): {answered}")


def test_a_service_name_resolves_only_inside_the_cluster_domain(
    serving: serving_cluster.ServingCluster,
) -> None:
    """CoreDNS answers the cluster's names with the Services' ClusterIPs (through the kube-dns Service),
    and nothing outside the cluster domain (no forwarder: no query leaves the machine)."""
    ingress_ip = service_address(serving, "ingress").split(":")[0]
    name = f"{RELEASE}-ingress.{NAMESPACE}.svc.cluster.local"
    assert resolve(name) == [ingress_ip]
    assert resolve(serving_cluster.KAFKA_SERVICE) == [
        core(serving).read_namespaced_service("kafka", serving_cluster.INFRA_NAMESPACE).spec.cluster_ip
    ]
    assert resolve("example.com") == []


def resolve(name: str) -> list[str]:
    """A/IN lookup of `name` at the cluster DNS Service (a bare DNS query over UDP)."""
    import socket
    import struct

    from mars_stack import node_net

    query_id = 0x4D41
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".")) + b"\0"
    packet = struct.pack(">HHHHHH", query_id, 0x0100, 1, 0, 0, 0) + question + struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        s.sendto(packet, (node_net.DNS_SERVICE_IP, 53))
        reply, _ = s.recvfrom(4096)
    answers = struct.unpack(">H", reply[6:8])[0]
    offset = 12 + len(question) + 4
    addresses = []
    for _ in range(answers):
        offset += 2 if reply[offset] & 0xC0 else len(reply[offset:].split(b"\0", 1)[0]) + 1
        kind, _cls, _ttl, length = struct.unpack(">HHIH", reply[offset : offset + 10])
        offset += 10
        if kind == 1:
            addresses.append(socket.inet_ntoa(reply[offset : offset + length]))
        offset += length
    return addresses


def test_bad_input_through_the_service_is_invalid_argument(
    serving: serving_cluster.ServingCluster, api_key: str
) -> None:
    stub = svc_grpc.IngressStub(
        ingress_channel(service_address(serving, "ingress"), api_key, INGRESS_OPTIONS)
    )
    with pytest.raises(grpc.RpcError) as refused:
        stub.SendTurn(svc.TurnRequest(tenant=TENANT, user_id="u", session_id="s", text=""), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
