"""embed_bench.py's stored-pair sample: three consecutive turns of one conversation, drawn reproducibly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "load-tests"))
import embed_bench


def _locomo(tmp_path: Path, turns: int) -> str:
    session = [{"speaker": "A" if i % 2 else "B", "dia_id": f"D1:{i + 1}", "text": f"t{i}"} for i in range(turns)]
    conv = {"sample_id": "c0", "conversation": {"session_1": session, "session_1_date_time": "d"}, "qa": []}
    path = tmp_path / "locomo.json"
    path.write_text(json.dumps([conv]))
    return str(path)


def test_pairs_are_three_consecutive_turns_drawn_with_the_seed(tmp_path: Path) -> None:
    path = _locomo(tmp_path, 12)
    pairs = embed_bench.sample_pairs(path, 5)
    assert pairs == embed_bench.sample_pairs(path, 5) and len(set(pairs)) == 5
    for pair in pairs:
        head, tail = pair.split("\n")
        first = int(head.rsplit("t", 1)[1])
        assert tail == f"[d] {'A' if (first + 1) % 2 else 'B'}: t{first + 1} [d] {'A' if first % 2 else 'B'}: t{first + 2}"
    assert len(embed_bench.sample_pairs(path, 100)) == 10  # every start once, no more


def test_a_file_without_three_turns_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no conversation with three turns"):
        embed_bench.sample_pairs(_locomo(tmp_path, 2), 4)
