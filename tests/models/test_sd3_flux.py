"""SD3 and FLUX adapters drive their diffusers pipelines exactly (tiny random pipelines, fp32):
what is particular to each family. The checks every family passes (noise-0 rollout equals the
pipeline at two sizes with and without guidance, log-probs, bf16, LoRA export) are in
tests/models/test_conformance.py."""

from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.models.flux import FluxAdapter
from flowgrpo.models.sd3 import SD3Adapter
from flowgrpo.rollout import sample_trajectories
from flowgrpo.testing.tiny import tiny_pipeline, tiny_size

PROMPTS = ["a red cat holding a sign", "two blue birds"]
SIZES = [tiny_size("sd3"), (24, 16)]  # two image sizes (non-square both ways)
SEQ = 16  # short T5 length keeps the tests fast; the default is checked once
STEPS = 3
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: one thread is faster


@pytest.fixture(scope="module")
def sd3_pipe():
    return tiny_pipeline("sd3")


@pytest.fixture(scope="module")
def flux_pipe():
    return tiny_pipeline("flux")


def _ours(adapter, latents, guidance_scale, height, width, negative=None):
    traj = sample_trajectories(
        adapter,
        PROMPTS,
        num_steps=STEPS,
        guidance_scale=guidance_scale,
        noise_level=0.0,
        height=height,
        width=width,
        latents=latents.clone(),
        negative_prompts=negative,
        decode=False,
    )
    return traj.final_latents


def test_sd3_default_length_negative_prompt_and_decode(sd3_pipe):
    """Default T5 length (256), an explicit negative prompt, and decoding as the pipeline."""
    height, width = SIZES[0]
    adapter = SD3Adapter(sd3_pipe)
    gen = torch.Generator().manual_seed(2)
    latents = adapter.prepare_latents(2, height, width, gen)
    negative = ["blurry", "a cat"]
    traj = sample_trajectories(
        adapter,
        PROMPTS,
        num_steps=2,
        guidance_scale=3.0,
        noise_level=0.0,
        height=height,
        width=width,
        latents=latents.clone(),
        negative_prompts=negative,
    )
    assert traj.prompt_embeds.embeds.shape[1] == 77 + 256
    ref = sd3_pipe(
        PROMPTS,
        negative_prompt=negative,
        height=height,
        width=width,
        num_inference_steps=2,
        guidance_scale=3.0,
        latents=latents.clone(),
        output_type="pt",
    ).images
    assert traj.images.shape == (2, 3, height, width)
    assert traj.images.dtype == torch.float32 and traj.images.device.type == "cpu"
    assert (traj.images - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_same_generator_same_initial_noise_as_pipeline(kind, sd3_pipe, flux_pipe):
    """The adapter draws the initial latents with the generator exactly as the pipeline does."""
    pipe = sd3_pipe if kind == "sd3" else flux_pipe
    adapter = (SD3Adapter if kind == "sd3" else FluxAdapter)(pipe, max_sequence_length=SEQ)
    height, width = SIZES[0]
    traj = sample_trajectories(
        adapter,
        PROMPTS,
        num_steps=2,
        guidance_scale=1.0,
        noise_level=0.0,
        height=height,
        width=width,
        generator=torch.Generator().manual_seed(7),
        decode=False,
    )
    ref = pipe(
        PROMPTS,
        height=height,
        width=width,
        num_inference_steps=2,
        guidance_scale=1.0,
        generator=torch.Generator().manual_seed(7),
        output_type="latent",
        max_sequence_length=SEQ,
    ).images
    assert (traj.final_latents - ref).abs().max().item() <= 1e-5


def test_sd3_schedule_shift_and_dynamic_shift(sd3_pipe):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    adapter = SD3Adapter(sd3_pipe)
    sched = adapter.schedule(4, 32, 48)

    def shift(x):
        return 3.0 * x / (1 + 2.0 * x)

    # timesteps evenly spaced from sigma_max to sigma_min (both already shifted), then shifted
    shifted = shift(torch.linspace(1.0, shift(1.0 / 1000), 4, dtype=torch.float64))
    assert sched.sigmas.shape == (5,) and sched.timesteps.shape == (4,)
    assert float(sched.sigmas[-1]) == 0.0
    assert torch.allclose(sched.sigmas[:-1].double(), shifted, atol=1e-6)
    assert torch.equal(sched.timesteps, sched.sigmas[:-1] * 1000)

    # A scheduler config asking for dynamic shifting: mu as the pipeline computes it.
    dyn = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=64,
        max_image_seq_len=1024,
    )
    pipe = StableDiffusion3Pipeline(**{**sd3_pipe.components, "scheduler": dyn})
    pipe.set_progress_bar_config(disable=True)
    dyn_adapter = SD3Adapter(pipe, max_sequence_length=SEQ)
    small, large = dyn_adapter.schedule(4, 32, 48), dyn_adapter.schedule(4, 64, 64)
    assert not torch.allclose(small.sigmas, large.sigmas)  # depends on the image size
    height, width = SIZES[1]
    latents = dyn_adapter.prepare_latents(2, height, width, torch.Generator().manual_seed(3))
    traj = sample_trajectories(
        dyn_adapter,
        PROMPTS,
        num_steps=STEPS,
        guidance_scale=2.0,
        noise_level=0.0,
        height=height,
        width=width,
        latents=latents.clone(),
        decode=False,
    )
    ref = pipe(
        PROMPTS,
        height=height,
        width=width,
        num_inference_steps=STEPS,
        guidance_scale=2.0,
        latents=latents.clone(),
        output_type="latent",
        max_sequence_length=SEQ,
    ).images
    assert (traj.final_latents - ref).abs().max().item() <= 1e-5


def test_flux_guidance_embedding_changes_output(flux_pipe):
    height, width = SIZES[0]
    adapter = FluxAdapter(flux_pipe, max_sequence_length=SEQ)
    latents = adapter.prepare_latents(2, height, width, torch.Generator().manual_seed(1))
    a = _ours(adapter, latents, 1.0, height, width)
    b = _ours(adapter, latents, 3.5, height, width)
    assert (a - b).abs().max().item() > 1e-4


def test_flux_true_cfg_matches_pipeline_and_decode(flux_pipe):
    """true_cfg_scale > 1: negative branch (default ""), pipeline formula; then decode."""
    height, width = SIZES[1]
    adapter = FluxAdapter(flux_pipe, true_cfg_scale=3.0, max_sequence_length=SEQ)
    assert adapter.uses_cfg(1.0) and adapter.uses_cfg(3.5)
    latents = adapter.prepare_latents(2, height, width, torch.Generator().manual_seed(4))
    traj = sample_trajectories(
        adapter,
        PROMPTS,
        num_steps=STEPS,
        guidance_scale=3.5,
        noise_level=0.0,
        height=height,
        width=width,
        latents=latents.clone(),
    )
    assert traj.negative_embeds is not None
    ref = flux_pipe(
        PROMPTS,
        negative_prompt=["", ""],
        true_cfg_scale=3.0,
        height=height,
        width=width,
        num_inference_steps=STEPS,
        guidance_scale=3.5,
        latents=latents.clone(),
        output_type="latent",
        max_sequence_length=SEQ,
    ).images
    assert (traj.final_latents - ref).abs().max().item() <= 1e-5
    images = flux_pipe(
        PROMPTS,
        negative_prompt=["", ""],
        true_cfg_scale=3.0,
        height=height,
        width=width,
        num_inference_steps=STEPS,
        guidance_scale=3.5,
        latents=latents.clone(),
        output_type="pt",
        max_sequence_length=SEQ,
    ).images
    assert traj.images.shape == (2, 3, height, width)
    assert (traj.images - images).abs().max().item() <= 1e-5


def test_flux_schedule_dynamic_shift(flux_pipe):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    adapter = FluxAdapter(flux_pipe)
    n = 4
    sched = adapter.schedule(n, 64, 64)  # latents 32 x 32 -> 16 x 16 = 256 packed tokens
    conf = flux_pipe.scheduler.config
    mu = calculate_shift(
        (64 // 4) * (64 // 4),
        conf.base_image_seq_len,
        conf.max_image_seq_len,
        conf.base_shift,
        conf.max_shift,
    )
    base = torch.linspace(1.0, 1.0 / n, n, dtype=torch.float64)
    expected = math.exp(mu) / (math.exp(mu) + (1 / base - 1))
    assert torch.allclose(sched.sigmas[:-1].double(), expected, atol=1e-6)
    assert float(sched.sigmas[0]) == pytest.approx(1.0)
    assert not torch.allclose(adapter.schedule(n, 32, 48).sigmas, sched.sigmas)
    # the adapter works on a copy: the pipeline's scheduler is untouched
    before = flux_pipe.scheduler.sigmas.clone()
    adapter.schedule(7, 32, 32)
    assert torch.equal(flux_pipe.scheduler.sigmas, before)


def test_build_adapter_dispatch_and_options(sd3_pipe, flux_pipe):
    from flowgrpo.models.registry import build_adapter

    assert type(build_adapter(sd3_pipe)) is SD3Adapter
    flux = build_adapter(flux_pipe, true_cfg_scale=2.0)
    assert type(flux) is FluxAdapter and flux.true_cfg_scale == 2.0
    with pytest.raises(ValueError, match="true_cfg_scale"):
        FluxAdapter(flux_pipe, true_cfg_scale=0.5)
    with pytest.raises(ValueError, match="num_steps"):
        SD3Adapter(sd3_pipe).schedule(0, 32, 32)
    # FLUX without true CFG never encodes a negative prompt, whatever the distilled scale
    pos, neg = FluxAdapter(flux_pipe, max_sequence_length=SEQ).encode(["a cat"], guidance_scale=4)
    assert neg is None and pos.pooled.shape == (1, 32) and pos.embeds.shape == (1, SEQ, 32)


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_lora_targets_wrap_attention_and_mlps(kind, sd3_pipe, flux_pipe):
    import copy

    from peft import LoraConfig, get_peft_model

    pipe = sd3_pipe if kind == "sd3" else flux_pipe
    adapter = SD3Adapter(pipe) if kind == "sd3" else FluxAdapter(pipe)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=list(adapter.lora_target_modules))
    model = get_peft_model(copy.deepcopy(pipe.transformer), config)
    prefix = "base_model.model."
    wrapped = {n.removeprefix(prefix) for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert "transformer_blocks.0.attn.to_q" in wrapped
    assert "transformer_blocks.0.attn.to_add_out" in wrapped
    if kind == "flux":  # flow_grpo's targets: attention everywhere, the double blocks' MLPs
        assert "single_transformer_blocks.0.attn.to_q" in wrapped
        assert "transformer_blocks.0.ff.net.2" in wrapped
        assert "transformer_blocks.0.ff_context.net.0.proj" in wrapped
        assert "proj_out" not in wrapped  # the final output layer stays frozen
        assert not any(n.startswith("single_transformer_blocks.0.proj") for n in wrapped)
    else:
        assert "transformer_blocks.0.attn2.to_q" in wrapped  # SD3.5 dual attention
        assert not any("ff." in n for n in wrapped)
