"""Tiny offline pipelines (the test doubles of flowgrpo.testing.families): real diffusers
classes, one per registered pipeline class, deterministic, runnable end to end."""

from functools import cache

import pytest
import torch

from flowgrpo.models.base import check_size
from flowgrpo.models.registry import SUPPORTED_PIPELINES, families
from flowgrpo.testing.families import doubles, params
from flowgrpo.testing.tiny import kinds, size_rule, tiny_pipeline, tiny_size

PROMPTS = ["a red cube", "a cat holding a sign that says hello world"]


@cache
def shared(kind: str):
    """One default pipeline per kind for read-only tests."""
    return tiny_pipeline(kind)


def test_every_registered_pipeline_has_a_test_double_in_its_family_module():
    covered = {f.pipeline_class for f in doubles()}
    assert covered == set(SUPPORTED_PIPELINES)
    for fam in doubles():  # each family's doubles live in the module named as the family
        name = fam.build.__module__.rsplit(".", 1)[1]
        assert fam.pipeline_class in families()[name], (fam.kind, name)
    assert len(set(kinds())) == len(kinds())


def _state(pipe) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": value
        for name, module in pipe.components.items()
        if isinstance(module, torch.nn.Module)
        for key, value in module.state_dict().items()
    }


@pytest.mark.parametrize("fam", params(doubles()))
def test_tiny_pipeline_is_its_class_deterministic_and_leaves_the_rng_alone(fam):
    rng_before = torch.random.get_rng_state()
    pipe = tiny_pipeline(fam.kind)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # global RNG untouched
    assert type(pipe).__name__ == fam.pipeline_class
    modules = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    assert modules and not any(m.training for m in modules)  # eval, as from_pretrained
    again, other = _state(tiny_pipeline(fam.kind)), _state(tiny_pipeline(fam.kind, seed=1))
    state = _state(pipe)
    assert state.keys() == again.keys() == other.keys()
    assert all(torch.equal(state[k], again[k]) for k in state)
    assert any(not torch.equal(state[k], other[k]) for k in state if state[k].is_floating_point())


@pytest.mark.parametrize("kind", kinds())
def test_tiny_size_follows_the_family_size_rule(kind):
    """The size the adapter's own rule accepts (Qwen-Image 2.1: multiples of 32), non-square
    where the rule allows; the conformance sizes obey it too."""
    rule = size_rule(kind)
    h, w = tiny_size(kind)
    check_size(rule, h, w, None)
    assert h != w or rule.max_size == rule.multiple  # only the toy's one size is square
    fam = next(f for f in doubles() if f.kind == kind)
    for size in (*fam.sizes, fam.size, fam.train_size):
        check_size(rule, *size, None)


def test_tiny_size_of_the_vae_x2_x32_and_qwen_image21_families():
    assert tiny_size("sd3") == (32, 48)  # 8 x 12 = 96 tokens
    assert tiny_size("flux_kontext") == (64, 128)  # VAE x32, 2x2 packing
    assert tiny_size("qwen_image21") == (32, 64)  # multiples of 32 (32 x 48 was refused)


def _guided_call(pipe, kind: str, output_type: str = "latent", seed: int = 0, steps: int = 2):
    """Run the stock ``pipe`` with guidance on, at the tiny test size."""
    fam = next(f for f in doubles() if f.kind == kind)
    height, width = tiny_size(kind)
    kwargs = dict(
        prompt=PROMPTS,
        num_inference_steps=steps,
        height=height,
        width=width,
        output_type=output_type,
        generator=torch.Generator().manual_seed(seed),
        **fam.call_options,
    )
    kwargs[fam.guidance_arg] = 4.0
    if fam.guidance_arg == "true_cfg_scale":
        kwargs["negative_prompt"] = [" ", ""]
    return pipe(**kwargs).images


def test_tiny_qwen_image_runs_with_guidance_end_to_end():
    """Qwen-Image's double: packed 2x2 latents of the tiny size, images in [0, 1]."""
    pipe = shared("qwen_image")
    height, width = tiny_size("qwen_image")
    latents = _guided_call(pipe, "qwen_image")
    assert latents.shape == (2, (height // 4) * (width // 4), 16)
    assert torch.isfinite(latents).all()
    assert torch.equal(latents, _guided_call(tiny_pipeline("qwen_image"), "qwen_image"))
    images = _guided_call(pipe, "qwen_image", output_type="pt")
    assert images.shape == (2, 3, height, width)
    assert images.min() >= 0 and images.max() <= 1 and images.std() > 0


def test_tiny_sd3_runs_with_guidance_end_to_end():
    """SD3's double: unpacked latents of the VAE's factor 2."""
    height, width = tiny_size("sd3")
    latents = _guided_call(shared("sd3"), "sd3")
    assert latents.shape == (2, 4, height // 2, width // 2) and torch.isfinite(latents).all()


def test_schedulers_carry_the_real_configs():
    cfg = shared("sd3").scheduler.config
    assert cfg.shift == 3.0 and not cfg.use_dynamic_shifting
    cfg = shared("flux").scheduler.config
    assert cfg.use_dynamic_shifting and (cfg.base_shift, cfg.max_shift) == (0.5, 1.15)
    assert (cfg.base_image_seq_len, cfg.max_image_seq_len) == (256, 4096)
    cfg = shared("qwen_image").scheduler.config
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
    with pytest.raises(ValueError, match="tier 'medium'"):
        from flowgrpo.testing.family import Family

        Family("x", ((8, 8), (8, 8)), tier="medium")
