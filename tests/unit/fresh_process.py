"""Run Python in fresh interpreters, so a test can compare what separate processes compute: "the same in
every process" means two processes with different string-hash seeds (PYTHONHASHSEED), not two calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def in_fresh_process(code: str, hash_seed: int) -> Any:
    """The JSON value that `code` prints, computed in a new interpreter whose str hashes use `hash_seed`."""
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout)


def across_processes(code: str, seeds: tuple[int, ...] = (1, 2)) -> list[Any]:
    """`code`'s printed JSON value from one fresh process per hash seed."""
    return [in_fresh_process(code, seed) for seed in seeds]
