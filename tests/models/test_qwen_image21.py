"""Qwen-Image 2.1 particulars, against the stock ``QwenImage21Pipeline``: text padding moves
the target image (its rotary frame position is the padded text length), so the stock batch of
unequal prompts differs from each prompt alone, and our rollout equals the latter; the
pipeline's configured ``sample_sigmas`` are the schedule."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.models import build_adapter
from flowgrpo.models.tiny import tiny_pipeline
from flowgrpo.rollout import sample_trajectories
from flowgrpo.testing.compare import assert_tensors_close

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["a photo of a big old house with a tree", "dog"]  # 17 and 1 prompt tokens
SIZE = (32, 64)


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline("qwen_image21")


def _stock(pipe, prompts, latents, steps=3, **kw):
    return pipe(
        prompts,
        height=SIZE[0],
        width=SIZE[1],
        num_inference_steps=steps,
        latents=latents.clone(),
        output_type="latent",
        **kw,
    ).images


def _ours(adapter, prompts, latents, steps=3):
    return sample_trajectories(
        adapter,
        prompts,
        num_steps=steps,
        guidance_scale=1.0,
        noise_level=0.0,
        height=SIZE[0],
        width=SIZE[1],
        latents=latents.clone(),
        decode=False,
    ).final_latents


def test_rollout_equals_the_stock_pipeline_per_prompt_not_its_padded_batch(pipe):
    adapter = build_adapter(pipe)
    x = adapter.prepare_latents(2, *SIZE, torch.Generator().manual_seed(0))
    batch = _stock(pipe, PROMPTS, x)
    alone = torch.cat([_stock(pipe, [p], x[i : i + 1]) for i, p in enumerate(PROMPTS)])
    # the short prompt padded to the long one's length: another image position, another result
    assert float((batch[1] - alone[1]).abs().max()) > 1e-3
    assert_tensors_close(batch[0], alone[0], 1e-5, "the longest prompt is not padded")
    assert_tensors_close(_ours(adapter, PROMPTS, x), alone, 1e-5, "ours vs stock per prompt")


def test_sample_sigmas_are_the_schedule(pipe):
    pipe.register_to_config(sample_sigmas=[1.0, 0.8, 0.45, 0.2])
    try:
        adapter = build_adapter(pipe)
        x = adapter.prepare_latents(1, *SIZE, torch.Generator().manual_seed(1))
        ref = _stock(pipe, PROMPTS[1:], x, steps=40)  # the pipeline ignores the step count
        assert_tensors_close(_ours(adapter, PROMPTS[1:], x, steps=4), ref, 1e-5, "sigmas")
        linspace = adapter.schedule(4, *SIZE).sigmas
        pipe.register_to_config(sample_sigmas=None)
        assert not torch.equal(build_adapter(pipe).schedule(4, *SIZE).sigmas, linspace)
    finally:
        pipe.register_to_config(sample_sigmas=None)
