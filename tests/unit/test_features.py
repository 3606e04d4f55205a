import numpy as np
from mars.domain.features import FEATURE_DIM, FEATURE_NAMES, featurize
from mars.domain.state_rules import estimate_state
from mars.v1 import events_pb2 as ev


def _x(state: ev.SessionState, load: ev.ViewLoad | None = None, depth: int = 1) -> dict[str, float]:
    vec = featurize(state, load or ev.ViewLoad(), depth)
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
    assert f["phase=REVISE"] == 1.0 and f["pos.revision"] == 1.0 and f["pos.finalization"] == 0.0
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
        max_retrieval_score=3.0,
        mean_retrieval_score=1.0,
        num_recent=2,
    )
    f = _x(st, load, depth=50)
    assert f["load.num_blocks"] == 1.0
    assert f["load.estimated_tokens"] == 0.5
    assert f["load.has_retrieved_history"] == 1.0
    assert f["load.num_retrieved"] == 0.5
    assert f["load.max_retrieval_score"] == 0.75
    assert f["load.mean_retrieval_score"] == 0.5
    assert f["pos.turn_depth"] == 1.0
    assert f["pos.finalization"] == 1.0


def test_all_values_in_unit_interval() -> None:
    for text in ["", "what did I say yesterday", "suggest ideas", "verify it", "explain gravity"]:
        for ctx in ([], ["User: about gravity\nAssistant: ..."]):
            vec = featurize(estimate_state(text, ctx), ev.ViewLoad(estimated_tokens=10**6), 3)
            assert np.all(vec >= 0.0) and np.all(vec <= 1.0)


def test_unspecified_state_has_empty_one_hots() -> None:
    f = _x(ev.SessionState())
    assert sum(v for k, v in f.items() if k.startswith("action=")) == 0.0
    assert f["bias"] == 1.0
