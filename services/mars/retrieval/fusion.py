"""Rank fusion of several retrievers' results (pure)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[K]], weights: Sequence[float] | None = None, k: float = 60.0
) -> dict[K, float]:
    """Sum over rankings of w / (k + rank), rank starting at 1 (Cormack et al., 2009)."""
    weights = weights if weights is not None else [1.0] * len(rankings)
    if len(weights) != len(rankings):
        raise ValueError("one weight per ranking")
    fused: dict[K, float] = {}
    for ranking, w in zip(rankings, weights, strict=True):
        for rank, key in enumerate(ranking, start=1):
            fused[key] = fused.get(key, 0.0) + w / (k + rank)
    return fused


def min_max(scores: Mapping[K, float]) -> dict[K, float]:
    if not scores:
        return {}
    lo, hi = min(scores.values()), max(scores.values())
    span = hi - lo
    return {key: ((v - lo) / span if span > 0 else 1.0) for key, v in scores.items()}


def weighted_score_fusion(
    score_maps: Sequence[Mapping[K, float]], weights: Sequence[float]
) -> dict[K, float]:
    """Sum of min-max normalised scores times weights; a key missing from a map scores 0 there."""
    if len(weights) != len(score_maps):
        raise ValueError("one weight per score map")
    fused: dict[K, float] = {}
    for scores, w in zip(score_maps, weights, strict=True):
        for key, v in min_max(scores).items():
            fused[key] = fused.get(key, 0.0) + w * v
    return fused


def ranked(scores: Mapping[K, float]) -> list[K]:
    """Keys by score, best first; ties keep insertion order."""
    return [key for key, _ in sorted(scores.items(), key=lambda kv: -kv[1])]
