"""Tiny offline pipelines: real diffusers classes, deterministic, runnable end to end."""

from functools import cache

import pytest
import torch

from flowgrpo.models.tiny import TINY_KINDS, TINY_MULTIPLE, tiny_pipeline, tiny_size

PIPELINE_CLASSES = {
    "qwen_image": "QwenImagePipeline",
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
}
PROMPTS = ["a red cube", "a cat holding a sign that says hello world"]


@cache
def shared(kind: str):
    """One default pipeline per kind for read-only tests."""
    return tiny_pipeline(kind)


def guided_call(pipe, kind: str, output_type: str = "latent", seed: int = 0, steps: int = 2):
    """Run ``pipe`` with guidance on, at the tiny test size."""
    height, width = tiny_size(kind)
    kwargs = dict(
        prompt=PROMPTS,
        num_inference_steps=steps,
        height=height,
        width=width,
        output_type=output_type,
        generator=torch.Generator().manual_seed(seed),
    )
    if kind == "qwen_image":
        kwargs.update(true_cfg_scale=4.0, negative_prompt=[" ", ""])
    elif kind == "sd3":
        kwargs.update(guidance_scale=4.5, max_sequence_length=32)
    else:
        kwargs.update(guidance_scale=3.5, max_sequence_length=32)
    return pipe(**kwargs).images


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_pipeline_runs_with_guidance_and_is_deterministic(kind):
    rng_before = torch.random.get_rng_state()
    pipe = tiny_pipeline(kind)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # global RNG untouched
    assert type(pipe).__name__ == PIPELINE_CLASSES[kind]
    assert not pipe.transformer.training and not pipe.text_encoder.training

    height, width = tiny_size(kind)
    assert height % TINY_MULTIPLE == 0 and width % TINY_MULTIPLE == 0 and height != width
    latents = guided_call(pipe, kind)
    tokens = (height // 4) * (width // 4)
    if kind == "sd3":
        assert latents.shape == (2, 4, height // 2, width // 2)
    else:  # packed 2x2 patches of 4 latent channels
        assert latents.shape == (2, tokens, 16)
    assert torch.isfinite(latents).all()

    again = guided_call(shared(kind), kind)
    assert torch.equal(latents, again)
    other = guided_call(tiny_pipeline(kind, seed=1), kind)
    assert (latents - other).abs().max() > 1e-2

    images = guided_call(pipe, kind, output_type="pt")
    assert images.shape == (2, 3, height, width)
    assert images.min() >= 0 and images.max() <= 1 and images.std() > 0


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_schedulers_carry_the_real_configs(kind):
    cfg = shared(kind).scheduler.config
    if kind == "sd3":
        assert cfg.shift == 3.0 and not cfg.use_dynamic_shifting
    elif kind == "flux":
        assert cfg.use_dynamic_shifting and (cfg.base_shift, cfg.max_shift) == (0.5, 1.15)
        assert (cfg.base_image_seq_len, cfg.max_image_seq_len) == (256, 4096)
    else:
        assert cfg.use_dynamic_shifting and (cfg.base_shift, cfg.max_shift) == (0.5, 0.9)
        assert (cfg.max_image_seq_len, cfg.shift_terminal) == (8192, 0.02)
        assert cfg.time_shift_type == "exponential"


def test_qwen_tokenizer_drops_exactly_the_template_prefix():
    pipe = shared("qwen_image")
    tok = pipe.tokenizer
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(tok(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    full = tok(pipe.prompt_template_encode.format("a red cube")).input_ids
    kept = tok.convert_ids_to_tokens(full[34:])
    assert kept[:3] == ["a", "Ġred", "Ġcube"] and kept[3] == "<|im_end|>"


def test_qwen_transformer_honours_the_text_mask():
    """Padded batch + mask == each prompt alone; padding content is ignored."""
    pipe = shared("qwen_image")
    tr = pipe.transformer
    embeds, mask = pipe.encode_prompt(PROMPTS, device="cpu")
    assert mask is not None and mask.dtype == torch.long and mask[0, -1] == 0
    x = torch.randn(2, 96, 16, generator=torch.Generator().manual_seed(0))
    t = torch.full((2,), 0.7)
    shapes = [[(1, 8, 12)]] * 2
    with torch.no_grad():
        out = tr(x, embeds, mask, t, shapes, return_dict=False)[0]
        n = int(mask[0].sum())
        alone = tr(x[:1], embeds[:1, :n], None, t[:1], shapes[:1], return_dict=False)[0]
        junk = embeds.clone()
        junk[0, n:] = 3.0
        out_junk = tr(x, junk, mask, t, shapes, return_dict=False)[0]
    assert (out[0] - alone[0]).abs().max() < 1e-5
    assert torch.equal(out_junk, out)


def test_clip_and_t5_tokenizers():
    pipe = shared("sd3")
    for tok in (pipe.tokenizer, pipe.tokenizer_2):
        assert tok.model_max_length == 77
        ids = tok("a photo of a zebra").input_ids
        assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
        assert pipe.text_encoder.config.eos_token_id == tok.eos_token_id
    ids = pipe.tokenizer_3("a photo", padding="max_length", max_length=6).input_ids
    assert ids == [ids[0], ids[1], 1, 0, 0, 0]  # ..., </s>, <pad> x3


def test_overrides_and_bad_kinds():
    pipe = tiny_pipeline("flux", num_layers=2)
    assert len(pipe.transformer.transformer_blocks) == 2
    with pytest.raises(ValueError, match="unknown tiny pipeline kind 'sdxl'"):
        tiny_pipeline("sdxl")
    with pytest.raises(ValueError, match="unknown transformer option"):
        tiny_pipeline("sd3", depth=3)
