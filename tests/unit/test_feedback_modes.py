"""Feedback in the reward: ratings and thumbs, the three modes, and the arm-model shift of a correction."""

from __future__ import annotations

import numpy as np
import pytest
from mars.domain.feedback import feedback_utility, rating_from
from mars.domain.linucb import ArmModel


def test_thumbs_override_rating_and_bad_values_are_rejected() -> None:
    assert rating_from(0.3, 1) == 1.0 and rating_from(0.3, -1) == 0.0 and rating_from(0.3, 0) == 0.3
    with pytest.raises(ValueError, match="thumbs"):
        rating_from(0.5, 2)
    with pytest.raises(ValueError, match="rating"):
        rating_from(1.5, 0)


def test_modes() -> None:
    assert feedback_utility("log", 0.6, 0.1, 0.5) == 0.6
    assert feedback_utility("replace", 0.6, 0.1, 0.5) == 0.1
    assert feedback_utility("blend", 0.6, 0.1, 0.25) == pytest.approx(0.75 * 0.6 + 0.25 * 0.1)
    assert feedback_utility("replace", 0.6, None, 0.5) == 0.6  # no rating yet
    with pytest.raises(ValueError, match="unknown feedback mode"):
        feedback_utility("ignore", 0.6, 0.1, 0.5)


def test_shift_moves_b_only() -> None:
    m = ArmModel.cold(3)
    x = np.array([1.0, 0.5, 0.0])
    shifted = m.shifted(x, -0.4)
    np.testing.assert_array_equal(shifted.A, m.A)
    np.testing.assert_allclose(shifted.b, m.b - 0.4 * x)
    assert (shifted.pulls, shifted.reward_sum) == (m.pulls, m.reward_sum - 0.4)
