"""SD3's test double: a real ``StableDiffusion3Pipeline`` like SD3.5-Medium (qk RMS-norm, a
dual-attention first layer) with tiny random weights: two CLIP text encoders (16 + 32 wide) and
a T5, CLIP/T5 tokenizers trained in code, a VAE of factor 2 with SD3's latent factors, patch 2:
H and W multiples of 4."""

from __future__ import annotations

from typing import Any

import torch

from flowgrpo.testing.families._parts import (
    KL_VAE,
    clip_text,
    clip_tokenizer,
    kl_vae,
    t5_encoder,
    t5_tokenizer,
)
from flowgrpo.testing.family import Family, PublishedSizes

#: stabilityai/stable-diffusion-3.5-medium's scheduler config (and SD3-medium's)
SCHEDULER: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0}
# 2 blocks, 2 heads of 32. One forward at 1024 image tokens, batch 4, 2 CPU threads: ~55-80 ms
# (77 + 128..256 T5 tokens).
TRANSFORMER: dict[str, Any] = {
    "sample_size": 32,
    "patch_size": 2,
    "in_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 2,
    "joint_attention_dim": 64,  # = T5 d_model (>= 16 + 32 CLIP hidden sizes)
    "caption_projection_dim": 64,  # = inner dim
    "pooled_projection_dim": 48,  # = 16 + 32 CLIP projection dims
    "out_channels": 4,
    "pos_embed_max_size": 64,  # latent side up to 128 -> images up to 256 px
    "dual_attention_layers": (0,),
    "qk_norm": "rms_norm",
}


def build(tcfg: dict[str, Any], seeds) -> Any:
    """The tiny ``StableDiffusion3Pipeline`` with transformer config ``tcfg``."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    if tcfg["pooled_projection_dim"] != 48:
        raise ValueError("tiny sd3: pooled_projection_dim is fixed at 48 (16 + 32 CLIP dims)")
    tok1, tok2, tok3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
    torch.manual_seed(next(seeds))
    te1 = clip_text(CLIPTextModelWithProjection, tok1, hidden=16, proj=16)
    torch.manual_seed(next(seeds))
    te2 = clip_text(CLIPTextModelWithProjection, tok2, hidden=32, proj=32)
    torch.manual_seed(next(seeds))
    te3 = t5_encoder(tok3, d_model=tcfg["joint_attention_dim"])
    torch.manual_seed(next(seeds))
    vae = kl_vae(shift=0.0609, scale=1.5305)  # SD3/SD3.5 VAE factors
    torch.manual_seed(next(seeds))
    transformer = SD3Transformer2DModel(**tcfg)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=te1,
        tokenizer=tok1,
        text_encoder_2=te2,
        tokenizer_2=tok2,
        text_encoder_3=te3,
        tokenizer_3=tok3,
    )


DOUBLES = (
    Family(
        "sd3",
        ((32, 48), (24, 16)),
        options={"max_sequence_length": 16},
        call_options={"max_sequence_length": 16},
        pipeline_class="StableDiffusion3Pipeline",
        build=build,
        tier="core",  # every algorithm x LoRA/full runs on it
        transformer=TRANSFORMER,
        vae=KL_VAE,
        published=PublishedSizes(  # stabilityai/stable-diffusion-3.5-medium: VAE 8 x patch 2
            vae={"block_out_channels": [128, 256, 512, 512]},
            transformer={"patch_size": 2},
            multiple=16,
            name="SD3",
            valid=("model.height=512", "model.width=768"),
        ),
    ),
)
