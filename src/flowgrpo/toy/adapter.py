"""Adapter for the built-in toy digits model (``flowgrpo.toy.pipeline.ToyDigitsPipeline``).

The registry maps the pipeline class to this adapter by import path (a string), so nothing
below the toy package imports it.

Latents are the images themselves, [B, 1, 8, 8] in [-1, 1]; prompts ("a handwritten 7") map to
4 learned tokens [B, 4, 32] (no mask) plus a pooled vector [B, 32], "" to the unconditional
entry; schedule = the pipeline's FlowMatchEulerDiscreteScheduler; timestep = sigma * 1000.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from flowgrpo.models.base import DiffusionAdapter, PromptEmbeds, Schedule, param_dtype
from flowgrpo.toy.pipeline import EMPTY_ID, IMAGE_SIZE, ToyDigitsPipeline, parse_digit


class ToyAdapter(DiffusionAdapter):
    """Drives a ``ToyDigitsPipeline``: latents [B, 1, 8, 8] (the image in [-1, 1]), prompt
    embeds [B, 4, 32] without mask plus pooled [B, 32], timestep = sigma * 1000."""

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

    def __init__(self, pipe: Any):
        super().__init__(pipe)
        self.num_train_timesteps = int(pipe.scheduler.config.num_train_timesteps)

    @staticmethod
    def digits(prompts: list[str]) -> list[int | None]:
        """Parsed digit per prompt (None for ""); raises ValueError on a prompt without one."""
        return [parse_digit(p) for p in prompts]

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        ids = [EMPTY_ID if d is None else d for d in self.digits(list(prompts))]
        enc = self.pipe.text_encoder
        idx = torch.tensor(ids, dtype=torch.long, device=enc.tokens.device)
        embeds, pooled = enc(idx)
        return PromptEmbeds(embeds.detach().clone(), None, pooled.detach().clone()).to(
            self.device, self.dtype
        )

    def _check_size(self, height: int, width: int) -> None:
        if (height, width) != (IMAGE_SIZE, IMAGE_SIZE):
            raise ValueError(
                f"the toy model makes {IMAGE_SIZE}x{IMAGE_SIZE} images, got height={height}, "
                f"width={width}"
            )

    def schedule(self, num_steps: int, height: int, width: int) -> Schedule:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self._check_size(height, width)
        scheduler = copy.deepcopy(self.pipe.scheduler)
        scheduler.set_timesteps(num_steps, device="cpu")
        return Schedule(scheduler.sigmas.float(), scheduler.timesteps.float())

    def prepare_latents(
        self,
        batch_size: int,
        height: int,
        width: int,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """fp32 noise [B, 1, 8, 8] (one generator, or one per sample as diffusers' randn_tensor)."""
        from diffusers.utils.torch_utils import randn_tensor

        self._check_size(height, width)
        shape = (batch_size, 1, height, width)
        return randn_tensor(shape, generator=generator, device=self.device, dtype=torch.float32)

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
        """Raw velocity [B, 1, 8, 8]; timestep = sigma * 1000 in fp32."""
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
        """Latents in [-1, 1] -> images [B, 1, 8, 8] fp32 in [0, 1] on CPU (clamped)."""
        return ((latents.float() + 1) / 2).clamp(0, 1).cpu()


__all__ = ["ToyAdapter", "ToyDigitsPipeline"]
