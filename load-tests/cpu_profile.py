"""Sampled stacks of the MARS services under load (`load.py --profile DIR`): py-spy records every Python
service process for one rate, and the summary says where each spends its CPU, by area (Kafka client,
gRPC, protobuf, Postgres driver, the embedding model, asyncio, MARS's own code) and by function.

py-spy samples only threads that are running (idle waits are not counted), so shares are of busy time.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

PY_SPY = Path(sys.executable).parent / "py-spy"
#: Samples per second per process (py-spy's default is 100; 50 keeps its own cost small on two cores).
RATE = 50
#: Leaf frame "function (path:line)" -> area, by the first pattern (a regular expression) its path matches.
AREAS: tuple[tuple[str, str], ...] = (
    ("aiokafka", "kafka client (aiokafka)"),
    ("kafka/", "kafka client (aiokafka)"),
    ("grpc", "gRPC"),
    ("google/protobuf", "protobuf"),
    ("psycopg", "Postgres driver (psycopg)"),
    ("onnxruntime", "embedding model"),
    ("tokenizers", "embedding model"),
    ("transformers", "embedding model"),
    ("faiss", "FAISS search"),
    ("numpy", "numpy"),
    ("cryptography", "sealing (AES-GCM)"),
    ("opentelemetry", "tracing"),
    ("asyncio", "asyncio loop"),
    ("selectors", "asyncio loop"),
    ("threading", "threads"),
    ("concurrent/futures", "threads"),
    (r"(^|/)(services|infra)/mars|(^|/)mars(_[a-z]+)?/", "MARS code"),
)
_FRAME = re.compile(r"^(?P<func>.*) \((?P<path>[^()]*?)(?::\d+)?\)$")


def is_python(pid: int) -> bool:
    try:
        return "python" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return False


def start(pids: dict[str, int], seconds: float, folder: Path, label: str) -> list[subprocess.Popen[bytes]]:
    """One py-spy per Python process, recording for `seconds` into folder/<label>-<name>.txt."""
    folder.mkdir(parents=True, exist_ok=True)
    procs = []
    for name, pid in sorted(pids.items()):
        if not is_python(pid):
            continue
        out = folder / f"{label}-{name}.txt"
        cmd = [str(PY_SPY), "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))),
               "--rate", str(RATE), "--format", "raw", "--output", str(out), "--nonblocking"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def _leaf(stack: str) -> tuple[str, str]:
    frame = stack.rsplit(";", 1)[-1]
    m = _FRAME.match(frame)
    return (m.group("func"), m.group("path")) if m else (frame, "")


def area_of(path: str) -> str:
    for pattern, area in AREAS:
        if re.search(pattern, path):
            return area
    return "other"


def summarise(path: Path, top: int = 8) -> dict[str, Any]:
    """Samples, shares by area, and the `top` leaf functions by self samples of one recording."""
    areas: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        func, where = _leaf(stack)
        areas[area_of(where)] += n
        short = "/".join(Path(where).parts[-2:]) if where else ""
        leaves[f"{func} ({short})"] += n
        total += n
    return {
        "samples": total,
        "areas": {a: n / total for a, n in areas.most_common()} if total else {},
        "top": [(f, n / total) for f, n in leaves.most_common(top)] if total else [],
    }


def summarise_folder(folder: Path, label: str) -> dict[str, dict[str, Any]]:
    return {
        p.stem.removeprefix(f"{label}-"): summarise(p) for p in sorted(folder.glob(f"{label}-*.txt"))
    }


def print_summary(summary: dict[str, dict[str, Any]], cpu_ms: dict[str, float]) -> None:
    """Per process: its CPU ms per turn (from load.py's row) split over the areas."""
    for name, s in summary.items():
        ms = cpu_ms.get(name, 0.0)
        print(f"\n{name}: {ms:.1f} ms CPU per turn, {s['samples']} samples")
        for area, share in s["areas"].items():
            if share >= 0.02:
                print(f"  {area:28s} {100 * share:5.1f}%  {ms * share:5.1f} ms")
        for func, share in s["top"]:
            print(f"    {100 * share:5.1f}%  {func}")
