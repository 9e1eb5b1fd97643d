"""Advantages, reward combination and the clipped loss, against hand computations."""

import math

import pytest
import torch

from flowgrpo.functional.advantages import (
    combine_rewards,
    group_advantages,
    reward_stats,
    zero_std_ratio,
)
from flowgrpo.functional.losses import flow_grpo_loss, kl_penalty_image


def test_group_advantages_global_and_per_group_std_by_hand():
    r = torch.tensor([1.0, 3.0, 10.0, 14.0])
    ids = ["cat", "cat", "dog", "dog"]
    # group means 2 and 12 -> centred [-1, 1, -2, 2]
    global_std = r.std(unbiased=False).item()  # population std of all four rewards
    adv = group_advantages(r, ids, global_std=True, eps=0.0)
    expected = torch.tensor([-1.0, 1.0, -2.0, 2.0]) / global_std
    torch.testing.assert_close(adv, expected)
    adv_g = group_advantages(r, ids, global_std=False, eps=0.0)
    torch.testing.assert_close(adv_g, torch.tensor([-1.0, 1.0, -1.0, 1.0]))
    adv_eps = group_advantages(r, ids, global_std=False, eps=1e-4)
    torch.testing.assert_close(
        adv_eps,
        torch.tensor([-1.0, 1.0, -2.0, 2.0])
        / torch.tensor([1 + 1e-4, 1 + 1e-4, 2 + 1e-4, 2 + 1e-4]),
    )


def test_groups_of_one_get_zero_and_int_ids_work():
    r = torch.tensor([5.0, 1.0, 2.0])
    adv = group_advantages(r, [7, 3, 3], global_std=False)
    assert adv[0] == 0.0
    assert adv[1] < 0 < adv[2]
    adv_t = group_advantages(r, torch.tensor([7, 3, 3]), global_std=False)
    torch.testing.assert_close(adv, adv_t)


def test_equal_reward_groups_get_exactly_zero_advantage():
    """A group whose rewards are all equal gets A = 0 exactly, also when the common value is not
    representable in fp32 (its fp32 mean is then an ulp off: 0.1 x 12 / 12 != 0.1, which gave
    advantages of ~5e-7 that an exact-zero filter kept). Swept over 99 values x 4 group sizes,
    with a second group that has spread; the spread group's advantages equal the float64 ones."""
    kept = 0
    for k in (4, 12, 16, 24):
        for i in range(1, 100):
            r = torch.tensor([i / 100] * k + [0.0, 1.0])
            ids = [0] * k + [1, 1]
            for global_std in (True, False):
                adv = group_advantages(r, ids, global_std=global_std)
                kept += int((adv[:k] != 0).any())
                r64 = r.double()
                std = r64.std(unbiased=False) if global_std else torch.tensor(0.5, dtype=r64.dtype)
                expected = torch.tensor([-0.5, 0.5], dtype=r64.dtype) / (std + 1e-4)
                torch.testing.assert_close(adv[k:].double(), expected, rtol=1e-6, atol=1e-7)
    assert kept == 0


def test_combine_weighted_sum_and_advantage_aggregation_by_hand():
    rewards = {"a": torch.tensor([1.0, 0.0, 2.0, 4.0]), "b": torch.tensor([0.0, 10.0, 0.0, 4.0])}
    weights = {"a": 2.0, "b": 0.5}
    ids = [0, 0, 1, 1]
    out = combine_rewards(rewards, weights, ids, mode="weighted_sum", global_std=False, eps=0.0)
    torch.testing.assert_close(out.reward, torch.tensor([2.0, 5.0, 4.0, 10.0]))
    # groups: [2, 5] mean 3.5 std 1.5 ; [4, 10] mean 7 std 3
    torch.testing.assert_close(out.advantages, torch.tensor([-1.0, 1.0, -1.0, 1.0]))
    agg = combine_rewards(rewards, weights, ids, mode="advantage", global_std=False, eps=0.0)
    # a: groups [1,0] -> [1,-1], [2,4] -> [-1,1]; b: [0,10] -> [-1,1], [0,4] -> [-1,1]
    expected = 2.0 * torch.tensor([1.0, -1.0, -1.0, 1.0]) + 0.5 * torch.tensor(
        [-1.0, 1.0, -1.0, 1.0]
    )
    torch.testing.assert_close(agg.advantages, expected)
    with pytest.raises(ValueError, match="mode"):
        combine_rewards(rewards, weights, ids, mode="max")
    with pytest.raises(ValueError, match="weight"):
        combine_rewards(rewards, {"a": 1.0}, ids)


def test_zero_std_ratio_and_reward_stats():
    r = torch.tensor([1.0, 1.0, 0.0, 2.0, 3.0, 3.0])
    ids = ["x", "x", "y", "y", "z", "z"]
    assert zero_std_ratio(r, ids) == pytest.approx(2 / 3)
    stats = reward_stats({"ocr": r}, ids)
    assert stats["reward/ocr_mean"] == pytest.approx(10 / 6)
    assert stats["reward/ocr_std"] == pytest.approx(r.std(unbiased=False).item())
    assert stats["zero_std_ratio/ocr"] == pytest.approx(2 / 3)


def test_loss_gradient_at_ratio_one_is_minus_advantage_over_batch():
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    old = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    logp = old.clone().requires_grad_(True)
    loss, metrics = flow_grpo_loss(logp, old, adv, clip_range=1e-4, adv_clip_max=5.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv / 4)
    assert loss.item() == pytest.approx(-adv.mean().item())
    assert metrics["approx_kl"].item() == 0.0
    assert metrics["clipfrac"].item() == 0.0
    assert metrics["ratio_mean"].item() == 1.0


def test_loss_metrics_k1_and_k2_kl_estimators_by_hand():
    """approx_kl = mean(-log r) (k1); approx_kl_k2 = 0.5 mean((log r)^2), flow_grpo's."""
    old = torch.tensor([-1.0, -2.0, 0.5])
    new = old + torch.tensor([0.1, -0.2, 0.0])
    _, m = flow_grpo_loss(new, old, torch.ones(3), clip_range=0.5, adv_clip_max=5.0)
    assert m["approx_kl"].item() == pytest.approx((-0.1 + 0.2 + 0.0) / 3, abs=1e-6)
    assert m["approx_kl_k2"].item() == pytest.approx(0.5 * (0.01 + 0.04) / 3, abs=1e-6)


def test_loss_gradient_is_zero_outside_the_clip_in_the_improving_direction():
    adv = torch.tensor([1.0, -1.0])
    old = torch.zeros(2)
    # ratio e^0.01 > 1 + eps with A > 0, and e^-0.01 < 1 - eps with A < 0: both clipped.
    logp = torch.tensor([0.01, -0.01], requires_grad=True)
    loss, metrics = flow_grpo_loss(logp, old, adv, clip_range=1e-4, adv_clip_max=5.0)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2))
    assert metrics["clipfrac"].item() == 1.0
    assert metrics["approx_kl"].item() == pytest.approx(0.0, abs=1e-9)
    # ...but the pessimistic side still has a gradient (ratio fell while A > 0).
    logp2 = torch.tensor([-0.01], requires_grad=True)
    flow_grpo_loss(logp2, torch.zeros(1), torch.ones(1), clip_range=1e-4, adv_clip_max=5.0)[
        0
    ].backward()
    assert logp2.grad.item() == pytest.approx(-math.exp(-0.01))


def test_advantage_clipping():
    logp = torch.zeros(2, requires_grad=True)
    loss, _ = flow_grpo_loss(
        logp, torch.zeros(2), torch.tensor([100.0, -100.0]), clip_range=0.1, adv_clip_max=5.0
    )
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-2.5, 2.5]))
    with pytest.raises(ValueError, match="clip_range"):
        flow_grpo_loss(logp, torch.zeros(2), torch.zeros(2), clip_range=0.0, adv_clip_max=5.0)


def test_kl_penalty_zero_for_equal_means_and_hand_value_otherwise():
    mean = torch.randn(2, 3, 4)
    assert torch.equal(
        kl_penalty_image(mean, mean.clone(), torch.tensor([0.3, 0.5])), torch.zeros(2)
    )
    ref = torch.zeros(2, 1, 2)
    m = torch.tensor([[[1.0, 3.0]], [[2.0, 0.0]]])
    std = torch.tensor([1.0, 2.0])
    # sample 0: (1 + 9) / 2 / (2 * 1) = 2.5 ; sample 1: (4 + 0) / 2 / (2 * 4) = 0.25
    torch.testing.assert_close(kl_penalty_image(m, ref, std), torch.tensor([2.5, 0.25]))
