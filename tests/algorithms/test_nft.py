"""DiffusionNFT math: hand values, the gradient at the old policy against plain flow matching,
where gradients flow, and the old-policy schedules (NVlabs/DiffusionNFT train_nft_sd3.py)."""

import pytest
import torch

from flowgrpo.algorithms.nft import (
    forward_noising,
    nft_loss,
    old_policy_decay,
    optimality_probability,
    update_old_policy_,
)


def test_optimality_probability_by_hand():
    adv = torch.tensor([-10.0, -5.0, -2.5, 0.0, 1.0, 5.0, 7.0])
    expected = torch.tensor([0.0, 0.0, 0.25, 0.5, 0.6, 1.0, 1.0])
    torch.testing.assert_close(optimality_probability(adv), expected)
    # adv_clip_max sets both the clamp and the scale: A = 1 of 2 -> 1/2/2 + 0.5 = 0.75
    torch.testing.assert_close(
        optimality_probability(torch.tensor([1.0, -3.0]), adv_clip_max=2.0),
        torch.tensor([0.75, 0.0]),
    )
    with pytest.raises(ValueError, match="adv_clip_max"):
        optimality_probability(adv, adv_clip_max=0.0)


def test_forward_noising_by_hand_with_per_sample_sigma():
    x0 = torch.tensor([[1.0, 2.0], [4.0, -4.0]])
    noise = torch.tensor([[3.0, -1.0], [0.0, 8.0]])
    out = forward_noising(x0, noise, torch.tensor([0.25, 0.5]))
    torch.testing.assert_close(out, torch.tensor([[1.5, 1.25], [2.0, 2.0]]))
    torch.testing.assert_close(forward_noising(x0, noise, 0.0), x0)
    torch.testing.assert_close(forward_noising(x0, noise, 1.0), noise)


def _hand_case():
    # x0 = [1, 0], eps = [0, 1], t = 0.5 -> x_t = [0.5, 0.5]; v_old = 0, v = [1, -1]
    x0 = torch.tensor([[1.0, 0.0]])
    x_t = forward_noising(x0, torch.tensor([[0.0, 1.0]]), 0.5)
    return torch.tensor([[1.0, -1.0]]), torch.zeros(1, 2), x_t, x0


def test_nft_loss_by_hand_beta_one():
    v, v_old, x_t, x0 = _hand_case()
    # v+ = v -> x0+ = [0, 1], error [-1, 1], w+ = 1, L+ = 1
    # v- = 2 v_old - v = [-1, 1] -> x0- = [1, 0] = x0, error 0, w- = 1e-5 (clip), L- = 0
    loss, metrics = nft_loss(v, v_old, x_t, x0, 0.5, torch.tensor([0.75]), beta=1.0)
    assert loss.item() == pytest.approx(5 * (0.75 * 1.0 + 0.25 * 0.0))  # 3.75
    assert metrics["unweighted_policy_loss"].item() == pytest.approx(0.75)
    assert metrics["old_deviate"].item() == pytest.approx(1.0)


def test_nft_loss_by_hand_beta_half_with_kl():
    v, v_old, x_t, x0 = _hand_case()
    # v+ = 0.5 v = [0.5, -0.5] -> x0+ = [0.25, 0.75], error [-0.75, 0.75], w+ = 0.75,
    #   L+ = 0.5625 / 0.75 = 0.75
    # v- = -0.5 v = [-0.5, 0.5] -> x0- = [0.75, 0.25], error [-0.25, 0.25], w- = 0.25,
    #   L- = 0.0625 / 0.25 = 0.25
    # policy = 5 * (0.75 * 0.75 + 0.25 * 0.25) / 0.5 = 6.25; KL = mean((v - 0)^2) = 1
    r = torch.tensor([0.75])
    loss, metrics = nft_loss(
        v, v_old, x_t, x0, 0.5, r, beta=0.5, kl_beta=0.1, v_ref=torch.zeros(1, 2)
    )
    assert metrics["policy_loss"].item() == pytest.approx(6.25)
    assert metrics["kl_div"].item() == pytest.approx(1.0)
    assert metrics["old_kl_div"].item() == pytest.approx(0.0)
    assert loss.item() == pytest.approx(6.25 + 0.1 * 1.0)
    # kl_beta = 0 with v_ref given: the KL is logged but not added
    loss0, metrics0 = nft_loss(v, v_old, x_t, x0, 0.5, r, beta=0.5, v_ref=torch.zeros(1, 2))
    assert loss0.item() == pytest.approx(6.25)
    assert metrics0["kl_div"].item() == pytest.approx(1.0)


def _batch(seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    shape = (3, 2, 4, 4)
    x0 = torch.randn(shape, generator=g, dtype=dtype)
    eps = torch.randn(shape, generator=g, dtype=dtype)
    v_old = torch.randn(shape, generator=g, dtype=dtype)
    sigma = torch.tensor([0.9, 0.5, 0.2], dtype=dtype)
    r = optimality_probability(torch.tensor([-3.0, 0.0, 7.0], dtype=dtype))  # 0.2, 0.5, 1
    return x0, eps, v_old, sigma, r


def _plain_fm_grad(v: torch.Tensor, eps: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Independent reference: gradient of the per-sample rectified-flow loss
    mean_d (v - (eps - x0))^2, summed over the batch (so row b is sample b's gradient)."""
    v = v.detach().clone().requires_grad_(True)
    ((v - (eps - x0)) ** 2).mean(dim=(1, 2, 3)).sum().backward()
    return v.grad


@pytest.mark.parametrize("beta", [1.0, 0.1, 1e-3])
def test_gradient_at_old_policy_is_signed_multiple_of_flow_matching(beta):
    """At v_theta = v_old: grad = (2r - 1) * c * grad(plain FM), c = 5 t / (B mean|eps - x0 - v_old|)
    per sample, for every beta. So r = 1 pulls toward plain flow matching and r = 0.5 (A = 0,
    a constant reward) gives exactly no gradient."""
    x0, eps, v_old, sigma, r = _batch()
    x_t = forward_noising(x0, eps, sigma)
    v = v_old.clone().requires_grad_(True)
    loss, _ = nft_loss(v, v_old, x_t, x0, sigma, r, beta=beta)
    loss.backward()

    batch = x0.shape[0]
    w = (eps - x0 - v_old).abs().mean(dim=(1, 2, 3))
    c = 5.0 * sigma / (batch * w)
    expected = ((2 * r - 1) * c).view(-1, 1, 1, 1) * _plain_fm_grad(v_old, eps, x0)
    torch.testing.assert_close(v.grad, expected, rtol=1e-10, atol=1e-13)
    assert v.grad[1].abs().max().item() < 1e-13  # r = 0.5: no gradient at all
    assert (v.grad[2] * _plain_fm_grad(v_old, eps, x0)[2]).sum() > 0  # r = 1: same direction


def test_beta_one_and_r_one_is_adaptive_flow_matching_at_any_theta():
    """With beta = 1 the positive policy is v_theta itself: at r = 1 the loss is x0-weighted flow
    matching everywhere, grad = 5 t / (B mean|eps - x0 - v|) * grad(plain FM)."""
    x0, eps, v_old, sigma, _ = _batch(seed=1)
    g = torch.Generator().manual_seed(7)
    v0 = v_old + 0.3 * torch.randn(v_old.shape, generator=g, dtype=v_old.dtype)
    v = v0.clone().requires_grad_(True)
    r = torch.ones(3, dtype=x0.dtype)
    loss, _ = nft_loss(v, v_old, forward_noising(x0, eps, sigma), x0, sigma, r, beta=1.0)
    loss.backward()
    c = 5.0 * sigma / (3 * (eps - x0 - v0).abs().mean(dim=(1, 2, 3)))
    expected = c.view(-1, 1, 1, 1) * _plain_fm_grad(v0, eps, x0)
    torch.testing.assert_close(v.grad, expected, rtol=1e-10, atol=1e-13)


def test_gradients_flow_only_into_v_theta_and_kl_adds_its_own():
    x0, eps, v_old, sigma, _ = _batch(seed=2)
    x_t = forward_noising(x0, eps, sigma)
    r = torch.full((3,), 0.5, dtype=x0.dtype)  # no policy gradient at theta = old
    v_old_leaf = v_old.clone().requires_grad_(True)
    v_ref = (v_old + 0.5).requires_grad_(True)
    v = v_old.clone().requires_grad_(True)
    loss, _ = nft_loss(v, v_old_leaf, x_t, x0, sigma, r, beta=1.0, kl_beta=1e-2, v_ref=v_ref)
    loss.backward()
    assert v_old_leaf.grad is None  # the old policy is a constant (no_grad in the authors' code)
    assert v_ref.grad is None  # so is the reference model
    d = v[0].numel()
    # only the KL is left: d/dv of kl_beta * mean_b mean_d (v - v_ref)^2
    expected = 2 * 1e-2 * (v_old - v_ref.detach()) / (3 * d)
    torch.testing.assert_close(v.grad, expected, rtol=1e-10, atol=1e-14)


def test_bf16_inputs_compute_in_fp32():
    x0, eps, v_old, sigma, r = _batch(seed=3, dtype=torch.float32)
    x_t = forward_noising(x0, eps, sigma)
    v = v_old + 0.1
    loss16, _ = nft_loss(v.bfloat16(), v_old.bfloat16(), x_t, x0, sigma, r, beta=1.0)
    loss32, _ = nft_loss(
        v.bfloat16().float(), v_old.bfloat16().float(), x_t, x0, sigma, r, beta=1.0
    )
    assert loss16.dtype == torch.float32
    assert loss16.item() == loss32.item()


def test_nft_loss_rejects_bad_input():
    v, v_old, x_t, x0 = _hand_case()
    r = torch.tensor([0.5])
    with pytest.raises(ValueError, match="beta must be > 0"):
        nft_loss(v, v_old, x_t, x0, 0.5, r, beta=0.0)
    with pytest.raises(ValueError, match="v_ref"):
        nft_loss(v, v_old, x_t, x0, 0.5, r, beta=1.0, kl_beta=1e-4)
    with pytest.raises(ValueError, match="share one shape"):
        nft_loss(v, v_old[:, :1], x_t, x0, 0.5, r, beta=1.0)
    with pytest.raises(ValueError, match=r"r must be \[B\]"):
        nft_loss(v, v_old, x_t, x0, 0.5, torch.tensor([0.5, 0.5]), beta=1.0)


@pytest.mark.parametrize(
    "schedule, step, expected",
    [
        (1, 0, 0.0),
        (1, 100, 0.1),
        (1, 499, 0.499),
        (1, 500, 0.5),
        (1, 5000, 0.5),
        (2, 0, 0.0),
        (2, 74, 0.0),
        (2, 75, 0.0),
        (2, 76, 0.0075),
        (2, 175, 0.75),
        (2, 300, 0.999),
        (0, 0, 0.0),
        (0, 10_000, 0.0),
    ],
)
def test_old_policy_decay_schedules_by_hand(schedule, step, expected):
    assert old_policy_decay(step, schedule) == pytest.approx(expected, abs=1e-12)


def test_old_policy_update_and_errors():
    old = [torch.tensor([1.0, 2.0]), torch.tensor([0.0])]
    new = [torch.tensor([3.0, 4.0]), torch.tensor([8.0])]
    update_old_policy_(old, new, 0.25)  # 0.25 old + 0.75 new
    torch.testing.assert_close(old[0], torch.tensor([2.5, 3.5]))
    torch.testing.assert_close(old[1], torch.tensor([6.0]))
    with pytest.raises(ValueError, match="schedule"):
        old_policy_decay(3, 3)
    with pytest.raises(ValueError, match="decay"):
        update_old_policy_(old, new, 1.5)
    with pytest.raises(ValueError, match="old tensors"):
        update_old_policy_(old, new[:1], 0.5)
