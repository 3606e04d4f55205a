"""Fuzzing on one running stack (issue 16, item 7; Apache Kafka, Postgres, the stand-in LLM, the six
services): first the stage consumers, then the internal gRPC services. One stack for both, since neither
part reads another's effects (issue 46: fewer stack starts).

The consumers: hypothesis-drawn malformed and adversarial events on every consumed topic.

The short run of `load-tests/fuzz.py` (the full one sends 1,000 events, see load-tests/README.md): random
bytes, truncated protobufs, another message type, invalid UTF-8, NUL in ids and text, ~1 MB texts,
unknown schema_version, seq <= 0, missing ids, keys that disagree with the envelope, non-finite numbers,
bodies fuzzed field by field, replays of answered turns, garbage on the dead-letter topic. Afterwards:
no process exited, every malformed event was dead-lettered by every consumer group of its topic with a
reason naming the problem, no handler failed on an unexpected exception, replays had no second effect,
valid turns sent after the storm were answered, and every stage group's lag is back to 0.

The RPCs: hypothesis-drawn requests against StateEstimator.Estimate, Memory.BuildView / DescribeIndex,
Router.Route / GetPolicy / ResetPolicy, Dispatch.Generate / ListModels and Judge.Score on a running stack:
arbitrary unicode with NUL, huge strings, extreme integers, NaN and infinite doubles, unknown enum values,
random maps and repeated fields, empty messages; half of them with valid ids so they reach past the first
check. No request may end INTERNAL, UNKNOWN (an exception the servicer did not map) or DEADLINE_EXCEEDED (a
hang): bad input gets INVALID_ARGUMENT (or another specific status) with a message, valid input OK. A
failing request is shrunk by hypothesis to the smallest one that fails. Every process is still up
afterwards. The full run (10,000 requests) is `load-tests/fuzz.py --events 0 --requests 10000`."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from conftest import REPO, require_kafka, start_stack
from mars_stack import LocalStack

pytestmark = pytest.mark.integration

#: Fuzz events in the suite's run (about 14 of each kind).
EVENTS = 210
#: Requests per method in the suite's run.
PER_METHOD = 40


def load_fuzz() -> ModuleType:
    """load-tests/fuzz.py as a module (the harness and these tests share its generators and checks)."""
    if "mars_fuzz" in sys.modules:
        return sys.modules["mars_fuzz"]
    spec = importlib.util.spec_from_file_location("mars_fuzz", REPO / "load-tests" / "fuzz.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mars_fuzz"] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fuzz_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    require_kafka()
    s = start_stack(
        tmp_path_factory.mktemp("fuzz"),
        str(REPO / "config" / "models.standin.yaml"),
        llm="standin",
        service_env={"memory": {"MARS_MEMORY_READ_YOUR_WRITES_WAIT_S": "5"}},
    )
    try:
        yield s
    finally:
        s.stop()


def test_malformed_events_are_dead_lettered_and_the_consumers_go_on(fuzz_stack: LocalStack) -> None:
    fuzz = load_fuzz()
    report = fuzz.fuzz_consumers(fuzz_stack, EVENTS, rng_seed=16)
    summary = {k: v for k, v in vars(report).items() if k not in ("reasons", "tolerated_reasons")}

    assert report.events == EVENTS
    assert set(report.by_kind) == set(fuzz.KINDS), report.by_kind
    assert report.refused_by_broker == 0, summary
    # No process exited (the launcher would have restarted it) and every one still runs.
    assert report.crashes == [], report.crashes
    assert all(alive for _, alive in fuzz_stack.alive())
    # Every malformed event: a dead letter from every stage group reading its topic, naming the problem.
    assert report.must_dead_letter >= EVENTS // 2, summary
    assert report.not_dead_lettered == [], report.not_dead_lettered
    assert report.dead_lettered == report.must_dead_letter
    assert report.vague_reasons == [], report.vague_reasons
    # Bad input is recognised as such: no handler failed on an unexpected exception (retried, then
    # dead-lettered as "handler failed after N attempts").
    assert report.handler_failures == [], report.handler_failures
    # Replayed turns: no second state, view, route, answer, judgement, router update or memory record.
    assert report.by_kind.get("replay", 0) > 0
    assert report.duplicate_effects == [], report.duplicate_effects
    # The consumers went on: valid turns after the storm were answered end to end, nothing is stuck.
    assert report.valid_turns > 0 and report.unanswered == [], summary
    assert report.lag == {}, report.lag


@pytest.mark.parametrize("rpc", load_fuzz().INTERNAL_RPCS, ids=lambda r: f"{r.service}.{r.method}")
def test_no_request_ends_internal_or_unknown(fuzz_stack: LocalStack, rpc: Any) -> None:
    fuzz = load_fuzz()
    report = fuzz.RpcReport()
    fuzz.fuzz_rpc(fuzz_stack, rpc, PER_METHOD, report, rng_seed=16, strict=True)
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


def test_every_service_is_still_up(fuzz_stack: LocalStack) -> None:
    assert [e for e in fuzz_stack.events if e.kind == "exited"] == []
    assert all(alive for _, alive in fuzz_stack.alive())
