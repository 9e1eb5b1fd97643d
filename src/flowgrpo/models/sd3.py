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

from collections.abc import Callable
from typing import Any

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


# -- sequence parallelism: a CP-capable joint-attention processor, a cp plan -------------------
class CPJointAttnProcessor:
    """diffusers' ``JointAttnProcessor2_0`` (SD3/SD3.5: q/k RMS-norm, [image, text] joint
    order, ``context_pre_only``, the image-only ``attn2`` of SD3.5 dual layers) computed through
    ``dispatch_attention_fn``, so ``enable_parallelism`` hands it the Ulysses config. The stock
    processor calls F.scaled_dot_product_attention directly and has no ``_parallel_config``:
    diffusers skips it silently and every rank attends to its own tokens only (1.3e-2 off).

    ``text_key_mask`` [B, L] (True = real token, full length, never split) masks the padding
    that ``flowgrpo.engine.sp.enable_sequence_parallel`` appends to the text."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        text_key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if attention_mask is not None:
            raise ValueError("CPJointAttnProcessor takes text_key_mask, not attention_mask")
        heads = attn.heads

        def split(x: torch.Tensor) -> torch.Tensor:  # [B, S, H * D] -> [B, S, H, D]
            return x.unflatten(-1, (heads, x.shape[-1] // heads))

        query, key, value = (split(f(hidden_states)) for f in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        n_img, mask = hidden_states.shape[1], None
        if encoder_hidden_states is not None:
            projs = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            eq, ek, ev = (split(f(encoder_hidden_states)) for f in projs)
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            query, key, value = (torch.cat(p, dim=1) for p in ((query, eq), (key, ek), (value, ev)))
            if text_key_mask is not None:
                txt = local_chunk(text_key_mask.bool(), self._parallel_config)
                img = txt.new_ones(txt.shape[0], n_img)
                mask = torch.cat([img, txt], dim=1)[:, None, None, :]  # [B, 1, 1, S_local]
        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=mask,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        out, enc = out[:, :n_img], out[:, n_img:]
        if not attn.context_pre_only:
            enc = attn.to_add_out(enc)
        return attn.to_out[1](attn.to_out[0](out)), enc


def sd3_cp_plan() -> dict[str, Any]:
    """``SD3Transformer2DModel`` has no ``_cp_plan`` in diffusers 0.42.1. Its input is a latent
    image [B, C, H, W]; PatchEmbed adds a cropped 2-D position embedding that needs the full H
    and W, so the image is split *after* ``pos_embed`` (its [B, S, D] output, dim 1), the text
    at the root (``context_embedder`` is per token), and the output is gathered after
    ``proj_out``, before the unpatchify that reads H and W from the unsplit input."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    return {
        "": {"encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
        "pos_embed": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


class SD3SequenceParallel(SequenceParallelSpec):
    """SD3/SD3.5 under Ulysses SP: ``sd3_cp_plan``, ``CPJointAttnProcessor`` on every attention
    module, image tokens of the unpatchified [B, C, H, W] latents, text padded with a key mask."""

    name = "sd3"
    transformer_class = "SD3Transformer2DModel"

    def cp_plan(self, transformer: nn.Module) -> dict[str, Any]:
        return sd3_cp_plan()

    def attention_processor(self, module: nn.Module) -> CPJointAttnProcessor:
        return CPJointAttnProcessor()

    def image_tokens(self, transformer: nn.Module, hidden_states: torch.Tensor) -> int:
        p = transformer.config.patch_size  # [B, C, H, W] latents, patchified inside
        return (hidden_states.shape[-2] // p) * (hidden_states.shape[-1] // p)


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
    sequence_parallel = SD3SequenceParallel()
    truncation_loggers = ("diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3",)

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
    def prompt_tokens(cls, max_sequence_length: int | None) -> tuple[int, int]:
        """77 CLIP tokens + the T5 tokens (default 256), 4096 wide."""
        return 77 + (max_sequence_length or 256), 4096

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
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self._check_size(height, width)
        seq_len = None
        if self.pipe.scheduler.config.get("use_dynamic_shifting", None):
            h, w = self.latent_size(height, width)
            seq_len = (h // self.patch_size) * (w // self.patch_size)
        return self.shifted_schedule(num_steps, image_seq_len=seq_len, max_shift=1.16)

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
