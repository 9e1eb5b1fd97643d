"""What is particular to the HunyuanVideo-1.5 adapter (tiny random ``HunyuanVideo15Pipeline``):
its two text encoders against the pipeline's own ``encode_prompt`` (the ByT5 glyph path of
quoted text included), decoding against ``output_type="pt"``, the guider options it refuses,
its size and frame rules. What every family passes (noise-0 rollouts equal to the pipeline,
log-probs under any split, bf16 on-policy, the LoRA export): tests/models/test_conformance.py.
"""

from __future__ import annotations

import pytest
import torch

from flowgrpo.models import build_adapter
from flowgrpo.models.hunyuan_video15 import HunyuanVideo15Adapter
from flowgrpo.testing.tiny import tiny_pipeline

PROMPTS = ['a sign that says "HELLO"', "two blue birds", 'the words "A" and “B”']
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline("hunyuan_video15")


def test_text_inputs_equal_the_pipelines_encode_prompt(pipe):
    adapter = build_adapter(pipe, num_frames=5)
    ours = adapter._text_inputs(adapter.encode_prompts(PROMPTS), torch.float32)
    with torch.no_grad():  # as in the pipeline's __call__ (T5's grad path rounds differently)
        e1, m1, e2, m2 = pipe.encode_prompt(
            PROMPTS, device="cpu", dtype=torch.float32, batch_size=len(PROMPTS)
        )
    assert torch.equal(ours["encoder_attention_mask"], m1)
    valid = m1.bool()
    assert torch.equal(ours["encoder_hidden_states"][valid], e1[valid])
    assert bool((ours["encoder_hidden_states"][~valid] == 0).all())  # padded rows: zeros
    assert torch.equal(ours["encoder_hidden_states_2"], e2)
    assert torch.equal(ours["encoder_attention_mask_2"], m2)
    glyph_tokens = m2.sum(1)
    assert bool((glyph_tokens[[0, 2]] > 0).all()) and glyph_tokens[1] == 0  # quotes -> ByT5


def test_decode_equals_the_pipelines_videos(pipe):
    adapter = build_adapter(pipe, num_frames=5)
    latents = adapter.prepare_latents(1, 32, 48, torch.Generator().manual_seed(0))
    ref = pipe(
        ["a red cat"], height=32, width=48, num_frames=5, num_inference_steps=2,
        latents=latents.clone(), output_type="latent",
    ).frames  # fmt: skip
    video = adapter.decode(ref, 32, 48)
    stock = pipe.video_processor.postprocess_video(
        pipe.vae.decode(ref / pipe.vae.config.scaling_factor, return_dict=False)[0], "pt"
    )  # [B, F, C, H, W], as the pipeline's output_type="pt"
    assert video.shape == (1, 3, 5, 32, 48)
    torch.testing.assert_close(video, stock.permute(0, 2, 1, 3, 4), atol=1e-6, rtol=0)


def test_guider_options_it_cannot_reproduce_are_refused(pipe):
    from diffusers import ClassifierFreeGuidance

    guider = pipe.guider
    try:
        for bad in ({"guidance_rescale": 0.7}, {"start": 0.2}, {"enabled": False}):
            pipe.guider = ClassifierFreeGuidance(guidance_scale=5.0, **bad)
            with pytest.raises(ValueError, match="guider"):
                HunyuanVideo15Adapter(pipe, num_frames=5)
        pipe.guider = ClassifierFreeGuidance(guidance_scale=5.0, use_original_formulation=True)
        adapter = HunyuanVideo15Adapter(pipe, num_frames=5)
        assert adapter.uses_cfg(1.0) and not adapter.uses_cfg(0.0)  # the guider's own test
        v_c, v_u = torch.tensor([2.0]), torch.tensor([1.0])
        assert float(adapter.guide(v_c, v_u, 3.0)) == 2.0 + 3.0 * (2.0 - 1.0)
    finally:
        pipe.guider = guider
    adapter = HunyuanVideo15Adapter(pipe, num_frames=5)
    assert not adapter.uses_cfg(1.0) and adapter.uses_cfg(0.5) and adapter.uses_cfg(4.5)


def test_sizes_and_frames_are_checked_not_rounded(pipe):
    adapter = build_adapter(pipe, num_frames=5)
    with pytest.raises(ValueError, match="4k \\+ 1"):
        adapter.check_num_frames(6)
    with pytest.raises(ValueError, match="multiples of 8"):
        adapter.prepare_latents(1, 20, 48)
    assert adapter.prepare_latents(2, 32, 48, num_frames=9).shape == (2, 4, 3, 4, 6)
    configs = {
        "vae": {"spatial_compression_ratio": 16, "temporal_compression_ratio": 4},
        "transformer": {"patch_size": 1, "patch_size_t": 1, "text_embed_dim": 3584},
    }
    rule = HunyuanVideo15Adapter.size_rule(lambda name: configs[name])
    assert (rule.multiple, rule.frame_step) == ((16, 16), 4)
    counts = HunyuanVideo15Adapter.token_counts(configs, 480, 480, {"num_frames": 5})
    assert (counts.image, counts.latent) == (2 * 30 * 30, 32 * 2 * 30 * 30)


def test_schedule_is_the_pipelines(pipe):
    adapter = build_adapter(pipe, num_frames=5)
    schedule = adapter.schedule(4, 32, 48)
    t = torch.linspace(1, 0, 5)[:-1].double()
    shifted = 5.0 * t / (1 + 4.0 * t)  # the tiny scheduler's shift 5 on linspace(1, 0, N + 1)
    torch.testing.assert_close(schedule.sigmas[:-1].double(), shifted, atol=1e-7, rtol=0)
    assert float(schedule.sigmas[-1]) == 0.0
    torch.testing.assert_close(schedule.timesteps, schedule.sigmas[:-1] * 1000)


def test_a_checkpoint_whose_unused_lora_weights_never_stepped_loads(dist1, tmp_path):
    """The last block's text-stream output is discarded by the model: its LoRA weights get no
    gradient and AdamW keeps no state for them; the checkpoint still loads (resume, export)."""
    from flowgrpo.engine import (
        DiffusersFSDPEngine,
        EngineConfig,
        LoraConfig,
        load_checkpoint,
        save_checkpoint,
    )

    def engine():
        adapter = build_adapter(tiny_pipeline("hunyuan_video15"), num_frames=5)
        return adapter, DiffusersFSDPEngine(adapter, EngineConfig(lora=LoraConfig(rank=2)))

    adapter, trained = engine()
    x = adapter.prepare_latents(1, 32, 48, torch.Generator().manual_seed(0))
    embeds = adapter.encode_prompts(["a red cat"])
    kw = dict(guidance_scale=1.0, height=32, width=48)
    v = adapter.velocity(trained.transformer, x, torch.tensor([0.5]), embeds, **kw)
    trained.backward(v.square().mean(), last=True)
    trained.optimizer_step()
    unused = [n for n, p in trained.model.named_parameters() if p.requires_grad and p.grad is None]
    assert any("transformer_blocks.1.attn.to_add_out" in n for n in unused), unused
    ckpt = save_checkpoint(trained, tmp_path, 1)
    _, fresh = engine()
    assert load_checkpoint(fresh, ckpt)[0] == 1
    for (n, a), b in zip(trained.model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(a.detach(), b.detach()), n
