"""Qwen-Image 2.1 particulars, against the stock ``QwenImage21Pipeline``: text padding moves
the target image (its rotary frame position is the padded text length), so the stock batch of
unequal prompts differs from each prompt alone, and our rollout equals the latter; the
pipeline's configured ``sample_sigmas`` are the schedule; the sequence-parallel processor's
dense mask is the model's block-causal rule."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.models import build_adapter
from flowgrpo.rollout import sample_trajectories
from flowgrpo.testing.compare import assert_tensors_close
from flowgrpo.testing.tiny import tiny_pipeline

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


@pytest.mark.parametrize("pad", [0, 1, 3])
def test_sp_dense_mask_is_the_models_block_causal_rule(pad):
    """The sequence-parallel processor's dense mask (``block_causal_mask``) against diffusers'
    rule (``build_qwenimage21_block_causal_mask``'s ``mask_mod``: ``(q >= k) or same image
    block``, valid keys), on the model's own metadata and prefix segments for [text, condition
    image, text, target image] with a masked prompt token, and ``pad`` tokens of SP padding
    after the target (which the model's prefix length counts): equal for every real query;
    every padded query sees a key."""
    from diffusers.models.transformers.transformer_qwenimage21 import (
        QwenImage21Transformer2DModel,
        _qwenimage21_prefix_segments,
    )

    from flowgrpo.models.qwen_image21 import block_causal_mask

    shapes = [(1, 2, 2), (1, 2, 4)]  # a condition image, then the target
    layout = [False] * 3 + [True] * 4 + [False] * 2 + [True] * 8 + [False] * pad
    image = torch.tensor(layout)
    ids, target = QwenImage21Transformer2DModel.build_token_metadata(image, shapes)
    seq = len(layout)
    key_valid = torch.ones(2, seq, dtype=torch.bool)
    key_valid[1, 1] = False  # a padded prompt token in the second row
    key_valid[:, seq - pad :] = False
    segments = _qwenimage21_prefix_segments(ids, int((~target).sum()))
    got = block_causal_mask(segments, key_valid, seq, torch.device("cpu"))[:, 0]
    q, k = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    same_block = (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
    want = ((q >= k) | same_block)[None] & key_valid[:, None, :]
    real = seq - pad
    assert torch.equal(got[:, :real], want[:, :real])
    assert bool(got[:, real:].any(-1).all())
    if pad:  # the model's own segments end in a miscounted run (the target's first tokens)
        assert segments[-1] == (real - 8, real - 8 + pad, False)
