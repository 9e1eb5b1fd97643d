"""GRPO-Guard: the normalised ratio at theta = old, its closed form, its zero mean under the
policy's own noise, the dt-free gradient, hand values, and the authors' lines transcribed."""

import math

import pytest
import torch

from flowgrpo.algorithms.grpo_guard import grpo_guard_loss, normalized_log_ratio
from flowgrpo.functional.losses import flow_grpo_loss
from flowgrpo.functional.sde import sde_step_with_logprob

A_NOISE = 0.7


def _rollout(v_old, x, sigma, sigma_next, eps):
    """The rollout's "sde" step with a given standard normal eps: x' = mu_old + std*sqrt(-dt)*eps."""
    probe = sde_step_with_logprob(v_old, x, sigma, sigma_next, noise_level=A_NOISE, prev_sample=x)
    dt = torch.as_tensor(sigma_next, dtype=x.dtype) - torch.as_tensor(sigma, dtype=x.dtype)
    step_std = (probe.std_dev_t * torch.sqrt(-dt)).view(-1, *([1] * (x.ndim - 1)))
    x_next = probe.prev_sample_mean + step_std * eps
    old = sde_step_with_logprob(
        v_old, x, sigma, sigma_next, noise_level=A_NOISE, prev_sample=x_next
    )
    return x_next, old


def _pair(new, old):
    """(log_prob, old_log_prob, mean, old_mean) of the current and the rollout step."""
    return new.log_prob, old.log_prob, new.prev_sample_mean, old.prev_sample_mean


def _tensors(seed=0, batch=4, shape=(2, 4, 4), dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *shape, generator=g, dtype=dtype)
    v_old = torch.randn(batch, *shape, generator=g, dtype=dtype)
    eps = torch.randn(batch, *shape, generator=g, dtype=dtype)
    return x, v_old, eps


@pytest.mark.parametrize("bias_reduce", ["batch", "sample"])
def test_ratio_is_exactly_one_at_old_policy(bias_reduce):
    x, v_old, eps = _tensors(dtype=torch.float32)
    sigma, sigma_next = 0.8, 0.6
    x_next, old = _rollout(v_old, x, sigma, sigma_next, eps)
    new = sde_step_with_logprob(
        v_old, x, sigma, sigma_next, noise_level=A_NOISE, prev_sample=x_next
    )
    dt = sigma_next - sigma
    log_r = normalized_log_ratio(*_pair(new, old), new.std_dev_t, dt, bias_reduce=bias_reduce)
    assert torch.equal(torch.exp(log_r), torch.ones(4))
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    loss, metrics = grpo_guard_loss(
        *_pair(new, old),
        new.std_dev_t,
        dt,
        adv,
        clip_range=2e-6,
        adv_clip_max=5.0,
        bias_reduce=bias_reduce,
    )
    assert loss.item() == pytest.approx(-adv.mean().item() / abs(dt), rel=1e-6)
    assert metrics["clipfrac"].item() == 0.0


def test_closed_form_sample_bias_is_mean_eps_delta_and_batch_bias_adds_a_spread_term():
    """log r~ = mean_d(eps * delta) per sample; the authors' batch bias adds (m_bar - m_i)/(2 s)."""
    x, v_old, eps = _tensors(seed=1)
    g = torch.Generator().manual_seed(9)
    v = v_old + 0.2 * torch.randn(v_old.shape, generator=g, dtype=v_old.dtype)
    sigma, sigma_next = 0.7, 0.55
    x_next, old = _rollout(v_old, x, sigma, sigma_next, eps)
    new = sde_step_with_logprob(v, x, sigma, sigma_next, noise_level=A_NOISE, prev_sample=x_next)
    dt = sigma_next - sigma
    args = _pair(new, old)
    delta = new.prev_sample_mean - old.prev_sample_mean
    per_sample = (eps * delta).mean(dim=(1, 2, 3))
    torch.testing.assert_close(
        normalized_log_ratio(*args, new.std_dev_t, dt, bias_reduce="sample"),
        per_sample,
        rtol=0,
        atol=1e-12,
    )
    s = A_NOISE * math.sqrt(sigma / (1 - sigma)) * math.sqrt(-dt)
    m = (delta**2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(
        normalized_log_ratio(*args, new.std_dev_t, dt, bias_reduce="batch"),
        per_sample + (m.mean() - m) / (2 * s),
        rtol=0,
        atol=1e-12,
    )


def test_batch_mode_matches_the_authors_lines_transcribed():
    """``bias_reduce="batch"`` (legacy) is train_sd3_GRPO_Guard.py:909-932 (flow_grpo 2e2f712)
    verbatim in spirit: ``.mean(dim=tuple(range(1, log_prob.ndim)))`` with a 1-D log_prob is
    ``dim=()``, a mean over the whole micro-batch, so their bias is a scalar (the bug of
    flow_grpo issue #244)."""
    x, v_old, eps = _tensors(seed=2)
    g = torch.Generator().manual_seed(3)
    v = v_old + 0.1 * torch.randn(v_old.shape, generator=g, dtype=v_old.dtype)
    sigma, sigma_next = 0.6, 0.45
    x_next, old = _rollout(v_old, x, sigma, sigma_next, eps)
    new = sde_step_with_logprob(v, x, sigma, sigma_next, noise_level=A_NOISE, prev_sample=x_next)
    adv = torch.tensor([1.5, -0.5, 6.0, -2.0], dtype=torch.float64)
    clip_range, adv_clip_max = 2e-6, 5.0

    # --- the authors' code, with their shapes: std_dev_t and sqrt_dt are [B, 1, 1, 1] ---
    log_prob, prev_sample_mean = new.log_prob, new.prev_sample_mean
    std_dev_t = new.std_dev_t.view(-1, 1, 1, 1)
    sqrt_dt = torch.full_like(std_dev_t, math.sqrt(sigma - sigma_next))
    advantages = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    sigma_t = std_dev_t.mean()
    ratio_mean_bias = (
        (prev_sample_mean - old.prev_sample_mean).pow(2).mean(dim=tuple(range(1, log_prob.ndim)))
    )
    assert ratio_mean_bias.ndim == 0  # the whole-batch reduction
    ratio_mean_bias = ratio_mean_bias / (2 * (sqrt_dt.mean() * sigma_t) ** 2)
    ratio = torch.exp((log_prob - old.log_prob + ratio_mean_bias) * (sqrt_dt.mean() * sigma_t))
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    policy_loss = policy_loss / (sqrt_dt.mean() ** 2)
    # ---
    loss, metrics = grpo_guard_loss(
        *_pair(new, old),
        new.std_dev_t,
        sigma_next - sigma,
        adv,
        clip_range=clip_range,
        adv_clip_max=adv_clip_max,
        bias_reduce="batch",
    )
    torch.testing.assert_close(loss, policy_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(metrics["ratio_mean"], ratio.mean(), rtol=1e-12, atol=0)
    plain = log_prob - old.log_prob
    torch.testing.assert_close(metrics["approx_kl_k2"], 0.5 * torch.mean(plain**2))


def test_default_is_the_per_sample_bias_the_authors_intended():
    """The default reduces the bias per sample: the authors' corrected line (flow_grpo issue #244,
    ``.mean(dim=tuple(range(1, prev_sample_mean.ndim)))``), as verl-omni's ``grpo_guard`` loss
    (diffusion_algos.py:532-538). Checked against that transcription and against the
    closed form log r~ = mean_d(eps * delta) of every sample, which the batch bias breaks."""
    x, v_old, eps = _tensors(seed=5)
    g = torch.Generator().manual_seed(6)
    drift = torch.randn(v_old.shape, generator=g, dtype=v_old.dtype)
    v = v_old + 0.1 * drift * torch.tensor([0.2, 1.0, 3.0, 0.5], dtype=v_old.dtype).view(
        -1, 1, 1, 1
    )
    sigma, sigma_next = 0.6, 0.45
    x_next, old = _rollout(v_old, x, sigma, sigma_next, eps)
    new = sde_step_with_logprob(v, x, sigma, sigma_next, noise_level=A_NOISE, prev_sample=x_next)
    adv = torch.tensor([1.5, -0.5, 6.0, -2.0], dtype=torch.float64)
    clip_range = 2e-6
    # --- the authors' lines with the fix of issue #244 ---
    std_dev_t = new.std_dev_t.view(-1, 1, 1, 1)
    sqrt_dt = torch.full_like(std_dev_t, math.sqrt(sigma - sigma_next))
    scale = sqrt_dt.mean() * std_dev_t.mean()
    d2 = (new.prev_sample_mean - old.prev_sample_mean).pow(2)
    bias = d2.mean(dim=tuple(range(1, d2.ndim))) / (2 * scale**2)
    assert bias.shape == (4,)
    ratio = torch.exp((new.log_prob - old.log_prob + bias) * scale)
    a = torch.clamp(adv, -5.0, 5.0)
    expected = torch.mean(
        torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - clip_range, 1 + clip_range))
    ) / (sqrt_dt.mean() ** 2)
    # ---
    args = (*_pair(new, old), new.std_dev_t, sigma_next - sigma)
    loss, metrics = grpo_guard_loss(*args, adv, clip_range=clip_range, adv_clip_max=5.0)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(metrics["ratio_mean"], ratio.mean(), rtol=1e-12, atol=0)
    closed_form = (eps * (new.prev_sample_mean - old.prev_sample_mean)).mean(dim=(1, 2, 3))
    torch.testing.assert_close(normalized_log_ratio(*args), closed_form, rtol=0, atol=1e-12)
    batch = normalized_log_ratio(*args, bias_reduce="batch")
    assert (batch - closed_form).abs().max() > 1e-4  # the batch bias moves samples off it
    from flowgrpo.algorithms.grpo_guard import GRPOGuardConfig

    assert GRPOGuardConfig().bias_reduce == "sample"


def test_normalized_log_ratio_has_zero_mean_under_the_policys_own_noise():
    """Monte Carlo over the rollout's noise: E[log r~] = 0 while E[log r] = -mean(delta^2)/(2 s^2).

    log r~_i = mean_d(eps_i delta_i) is exactly Gaussian with variance mean_d(delta_i^2)/D, so
    the mean of n draws has standard error sqrt(mean_i mean_d(delta_i^2) / (D n)); we allow 4 of
    them (a correct implementation fails with probability 6e-5; the seed is fixed)."""
    n, d = 20000, 8
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, d, generator=g, dtype=torch.float64).expand(n, d).contiguous()
    v_old = torch.randn(1, d, generator=g, dtype=torch.float64).expand(n, d).contiguous()
    v = v_old + 0.5 * torch.randn(n, d, generator=g, dtype=torch.float64)  # drift per sample
    eps = torch.randn(n, d, generator=g, dtype=torch.float64)
    sigma, sigma_next = 0.5, 0.4
    x_next, old = _rollout(v_old, x, sigma, sigma_next, eps)
    new = sde_step_with_logprob(v, x, sigma, sigma_next, noise_level=A_NOISE, prev_sample=x_next)
    args = _pair(new, old)
    delta_sq = ((new.prev_sample_mean - old.prev_sample_mean) ** 2).mean(dim=1)
    se = math.sqrt(delta_sq.mean().item() / (d * n))
    s = A_NOISE * math.sqrt(sigma / (1 - sigma)) * math.sqrt(sigma - sigma_next)
    for bias_reduce in ("sample", "batch"):  # the batch bias shifts samples, not their mean
        log_r = normalized_log_ratio(*args, new.std_dev_t, -0.1, bias_reduce=bias_reduce)
        assert abs(log_r.mean().item()) < 4 * se, (bias_reduce, log_r.mean().item(), se)
    plain = new.log_prob - old.log_prob
    shift = -delta_sq.mean().item() / (2 * s**2)
    assert shift < -20 * se / s  # the left shift is far outside the noise
    assert plain.mean().item() == pytest.approx(shift, abs=4 * se / s)


def test_gradient_does_not_depend_on_dt_but_flow_grpos_does():
    """At theta = old: d loss / d v = (A/B)(1 + a^2/2) eps / D for every step (std_t^2 (1-sigma)
    / (2 sigma) = a^2/2 for the 'sde' std), while Flow-GRPO's is that times sqrt(-dt)/std_t."""
    x, v_old, eps = _tensors(seed=4, batch=3)
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    d = eps[0].numel()
    expected = (adv / 3).view(-1, 1, 1, 1) * (1 + A_NOISE**2 / 2) * eps / d
    for sigma, sigma_next in [(0.8, 0.7), (0.8, 0.5), (0.5, 0.45), (0.3, 0.05)]:
        x_next, old = _rollout(v_old, x, sigma, sigma_next, eps)
        grads = {}
        for name in ("guard", "flow_grpo"):
            v = v_old.clone().requires_grad_(True)
            new = sde_step_with_logprob(
                v, x, sigma, sigma_next, noise_level=A_NOISE, prev_sample=x_next
            )
            if name == "guard":
                loss, _ = grpo_guard_loss(
                    *_pair(new, old),
                    new.std_dev_t,
                    sigma_next - sigma,
                    adv,
                    clip_range=2e-6,
                    adv_clip_max=5.0,
                )
            else:
                loss, _ = flow_grpo_loss(
                    new.log_prob, old.log_prob, adv, clip_range=1e-4, adv_clip_max=5.0
                )
            loss.backward()
            grads[name] = v.grad
        torch.testing.assert_close(grads["guard"], expected, rtol=1e-10, atol=1e-15)
        std_t = A_NOISE * math.sqrt(sigma / (1 - sigma))
        torch.testing.assert_close(
            grads["flow_grpo"],
            expected * math.sqrt(sigma - sigma_next) / std_t,
            rtol=1e-6,
            atol=1e-12,  # flow_grpo_loss computes in fp32
        )


def test_hand_values_of_the_ratio_both_bias_reductions():
    # delta = [[1, 0], [0, -2]] -> mean_d delta^2 = [0.5, 2.0], batch mean 1.25
    # std_dev_t 0.5, dt -0.16 -> s = 0.5 * 0.4 = 0.2, 2 s^2 = 0.08
    log_prob, old = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])  # diff [0.5, -1]
    mean = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    old_mean = torch.tensor([[0.0, 2.0], [0.0, 2.0]])
    batch = normalized_log_ratio(log_prob, old, mean, old_mean, 0.5, -0.16, bias_reduce="batch")
    torch.testing.assert_close(batch, torch.tensor([(0.5 + 15.625) * 0.2, (-1 + 15.625) * 0.2]))
    sample = normalized_log_ratio(log_prob, old, mean, old_mean, 0.5, -0.16)  # the default
    torch.testing.assert_close(sample, torch.tensor([(0.5 + 6.25) * 0.2, (-1 + 25.0) * 0.2]))


def test_hand_values_of_the_loss_clipping_reweighting_and_kl():
    # s = 2 * sqrt(0.25) = 1 and delta = 0: log r~ = log_prob - old = [0.05, -0.2]
    log_prob, old = torch.tensor([0.05, -0.2]), torch.zeros(2)
    mean = torch.zeros(2, 2)
    adv = torch.tensor([2.0, -7.0])  # clamped to [2, -5]
    loss, m = grpo_guard_loss(
        log_prob, old, mean, mean, 2.0, -0.25, adv, clip_range=0.1, adv_clip_max=5.0
    )
    # sample 1: -2 e^0.05 (inside the clip range); sample 2: max(5 e^-0.2, 5 * 0.9) = 4.5
    expected = (-2 * math.exp(0.05) + 4.5) / 2 / 0.25
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["clipfrac"].item() == 0.5
    assert m["clipfrac_lt_one"].item() == 0.5
    assert m["clipfrac_gt_one"].item() == 0.0
    # KL against ref_mean = 1: mean_d (0 - 1)^2 / (2 * 2^2) = 1/8, added undivided by |dt|
    with_kl, m = grpo_guard_loss(
        log_prob,
        old,
        mean,
        mean,
        2.0,
        -0.25,
        adv,
        clip_range=0.1,
        adv_clip_max=5.0,
        kl_beta=0.5,
        ref_mean=torch.ones(2, 2),
    )
    assert with_kl.item() == pytest.approx(expected + 0.5 / 8, rel=1e-6)
    assert m["kl_loss"].item() == pytest.approx(1 / 8)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sde_type="cps"), "sde_type='sde'"),
        (dict(sde_type="ode"), "sde_type='sde'"),
        (dict(bias_reduce="max"), "bias_reduce"),
        (dict(dt=0.1), "dt"),
        (dict(std_dev_t=0.0), "std_dev_t"),
    ],
)
def test_unsupported_input_raises_clear_value_error(kwargs, match):
    args = dict(
        log_prob=torch.zeros(2),
        old_log_prob=torch.zeros(2),
        mean=torch.zeros(2, 3),
        old_mean=torch.zeros(2, 3),
        std_dev_t=0.5,
        dt=-0.1,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        normalized_log_ratio(**args)
    with pytest.raises(ValueError, match="ref_mean"):
        grpo_guard_loss(
            torch.zeros(2),
            torch.zeros(2),
            torch.zeros(2, 3),
            torch.zeros(2, 3),
            0.5,
            -0.1,
            torch.zeros(2),
            clip_range=1e-4,
            adv_clip_max=5.0,
            kl_beta=0.1,
        )
