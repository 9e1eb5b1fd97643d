"""Qwen-Image adapter: equivalence with diffusers' QwenImagePipeline, masks, log-probs, grads."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from flowgrpo.algo.losses import flow_grpo_loss, kl_penalty_image
from flowgrpo.algo.sde import sde_step_with_logprob
from flowgrpo.models.base import PromptEmbeds
from flowgrpo.models.qwen_image import QwenImageAdapter
from flowgrpo.models.tiny import tiny_pipeline, tiny_size
from flowgrpo.rollout import sample_trajectories, trajectory_log_prob

H, W = tiny_size("qwen_image")  # 32 x 48 -> 96 image tokens
SH, SW = 16, 24  # 24 image tokens: the log-prob and gradient tests
# Prompts of very different token lengths (after the template) so that padding matters.
PROMPTS = [
    "a red cat",
    "a photo of a big old house with a tree and the sun in the sky",
    "dog",
    "a blue car",
]
NEGATIVE = [" ", "blurry", "a bad photo of a dog with six legs", ""]


@pytest.fixture(scope="module")
def adapter() -> QwenImageAdapter:
    return QwenImageAdapter(tiny_pipeline("qwen_image", seed=0))


def _latents(adapter: QwenImageAdapter, n: int, h: int, w: int, seed: int) -> torch.Tensor:
    return adapter.prepare_latents(n, h, w, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("size", [(H, W), (24, 16)])
@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_ode_rollout_matches_pipeline(adapter, size, guidance):
    h, w = size
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


def _lora(base: torch.nn.Module, targets) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        copy.deepcopy(base),
        LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=list(targets)),
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # gaussian init zeroes lora_B (then dL/dA = 0): make every grad nonzero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _batched_detached(adapter, model, traj, step):
    """Issue 9's reference formulation: one doubled forward with grad, v_neg detached."""
    lat, sig = traj.latents[:, step], traj.sigmas[:, step]
    both = PromptEmbeds.cat([traj.negative_embeds, traj.prompt_embeds])
    v = adapter.forward(
        model, torch.cat([lat, lat]), torch.cat([sig, sig]), both,
        height=traj.height, width=traj.width, guidance_scale=traj.guidance_scale,
    )  # fmt: skip
    v_neg, v_pos = v.chunk(2)
    v = adapter.guide(v_pos, v_neg.detach(), traj.guidance_scale)
    return sde_step_with_logprob(
        v, lat, sig, traj.sigmas_next[:, step], noise_level=traj.noise_level,
        sde_type=traj.sde_type, prev_sample=traj.latents[:, step + 1], sigma_max=traj.sigma_max,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_split_cfg_gradients_equal_batched_detached(adapter, mode):
    """fp64 so that only the formulation (not fp32 rounding of padded kernels) is compared."""
    base = copy.deepcopy(adapter.transformer).double()
    if mode == "lora":
        model = _lora(base, adapter.lora_target_modules)
    else:
        model = copy.deepcopy(base).requires_grad_(True)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    params = [p for p in model.parameters() if p.requires_grad]
    prompts, neg = PROMPTS[:3], NEGATIVE[:3]
    traj = sample_trajectories(
        adapter, prompts, num_steps=3, guidance_scale=4.0, noise_level=1.2, height=SH, width=SW,
        latents=_latents(adapter, 3, SH, SW, seed=4).double(), negative_prompts=neg,
        generator=[torch.Generator().manual_seed(i) for i in range(3)], transformer=model,
        decode=False,
    )  # fmt: skip
    advantages = torch.tensor([1.0, -0.5, 0.3])
    step = 1

    with torch.no_grad():  # the reference policy: LoRA disabled / the frozen base
        if mode == "lora":
            with model.disable_adapter():
                ref_mean = trajectory_log_prob(adapter, model, traj, step).prev_sample_mean
        else:
            ref_mean = trajectory_log_prob(adapter, base, traj, step).prev_sample_mean

    def grads(out, beta):
        loss, _ = flow_grpo_loss(
            out.log_prob, traj.log_probs[:, step], advantages, clip_range=1e-4, adv_clip_max=5.0
        )
        if beta:
            loss = (
                loss + beta * kl_penalty_image(out.prev_sample_mean, ref_mean, out.std_dev_t).mean()
            )
        return torch.autograd.grad(loss, params, allow_unused=True)

    refs = {}
    for beta in (0.0, 0.04):
        ours = grads(trajectory_log_prob(adapter, model, traj, step), beta)
        ref = refs[beta] = grads(_batched_detached(adapter, model, traj, step), beta)
        checked = 0
        for name, a, b in zip(
            [n for n, p in model.named_parameters() if p.requires_grad], ours, ref
        ):
            if b is None or not bool(b.any()):  # the last block's text outputs are discarded
                assert a is None or not bool(a.any()), name
                assert "transformer_blocks.1." in name, name
                continue
            rel = ((a - b).norm() / b.norm()).item()
            assert rel < 1e-6, (name, rel)
            checked += 1
        assert checked >= len(params) - 9
    kl_moves = [
        ((a - b).norm() / b.norm()).item()
        for a, b in zip(ref, refs[0.0])
        if b is not None and b.any()
    ]
    assert max(kl_moves) > 1e-5  # the KL term is really in the loss
    # the check can fail: without detaching v_neg the gradient differs
    lat, sig = traj.latents[:, step], traj.sigmas[:, step]
    both = PromptEmbeds.cat([traj.negative_embeds, traj.prompt_embeds])
    kw = dict(height=SH, width=SW, guidance_scale=4.0)
    v_neg, v_pos = adapter.forward(
        model, torch.cat([lat, lat]), torch.cat([sig, sig]), both, **kw
    ).chunk(2)
    out = sde_step_with_logprob(
        adapter.guide(v_pos, v_neg, 4.0), lat, sig, traj.sigmas_next[:, step], noise_level=1.2,
        prev_sample=traj.latents[:, step + 1], sigma_max=traj.sigma_max,
    )  # fmt: skip
    undetached = grads(out, 0.0)
    diffs = [
        ((a - b).norm() / b.norm()).item()
        for a, b in zip(undetached, refs[0.0])
        if b is not None and b.any()
    ]
    assert max(diffs) > 1e-5
