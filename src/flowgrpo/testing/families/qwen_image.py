"""Qwen-Image's test double: a real ``QwenImagePipeline`` with tiny random weights.

A 2-layer Qwen2.5-VL text model whose Qwen2 BPE (trained in code) encodes the pipeline's
prompt-template prefix to exactly 34 tokens (the pipeline drops
``prompt_template_encode_start_idx = 34``); a Qwen-Image VAE with one downsampling (factor 2)
and the transformer's 2x2 packing: H and W multiples of 4; Qwen/Qwen-Image's scheduler config.
"""

from __future__ import annotations

from typing import Any

import torch

from flowgrpo.testing.families._parts import (
    qwen25_vl_text_config,
    qwen25_vl_vision_config,
    qwen_tokenizer,
)
from flowgrpo.testing.family import Family, PublishedSizes

#: Qwen/Qwen-Image's scheduler/scheduler_config.json
SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}
# 2 blocks, 2 heads of 32 (inner dim 64). One forward at 1024 image tokens, batch 4, 2 CPU
# threads: ~40-50 ms (32-128 text tokens).
TRANSFORMER: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 16,  # 4 latent channels x 2x2 patch
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,  # = text encoder hidden size
    "guidance_embeds": False,
    "axes_dims_rope": (8, 12, 12),  # sums to attention_head_dim
}
VAE: dict[str, Any] = dict(
    base_dim=16,
    z_dim=4,
    dim_mult=[1, 2],
    num_res_blocks=1,
    temperal_downsample=[False],
    latents_mean=[-0.2, 0.1, 0.0, 0.3],
    latents_std=[1.5, 2.0, 2.5, 3.0],
)


def build(tcfg: dict[str, Any], seeds) -> Any:
    """The tiny ``QwenImagePipeline`` with transformer config ``tcfg``."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = qwen_tokenizer()
    hidden = tcfg["joint_attention_dim"]
    torch.manual_seed(next(seeds))
    text_cfg = Qwen2_5_VLConfig(
        # + 4 vision placeholder ids the tokenizer never emits
        text_config=qwen25_vl_text_config(tok, hidden, vocab_size=len(tok) + 4),
        vision_config=qwen25_vl_vision_config(hidden),
        image_token_id=len(tok),
        video_token_id=len(tok) + 1,
        vision_start_token_id=len(tok) + 2,
        vision_end_token_id=len(tok) + 3,
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(text_cfg)
    torch.manual_seed(next(seeds))
    vae = AutoencoderKLQwenImage(**VAE)
    torch.manual_seed(next(seeds))
    transformer = QwenImageTransformer2DModel(**tcfg)
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    pipe = QwenImagePipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformer,
    )
    prefix = pipe.prompt_template_encode.split("{}")[0]
    n = len(tok(prefix).input_ids)
    if n != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(
            f"tiny Qwen tokenizer encodes the prompt-template prefix to {n} tokens, "
            f"the pipeline drops {pipe.prompt_template_encode_start_idx}"
        )
    return pipe


DOUBLES = (
    Family(
        "qwen_image",
        ((32, 48), (24, 16)),
        negative=" ",
        guidance_arg="true_cfg_scale",
        bf16_split_atol=5e-4,
        pipeline_class="QwenImagePipeline",
        build=build,
        tier="core",  # every algorithm x LoRA/full runs on it
        transformer=TRANSFORMER,
        vae=VAE,
        published=PublishedSizes(  # Qwen/Qwen-Image: VAE 8 (3 downsamples) x patch 2
            vae={"temperal_downsample": [False, True, True]},
            transformer={},
            multiple=16,
            name="Qwen-Image",
            valid=("model.height=1328", "model.width=1328"),
        ),
    ),
)
