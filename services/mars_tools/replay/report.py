"""`mars replay report`: a markdown report with PNG plots from one or more trace files (`replay read --out`).

Per configuration (one trace file each, labelled by its file name): quality against cost (the paper's
Figure 2: mean utility against generation + controller cost per turn), routing shares by state slice,
and reward over time (a moving average in turn order).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console


def load_traces(path: Path) -> list[dict[str, Any]]:
    """Complete, answered traces of a `replay read --out` file; other lines are skipped."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            trace = json.loads(line)
        except ValueError:
            continue
        if trace.get("complete") and trace.get("generated", {}).get("status") == "OK" and "judged" in trace:
            out.append(trace)
    return out


def _config_stats(traces: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(traces)
    utility = sum(float(t["judged"].get("utility", 0.0)) for t in traces) / n
    cost = (
        sum(
            float(t["generated"].get("cost_usd", 0.0))
            + float(t["state"].get("state", {}).get("usage", {}).get("cost_usd", 0.0))
            for t in traces
        )
        / n
    )
    shares: dict[str, dict[str, int]] = {}
    for t in traces:
        state = t["routed"].get("state", {})
        for key in (
            f"scope={state.get('retrieval_scope', 'UNSPECIFIED')}",
            f"phase={state.get('phase', 'UNSPECIFIED')}",
        ):
            shares.setdefault(key, {}).setdefault(t["generated"].get("model", "?"), 0)
            shares[key][t["generated"].get("model", "?")] += 1
    ordered = sorted(traces, key=lambda t: int(t["received"]["turn"].get("received_at_ms", 0)))
    rewards = [float(t["judged"].get("reward", 0.0)) for t in ordered]
    return {"turns": n, "utility": utility, "cost_per_turn": cost, "shares": shares, "rewards": rewards}


def write_report(inputs: list[Path], out_dir: Path) -> list[Path]:
    # Imported here: pyplot takes 0.7 s to import, and every `mars replay` run (and `mars --help`) loads this module.
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    stats = {p.stem: _config_stats(t) for p in inputs if (t := load_traces(p))}
    if not stats:
        raise ValueError("no complete, answered traces in the inputs")
    written = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, s in stats.items():
        ax.scatter(s["cost_per_turn"], s["utility"], s=40)
        ax.annotate(name, (s["cost_per_turn"], s["utility"]), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("generation + controller cost per turn (USD)")
    ax.set_ylabel("mean utility (Eq. 17)")
    ax.set_title("Quality against cost")
    written.append(out_dir / "quality_vs_cost.png")
    fig.tight_layout()
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, s in stats.items():
        r = s["rewards"]
        window = max(1, len(r) // 20)
        avg = [
            sum(r[max(0, i - window + 1) : i + 1]) / len(r[max(0, i - window + 1) : i + 1])
            for i in range(len(r))
        ]
        ax.plot(range(1, len(r) + 1), avg, label=name)
    ax.set_xlabel("turn (log order)")
    ax.set_ylabel("reward, moving average")
    ax.legend()
    ax.set_title("Reward over time")
    written.append(out_dir / "reward_over_time.png")
    fig.tight_layout()
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    for name, s in stats.items():
        slices = sorted(s["shares"])
        models = sorted({m for counts in s["shares"].values() for m in counts})
        fig, ax = plt.subplots(figsize=(max(6, len(slices) * 0.9), 4))
        bottom = [0.0] * len(slices)
        for m in models:
            share = [s["shares"][k].get(m, 0) / sum(s["shares"][k].values()) for k in slices]
            ax.bar(slices, share, bottom=bottom, label=m)
            bottom = [b + v for b, v in zip(bottom, share, strict=True)]
        ax.set_ylabel("share of turns")
        ax.set_title(f"Routing share by state slice: {name}")
        ax.tick_params(axis="x", rotation=45)
        ax.legend(fontsize=8)
        written.append(out_dir / f"routing_share_{name}.png")
        fig.tight_layout()
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    lines = [
        "# MARS replay report",
        "",
        "| configuration | turns | mean utility | cost per turn (USD) |",
        "|---|---|---|---|",
    ]
    for name, s in stats.items():
        lines.append(f"| {name} | {s['turns']} | {s['utility']:.4f} | {s['cost_per_turn']:.6f} |")
    lines += ["", *[f"![{p.stem}]({p.name})" for p in written]]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    return [out_dir / "report.md", *written]


def cmd_report(args: argparse.Namespace) -> int:
    console = Console(soft_wrap=True)
    inputs = [Path(p) for p in args.traces]
    missing = [str(p) for p in inputs if not p.is_file()]
    if missing:
        console.print(f"[red]no trace file: {', '.join(missing)}[/]")
        return 2
    try:
        files = write_report(inputs, Path(args.out))
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    console.print(f"wrote {', '.join(str(f) for f in files)}")
    return 0


def add_report_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "report",
        help="markdown + PNG report (quality vs cost, routing shares, reward over time) from trace files",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "traces", nargs="+", help="trace files from `mars replay read --out`, one per configuration"
    )
    p.add_argument("--out", required=True, help="folder for report.md and the plots")
    p.set_defaults(func=cmd_report)
