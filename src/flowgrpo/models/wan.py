"""Adapter for diffusers' ``WanPipeline``: Wan2.1 and Wan2.2 text-to-video.

Mirrors ``WanPipeline.__call__`` of diffusers 0.42.1 piece by piece:

- prompts: ``pipe._get_t5_prompt_embeds`` (``prompt_clean``, UMT5 with the tokenizer's mask,
  each row cut to its tokens and zero-padded) at ``max_sequence_length`` 512, the call's default
  (``encode_prompt`` alone defaults to 226). The transformer gets no text mask: the zero rows
  are cross-attention keys, so the padded length L is part of the model input. Embeddings are
  stored trimmed to the batch's longest prompt with a mask, and ``forward`` zero-pads them back
  to exactly L (bit-identical to the pipeline's). Negative prompt ``""`` (``negative_prompt or
  ""``); CFG is on iff ``guidance_scale > 1``, whatever ``guidance_scale_2`` is.
- schedule: ``set_timesteps(N)`` on a copy of the pipeline's scheduler, which must be
  ``FlowMatchEulerDiscreteScheduler`` (static shift = Wan's ``flow_shift``). The hub repos ship
  UniPC, a 2nd-order multistep solver that no Euler/SDE step reproduces: it is refused here, and
  ``load_pipeline`` swaps it for the Euler scheduler with the same shift (``use_flow_match``).
- latents [B, C, (F - 1)/4 + 1, H/8, W/8] fp32 from ``pipe.prepare_latents``. F = 4k + 1 and
  H, W multiples of 16 are checked (the pipeline would round F and H, W silently).
- transformer call: latents and text in the transformer's dtype (``compute_dtype``: parameters
  outside ``_keep_in_fp32_modules``), ``timestep = sigma * 1000`` in fp32
  (the scheduler's timesteps, not cast); one per video token [B, S] when ``expand_timesteps``.
- guidance ``v_u + g (v_c - v_u)``. Wan2.2-A14B: ``transformer`` (high noise) where
  ``timestep >= boundary_ratio * 1000`` with ``guidance_scale``, else ``transformer_2`` with
  ``guidance_scale_2`` (default: ``guidance_scale``), decided per sample (``WanExperts``).
- decode: ``latents / (1 / latents_std) + latents_mean`` (the pipeline's form), ``vae.decode``
  -> videos [B, 3, F, H, W], ``(x / 2 + 0.5).clamp(0, 1)``. The pipeline's ``output_type="pt"``
  permutes to [B, F, 3, H, W]; flowgrpo keeps the VAE's [B, C, F, H, W].
Image-to-video (``WanImageToVideoPipeline``) is not supported.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flowgrpo.models.base import (
    DiffusionAdapter,
    PromptEmbeds,
    Schedule,
    SizeRule,
    TokenCounts,
    planner_vae,
)
from flowgrpo.settings import ge, optional, setting


@dataclass
class WanSettings:
    """Wan's own settings, the config section ``wan`` (its size, ``model.num_frames``, is
    shared with the other video families)."""

    guidance_scale_2: float | None = setting(
        None,
        "Wan2.2 (two experts): CFG scale of the low-noise expert; null = `sample.guidance_scale`.",
        check=optional(ge(0)),
    )


#: ``wan_experts``'s names, re-exported here and imported when first asked for: that module
#: imports diffusers, which reading the config (``WanSettings``) must not
_FROM_EXPERTS = ("WanExperts", "compute_dtype")


def __getattr__(name: str) -> Any:
    """A name of ``_FROM_EXPERTS``, from ``wan_experts`` on first use."""
    if name in _FROM_EXPERTS:
        from flowgrpo.models import wan_experts

        return getattr(wan_experts, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def use_flow_match(pipe: Any) -> Any:
    """Give a Wan pipeline ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)`` in place of the
    UniPC flow scheduler the hub repos ship (diffusers' documented alternative for Wan; the same
    shifted flow ODE integrated by Euler steps, on FlowMatch's grid). Returns ``pipe``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = pipe.scheduler
    if isinstance(sched, FlowMatchEulerDiscreteScheduler):
        return pipe
    cfg = sched.config
    flow = cfg.get("use_flow_sigmas", False) and cfg.get("prediction_type") == "flow_prediction"
    if not flow or cfg.get("use_dynamic_shifting", False):
        raise ValueError(
            f"cannot convert {type(sched).__name__} (use_flow_sigmas={cfg.get('use_flow_sigmas')}"
            f", prediction_type={cfg.get('prediction_type')!r}) to a flow-matching Euler scheduler"
        )
    shift = float(cfg.get("flow_shift", 1.0))
    warnings.warn(
        f"Wan: replacing the pipeline's {type(sched).__name__} (flow_shift={shift}) with "
        f"FlowMatchEulerDiscreteScheduler(shift={shift}): rollouts are Euler/SDE steps",
        stacklevel=2,
    )
    n = int(cfg.get("num_train_timesteps", 1000))
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=n, shift=shift)
    return pipe


class WanAdapter(DiffusionAdapter):
    """Drives a ``WanPipeline``; see the module docstring for the exact mapping.

    num_frames: default frames per video (the pipeline's 81); ``sample_trajectories(...,
    num_frames=F)`` overrides it. max_sequence_length: the padded text length L (512 as
    ``__call__``). guidance_scale_2: Wan2.2's low-noise guidance (None: ``guidance_scale``).
    """

    # Flow-Factory's Wan default (attn1 + attn2 projections and the FFN, every block); flow_grpo's
    # Wan script targets the four attention names only (to_q, to_k, to_v, to_out.0).
    lora_target_modules = tuple(
        [f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")]
        + ["ffn.net.0.proj", "ffn.net.2"]
    )
    batch_cfg = True  # no text mask anywhere: both branches are padded to the same L
    default_negative_prompt = ""  # WanPipeline.encode_prompt: negative_prompt or ""
    settings_class = WanSettings

    def __init__(
        self,
        pipe: Any,
        *,
        num_frames: int = 81,
        max_sequence_length: int = 512,
        guidance_scale_2: float | None = WanSettings.guidance_scale_2,
    ):
        from diffusers import FlowMatchEulerDiscreteScheduler

        super().__init__(pipe)
        if pipe.transformer is None:
            raise ValueError("WanAdapter needs pipe.transformer (the high-noise expert)")
        if not isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
            raise ValueError(
                f"WanAdapter needs FlowMatchEulerDiscreteScheduler, got "
                f"{type(pipe.scheduler).__name__}: an Euler/SDE sampler cannot reproduce it. "
                "Convert with flowgrpo.models.wan.use_flow_match(pipe) (load_pipeline does)"
            )
        if pipe.scheduler.config.get("use_dynamic_shifting", False):
            raise ValueError("WanPipeline passes no mu: use_dynamic_shifting is not supported")
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        self.num_train_timesteps = int(pipe.scheduler.config.num_train_timesteps)
        ratio = pipe.config.get("boundary_ratio", None)
        if ratio is None and guidance_scale_2 is not None:
            raise ValueError("guidance_scale_2 is only supported with a boundary_ratio (Wan2.2)")
        self.boundary_timestep = None if ratio is None else ratio * self.num_train_timesteps
        self._experts = None
        if ratio is not None:
            if pipe.transformer_2 is None:
                raise ValueError("boundary_ratio is set but the pipeline has no transformer_2")
            from flowgrpo.models.wan_experts import WanExperts

            self._experts = WanExperts(pipe.transformer, pipe.transformer_2, self.boundary_timestep)
        self.guidance_scale_2 = guidance_scale_2
        self.max_sequence_length = max_sequence_length
        self.expand_timesteps = bool(pipe.config.get("expand_timesteps", False))
        self.num_frames = self.check_num_frames(num_frames)

    @classmethod
    def trained_components(cls, model_index: dict[str, Any]) -> tuple[str, ...]:
        """Wan2.2 (a ``boundary_ratio``) trains both experts; Wan2.1 its transformer."""
        if model_index.get("boundary_ratio") is None:
            return ("transformer",)
        return ("transformer", "transformer_2")

    @staticmethod
    def prepare_pipeline(pipe: Any) -> Any:
        """What ``load_pipeline`` applies after loading: the Euler scheduler (``use_flow_match``)."""
        return use_flow_match(pipe)

    @property
    def transformer(self) -> torch.nn.Module:
        """Wan2.1: ``pipe.transformer``; Wan2.2: both experts in one ``WanExperts``."""
        return self._experts if self._experts is not None else self.pipe.transformer

    @property
    def dtype(self) -> torch.dtype:
        from flowgrpo.models.wan_experts import compute_dtype

        return compute_dtype(self.transformer)

    # -- sizes ------------------------------------------------------------------------------------
    @classmethod
    def token_counts(
        cls, configs: dict[str, Any], height: int, width: int, options: dict[str, Any]
    ) -> TokenCounts:
        """Video tokens of (frames, h, w) patches over (F - 1)/4 + 1 latent frames (default F
        81); the text is cross-attended (no text tokens in the sequence)."""
        f, channels = planner_vae(configs.get("vae", {}))
        patch = configs["transformer"]["patch_size"]
        frames = options.get("num_frames") or 81
        lat_f = (frames - 1) // 4 + 1
        image = lat_f * (height // (f * patch[1])) * (width // (f * patch[2]))
        latent = channels * lat_f * (height // f) * (width // f)
        prompt = cls.prompt_tokens(options.get("max_sequence_length"))
        return TokenCounts(image, 0, latent, prompt, frames)

    @classmethod
    def size_rule(cls, config: Callable[[str], dict]) -> SizeRule:
        """Sides multiples of lcm(16, VAE x patch); frames t·k + 1 (t: the VAE's temporal
        factor); at most ``rope_max_seq_len`` latent positions per axis (its rotary table)."""
        down = config("vae").get("temperal_downsample", (False, True, True))
        s, t = 2 ** len(down), 2 ** sum(bool(d) for d in down)
        tr = config("transformer")
        pf, ph, pw = tr.get("patch_size", (1, 2, 2))
        rope = int(tr.get("rope_max_seq_len", 1024))
        return SizeRule(
            "Wan",
            (math.lcm(16, s * ph), math.lcm(16, s * pw)),
            f"16 and VAE {s} x patch {ph}",
            max_size=(rope * s * ph, rope * s * pw),
            frame_step=t,
            max_frames=t * (rope * pf - 1) + 1,
        )

    def check_num_frames(self, num_frames: int | None) -> int:
        num_frames = self.num_frames if num_frames is None else num_frames
        t = self.pipe.vae_scale_factor_temporal
        if int(num_frames) != num_frames or num_frames < 1 or (num_frames - 1) % t:
            raise ValueError(f"num_frames must be {t}k + 1 (1, {t + 1}, ...), got {num_frames}")
        return int(num_frames)

    def _check_size(self, height: int, width: int) -> None:
        _, ph, pw = self.pipe.transformer.config.patch_size
        s = self.pipe.vae_scale_factor_spatial
        mh, mw = math.lcm(16, s * ph), math.lcm(16, s * pw)
        if height <= 0 or width <= 0 or height % mh or width % mw:
            raise ValueError(
                f"height and width must be positive multiples of {mh} x {mw} (16 and VAE x patch),"
                f" got {height}x{width}"
            )

    # -- text -------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """embeds [B, n, D] trimmed to the longest prompt (n <= L, </s> included), mask [B, n]."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        L = self.max_sequence_length
        embeds = self.pipe._get_t5_prompt_embeds(
            prompt=list(prompts), max_sequence_length=L, device=self.device
        )
        mask = self.pipe.tokenizer(
            [prompt_clean(p) for p in prompts],
            padding="max_length",
            max_length=L,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        ).attention_mask.long()
        n = int(mask.sum(1).max())
        return PromptEmbeds(embeds[:, :n].contiguous(), mask[:, :n].to(embeds.device), None)

    def padded_embeds(self, embeds: PromptEmbeds) -> torch.Tensor:
        """[B, L, D]: rows past each prompt exact zeros, as ``_get_t5_prompt_embeds`` gives."""
        e = embeds.embeds
        if embeds.mask is not None:
            e = e.masked_fill(embeds.mask[..., None] == 0, 0.0)
        if e.shape[1] > self.max_sequence_length:
            raise ValueError(f"{e.shape[1]} text tokens > max_sequence_length")
        return torch.nn.functional.pad(e, (0, 0, 0, self.max_sequence_length - e.shape[1]))

    # -- schedule and latents -----------------------------------------------------------------------
    def schedule(self, num_steps: int, height: int, width: int) -> Schedule:
        """``scheduler.set_timesteps(N)`` as the pipeline (no sigmas, no mu), on a copy."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self._check_size(height, width)
        return self.scheduler_schedule(num_steps)

    def prepare_latents(
        self,
        batch_size: int,
        height: int,
        width: int,
        generator: torch.Generator | list[torch.Generator] | None = None,
        *,
        num_frames: int | None = None,
    ) -> torch.Tensor:
        """Noise [B, C, F', H/8, W/8] fp32, drawn by the pipeline's ``prepare_latents``."""
        self._check_size(height, width)
        frames = self.check_num_frames(num_frames)
        channels = self.pipe.transformer.config.in_channels
        return self.pipe.prepare_latents(
            batch_size, channels, height, width, frames, torch.float32, self.device, generator
        )

    # -- the model ----------------------------------------------------------------------------------
    def _high_noise(self, sigma: torch.Tensor) -> torch.Tensor:
        """[B] bool: the samples the high-noise expert runs (the pipeline's test, in fp32)."""
        return sigma.float() * self.num_train_timesteps >= self.boundary_timestep

    def guidance_at(self, guidance_scale: float, sigma: torch.Tensor) -> float | torch.Tensor:
        if self.boundary_timestep is None or self.guidance_scale_2 is None:
            return guidance_scale
        g = torch.full(sigma.shape, float(guidance_scale), device=sigma.device)
        return g.masked_fill(~self._high_noise(sigma), float(self.guidance_scale_2))

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
        """One call of the transformer (both experts: routed per sample) -> velocity."""
        batch = latents.shape[0]
        if len(embeds) != batch:
            raise ValueError(f"{len(embeds)} prompt embeddings for a batch of {batch} latents")
        if self.boundary_timestep is not None and not hasattr(transformer, "boundary_timestep"):
            raise ValueError("Wan2.2 has two experts: pass adapter.transformer (WanExperts)")
        from flowgrpo.models.wan_experts import compute_dtype

        dtype = compute_dtype(transformer)
        t = sigma.to(latents.device, torch.float32) * self.num_train_timesteps
        if self.expand_timesteps:  # one timestep per video token (mask[0][0][:, ::2, ::2] * t)
            f, h, w = latents.shape[2:]
            t = t[:, None].expand(batch, f * ((h + 1) // 2) * ((w + 1) // 2))
        return transformer(
            hidden_states=latents.to(dtype),
            timestep=t,
            encoder_hidden_states=self.padded_embeds(embeds).to(dtype),
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """[B, C, F', h, w] latents -> videos [B, 3, F, H, W] fp32 in [0, 1] on CPU."""
        vae = self.pipe.vae
        x = latents.to(next(vae.parameters()).device, vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(x.device, x.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(
            x.device, x.dtype
        )
        video = vae.decode(x / inv_std + mean, return_dict=False)[0]
        return (video.float() / 2 + 0.5).clamp(0, 1).cpu()


__all__ = ["WanAdapter", "WanSettings", "use_flow_match"]
