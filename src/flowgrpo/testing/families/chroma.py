"""Chroma's test double: a real ``ChromaPipeline`` like Chroma1-HD (FLUX.1's double and single
blocks, the modulation approximator, T5 only) with tiny random weights: the T5 tokenizer and
encoder of the FLUX.1 double, the VAE of factor 2 with FLUX.1's latent factors, 2x2 packing:
H and W multiples of 4."""

from __future__ import annotations

from typing import Any

import torch

from flowgrpo.testing.families._parts import KL_VAE, kl_vae, t5_encoder, t5_tokenizer
from flowgrpo.testing.family import Family

#: FLUX.1's dynamic shift (the pipeline computes mu from the packed sequence length)
SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
# 1 double + 1 single block, 2 heads of 32; the approximator at 2 layers of 32 (real: 5 of
# 5120, 64 input channels)
TRANSFORMER: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 16,  # 4 latent channels x 2x2 packing
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 32,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,  # = T5 d_model
    "axes_dims_rope": (8, 12, 12),
    "approximator_num_channels": 16,
    "approximator_hidden_dim": 32,
    "approximator_layers": 2,
}


def build(tcfg: dict[str, Any], seeds) -> Any:
    """The tiny ``ChromaPipeline`` with transformer config ``tcfg``."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    tok = t5_tokenizer()
    torch.manual_seed(next(seeds))
    text_encoder = t5_encoder(tok, d_model=tcfg["joint_attention_dim"])
    torch.manual_seed(next(seeds))
    vae = kl_vae(shift=0.1159, scale=0.3611)  # FLUX.1 VAE factors
    torch.manual_seed(next(seeds))
    transformer = ChromaTransformer2DModel(**tcfg)
    return ChromaPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformer,
    )


DOUBLES = (
    Family(
        "chroma",
        ((32, 48), (24, 16)),
        options={"max_sequence_length": 16},
        call_options={"max_sequence_length": 16},
        pipeline_class="ChromaPipeline",
        build=build,
        transformer=TRANSFORMER,
        vae=KL_VAE,
    ),
)
