"""Fuzzing the internal gRPC services (issue 16, item 7): hypothesis-drawn requests against
StateEstimator.Estimate, Memory.BuildView / DescribeIndex, Router.Route / GetPolicy / ResetPolicy,
Dispatch.Generate / ListModels and Judge.Score on a running stack: arbitrary unicode with NUL, huge
strings, extreme integers, NaN and infinite doubles, unknown enum values, random maps and repeated fields,
empty messages; half of them with valid ids so they reach past the first check.

No request may end INTERNAL, UNKNOWN (an exception the servicer did not map) or DEADLINE_EXCEEDED (a
hang): bad input gets INVALID_ARGUMENT (or another specific status) with a message, valid input OK. A
failing request is shrunk by hypothesis to the smallest one that fails. Every process is still up
afterwards. The full run (10,000 requests) is `load-tests/fuzz.py --events 0 --requests 10000`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import REPO, require_kafka, start_stack
from mars_stack import LocalStack
from test_fuzz_consumers import load_fuzz

pytestmark = pytest.mark.integration

fuzz = load_fuzz()
#: Requests per method in the suite's run.
PER_METHOD = 40


@pytest.fixture(scope="module")
def rpc_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    require_kafka()
    s = start_stack(
        tmp_path_factory.mktemp("fuzz-rpcs"), str(REPO / "config" / "models.standin.yaml"), llm="standin"
    )
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("rpc", fuzz.INTERNAL_RPCS, ids=lambda r: f"{r.service}.{r.method}")
def test_no_request_ends_internal_or_unknown(rpc_stack: LocalStack, rpc: Any) -> None:
    report = fuzz.RpcReport()
    fuzz.fuzz_rpc(rpc_stack, rpc, PER_METHOD, report, rng_seed=16, strict=True)
    assert report.bad == []
    assert report.requests >= min(PER_METHOD, 2)
    assert set(report.codes) <= {
        "OK",
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "FAILED_PRECONDITION",
        "RESOURCE_EXHAUSTED",
        "UNAVAILABLE",
    }, report.codes
    # Valid requests still get answers.
    assert report.codes.get("OK", 0) > 0, report.codes


def test_every_service_is_still_up(rpc_stack: LocalStack) -> None:
    assert [e for e in rpc_stack.events if e.kind == "exited"] == []
    assert all(alive for _, alive in rpc_stack.alive())
