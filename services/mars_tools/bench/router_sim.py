"""`mars bench router`: routing policies in a simulated environment with a known (hidden) quality model.

The environment
---------------
Each turn draws a session state (Table 5 fields) and a pre-packing view load, as the live pipeline
would produce them, and the policy sees only x = featurize(state, load, depth) — the router's real
feature function. The four arms are the paper's pool with Table 10 prices. The hidden expected
quality of arm a on a turn is

    q_a = clip(base_a + affinity_a[phase] - weakness_a * load - overflow_a, 0, 1)
    load = 0.15 * need_memory + 0.3 * min(1, view_tokens / 12000) + 0.1 * [ambiguity HIGH]
    overflow_a = 0.5 when the view does not fit the arm's input budget (truncated context), else 0

for Llama-3.2-3B, Mixtral-8x7B, Qwen2.5-72B, GPT-4o: base 0.62 / 0.66 / 0.70 / 0.74, weakness
0.9 / 0.6 / 0.4 / 0.2, and phase affinities (EXPLORE, CONSTRAIN, VERIFY, REVISE, SYNTHESIZE) of
(+.25, -.05, 0, -.15, -.25), (0, +.20, 0, -.05, -.15), (-.05, 0, +.10, +.20, 0), (-.10, 0, +.05, 0, +.25):
no arm is best everywhere (small models on light exploration, the strongest on heavy synthesis).
The observed utility is q_a plus N(0, 0.1) noise, clipped to [0, 1]; the
reward is u - lambda * C_gen, with C_gen the cost of (view + 300 prompt tokens in, 300 out) at the
arm's Table 10 price in US dollars, the unit of the live judge's reward (Eq. 10, MARS_JUDGE_LAMBDA_COST), so a
lambda here is the service's lambda. A turn costs $0.0002 on Llama-3.2-3B, $0.0014 on Qwen2.5-72B and
$0.012 on GPT-4o on average: at the paper's lambdas (0.002 main, 0.5 ablation) cost moves an average
GPT-4o turn's reward by 0.00002 / 0.006, so routing is quality-first (as in the paper's Table 19, where
lambda from 0 to 1 shifts the model shares by a few points); lambda 50 (a cent weighs half a quality
point) shows the simulator under real cost pressure. The oracle plays argmax of the expected reward; regret is
in expected reward.

The no-QTM baseline (`query-linucb`, as MetaLLM routes) sees a synthetic query embedding instead of x:

    e = topic + 0.5 * phase_direction[phase] + 0.3 * need_memory * memory_direction + noise

with 40 topics and the directions fixed random unit vectors in 64 dimensions and noise N(0, 0.5^2/64)
per dimension: a query's wording reveals its phase and whether it leans on memory, but neither the view
load nor ambiguity, which live in the session rather than the query text.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from mars.domain.bandits import (
    EpsilonGreedyRouting,
    FixedArmRouting,
    LinearThompsonRouting,
    LinUCBRouting,
    RandomRouting,
    RoutingPolicy,
)
from mars.domain.features import FEATURE_DIM, QUERY_FEATURE_DIM, featurize, query_features
from mars.domain.linucb import ArmModel
from mars.v1 import events_pb2 as ev
from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class Arm:
    name: str
    base: float
    weakness: float
    context_window: int
    input_price_per_m: float
    output_price_per_m: float

    def cost_usd(self, input_tokens: int, output_tokens: int) -> float:
        """What the live dispatch charges (ModelSpec.cost_usd): prices are USD per million tokens."""
        return (input_tokens * self.input_price_per_m + output_tokens * self.output_price_per_m) / 1e6


POOL = (
    Arm("llama-3.2-3b", 0.62, 0.90, 8_192, 0.05, 0.10),
    Arm("mixtral-8x7b", 0.66, 0.60, 32_768, 0.20, 0.20),
    Arm("qwen2.5-72b", 0.70, 0.40, 32_768, 0.35, 0.40),
    Arm("gpt-4o", 0.74, 0.20, 128_000, 2.50, 10.00),
)
PHASES = (ev.EXPLORE, ev.CONSTRAIN, ev.VERIFY, ev.REVISE, ev.SYNTHESIZE)
AFFINITY = {
    "llama-3.2-3b": (0.25, -0.05, 0.0, -0.15, -0.25),
    "mixtral-8x7b": (0.0, 0.20, 0.0, -0.05, -0.15),
    "qwen2.5-72b": (-0.05, 0.0, 0.10, 0.20, 0.0),
    "gpt-4o": (-0.10, 0.0, 0.05, 0.0, 0.25),
}
PROMPT_OVERHEAD, OUTPUT_TOKENS, NOISE = 300, 300, 0.1


@dataclass
class Turn:
    x: np.ndarray
    expected_quality: np.ndarray  # per arm
    cost: np.ndarray  # per arm, USD (Table 10 prices per million tokens)
    #: Tokens of the view before packing (the prompt adds PROMPT_OVERHEAD, the answer OUTPUT_TOKENS).
    view_tokens: int = 0
    #: The no-QTM baseline's context: features of the synthetic query embedding.
    xq: np.ndarray | None = None


EMBED_DIM = 64
_directions = np.random.default_rng(4242).standard_normal((40 + len(PHASES) + 1, EMBED_DIM))
_directions /= np.linalg.norm(_directions, axis=1, keepdims=True)
TOPICS, PHASE_DIRECTIONS, MEMORY_DIRECTION = _directions[:40], _directions[40:-1], _directions[-1]


def query_embedding(rng: np.random.Generator, phase_index: int, need_memory: int) -> np.ndarray:
    """The synthetic query embedding of the module docstring (own RNG: the state stream is unchanged)."""
    e = (
        TOPICS[rng.integers(len(TOPICS))]
        + 0.5 * PHASE_DIRECTIONS[phase_index]
        + 0.3 * need_memory * MEMORY_DIRECTION
        + rng.normal(0, 0.5 / np.sqrt(EMBED_DIM), EMBED_DIM)
    )
    return e / np.linalg.norm(e)


def draw_turn(rng: np.random.Generator, depth: int, query_rng: np.random.Generator | None = None) -> Turn:
    state = ev.SessionState()
    state.action = ev.MATCH if rng.random() < 0.65 else ev.NEW_TOPIC
    state.phase = int(rng.choice(list(PHASES), p=[0.35, 0.15, 0.15, 0.2, 0.15]))  # type: ignore[assignment]
    state.query_type = int(
        rng.choice([ev.STATIC, ev.DYNAMIC, ev.TEMPORAL, ev.PROACTIVE], p=[0.3, 0.4, 0.2, 0.1])
    )  # type: ignore[assignment]
    state.taxonomy.need_memory = int(rng.random() < 0.7)
    state.taxonomy.ambiguity = int(rng.choice([ev.LOW, ev.MEDIUM, ev.HIGH], p=[0.4, 0.4, 0.2]))  # type: ignore[assignment]
    state.retrieval_scope = ev.GLOBAL if rng.random() < 0.4 else ev.LOCAL
    state.top_k_hint = int(rng.choice([3, 5, 8]))
    state.prefer_recent = int(rng.random() < 0.3)
    state.lens_recommendation = 3 if state.taxonomy.need_memory else 0
    load = ev.ViewLoad()
    if state.taxonomy.need_memory:
        per_block = rng.lognormal(mean=6.0, sigma=0.8)  # ~400 tokens, heavy tail
        blocks = 1 + state.top_k_hint + (4 if state.action == ev.MATCH else 0)
        load.num_blocks = blocks
        load.estimated_tokens = int(min(60_000, blocks * per_block))
        load.num_retrieved = state.top_k_hint if state.retrieval_scope == ev.GLOBAL else 0
        load.has_retrieved_history = load.num_retrieved > 0
        # Per-view normalised scores in [0, 1], as live views report them (mars.domain.memory_policy).
        load.max_retrieval_score = float(rng.uniform(0.2, 1.0)) if load.has_retrieved_history else 0.0
        load.mean_retrieval_score = load.max_retrieval_score * 0.6
    tokens = load.estimated_tokens
    load_difficulty = (
        0.15 * state.taxonomy.need_memory
        + 0.3 * min(1.0, tokens / 12_000)
        + (0.1 if state.taxonomy.ambiguity == ev.HIGH else 0.0)
    )
    phase = PHASES.index(state.phase)  # type: ignore[arg-type]
    quality = np.array(
        [
            np.clip(
                a.base
                + AFFINITY[a.name][phase]
                - a.weakness * load_difficulty
                - (0.5 if tokens + PROMPT_OVERHEAD > a.context_window - 1024 else 0),
                0,
                1,
            )
            for a in POOL
        ]
    )
    cost = np.array([a.cost_usd(tokens + PROMPT_OVERHEAD, OUTPUT_TOKENS) for a in POOL])
    xq = (
        query_features(query_embedding(query_rng, phase, state.taxonomy.need_memory))
        if query_rng is not None
        else None
    )
    return Turn(featurize(state, load, depth), quality, cost, view_tokens=tokens, xq=xq)


@dataclass
class RunResult:
    utility: float
    reward: float
    regret: float
    last_quarter_regret: float
    shares: dict[str, float]
    quality: float
    cost: float


#: Policies that see the query-embedding features instead of the state features.
QUERY_POLICIES = ("query-linucb",)


def simulate(
    make: Callable[[int], RoutingPolicy | None], turns: int, lam: float, seed: int, query: bool = False
) -> RunResult:
    """One run; `make(seed)` returns a policy, or None for the oracle; `query` feeds it xq, not x."""
    env = np.random.default_rng(seed)
    query_rng = np.random.default_rng(seed + 7_000) if query else None
    policy = make(seed)
    arms = [a.name for a in POOL]
    dim = QUERY_FEATURE_DIM if query else FEATURE_DIM
    models = {a: ArmModel.cold(dim, 1.0) for a in arms}
    picks = np.zeros(len(arms))
    util = rew = regret = q_sum = c_sum = 0.0
    regrets = []
    for t in range(turns):
        turn = draw_turn(env, depth=1 + t % 12, query_rng=query_rng)
        x = turn.xq if query and turn.xq is not None else turn.x
        expected = turn.expected_quality - lam * turn.cost
        if policy is None:
            i = int(np.argmax(expected))
        else:
            i = arms.index(policy.decide(x, models).arm)
        observed = float(np.clip(turn.expected_quality[i] + env.normal(0, NOISE), 0, 1))
        reward = observed - lam * float(turn.cost[i])
        if policy is not None:
            models[arms[i]] = policy.update(models[arms[i]], x, reward)
        picks[i] += 1
        util += float(turn.expected_quality[i])
        rew += float(expected[i])
        r = float(expected.max() - expected[i])
        regret += r
        regrets.append(r)
        q_sum += float(turn.expected_quality[i])
        c_sum += float(turn.cost[i])
    q = len(regrets) // 4
    return RunResult(
        utility=util,
        reward=rew,
        regret=regret,
        last_quarter_regret=float(np.mean(regrets[-q:])) if q else 0.0,
        shares={a: float(picks[j] / turns) for j, a in enumerate(arms)},
        quality=q_sum / turns,
        cost=c_sum / turns,
    )


def policies() -> dict[str, Callable[[int], RoutingPolicy | None]]:
    arms = [a.name for a in POOL]
    out: dict[str, Callable[[int], RoutingPolicy | None]] = {
        "linucb": lambda s: LinUCBRouting(arms, FEATURE_DIM, alpha=0.8, ridge=1.0),
        "query-linucb": lambda s: LinUCBRouting(arms, QUERY_FEATURE_DIM, alpha=0.8, ridge=1.0),
        "thompson": lambda s: LinearThompsonRouting(arms, FEATURE_DIM, v=0.3, seed=s + 101),
        "eps-greedy": lambda s: EpsilonGreedyRouting(arms, FEATURE_DIM, epsilon=0.1, seed=s + 202),
        "random": lambda s: RandomRouting(arms, FEATURE_DIM, seed=s + 303),
    }
    for a in arms:
        out[f"fixed:{a}"] = lambda s, a=a: FixedArmRouting(arms, FEATURE_DIM, a)  # type: ignore[misc]
    out["oracle"] = lambda s: None
    return out


def time_in_process(samples: int = 2000) -> tuple[list[float], list[float]]:
    rng = np.random.default_rng(0)
    arms = [a.name for a in POOL]
    policy = LinUCBRouting(arms, FEATURE_DIM)
    models = {a: ArmModel.cold(FEATURE_DIM, 1.0) for a in arms}
    route, update = [], []
    for t in range(samples):
        turn = draw_turn(rng, 1 + t % 12)
        t0 = time.perf_counter()
        arm = policy.decide(turn.x, models).arm
        route.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        models[arm] = policy.update(models[arm], turn.x, float(turn.expected_quality[0]))
        update.append(time.perf_counter() - t0)
    return route, update


def add_router_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "router",
        help="routing policies in a simulated environment with a known quality model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--turns", type=int, default=3000, help="turns per run (default 3000)")
    p.add_argument("--seeds", type=int, default=5, help="runs per policy (default 5)")
    p.add_argument(
        "--lambdas",
        type=float,
        nargs="+",
        default=[0.002, 0.5, 50.0],
        help="cost weights per US dollar, as MARS_JUDGE_LAMBDA_COST (default: the paper's 0.002 and 0.5, and 50, "
        "where a cent weighs half a quality point)",
    )
    p.add_argument("--out", help="write results as JSON here")
    p.add_argument(
        "--no-postgres",
        action="store_true",
        help="skip timing route/update against a local embedded Postgres",
    )
    p.set_defaults(func=cmd_router)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000.0, q))


def cmd_router(args: argparse.Namespace) -> int:
    console = Console(width=200)
    if args.turns < 4 or args.seeds < 1:
        console.print("[red]--turns must be at least 4 and --seeds at least 1[/]")
        return 2
    report: dict[str, dict[str, dict[str, Any]]] = {}
    for lam in args.lambdas:
        results = {
            name: [
                simulate(make, args.turns, lam, seed, name in QUERY_POLICIES) for seed in range(args.seeds)
            ]
            for name, make in policies().items()
        }
        strongest = results["fixed:gpt-4o"]
        ref_q = np.mean([r.quality for r in strongest])
        ref_c = np.mean([r.cost for r in strongest])
        table = Table(
            title=f"lambda = {lam} per USD: {args.turns} turns x {args.seeds} seeds (mean ± std over seeds)"
        )
        for col in (
            "policy",
            "cum. utility",
            "cum. reward",
            "regret",
            "regret/turn last 25%",
            "quality vs gpt-4o",
            "cost vs gpt-4o",
            "cost/turn (USD)",
            "shares (llama/mixtral/qwen/gpt-4o)",
        ):
            table.add_column(col)
        report[str(lam)] = {}
        for name, runs in results.items():

            def ms(values: list[float], fmt: str = "{:.1f}") -> str:
                return f"{fmt.format(np.mean(values))} ± {fmt.format(np.std(values))}"

            shares = "/".join(f"{np.mean([r.shares[a.name] for r in runs]):.2f}" for a in POOL)
            quality = float(np.mean([r.quality for r in runs]) / ref_q)
            cost = float(np.mean([r.cost for r in runs]) / ref_c)
            table.add_row(
                name,
                ms([r.utility for r in runs]),
                ms([r.reward for r in runs]),
                ms([r.regret for r in runs]),
                ms([r.last_quarter_regret for r in runs], "{:.4f}"),
                f"{quality:.3f}",
                f"{cost:.3f}",
                f"{np.mean([r.cost for r in runs]):.5f}",
                shares,
            )
            report[str(lam)][name] = {
                "utility": float(np.mean([r.utility for r in runs])),
                "reward": float(np.mean([r.reward for r in runs])),
                "regret": float(np.mean([r.regret for r in runs])),
                "last_quarter_regret": float(np.mean([r.last_quarter_regret for r in runs])),
                "quality_vs_strongest": quality,
                "cost_vs_strongest": cost,
                "cost_usd_per_turn": float(np.mean([r.cost for r in runs])),
                "shares": {a.name: float(np.mean([r.shares[a.name] for r in runs])) for a in POOL},
            }
        console.print(table)
    route, update = time_in_process()
    console.print(
        f"in-process LinUCB ({FEATURE_DIM} features, {len(POOL)} arms): route p50 {_pct(route, 50):.3f} ms, "
        f"p99 {_pct(route, 99):.3f} ms; update p50 {_pct(update, 50):.3f} ms, p99 {_pct(update, 99):.3f} ms"
    )
    if not args.no_postgres:
        route_pg, update_pg = time_against_postgres()
        console.print(
            f"against local Postgres (router PolicyStore): route p50 {_pct(route_pg, 50):.3f} ms, "
            f"p99 {_pct(route_pg, 99):.3f} ms; update p50 {_pct(update_pg, 50):.3f} ms, p99 {_pct(update_pg, 99):.3f} ms"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def time_against_postgres(samples: int = 500) -> tuple[list[float], list[float]]:
    """route = load the user's policy + choose; update = the ledgered, row-locked Eq. 11 transaction."""
    import asyncio

    from mars import db
    from mars_router.schema import MIGRATIONS
    from mars_router.settings import RouterSettings
    from mars_router.store import PolicyStore
    from mars_stack import LocalStack, StackSettings

    stack = LocalStack(StackSettings(start_llm=False, start_broker=False, services=())).start()

    async def run() -> tuple[list[float], list[float]]:
        dsn = stack.env["MARS_POSTGRES_DSN"]
        pool = await db.open_pool(dsn)
        await db.migrate(pool, "router", MIGRATIONS)
        store = PolicyStore(pool, RouterSettings(postgres_dsn=dsn), [a.name for a in POOL])
        rng = np.random.default_rng(1)
        route, update = [], []
        for t in range(samples):
            turn = draw_turn(rng, 1 + t % 12)
            t0 = time.perf_counter()
            decision = await store.decide("bench", f"user-{t % 20}", turn.x)
            route.append(time.perf_counter() - t0)
            await store.record_decision(f"turn-{t}", decision.policy_id, decision.arm, turn.x)
            t0 = time.perf_counter()
            await store.apply_reward(f"turn-{t}", decision.arm, float(turn.expected_quality[0]), [])
            update.append(time.perf_counter() - t0)
        await pool.close()
        return route, update

    try:
        return asyncio.run(run())
    finally:
        stack.stop()
