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


def _presence_by_scan(index: BM25Index, terms: list[str], docs: list[int]) -> list[list[bool]]:
    """What presence must say, read from scratch off each document's term counts (no cache)."""
    return [[term in index._tfs[i] for i in docs] for term in terms]


def test_presence_reads_postings_cached_and_invalidated_as_documents_change() -> None:
    index = BM25Index(["red apples", "green pears"])
    terms = ["pears", "apples", "red", "plums", "absent"]
    assert index.presence(terms, [0, 1]).tolist() == _presence_by_scan(index, terms, [0, 1])
    # The arrays cached by that call must follow every change to the documents.
    index.add("ripe plums and pears")
    index.extend(0, "\nwith plums")
    docs = [2, 0, 1]
    assert index.presence(terms, docs).tolist() == _presence_by_scan(index, terms, docs)
    assert index.presence(["plums"], docs).tolist() == [[True, True, False]]
    # Built at once, the same index answers the same.
    whole = BM25Index(["red apples\nwith plums", "green pears", "ripe plums and pears"])
    assert whole.presence(terms, docs).tolist() == index.presence(terms, docs).tolist()


def test_presence_answers_any_order_of_documents_and_repeats() -> None:
    index = BM25Index(DOCS)
    terms = ["paris", "trip", "parser", "grocery", "nowhere"]
    for docs in ([3, 2, 1, 0], [2, 2, 0], [1], list(range(len(DOCS)))):
        held = index.presence(terms, docs)
        assert held.tolist() == _presence_by_scan(index, terms, docs)
        assert held.dtype == bool and held.flags["C_CONTIGUOUS"]
    assert index.presence(["paris"], []).shape == (1, 0)


def test_idfs_and_token_scores_equal_their_one_by_one_forms() -> None:
    index = BM25Index(DOCS)
    terms = ["paris", "trip", "weekly", "nowhere"]
    assert index.idfs(terms) == {t: index.idf(t) for t in terms}
    query = "Paris trip on a budget"
    assert index.token_scores(index.tokenize(query)) == index.scores(query)


@pytest.mark.parametrize("gone", [{2}, {0, 3}, {1}])
def test_excluded_documents_score_as_if_never_added(gone: set[int]) -> None:
    """A live session ranked against the others: the index holding it but excluding it must score and
    weigh (idf, average length) exactly as an index that never held it."""
    index = BM25Index(DOCS)
    kept = [i for i in range(len(DOCS)) if i not in gone]
    without = BM25Index([DOCS[i] for i in kept])
    query = "paris trip budget for the parser"
    terms = index.tokenize(query)
    assert index.idfs(terms, gone) == pytest.approx(without.idfs(terms))
    scores = index.scores(query, gone)
    assert set(scores) <= set(kept)
    assert {kept.index(i): s for i, s in scores.items()} == pytest.approx(without.scores(query))
    # Not excluding changes the figures (the test can fail): idf counts the excluded document.
    assert index.idfs(terms) != pytest.approx(without.idfs(terms))
