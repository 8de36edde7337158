"""Group advantages and the zero-variance filter: hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rljob_rollout.advantages import filter_zero_variance, group_advantages, has_zero_variance


def test_standardised_advantages_match_hand_computation():
    # rewards 0, 1, 1, 2: mean 1, unbiased std sqrt(((1)+0+0+(1))/3) = sqrt(2/3)
    std = math.sqrt(2 / 3)
    eps = 1e-6
    expected = [-1 / (std + eps), 0.0, 0.0, 1 / (std + eps)]
    np.testing.assert_allclose(group_advantages([0.0, 1.0, 1.0, 2.0], epsilon=eps), expected, rtol=1e-12)


def test_mean_centred_only_without_std_normalisation():
    np.testing.assert_allclose(group_advantages([0.25, 0.75, 0.5], normalize_std=False), [-0.25, 0.25, 0.0], atol=1e-15)


def test_equal_rewards_and_single_sample_give_zero_advantage():
    np.testing.assert_array_equal(group_advantages([0.5, 0.5, 0.5]), [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(group_advantages([0.7]), [0.0])


def test_epsilon_bounds_a_tiny_spread():
    # std of [0, 1e-9] is 7.07e-10; with eps = 1e-6 the advantages stay ~ +-3.5e-4 instead of +-0.707
    advantages = group_advantages([0.0, 1e-9], epsilon=1e-6)
    assert abs(advantages[0]) < 1e-3
    assert advantages[0] == pytest.approx(-advantages[1])


@pytest.mark.parametrize("bad", [[], [float("nan"), 1.0], [float("inf")]])
def test_bad_rewards_are_refused(bad):
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(bad)


def test_zero_variance_filter_counts_what_it_drops():
    groups = [[1.0, 1.0], [0.0, 1.0, 0.5], [0.25, 0.25, 0.25], [0.0]]
    assert [has_zero_variance(g) for g in groups] == [True, False, True, True]
    result = filter_zero_variance(groups, enabled=True)
    assert result.kept == [1]
    assert (result.groups_dropped, result.samples_dropped) == (3, 6)


def test_zero_variance_filter_off_keeps_everything():
    result = filter_zero_variance([[1.0, 1.0], [0.0, 1.0]], enabled=False)
    assert (result.kept, result.groups_dropped, result.samples_dropped) == ([0, 1], 0, 0)
