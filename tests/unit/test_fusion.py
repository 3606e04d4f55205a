import pytest
from mars.retrieval.fusion import min_max, ranked, reciprocal_rank_fusion, weighted_score_fusion


def test_rrf_sums_reciprocal_ranks() -> None:
    fused = reciprocal_rank_fusion([["a", "b", "c"], ["b", "a"]], k=60)
    assert fused["a"] == pytest.approx(1 / 61 + 1 / 62)
    assert fused["b"] == pytest.approx(1 / 62 + 1 / 61)
    assert fused["c"] == pytest.approx(1 / 63)
    assert ranked(fused)[-1] == "c"


def test_rrf_weights_and_validation() -> None:
    fused = reciprocal_rank_fusion([["a"], ["b"]], weights=[2.0, 1.0], k=0)
    assert fused == {"a": 2.0, "b": 1.0}
    with pytest.raises(ValueError):
        reciprocal_rank_fusion([["a"]], weights=[1.0, 2.0])


def test_weighted_fusion_normalises_each_map() -> None:
    fused = weighted_score_fusion([{"a": 10.0, "b": 0.0}, {"b": 0.5, "c": 0.25}], [1.0, 2.0])
    assert fused == {"a": 1.0, "b": 2.0, "c": 0.0}
    assert min_max({"x": 3.0}) == {"x": 1.0}
    assert min_max({}) == {}
