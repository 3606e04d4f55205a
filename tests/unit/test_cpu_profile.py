"""load.py --profile's summary of py-spy's collapsed stacks: self samples by leaf function and by area."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "load-tests"))
import cpu_profile


def test_summary_counts_self_samples_by_area_and_function(tmp_path: Path) -> None:
    raw = tmp_path / "25-memory.txt"
    raw.write_text(
        "<module> (mars_memory/__main__.py:3);run (asyncio/runners.py:118);_run_once (asyncio/base_events.py:1898) 10\n"
        "handle (mars/bus.py:706);ParseFromString (google/protobuf/message.py:202) 20\n"
        "encode (mars/retrieval/embedder.py:200);run (onnxruntime/capi/onnxruntime_inference_collection.py:220) 60\n"
        "view (mars_memory/store.py:300) 10\n"
        "garbage line\n"
    )
    summary = cpu_profile.summarise_folder(tmp_path, "25")
    memory = summary["memory"]
    assert memory["samples"] == 100
    assert memory["areas"] == pytest.approx(
        {"embedding model": 0.6, "protobuf": 0.2, "asyncio loop": 0.1, "MARS code": 0.1}
    )
    assert memory["top"][0] == ("run (capi/onnxruntime_inference_collection.py)", pytest.approx(0.6))


def test_only_python_processes_are_recorded() -> None:
    import os

    assert cpu_profile.is_python(os.getpid())
    assert not cpu_profile.is_python(1 << 30)  # no such process
