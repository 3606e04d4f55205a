"""Router features (paper Table 7) on real candidate views of the pipeline.

One user talks through the ingress over two sessions (rules QTM, real memory service with MiniLM + BM25
and reciprocal-rank fusion, real router). The views' retrieval scores are raw fused reciprocal-rank sums
(below ~0.15); a squash s/(1+s) of them kept both score features under 0.13, whereas the per-view
normalisation spreads them over [0, 1]. The router's session-position flags come from the session's
earlier turns, not from the current phase.
"""

from __future__ import annotations

import grpc
import pytest
from conftest import ingress_stub, read_events
from mars.config import TOPIC_ROUTED, TOPIC_VIEW
from mars.domain.features import FEATURE_NAMES, RECENT_TURNS, featurize
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars_stack import LocalStack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(smollm2_stack: LocalStack) -> LocalStack:
    """The SmolLM2 stack this module shares with its neighbour (conftest.smollm2_stack)."""
    return smollm2_stack


TENANT = "features"
USER = "user-lynx"
# Rules QTM: an edit loop (REVISE, VERIFY, SYNTHESIZE) in s1, temporal recalls (GLOBAL, top_k 8) in both
# sessions; the thread grows past the recent window, so LOCAL turns retrieve older thread records too.
SCRIPT: list[tuple[str, str]] = [
    ("s1", "I am writing a travel guide about lynx tracking in the Carpathian mountains."),
    ("s1", "Which lynx tracking trails in the Carpathian mountains suit beginners?"),
    ("s1", "Add a section on lynx tracking gear for the winter trails."),
    ("s1", "Rewrite the lynx tracking guide intro to be shorter."),
    ("s1", "Which Carpathian villages are close to the lynx trails?"),
    ("s1", "Check that the lynx guide mentions permits for the mountains."),
    ("s1", "Summarize the final lynx tracking guide."),
    ("s1", "What did I say earlier about lynx tracking gear?"),
    ("s2", "I want to bake a rye sourdough loaf on Saturday."),
    ("s2", "Remember the lynx trails I asked about before? Which one was for beginners?"),
    ("s2", "How long should the rye sourdough loaf proof?"),
    ("s2", "What did I say previously about Carpathian villages?"),
]
MAX_SCORE = FEATURE_NAMES.index("load.max_retrieval_score")
MEAN_SCORE = FEATURE_NAMES.index("load.mean_retrieval_score")
RECENT_REVISION = FEATURE_NAMES.index("pos.recent_revision")
RECENT_FINALIZATION = FEATURE_NAMES.index("pos.recent_finalization")


@pytest.fixture(scope="module")
def turns(stack: LocalStack) -> dict[str, tuple[ev.ViewBuilt, ev.Routed]]:
    """turn_id -> (view, routed event) for every scripted turn, sent in order.

    Views and routing decisions come before generation, so a turn whose answer runs past the deadline on
    a loaded machine still has both; such a turn is tolerated (its pair is just not stored in memory)."""
    stub = ingress_stub(stack, TENANT)
    failed: list[str] = []
    for session, text in SCRIPT:
        req = svc.TurnRequest(
            tenant=TENANT,
            user_id=USER,
            session_id=session,
            text=text,
            options={"max_tokens": "8", "view_tokens": "64"},  # features come before packing
        )
        try:
            stub.SendTurn(req, timeout=180)
        except grpc.RpcError as exc:
            failed.append(f"{text!r}: {exc.code()} {exc.details()}")
    assert len(failed) <= len(SCRIPT) // 2, failed
    views = read_events(stack, TOPIC_VIEW, ev.ViewBuilt)
    routed = read_events(stack, TOPIC_ROUTED, ev.Routed)
    by_id = {r.turn.turn_id: r for r in routed if r.turn.tenant == TENANT}
    out = {v.turn.turn_id: (v, by_id[v.turn.turn_id]) for v in views if v.turn.tenant == TENANT}
    assert sorted((v.turn.session_id, v.text) for v, _ in out.values()) == sorted(SCRIPT)
    return out


def test_score_features_spread_over_the_unit_interval(
    turns: dict[str, tuple[ev.ViewBuilt, ev.Routed]],
) -> None:
    with_history = [(v, r) for v, r in turns.values() if v.view.load.has_retrieved_history]
    assert len(with_history) >= 3, "the script should make several views retrieve history"
    values: list[float] = []
    for view, routed in with_history:
        raw = [b.score for b in view.view.blocks if b.kind == ev.RETRIEVED_HISTORY]
        # The premise: the retriever's fused scores are small, so the old squash kept them near 0.
        assert raw and max(raw) < 0.2 and max(s / (1 + s) for s in raw) < 0.17
        x = featurize(view.state, view.view.load, view.state.thread_depth)
        mx, mean = x[MAX_SCORE], x[MEAN_SCORE]
        assert 0.0 <= mean <= mx <= 1.0
        # The live router routed on exactly these values.
        assert (routed.features[MAX_SCORE], routed.features[MEAN_SCORE]) == pytest.approx((mx, mean))
        values += [mx, mean]
    # Per-view normalisation: the strongest view reaches the top of the range and the features spread.
    assert max(values) == pytest.approx(1.0)
    assert max(values) - min(values) >= 0.4, values


def test_router_flags_recent_revisions_of_the_session(
    turns: dict[str, tuple[ev.ViewBuilt, ev.Routed]],
) -> None:
    """pos.recent_revision / pos.recent_finalization: a REVISE / SYNTHESIZE among the session's last
    RECENT_TURNS turns before this one, as the router knows them from the decisions it logged."""
    by_session: dict[str, list[ev.Routed]] = {}
    for _, routed in turns.values():
        by_session.setdefault(routed.turn.session_id, []).append(routed)
    flagged = 0
    for events in by_session.values():
        events.sort(key=lambda r: r.turn.seq)
        for i, routed in enumerate(events):
            earlier = [e.state.phase for e in events[max(0, i - RECENT_TURNS) : i]]
            expected = (float(ev.REVISE in earlier), float(ev.SYNTHESIZE in earlier))
            got = (routed.features[RECENT_REVISION], routed.features[RECENT_FINALIZATION])
            assert got == expected, (routed.text, [ev.Phase.Name(p) for p in earlier])
            flagged += int(sum(expected) > 0)
    # The script's edit loop sets the flags on turns whose own phase is not REVISE / SYNTHESIZE.
    assert flagged >= 3
    phases = [r.state.phase for r in by_session["s1"]]
    assert ev.REVISE in phases and ev.SYNTHESIZE in phases


def test_each_turn_is_embedded_once_and_its_vector_travels_sealed_on_the_state_event(
    stack: LocalStack, turns: dict[str, tuple[ev.ViewBuilt, ev.Routed]]
) -> None:
    """The learned controller's embedding of the turn rides on the state event (opened here with the data
    keys, as memory opens it), made by the model memory runs: memory takes it instead of embedding again."""
    import numpy as np
    from mars.config import TOPIC_STATE
    from mars.domain.vectors import decode_vector
    from mars.retrieval.embedder import embedder_tag, load_embedder

    states = [s for s in read_events(stack, TOPIC_STATE, ev.StateEstimated) if s.turn.turn_id in turns]
    assert len(states) == len(turns)
    embedder = load_embedder()
    for state in states:
        assert state.text_embedder == embedder_tag(None)
        vector = decode_vector(state.text_embedding)
        assert np.allclose(vector, embedder.encode([state.text])[0], atol=1e-4), state.text
