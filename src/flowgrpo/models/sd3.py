"""Adapter for diffusers' ``StableDiffusion3Pipeline`` (SD3 / SD3.5).

Mirrors ``StableDiffusion3Pipeline.__call__`` piece by piece:

- prompts: ``pipe.encode_prompt`` (CLIP-L + CLIP-G + T5), embeddings [B, 77 + T5 length, D]
  and pooled [B, 2048] (no mask: SD3 attends to every padded token);
- schedule: ``retrieve_timesteps`` on a copy of the pipeline's scheduler (static shift from
  its config, 3.0 for SD3; dynamic shift with the pipeline's ``mu`` when the config asks);
- transformer input: latents [B, C, H/8, W/8], ``timestep = sigma * 1000`` (fp32, equal to
  the scheduler's timesteps), pooled projections;
- guidance: standard CFG, unconditional and conditional rows in one batched forward when no
  gradient is needed (the base class);
- decoding: ``latents / scaling_factor + shift_factor``, ``vae.decode``, mapped to [0, 1].
Skip-layer guidance and IP-adapters are not supported.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from flowgrpo.models.base import (
    DiffusionAdapter,
    PromptEmbeds,
    Schedule,
    SizeRule,
    check_size,
    param_dtype,
    vae_scale,
)


class SD3Adapter(DiffusionAdapter):
    """Drives a ``StableDiffusion3Pipeline``; see the module docstring for the exact mapping.

    max_sequence_length: T5 tokens per prompt (the pipeline's default 256).
    """

    lora_target_modules = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
    )

    def __init__(self, pipe: Any, *, max_sequence_length: int = 256):
        super().__init__(pipe)
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length
        cfg = pipe.transformer.config
        self.in_channels = int(cfg.in_channels)
        self.patch_size = int(cfg.patch_size)
        self.num_train_timesteps = int(pipe.scheduler.config.num_train_timesteps)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """embeds [B, L, joint_attention_dim], pooled [B, pooled_projection_dim]; no mask."""
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return PromptEmbeds(embeds, None, pooled)

    @classmethod
    def size_rule(cls, config: Callable[[str], dict]) -> SizeRule:
        """Multiples of VAE factor x patch size (16 for SD3/SD3.5), as the pipeline checks."""
        f, p = vae_scale(config("vae")), int(config("transformer").get("patch_size", 2))
        return SizeRule("SD3", (f * p, f * p), f"VAE {f} x patch {p}")

    def _check_size(self, height: int, width: int) -> None:
        """ValueError for a size the family cannot generate exactly (``size_rule``)."""
        rule = self.size_rule(lambda name: dict(getattr(self.pipe, name).config))
        check_size(rule, height, width, None)

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        """Latent (h, w) for an image of height x width pixels."""
        f = self.pipe.vae_scale_factor
        return int(height) // f, int(width) // f

    def schedule(self, num_steps: int, height: int, width: int) -> Schedule:
        """``retrieve_timesteps`` exactly as the pipeline calls it (on a scheduler copy)."""
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
            calculate_shift,
            retrieve_timesteps,
        )

        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self._check_size(height, width)
        scheduler = copy.deepcopy(self.pipe.scheduler)
        kwargs: dict[str, Any] = {}
        conf = scheduler.config
        if conf.get("use_dynamic_shifting", None):
            h, w = self.latent_size(height, width)
            seq_len = (h // self.patch_size) * (w // self.patch_size)
            kwargs["mu"] = calculate_shift(
                seq_len,
                conf.get("base_image_seq_len", 256),
                conf.get("max_image_seq_len", 4096),
                conf.get("base_shift", 0.5),
                conf.get("max_shift", 1.16),
            )
        timesteps, _ = retrieve_timesteps(scheduler, num_steps, "cpu", **kwargs)
        return Schedule(scheduler.sigmas.float(), timesteps.float())

    def prepare_latents(
        self,
        batch_size: int,
        height: int,
        width: int,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """Noise [B, C, H/8, W/8] drawn by the pipeline's own ``prepare_latents``."""
        self._check_size(height, width)
        return self.pipe.prepare_latents(
            batch_size,
            self.in_channels,
            height,
            width,
            torch.float32,  # trajectories are fp32 whatever the weights' dtype
            self.device,
            generator,
        )

    def forward(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        embeds: PromptEmbeds,
        *,
        height: int,
        width: int,
        guidance_scale: float,
    ) -> torch.Tensor:
        """Raw velocity [B, C, h, w]; timestep = sigma * num_train_timesteps in fp32."""
        dtype = param_dtype(transformer)
        timestep = sigma.to(device=latents.device, dtype=torch.float32) * self.num_train_timesteps
        return transformer(
            hidden_states=latents.to(dtype),
            timestep=timestep,
            encoder_hidden_states=embeds.embeds.to(dtype),
            pooled_projections=embeds.pooled.to(dtype),
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """[B, C, h, w] latents -> images [B, 3, H, W] fp32 in [0, 1] on CPU."""
        vae = self.pipe.vae
        z = latents / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z.to(vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1).cpu()


__all__ = ["SD3Adapter"]
