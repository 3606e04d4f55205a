"""Two runs side by side: the recorded run and its re-drive under another configuration, each summarized by
`mars_tools.replay.traces.summarize` over the same turns."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from mars.v1 import events_pb2 as ev
from rich.table import Table

from mars_tools.replay.traces import TraceBuilder, summarize


def only(builder: TraceBuilder, turn_ids: Iterable[str]) -> TraceBuilder:
    """The builder's traces of these turns only (the record counts stay those of everything read)."""
    wanted = set(turn_ids)
    out = TraceBuilder()
    out.counts = builder.counts
    out.traces = {k: v for k, v in builder.traces.items() if k in wanted}
    return out


def read_back(
    bootstrap: str,
    prefix: str,
    turn_ids: list[str],
    timeout_s: float = 60.0,
    idle_s: float = 2.0,
    kafka: dict[str, Any] | None = None,
) -> TraceBuilder:
    """The traces of `turn_ids` from the run with topic prefix `prefix`, read again until all are complete
    (rewards arrive after the answers) or `timeout_s` has passed. `kafka`: client options (default: the
    MARS_* environment's)."""
    deadline = time.monotonic() + timeout_s
    while True:
        builder = TraceBuilder()
        asyncio.run(_read_into(builder, bootstrap, prefix, idle_s, kafka))
        mine = only(builder, turn_ids)
        done = len(mine.traces) == len(set(turn_ids)) and all(t.missing is None for t in mine.traces.values())
        if done or time.monotonic() > deadline:
            return mine
        time.sleep(1.0)


async def _read_into(
    builder: TraceBuilder, bootstrap: str, prefix: str, idle_s: float, kafka: dict[str, Any] | None = None
) -> None:
    from mars_tools.replay.readers import read_topics

    async for record in read_topics(bootstrap, idle_s=idle_s, prefix=prefix, kafka=kafka):
        builder.add(record)


def model_shares(builder: TraceBuilder) -> dict[str, float]:
    """Share of each answering model over complete, answered turns."""
    models = Counter(
        t.events["generated"].model  # type: ignore[attr-defined]
        for t in builder.traces.values()
        if t.missing is None and not t.failed and isinstance(t.events.get("generated"), ev.Generated)
    )
    total = sum(models.values())
    return {m: n / total for m, n in sorted(models.items())} if total else {}


def comparison_rows(original: TraceBuilder, redriven: TraceBuilder) -> list[tuple[str, str, str]]:
    """(metric, original, re-driven) rows: turns, completeness, reward, cost and routing shares."""
    a, b = summarize(original), summarize(redriven)

    def num(x: Any, fmt: str = "{:.4f}") -> str:
        return fmt.format(x) if isinstance(x, float) else str(x)

    rows = [
        ("turns", num(a["turns"]), num(b["turns"])),
        ("complete", num(a["complete"]), num(b["complete"])),
        ("failed", num(a["failed"]), num(b["failed"])),
        ("fallbacks", num(a["fallbacks"]), num(b["fallbacks"])),
        ("mean reward", num(a["reward"]["mean"]), num(b["reward"]["mean"])),
        ("mean utility", num(a["reward"]["mean_utility"]), num(b["reward"]["mean_utility"])),
    ]
    for view in ("generation_controller", "feedback_inclusive"):
        rows.append(
            (f"cost USD ({view})", num(a["cost_usd"][view], "{:.6f}"), num(b["cost_usd"][view], "{:.6f}"))
        )
    sa, sb = model_shares(original), model_shares(redriven)
    for model in sorted(set(sa) | set(sb)):
        rows.append((f"share {model}", num(sa.get(model, 0.0), "{:.2f}"), num(sb.get(model, 0.0), "{:.2f}")))
    ra, rb = a["routing_share"], b["routing_share"]
    for key in sorted(set(ra) | set(rb)):
        for model in sorted(set(ra.get(key, {})) | set(rb.get(key, {}))):
            rows.append(
                (
                    f"  {key}: {model}",
                    num(ra.get(key, {}).get(model, 0.0), "{:.2f}"),
                    num(rb.get(key, {}).get(model, 0.0), "{:.2f}"),
                )
            )
    return rows


def comparison_table(original: TraceBuilder, redriven: TraceBuilder, label: str) -> Table:
    table = Table(title="recorded run vs re-drive")
    table.add_column("metric")
    table.add_column("recorded", justify="right")
    table.add_column(label, justify="right")
    for row in comparison_rows(original, redriven):
        table.add_row(*row)
    return table
