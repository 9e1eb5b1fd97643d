"""Qwen-Image-Edit's test doubles: real ``QwenImageEditPipeline`` and
``QwenImageEditPlusPipeline`` with tiny random weights: the Qwen-Image tiny with the vision
tokens in the tokenizer, a one-block vision tower, the VL processor, and a VAE of spatial
factor 32 (5 downsamplings, no residual blocks): the pipelines resize every source image to
~1024² pixels, which this VAE encodes in ~1.5 s on one CPU thread into 32 x 32 latents (256
source tokens). Sizes: multiples of 64. Source images are conditioning (``sources``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from flowgrpo.testing.families import qwen_image
from flowgrpo.testing.families._parts import (
    qwen25_vl_text_config,
    qwen25_vl_vision_config,
    qwen_tokenizer,
    random_image,
)
from flowgrpo.testing.family import Family, SequenceParallelCase

TRANSFORMER: dict[str, Any] = dict(qwen_image.TRANSFORMER)
#: the VAE of factor 32 (5 downsamplings, no residual blocks)
VAE: dict[str, Any] = dict(
    base_dim=4,
    z_dim=4,
    dim_mult=[1, 1, 1, 1, 1, 1],
    num_res_blocks=0,
    temperal_downsample=[False] * 5,
    latents_mean=[-0.2, 0.1, 0.0, 0.3],
    latents_std=[1.5, 2.0, 2.5, 3.0],
)


def _qwen_vl_processor(tok: Any) -> Any:
    """Qwen2.5-VL's processor built in code: the PIL image processor (patch 14, merge 2, at
    most 4 x 56² pixels: a few vision tokens per image) and ``tok``; no video processor
    (``qwen_image_edit.vl_processor``)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from flowgrpo.models.qwen_image_edit import vl_processor

    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 56 * 56, "longest_edge": 4 * 56 * 56},
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )
    return vl_processor(image_processor, tok)


def build(tcfg: dict[str, Any], seeds, plus: bool = False) -> Any:
    """Qwen-Image-Edit(-Plus): the Qwen-Image tiny with the vision tokens in the tokenizer, a
    one-block vision tower, the VL processor, and a VAE of spatial factor 32 (5 downsamplings,
    no residual blocks): the pipelines resize every source image to ~1024² pixels, which this
    VAE encodes in ~1.5 s on one CPU thread into 32 x 32 latents (256 source tokens). Sizes:
    multiples of 64."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageEditPlusPipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = qwen_tokenizer()
    vision = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok.add_tokens(vision, special_tokens=True)
    ids = {t: tok.convert_tokens_to_ids(t) for t in vision}
    hidden = tcfg["joint_attention_dim"]
    torch.manual_seed(next(seeds))
    text_cfg = Qwen2_5_VLConfig(
        text_config=qwen25_vl_text_config(tok, hidden, vocab_size=len(tok)),
        vision_config=qwen25_vl_vision_config(
            hidden, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(text_cfg)
    torch.manual_seed(next(seeds))
    vae = AutoencoderKLQwenImage(**VAE)
    torch.manual_seed(next(seeds))
    transformer = QwenImageTransformer2DModel(**tcfg)
    scheduler = FlowMatchEulerDiscreteScheduler(**qwen_image.SCHEDULER)
    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    return cls(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        processor=_qwen_vl_processor(tok),
        transformer=transformer,
    )


def build_plus(tcfg: dict[str, Any], seeds) -> Any:
    return build(tcfg, seeds, plus=True)


def _one_source() -> list[list[Any]]:
    """Qwen-Image-Edit: one square source per prompt (resized to 1024² by the pipeline)."""
    return [[random_image(i, 40, 40)] for i in range(4)]


def _two_sources() -> list[list[Any]]:
    """Qwen-Image-Edit-Plus: two sources per prompt, square and 2:1 (1024² and 1440 x 736)."""
    return [[random_image(i, 40, 40), random_image(10 + i, 40, 80)] for i in range(4)]


_EDIT = Family(
    "qwen_image_edit",
    ((128, 192), (192, 128)),
    size=(64, 128),
    negative=" ",
    guidance_arg="true_cfg_scale",
    bf16_split_atol=1e-3,  # the re-padded text holds the image's tokens: measured 5.8e-4
    train_size=(64, 64),
    sources=_one_source,
    stock_batch=False,
    pipeline_class="QwenImageEditPipeline",
    build=build,
    transformer=TRANSFORMER,
    vae=VAE,
    # ~1024² sources, encoded in bf16 by the on-policy check (~9x slower than fp32 on a CPU
    # without AVX-512): 13% of make test-fast; FLUX.1 Kontext covers editing there
    tier="slow",
    # scaled down from the pipelines' ~1024² sources to keep SP fast: a 1:3 source becomes
    # 64 x 192 pixels, 2 x 6 latents of the tiny VAE (factor 32), 1 x 3 tokens (2x2 packing);
    # 1 x 3 noised + 3 source tokens: the 3 noised alone do not split over sp = 2, so SP runs
    # only if the source tokens are counted and split with them
    sp=SequenceParallelCase(edit=(64, 192, ((20, 60),), 64 * 192, 3)),
)
DOUBLES = (
    _EDIT,
    replace(  # two sources per prompt
        _EDIT,
        kind="qwen_image_edit_plus",
        sources=_two_sources,
        pipeline_class="QwenImageEditPlusPipeline",
        build=build_plus,
        # 2 x 3 noised + 3 + 3 source tokens (two sources, 3:1 and 1:3)
        sp=SequenceParallelCase(edit=(128, 192, ((20, 60), (60, 20)), 64 * 192, 6)),
    ),
)
