"""The metrics over a real stack: every service serves Prometheus on its own MARS_METRICS_PORT, and after a
few turns each stage's consumer group has handler timings and queue delays, its lag gauge, the judge has
costs by tenant and component, dispatch its attempts and circuit states, and no series carries a per-user
label anywhere; and every series the chart's Grafana dashboard queries is one a service serves."""

from __future__ import annotations

import json
import re
import socket
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
import yaml
from conftest import REPO, api_key, ingress_stub, start_stack, wait_for
from mars import topology
from mars.topology import STAGE_GROUPS
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_ingress.client import ingress_channel
from mars_stack import LocalStack
from mars_stack.canary import rollout_turns, start_canary_run
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

TENANT = "metrics"
USERS = ("u-metrics-1", "u-metrics-2")
TURNS_PER_USER = 2
FORBIDDEN_LABELS = {"user", "user_id", "session", "session_id", "turn", "turn_id"}
#: The groups each service's consumers join (each ingress replica's reply reader has its own name).
GROUPS: dict[str, set[str]] = defaultdict(set)
for _group in STAGE_GROUPS:
    GROUPS[_group.service].add(_group.name)
GROUPS["ingress"].add("ingress-replies")

Sample = tuple[str, dict[str, str], float]
#: The ingress's concurrency limit held at 2 (mars_ingress.capacity), so that a burst is shed for sure.
SHEDDING = {
    "MARS_INGRESS_ADMISSION_LIMIT": "true",
    "MARS_INGRESS_ADMISSION_INITIAL_LIMIT": "2",
    "MARS_INGRESS_ADMISSION_MIN_LIMIT": "2",  # held at 2: a burst drains within the retries even under load
    "MARS_INGRESS_ADMISSION_MAX_LIMIT": "2",
    "MARS_INGRESS_ADMISSION_RETRY_AFTER_MS": "700",
}
BURST = 12
#: A tenant whose turn quota is one burst of BURST turns, refilled at one turn per 1000 s: what a shed turn
#: would take from it shows as turns refused for quota later.
CAPPED = "capped"
SHEDDING["MARS_INGRESS_QUOTA_TENANTS"] = json.dumps({CAPPED: {"turns_per_s": 0.001, "turn_burst": BURST}})
DASHBOARD = REPO / "charts" / "mars" / "dashboards" / "mars.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def metrics_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, dict[str, int]]]:
    ports = {service: _free_port() for service in topology.NAMES}
    s = start_stack(
        tmp_path_factory.mktemp("metrics"),
        str(REPO / "config" / "models.standin.yaml"),
        llm="standin",
        service_env={
            service: {"MARS_METRICS_PORT": str(port), **(SHEDDING if service == "ingress" else {})}
            for service, port in ports.items()
        },
    )
    try:
        yield s, ports
    finally:
        s.stop()


@pytest.fixture(scope="module")
def turns(metrics_stack: tuple[LocalStack, dict[str, int]]) -> list[svc.TurnReply]:
    stack, _ = metrics_stack
    pool = yaml.safe_load((REPO / "config" / "models.standin.yaml").read_text())
    start_canary_run(stack.env["MARS_POSTGRES_DSN"], TENANT, [m["name"] for m in pool["models"]])
    stub = ingress_stub(stack, TENANT)
    replies = []
    for user in USERS:
        for i in range(TURNS_PER_USER):
            replies.append(
                stub.SendTurn(
                    svc.TurnRequest(
                        tenant=TENANT,
                        user_id=user,
                        session_id="s1",
                        text=f"Plan a short trip to Lisbon, step {i + 1}.",
                    ),
                    timeout=120,
                )
            )
    wait_for(
        lambda: rollout_turns(stack.env["MARS_POSTGRES_DSN"], TENANT) == len(replies),
        what="the canary run's test to hold every judged turn",
    )
    return replies


@pytest.fixture(scope="module")
def burst(metrics_stack: tuple[LocalStack, dict[str, int]]) -> dict[str, list[Any]]:
    """BURST turns of one tenant at once, and one turn of another tenant among them: per tenant, each
    turn's reply or its grpc.RpcError."""
    stack, _ = metrics_stack
    # Without gRPC's own retries (mars_ingress.client would send a shed turn again after its pushback).
    stubs = {
        tenant: svc_grpc.IngressStub(
            ingress_channel(stack.addr("ingress"), api_key(stack, tenant), [("grpc.enable_retries", 0)])
        )
        for tenant in (TENANT, "quiet")
    }
    return _send_burst(stubs)


def _send_burst(stubs: dict[str, svc_grpc.IngressStub], tenant: str = TENANT) -> dict[str, list[Any]]:
    """BURST turns of `tenant` at once, with one turn of "quiet" among them when `stubs` has it."""
    calls = [(tenant, i) for i in range(BURST)]
    if "quiet" in stubs:
        calls.insert(BURST // 2, ("quiet", 0))
    futures = [
        (
            tenant,
            stubs[tenant].SendTurn.future(
                svc.TurnRequest(
                    tenant=tenant, user_id=f"u-burst-{i}", session_id=f"b{i}", text=f"Burst turn {i}."
                ),
                timeout=120,
            ),
        )
        for tenant, i in calls
    ]
    out: dict[str, list[Any]] = defaultdict(list)
    for tenant, future in futures:
        try:
            out[tenant].append(future.result())
        except grpc.RpcError as exc:
            out[tenant].append(exc)
    return out


def test_a_burst_beyond_the_limit_is_shed_at_once_and_another_tenant_still_gets_in(
    metrics_stack: tuple[LocalStack, dict[str, int]], burst: dict[str, list[Any]]
) -> None:
    _, ports = metrics_stack
    refused = [r for r in burst[TENANT] if isinstance(r, grpc.RpcError)]
    answered = [r for r in burst[TENANT] if isinstance(r, svc.TurnReply)]
    assert answered and refused, "a burst of 12 over a limit of 2 has turns both ways"
    assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused), [r.code() for r in refused]
    assert all("at capacity" in (r.details() or "") for r in refused)
    hints = [int(dict(r.trailing_metadata() or ())["retry-after-ms"]) for r in refused]
    assert all(350 <= h <= 1050 for h in hints), hints  # 700 ms spread over 0.5x to 1.5x
    # A tenant with no turn in flight is under its share: it gets in however full the limit is.
    assert [type(r) for r in burst["quiet"]] == [svc.TurnReply]
    samples = scrape(ports["ingress"])
    assert total(samples, "mars_admission_shed_total", tenant=TENANT) == len(refused)
    assert total(samples, "mars_admission_shed_total", tenant="quiet") == 0
    assert 1 <= total(samples, "mars_admission_limit") <= 2
    assert total(samples, "mars_admission_inflight") == 0  # every slot given back


def test_a_client_that_retries_on_the_pushback_gets_the_whole_burst_answered(
    metrics_stack: tuple[LocalStack, dict[str, int]], burst: dict[str, list[Any]]
) -> None:
    stack, ports = metrics_stack
    shed_before = total(scrape(ports["ingress"]), "mars_admission_shed_total", tenant=TENANT)
    again = _send_burst({TENANT: ingress_stub(stack, TENANT), "quiet": ingress_stub(stack, "quiet")})
    assert all(isinstance(r, svc.TurnReply) for replies in again.values() for r in replies), again
    # Answered because gRPC sent shed turns again after the 700 ms pushback, not because none was shed.
    assert total(scrape(ports["ingress"]), "mars_admission_shed_total", tenant=TENANT) > shed_before


def test_a_turn_shed_at_capacity_takes_nothing_from_its_tenants_quota(
    metrics_stack: tuple[LocalStack, dict[str, int]],
) -> None:
    """A burst of BURST turns over the limit of 2, then turns one by one: the tenant's quota of BURST turns
    is charged for the turns let in only, so exactly BURST turns in all are answered before the first
    refusal for quota (charged at the door, each shed turn would have drained it with the burst)."""
    stack, _ = metrics_stack
    stub = svc_grpc.IngressStub(
        ingress_channel(stack.addr("ingress"), api_key(stack, CAPPED), [("grpc.enable_retries", 0)])
    )
    shed = [r for r in _send_burst({CAPPED: stub}, CAPPED)[CAPPED] if isinstance(r, grpc.RpcError)]
    assert shed, "a burst of 12 over a limit of 2 has turns shed"
    assert all("at capacity" in (r.details() or "") for r in shed), [r.details() for r in shed]
    answered = BURST - len(shed)
    outcome: grpc.RpcError | None = None
    for i in range(BURST + 1):  # one by one, so none is shed: at most BURST - answered get in
        try:
            stub.SendTurn(
                svc.TurnRequest(
                    tenant=CAPPED, user_id="u-capped", session_id="c", text=f"After the burst {i}."
                ),
                timeout=120,
            )
        except grpc.RpcError as exc:
            outcome = exc
            break
        answered += 1
    assert outcome is not None and outcome.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "over its quota" in (outcome.details() or ""), outcome.details()
    assert answered == BURST


def scrape(port: int) -> list[Sample]:
    body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return [
        (sample.name, dict(sample.labels), float(sample.value))
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    ]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    return sum(v for n, ls, v in samples if n == name and all(ls.get(k) == x for k, x in labels.items()))


def groups_with(samples: list[Sample], name: str, **labels: str) -> set[str]:
    """The `group` labels of the samples of `name` (with `labels`) whose value is above zero."""
    return {
        ls["group"]
        for n, ls, v in samples
        if n == name and v > 0 and all(ls.get(k) == x for k, x in labels.items())
    }


def test_every_stage_has_timings_queue_delays_and_lag(
    metrics_stack: tuple[LocalStack, dict[str, int]], turns: list[svc.TurnReply]
) -> None:
    _, ports = metrics_stack
    assert len(turns) == len(USERS) * TURNS_PER_USER and all(r.text for r in turns)
    missing: dict[str, set[str]] = {}

    def all_timed() -> bool:
        # The learning path (memory writer, judge, router updates) runs after the reply: wait for it.
        missing.clear()
        for service, port in ports.items():
            samples = scrape(port)
            timed = groups_with(samples, "mars_stage_duration_milliseconds_count", outcome="ok")
            if GROUPS[service] - timed:
                missing[service] = GROUPS[service] - timed
        return not missing

    wait_for(all_timed, timeout_s=60, what=f"mars.stage.duration of every group (missing: {missing})")
    for service, port in ports.items():
        samples = scrape(port)
        delayed = groups_with(samples, "mars_stage_queue_delay_milliseconds_count")
        assert GROUPS[service] <= delayed, (service, delayed)
        lag_groups = {ls["group"] for n, ls, _ in samples if n == "mars_consumer_lag"}
        assert GROUPS[service] <= lag_groups, (service, lag_groups)
        assert all(v >= 0 for n, _, v in samples if n == "mars_consumer_lag")
        series = [(n, tuple(sorted(ls.items()))) for n, ls, _ in samples]
        assert len(series) == len(set(series)), f"{service} reports a series twice"
        # Histogram buckets are cumulative: the +Inf bucket holds every call.
        assert total(samples, "mars_stage_duration_milliseconds_bucket", le="+Inf") == total(
            samples, "mars_stage_duration_milliseconds_count"
        )


def test_costs_by_tenant_and_component_in_judge(
    metrics_stack: tuple[LocalStack, dict[str, int]], turns: list[svc.TurnReply]
) -> None:
    _, ports = metrics_stack
    expected_generator = sum(r.cost_usd for r in turns)
    assert expected_generator > 0

    def generator_cost() -> float:
        return total(scrape(ports["judge"]), "mars_cost_usd_USD_total", tenant=TENANT, component="generator")

    wait_for(lambda: generator_cost() >= expected_generator * 0.999, timeout_s=60, what="generator costs")
    samples = scrape(ports["judge"])
    components = {ls["component"] for n, ls, _ in samples if n == "mars_cost_usd_USD_total"}
    assert components == {"generator", "controller", "judge"}
    assert total(samples, "mars_judge_outcomes_total") >= len(turns)


def test_dispatch_attempts_circuits_and_qtm_outcomes(
    metrics_stack: tuple[LocalStack, dict[str, int]], turns: list[svc.TurnReply]
) -> None:
    _, ports = metrics_stack
    dispatch = scrape(ports["dispatch"])
    assert total(dispatch, "mars_dispatch_attempts_total", outcome="ok") >= len(turns)
    circuits = {ls["arm"]: v for n, ls, v in dispatch if n == "mars_circuit_state"}
    assert circuits == {"standin-short": 0.0, "standin-long": 0.0}
    assert total(scrape(ports["state"]), "mars_qtm_outcomes_total") >= len(turns)


def test_turns_by_status_and_tenant_at_ingress(
    metrics_stack: tuple[LocalStack, dict[str, int]], turns: list[svc.TurnReply]
) -> None:
    _, ports = metrics_stack
    samples = scrape(ports["ingress"])
    assert total(samples, "mars_turns_total", status="answered", tenant=TENANT) >= len(turns)


def test_no_series_has_a_per_user_label(
    metrics_stack: tuple[LocalStack, dict[str, int]], turns: list[svc.TurnReply]
) -> None:
    _, ports = metrics_stack
    for service, port in ports.items():
        labels = {k for _, ls, _ in scrape(port) for k in ls}
        assert labels and not labels & FORBIDDEN_LABELS, (service, sorted(labels))
        values = {v for _, ls, _ in scrape(port) for v in ls.values()}
        assert not values & set(USERS), service
        assert not values & {r.turn_id for r in turns}, service


# --- the Grafana dashboard's queries ------------------------------------------------------------------------

#: PromQL words that look like identifiers but name no series (`bool`, `offset`, set operators, ...).
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
    "offset", "atan2", "inf", "nan",
}  # fmt: skip
#: The series a family of each type serves (prometheus_client's parser names a counter's family without
#: `_total`).
SERIES_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_IDENTIFIER = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")


def promql_metrics(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers that are not a function call, a PromQL word,
    or inside a string, label matchers `{...}`, a range `[...]`, a `by (...)`-style clause or a Grafana
    variable."""
    text = _STRING.sub(" ", expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    text = re.sub(r"\$\{[^}]*\}|\$\w+", " ", text)
    return {m for m in _IDENTIFIER.findall(text) if m.lower() not in PROMQL_WORDS}


def call_arguments(expr: str, function: str) -> list[str]:
    """The argument text of each call of `function` in `expr` (parentheses balanced, strings skipped)."""
    masked = _STRING.sub(lambda m: "_" * len(m.group()), expr)
    out = []
    for match in re.finditer(rf"\b{function}\s*\(", masked):
        depth, start = 1, match.end()
        for i in range(start, len(masked)):
            depth += {"(": 1, ")": -1}.get(masked[i], 0)
            if depth == 0:
                out.append(expr[start:i])
                break
    return out


def dashboard_queries() -> dict[str, list[str]]:
    """Each panel's PromQL (by title), and the template variables' queries (as "$name")."""
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    queries: dict[str, list[str]] = defaultdict(list)
    for panel in dashboard["panels"]:
        queries[panel["title"]] += [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else query
        if var.get("type") == "query" and text:
            # label_values(selector, label): the label is no series.
            labels = re.fullmatch(r"\s*label_values\((.*?)(?:,\s*\w+)?\)\s*", text)
            queries[f"${var['name']}"].append(labels.group(1) if labels else text)
    return queries


def served_series(ports: dict[str, int]) -> dict[str, tuple[str, str]]:
    """Every series name some service serves -> its family and type."""
    out: dict[str, tuple[str, str]] = {}
    for port in ports.values():
        body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                out[sample.name] = (family.name, family.type)
    return out


def family_of(name: str, served: dict[str, tuple[str, str]]) -> tuple[str, str] | None:
    """The served family (and type) `name` is a series of: its name plus the type's suffix."""
    found = served.get(name)
    if found is None:
        return None
    family, kind = found
    return found if any(name == family + suffix for suffix in SERIES_SUFFIXES.get(kind, ())) else None


def test_promql_metrics_finds_the_series_names() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, group) (rate(mars_x_bucket{outcome="ok", group=~"$g"}'
        "[$__rate_interval]))) / on (group) group_left sum without (topic) (mars_y) * 1e3 > bool 0"
        " unless max(mars_z offset 5m) or absent(mars_w[${__range}:1m])"
    )
    assert promql_metrics(expr) == {"mars_x_bucket", "mars_y", "mars_z", "mars_w"}
    assert call_arguments('sum(rate(a[1m])) + rate(b{c="("}[1m])', "rate") == ["a[1m]", 'b{c="("}[1m]']


def test_every_series_on_the_dashboard_is_served(
    metrics_stack: tuple[LocalStack, dict[str, int]], turns: list[svc.TurnReply], burst: dict[str, list[Any]]
) -> None:
    _, ports = metrics_stack
    queries = dashboard_queries()
    wanted = {(title, name) for title, exprs in queries.items() for e in exprs for name in promql_metrics(e)}
    assert {title for title, _ in wanted} == set(queries), "a panel or variable selects no series"
    # The learning path's series (cost, judge outcomes) appear after the replies: wait for them.

    def all_served() -> bool:
        served = served_series(ports)
        return all(family_of(name, served) for _, name in wanted)

    try:
        wait_for(all_served, timeout_s=60, what="every series the dashboard queries")
    except AssertionError:
        pass  # named below
    served = served_series(ports)
    unserved = sorted((title, name) for title, name in wanted if family_of(name, served) is None)
    assert not unserved, f"the dashboard queries series no service serves: {unserved}"
    for title, exprs in queries.items():
        for expr in exprs:
            for arg in call_arguments(expr, "histogram_quantile"):
                for name in promql_metrics(arg):
                    assert served[name][1] == "histogram" and name.endswith("_bucket"), (title, name)
            for function in ("rate", "irate", "increase"):
                for arg in call_arguments(expr, function):
                    for name in promql_metrics(arg):
                        assert served[name][1] in ("counter", "histogram"), (title, function, name)
