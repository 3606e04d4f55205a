"""What sealing user text costs per turn (mars.sealing): the CPU to seal every event of one turn as a stage
publishes it and to open it as the next stage consumes it, against serializing and parsing the same events
in plaintext (what every hop costs anyway), in the same run. The events are shaped like a real turn's: an
8-block view of ~300-character memory blocks, an answer of ~800 characters, the view packed into the prompt.

    .venv/bin/python load-tests/sealing_bench.py [--turns 2000] [--block-chars 300] [--answer-chars 800]

The turn-level A/B (the whole answer path with and without a master key) is the load harness:

    .venv/bin/python load-tests/load.py --no-litellm --no-floor --rates 10 --seconds 30 \\
        --service-env MARS_MASTER_KEY_FILE=
    .venv/bin/python load-tests/load.py --no-litellm --no-floor --rates 10 --seconds 30
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def turn_events(rng: random.Random, block_chars: int, answer_chars: int) -> list[object]:
    """One turn's sealable events in pipeline order (received, state, view, routed, generated, feedback)."""
    from mars.v1 import events_pb2 as ev

    def text(n: int) -> str:
        return "".join(rng.choice(string.ascii_letters + "     ") for _ in range(n))

    turn = ev.TurnEnvelope(turn_id=f"{rng.getrandbits(64):016x}", tenant="t", user_id="u", seq=1)
    query = text(120)
    state = ev.SessionState(lens_reason=text(80), top_k_hint=8)
    blocks = [
        ev.MemoryBlock(block_id=f"b{i}", kind=ev.RETRIEVED_HISTORY, text=text(block_chars)) for i in range(8)
    ]
    view = ev.CandidateView(blocks=blocks)
    return [
        ev.TurnReceived(turn=turn, text=query),
        ev.StateEstimated(turn=turn, text=query, state=state),
        ev.ViewBuilt(turn=turn, text=query, state=state, view=view),
        ev.Routed(turn=turn, text=query, state=state, view=view, features=[0.1] * 24),
        ev.Generated(turn=turn, text=text(answer_chars), query=query, state=state, packed_blocks=blocks),
        ev.Feedback(turn=turn, rating=1.0, comment=text(60)),
    ]


def measure(turns: int, block_chars: int, answer_chars: int) -> dict[str, object]:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from mars import sealing

    rng = random.Random(7)
    key = AESGCM(sealing.new_key())
    samples = [turn_events(rng, block_chars, answer_chars) for _ in range(turns)]
    plain_us: list[float] = []
    sealed_us: list[float] = []
    plain_bytes = sealed_bytes = 0
    for events in samples:
        t0 = time.perf_counter()
        for event in events:
            wire = event.SerializeToString()  # type: ignore[attr-defined]
            type(event).FromString(wire)
            plain_bytes += len(wire)
        t1 = time.perf_counter()
        for event in events:
            sealed = sealing.seal(event, event.turn, "k", key)  # type: ignore[arg-type, attr-defined]
            wire = sealed.SerializeToString()
            back = type(event).FromString(wire)
            sealing.unseal(back, key)
            sealed_bytes += len(wire)
        t2 = time.perf_counter()
        plain_us.append((t1 - t0) * 1e6)
        sealed_us.append((t2 - t1) * 1e6)
    extra = [s - p for s, p in zip(sealed_us, plain_us, strict=True)]
    return {
        "turns": turns,
        "events_per_turn": len(samples[0]),
        "plaintext_serialize_parse_us": {"p50": pct(plain_us, 0.5), "p99": pct(plain_us, 0.99)},
        "sealed_serialize_parse_us": {"p50": pct(sealed_us, 0.5), "p99": pct(sealed_us, 0.99)},
        "sealing_adds_us": {"p50": pct(extra, 0.5), "p99": pct(extra, 0.99)},
        "bytes_per_turn": {"plaintext": plain_bytes // turns, "sealed": sealed_bytes // turns},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=2000, help="turns to seal and open (default 2000)")
    parser.add_argument("--block-chars", type=int, default=300, help="characters per memory block")
    parser.add_argument("--answer-chars", type=int, default=800, help="characters of the answer")
    args = parser.parse_args(argv)
    if args.turns < 1:
        parser.error("--turns must be at least 1")
    sys.path[:0] = [str(REPO / "services")]
    print(json.dumps(measure(args.turns, args.block_chars, args.answer_chars), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
