"""`mars bench rollout` (mars_tools.bench.rollout): candidates calibrated to their stated effects on the router
simulator's pool, runs that reach the decisions the scenarios are built for, and the command's report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
from mars.domain.rollout import RolloutConfig
from mars_tools.bench.rollout import (
    LIVE,
    Environment,
    add_rollout_parser,
    build_environment,
    scenarios,
    simulate,
    truth,
)


@pytest.fixture(scope="module")
def env() -> Environment:
    return build_environment(2000, lam=0.002)


def test_candidates_have_exactly_their_stated_effects_on_the_pool(env: Environment) -> None:
    cases = {s.name: s for s in scenarios(env, [0.02, 0.1, 0.0, -0.05])}
    assert truth(env, cases["better +0.02"])["effect"] == pytest.approx(0.02, abs=1e-9)
    assert truth(env, cases["better +0.1"])["effect"] == pytest.approx(0.1, abs=1e-9)
    assert truth(env, cases["worse -0.05"])["effect"] == pytest.approx(-0.05, abs=1e-9)
    assert truth(env, cases["equal 0"])["effect"] == pytest.approx(0.0, abs=1e-9)
    assert cases["equal 0"].f_best > 0 and cases["equal 0"].f_worst > 0  # another policy, not a copy
    assert truth(env, cases["costly"])["cost_ratio"] == pytest.approx(3.0, abs=1e-9)
    assert truth(env, cases["failing arm"])["failure_excess"] > 0.05
    # The best open-weight arm beats live's (always Mixtral) by more than the largest effect asked for.
    rows = np.arange(len(env.value))
    assert float(np.mean(env.value[rows, env.best] - env.value[:, LIVE])) > 0.1
    with pytest.raises(ValueError, match="needs the candidate off live's arm"):
        scenarios(env, [0.5])


def test_runs_reach_the_decisions_their_scenarios_are_built_for(env: Environment) -> None:
    config = RolloutConfig(max_turns=3000)
    cases = {s.name: s for s in scenarios(env, [0.1, 0.0, -0.1])}
    for seed in range(3):
        assert simulate(env, cases["better +0.1"], config, seed)["decision"] == "promote"
        assert simulate(env, cases["worse -0.1"], config, seed)["decision"] == "rollback"
        assert simulate(env, cases["failing arm"], config, seed)["reason"] == "failure guardrail"
        assert simulate(env, cases["costly"], config, seed)["reason"] == "cost guardrail"
    equal = simulate(env, cases["equal 0"], config, 0)
    assert equal == {"decision": "undecided", "reason": "turn cap reached", "turns": 3000}


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_rollout_parser(parser.add_subparsers())
    return parser.parse_args(["rollout", *argv])


def test_the_command_prints_and_writes_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rollout.json"
    args = _args(["--seeds", "4", "--jobs", "2", "--pool", "1000", "--max-turns", "1500", "--json", str(out)])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "false promotion (equal candidate): " in printed and "Wilson 95% upper bound" in printed
    report = json.loads(out.read_text())
    assert report["seeds"] == 4 and report["config"]["max_turns"] == 1500
    better = report["scenarios"]["better +0.1"]
    assert better["runs"] == 4 and better["promoted"] == 1.0 and better["turns_median"] > 0
    assert set(report["scenarios"]) == {
        "better +0.02",
        "better +0.05",
        "better +0.1",
        "equal 0",
        "worse -0.05",
        "failing arm",
        "costly",
    }


def test_bad_arguments_are_refused_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert _args(["--seeds", "0"]).func(_args(["--seeds", "0"])) == 2
    assert "--seeds" in capsys.readouterr().out
    args = _args(["--share", "1.5", "--pool", "500"])
    assert args.func(args) == 2
    assert "canary_share" in capsys.readouterr().out
