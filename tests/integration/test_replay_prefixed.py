"""Per-run topic prefixes against the real broker: a pipeline started with MARS_TOPIC_PREFIX writes only to
its prefixed topics, `replay read --topic-prefix` reads them back as complete traces, and `replay run`
re-drives the log through a stack of its own with an ablation preset and compares the two runs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from conftest import HERE, ingress_stub, keys_env, start_stack, wait_judged
from mars.config import ALL_TOPICS, Topics
from mars.v1 import services_pb2 as svc
from mars_stack import LocalStack, stack_kafka_options

pytestmark = pytest.mark.integration

PREFIX, TURNS = "it7.", 3


@pytest.fixture(scope="module")
def prefixed_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(
        tmp_path_factory.mktemp("prefixed"),
        "models.standin-test.yaml",  # the stand-in LLM: no test here reads the answers' words
        llm="standin",
        service_env={"dispatch": {"MARS_DISPATCH_DEFAULT_MAX_TOKENS": "8"}},
        topic_prefix=PREFIX,
    )
    try:
        stub = ingress_stub(s, "px")
        replies = [
            stub.SendTurn(
                svc.TurnRequest(tenant="px", user_id="u1", session_id="s", text=f"Question {i} about tea."),
                timeout=180,
            )
            for i in range(TURNS)
        ]
        wait_judged(s, [r.turn_id for r in replies])  # exports stop at the log's end: every turn there
        yield s
    finally:
        s.stop()


def mars(*args: str, stack: LocalStack | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI; with `stack`, able to open that stack's sealed event text (keys_env)."""
    exe = str(Path(sys.executable).parent / "mars")
    env = keys_env(stack) if stack is not None else None
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=540, check=False, env=env)


def list_topics(bootstrap: str) -> set[str]:
    async def run() -> set[str]:
        admin = AIOKafkaAdminClient(**stack_kafka_options(bootstrap))
        await admin.start()
        try:
            return set(await admin.list_topics())
        finally:
            await admin.close()

    return asyncio.run(run())


def test_prefixed_run_writes_only_prefixed_topics_and_reads_back(
    prefixed_stack: LocalStack, tmp_path: Path
) -> None:
    bootstrap = prefixed_stack.env["MARS_KAFKA_BOOTSTRAP"]
    topics = list_topics(bootstrap)
    assert set(Topics(PREFIX).all) <= topics
    assert not topics & set(ALL_TOPICS)  # no service touched a plain topic name
    run = mars(
        "replay", "read", "--bootstrap", bootstrap, "--topic-prefix", PREFIX, "--until", "quiet", "--idle-s", "2",
        "--summary", str(tmp_path / "summary.json"), stack=prefixed_stack,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["turns"] == summary["complete"] == TURNS and summary["incomplete"] == {}
    bad = mars("replay", "read", "--bootstrap", bootstrap, "--topic-prefix", "no/slash", stack=prefixed_stack)
    assert bad.returncode == 2 and "characters Kafka does not allow" in bad.stderr


def test_replay_run_with_a_preset_on_a_stack_of_its_own(prefixed_stack: LocalStack, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    export = mars(
        "replay", "export", "--bootstrap", prefixed_stack.env["MARS_KAFKA_BOOTSTRAP"],
        "--topic-prefix", PREFIX, "--out", str(log), stack=prefixed_stack,
    )  # fmt: skip
    assert export.returncode == 0, export.stderr[-2000:]
    # Exports carry the base topic names, so a prefixed run's file reads like any other.
    assert {json.loads(line)["topic"] for line in log.read_text().splitlines()} <= set(ALL_TOPICS)
    run = mars(
        "replay", "run", "--file", str(log), "--model-pool", str(HERE / "models.standin-test.yaml"),
        "--config", "lambda-0.5", "--config", "fixed:standin-short", "--set", "MARS_DISPATCH_DEFAULT_MAX_TOKENS=8",
        "--topic-prefix", "rerun.", "--strict", "--summary", str(tmp_path / "compare.json"),
        "--traces", str(tmp_path / "traces"),
        stack=prefixed_stack,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "recorded run vs re-drive" in run.stdout and "mean reward" in run.stdout
    s = json.loads((tmp_path / "compare.json").read_text())
    assert s["topic_prefix"] == "rerun." and s["answered"] == TURNS
    assert s["overrides"]["MARS_JUDGE_LAMBDA_COST"] == "0.5"
    assert s["recorded"]["complete"] == s["redriven"]["complete"] == TURNS
    # The recorded run fell back from the broken first arm; the fixed arm answers every re-driven turn.
    assert s["recorded"]["fallbacks"] >= 1 and s["redriven"]["fallbacks"] == 0
    redriven = [
        json.loads(line) for line in (tmp_path / "traces" / "redriven.jsonl").read_text().splitlines()
    ]
    assert {t["generated"]["model"] for t in redriven} == {"standin-short"}
    assert {t["judged"]["lambda_cost"] for t in redriven} == {0.5}
