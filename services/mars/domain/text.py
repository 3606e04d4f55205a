"""Lexical helpers shared by the rule-based QTM, BM25 retrieval, packing and the deterministic judge.

Everything here is deterministic and dependency-free so the same text gives the same state, view and reward
on every replica.
"""

from __future__ import annotations

import math
import re
from typing import Any

_WORD = re.compile(r"\w+")
#: C0 control characters but tab, newline and carriage return: Postgres refuses NUL in text, and none of
#: them belongs in a turn, an id or a comment.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")

# Small English stopword set: enough to keep function words from dominating overlap and BM25 scores.
STOPWORDS: frozenset[str] = frozenset(
    """
    a an the and or but if then else of to in on at by for with from as into onto over about
    is are was were be been being am do does did done have has had having
    i me my mine we us our ours you your yours he him his she her hers it its they them their theirs
    this that these those there here what which who whom whose when where why how
    not no nor so too very can could should would will shall may might must just also
    s t d ll re ve m
    """.split()
)


def control_character(text: str) -> int | None:
    """Position of the first C0 control character other than tab, newline and return, else None."""
    found = _CONTROL.search(text)
    return found.start() if found else None


def tokenize(text: str) -> list[str]:
    """Lowercase word tokens without stopwords (order and duplicates kept, for BM25 term frequencies)."""
    return [tok for tok in _WORD.findall(text.lower()) if tok not in STOPWORDS]


def estimate_tokens(text: str) -> int:
    """Conservative token estimate: ceil(chars / 3.5) + 1; over-estimating keeps packing inside budget."""
    if not text:
        return 0
    return math.ceil(len(text) / 3.5) + 1


def overlap(a: str, b: str) -> float:
    """Fraction of the distinct content tokens of `a` that also occur in `b` (0.0 when `a` has none)."""
    ta = set(tokenize(a))
    if not ta:
        return 0.0
    tb = set(tokenize(b))
    return len(ta & tb) / len(ta)


def enum_name(enum: Any, value: int) -> str:
    """The name of a protobuf enum value, "UNSPECIFIED" for 0 and for numbers this build does not know
    (proto3 enums are open: an event from a newer or foreign producer may carry any int32)."""
    if not value:
        return "UNSPECIFIED"
    try:
        return enum.Name(value)
    except ValueError:
        return "UNSPECIFIED"
