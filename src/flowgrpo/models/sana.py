"""Adapter for diffusers' ``SanaPipeline`` (SANA 1.0 / 1.5: a linear-attention DiT with
cross-attention to Gemma-2 text, the 32x DC-AE, Flow-DPM-Solver).

Mirrors ``SanaPipeline.__call__`` of diffusers 0.42.1 piece by piece:

- prompts: ``pipe.encode_prompt`` with the call's default ``complex_human_instruction`` (CHI,
  read from the ``__call__`` signature) prepended: Gemma-2 hidden states padded (right) to the
  CHI's tokens + ``max_sequence_length`` - 2, then the first token and the last
  ``max_sequence_length`` - 1 kept: [B, max_sequence_length, D] with the tokenizer's mask.
  The negative prompt (default "") is encoded WITHOUT the CHI and not re-indexed (the
  pipeline's ``encode_prompt``), hence ``encode`` below. The text is never trimmed: the mask
  travels in ``PromptEmbeds.pooled`` (``mask`` stays None) and the transformer gets it as
  ``encoder_attention_mask`` (a -10000 bias on the padding, as the pipeline passes it);
- schedule: ``set_timesteps(N)`` on a copy of the pipeline's scheduler (DPM-Solver++ 2M with
  flow sigmas, shift 3: sigmas = shift s / (1 + (shift - 1) s) over linspace, then 0). Its
  timesteps are ``int64(sigma * 1000)`` computed in fp64 (truncated: 0.8568 -> 856), and the
  transformer gets them so. ``forward`` only receives the fp32 sigma, so the adapter keeps the
  timestep of every sigma its schedules produced and truncates sigma * 1000 for any other
  (an algorithm's own times);
- latents [B, 32, H/32, W/32] fp32 from the pipeline's ``prepare_latents``; H and W multiples
  of 32 (``check_inputs``). ``use_resolution_binning`` (the call's default) would map the size
  to its aspect-ratio bin; flowgrpo generates the configured size, the call with binning off;
- transformer call: latents and text in the transformer's dtype, ``timestep * timestep_scale``,
  output fp32 (the first half of the channels for a learned-sigma model, none shipped);
- guidance ``v_u + g (v_c - v_u)`` for g > 1; the pipeline runs one doubled batch, as here;
- decode: ``vae.decode(latents / scaling_factor)`` (DC-AE has no shift) -> [0, 1].

The stock scheduler is DPM-Solver++ 2M, the sampler's ``ode_solver="dpm2"``: a noise-0 rollout
with it equals the pipeline (the conformance check runs it so). The SDE steps of training are
the sampler's own, on the same sigmas.

Limits: no sequence parallelism (diffusers ships no context-parallel plan for
``SanaTransformer2DModel``; ``sequence_parallel`` None: ``fsdp.sp_degree`` > 1 is refused);
SANA-Sprint (``SanaSprintPipeline``, SCM scheduler) and the ControlNet/PAG pipelines are not
driven.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from flowgrpo.models.base import (
    DiffusionAdapter,
    PromptEmbeds,
    Schedule,
    SizeRule,
    TokenCounts,
    check_size,
    param_dtype,
)


def dc_ae_scale(vae_config: dict) -> int:
    """The pipeline's ``vae_scale_factor``: 2^(levels - 1) of the DC-AE's encoder (32 for the
    shipped ones); 32 without a config."""
    blocks = vae_config.get("encoder_block_out_channels")
    return 2 ** (len(blocks) - 1) if blocks else 32


class SanaAdapter(DiffusionAdapter):
    """Drives a ``SanaPipeline``; see the module docstring for the exact mapping.

    max_sequence_length: Gemma-2 tokens per prompt after the CHI (the pipeline's default 300).
    """

    #: attention of every block: the linear self-attention (attn1) and the cross-attention
    #: (attn2); the feed-forward (GLUMBConv) is convolutions, which LoRA here does not target
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")

    def __init__(self, pipe: Any, *, max_sequence_length: int = 300):
        super().__init__(pipe)
        if max_sequence_length < 2:
            raise ValueError(f"max_sequence_length must be >= 2, got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length
        if getattr(pipe, "tokenizer", None) is not None:  # what every encode_prompt sets: now,
            pipe.tokenizer.padding_side = "right"  # so that the prompt cache's key is stable
        call = inspect.signature(type(pipe).__call__).parameters
        self.complex_human_instruction = list(call["complex_human_instruction"].default or [])
        self.num_train_timesteps = int(pipe.scheduler.config.num_train_timesteps)
        #: {fp32 sigma: the scheduler's timestep} of every schedule made (module docstring)
        self._timesteps: dict[float, float] = {}

    @classmethod
    def prompt_tokens(cls, max_sequence_length: int | None) -> tuple[int, int]:
        """(max_sequence_length, Gemma-2 2B's width 2304)."""
        return max_sequence_length or 300, 2304

    @classmethod
    def token_counts(
        cls, configs: dict[str, Any], height: int, width: int, options: dict[str, Any]
    ) -> TokenCounts:
        """Image tokens of the DC-AE's latents (patch 1); the text is cross-attended."""
        vae = configs.get("vae", {})
        f, channels = dc_ae_scale(vae), int(vae.get("latent_channels", 32))
        patch = int(configs.get("transformer", {}).get("patch_size", 1))
        image = (height // (f * patch)) * (width // (f * patch))
        latent = channels * (height // f) * (width // f)
        return TokenCounts(image, 0, latent, cls.prompt_tokens(options.get("max_sequence_length")))

    def _encode(self, prompts: list[str], chi: bool) -> PromptEmbeds:
        embeds, mask, *_ = self.pipe.encode_prompt(
            list(prompts),
            do_classifier_free_guidance=False,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
            complex_human_instruction=self.complex_human_instruction if chi else None,
        )
        return PromptEmbeds(embeds, None, mask)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """embeds [B, max_sequence_length, D] with the CHI; the text mask [B, L] as ``pooled``."""
        return self._encode(prompts, chi=True)

    @torch.no_grad()
    def encode_negative(self, prompts: list[str]) -> PromptEmbeds:
        """The negative prompts as the pipeline encodes them: without the CHI."""
        return self._encode(prompts, chi=False)

    def encode(
        self,
        prompts: list[str],
        negative_prompts: list[str] | None = None,
        *,
        guidance_scale: float = 1.0,
        images: list[list[torch.Tensor]] | None = None,
    ) -> tuple[PromptEmbeds, PromptEmbeds | None]:
        """The base ``encode`` for the prompts (and its prompt cache); the negatives without
        the CHI (``encode_negative``), as the pipeline."""
        embeds, _ = super().encode(prompts, None, guidance_scale=1.0, images=images)
        if not self.uses_cfg(guidance_scale):
            return embeds, None
        if negative_prompts is None:
            negative_prompts = [self.default_negative_prompt] * len(prompts)
        if len(negative_prompts) != len(prompts):
            raise ValueError(
                f"got {len(negative_prompts)} negative prompts for {len(prompts)} prompts"
            )
        return embeds, self.encode_negative(list(negative_prompts))

    @classmethod
    def size_rule(cls, config: Callable[[str], dict]) -> SizeRule:
        """Multiples of 32: the pipeline's ``check_inputs`` (the DC-AE's 32 x patch 1)."""
        return SizeRule("SANA", (32, 32), "the pipeline's check_inputs; DC-AE 32 x patch 1")

    def _check_size(self, height: int, width: int) -> None:
        rule = self.size_rule(lambda name: dict(getattr(self.pipe, name).config))
        check_size(rule, height, width, None)

    def schedule(self, num_steps: int, height: int, width: int) -> Schedule:
        """sigmas [N+1] (final 0) and the scheduler's integer timesteps [N], exactly as the
        pipeline (``set_timesteps(N)`` on a copy); each sigma's timestep kept for ``forward``."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self._check_size(height, width)
        schedule = self.scheduler_schedule(num_steps)
        for s, t in zip(schedule.sigmas[:-1].tolist(), schedule.timesteps.tolist()):
            self._timesteps[s] = t
        return schedule

    def timesteps_of(self, sigma: torch.Tensor) -> torch.Tensor:
        """The transformer's timestep [B] fp32 for fp32 sigmas [B]: the scheduler's (a schedule's
        sigma), else ``floor(sigma * 1000)`` as the scheduler truncates."""
        n = self.num_train_timesteps
        values = [
            self._timesteps.get(s, float(math.floor(s * n)))
            for s in sigma.detach().float().cpu().tolist()
        ]
        return torch.tensor(values, dtype=torch.float32, device=sigma.device)

    def prepare_latents(
        self,
        batch_size: int,
        height: int,
        width: int,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """Noise [B, C, H/32, W/32] drawn by the pipeline's own ``prepare_latents``."""
        self._check_size(height, width)
        return self.pipe.prepare_latents(
            batch_size,
            int(self.pipe.transformer.config.in_channels),
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
        """Raw velocity [B, C, h, w]; timestep = the scheduler's integer t x timestep_scale."""
        if embeds.pooled is None:
            raise ValueError("SANA prompt embeddings lack the text mask (PromptEmbeds.pooled)")
        dtype = param_dtype(transformer)
        config = transformer.config
        t = self.timesteps_of(sigma.to(latents.device)) * config.timestep_scale
        out = transformer(
            latents.to(dtype),
            encoder_hidden_states=embeds.embeds.to(dtype),
            encoder_attention_mask=embeds.pooled,
            timestep=t,
            return_dict=False,
        )[0]
        if config.out_channels // 2 == config.in_channels:  # a learned-sigma model
            out = out.chunk(2, dim=1)[0]
        return out

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Latents -> images [B, 3, H, W] fp32 in [0, 1] on CPU."""
        vae = self.pipe.vae
        image = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1).cpu()


__all__ = ["SanaAdapter", "dc_ae_scale"]
