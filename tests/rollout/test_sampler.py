"""The sampler's log-probs, CFG batching, SDE window and per-sample seeding on the tiny SD3
pipeline (FLUX where cheap), fp32. The training pass's gradients: test_cfg_gradients.py."""

from __future__ import annotations

import copy

import pytest
import torch

from flowgrpo.models.base import PromptEmbeds
from flowgrpo.models.flux import FluxAdapter
from flowgrpo.models.sd3 import SD3Adapter
from flowgrpo.rollout import SDEWindow, sample_trajectories, trajectory_log_prob
from flowgrpo.testing.tiny import tiny_pipeline

PROMPTS = ["a red cat", "a sign saying hello", "two blue birds"]
H, W = 16, 24  # 4 x 6 image tokens: a non-square size below tiny_size("sd3"), for speed
SEQ = 8  # T5 tokens: short prompts, fast tests
STEPS = 4


@pytest.fixture(scope="module")
def sd3():
    return SD3Adapter(tiny_pipeline("sd3"), max_sequence_length=SEQ)


@pytest.fixture(scope="module")
def flux():
    return FluxAdapter(tiny_pipeline("flux"), max_sequence_length=SEQ)


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def _sample(adapter, prompts=PROMPTS, **kw):
    opts = dict(
        num_steps=STEPS,
        guidance_scale=4.5,
        noise_level=0.7,
        height=H,
        width=W,
        decode=False,
        generator=_gens(range(len(prompts))),
    )
    opts.update(kw)
    return sample_trajectories(adapter, prompts, **opts)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_recomputed_log_probs_match_rollout_any_split(sd3, sde_type):
    traj = _sample(sd3, sde_type=sde_type, num_steps=3)
    k = traj.num_train_steps
    assert k == 2  # the last step is deterministic and not trained
    assert traj.log_probs.shape == (3, k) and traj.latents.shape[:2] == (3, k + 1)
    assert bool((traj.log_probs != 0).all())
    worst = 0.0
    with torch.enable_grad():  # the training path: uncond under no_grad, cond with grad
        for step in range(k):
            for split in ([2, 0], [1]):  # micro-batches unlike the rollout's batch of 3
                index = torch.tensor(split)
                out = trajectory_log_prob(sd3, sd3.transformer, traj, step, index)
                worst = max(worst, (out.log_prob - traj.log_probs[index, step]).abs().max().item())
    assert worst < 1e-6


def test_flux_recomputed_log_probs_match_rollout(flux):
    prompts = PROMPTS[:2]
    traj = _sample(flux, prompts, guidance_scale=3.5)
    with torch.enable_grad():
        for step in range(traj.num_train_steps):
            out = trajectory_log_prob(flux, flux.transformer, traj, step, slice(1, 2))
            assert (out.log_prob - traj.log_probs[1:2, step]).abs().max().item() < 1e-6


def test_batched_cfg_equals_separate_forwards_and_grad_path(sd3):
    pos, neg = sd3.encode(PROMPTS, guidance_scale=4.5)
    x = sd3.prepare_latents(3, H, W, torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.6, 0.3])
    kw = dict(height=H, width=W, guidance_scale=4.5)
    both = PromptEmbeds.cat([neg, pos])
    with torch.no_grad():
        batched = sd3.velocity(sd3.transformer, x, sigma, pos, neg, **kw)
        v_c = sd3.forward(sd3.transformer, x, sigma, pos, **kw)
        v_u = sd3.forward(sd3.transformer, x, sigma, neg, **kw)
        doubled = sd3.forward(sd3.transformer, torch.cat([x, x]), sigma.repeat(2), both, **kw)
    # each branch of the doubled batch equals its separate forward to 1e-6 (measured 5e-7) ...
    b_u, b_c = doubled.chunk(2)
    assert (b_u - v_u).abs().max().item() <= 1e-6
    assert (b_c - v_c).abs().max().item() <= 1e-6
    # ... so the guided velocity 4.5 v_c - 3.5 v_u agrees to (4.5 + 3.5) * 1e-6
    separate = v_u + 4.5 * (v_c - v_u)
    assert torch.equal(batched, sd3.guide(b_c, b_u, 4.5))
    assert (batched - separate).abs().max().item() <= 8e-6
    # with grad enabled (and a trainable parameter) the training pass runs the same doubled
    # batch: bit-identical to the rollout's value, so the recomputed log-prob is exact
    model = copy.deepcopy(sd3.transformer).requires_grad_(True)
    with torch.enable_grad():
        graded = sd3.velocity(model, x, sigma, pos, neg, **kw)
        cond_only = sd3.velocity(model, x, sigma, pos, neg, **kw, cfg_grad="cond_only")
    assert graded.requires_grad
    assert torch.equal(graded.detach(), batched)
    # the opt-in cond-only form runs two calls: equal to the separate forwards
    assert torch.equal(cond_only.detach(), separate)
    with pytest.raises(ValueError, match="cfg_grad"):
        sd3.velocity(model, x, sigma, pos, neg, **kw, cfg_grad="uncond")
    # guidance off: a single forward, no negative embeddings needed
    with torch.no_grad():
        plain = sd3.velocity(sd3.transformer, x, sigma, pos, None, **{**kw, "guidance_scale": 1})
    assert torch.equal(plain, v_c)


def test_sde_window_is_deterministic_outside(sd3):
    window = SDEWindow(size=2, lo=1, hi=3)  # start fixed at 1: SDE on steps 1 and 2
    x0 = sd3.prepare_latents(2, H, W, torch.Generator().manual_seed(9))
    prompts = PROMPTS[:2]
    kw = dict(sde_window=window, latents=x0, noise_level=0.8)
    a = _sample(sd3, prompts, generator=_gens([1, 2]), **kw)
    b = _sample(sd3, prompts, generator=_gens([3, 4]), **kw)
    ode = _sample(sd3, prompts, noise_level=0.0, latents=x0)  # records x_0 .. x_{N-1}
    assert a.log_probs.shape == (2, window.size)
    assert a.step_indices.tolist() == [[1, 2], [1, 2]]
    # before the window: Euler steps only, so identical whatever the noise seed
    assert torch.equal(a.latents[:, 0], b.latents[:, 0])
    assert (a.latents[:, 0] - ode.latents[:, 1]).abs().max().item() <= 1e-6
    assert (a.latents[:, -1] - b.latents[:, -1]).abs().max().item() > 1e-3  # noise was used
    # after the window: plain Euler steps to the end
    sched = sd3.schedule(STEPS, H, W)
    x = a.latents[:, -1]
    pos, neg = a.prompt_embeds, a.negative_embeds
    with torch.no_grad():
        for i in range(3, STEPS):
            sig = sched.sigmas[i].expand(2)
            v = sd3.velocity(
                sd3.transformer, x, sig, pos, neg, height=H, width=W, guidance_scale=4.5
            )
            x = x + v * (sched.sigmas[i + 1] - sched.sigmas[i])
    assert (x - a.final_latents).abs().max().item() <= 1e-6
    # the window's log-probs are recomputed exactly
    for step in range(window.size):
        out = trajectory_log_prob(sd3, sd3.transformer, a, step)
        assert (out.log_prob - a.log_probs[:, step]).abs().max().item() < 1e-6


def test_sde_window_random_start_and_bad_windows(sd3):
    traj = _sample(sd3, sde_window=SDEWindow(size=2, lo=0), generator=_gens([5, 6, 7]))
    assert traj.log_probs.shape == (3, 2)
    start = traj.step_indices[:, 0]
    assert bool(((start >= 0) & (start <= STEPS - 1 - 2)).all())
    assert torch.equal(traj.step_indices[:, 1], start + 1)
    for bad in (SDEWindow(size=3, lo=2, hi=4), SDEWindow(size=2, lo=0, hi=STEPS + 1)):
        with pytest.raises(ValueError, match="sde_window"):
            _sample(sd3, sde_window=bad)
    with pytest.raises(ValueError, match="sde_window"):
        _sample(sd3, sde_window=SDEWindow(size=0))


def test_per_sample_generators_make_samples_batch_independent(sd3):
    """A sample's noise (initial latents, window start, SDE noise) depends only on its own
    generator. Its final latents then match to float noise: CPU kernels give ~4e-7 different
    velocities for a batch of 3 and a batch of 1 (measured), amplified by CFG over the steps."""
    window = SDEWindow(size=2, lo=0)
    batch = _sample(sd3, generator=_gens([11, 12, 13]), sde_window=window)
    alone = _sample(sd3, [PROMPTS[1]], generator=_gens([12]), sde_window=window)
    x_batch = sd3.prepare_latents(3, H, W, _gens([11, 12, 13]))
    assert torch.equal(x_batch[1:2], sd3.prepare_latents(1, H, W, _gens([12])))
    assert torch.equal(batch.step_indices[1], alone.step_indices[0])
    assert (batch.final_latents[1] - alone.final_latents[0]).abs().max().item() <= 1e-5
    assert (batch.log_probs[1] - alone.log_probs[0]).abs().max().item() <= 1e-5
    other = _sample(sd3, [PROMPTS[1]], generator=_gens([99]), sde_window=window)
    assert (other.final_latents - alone.final_latents).abs().max().item() > 1e-2


def test_dpm2_ode_rollout_equals_the_solver_step_by_step(sd3):
    """The DPM-Solver++ 2M path of an ODE rollout (DiffusionNFT's rollouts): every step is
    ``dpm_solver_2m_step`` fed the previous step's x0 = x - sigma v (first order at the first
    step and into sigma = 0), computed here by hand from the initial latents; it differs from
    the Euler rollout of the same noise."""
    from flowgrpo.functional.dpm_solver import dpm_solver_2m_step

    steps, prompts = 6, PROMPTS[:2]
    x0 = sd3.prepare_latents(2, H, W, torch.Generator().manual_seed(5))
    dpm = _sample(sd3, prompts, num_steps=steps, noise_level=0.0, ode_solver="dpm2", latents=x0)
    euler = _sample(sd3, prompts, num_steps=steps, noise_level=0.0, latents=x0)
    sig = [float(s) for s in sd3.schedule(steps, H, W).sigmas]
    x, hist = x0, None
    with torch.no_grad():
        for i in range(steps):
            v = sd3.velocity(sd3.transformer, x, torch.full((2,), sig[i]), dpm.prompt_embeds,
                             dpm.negative_embeds, height=H, width=W, guidance_scale=4.5)  # fmt: skip
            kw = {} if hist is None else {"prev_x0": hist, "sigma_prev": sig[i - 1]}
            x, hist = dpm_solver_2m_step(v, x, sig[i], sig[i + 1], **kw)
    assert (dpm.final_latents - x).abs().max().item() <= 1e-6
    assert (dpm.final_latents - euler.final_latents).abs().max().item() > 1e-3


def test_init_generator_draws_the_initial_noise_and_generator_the_rest(sd3):
    """``init_generator`` (sample.same_latent's per-group generators) draws the starting latents;
    the per-sample ``generator`` still draws each sample's SDE noise."""
    prompts = PROMPTS[:2]
    same = _sample(sd3, prompts, init_generator=_gens([7, 7]), generator=_gens([1, 2]))
    assert torch.equal(same.latents[0, 0], same.latents[1, 0])
    ref = sd3.prepare_latents(1, H, W, torch.Generator().manual_seed(7))
    assert torch.equal(same.latents[0, 0], ref[0].to(same.latents.dtype))
    assert (same.final_latents[0] - same.final_latents[1]).abs().max().item() > 1e-3
