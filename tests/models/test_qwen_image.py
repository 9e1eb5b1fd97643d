"""Qwen-Image adapter: equivalence with diffusers' QwenImagePipeline, masks, log-probs, grads
(what is particular to Qwen-Image: text masks and re-padding; the checks every family passes
are in tests/models/test_conformance.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flowgrpo.models.base import PromptEmbeds
from flowgrpo.models.qwen_image import QwenImageAdapter
from flowgrpo.rollout import sample_trajectories, trajectory_log_prob
from flowgrpo.testing.tiny import tiny_pipeline, tiny_size

H, W = tiny_size("qwen_image")  # 32 x 48 -> 96 image tokens
SH, SW = 16, 24  # 24 image tokens: the log-prob and gradient tests
# Prompts of very different token lengths (after the template) so that padding matters.
PROMPTS = [
    "a red cat",
    "a photo of a big old house with a tree and the sun in the sky",
    "dog",
    "a blue car",
]
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: one thread is faster
NEGATIVE = [" ", "blurry", "a bad photo of a dog with six legs", ""]


@pytest.fixture(scope="module")
def adapter() -> QwenImageAdapter:
    return QwenImageAdapter(tiny_pipeline("qwen_image", seed=0))


def _latents(adapter: QwenImageAdapter, n: int, h: int, w: int, seed: int) -> torch.Tensor:
    return adapter.prepare_latents(n, h, w, torch.Generator().manual_seed(seed))


def test_ode_rollout_with_per_prompt_negatives_matches_pipeline(adapter):
    """Negative prompts of different lengths (padding per branch) as the pipeline takes them;
    the plain cases of every family: tests/models/test_conformance.py."""
    (h, w), guidance = (H, W), 4.0
    prompts, neg = PROMPTS[:3], NEGATIVE[:3]
    latents = _latents(adapter, 3, h, w, seed=1)
    ours = sample_trajectories(
        adapter,
        prompts,
        num_steps=4,
        guidance_scale=guidance,
        noise_level=0.0,
        height=h,
        width=w,
        latents=latents,
        negative_prompts=neg,
        decode=False,
    ).final_latents
    ref = adapter.pipe(
        prompt=prompts,
        negative_prompt=neg if guidance > 1 else None,
        true_cfg_scale=guidance,
        latents=latents,
        num_inference_steps=4,
        height=h,
        width=w,
        output_type="latent",
    ).images
    assert ours.shape == ref.shape == latents.shape
    assert (ours - ref).abs().max().item() < 1e-5
    # the comparison can fail: guidance and the initial noise both move the result
    assert (ref - latents).abs().max().item() > 0.1


def test_schedule_latents_and_decode_match_pipeline(adapter):
    pipe = adapter.pipe
    sched = adapter.schedule(4, H, W)
    assert sched.sigmas.shape == (5,) and sched.timesteps.shape == (4,)
    assert sched.sigmas[0] == 1.0 and sched.sigmas[-1] == 0.0
    assert torch.allclose(sched.timesteps, sched.sigmas[:-1] * 1000)
    # shift_terminal 0.02 of the real Qwen-Image scheduler config stretches the last sigma
    assert abs(float(sched.sigmas[-2]) - 0.02) < 1e-6
    gen = torch.Generator().manual_seed(5)
    ref = pipe.prepare_latents(2, 4, H, W, torch.float32, "cpu", gen)
    assert torch.equal(_latents(adapter, 2, H, W, seed=5), ref)
    assert ref.shape == (2, (H // 4) * (W // 4), 16)
    latents = _latents(adapter, 2, H, W, seed=2)
    kw = dict(num_inference_steps=2, height=H, width=W, true_cfg_scale=1.0, latents=latents)
    final = pipe(prompt=PROMPTS[:2], output_type="latent", **kw).images
    images = pipe(prompt=PROMPTS[:2], output_type="pt", **kw).images
    ours = adapter.decode(final, H, W)
    assert ours.shape == (2, 3, H, W) and ours.dtype == torch.float32
    assert (ours - images).abs().max().item() < 1e-5
    assert 0 <= ours.min() and ours.max() <= 1 and ours.std() > 1e-3


def test_encode_default_negative_and_cfg_switch(adapter):
    pos, neg = adapter.encode(PROMPTS[:2], guidance_scale=1.0)
    assert neg is None and pos.pooled is None
    lengths = pos.mask.sum(1).tolist()
    assert pos.mask.dtype == torch.long and pos.embeds.shape[1] == max(lengths) > min(lengths)
    pos, neg = adapter.encode(PROMPTS[:2], guidance_scale=4.0)
    spaces = adapter.encode_prompts([" ", " "])
    assert torch.equal(neg.embeds, spaces.embeds) and torch.equal(neg.mask, spaces.mask)
    with pytest.raises(ValueError, match="negative prompts"):
        adapter.encode(PROMPTS[:2], [" "], guidance_scale=4.0)
    with pytest.raises(ValueError, match="multiples of 4"):
        adapter.schedule(4, 30, 48)


def test_text_mask_is_honoured(adapter):
    """Padding (even garbage) never changes the velocity, so batched CFG stays exact."""
    embeds = adapter.encode_prompts(PROMPTS)
    latents = _latents(adapter, 4, H, W, seed=3)
    sigma = torch.full((4,), 0.7)
    kw = dict(height=H, width=W, guidance_scale=1.0)
    tr = adapter.transformer
    with torch.no_grad():
        v = adapter.forward(tr, latents, sigma, embeds, **kw)
        keep = embeds.mask[..., None].bool()
        garbage = torch.where(keep, embeds.embeds, 10 * torch.randn_like(embeds.embeds))
        v_garbage = adapter.forward(tr, latents, sigma, PromptEmbeds(garbage, embeds.mask), **kw)
        assert torch.equal(v_garbage, v)
        for i in range(4):
            alone = embeds.select([i])  # trimmed to its own length: no padding, mask None
            v_i = adapter.forward(tr, latents[i : i + 1], sigma[i : i + 1], alone, **kw)
            assert (v_i - v[i : i + 1]).abs().max().item() < 1e-6
        # without the mask the padding would leak in: the test can fail
        unmasked = tr(
            hidden_states=latents, timestep=sigma, encoder_hidden_states=embeds.embeds,
            img_shapes=[[(1, H // 4, W // 4)]] * 4, return_dict=False,
        )[0]  # fmt: skip
        assert (unmasked - v).abs().max().item() > 1e-3
        # batched true CFG (one doubled, padded forward) == two separate forwards
        neg = adapter.encode_prompts(NEGATIVE)
        batched = adapter.velocity(
            tr, latents, sigma, embeds, neg, guidance_scale=4.0, height=H, width=W
        )
        v_neg = adapter.forward(tr, latents, sigma, neg, **kw)
        separate = adapter.guide(v, v_neg, 4.0)
    assert (batched - separate).abs().max().item() < 1e-5


def test_true_cfg_formula(adapter):
    g = torch.Generator().manual_seed(0)
    v_pos, v_neg = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    out = adapter.guide(v_pos, v_neg, 4.0)
    comb = v_neg + 4.0 * (v_pos - v_neg)
    assert torch.allclose(out.norm(dim=-1), v_pos.norm(dim=-1), atol=1e-5)
    assert torch.allclose(
        out / out.norm(dim=-1, keepdim=True), comb / comb.norm(dim=-1, keepdim=True), atol=1e-6
    )


@pytest.mark.parametrize(("sde_type", "noise_level"), [("sde", 1.2), ("cps", 0.8)])
def test_log_prob_recomputation_is_batch_invariant(adapter, sde_type, noise_level):
    gens = [torch.Generator().manual_seed(100 + i) for i in range(4)]
    traj = sample_trajectories(
        adapter,
        PROMPTS,
        num_steps=4,
        guidance_scale=4.0,
        noise_level=noise_level,
        sde_type=sde_type,
        height=SH,
        width=SW,
        generator=gens,
        negative_prompts=NEGATIVE,
        decode=False,
    )
    assert traj.log_probs.shape == (4, 3) and bool(torch.isfinite(traj.log_probs).all())
    tr = adapter.transformer
    worst = 0.0
    for step in range(traj.num_train_steps):
        rollout = traj.log_probs[:, step]
        for grad in (True, False):  # training path (split CFG) and no-grad path (batched CFG)
            with torch.set_grad_enabled(grad):
                full = trajectory_log_prob(adapter, tr, traj, step).log_prob
                parts = torch.empty(4)
                for idx in ([0, 2, 3], [1]):  # [0, 2, 3] re-padded to its own longest prompt
                    parts[idx] = trajectory_log_prob(adapter, tr, traj, step, index=idx).log_prob
            worst = max(
                worst, (full - rollout).abs().max().item(), (parts - rollout).abs().max().item()
            )
    assert worst < 1e-6
    lengths = traj.prompt_embeds.mask.sum(1)
    repadded = traj.select([0, 2, 3]).prompt_embeds.embeds.shape[1]
    assert repadded == int(lengths[[0, 2, 3]].max()) < int(lengths.max())
    # the check can fail: letting the padding in (mask all ones) moves the log-probs
    leaky = PromptEmbeds(traj.prompt_embeds.embeds, torch.ones_like(traj.prompt_embeds.mask))
    with torch.no_grad():
        moved = trajectory_log_prob(adapter, tr, dataclasses.replace(traj, prompt_embeds=leaky), 1)
    assert (moved.log_prob - traj.log_probs[:, 1]).abs().max().item() > 1e-5
