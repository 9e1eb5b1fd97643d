"""Adapter for diffusers' ``FluxPipeline`` (FLUX.1-dev / -schnell style models).

Mirrors ``FluxPipeline.__call__`` piece by piece:

- prompts: ``pipe.encode_prompt``: T5 embeddings [B, L, D] (padded to ``max_sequence_length``,
  no mask) and the CLIP pooled output [B, P]; text ids are zeros [L, 3];
- latents: packed 2x2 patches [B, (h/2)(w/2), 4C] (``pipe._pack_latents``) with latent image
  ids [(h/2)(w/2), 3];
- schedule: sigmas = linspace(1, 1/N, N) with the dynamic shift ``mu = calculate_shift(packed
  sequence length, ...)`` read from the scheduler config;
- transformer input: ``timestep = (sigma * 1000) / 1000`` as the pipeline passes ``t / 1000``;
  ``guidance = guidance_scale`` as an embedding when the transformer is guidance-distilled
  (``guidance_embeds``): one forward, no negative branch;
- optional "true CFG" (``true_cfg_scale > 1``): a negative-prompt branch combined as
  ``v_neg + true_cfg_scale (v_pos - v_neg)``, independent of the distilled ``guidance_scale``;
- decoding: unpack, ``/ scaling_factor + shift_factor``, ``vae.decode``, mapped to [0, 1].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from flowgrpo.models.base import (
    DiffusionAdapter,
    PromptEmbeds,
    Schedule,
    SizeRule,
    check_size,
    param_dtype,
    vae_scale,
)
from flowgrpo.models.parallel import SequenceParallelSpec, local_chunk
from flowgrpo.settings import ge, setting


@dataclass
class FluxSettings:
    """FLUX.1's own settings, the config section ``flux`` (FLUX.1 Kontext takes them too)."""

    true_cfg_scale: float = setting(
        1.0,
        "FLUX.1 (and FLUX.1 Kontext): true CFG with the negative prompt when > 1 (1 = off).",
        check=ge(1, " (1 = off)"),
    )


# -- sequence parallelism: a processor that masks padded text ---------------------------------
def maskable_processor(old: Any) -> Any:
    """diffusers' ``FluxAttnProcessor`` that also takes ``text_key_mask`` [B, L] (full length)
    for padded T5 tokens; the joint sequence is [text, image] in double and single blocks."""
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    class MaskableFluxAttnProcessor(FluxAttnProcessor):
        def __call__(
            self,
            attn,
            hidden_states,
            encoder_hidden_states=None,
            attention_mask=None,
            image_rotary_emb=None,
            text_key_mask=None,
        ):
            if text_key_mask is not None:
                if attention_mask is not None:
                    raise ValueError("pass text_key_mask or attention_mask, not both")
                txt = local_chunk(text_key_mask.bool(), self._parallel_config)
                total = hidden_states.shape[1]
                if encoder_hidden_states is not None:
                    total += encoder_hidden_states.shape[1]
                rest = txt.new_ones(txt.shape[0], total - txt.shape[1])
                attention_mask = torch.cat([txt, rest], dim=1)[:, None, None, :]
            return super().__call__(
                attn,
                hidden_states,
                encoder_hidden_states,
                attention_mask=attention_mask,
                image_rotary_emb=image_rotary_emb,
            )

    new = MaskableFluxAttnProcessor()
    new._attention_backend = getattr(old, "_attention_backend", None)
    return new


class FluxSequenceParallel(SequenceParallelSpec):
    """FLUX under Ulysses SP: diffusers' ``_cp_plan``, its processor made maskable, text padded
    with a key mask and zero position ids (as every T5 token has)."""

    name = "flux"
    transformer_class = "FluxTransformer2DModel"
    zero_padded_kwargs = ("txt_ids",)
    #: FLUX.1 Kontext's transformer is this class too: its source tokens split with the rest
    image_token_rule = "latent h/2 x w/2, plus the source image's tokens of FLUX.1 Kontext"

    def attention_processor(self, module: nn.Module) -> Any:
        return maskable_processor(module.processor)


class FluxAdapter(DiffusionAdapter):
    """Drives a ``FluxPipeline``; see the module docstring for the exact mapping.

    true_cfg_scale: the pipeline's ``true_cfg_scale`` (1 = off; > 1 runs a negative branch).
    max_sequence_length: T5 tokens per prompt (the pipeline's default 512).
    """

    #: flow_grpo's FLUX targets (scripts/train_flux.py): attention and the double blocks'
    #: feed-forwards. The single blocks' ``proj_mlp``/``proj_out`` are not targeted; a bare
    #: "proj_out" would also wrap the transformer's final output layer.
    lora_target_modules = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )
    sequence_parallel = FluxSequenceParallel()
    truncation_loggers = ("diffusers.pipelines.flux.pipeline_flux",)
    settings_class = FluxSettings

    def __init__(
        self,
        pipe: Any,
        *,
        true_cfg_scale: float = FluxSettings.true_cfg_scale,
        max_sequence_length: int = 512,
    ):
        super().__init__(pipe)
        if true_cfg_scale < 1.0:
            raise ValueError(f"true_cfg_scale must be >= 1 (1 = off), got {true_cfg_scale}")
        if not 1 <= max_sequence_length <= 512:
            raise ValueError(f"max_sequence_length must be in [1, 512], got {max_sequence_length}")
        self.true_cfg_scale = float(true_cfg_scale)
        self.max_sequence_length = max_sequence_length
        cfg = pipe.transformer.config
        self.num_channels_latents = int(cfg.in_channels) // 4
        self.guidance_embeds = bool(cfg.guidance_embeds)
        self.num_train_timesteps = int(pipe.scheduler.config.num_train_timesteps)

    # -- guidance: the distilled scale is an input, true CFG is the only second branch ------------
    def uses_cfg(self, guidance_scale: float) -> bool:
        """A negative branch runs only for true CFG; ``guidance_scale`` is the distilled input."""
        return self.true_cfg_scale > 1.0

    def guide(
        self, v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float
    ) -> torch.Tensor:
        """The pipeline's true CFG: v_neg + true_cfg_scale (v_pos - v_neg)."""
        return v_uncond + self.true_cfg_scale * (v_cond - v_uncond)

    # -- pieces of the pipeline -------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """embeds [B, max_sequence_length, joint_attention_dim], pooled [B, P]; no mask."""
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        return PromptEmbeds(embeds, None, pooled)

    @classmethod
    def plans_cfg(cls, guidance_scale: float, options: dict[str, Any]) -> bool:
        """FLUX.1-dev's guidance is distilled: a negative branch only for true CFG."""
        return options.get("true_cfg_scale", FluxSettings.true_cfg_scale) > 1

    @classmethod
    def size_rule(cls, config: Callable[[str], dict]) -> SizeRule:
        """Multiples of VAE factor x 2 (16): the latents are packed 2x2. The pipeline would
        round 22 px down to 16 (tiny: 20) silently; the adapter refuses instead."""
        f = vae_scale(config("vae"))
        return SizeRule("FLUX", (2 * f, 2 * f), f"VAE {f} x 2x2 packing")

    def _check_size(self, height: int, width: int) -> None:
        """ValueError for a size the family cannot generate exactly (``size_rule``)."""
        rule = self.size_rule(lambda name: dict(getattr(self.pipe, name).config))
        check_size(rule, height, width, None)

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        """Unpacked latent (h, w) for an image of height x width pixels (both even)."""
        f = self.pipe.vae_scale_factor * 2
        return 2 * (int(height) // f), 2 * (int(width) // f)

    def schedule(self, num_steps: int, height: int, width: int) -> Schedule:
        """linspace(1, 1/N, N) sigmas with the pipeline's dynamic shift (on a scheduler copy)."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self._check_size(height, width)
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if self.pipe.scheduler.config.get("use_flow_sigmas", False):
            sigmas = None
        h, w = self.latent_size(height, width)
        return self.shifted_schedule(num_steps, sigmas, image_seq_len=(h // 2) * (w // 2))

    def prepare_latents(
        self,
        batch_size: int,
        height: int,
        width: int,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """Packed noise [B, (h/2)(w/2), 4C] drawn by the pipeline's own ``prepare_latents``."""
        self._check_size(height, width)
        latents, _ = self.pipe.prepare_latents(
            batch_size,
            self.num_channels_latents,
            height,
            width,
            torch.float32,  # trajectories are fp32 whatever the weights' dtype
            self.device,
            generator,
        )
        return latents

    def image_ids(self, height: int, width: int, device, dtype: torch.dtype) -> torch.Tensor:
        """Latent image position ids [(h/2)(w/2), 3] as the pipeline builds them."""
        h, w = self.latent_size(height, width)
        return self.pipe._prepare_latent_image_ids(1, h // 2, w // 2, device, dtype)

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
        """Raw velocity [B, S, 4C] for packed latents; timestep = t / 1000 with t = 1000 sigma."""
        img_ids = self.image_ids(height, width, latents.device, latents.dtype)
        return self.transformer_call(transformer, latents, sigma, embeds, img_ids, guidance_scale)

    def transformer_call(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        embeds: PromptEmbeds,
        img_ids: torch.Tensor,
        guidance_scale: float,
    ) -> torch.Tensor:
        """The transformer on packed tokens ``latents`` [B, S, 4C] at positions ``img_ids``
        [S, 3] (FLUX.1 Kontext: noised and source tokens) -> its output [B, S, 4C]."""
        dtype = param_dtype(transformer)
        device, batch = latents.device, latents.shape[0]
        t = sigma.to(device=device, dtype=torch.float32) * self.num_train_timesteps
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((batch,), float(guidance_scale), device=device)
        text_ids = torch.zeros(embeds.embeds.shape[1], 3, device=device, dtype=embeds.embeds.dtype)
        return transformer(
            hidden_states=latents.to(dtype),
            timestep=t.to(latents.dtype) / 1000,
            guidance=guidance,
            pooled_projections=embeds.pooled.to(dtype),
            encoder_hidden_states=embeds.embeds.to(dtype),
            txt_ids=text_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents -> images [B, 3, H, W] fp32 in [0, 1] on CPU."""
        vae = self.pipe.vae
        z = self.pipe._unpack_latents(latents, height, width, self.pipe.vae_scale_factor)
        z = z / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z.to(vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1).cpu()


__all__ = ["FluxAdapter", "FluxSettings"]
