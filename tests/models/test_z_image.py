"""What is particular to Z-Image (diffusers ``ZImagePipeline``): guidance is on for any
``guidance_scale > 0`` (Z-Image-Turbo runs with 0: no negative branch), and the pipeline's
``cfg_normalization`` / ``cfg_truncation`` options. Each is checked against the stock pipeline
at noise 0 (the conformance suite's check), with settings under which the option changes the
pipeline's output, so that ignoring it would fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flowgrpo.testing import conformance as C
from flowgrpo.testing.compare import assert_tensors_close

pytestmark = pytest.mark.usefixtures("one_thread")
FAM = C.family("z_image")
SIZE = (16, 24)


@pytest.fixture(scope="module")
def pipe():
    return FAM.pipeline()


def _stock(pipe, guidance_scale: float, steps: int = 4, **options) -> torch.Tensor:
    adapter = FAM.adapter(pipe)
    latents = adapter.prepare_latents(2, *SIZE, torch.Generator().manual_seed(1))
    return pipe(
        list(FAM.prompts[:2]),
        height=SIZE[0],
        width=SIZE[1],
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        latents=latents,
        output_type="latent",
        max_sequence_length=64,
        **options,
    ).images


def test_guidance_zero_is_the_unguided_pipeline(pipe):
    """g = 0 (Turbo): one branch, no negative prompt, equal to the pipeline's g = 0."""
    adapter = FAM.adapter(pipe)
    assert not adapter.uses_cfg(0.0) and adapter.uses_cfg(0.5)
    C.check_noise0_matches_pipeline(FAM, pipe, SIZE, 0.0)
    assert float((_stock(pipe, 0.0) - _stock(pipe, 0.5)).abs().max()) > 1e-3


@pytest.mark.parametrize(
    "option",
    [{"cfg_normalization": 1.0}, {"cfg_truncation": 0.2}, {"cfg_normalization": 1.2}],
    ids=["normalization-1", "truncation-0.2", "normalization-1.2"],
)
def test_cfg_options_equal_the_pipeline(pipe, option):
    """The option as an adapter option equals the pipeline's call argument (4 steps, shift 3:
    (1000 - t)/1000 = 0, 0.1, 0.25, 0.5, so truncation 0.2 cuts CFG at the last two)."""
    changed = float((_stock(pipe, 4.0, **option) - _stock(pipe, 4.0)).abs().max())
    assert changed > 1e-3, f"{option} changes nothing here ({changed:.2e})"
    fam = dataclasses.replace(
        FAM,
        options={**FAM.options, **option},
        call_options={**FAM.call_options, **option},
    )
    C.check_noise0_matches_pipeline(fam, pipe, SIZE, 4.0, steps=4)


def test_transformer_time_is_reversed_and_velocity_negated(pipe):
    """forward = -transformer(x, (1000 - 1000 sigma) / 1000) (the pipeline's convention,
    written out here independently of the adapter)."""
    adapter = FAM.adapter(pipe)
    x = adapter.prepare_latents(2, *SIZE, torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.25])
    embeds = adapter.encode_prompts(list(FAM.prompts[:2]))
    with torch.no_grad():
        ours = adapter.forward(
            pipe.transformer, x, sigma, embeds, height=SIZE[0], width=SIZE[1], guidance_scale=0
        )
        caps = pipe._encode_prompt(list(FAM.prompts[:2]), device="cpu", max_sequence_length=64)
        ref = pipe.transformer(
            list(x.unsqueeze(2).unbind(0)), (1000 - sigma * 1000) / 1000, caps, return_dict=False
        )[0]
    assert_tensors_close(ours, -torch.stack(ref).squeeze(2), 1e-6, "velocity")
