"""Z-Image and Z-Image-Turbo (diffusers ``ZImagePipeline``): CFG of the form
``v_pos + g (v_pos - v_neg)`` with optional norm clipping and truncation, and a transformer
that predicts the negated velocity at the reversed time ``(1000 - t) / 1000``.

Mirrors ``ZImagePipeline.__call__`` of diffusers 0.42.1 piece by piece:

- prompts: the Qwen3 chat template (one user turn, ``add_generation_prompt``,
  ``enable_thinking=True``), tokenized to ``max_sequence_length`` (512), the text encoder's
  second-to-last hidden states, each prompt's real tokens only (``pipe._encode_prompt``); here
  right-padded with a mask, and unpadded again per sample in ``forward``;
- latents: [B, C, H/8, W/8] (``pipe.prepare_latents``), drawn in fp32; the transformer takes a
  list of [C, 1, h, w] and patchifies 2x2 itself;
- schedule: sigmas = ``torch.linspace(1, 1/N, N)`` (``get_default_z_image_sigmas``) through
  ``retrieve_timesteps`` with ``mu = calculate_shift(image tokens, ...)`` (Z-Image's scheduler
  has a static shift 3, so ``mu`` is ignored there);
- transformer input: ``timestep = (1000 - t) / 1000`` in fp32 with ``t = 1000 sigma``; its output
  negated is the velocity the scheduler's Euler step takes (``noise_pred = -noise_pred``);
- guidance: on when ``guidance_scale > 0`` (not > 1): ``pred = pos + g (pos - neg)``, then with
  ``cfg_normalization`` c > 0 the sample's norm is clipped to c |pos| (norms over the whole
  sample), and with ``cfg_truncation`` <= 1 the scale is 0 (no CFG) at the steps whose
  ``(1000 - t) / 1000`` exceeds it (the pipeline's defaults: c = 0 off, truncation 1.0 never);
- decoding: ``/ scaling_factor + shift_factor``, ``vae.decode``, mapped to [0, 1].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flowgrpo.models.base import (
    DiffusionAdapter,
    PromptEmbeds,
    Schedule,
    SizeRule,
    TokenCounts,
    check_size,
    param_dtype,
    planner_vae,
    vae_scale,
)
from flowgrpo.models.parallel import SequenceParallelSpec
from flowgrpo.settings import ge, setting


@dataclass
class ZImageSettings:
    """Z-Image's own settings, the config section ``zimage``: the pipeline's CFG options."""

    cfg_normalization: float = setting(
        0.0,
        "Z-Image: clip each guided sample's norm to this multiple of the conditional one's (the "
        "pipeline's `cfg_normalization`; 0 = off).",
        check=ge(0, " (0 = off)"),
    )
    cfg_truncation: float = setting(
        1.0,
        "Z-Image: no CFG at the steps whose normalized time (1000 - t)/1000 exceeds this (the "
        "pipeline's `cfg_truncation`; 1 = CFG at every step).",
    )


#: the transformer pads every image and caption to a multiple of this many tokens
#: (diffusers' ``transformer_z_image.SEQ_MULTI_OF``)
Z_IMAGE_SEQ_MULTIPLE = 32


# -- sequence parallelism: a cp plan for the main layers, local refiners -----------------------
def _local_attn_processor() -> Any:
    """A ``ZSingleStreamAttnProcessor`` that attends over the tokens it is given, whatever
    parallel config ``enable_parallelism`` records on it (see ``ZImageSequenceParallel``)."""
    from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

    class ZImageLocalAttnProcessor(ZSingleStreamAttnProcessor):
        """For the refiner blocks, which run before the split on every rank's full tokens:
        the stock computation with ``parallel_config=None``."""

        def __call__(  # the stock signature: Attention passes only the keywords it names
            self,
            attn: Any,
            hidden_states: torch.Tensor,
            encoder_hidden_states: torch.Tensor | None = None,
            attention_mask: torch.Tensor | None = None,
            freqs_cis: torch.Tensor | None = None,
        ) -> torch.Tensor:
            config, self._parallel_config = self._parallel_config, None
            try:
                return super().__call__(
                    attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis
                )
            finally:
                self._parallel_config = config

    return ZImageLocalAttnProcessor()


class ZImageSequenceParallel(SequenceParallelSpec):
    """Z-Image under Ulysses SP. ``ZImageTransformer2DModel`` (no ``_cp_plan`` in diffusers
    0.42.1) takes lists (one [C, 1, h, w] latent and one caption per sample), patchifies, runs
    the noise refiner on the image tokens and the context refiner on the caption tokens, each
    padded to a multiple of 32 with its pad token, then the main layers on the unified
    [image, caption] sequence of each sample, batch-padded with a key mask [B, S].

    The plan splits the unified sequence where it enters the main layers (``layers.0``: its
    ``x``), each main layer's per-token RoPE ``freqs_cis`` [B, S, D/2] alike, and gathers the
    final layer's output before the unpatchify. The key mask stays whole: diffusers' Ulysses
    attention uses a full-length mask as is. Every length is a multiple of 32, so the split
    divides for any sp_degree dividing 32 and text is never padded. The refiners (2 of 34
    blocks in Z-Image) run unsplit on every rank (``ZImageLocalAttnProcessor``): their outputs
    feed the unified sequence, which no module of the model outputs, so there is no point to
    gather them at. The main layers keep diffusers' own processor (it calls
    ``dispatch_attention_fn``). Omni mode (SigLIP, several images) is refused."""

    name = "z_image"
    transformer_class = "ZImageTransformer2DModel"
    image_kwarg = "x"
    text_kwarg = "cap_feats"
    timestep_kwarg = "t"
    image_token_rule = "latent h/2 x w/2, padded to a multiple of 32"

    def cp_plan(self, transformer: nn.Module) -> dict[str, Any]:
        from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

        if getattr(transformer, "siglip_embedder", None) is not None:
            raise ValueError("Z-Image Omni (SigLIP inputs) has no sequence-parallel plan here")
        split = ContextParallelInput(split_dim=1, expected_dims=3)
        plan: dict[str, Any] = {"layers.0": {"x": split}, "layers.*": {"freqs_cis": split}}
        for key in transformer.all_final_layer:
            plan[f"all_final_layer.{key}"] = ContextParallelOutput(gather_dim=1, expected_dims=3)
        return plan

    def processor_for(self, name: str, module: nn.Module) -> Any | None:
        """The refiners' attention: local; the main layers': diffusers' (kept)."""
        if name.startswith(("noise_refiner.", "context_refiner.")):
            return _local_attn_processor()
        return None

    def image_tokens(self, transformer: nn.Module, hidden_states: Any) -> int:
        """Image tokens of the list of [C, F, H, W] latents, as padded to a multiple of 32."""
        if not isinstance(hidden_states, (list, tuple)) or isinstance(hidden_states[0], list):
            raise ValueError("Z-Image under SP takes a list of [C, F, H, W] latents (no Omni)")
        p, pf = transformer.all_patch_size[0], transformer.all_f_patch_size[0]
        _, f, h, w = hidden_states[0].shape
        m = Z_IMAGE_SEQ_MULTIPLE
        return -(-((f // pf) * (h // p) * (w // p)) // m) * m

    def text_padding(self, transformer: nn.Module, kwargs: dict[str, Any], sp: int) -> int:
        """None: the transformer pads each caption to a multiple of 32 itself."""
        if Z_IMAGE_SEQ_MULTIPLE % sp:
            raise ValueError(
                f"Z-Image pads images and captions to multiples of {Z_IMAGE_SEQ_MULTIPLE} tokens: "
                f"sp_degree must divide {Z_IMAGE_SEQ_MULTIPLE}, got {sp}"
            )
        return 0


class ZImageAdapter(DiffusionAdapter):
    """Adapter for ``diffusers.ZImagePipeline`` (Z-Image, Z-Image-Turbo).

    ``guidance_scale`` is the pipeline's: 0 turns CFG off (Z-Image-Turbo runs with 0), any
    g > 0 evaluates the negative branch. ``batch_cfg``: the positive and negative prompts run as
    one list, as the pipeline does; the transformer pads every caption to a multiple of 32 with
    its own pad token and masks the batch padding, so each sample sees only its own tokens.
    """

    lora_target_modules = (  # every linear of the attention and the SwiGLU feed-forward
        "attention.to_q",
        "attention.to_k",
        "attention.to_v",
        "attention.to_out.0",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    )
    batch_cfg = True
    sequence_parallel = ZImageSequenceParallel()
    default_negative_prompt = ""  # the pipeline's when none is given
    settings_class = ZImageSettings

    def __init__(
        self,
        pipe: Any,
        *,
        max_sequence_length: int = 512,
        cfg_normalization: float = ZImageSettings.cfg_normalization,
        cfg_truncation: float = ZImageSettings.cfg_truncation,
    ):
        super().__init__(pipe)
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        if cfg_normalization < 0:
            raise ValueError(f"cfg_normalization must be >= 0, got {cfg_normalization}")
        self.max_sequence_length = max_sequence_length
        self.cfg_normalization = float(cfg_normalization)
        self.cfg_truncation = float(cfg_truncation)
        self.num_train_timesteps = pipe.scheduler.config.num_train_timesteps

    # -- guidance on / off ---------------------------------------------------------------------
    def uses_cfg(self, guidance_scale: float) -> bool:
        """The pipeline's ``do_classifier_free_guidance``: guidance_scale > 0."""
        return guidance_scale > 0.0

    @classmethod
    def plans_cfg(cls, guidance_scale: float, options: dict[str, Any]) -> bool:
        """CFG whenever guidance_scale > 0 (Z-Image-Turbo: 0)."""
        return guidance_scale > 0.0

    @classmethod
    def prompt_tokens(cls, max_sequence_length: int | None) -> tuple[int, int]:
        """Qwen3-4B hidden states: at most 512 tokens by default, 2560 wide."""
        return max_sequence_length or 512, 2560

    @classmethod
    def token_counts(
        cls, configs: dict[str, Any], height: int, width: int, options: dict[str, Any]
    ) -> TokenCounts:
        """A single-stream transformer: its ``layers`` run every Linear on the caption and the
        image tokens alike, so the planner counts them as one sequence (``image`` = 2x2 image
        patches + caption tokens, at most ``max_sequence_length``; ``text`` 0). The refiners
        (2 blocks on each side) are not counted."""
        f, channels = planner_vae(configs.get("vae", {}))
        prompt = cls.prompt_tokens(options.get("max_sequence_length"))
        patches = (height // (2 * f)) * (width // (2 * f))
        latent = channels * (height // f) * (width // f)
        return TokenCounts(patches + prompt[0], 0, latent, prompt)

    @classmethod
    def size_rule(cls, config: Callable[[str], dict]) -> SizeRule:
        """Multiples of VAE factor x 2 (16): the transformer's 2x2 patches."""
        f = vae_scale(config("vae"))
        return SizeRule("Z-Image", (2 * f, 2 * f), f"VAE {f} x 2x2 patches")

    def _check_size(self, height: int, width: int) -> None:
        m = 2 * self.pipe.vae_scale_factor
        rule = SizeRule("Z-Image", (m, m), f"VAE {m // 2} x 2x2 patches")
        check_size(rule, height, width, None)

    # -- text ---------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Qwen3 hidden states of each prompt's real tokens, right-padded: embeds [B, L, D] and
        mask [B, L] (L the longest prompt)."""
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        device = next(self.pipe.text_encoder.parameters()).device
        rows = self.pipe._encode_prompt(  # it templates the list in place: pass a copy
            list(prompts), device=device, max_sequence_length=self.max_sequence_length
        )
        longest = max(r.shape[0] for r in rows)
        embeds = torch.stack(
            [torch.nn.functional.pad(r, (0, 0, 0, longest - len(r))) for r in rows]
        )
        mask = torch.zeros(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        for i, r in enumerate(rows):
            mask[i, : len(r)] = 1
        return PromptEmbeds(embeds.to(self.device), mask.to(self.device), None)

    # -- schedule and latents -----------------------------------------------------------------
    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        f = self.pipe.vae_scale_factor
        return 2 * (int(height) // (f * 2)), 2 * (int(width) // (f * 2))

    def schedule(self, num_steps: int, height: int, width: int) -> Schedule:
        """sigmas [N+1] (final 0 included) and timesteps [N], exactly as the pipeline."""
        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self._check_size(height, width)
        lh, lw = self._latent_hw(height, width)
        sigmas = get_default_z_image_sigmas(num_steps)
        return self.shifted_schedule(num_steps, sigmas, image_seq_len=(lh // 2) * (lw // 2))

    def prepare_latents(
        self,
        batch_size: int,
        height: int,
        width: int,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """Noise [B, C, h, w] drawn as the pipeline draws it (fp32, same generator use)."""
        self._check_size(height, width)
        return self.pipe.prepare_latents(
            batch_size,
            self.transformer.config.in_channels,
            height,
            width,
            torch.float32,
            self.device,
            generator,
        )

    # -- the model ----------------------------------------------------------------------------
    def _reversed_time(self, sigma: torch.Tensor) -> torch.Tensor:
        """The pipeline's ``(1000 - t) / 1000`` of the scheduler's t = 1000 sigma, fp32."""
        t = sigma.float() * self.num_train_timesteps
        return (1000 - t) / 1000

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
        """Velocity [B, C, h, w] = minus the transformer's output at time (1000 - t) / 1000."""
        batch = latents.shape[0]
        if len(embeds) != batch:
            raise ValueError(f"{len(embeds)} prompt embeddings for a batch of {batch} latents")
        dtype = param_dtype(transformer)
        x = list(latents.to(dtype).unsqueeze(2).unbind(dim=0))  # B x [C, 1, h, w]
        text = embeds.embeds.to(dtype)
        if embeds.mask is None:
            caps = list(text.unbind(dim=0))
        else:
            caps = [text[i][embeds.mask[i].bool()] for i in range(batch)]
        t = self._reversed_time(sigma.to(latents.device))
        out = transformer(x=x, t=t, cap_feats=caps, return_dict=False)[0]
        return -torch.stack(out, dim=0).squeeze(2)

    def guidance_at(self, guidance_scale: float, sigma: torch.Tensor) -> float | torch.Tensor:
        """``cfg_truncation`` <= 1: scale 0 where (1000 - t) / 1000 > cfg_truncation (the
        pipeline's comparison, of the fp32 value as a Python float), else ``guidance_scale``."""
        if self.cfg_truncation > 1:
            return guidance_scale
        t_norm = self._reversed_time(sigma).double()
        cut = t_norm > self.cfg_truncation
        return torch.where(cut, 0.0, float(guidance_scale)).float()

    def guide(
        self, v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float | torch.Tensor
    ) -> torch.Tensor:
        """``pos + g (pos - neg)``; with ``cfg_normalization`` c > 0, a sample whose norm
        exceeds c |pos| is scaled down to it (only where its scale g > 0, as the pipeline)."""
        pred = v_cond + guidance_scale * (v_cond - v_uncond)
        if self.cfg_normalization <= 0.0:
            return pred
        dims = tuple(range(1, pred.ndim))
        shape = (-1,) + (1,) * (pred.ndim - 1)
        pos_norm = torch.linalg.vector_norm(v_cond, dim=dims).view(shape)
        new_norm = torch.linalg.vector_norm(pred, dim=dims).view(shape)
        max_norm = pos_norm * self.cfg_normalization
        clip = new_norm > max_norm
        if isinstance(guidance_scale, torch.Tensor):
            clip = clip & (guidance_scale.reshape(-1, *[1] * (pred.ndim - 1)) > 0)
        return torch.where(clip, pred * (max_norm / new_norm), pred)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Latents -> images [B, 3, H, W] fp32 in [0, 1] on CPU (as output_type="pt")."""
        vae = self.pipe.vae
        z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1).cpu()


__all__ = ["ZImageAdapter", "ZImageSettings"]
