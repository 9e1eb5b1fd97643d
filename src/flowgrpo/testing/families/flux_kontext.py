"""FLUX.1 Kontext's test double: a real ``FluxKontextPipeline``: the FLUX tiny's text encoders
and transformer with a VAE of spatial factor 32 (5 downsamplings, 4 channels, no residual
blocks): the pipeline resizes every source image to a preferred Kontext resolution (~1024²
pixels), which this VAE encodes in ~0.1 s on one CPU thread into 32 x 32 latents (256 source
tokens). Sizes: multiples of 64. Source images are conditioning (``sources``)."""

from __future__ import annotations

from typing import Any

import torch

from flowgrpo.testing.families import flux
from flowgrpo.testing.families._parts import random_image
from flowgrpo.testing.family import Family, SequenceParallelCase

TRANSFORMER: dict[str, Any] = dict(flux.TRANSFORMER)
VAE: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 6,
    up_block_types=("UpDecoderBlock2D",) * 6,
    block_out_channels=(4,) * 6,
    layers_per_block=0,
    latent_channels=4,
    norm_num_groups=4,
    sample_size=32,
    scaling_factor=0.3611,  # FLUX.1 VAE factors
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=False,
)


def build(tcfg: dict[str, Any], seeds) -> Any:
    """The tiny ``FluxKontextPipeline`` with transformer config ``tcfg``."""
    from diffusers import AutoencoderKL, FluxKontextPipeline

    base = flux.build(tcfg, seeds)
    torch.manual_seed(next(seeds))
    vae = AutoencoderKL(**VAE)
    return FluxKontextPipeline(**{**base.components, "vae": vae})


DOUBLES = (
    Family(  # both sizes of one area: the stock call's max_area keeps them as given
        "flux_kontext",
        ((128, 192), (192, 128)),
        size=(64, 128),
        options={"max_sequence_length": 16},
        cfg_options={"true_cfg_scale": 4.0},
        call_options={"max_sequence_length": 16, "max_area": 128 * 192},
        guidance=2.5,
        train_size=(64, 64),
        # one 2:1 source per prompt (at least 64 px: the pipeline floors the image's size to
        # its multiple, 64, before reading the aspect ratio): resized to 1408 x 704 (242 tokens)
        sources=lambda: [[random_image(i, 80, 144)] for i in range(4)],
        pipeline_class="FluxKontextPipeline",
        # source_size=64: one source token (1 x 1 after the 2x2 packing) beside the 1 x 3
        # noised ones of a 64 x 192 image (its VAE view's area is unused)
        sp=SequenceParallelCase(
            options={"max_sequence_length": 16, "source_size": 64},
            edit=(64, 192, ((20, 60),), None, 1),
        ),
        build=build,
        transformer=TRANSFORMER,
        vae=VAE,
    ),
)
