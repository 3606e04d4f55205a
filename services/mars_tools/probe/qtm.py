"""`mars probe qtm` and `mars probe qtm-boundaries`: how stable the controller's decisions are.

`qtm` (paper Table 4 / 20 / 21) freezes N snapshots of RealMem conversations — the query, the active
context (the earlier user turns of its session) and the memory pool (every turn pair before it) — runs two
controller configurations on each with deterministic decoding, and compares what they decide:
the effective MATCH/NEW_TOPIC action after guardrails (agreement with a Wilson 95% interval), and the
memory ids of the state-conditioned view before packing (top 20; Jaccard), overall and on snapshots that
have active-thread history.

`qtm-boundaries` scores NEW_TOPIC on the first user turn of each RealMem project session: ground truth is
"this session's task (the session_identifier before `:S`) differs from the previous project session's
task". The identifiers are read only to score, never given to a controller.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mars.domain.memory_policy import memory_controls
from mars.retrieval.embedder import Embedder
from mars.retrieval.hybrid import POLICY_CONFIGS, HybridMemory, state_conditioned
from mars.v1 import events_pb2 as ev
from mars_state.qtm.guard import GuardedEstimator
from rich.console import Console
from rich.progress import Progress

from mars_tools.bench.policies import CachingEmbedder
from mars_tools.bench.realmem import Persona, Session, load_persona
from mars_tools.probe.common import (
    CONFIG_HELP,
    CONTEXT_TURNS,
    Boundary,
    ControllerConfig,
    LocalLlm,
    percentile,
    persona_files,
    precision_recall_f1,
    project_boundaries,
)
from mars_tools.stats import wilson_interval

TOP_IDS = 20
#: Turns of the active thread the `mars` view policy adds as secondary queries (memory service default).
QUERY_CONTEXT_TURNS = 3


# ---- controller configurations --------------------------------------------------------------------------


# ---- snapshots --------------------------------------------------------------------------------------------


def turn_pairs(session: Session) -> list[str]:
    """The session's memory records: each user turn with the assistant reply after it."""
    pairs: list[str] = []
    for turn in session.turns:
        if turn.speaker == "User" or not pairs:
            pairs.append(f"{turn.speaker}: {turn.text}")
        else:
            pairs[-1] += f"\n{turn.speaker}: {turn.text}"
    return pairs


@dataclass(frozen=True)
class Snapshot:
    persona: str
    query_id: str
    text: str
    session_position: int
    #: Earlier user turns of the query's session (the active thread as the state service sees it).
    active_context: tuple[str, ...]


def pick_snapshots(personas: Sequence[Persona], n: int, max_sessions: int | None) -> list[Snapshot]:
    """N scored queries spread evenly over the personas' timelines (deterministic)."""
    pool = [
        Snapshot(p.name, q.query_id, q.text, q.session_position, q.session_user_turns[-CONTEXT_TURNS:])
        for p in personas
        for q in p.queries
        if max_sessions is None or q.session_position < max_sessions
    ]
    if n >= len(pool):
        return pool
    step = len(pool) / n
    return [pool[int(i * step)] for i in range(n)]


class FrozenMemory:
    """One persona's memory grown in list order; `view_ids` is the view a state gets at a snapshot."""

    def __init__(self, embedder: Embedder) -> None:
        self.memory = HybridMemory(embedder, POLICY_CONFIGS["mars"])
        self.keys: list[str] = []

    def add(self, key: str, text: str) -> None:
        self.memory.add_group(key, len(self.keys), [text])
        self.keys.append(key)

    def view_ids(self, state: ev.SessionState, snapshot: Snapshot, thread: list[str]) -> list[str]:
        """Memory ids of the pre-packing view (as the memory service builds it): the recent window of the
        active thread, then retrieved records (LOCAL: from the thread; GLOBAL: from all memory)."""
        controls = memory_controls(state)
        window = thread[-controls.recent_window :] if controls.recent_window else []
        ids = list(window)
        if controls.retrieve_k > 0 and self.keys:
            allowed = set(thread) if controls.scope == ev.LOCAL else None
            cfg = state_conditioned(POLICY_CONFIGS["mars"], controls.prefer_recent)
            context = list(snapshot.active_context[-QUERY_CONTEXT_TURNS:])
            ranked = self.memory.rank_groups(snapshot.text, context, len(self.keys), cfg)
            shown = set(window)
            hits = [k for k, _ in ranked if (allowed is None or k in allowed) and k not in shown]
            ids += hits[: controls.retrieve_k]
        return ids[:TOP_IDS]


# ---- statistics -------------------------------------------------------------------------------------------


def jaccard(a: Sequence[str], b: Sequence[str]) -> float:
    """|A ∩ B| / |A ∪ B|; two empty views agree completely (both exposed no memory)."""
    sa, sb = set(a), set(b)
    return 1.0 if not sa and not sb else len(sa & sb) / len(sa | sb)


@dataclass
class SliceStats:
    n: int = 0
    agree: int = 0
    jaccards: list[float] = field(default_factory=list)

    def add(self, agree: bool, jac: float) -> None:
        self.n += 1
        self.agree += int(agree)
        self.jaccards.append(jac)

    def summary(self) -> dict[str, Any]:
        lo, hi = wilson_interval(self.agree, self.n)
        return {
            "n": self.n,
            "action_agreement": self.agree / self.n if self.n else 0.0,
            "wilson95": [lo, hi],
            "jaccard_mean": statistics.fmean(self.jaccards) if self.jaccards else 0.0,
            "jaccard_median": statistics.median(self.jaccards) if self.jaccards else 0.0,
        }


# ---- commands ---------------------------------------------------------------------------------------------


def cmd_probe_qtm(args: argparse.Namespace) -> int:
    console = Console(soft_wrap=True)
    try:
        configs = [ControllerConfig.parse(args.a), ControllerConfig.parse(args.b)]
        files = persona_files(Path(args.data), args.personas)
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    personas = [load_persona(f) for f in files]
    snapshots = pick_snapshots(personas, args.snapshots, args.max_sessions)
    if not snapshots:
        console.print("[red]no scored queries in range; raise --max-sessions or pick other personas[/]")
        return 2
    from mars.retrieval.embedder import load_embedder

    embedder: Embedder = load_embedder()
    if args.cache_dir:
        embedder = CachingEmbedder(embedder, args.cache_dir)
    with LocalLlm(configs, console) as llm:
        result = asyncio.run(_run_probe(personas, snapshots, configs, llm.url, embedder, console))
    if isinstance(embedder, CachingEmbedder):
        embedder.save()
    labels = [c.label() for c in configs]
    result["configs"] = labels
    _print_probe(console, result, labels)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        console.print(f"results written to {args.out}")
    return 0


async def _run_probe(
    personas: Sequence[Persona],
    snapshots: Sequence[Snapshot],
    configs: Sequence[ControllerConfig],
    llm_url: str,
    embedder: Embedder,
    console: Console,
) -> dict[str, Any]:
    # Clients live on this event loop: made and closed here.
    estimators = [c.estimator(llm_url) for c in configs]
    try:
        return await _probe_snapshots(personas, snapshots, estimators, embedder, console)
    finally:
        for est in estimators:
            await est.aclose()


async def _probe_snapshots(
    personas: Sequence[Persona],
    snapshots: Sequence[Snapshot],
    estimators: Sequence[GuardedEstimator],
    embedder: Embedder,
    console: Console,
) -> dict[str, Any]:
    overall, with_history = SliceStats(), SliceStats()
    latencies: list[list[float]] = [[] for _ in estimators]
    rows: list[dict[str, Any]] = []
    by_persona: dict[str, list[Snapshot]] = {}
    for s in snapshots:
        by_persona.setdefault(s.persona, []).append(s)
    with Progress(console=console) as progress:
        task = progress.add_task("snapshots", total=len(snapshots))
        for persona in personas:
            todo = sorted(by_persona.get(persona.name, []), key=lambda s: s.session_position)
            if not todo:
                continue
            memory = FrozenMemory(embedder)
            last = todo[-1].session_position
            for session in persona.sessions[: last + 1]:
                pairs = turn_pairs(session)
                here = [s for s in todo if s.session_position == session.position]
                added = 0
                for snap in sorted(here, key=lambda s: len(s.active_context)):
                    # The session's pairs before the query join memory first: they are the active thread.
                    upto = _pairs_before(pairs, snap)
                    for i in range(added, upto):
                        memory.add(f"{session.uuid}#{i}", pairs[i])
                    added = max(added, upto)
                    thread = [f"{session.uuid}#{i}" for i in range(upto)]
                    states = []
                    for j, est in enumerate(estimators):
                        t0 = time.perf_counter()
                        states.append(await est.estimate(snap.text, list(snap.active_context)))
                        latencies[j].append((time.perf_counter() - t0) * 1000)
                    views = [memory.view_ids(st, snap, thread) for st in states]
                    agree = states[0].action == states[1].action
                    jac = jaccard(views[0], views[1])
                    overall.add(agree, jac)
                    if thread:
                        with_history.add(agree, jac)
                    rows.append(
                        {
                            "persona": snap.persona,
                            "query_id": snap.query_id,
                            "actions": [ev.Action.Name(st.action) for st in states],
                            "fallbacks": [st.usage.fallback_reason for st in states],
                            "view_sizes": [len(v) for v in views],
                            "jaccard": jac,
                        }
                    )
                    progress.advance(task)
                for i in range(added, len(pairs)):
                    memory.add(f"{session.uuid}#{i}", pairs[i])
    return {
        "overall": overall.summary(),
        "with_active_history": with_history.summary(),
        "latency_ms": [{"p50": percentile(lat, 0.5), "p99": percentile(lat, 0.99)} for lat in latencies],
        "outcomes": [dict(est.counts) for est in estimators],
        "snapshots": rows,
    }


def _pairs_before(pairs: list[str], snap: Snapshot) -> int:
    # Each earlier user turn opens one pair; a session opening with an assistant turn has one more.
    offset = 1 if pairs and not pairs[0].startswith("User: ") else 0
    return min(len(pairs), len(snap.active_context) + offset) if snap.active_context else offset


def _print_probe(console: Console, result: dict[str, Any], labels: Sequence[str]) -> None:
    console.print(f"QTM sensitivity probe: A = {labels[0]}, B = {labels[1]}")
    header = f"{'slice':<22}{'n':>5}{'action agree':>14}{'Wilson 95%':>18}{'Jaccard mean':>14}{'median':>9}"
    console.print(header)
    for name in ("overall", "with_active_history"):
        s = result[name]
        lo, hi = s["wilson95"]
        console.print(
            f"{name:<22}{s['n']:>5}{s['action_agreement']:>14.3f}{f'[{lo:.3f}, {hi:.3f}]':>18}"
            f"{s['jaccard_mean']:>14.3f}{s['jaccard_median']:>9.3f}"
        )
    for label, lat, outcomes in zip(labels, result["latency_ms"], result["outcomes"], strict=True):
        console.print(
            f"{label}: controller latency p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms; outcomes {outcomes}"
        )


# ---- boundaries -------------------------------------------------------------------------------------------


def cmd_probe_boundaries(args: argparse.Namespace) -> int:
    console = Console(soft_wrap=True)
    try:
        configs = [ControllerConfig.parse(spec) for spec in args.configs]
        files = persona_files(Path(args.data), args.personas)
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    boundaries = [b for f in files for b in project_boundaries(f)]
    if args.limit:
        boundaries = boundaries[: args.limit]
    report: dict[str, Any] = {}
    with LocalLlm(configs, console) as llm:
        for config in configs:
            report[config.label()] = asyncio.run(_score_boundaries(config, llm.url, boundaries, console))
    positives = sum(b.new_task for b in boundaries)
    console.print(f"{len(boundaries)} project-session starts, {positives} of them a new task")
    console.print(f"{'backend':<28}{'precision':>10}{'recall':>8}{'F1':>7}{'p50 ms':>9}{'p99 ms':>9}")
    for label, r in report.items():
        console.print(
            f"{label:<28}{r['precision']:>10.3f}{r['recall']:>8.3f}{r['f1']:>7.3f}"
            f"{r['latency_ms']['p50']:>9.2f}{r['latency_ms']['p99']:>9.2f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
        console.print(f"results written to {args.out}")
    return 0


async def _score_boundaries(
    config: ControllerConfig, llm_url: str, boundaries: Sequence[Boundary], console: Console
) -> dict[str, Any]:
    tp = fp = fn = 0
    latencies: list[float] = []
    est = config.estimator(llm_url)
    try:
        with Progress(console=console) as progress:
            task = progress.add_task(config.label(), total=len(boundaries))
            for b in boundaries:
                t0 = time.perf_counter()
                state = await est.estimate(b.first_user_turn, list(b.previous_turns))
                latencies.append((time.perf_counter() - t0) * 1000)
                predicted = state.action == ev.NEW_TOPIC
                tp += predicted and b.new_task
                fp += predicted and not b.new_task
                fn += (not predicted) and b.new_task
                progress.advance(task)
    finally:
        await est.aclose()
    precision, recall, f1 = precision_recall_f1(tp, fp, fn)
    return {
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "tp": tp,
        "fp": fp,
        "fn": fn,
        "latency_ms": {"p50": percentile(latencies, 0.5), "p99": percentile(latencies, 0.99)},
        "outcomes": dict(est.counts),
    }


def add_qtm_parsers(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:  # type: ignore[type-arg]
    """`mars probe` with `qtm` and `qtm-boundaries`; returns the probe subcommands for the others."""
    probe = sub.add_parser("probe", help="sensitivity probes of the QTM controller")
    probe_sub = probe.add_subparsers(dest="probe_cmd", required=True)
    p = probe_sub.add_parser(
        "qtm",
        help="agreement of two controller configs on frozen RealMem snapshots (paper Table 4/20/21)",
        description="Freezes N snapshots (query, active context, memory pool) from RealMem persona files, runs "
        "both controller configs with deterministic decoding, and prints MATCH/NEW_TOPIC agreement with a "
        "Wilson 95%% interval and the Jaccard of the top-20 pre-packing memory ids, overall and on snapshots "
        "with active-thread history.",
    )
    p.add_argument("--data", required=True, help="folder with *_dialogues_256k.json persona files")
    p.add_argument("--snapshots", type=int, default=100, help="number of snapshots (default 100)")
    p.add_argument("--a", required=True, help=CONFIG_HELP)
    p.add_argument("--b", required=True, help="the second controller config, same syntax as --a")
    p.add_argument("--personas", nargs="*", help="persona names (default: all in --data)")
    p.add_argument("--max-sessions", type=int, help="only queries in the first N sessions of each persona")
    p.add_argument("--cache-dir", help="cache memory embeddings here (speeds up repeated probes)")
    p.add_argument("--out", help="write the full results (per snapshot too) as JSON here")
    p.set_defaults(func=cmd_probe_qtm)

    b = probe_sub.add_parser(
        "qtm-boundaries",
        help="precision/recall of NEW_TOPIC at RealMem project-session starts, per controller config",
        description="Runs each controller config on the first user turn of every RealMem project session, with "
        "the previous project session's user turns as active context, and scores NEW_TOPIC against "
        "'the task differs from the previous project session's task' (labels only score, never inform).",
    )
    b.add_argument("--data", required=True, help="folder with *_dialogues_256k.json persona files")
    b.add_argument("--configs", nargs="+", default=["rules"], help=CONFIG_HELP)
    b.add_argument("--personas", nargs="*", help="persona names (default: all in --data)")
    b.add_argument("--limit", type=int, help="score only the first N boundaries")
    b.add_argument("--out", help="write the results as JSON here")
    b.set_defaults(func=cmd_probe_boundaries)
    return probe_sub
