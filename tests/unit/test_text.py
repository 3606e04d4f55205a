from mars.domain.text import estimate_tokens, overlap, tokenize


def test_tokenize_lowercases_and_drops_stopwords() -> None:
    assert tokenize("The Budget is UNDER 500 dollars, and it's fine") == [
        "budget",
        "under",
        "500",
        "dollars",
        "fine",
    ]


def test_tokenize_keeps_duplicates_for_term_frequency() -> None:
    assert tokenize("paris paris Paris") == ["paris", "paris", "paris"]


def test_estimate_tokens() -> None:
    assert estimate_tokens("") == 0
    assert estimate_tokens("a") == 2
    assert estimate_tokens("x" * 7) == 3
    assert estimate_tokens("x" * 8) == 4


def test_overlap_is_fraction_of_distinct_tokens_of_a() -> None:
    assert overlap("paris trip budget budget", "the budget for paris") == 2 / 3
    assert overlap("the of and", "anything") == 0.0
    assert overlap("hotel", "") == 0.0
    assert overlap("hotel rome", "ROME hotel") == 1.0
