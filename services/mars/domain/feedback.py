"""User feedback in the reward (paper appendix G.1): per tenant it replaces the judge's utility, blends
with it, or is only logged; a correction moves an already-applied reward to the new target once."""

from __future__ import annotations

from typing import Literal, get_args

FeedbackMode = Literal["log", "replace", "blend"]
FEEDBACK_MODES: tuple[str, ...] = get_args(FeedbackMode)


def rating_from(rating: float, thumbs: int) -> float:
    """The [0, 1] rating of a feedback request: thumbs (1 up, -1 down) win over `rating` when set."""
    if thumbs not in (-1, 0, 1):
        raise ValueError("thumbs must be 1 (up), -1 (down) or 0 (unset)")
    if thumbs:
        return 1.0 if thumbs > 0 else 0.0
    if not 0.0 <= rating <= 1.0:
        raise ValueError("rating must be in [0, 1]")
    return rating


def feedback_utility(mode: str, judge_utility: float, rating: float | None, blend_weight: float) -> float:
    """The utility the router should learn from, given the judge's and the user's view of the turn."""
    if mode not in FEEDBACK_MODES:
        raise ValueError(f"unknown feedback mode {mode!r}; known: {', '.join(FEEDBACK_MODES)}")
    if rating is None or mode == "log":
        return judge_utility
    if mode == "replace":
        return rating
    return (1.0 - blend_weight) * judge_utility + blend_weight * rating
