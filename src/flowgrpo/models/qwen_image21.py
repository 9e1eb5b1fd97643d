"""Qwen-Image 2.1 (diffusers ``QwenImage21Pipeline``): a Qwen-Image adapter with 2.1's pieces.

Mirrors ``QwenImage21Pipeline.__call__`` of diffusers 0.42.1 (text-to-image) piece by piece;
what differs from Qwen-Image (``qwen_image.py``, subclassed for the rest):

- prompts: a raw Qwen3-VL template (system "Comprehend and analyze the provided prompt."),
  left-padded tokens, the last decoder layer's hidden states before the final norm, the system
  turn dropped; the pipeline's ``encode_prompt`` does all of it. No ``max_sequence_length``.
- latents are unpatched: [B, h w, C] with h = 2 (H // 32), w = 2 (W // 32), C = the VAE's
  ``z_dim`` (64); each of the text encoder's image slots stands for 2x2 latent tokens.
- schedule: the pipeline's ``sample_sigmas`` when its length is the step count, else
  linspace(1, 1/N, N); ``mu = calculate_shift(h w, scheduler config)`` (every latent token,
  not Qwen-Image's 2x2 patches).
- the transformer (single stream, block-causal) gets ``timestep / 1000``, ``img_shapes``
  [(1, h, w)], ``img_mask`` (text slots False, then h w / 4 image slots True) and returns the
  joint sequence, of which the last h w tokens are the velocity.
- guidance: plain true CFG, ``v_u + g (v_c - v_u)`` (no norm rescale); off by default
  (``true_cfg_scale=1``: the model is meant to be sampled without guidance).
- the VAE is RGBA (4 channels); ``decode`` returns RGB (the alpha channel is dropped).

Text padding moves the image: the rotary frame position of the target image is the length
of the (padded) text before it, so the stock pipeline's rows depend on the batch's longest
prompt. ``forward`` runs each group of equal-length prompts unpadded (as the pipeline run on
those prompts alone): batch invariant, and equal to the stock pipeline whenever its batch
has no padding (tests/models/test_qwen_image21.py).
"""

from __future__ import annotations

import copy
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
    param_dtype,
)
from flowgrpo.models.qwen_image import QwenImageAdapter


class QwenImage21Adapter(QwenImageAdapter):
    """Adapter for ``diffusers.QwenImage21Pipeline`` (text-to-image)."""

    lora_target_modules = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "img_mlp.proj",
        "img_mlp.gate_layer",
        "img_mlp.out",
    )
    batch_cfg = True  # ``forward`` groups rows by text length, so any batch is exact
    sequence_parallel = None  # no diffusers ``_cp_plan`` for the block-causal transformer
    default_negative_prompt = " "  # the pipeline encodes "" as " " anyway

    def __init__(self, pipe: Any):
        DiffusionAdapter.__init__(self, pipe)

    # -- text ---------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Qwen3-VL hidden states -> embeds [B, L, D] and mask [B, L] (long, left-aligned)."""
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        device = next(self.pipe.text_encoder.parameters()).device
        embeds, mask, _ = self.pipe.encode_prompt(list(prompts), device=device)
        if mask is None:  # the pipeline drops an all-ones mask; keep it so batches can be padded
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return PromptEmbeds(embeds.to(self.device), mask.to(self.device), None)

    # -- schedule and latents -----------------------------------------------------------------
    @classmethod
    def prompt_tokens(cls, max_sequence_length: int | None) -> tuple[int, int]:
        """Qwen3-VL hidden states: ~512 tokens planned (no truncation), 4096 wide."""
        return max_sequence_length or 512, 4096

    @classmethod
    def token_counts(
        cls, configs: dict[str, Any], height: int, width: int, options: dict[str, Any]
    ) -> TokenCounts:
        """A single-stream transformer on the joint sequence text + h w latent tokens (the
        text's image slots expand into the latents): every block's Linears see all of them, so
        the planner counts them as one sequence (``image``; ``text`` 0). Latents unpatched,
        h = H / 16, ``z_dim`` channels."""
        vae = configs.get("vae", {})
        f = int(vae.get("scale_factor_spatial", 16))
        channels = int(vae.get("z_dim", 64))
        prompt = cls.prompt_tokens(options.get("max_sequence_length"))
        tokens = (height // f) * (width // f)
        return TokenCounts(tokens + prompt[0], 0, channels * tokens, prompt)

    @classmethod
    def size_rule(cls, config: Callable[[str], dict]) -> SizeRule:
        """Multiples of 32: the VAE's x16 and the 2x2 latent groups of an image slot."""
        return SizeRule("Qwen-Image 2.1", (32, 32), "VAE 16 x 2x2 image slots")

    def schedule(self, num_steps: int, height: int, width: int) -> Schedule:
        """sigmas [N+1] (final 0 included) and timesteps [N], exactly as the pipeline."""
        from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import (
            calculate_shift,
            retrieve_timesteps,
        )

        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self._check_size(height, width)
        lh, lw = self._latent_hw(height, width)
        scheduler = copy.deepcopy(self.pipe.scheduler)  # leave the pipeline's state alone
        cfg = scheduler.config
        mu = calculate_shift(
            lh * lw,
            cfg.get("base_image_seq_len", 256),
            cfg.get("max_image_seq_len", 4096),
            cfg.get("base_shift", 0.5),
            cfg.get("max_shift", 1.15),
        )
        sigmas = self.pipe.config.get("sample_sigmas")
        if sigmas is None or len(sigmas) != num_steps:
            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        timesteps, _ = retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
        return Schedule(scheduler.sigmas.float().cpu(), timesteps.float().cpu())

    def prepare_latents(
        self,
        batch_size: int,
        height: int,
        width: int,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """Noise [B, h w, C] drawn as the pipeline draws it (same generator use), fp32,
        contiguous."""
        self._check_size(height, width)
        latents, _ = self.pipe.prepare_latents(
            None,
            batch_size,
            self.transformer.config.in_channels,
            height,
            width,
            torch.float32,
            self.device,
            generator,
        )
        # the pipeline's packing is a transposed view: a contiguous copy (same values), so that
        # the rollout's log-prob reductions run in the layout of the stored trajectory
        return latents.contiguous()

    # -- the model ----------------------------------------------------------------------------
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
        """Transformer calls on latents [B, S, C] at sigma [B] -> velocity [B, S, C]: one per
        text length, each on its rows' unpadded text (no mask, as the pipeline)."""
        lh, lw = self._latent_hw(height, width)
        batch, seq = latents.shape[:2]
        if len(embeds) != batch:
            raise ValueError(f"{len(embeds)} prompt embeddings for a batch of {batch} latents")
        dtype = param_dtype(transformer)
        # sigma * 1000 cast to the latents' dtype, then / 1000, as the pipeline's timestep
        t = (sigma.float() * self.pipe.scheduler.config.num_train_timesteps).to(dtype)
        text = embeds.embeds.to(dtype)
        full = text.shape[1]
        lengths = embeds.mask.sum(1) if embeds.mask is not None else torch.full([batch], full)
        out: torch.Tensor | None = None
        for n in sorted({int(x) for x in lengths.tolist()}):
            rows = (lengths == n).nonzero().flatten().to(latents.device)
            every = len(rows) == batch
            img_mask = torch.cat(
                [
                    torch.zeros(len(rows), n, dtype=torch.bool, device=latents.device),
                    torch.ones(len(rows), seq // 4, dtype=torch.bool, device=latents.device),
                ],
                dim=1,
            )
            v = transformer(
                hidden_states=(latents if every else latents[rows]).to(dtype),
                timestep=(t if every else t[rows]) / 1000,
                encoder_hidden_states=(text if every else text[rows])[:, :n],
                encoder_hidden_states_mask=None,
                img_shapes=[[(1, lh, lw)]] * len(rows),
                img_mask=img_mask,
                return_dict=False,
            )[0][:, -seq:]
            if every:
                return v
            if out is None:
                out = v.new_zeros(batch, *v.shape[1:])
            out = out.index_copy(0, rows, v)
        assert out is not None
        return out

    def guide(
        self, v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float
    ) -> torch.Tensor:
        """Plain true CFG, as the 2.1 pipeline (no per-token norm rescale)."""
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Latents -> RGB images [B, 3, H, W] fp32 in [0, 1] on CPU (the VAE's alpha dropped)."""
        return super().decode(latents, height, width)[:, :3]


__all__ = ["QwenImage21Adapter"]
