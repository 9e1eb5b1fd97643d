"""Adapter for diffusers' ``ChromaPipeline`` (Chroma1-HD / Chroma1-Base: FLUX.1-schnell's
architecture pruned to 8.9B, T5 only, real CFG).

Mirrors ``ChromaPipeline.__call__`` piece by piece:

- prompts: ``pipe.encode_prompt``: T5 embeddings [B, L, D] padded to ``max_sequence_length``
  and encoded WITH the tokenizer's mask; the transformer's text mask keeps every real token
  and the first padding token (1.0) and zeroes the rest. That mask travels in
  ``PromptEmbeds.pooled`` [B, L] (``mask`` stays None: the text is never trimmed, see below);
- latents: packed 2x2 patches [B, (h/2)(w/2), 4C] with latent image ids [(h/2)(w/2), 3], the
  pipeline's own ``prepare_latents`` (FLUX.1's); text ids are zeros [L, 3];
- schedule: sigmas = linspace(1, 1/N, N) with the dynamic shift ``mu = calculate_shift(packed
  sequence length, ...)`` from the scheduler config, as FLUX.1;
- transformer input: ``timestep = t / 1000`` (t = 1000 sigma) and ``attention_mask`` = [text
  mask, ones for the image tokens] [B, L + S]; no guidance embedding;
- guidance: standard CFG ``v_neg + g (v_pos - v_neg)``, on for g > 1 (the pipeline's default
  negative prompt is ""); the pipeline runs two calls, the adapter one doubled batch;
- decoding: unpack, ``/ scaling_factor + shift_factor``, ``vae.decode``, mapped to [0, 1].

The mask is a float tensor, which ``scaled_dot_product_attention`` ADDS to the scores: masked
pairs get +0, kept pairs +1 (diffusers 0.42.1 transformer_chroma.py builds the outer product
of the mask and passes it as ``attn_mask``), so the padded tokens still take part. The adapter
keeps that arithmetic, and the padding with it: trimming the text to the longest prompt (what
``PromptEmbeds.mask`` would do) would change the result.

Activation checkpointing: diffusers' checkpointed call of a single block passes no
``attention_mask`` (transformer_chroma.py, ``_gradient_checkpointing_func(block,
hidden_states, temb, image_rotary_emb)``), so a checkpointed training pass would run without
the mask the rollout used. While the adapter's call runs, the transformer's checkpointing
function binds the call's mask to each single block (restored after the call); the
recomputation in backward uses the bound mask.

Limits: diffusers ships no context-parallel plan for ``ChromaTransformer2DModel`` and its
blocks take the mask as a full [B, L + S] tensor, so no sequence parallelism
(``sequence_parallel`` None: the engine refuses ``fsdp.sp_degree`` > 1 naming the class).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
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


@contextmanager
def masked_checkpointing(transformer: torch.nn.Module, mask: torch.Tensor) -> Iterator[None]:
    """While the block runs, ``transformer``'s checkpointing function (when checkpointing is
    on and grad enabled) calls each single block with ``attention_mask=mask``, which diffusers'
    checkpointed call leaves out; the function is restored after."""
    base = getattr(transformer, "_gradient_checkpointing_func", None)
    if base is None or not (torch.is_grad_enabled() and transformer.gradient_checkpointing):
        yield
        return
    from diffusers.models.transformers.transformer_chroma import ChromaSingleTransformerBlock

    def bound(block: Any, *args: Any) -> Any:
        if isinstance(block, ChromaSingleTransformerBlock):  # FSDP's subclass too
            return base(functools.partial(block, attention_mask=mask), *args)
        return base(block, *args)

    transformer._gradient_checkpointing_func = bound
    try:
        yield
    finally:
        transformer._gradient_checkpointing_func = base


class ChromaAdapter(DiffusionAdapter):
    """Drives a ``ChromaPipeline``; see the module docstring for the exact mapping.

    max_sequence_length: T5 tokens per prompt (the pipeline's default 512).
    """

    #: FLUX.1's targets (the transformer's blocks are FLUX.1's, modulation pruned): attention
    #: and the double blocks' feed-forwards; a bare "proj_out" would also wrap the output layer
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

    def __init__(self, pipe: Any, *, max_sequence_length: int = 512):
        super().__init__(pipe)
        if not 1 <= max_sequence_length <= 512:
            raise ValueError(f"max_sequence_length must be in [1, 512], got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length
        self.num_channels_latents = int(pipe.transformer.config.in_channels) // 4
        self.num_train_timesteps = int(pipe.scheduler.config.num_train_timesteps)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """embeds [B, max_sequence_length, D]; the transformer's text mask [B, L] as
        ``pooled`` (1.0: real tokens and the first padding token)."""
        embeds, _, mask, *_ = self.pipe.encode_prompt(
            prompt=list(prompts),
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return PromptEmbeds(embeds, None, mask)

    @classmethod
    def size_rule(cls, config: Callable[[str], dict]) -> SizeRule:
        """Multiples of VAE factor x 2 (16): the latents are packed 2x2, as FLUX.1's."""
        f = vae_scale(config("vae"))
        return SizeRule("Chroma", (2 * f, 2 * f), f"VAE {f} x 2x2 packing")

    def _check_size(self, height: int, width: int) -> None:
        rule = self.size_rule(lambda name: dict(getattr(self.pipe, name).config))
        check_size(rule, height, width, None)

    def schedule(self, num_steps: int, height: int, width: int) -> Schedule:
        """linspace(1, 1/N, N) sigmas with the pipeline's dynamic shift (on a scheduler copy)."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self._check_size(height, width)
        f = self.pipe.vae_scale_factor * 2
        tokens = (int(height) // f) * (int(width) // f)
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        return self.shifted_schedule(num_steps, sigmas, image_seq_len=tokens)

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
        if embeds.pooled is None:
            raise ValueError("Chroma prompt embeddings lack the text mask (PromptEmbeds.pooled)")
        dtype = param_dtype(transformer)
        device, batch = latents.device, latents.shape[0]
        f = self.pipe.vae_scale_factor * 2
        h, w = int(height) // f, int(width) // f
        img_ids = self.pipe._prepare_latent_image_ids(batch, h, w, device, latents.dtype)
        text_ids = torch.zeros(embeds.embeds.shape[1], 3, device=device, dtype=embeds.embeds.dtype)
        mask = torch.cat([embeds.pooled.to(dtype), latents.new_ones(batch, h * w, dtype=dtype)], 1)
        t = sigma.to(device=device, dtype=torch.float32) * self.num_train_timesteps
        with masked_checkpointing(transformer, mask):
            return transformer(
                hidden_states=latents.to(dtype),
                timestep=t.to(latents.dtype) / 1000,
                encoder_hidden_states=embeds.embeds.to(dtype),
                txt_ids=text_ids,
                img_ids=img_ids,
                attention_mask=mask,
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


__all__ = ["ChromaAdapter"]
