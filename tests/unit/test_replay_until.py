"""Where `mars replay` stops reading the topics: at the log's end as the command starts, or, where the
broker's end offsets cannot be trusted (MARS_KAFKA_TRUST_END_OFFSETS=false, as the local stack writes on
Tansu), once the log has been quiet for --idle-s."""

from __future__ import annotations

import pytest
from mars_tools.cli import build_parser


@pytest.mark.parametrize("command", ["read", "export", "ope"])
def test_until_is_end_by_default_and_quiet_where_end_offsets_are_not_trusted(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MARS_ENV_FILE", raising=False)
    extra = {"export": ["--out", "x.jsonl"], "ope": ["--policy", "uniform"]}.get(command, [])
    monkeypatch.delenv("MARS_KAFKA_TRUST_END_OFFSETS", raising=False)
    assert build_parser("replay").parse_args(["replay", command, *extra]).until == "end"
    monkeypatch.setenv("MARS_KAFKA_TRUST_END_OFFSETS", "false")
    assert build_parser("replay").parse_args(["replay", command, *extra]).until == "quiet"
    chosen = build_parser("replay").parse_args(["replay", command, *extra, "--until", "end"])
    assert chosen.until == "end"
    with pytest.raises(SystemExit):
        build_parser("replay").parse_args(["replay", command, *extra, "--until", "never"])
