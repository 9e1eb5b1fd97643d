"""FLUX.1 Kontext beyond the conformance suite: its true CFG and ``flux_kontext.source_size`` against
the stock ``FluxKontextPipeline``, its one-line errors, and the planner's source tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flowgrpo.testing import conformance as C
from flowgrpo.testing.families import kinds, params

pytestmark = pytest.mark.usefixtures("one_thread")
FAM = C.family("flux_kontext")


@pytest.fixture(scope="module")
def pipe():
    return FAM.pipeline()


def test_true_cfg_equals_the_stock_pipeline(pipe):
    """true_cfg_scale 4 with the empty negative prompt: the negative branch sees the same
    source tokens, as the pipeline's."""
    fam = dataclasses.replace(
        FAM,
        options={**FAM.options, "true_cfg_scale": 4.0},
        call_options={**FAM.call_options, "true_cfg_scale": 4.0},
    )
    assert fam.adapter(pipe).uses_cfg(2.5)
    C.check_noise0_matches_pipeline(fam, pipe, fam.sizes[0], 2.5)


def test_source_size_equals_the_stock_pipeline_given_that_size(pipe):
    """source_size=128: the 80 x 144 sources resized to 128 x 128, as the stock pipeline given
    the image at that size with ``_auto_resize=False`` (4 source tokens, not 242)."""
    prompts = list(FAM.prompts[:2])
    adapter = FAM.adapter(pipe)
    sized = type(adapter)(pipe, **FAM.options, source_size=128)
    h, w = FAM.sizes[0]
    latents = sized.prepare_latents(2, h, w, torch.Generator().manual_seed(1))
    kw = dict(size=(h, w), guidance_scale=2.5, latents=latents.clone())
    ours = C._rollout(FAM, sized, prompts, **kw).final_latents
    default = C._rollout(FAM, adapter, prompts, **kw).final_latents
    images = [pipe.image_processor.resize(s[0], 128, 128) for s in FAM.sources()[:2]]
    ref = pipe(
        prompt=prompts,
        image=images,
        height=h,
        width=w,
        num_inference_steps=3,
        latents=latents.clone(),
        output_type="latent",
        guidance_scale=2.5,
        _auto_resize=False,
        **FAM.call_options,
    ).images
    C.assert_tensors_close(ours, ref, C.NOISE0_ATOL, "source_size=128")
    assert float((ours - default).abs().max()) > 1e-3  # the source's size matters
    embeds, _ = sized.encode(prompts, images=FAM.source_images(prompts))
    assert embeds.image_latents.shape[1] == 4 and embeds.image_shapes == (2, 2)


def test_bad_source_size_and_too_small_images_are_one_line_errors(pipe):
    adapter_cls = type(FAM.adapter(pipe))
    with pytest.raises(ValueError, match="source_size must be a positive multiple of 64"):
        adapter_cls(pipe, source_size=96)
    tiny = [[torch.rand(3, 40, 40)]]
    with pytest.raises(ValueError, match="40 x 40 pixels is smaller than FLUX.1 Kontext's"):
        FAM.adapter(pipe).encode(["a dog"], images=tiny)
    two = [[torch.rand(3, 64, 64), torch.rand(3, 64, 64)]]
    with pytest.raises(ValueError, match="one source image per prompt"):
        FAM.adapter(pipe).encode(["a dog"], images=two)


def test_the_planner_counts_the_source_tokens():
    """FLUX.1-Kontext-dev at 512²: 1024 noised tokens + 4096 of a ~1024² source (the
    pipeline's rule), or + 1024 with source_size 512 (the preset)."""
    from flowgrpo.models.flux_kontext import FluxKontextAdapter
    from flowgrpo.planner import read_model_configs

    configs = read_model_configs("known:flux.1-kontext-dev")
    assert FluxKontextAdapter.token_counts(configs, 512, 512, {}).image == 1024 + 4096
    sized = FluxKontextAdapter.token_counts(configs, 512, 512, {"source_size": 512})
    assert sized.image == 1024 + 1024


def test_the_preset_loads_with_flow_grpos_values(tmp_path):
    """flux-kontext-counting: flow_grpo's counting_flux_kontext (config/grpo.py:654-690)."""
    from PIL import Image

    from flowgrpo import cli
    from flowgrpo.config import load_config

    Image.new("RGB", (8, 8)).save(tmp_path / "src.png")
    edits = tmp_path / "edits.jsonl"
    edits.write_text('{"prompt": "two clocks", "image": "src.png"}\n')
    cfg = load_config(
        "flux-kontext-counting",
        [
            f"model.path={tmp_path}",
            f"data.train_prompts={edits}",
            f"reward.image_similarity.options.path={tmp_path}",
        ],
    )
    assert cli.main(["config", "show", "flux-kontext-counting"]) == 0
    assert [(r.name, r.label, r.weight) for r in cfg.reward] == [
        ("image_similarity", "image_similarity", 0.5),
        ("remote", "geneval", 0.5),
    ]
    s = cfg.sample
    assert (s.num_steps, s.eval_num_steps, s.guidance_scale, s.noise_level) == (6, 28, 2.5, 0.9)
    assert (s.prompts_per_step, s.group_size, cfg.model.height, cfg.flux_kontext.source_size) == (
        48,
        21,
        512,
        512,
    )
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.flow_grpo.kl_beta, cfg.ema.enabled) == (
        64,
        128,
        0.0,
        True,
    )


@pytest.mark.parametrize("kind", params(kinds(lambda f: f.sources)))  # editing families
def test_sources_are_encoded_once_for_both_guidance_branches(kind):
    """``encode`` with CFG on encodes the batch's sources once (``encode_sources``) and both
    branches carry exactly those latents; a text-to-image family has no sources to encode."""
    fam = C.family(kind)
    adapter = fam.adapter(fam.pipeline(), cfg=True)
    prompts = list(fam.prompts[:2])
    calls = []
    encode_sources = adapter.encode_sources

    def counted(images):
        calls.append(len(images))
        return encode_sources(images)

    adapter.encode_sources = counted
    scale = 4.5 if kind == "flux_kontext" else 4.0
    if kind == "flux_kontext":
        adapter = type(adapter)(adapter.pipe, **fam.options, true_cfg_scale=4.0)
        adapter.encode_sources = counted
    assert adapter.uses_cfg(scale)
    pos, neg = adapter.encode(prompts, guidance_scale=scale, images=fam.source_images(prompts))
    assert calls == [2]
    assert neg is not None and torch.equal(pos.image_latents, neg.image_latents)
    with pytest.raises(NotImplementedError, match="not an editing family"):
        C.family("flux").adapter(C.family("flux").pipeline()).encode_sources(None)
