"""`mars replay read/export` against the real broker: 50 turns come back as 50 complete traces, and a log
with a missing stage, a duplicate, an unknown schema version and a truncated line is reported, not fatal."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ingress_stub, keys_env, talk_concurrently, wait_judged
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars_stack import LocalStack

pytestmark = pytest.mark.integration

USERS, TURNS = 5, 10


@dataclass(frozen=True)
class Logged:
    """The stand-in stack this module shares with test_eval and test_feedback (conftest.standin_stack), and
    where its own turns begin on the log: every read and export here starts there, so the log is this
    module's 50 turns alone."""

    stack: LocalStack
    since_ms: int


@pytest.fixture(scope="module")
def logged(standin_stack: LocalStack) -> Logged:
    s = standin_stack
    since_ms = int(time.time() * 1000)
    turn_ids: list[str] = []

    def talk(user: str) -> None:
        stub = ingress_stub(s, "rp")
        for i in range(TURNS):
            request = svc.TurnRequest(tenant="rp", user_id=user, session_id="s", text=f"Question {i} about tea.")
            turn_ids.append(stub.SendTurn(request, timeout=180).turn_id)

    talk_concurrently([f"r{u}" for u in range(USERS)], talk)
    wait_judged(s, turn_ids)  # the reads below stop at the log's end: every trace complete by then
    return Logged(s, since_ms)


def mars(*args: str, stack: LocalStack | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI; with `stack`, able to open that stack's sealed event text (keys_env) and to read the router's
    policy as the replay tool (its service identity)."""
    exe = str(Path(sys.executable).parent / "mars")
    env = {**keys_env(stack), **stack.identity_env("replay")} if stack is not None else None
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, check=False, env=env)


def export(log: Logged, path: Path) -> None:
    run = mars(
        "replay", "export", "--bootstrap", log.stack.env["MARS_KAFKA_BOOTSTRAP"], "--since-ms", str(log.since_ms),
        "--out", str(path), stack=log.stack,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]


def test_fifty_turns_read_back_as_fifty_complete_traces(logged: Logged, tmp_path: Path) -> None:
    run = mars(
        "replay", "read", "--bootstrap", logged.stack.env["MARS_KAFKA_BOOTSTRAP"], "--since-ms", str(logged.since_ms),
        "--out", str(tmp_path / "traces.jsonl"), "--summary", str(tmp_path / "summary.json"),
        stack=logged.stack,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["turns"] == summary["complete"] == USERS * TURNS and summary["incomplete"] == {}
    assert summary["fallbacks"] >= USERS  # each user's first turn falls back from the broken endpoint
    assert summary["cost_usd"]["feedback_inclusive"] >= summary["cost_usd"]["generation_controller"] > 0
    assert summary["routing_share"] and "received->state" in summary["stage_latency_ms"]
    traces = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    assert len(traces) == USERS * TURNS and all(t["complete"] for t in traces)
    assert "traces/s" in run.stderr
    report = mars("replay", "report", str(tmp_path / "traces.jsonl"), "--out", str(tmp_path / "report"))
    assert report.returncode == 0, report.stderr[-2000:]
    for name in ("report.md", "quality_vs_cost.png", "reward_over_time.png", "routing_share_traces.png"):
        assert (tmp_path / "report" / name).stat().st_size > 0


def test_exported_log_with_defects_is_reported(logged: Logged, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    export(logged, log)
    lines = log.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    judged = [i for i, r in enumerate(records) if r["topic"] == "mars.turn.judged"]
    received = next(r for r in records if r["topic"] == "mars.turn.received")
    dropped = lines.pop(judged[0])  # one turn loses its judged event
    lines.append(lines[0])  # a duplicated record
    future = ev.TurnReceived.FromString(base64.b64decode(received["value"]))
    future.turn.turn_id, future.turn.schema_version = "from-the-future", 99
    lines.append(json.dumps(dict(received, value=base64.b64encode(future.SerializeToString()).decode())))
    lines.append(lines[1][: len(lines[1]) // 2])  # a truncated last line
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines))
    run = mars("replay", "read", "--file", str(bad), "--summary", str(tmp_path / "s.json"))
    assert run.returncode == 0, run.stderr[-2000:]
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["turns"] == USERS * TURNS and s["complete"] == USERS * TURNS - 1
    assert s["incomplete"] == {"judged": 1}
    assert s["records"]["duplicate_events"] == 1 and s["records"]["unknown_schema_version"] == 1
    assert s["records"]["unreadable_lines"] == 1
    assert json.loads(dropped)["topic"] == "mars.turn.judged"


def test_ope_on_the_logged_turns_matches_the_traces(logged: Logged, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    export(logged, log)
    read = mars("replay", "read", "--file", str(log), "--out", str(tmp_path / "traces.jsonl"))
    assert read.returncode == 0, read.stderr[-2000:]
    steps = []
    for t in map(json.loads, (tmp_path / "traces.jsonl").read_text().splitlines()):
        routed, judged = t.get("routed"), t.get("judged")
        if routed is None or judged is None:
            continue
        chosen = routed["chosen_arm"]
        # A fallback turn: the chosen arm failed and earns 0, as the router learns it.
        reward = judged.get("reward", 0.0) if judged.get("arm") == chosen else 0.0
        steps.append((chosen, routed.get("propensity", 0.0), reward))
    known = [s for s in steps if s[1] > 0]
    assert len(steps) >= USERS * TURNS and known
    arm = max({s[0] for s in known}, key=lambda a: sum(1 for s in known if s[0] == a))
    out = tmp_path / "ope.json"
    run = mars("replay", "ope", "--file", str(log), "--policy", f"fixed:{arm}", "uniform", "--out", str(out))
    assert run.returncode == 0, run.stderr[-2000:] + run.stdout[-2000:]
    report = json.loads(out.read_text())
    assert report["logged_turns"] == len(steps)
    fixed = report[f"fixed:{arm}"]
    assert fixed["steps"] == len(known)
    assert fixed["ips"]["value"] == pytest.approx(sum(r / p for a, p, r in known if a == arm) / len(known))
    assert fixed["ips"]["low"] <= fixed["ips"]["value"] <= fixed["ips"]["high"]
    assert fixed["support"] == pytest.approx(sum(1 for s in known if s[0] == arm) / len(steps))
    assert "uniform" in report
    bad = mars("replay", "ope", "--file", str(log), "--policy", "fixed:no-such-arm")
    assert bad.returncode == 2 and "is not on the log" in bad.stdout


def test_strict_redrive_is_deterministic(logged: Logged, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    export(logged, log)
    runs = []
    for suffix in ("-a", "-b"):
        out = tmp_path / f"run{suffix}.jsonl"
        run = mars(
            "replay", "run", "--file", str(log), "--ingress", logged.stack.addr("ingress"),
            "--router", logged.stack.addr("router"), "--strict", "--limit", "8", f"--tenant-suffix={suffix}",
            "--postgres-dsn", logged.stack.env["MARS_POSTGRES_DSN"], "--out", str(out),
        stack=logged.stack,
    )  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        assert json.loads(run.stderr[run.stderr.index("{") :])["answered"] == 8
        runs.append([json.loads(line) for line in out.read_text().splitlines()])
    a, b = runs
    # Without the data keys the recorded text cannot be read, so nothing is sent again (and it says why).
    blind = mars(
        "replay", "run", "--file", str(log), "--ingress", logged.stack.addr("ingress"), "--limit", "8"
    )
    assert blind.returncode == 2 and "skipped_sealed_turns" in blind.stdout + blind.stderr
    assert [r["recorded_turn_id"] for r in a] == [r["recorded_turn_id"] for r in b]
    assert len({r["user_id"] for r in a}) == 1 and [r["seq"] for r in a] == list(range(1, 9))
    # Same log, same configuration, strict order: the same decisions and the same answers.
    assert [(r["arm"], r["answered_by"], r["text"]) for r in a] == [
        (r["arm"], r["answered_by"], r["text"]) for r in b
    ]
    assert all("reward_wait" not in r for r in a + b)
