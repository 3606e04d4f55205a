import numpy as np
import pytest
from mars.domain.features import FEATURE_DIM, FEATURE_NAMES, RECENT_TURNS, featurize, phase_of
from mars.domain.state_rules import estimate_state
from mars.v1 import events_pb2 as ev


def _x(
    state: ev.SessionState, load: ev.ViewLoad | None = None, depth: int = 1, phases: tuple[int, ...] = ()
) -> dict[str, float]:
    vec = featurize(state, load or ev.ViewLoad(), depth, phases)
    assert vec.dtype == np.float64 and vec.shape == (FEATURE_DIM,)
    return dict(zip(FEATURE_NAMES, vec.tolist(), strict=True))


def test_dimension_and_names() -> None:
    assert FEATURE_DIM == 35
    assert len(set(FEATURE_NAMES)) == FEATURE_DIM
    assert FEATURE_NAMES[0] == "bias"


def test_one_hot_groups_and_flags() -> None:
    st = estimate_state("make it shorter", ["User: cover letter draft\nAssistant: Dear ..."])
    f = _x(st, depth=5)
    assert f["bias"] == 1.0
    assert f["action=MATCH"] == 1.0 and f["action=NEW_TOPIC"] == 0.0
    assert f["phase=REVISE"] == 1.0
    assert sum(v for k, v in f.items() if k.startswith("phase=")) == 1.0
    assert sum(v for k, v in f.items() if k.startswith("query_type=")) == 1.0
    assert f["top_k=5"] == 1.0 and f["top_k=3"] == 0.0
    assert f["lens_full"] == 1.0 and f["need_memory"] == 1.0 and f["prefer_recent"] == 1.0
    assert f["pos.turn_depth"] == 0.25


def test_load_features_are_normalised_and_clipped() -> None:
    st = estimate_state("summarize the final plan", [])
    load = ev.ViewLoad(
        num_blocks=40,
        estimated_tokens=2000,
        has_retrieved_history=True,
        num_retrieved=4,
        max_retrieval_score=0.9,
        mean_retrieval_score=0.35,
        num_recent=2,
    )
    f = _x(st, load, depth=50)
    assert f["load.num_blocks"] == 1.0
    assert f["load.estimated_tokens"] == 0.5
    assert f["load.has_retrieved_history"] == 1.0
    assert f["load.num_retrieved"] == 0.5
    assert f["pos.turn_depth"] == 1.0


def test_score_features_keep_the_views_relative_scores() -> None:
    """The view reports scores relative to its ranking (build_view); the features keep them as they are
    (a squash s/(1+s) mapped 0.9 to 0.47 and RRF sums <= 0.15 to <= 0.13) and clip foreign values."""
    f = _x(ev.SessionState(), ev.ViewLoad(max_retrieval_score=0.9, mean_retrieval_score=0.35))
    assert (f["load.max_retrieval_score"], f["load.mean_retrieval_score"]) == (0.9, 0.35)
    f = _x(ev.SessionState(), ev.ViewLoad(max_retrieval_score=7.5, mean_retrieval_score=-1.0))
    assert (f["load.max_retrieval_score"], f["load.mean_retrieval_score"]) == (1.0, 0.0)


def test_position_flags_do_not_repeat_the_phase() -> None:
    """The old flags were phase==REVISE / phase==SYNTHESIZE, copies of the phase one-hot."""
    f = _x(ev.SessionState(phase=ev.REVISE))
    assert f["phase=REVISE"] == 1.0 and f["pos.recent_revision"] == 0.0
    f = _x(ev.SessionState(phase=ev.SYNTHESIZE))
    assert f["phase=SYNTHESIZE"] == 1.0 and f["pos.recent_finalization"] == 0.0
    names = list(FEATURE_NAMES)
    position = names.index("pos.turn_depth")
    phases = slice(names.index("phase=EXPLORE"), names.index("phase=VERIFY") + 1)
    for phase in (ev.EXPLORE, ev.CONSTRAIN, ev.REVISE, ev.SYNTHESIZE, ev.VERIFY):
        vec = featurize(ev.SessionState(phase=phase), ev.ViewLoad(), 1)
        # Without history no position flag is set, whatever the phase one-hot says.
        assert vec[phases].sum() == 1.0 and vec[position + 1 :].sum() == 0.0


@pytest.mark.parametrize(
    ("phases", "revision", "finalization"),
    [
        ((), 0.0, 0.0),
        ((ev.REVISE,), 1.0, 0.0),
        ((ev.REVISE, ev.EXPLORE, ev.EXPLORE), 1.0, 0.0),
        # Older than RECENT_TURNS turns: no longer recent.
        ((ev.REVISE, ev.EXPLORE, ev.EXPLORE, ev.EXPLORE), 0.0, 0.0),
        ((ev.EXPLORE, ev.SYNTHESIZE), 0.0, 1.0),
        ((ev.SYNTHESIZE, ev.REVISE, ev.VERIFY), 1.0, 1.0),
    ],
)
def test_recent_revision_and_finalization_flags(
    phases: tuple[int, ...], revision: float, finalization: float
) -> None:
    assert RECENT_TURNS == 3
    f = _x(ev.SessionState(phase=ev.VERIFY), phases=phases)
    assert (f["pos.recent_revision"], f["pos.recent_finalization"]) == (revision, finalization)


def test_phase_of_reads_back_a_logged_feature_vector() -> None:
    for text in ["make it shorter", "verify it", "summarize the final plan", "explain gravity"]:
        st = estimate_state(text, ["User: a cover letter draft about gravity\nAssistant: Dear ..."])
        vec = featurize(st, ev.ViewLoad(), 2, (ev.REVISE,))
        assert phase_of(vec.tolist()) == st.phase
    assert phase_of(featurize(ev.SessionState(), ev.ViewLoad(), 1).tolist()) == ev.PHASE_UNSPECIFIED
    assert phase_of([1.0] * 10) == ev.PHASE_UNSPECIFIED  # another feature space (or an older layout)


def test_all_values_in_unit_interval() -> None:
    for text in ["", "what did I say yesterday", "suggest ideas", "verify it", "explain gravity"]:
        for ctx in ([], ["User: about gravity\nAssistant: ..."]):
            vec = featurize(estimate_state(text, ctx), ev.ViewLoad(estimated_tokens=10**6), 3)
            assert np.all(vec >= 0.0) and np.all(vec <= 1.0)


def test_unspecified_state_has_empty_one_hots() -> None:
    f = _x(ev.SessionState())
    assert sum(v for k, v in f.items() if k.startswith("action=")) == 0.0
    assert f["bias"] == 1.0
