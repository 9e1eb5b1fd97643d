"""Group-relative preference advantages (Pref-GRPO): win rates within groups, normalised as
group advantages are, against a hand computation."""

import math

import pytest
import torch

from flowgrpo.functional.advantages import group_pairs, preference_advantages, win_rates


def test_group_pairs_are_every_pair_within_each_group():
    firsts, seconds = group_pairs(["a", "b", "a", "a", "b"])
    # group a = samples 0, 2, 3 (combinations order), group b = 1, 4
    assert list(zip(firsts, seconds)) == [(0, 2), (0, 3), (2, 3), (1, 4)]


def test_win_rates_and_advantages_by_hand():
    # group 0 = samples 0, 1, 2: 0 beats 1 and 2, 1 ties 2 -> wins [2, 0.5, 0.5] of 2 comparisons
    # group 1 = samples 3, 4: 4 beats 3 -> wins [0, 1] of 1
    firsts, seconds, outcomes = [0, 0, 1, 3], [1, 2, 2, 4], [1.0, 1.0, 0.5, 0.0]
    rates = win_rates(outcomes, firsts, seconds, 5)
    torch.testing.assert_close(rates, torch.tensor([1.0, 0.25, 0.25, 0.0, 1.0]))
    groups = [0, 0, 0, 1, 1]
    # group means 0.5 and 0.5 -> centred [0.5, -0.25, -0.25, -0.5, 0.5]; the std of all five
    # rates: mean 0.5, squared deviations 0.25 + 0.0625 + 0.0625 + 0.25 + 0.25 = 0.875 over 5
    std = math.sqrt(0.875 / 5)
    adv = preference_advantages(outcomes, firsts, seconds, groups, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.25, -0.25, -0.5, 0.5]) / std)
    # per-group std: group 0 sqrt((0.25 + 0.0625 * 2) / 3), group 1 0.5
    adv_g = preference_advantages(outcomes, firsts, seconds, groups, global_std=False, eps=0.0)
    s0 = math.sqrt(0.375 / 3)
    torch.testing.assert_close(adv_g, torch.tensor([0.5 / s0, -0.25 / s0, -0.25 / s0, -1.0, 1.0]))


def test_soft_outcomes_and_a_sample_compared_with_none():
    # a judge's probability 0.8 that sample 0 beats 1: 0 gets 0.8, 1 gets 0.2; sample 2 is alone
    rates = win_rates([0.8], [0], [1], 3)
    torch.testing.assert_close(rates, torch.tensor([0.8, 0.2, 0.0]))


def test_all_ties_give_zero_advantages():
    firsts, seconds = group_pairs([7, 7, 7])
    adv = preference_advantages([0.5] * 3, firsts, seconds, [7, 7, 7])
    assert torch.equal(adv, torch.zeros(3))


@pytest.mark.parametrize(
    ("outcomes", "firsts", "seconds", "match"),
    [
        ([1.5], [0], [1], "in \\[0, 1\\]"),
        ([float("nan")], [0], [1], "in \\[0, 1\\]"),
        ([1.0, 0.0], [0], [1], "2 outcomes for 1 firsts"),
        ([1.0], [1], [1], "compared with itself"),
    ],
)
def test_bad_outcomes_are_named(outcomes, firsts, seconds, match):
    with pytest.raises(ValueError, match=match):
        win_rates(outcomes, firsts, seconds, 2)
