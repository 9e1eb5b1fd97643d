"""Wan's test doubles: real ``WanPipeline`` s with tiny random weights. ``"wan"`` is like
Wan2.1-T2V (UMT5, the Wan VAE with the real temporal x4 and a spatial x4, patch (1, 2, 2));
``"wan22"`` adds a second expert ``transformer_2`` (next seed) and ``boundary_ratio`` 0.875,
as Wan2.2-T2V-A14B. Scheduler: ``FlowMatchEulerDiscreteScheduler(shift=3)`` (Wan's 480p
``flow_shift``; the hub ships UniPC). H, W multiples of 16 (the pipeline's check), F = 4k + 1
frames: a video of F x H x W has ((F - 1)/4 + 1) x (H/8) x (W/8) transformer tokens."""

from __future__ import annotations

from typing import Any

import torch

from flowgrpo.testing.families._parts import t5_config, t5_tokenizer
from flowgrpo.testing.family import Family, PublishedSizes

#: Wan-AI/Wan2.1-T2V-*-Diffusers ship UniPC with flow_shift 3.0 (480p); the Euler equivalent
SCHEDULER: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0}
TRANSFORMER: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 32,  # RoPE split t/h/w = 12/10/10
    "in_channels": 4,  # = the tiny VAE's z_dim (real Wan2.1/2.2-A14B: 16)
    "out_channels": 4,
    "text_dim": 32,  # = UMT5 d_model
    "freq_dim": 32,
    "ffn_dim": 128,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}
#: the Wan VAE's layout (its latent statistics follow ``in_channels``)
VAE: dict[str, Any] = dict(
    base_dim=8,
    dim_mult=[1, 1, 1],  # two down/up stages: spatial x4
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[True, True],  # temporal x4, as the real Wan VAE
    scale_factor_spatial=4,  # config values the pipeline reads: must match the layout
    scale_factor_temporal=4,
)


def build(tcfg: dict[str, Any], seeds, two_experts: bool = False) -> Any:
    """The tiny ``WanPipeline`` (Wan2.1; ``two_experts``: Wan2.2) with transformer ``tcfg``."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    tok = t5_tokenizer()
    d = tcfg["text_dim"]
    torch.manual_seed(next(seeds))
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            **t5_config(tok, d),
            relative_attention_max_distance=32,
            decoder_start_token_id=tok.pad_token_id,
        )
    )
    torch.manual_seed(next(seeds))
    z = tcfg["in_channels"]
    vae = AutoencoderKLWan(
        **VAE,
        z_dim=z,
        latents_mean=[0.1 * ((i % 5) - 2) for i in range(z)],
        latents_std=[1.5 + 0.5 * (i % 4) for i in range(z)],
    )
    experts = []
    for _ in range(2 if two_experts else 1):
        torch.manual_seed(next(seeds))
        experts.append(WanTransformer3DModel(**tcfg))
    return WanPipeline(
        tokenizer=tok,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        transformer=experts[0],
        transformer_2=experts[1] if two_experts else None,
        boundary_ratio=0.875 if two_experts else None,  # Wan2.2-T2V-A14B's model_index.json
    )


def build_wan22(tcfg: dict[str, Any], seeds) -> Any:
    """Wan2.2: two experts (each with ``tcfg``)."""
    return build(tcfg, seeds, two_experts=True)


def _straddles_wan22_boundary(traj: Any) -> None:
    """The trained steps of the batch visit both Wan2.2 experts (boundary t = 875)."""
    high = traj.sigmas[:, 0] * 1000 >= 875.0
    assert bool(high.any()) and not bool(high.all()), traj.step_indices


def _load_wan22_lora(pipe: Any, folder: Any) -> None:
    """Wan2.2's export as users load it: the second expert's file beside the first."""
    pipe.load_lora_weights(folder, weight_name="pytorch_lora_weights.safetensors")
    pipe.load_lora_weights(
        folder, weight_name="pytorch_lora_weights_2.safetensors", load_into_transformer_2=True
    )


_WAN = Family(
    "wan",
    ((32, 48), (48, 32)),
    size=(32, 48),
    options={"max_sequence_length": 32},
    call_options={"max_sequence_length": 32},
    num_frames=5,
    sde_window=(1, 0, 3),
    x0_seed=3,
    bf16_via_load=True,
    train_size=(32, 48),
    pipeline_class="WanPipeline",
    build=build,
    transformer=TRANSFORMER,
    vae=VAE,
    published=PublishedSizes(  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers: spatial 8, temporal 4
        vae={"temperal_downsample": [False, True, True]},
        transformer={"patch_size": [1, 2, 2], "rope_max_seq_len": 1024},
        multiple=16,
        name="Wan",
        valid=("model.height=480", "model.width=832", "model.num_frames=81"),
    ),
)
DOUBLES = (
    _WAN,
    Family(
        "wan22",
        ((32, 48), (48, 32)),
        size=(32, 48),
        options={"max_sequence_length": 32},
        cfg_options={"guidance_scale_2": 3.0},
        call_options={"max_sequence_length": 32},
        num_frames=5,
        sde_window=(1, 0, 3),
        x0_seed=3,
        rollout_check=_straddles_wan22_boundary,
        bf16_via_load=True,
        train_size=(32, 48),
        load_lora=_load_wan22_lora,
        pipeline_class="WanPipeline",
        build=build_wan22,
        tier="core",  # every algorithm x LoRA/full runs on it (two experts)
        transformer=TRANSFORMER,
        vae=VAE,
    ),
)
