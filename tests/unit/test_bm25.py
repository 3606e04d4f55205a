import pytest
from mars.domain.bm25 import BM25Index

DOCS = [
    "planning a trip to paris with a small budget",
    "python code review for the parser module",
    "paris museums and paris cafes for the trip",
    "weekly grocery list",
]


def test_search_ranks_relevant_docs_first() -> None:
    idx = BM25Index(DOCS)
    hits = idx.search("paris trip", 10)
    assert [i for i, _ in hits] == [2, 0]
    assert hits[0][1] > hits[1][1] > 0


def test_search_respects_k_and_only_positive_scores() -> None:
    idx = BM25Index(DOCS)
    assert len(idx.search("paris trip", 1)) == 1
    assert idx.search("unrelated quantum", 5) == []
    assert idx.search("paris", 0) == []


def test_ties_broken_by_lower_index() -> None:
    idx = BM25Index(["alpha beta", "gamma delta", "alpha beta"])
    hits = idx.search("alpha", 3)
    assert [i for i, _ in hits] == [0, 2]
    assert hits[0][1] == hits[1][1]


def test_rare_terms_weigh_more_and_longer_docs_are_normalised() -> None:
    idx = BM25Index(["common rare", "common", "common", "common filler filler filler filler filler"])
    scores = dict(idx.search("common rare", 4))
    assert scores[0] > scores[1]
    assert scores[1] > scores[3]  # same tf, longer document


def test_empty_corpus() -> None:
    assert BM25Index([]).search("anything", 3) == []


def test_extending_a_document_scores_as_adding_it_whole() -> None:
    whole = BM25Index(["red apples and pears\nripe red cherries", "blue sky"])
    grown = BM25Index(["red apples and pears", "blue sky"])
    grown.extend(0, "\nripe red cherries")
    for query in ("red cherries", "blue", "pears sky"):
        assert whole.scores(query) == pytest.approx(grown.scores(query))
    assert grown.avgdl == whole.avgdl and grown.idf("cherries") == whole.idf("cherries")


def test_presence_says_which_documents_hold_which_term() -> None:
    index = BM25Index(["red apples and pears", "green pears", "blue sky"])
    held = index.presence(["pears", "sky", "absent"], [0, 2])
    assert held.tolist() == [[True, False], [False, True], [False, False]]
    assert index.presence([], [0, 1]).shape == (0, 2)
