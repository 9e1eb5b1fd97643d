"""FLUX.2: diffusers' ``Flux2Pipeline`` (FLUX.2-dev) and ``Flux2KleinPipeline`` (klein 4B/9B).

Mirrors ``Flux2Pipeline.__call__`` / ``Flux2KleinPipeline.__call__`` of diffusers 0.42.1:

- prompts: ``pipe.encode_prompt``: the chat-templated prompt (dev: Mistral-3 with the FLUX.2
  system message; klein: Qwen3, thinking off) padded to ``max_sequence_length``, the hidden
  states of three layers stacked per token -> [B, L, 3 D]; the transformer gets no text mask;
  text position ids (t, h, w, l) = (0, 0, 0, 0..L-1) (``_prepare_text_ids``);
- latents: the layout the pipelines take as ``latents=``, 2x2-patchified [B, 4C, h/2, w/2];
  the transformer gets them packed to [B, (h/2)(w/2), 4C] (``_pack_latents``) with position ids
  (0, i, j, 0) (``_prepare_latent_ids``), its output unpacked back (both exact reshapes);
- schedule: sigmas = linspace(1, 1/N, N), shifted with the empirical
  ``mu = compute_empirical_mu(image tokens, N)`` (it depends on the step count, not only on the
  size: FLUX.2's own fit, not the scheduler config's base/max shift);
- transformer input: ``timestep = t / 1000`` (t = 1000 sigma cast to the latents' dtype);
- guidance: dev feeds ``guidance_scale`` to its distilled guidance embedding (one forward, no
  negative branch); klein has no embedding (``guidance=None``): the undistilled base runs true
  CFG ``v_neg + g (v_pos - v_neg)`` with the empty negative prompt when ``guidance_scale > 1``;
  the step-distilled klein (``is_distilled``) ignores ``guidance_scale``;
- decoding: unpack, de-normalize with the VAE's batch-norm statistics, unpatchify, decode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from flowgrpo.models.base import (
    DiffusionAdapter,
    PromptEmbeds,
    Schedule,
    SizeRule,
    TokenCounts,
    check_size,
    param_dtype,
    vae_scale,
)
from flowgrpo.models.parallel import SequenceParallelSpec


class Flux2SequenceParallel(SequenceParallelSpec):
    """FLUX.2 under Ulysses SP: diffusers' ``_cp_plan`` (text, image and both position ids
    split along the sequence) and processors. The pipelines pad every prompt to
    ``max_sequence_length`` and pass no text mask, so text is never padded here: the length
    must divide by sp (512, the default, does for sp in 1, 2, 4, 8)."""

    name = "flux2"
    transformer_class = "Flux2Transformer2DModel"

    def pad_text(self, kwargs: dict[str, Any], pad: int) -> dict[str, Any]:
        """Refused: the FLUX.2 processors take no key mask for padded text."""
        n = kwargs["encoder_hidden_states"].shape[1]
        raise ValueError(
            f"FLUX.2 under sequence parallelism: {n} text tokens do not split over the SP "
            f"degree; choose model.max_sequence_length a multiple of it ({n + pad} would do)"
        )


class Flux2Adapter(DiffusionAdapter):
    """Drives a ``Flux2Pipeline`` (FLUX.2-dev); see the module docstring for the mapping.

    max_sequence_length: text tokens per prompt, system message included (the pipeline's 512).
    """

    #: Flow-Factory's FLUX.2 targets (src/flow_factory/models/flux/flux2.py
    #: ``default_target_modules`` @ a0b2bc5): the double blocks' attention and SwiGLU
    #: feed-forwards, and the single blocks' fused QKV + MLP input projection. Their list also
    #: names "attn.to_out.0" for the single blocks, whose output layer is a bare ``attn.to_out``
    #: (a suffix that would also name the double blocks' ModuleList): not trained, as theirs.
    lora_target_modules = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.linear_in",
        "ff.linear_out",
        "ff_context.linear_in",
        "ff_context.linear_out",
        "attn.to_qkv_mlp_proj",
    )
    batch_cfg = True
    sequence_parallel = Flux2SequenceParallel()
    #: the text width of the real models: 3 stacked Mistral-Small-3.1 layers of 5120
    text_width = 15360

    def __init__(self, pipe: Any, *, max_sequence_length: int = 512):
        super().__init__(pipe)
        if not 1 <= max_sequence_length <= 512:
            raise ValueError(f"max_sequence_length must be in [1, 512], got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length
        cfg = pipe.transformer.config
        self.num_channels_latents = int(cfg.in_channels) // 4
        self.guidance_embeds = bool(cfg.guidance_embeds)
        self.num_train_timesteps = int(pipe.scheduler.config.num_train_timesteps)

    # -- guidance: the distilled scale is an embedding, never a second branch -----------------
    def uses_cfg(self, guidance_scale: float) -> bool:
        """FLUX.2-dev runs one forward: ``guidance_scale`` is its guidance embedding's input."""
        return False

    @classmethod
    def plans_cfg(cls, guidance_scale: float, options: dict[str, Any]) -> bool:
        """No negative branch (see ``uses_cfg``)."""
        return False

    # -- text ---------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """embeds [B, max_sequence_length, 3 D] (three stacked encoder layers); no mask."""
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        embeds, _ = self.pipe.encode_prompt(
            prompt=list(prompts), device=self.device, max_sequence_length=self.max_sequence_length
        )
        return PromptEmbeds(embeds.to(self.device), None, None)

    @classmethod
    def prompt_tokens(cls, max_sequence_length: int | None) -> tuple[int, int]:
        """512 tokens by default, ``text_width`` wide."""
        return max_sequence_length or 512, cls.text_width

    @classmethod
    def token_counts(
        cls, configs: dict[str, Any], height: int, width: int, options: dict[str, Any]
    ) -> TokenCounts:
        """The base rule (2x2-patchified latents, joint text), the prompt's width read off the
        transformer's ``joint_attention_dim`` (3 stacked text-encoder layers: dev 15360, klein
        4B 7680, klein 9B 12288) instead of ``text_width``."""
        counts = super().token_counts(configs, height, width, options)
        text_width = int(configs.get("transformer", {}).get("joint_attention_dim", cls.text_width))
        return dataclasses.replace(counts, prompt=(counts.prompt[0], text_width))

    # -- sizes, schedule, latents ---------------------------------------------------------------
    @classmethod
    def size_rule(cls, config: Callable[[str], dict]) -> SizeRule:
        """Multiples of VAE factor x 2 (16): the latents are patchified 2x2. The pipeline would
        round other sizes down with a warning; the adapter refuses instead."""
        f = vae_scale(config("vae"))
        return SizeRule("FLUX.2", (2 * f, 2 * f), f"VAE {f} x 2x2 patches")

    def _check_size(self, height: int, width: int) -> None:
        rule = self.size_rule(lambda name: dict(getattr(self.pipe, name).config))
        check_size(rule, height, width, None)

    def _tokens_hw(self, height: int, width: int) -> tuple[int, int]:
        """Patchified latent (h/2, w/2): the transformer's token grid."""
        f = self.pipe.vae_scale_factor * 2
        return int(height) // f, int(width) // f

    def schedule(self, num_steps: int, height: int, width: int) -> Schedule:
        """linspace(1, 1/N, N) sigmas shifted with the empirical mu (on a scheduler copy)."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self._check_size(height, width)
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if self.pipe.scheduler.config.get("use_flow_sigmas", False):
            sigmas = None
        th, tw = self._tokens_hw(height, width)
        mu = compute_empirical_mu(image_seq_len=th * tw, num_steps=num_steps)
        return self.shifted_schedule(num_steps, sigmas, mu=mu)

    def prepare_latents(
        self,
        batch_size: int,
        height: int,
        width: int,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """Noise [B, 4C, h/2, w/2] drawn by the pipeline's own ``prepare_latents`` (which
        returns it packed: unpacked here, the layout its ``latents=`` takes)."""
        self._check_size(height, width)
        packed, _ = self.pipe.prepare_latents(
            batch_size,
            self.num_channels_latents,
            height,
            width,
            torch.float32,  # trajectories are fp32 whatever the weights' dtype
            self.device,
            generator,
        )
        return self._unpack(packed, height, width)

    def _unpack(self, packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """[B, (h/2)(w/2), 4C] -> [B, 4C, h/2, w/2]: the inverse of ``_pack_latents``."""
        th, tw = self._tokens_hw(height, width)
        return packed.permute(0, 2, 1).reshape(packed.shape[0], -1, th, tw)

    def _latent_ids(self, batch: int, height: int, width: int, device) -> torch.Tensor:
        """Position ids [B, (h/2)(w/2), 4] as the pipeline builds them."""
        th, tw = self._tokens_hw(height, width)
        grid = torch.empty(batch, 0, th, tw)  # only its shape is read
        return self.pipe._prepare_latent_ids(grid).to(device)

    # -- the model ----------------------------------------------------------------------------
    def _guidance(self, batch: int, guidance_scale: float, device) -> torch.Tensor | None:
        """dev: the guidance embedding's input [B] (fp32, as the pipeline's)."""
        if not self.guidance_embeds:
            return None
        return torch.full([batch], float(guidance_scale), device=device, dtype=torch.float32)

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
        """Raw velocity [B, 4C, h/2, w/2]; the transformer sees the packed tokens and
        timestep = t / 1000, t = 1000 sigma."""
        dtype = param_dtype(transformer)
        device, batch = latents.device, latents.shape[0]
        if len(embeds) != batch:
            raise ValueError(f"{len(embeds)} prompt embeddings for a batch of {batch} latents")
        t = sigma.to(device=device, dtype=torch.float32) * self.num_train_timesteps
        text = embeds.embeds.to(dtype)
        tokens = self.pipe._pack_latents(latents)
        out = transformer(
            hidden_states=tokens.to(dtype),
            timestep=t.to(latents.dtype) / 1000,
            guidance=self._guidance(batch, guidance_scale, device),
            encoder_hidden_states=text,
            txt_ids=self.pipe._prepare_text_ids(text).to(device),
            img_ids=self._latent_ids(batch, height, width, device),
            return_dict=False,
        )[0]
        return self._unpack(out[:, : tokens.shape[1]], height, width)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Latents [B, 4C, h/2, w/2] -> images [B, 3, H, W] fp32 in [0, 1] on CPU."""
        vae = self.pipe.vae
        z = latents
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        z = self.pipe._unpatchify_latents(z * std.to(z.device, z.dtype) + mean)
        image = vae.decode(z.to(vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1).cpu()


class Flux2KleinAdapter(Flux2Adapter):
    """Drives a ``Flux2KleinPipeline`` (FLUX.2-klein 4B/9B, base or step-distilled).

    No guidance embedding. The base models (``is_distilled`` False) run true CFG with the empty
    negative prompt when ``guidance_scale > 1``, positive and negative as one doubled batch
    (the pipeline runs two calls: every op but attention is per token, and the text needs no
    mask since both are padded to ``max_sequence_length``). The distilled models ignore
    ``guidance_scale`` (one forward), as the pipeline does.
    """

    #: the text width of klein 9B: 3 stacked Qwen3-8B layers of 4096 (4B: 3 x 2560)
    text_width = 12288

    def __init__(self, pipe: Any, *, max_sequence_length: int = 512):
        super().__init__(pipe, max_sequence_length=max_sequence_length)
        self.is_distilled = bool(pipe.config.get("is_distilled", False))

    def uses_cfg(self, guidance_scale: float) -> bool:
        """True CFG when ``guidance_scale > 1``, except for the step-distilled models."""
        return guidance_scale > 1.0 and not self.is_distilled

    @classmethod
    def plans_cfg(cls, guidance_scale: float, options: dict[str, Any]) -> bool:
        """The base models' CFG (the planner does not read ``is_distilled``: an upper bound)."""
        return guidance_scale > 1.0


__all__ = ["Flux2Adapter", "Flux2KleinAdapter"]
