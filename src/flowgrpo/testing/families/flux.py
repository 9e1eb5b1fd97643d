"""FLUX.1's test double: a real ``FluxPipeline`` like FLUX.1-dev (``guidance_embeds=True``)
with tiny random weights: a CLIP and a T5 text encoder (tokenizers trained in code), a VAE of
factor 2 with FLUX.1's latent factors, 2x2 packing: H and W multiples of 4."""

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
from flowgrpo.testing.family import Family, PublishedSizes, SequenceParallelCase

#: black-forest-labs/FLUX.1-dev's scheduler config
SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
# 1 double + 1 single block, 2 heads of 32. One forward at 1024 image tokens, batch 4, 2 CPU
# threads: ~50-85 ms (128..512 T5 tokens).
TRANSFORMER: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 16,  # 4 latent channels x 2x2 packing
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 32,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,  # = T5 d_model
    "pooled_projection_dim": 32,  # = CLIP hidden size (pooler_output)
    "guidance_embeds": True,
    "axes_dims_rope": (8, 12, 12),
}


def build(tcfg: dict[str, Any], seeds) -> Any:
    """The tiny ``FluxPipeline`` with transformer config ``tcfg``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    tok1, tok2 = clip_tokenizer(), t5_tokenizer()
    torch.manual_seed(next(seeds))
    te1 = clip_text(CLIPTextModel, tok1, hidden=tcfg["pooled_projection_dim"], proj=None)
    torch.manual_seed(next(seeds))
    te2 = t5_encoder(tok2, d_model=tcfg["joint_attention_dim"])
    torch.manual_seed(next(seeds))
    vae = kl_vae(shift=0.1159, scale=0.3611)  # FLUX.1 VAE factors
    torch.manual_seed(next(seeds))
    transformer = FluxTransformer2DModel(**tcfg)
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=te1,
        tokenizer=tok1,
        text_encoder_2=te2,
        tokenizer_2=tok2,
        transformer=transformer,
    )


DOUBLES = (
    Family(
        "flux",
        ((32, 48), (24, 16)),
        options={"max_sequence_length": 16},
        cfg_options={"true_cfg_scale": 4.0},
        call_options={"max_sequence_length": 16},
        guidance=3.5,
        pipeline_class="FluxPipeline",
        # FLUX.1-dev's guidance is distilled: true CFG gives the second branch under SP
        sp=SequenceParallelCase(options={"true_cfg_scale": 4.0}, guidance=3.5),
        build=build,
        tier="core",  # every algorithm x LoRA/full runs on it
        transformer=TRANSFORMER,
        vae=KL_VAE,
        published=PublishedSizes(  # black-forest-labs/FLUX.1-dev: VAE 8 x 2x2 packing
            vae={"block_out_channels": [128, 256, 512, 512]},
            transformer={"patch_size": 1},
            multiple=16,
            name="FLUX",
            valid=("model.height=1024", "model.width=1024"),
        ),
    ),
)
