"""`mars replay run` configurations: every preset sets only real service settings to values they accept,
and presets, files and --set items resolve (or are refused) with clear messages."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from mars_tools.replay import presets


def test_every_preset_sets_real_settings_to_accepted_values() -> None:
    fields = presets.settings_fields()
    for preset in presets.PRESETS.values():
        for key in preset.overrides:
            assert key in fields, f"preset {preset.name}: {key} is no service setting"
            assert key not in presets.STACK_MANAGED
        presets.check(preset.overrides)  # each value parses as its setting


def test_paper_ablations_are_there() -> None:
    assert presets.preset("recent-only").overrides == {"MARS_MEMORY_VIEW_POLICY": "recent"}
    assert presets.preset("no-qtm-semantic").overrides["MARS_ROUTER_ROUTING_POLICY"] == "query-linucb"
    assert presets.preset("lambda-0.5").overrides == {"MARS_JUDGE_LAMBDA_COST": "0.5"}
    assert presets.preset("fixed:local-small").overrides == {"MARS_ROUTER_ROUTING_POLICY": "fixed:local-small"}


def test_every_table_17_row_has_a_preset() -> None:
    rows = ["full", "embedding-only", "no-state-header", "recent-only", "no-qtm-semantic", "no-qtm-recent"]
    assert all(name in presets.PRESETS for name in [*rows, "no-online-update"])
    # No QTM state/header starts from embedding-only and only takes the state header out of the prompt.
    no_header = presets.preset("no-state-header").overrides
    assert dict(no_header) == {**presets.preset("embedding-only").overrides, "MARS_DISPATCH_STATE_HEADER": "false"}
    assert presets.preset("no-online-update").overrides == {"MARS_ROUTER_POLICY_UPDATES": "false"}
    fields = presets.settings_fields()
    assert (fields["MARS_DISPATCH_STATE_HEADER"], fields["MARS_ROUTER_POLICY_UPDATES"]) == (["dispatch"], ["router"])


def test_header_and_updates_are_on_unless_a_preset_turns_them_off() -> None:
    from mars_dispatch.settings import DispatchSettings
    from mars_router.settings import RouterSettings

    assert DispatchSettings().state_header is True and RouterSettings().policy_updates is True
    with pytest.raises(ValueError, match="router settings refuse the overrides: MARS_ROUTER_POLICY_UPDATES"):
        presets.resolve(["no-online-update"], ["MARS_ROUTER_POLICY_UPDATES=sometimes"])


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown preset 'no-such'; known presets: full, embedding-only"):
        presets.resolve(["no-such"], [])


def test_files_and_sets_apply_in_order(tmp_path: Path) -> None:
    yaml_file = tmp_path / "other.yaml"
    yaml_file.write_text("lambda_cost: 0.25\nMARS_MEMORY_VIEW_QUERY_EMBEDDING: true\nfusion: {dense_weight: 2.0}\n")
    env_file = tmp_path / "other.env"
    env_file.write_text("# comment\nMARS_ROUTER_ALPHA=0.5\n")
    json_file = tmp_path / "other.json"
    json_file.write_text(json.dumps({"MARS_ROUTER_RIDGE": 2}))
    overrides, labels = presets.resolve(
        ["recent-only", str(yaml_file), str(env_file), str(json_file)], ["MARS_MEMORY_VIEW_POLICY=bm25"]
    )
    assert overrides == {
        "MARS_MEMORY_VIEW_POLICY": "bm25",
        "MARS_JUDGE_LAMBDA_COST": "0.25",
        "MARS_MEMORY_VIEW_QUERY_EMBEDDING": "true",
        "MARS_MEMORY_FUSION": '{"dense_weight": 2.0}',
        "MARS_ROUTER_ALPHA": "0.5",
        "MARS_ROUTER_RIDGE": "2",
    }
    assert labels == ["recent-only", "other.yaml", "other.env", "other.json", "MARS_MEMORY_VIEW_POLICY=bm25"]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["MARS_LAMBDA_COSTS=1"], "not a setting of any service \\(did you mean MARS_JUDGE_LAMBDA_COST"),
        (["MARS_KAFKA_BOOTSTRAP=x:1"], "set by the replay stack itself"),
        (["MARS_JUDGE_LAMBDA_COST=cheap"], "judge settings refuse the overrides: MARS_JUDGE_LAMBDA_COST"),
        (["MARS_MEMORY_VIEW_POLICY=psychic"], "memory settings refuse the overrides: MARS_MEMORY_VIEW_POLICY"),
        (["no-equals-sign"], "expected KEY=VALUE"),
    ],
)
def test_bad_overrides_are_refused(sets: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        presets.resolve([], sets)


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config file at"):
        presets.resolve([str(tmp_path / "missing.yaml")], [])


def test_context_turns_has_a_name_per_service_and_the_old_one_still_works_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mars_memory.settings import MemorySettings
    from mars_state.settings import StateSettings

    fields = presets.settings_fields()
    assert "MARS_CONTEXT_TURNS" not in fields  # one name, two meanings: gone
    assert fields["MARS_STATE_CONTEXT_TURNS"] == ["state"]
    assert fields["MARS_MEMORY_CONTEXT_TURNS"] == ["memory"]
    assert (StateSettings().state_context_turns, MemorySettings().memory_context_turns) == (6, 3)
    monkeypatch.setenv("MARS_CONTEXT_TURNS", "4")
    with pytest.warns(FutureWarning, match="MARS_CONTEXT_TURNS is deprecated for StateSettings"):
        assert StateSettings().state_context_turns == 4
    monkeypatch.setenv("MARS_MEMORY_CONTEXT_TURNS", "2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name wins, and warns nothing
        assert MemorySettings().memory_context_turns == 2
