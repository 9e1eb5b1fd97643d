"""The sampler's log-probs, CFG batching, SDE window and per-sample seeding, and the training
pass's gradients (issue 9) on the tiny SD3 pipeline (FLUX where cheap). fp32; the gradient
identity is also checked in float64, where it is not blurred by kernel rounding."""

from __future__ import annotations

import copy

import pytest
import torch

from flowgrpo.algo.losses import flow_grpo_loss, kl_penalty_image
from flowgrpo.algo.sde import sde_step_with_logprob
from flowgrpo.models.base import PromptEmbeds
from flowgrpo.models.flux import FluxAdapter
from flowgrpo.models.sd3 import SD3Adapter
from flowgrpo.models.tiny import tiny_pipeline
from flowgrpo.rollout import SDEWindow, sample_trajectories, trajectory_log_prob

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
    # with grad enabled (and a trainable parameter) the value is the same
    model = copy.deepcopy(sd3.transformer).requires_grad_(True)
    with torch.enable_grad():
        graded = sd3.velocity(model, x, sigma, pos, neg, **kw)
    assert graded.requires_grad
    assert (graded.detach() - separate).abs().max().item() <= 1e-6
    assert (graded.detach() - batched).abs().max().item() <= 8e-6
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


# -- issue 9: the training pass's gradients equal the batched-then-detached formulation ------------


def _batched_step(adapter, model, traj, step):
    """Reference: one forward of the doubled batch with grad, unconditional output detached."""
    x, sig = traj.latents[:, step], traj.sigmas[:, step]
    both = PromptEmbeds.cat([traj.negative_embeds, traj.prompt_embeds])
    kw = dict(height=traj.height, width=traj.width, guidance_scale=traj.guidance_scale)
    v_u, v_c = adapter.forward(model, torch.cat([x, x]), torch.cat([sig, sig]), both, **kw).chunk(2)
    v = adapter.guide(v_c, v_u.detach(), traj.guidance_scale)
    return sde_step_with_logprob(
        v,
        x,
        sig,
        traj.sigmas_next[:, step],
        noise_level=traj.noise_level,
        sde_type=traj.sde_type,
        prev_sample=traj.latents[:, step + 1],
        sigma_max=traj.sigma_max,
    )


def _grads(adapter, model, ref_fn, traj, adv, beta, batched):
    model.zero_grad(set_to_none=True)
    for step in range(traj.num_train_steps):
        if batched:
            out = _batched_step(adapter, model, traj, step)
        else:
            out = trajectory_log_prob(adapter, model, traj, step)
        loss, _ = flow_grpo_loss(
            out.log_prob, traj.log_probs[:, step], adv, clip_range=0.2, adv_clip_max=5.0
        )
        if beta:
            with torch.no_grad():
                ref = ref_fn(step, batched)
            kl = kl_penalty_image(out.prev_sample_mean, ref.prev_sample_mean, out.std_dev_t)
            loss = loss + beta * kl.mean()
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def sd3_base64(sd3):
    """A float64 copy of the tiny SD3 transformer (see the gradient test's docstring)."""
    return copy.deepcopy(sd3.transformer).double()


@pytest.mark.parametrize(
    "mode, dtype",
    [("lora", torch.float64), ("full", torch.float64), ("full", torch.float32)],
)
def test_training_grads_equal_batched_formulation(sd3, sd3_base64, mode, dtype):
    """Issue 9: grads of the Flow-GRPO loss (+ KL) through ``trajectory_log_prob`` (unconditional
    branch under no_grad) equal those of the batched-then-detached formulation.

    In fp32 the two differ only by CPU kernels' batch-size dependence (a forward of 2B rows vs
    B rows: ~4e-7 abs in v), which the log-prob gradient amplifies to ~1-3e-6 relative; so the
    1e-6 check runs in float64 (transformer in fp64; the SDE math stays fp32) and fp32 is
    checked at 1e-5. A real mistake (e.g. v_u not detached) is off by O(1).
    """
    from peft import LoraConfig, get_peft_model

    base = sd3_base64 if dtype == torch.float64 else sd3.transformer
    x0 = sd3.prepare_latents(2, H, W, torch.Generator().manual_seed(3)).to(dtype)
    traj = _sample(
        sd3, PROMPTS[:2], num_steps=3, generator=_gens([0, 1]), latents=x0, transformer=base
    )
    assert traj.latents.dtype == dtype
    gen = torch.Generator().manual_seed(0)
    if mode == "lora":
        cfg = LoraConfig(
            r=2,
            lora_alpha=4,
            init_lora_weights="gaussian",
            target_modules=list(sd3.lora_target_modules),
        )
        model = get_peft_model(copy.deepcopy(base), cfg)
        frozen = None
    else:
        frozen = base
        model = copy.deepcopy(base).requires_grad_(True)
    with torch.no_grad():  # move off the rollout policy so ratio != 1 and KL != 0
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-2)

    def ref_fn(step, batched):
        if mode == "lora":
            with model.disable_adapter():
                if batched:
                    return _batched_step(sd3, model, traj, step)
                return trajectory_log_prob(sd3, model, traj, step)
        if batched:
            return _batched_step(sd3, frozen, traj, step)
        return trajectory_log_prob(sd3, frozen, traj, step)

    adv = torch.tensor([1.0, -0.5])
    tol = 1e-6 if dtype == torch.float64 else 1e-5
    for beta in (0.0, 0.5):
        ours = _grads(sd3, model, ref_fn, traj, adv, beta, batched=False)
        theirs = _grads(sd3, model, ref_fn, traj, adv, beta, batched=True)
        assert ours.keys() == theirs.keys() and len(ours) > 0
        if mode == "lora":
            assert all("lora_" in n for n in ours)
        nonzero = sum(bool(g.abs().max() > 0) for g in theirs.values())
        assert nonzero >= 0.9 * len(theirs)
        scale = max(g.abs().max().item() for g in theirs.values())
        worst = max((ours[n] - theirs[n]).abs().max().item() for n in ours)
        assert worst <= tol * scale, (beta, worst, scale)
