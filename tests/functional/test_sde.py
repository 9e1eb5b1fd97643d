"""sde_step_with_logprob: Euler equivalence with diffusers, exact log-densities, true marginals."""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from flowgrpo.functional.sde import sde_step_with_logprob


def _shifted_schedule(steps: int = 10, shift: float = 3.0) -> FlowMatchEulerDiscreteScheduler:
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    return scheduler


@pytest.mark.parametrize("mode", [("sde", 0.0), ("ode", 0.7), ("cps", 0.0)])
def test_zero_noise_and_ode_equal_diffusers_euler(mode):
    sde_type, noise_level = mode
    scheduler = _shifted_schedule()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 8, 8, generator=g)
    for i, t in enumerate(scheduler.timesteps):
        v = torch.randn(x.shape, generator=g)
        expected = scheduler.step(v, t, x, return_dict=False)[0]
        ours = sde_step_with_logprob(
            v,
            x,
            scheduler.sigmas[i],
            scheduler.sigmas[i + 1],
            noise_level=noise_level,
            sde_type=sde_type,
        )
        if sde_type == "cps":  # cps with a = 0 is also exactly the Euler step
            torch.testing.assert_close(ours.prev_sample, expected, atol=1e-6, rtol=0)
        else:
            torch.testing.assert_close(ours.prev_sample, expected, atol=1e-6, rtol=0)
            assert torch.equal(ours.log_prob, torch.zeros(3))
        x = expected


def test_sde_log_prob_is_mean_of_normal_log_density_and_replays_exactly():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 6, 6, generator=g)
    v = torch.randn(x.shape, generator=g)
    sigma, sigma_next, a = 0.8, 0.6, 0.7
    out = sde_step_with_logprob(
        v, x, sigma, sigma_next, noise_level=a, generator=torch.Generator().manual_seed(2)
    )
    dt = sigma_next - sigma
    std_t = a * math.sqrt(sigma / (1 - sigma))
    assert torch.allclose(out.std_dev_t, torch.full((4,), std_t))
    mean = (
        x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    torch.testing.assert_close(out.prev_sample_mean, mean, atol=1e-6, rtol=1e-6)
    normal = torch.distributions.Normal(mean, std_t * math.sqrt(-dt))
    expected = normal.log_prob(out.prev_sample).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob, expected, atol=1e-5, rtol=1e-6)
    # Given prev_sample nothing random happens: the same value comes back, RNG untouched.
    state = torch.get_rng_state()
    again = sde_step_with_logprob(
        v, x, sigma, sigma_next, noise_level=a, prev_sample=out.prev_sample
    )
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(again.log_prob, out.log_prob)
    assert torch.equal(again.prev_sample, out.prev_sample)


def test_per_sample_sigmas_match_one_sample_at_a_time():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 4, generator=g)
    v = torch.randn(x.shape, generator=g)
    prev = torch.randn(x.shape, generator=g)
    sigma = torch.tensor([0.9, 0.5, 0.3])
    sigma_next = torch.tensor([0.7, 0.4, 0.0])
    for sde_type in ("sde", "cps"):
        batched = sde_step_with_logprob(
            v, x, sigma, sigma_next, noise_level=0.7, sde_type=sde_type, prev_sample=prev
        )
        for b in range(3):
            one = sde_step_with_logprob(
                v[b : b + 1],
                x[b : b + 1],
                float(sigma[b]),
                float(sigma_next[b]),
                noise_level=0.7,
                sde_type=sde_type,
                prev_sample=prev[b : b + 1],
            )
            torch.testing.assert_close(batched.log_prob[b : b + 1], one.log_prob)
            torch.testing.assert_close(batched.prev_sample_mean[b : b + 1], one.prev_sample_mean)


def test_per_sample_generators_make_noise_batch_independent():
    x = torch.zeros(3, 2, 4)
    v = torch.ones_like(x)
    gens = [torch.Generator().manual_seed(s) for s in (10, 11, 12)]
    batched = sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=0.7, generator=gens)
    alone = sde_step_with_logprob(
        v[1:2], x[1:2], 0.5, 0.4, noise_level=0.7, generator=[torch.Generator().manual_seed(11)]
    )
    assert torch.equal(batched.prev_sample[1:2], alone.prev_sample)


def test_sigma_max_replaces_sigma_one_in_noise_scale():
    x, v = torch.zeros(2, 3), torch.zeros(2, 3)
    out = sde_step_with_logprob(v, x, 1.0, 0.9, noise_level=0.5, sigma_max=0.9)
    assert torch.allclose(out.std_dev_t, torch.full((2,), 0.5 * math.sqrt(1.0 / (1 - 0.9))))
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step_with_logprob(v, x, 1.0, 0.9, noise_level=0.5)
    # a one-step schedule has no second sigma: sigma_max is 1 too (was NaN log-probs)
    with pytest.raises(ValueError, match="one-step schedule"):
        sde_step_with_logprob(v, x, 1.0, 0.0, noise_level=0.5, sigma_max=1.0)


def test_fp64_inputs_are_computed_in_fp64():
    """fp64 stays fp64 (tests compare formulations without fp32 rounding); bf16 -> fp32."""
    g = torch.Generator().manual_seed(5)
    x, v = torch.randn(2, 8, generator=g).double(), torch.randn(2, 8, generator=g).double()
    out = sde_step_with_logprob(v, x, 0.7, 0.5, noise_level=0.7, generator=g)
    assert out.prev_sample.dtype == out.log_prob.dtype == out.prev_sample_mean.dtype
    assert out.log_prob.dtype == torch.float64
    replay = sde_step_with_logprob(v, x, 0.7, 0.5, noise_level=0.7, prev_sample=out.prev_sample)
    assert torch.equal(replay.log_prob, out.log_prob)


def test_fp32_inside_and_output_in_input_dtype():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 4, 4, generator=g)
    v = torch.randn(x.shape, generator=g)
    prev = torch.randn(x.shape, generator=g).bfloat16()
    out16 = sde_step_with_logprob(
        v.bfloat16(), x.bfloat16(), 0.7, 0.5, noise_level=0.7, prev_sample=prev
    )
    out32 = sde_step_with_logprob(
        v.bfloat16().float(),
        x.bfloat16().float(),
        0.7,
        0.5,
        noise_level=0.7,
        prev_sample=prev.float(),
    )
    assert out16.prev_sample.dtype == torch.bfloat16
    assert out16.log_prob.dtype == torch.float32
    torch.testing.assert_close(out16.log_prob, out32.log_prob)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sde_type="ddim"), "unknown sde_type"),
        (dict(noise_level=-0.1), "noise_level"),
        (dict(sigma=0.3, sigma_next=0.5), "sigma_next"),
        (dict(model_output=torch.zeros(2, 5)), "shape"),
    ],
)
def test_bad_input_raises_clear_value_error(kwargs, match):
    args = dict(
        model_output=torch.zeros(2, 4),
        sample=torch.zeros(2, 4),
        sigma=0.5,
        sigma_next=0.4,
        noise_level=0.7,
    )
    args.update(kwargs)
    model_output, sample = args.pop("model_output"), args.pop("sample")
    sigma, sigma_next = args.pop("sigma"), args.pop("sigma_next")
    with pytest.raises(ValueError, match=match):
        sde_step_with_logprob(model_output, sample, sigma, sigma_next, **args)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_oracle_velocity_preserves_true_marginals(sde_type):
    """With v = (x - x0)/sigma for one data point x0, x_sigma ~ N((1 - sigma) x0, sigma^2).

    A wrong sign in the score correction inflates or collapses the spread, which this catches.
    """
    torch.manual_seed(0)
    steps, n, x0 = 50, 20000, 0.8
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    x = torch.randn(n, 1)
    g = torch.Generator().manual_seed(5)
    checks = {}
    for i in range(steps):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        v = (x - x0) / s
        x = sde_step_with_logprob(
            v,
            x,
            s,
            s_next,
            noise_level=0.7,
            sde_type=sde_type,
            generator=g,
            sigma_max=float(sigmas[1]),
        ).prev_sample
        for target in (0.5, 0.2):
            if abs(s_next - target) < 1e-6:
                checks[target] = (float(x.mean()), float(x.std()))
    assert set(checks) == {0.5, 0.2}
    for sigma, (mean, std) in checks.items():
        assert mean == pytest.approx((1 - sigma) * x0, abs=0.03), (sigma, mean)
        # discretisation error of 50 steps is ~4%; a wrong-sign correction gives 2.5x
        assert std == pytest.approx(sigma, rel=0.06), (sigma, std)
