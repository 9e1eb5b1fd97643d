"""FLUX.1 Kontext (diffusers ``FluxKontextPipeline``): FLUX.1 editing one source image.

Mirrors ``FluxKontextPipeline.__call__`` of diffusers 0.42.1; what differs from FLUX.1
(``models/flux.py``, whose prompts, schedule, noise, distilled guidance, true CFG and decoding
are the same):

- the source image: its size (``image_processor.get_default_height_width``) picks the
  preferred Kontext resolution of the nearest aspect ratio (``PREFERRED_KONTEXT_RESOLUTIONS``,
  ~1024² pixels, the pipeline's ``_auto_resize``), floored to multiples of VAE factor x 2;
  resized (``image_processor.resize``) and preprocessed to [-1, 1]; VAE-encoded ("argmax",
  ``(z - shift) * scale``, in the text encoder's dtype as the pipeline's ``prepare_latents``)
  and packed 2x2, once per sample (both guidance branches share it). ``source_size=N``
  (``flux_kontext.source_size``) resizes every source to N x N instead (flow_grpo's training: 512).
- the source tokens are concatenated after the noised tokens along the sequence; their
  position ids are the pipeline's image ids with the first coordinate 1 (the noised tokens'
  is 0); the transformer's output is cut back to the noised tokens. They are never noised nor
  trained, and ride in ``PromptEmbeds.image_latents`` (their packed grid in ``image_shapes``)
  so that the training pass recomputes the rollout's computation.
- the schedule's dynamic shift counts the noised tokens only (the pipeline's
  ``image_seq_len = latents.shape[1]``).
- the output size is ``height`` x ``width`` as given: the stock pipeline called with
  ``max_area=height * width`` (its default ``max_area=1024**2`` rescales the requested size).
- guidance: the distilled guidance embedding (``guidance_scale``, one pass), and the
  pipeline's true CFG (``true_cfg_scale > 1`` with a negative prompt), whose negative branch
  sees the same source tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flowgrpo.models.base import PromptEmbeds, TokenCounts, planner_vae
from flowgrpo.models.flux import FluxAdapter, FluxSettings
from flowgrpo.models.qwen_image_edit import pil_rows
from flowgrpo.settings import ge, optional, setting


@dataclass
class FluxKontextSettings:
    """FLUX.1 Kontext's own settings, the config section ``flux_kontext`` (its true CFG is
    FLUX.1's: ``flux.true_cfg_scale``)."""

    source_size: int | None = setting(
        None,
        "FLUX.1 Kontext: resize every source image to this many pixels square (a multiple of "
        "16) instead of the pipeline's preferred resolution of its aspect ratio (~1024²); the "
        "reference counting_edit runs use the output size, 512. null = the pipeline's rule.",
        check=optional(ge(1)),
    )


def _check_source_size(m: int, source_size: int | None) -> None:
    if source_size is not None and (source_size < m or source_size % m):
        raise ValueError(
            f"flux_kontext.source_size must be a positive multiple of {m} for FLUX.1 "
            f"Kontext (VAE {m // 2} x 2x2 packing), got {source_size}"
        )


class FluxKontextAdapter(FluxAdapter):
    """Adapter for ``diffusers.FluxKontextPipeline``: one source image per prompt.

    true_cfg_scale, max_sequence_length: as ``FluxAdapter``.
    source_size: every source image resized to this many pixels square (a multiple of VAE
    factor x 2) instead of the pipeline's rule: the stock pipeline given the image at that
    size with ``_auto_resize=False``. flow_grpo's Kontext training resizes its sources to the
    output size (yifan123/flow_grpo@2e2f712 scripts/train_flux_kontext.py:582).
    """

    edits = True
    max_images: int | None = 1  # source images per prompt (the config check reads it)
    #: FLUX's targets plus the single blocks' ``proj_mlp``, as flow_grpo's Kontext training
    #: (yifan123/flow_grpo@2e2f712 scripts/train_flux_kontext.py:411-425)
    lora_target_modules = (*FluxAdapter.lora_target_modules, "proj_mlp")
    truncation_loggers = ("diffusers.pipelines.flux.pipeline_flux_kontext",)
    settings_class = FluxKontextSettings

    def __init__(
        self,
        pipe: Any,
        *,
        true_cfg_scale: float = FluxSettings.true_cfg_scale,
        max_sequence_length: int = 512,
        source_size: int | None = FluxKontextSettings.source_size,
    ):
        super().__init__(
            pipe, true_cfg_scale=true_cfg_scale, max_sequence_length=max_sequence_length
        )
        _check_source_size(pipe.vae_scale_factor * 2, source_size)
        self.source_size_px = source_size

    @classmethod
    def check_options(cls, config: Callable[[str], dict], options: dict[str, Any]) -> None:
        """``source_size`` against the VAE's rule, from the config files alone (what the
        trainer and the planner check before anything loads)."""
        blocks = config("vae").get("block_out_channels", (0,) * 4)
        _check_source_size(2 ** (len(blocks) - 1) * 2, options.get("source_size"))

    @classmethod
    def token_counts(
        cls, configs: dict[str, Any], height: int, width: int, options: dict[str, Any]
    ) -> TokenCounts:
        """FLUX's counts plus the source tokens of a square source image (``source_size``, else
        1024², the preferred resolution of aspect ratio 1): they lengthen the sequence."""
        counts = super().token_counts(configs, height, width, options)
        f, _ = planner_vae(configs.get("vae", {}))
        side = (options.get("source_size") or 1024) // (2 * f) * (2 * f)
        source = (side // (2 * f)) ** 2
        return TokenCounts(
            counts.image + source, counts.text, counts.latent, counts.prompt, counts.frames
        )

    # -- the source image -------------------------------------------------------------------------
    def source_hw(self, image: Any) -> tuple[int, int]:
        """(height, width) the pipeline resizes ``image`` (PIL, or [3, H, W]) to: the preferred Kontext
        resolution nearest its aspect ratio, floored to multiples of VAE factor x 2
        (``source_size`` given: that square)."""
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        if self.source_size_px is not None:
            return self.source_size_px, self.source_size_px
        if isinstance(image, torch.Tensor):  # [3, H, W]: the processor reads [B, C, H, W]
            image = image[None]
        h, w = self.pipe.image_processor.get_default_height_width(image)
        m = self.pipe.vae_scale_factor * 2
        if h == 0 or w == 0:  # the pipeline would divide by zero
            size = image.size if not isinstance(image, torch.Tensor) else image.shape[:-3:-1]
            raise ValueError(
                f"a source image of {size[0]} x {size[1]} pixels is smaller than FLUX.1 "
                f"Kontext's multiple of {m}: give larger images (or set flux_kontext.source_size)"
            )
        aspect = w / h
        _, w, h = min((abs(aspect - pw / ph), pw, ph) for pw, ph in PREFERRED_KONTEXT_RESOLUTIONS)
        return h // m * m, w // m * m

    def source_layout(self, row: list[torch.Tensor]) -> tuple[int, int]:
        """The (height, width) the prompt's source ([3, H, W]) resizes to: rows of different
        sizes are encoded and run as separate batches (``DiffusionAdapter``)."""
        return self.source_hw(row[0])

    @torch.no_grad()
    def encode_sources(self, images: list[list[torch.Tensor]]) -> tuple[torch.Tensor, tuple]:
        """Each prompt's source image ([3, H, W] in [0, 1]) -> packed VAE latents [B, S, 4C] and
        their packed grid ``(h/2, w/2)``; one batch resizes to one size (else ValueError)."""
        pipe = self.pipe
        if any(len(row) != 1 for row in images):
            raise ValueError(
                "FluxKontextAdapter takes one source image per prompt, got "
                f"{max(len(row) for row in images)}"
            )
        pils = [row[0] for row in pil_rows(images)]
        sizes = {self.source_hw(im) for im in pils}
        if len(sizes) > 1:
            raise ValueError(
                f"the source images of one batch must resize to one size, got {sorted(sizes)} "
                "(give a batch's samples source images of one aspect ratio)"
            )
        h, w = sizes.pop()
        proc = pipe.image_processor
        pixels = proc.preprocess(proc.resize(pils, h, w), h, w)
        dtype = pipe.text_encoder_2.dtype  # the pipeline encodes in prompt_embeds' dtype
        device = next(pipe.vae.parameters()).device
        z = pipe._encode_vae_image(pixels.to(device=device, dtype=dtype), generator=None)
        b, c, lh, lw = z.shape
        return pipe._pack_latents(z, b, c, lh, lw), (lh // 2, lw // 2)

    def source_ids(self, grid: tuple, device: Any, dtype: torch.dtype) -> torch.Tensor:
        """Position ids [S, 3] of the source tokens: image ids with the first coordinate 1."""
        ids = self.pipe._prepare_latent_image_ids(1, grid[0], grid[1], device, dtype)
        ids[..., 0] = 1
        return ids

    # -- conditioning -------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(
        self,
        prompts: list[str],
        images: list[list[torch.Tensor]] | None = None,
        sources: tuple[torch.Tensor, tuple] | None = None,
    ) -> PromptEmbeds:
        """FLUX's text embeddings with the source images' packed latents [B, S, 4C] and their
        packed grid (``image_shapes``); ``sources``: ``encode_sources(images)`` already done."""
        self.check_images(images, len(prompts))
        latents, grid = sources if sources is not None else self.encode_sources(images)
        text = super().encode_prompts(prompts)
        return PromptEmbeds(text.embeds, None, text.pooled, latents.to(self.device), grid)

    # -- latents and the model ----------------------------------------------------------------
    def prepare_latents(
        self,
        batch_size: int,
        height: int,
        width: int,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """Packed noise [B, (h/2)(w/2), 4C] drawn by the pipeline's ``prepare_latents`` (no
        image: the noise draw alone, fp32)."""
        self._check_size(height, width)
        return self.pipe.prepare_latents(
            None,
            batch_size,
            self.num_channels_latents,
            height,
            width,
            torch.float32,
            self.device,
            generator,
        )[0]

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
        """One transformer call on [noised | source] tokens at [noised ids | source ids] ->
        the noised tokens' velocity [B, S, 4C]."""
        batch, n = latents.shape[0], latents.shape[1]
        if len(embeds) != batch:
            raise ValueError(f"{len(embeds)} prompt embeddings for a batch of {batch} latents")
        if embeds.image_latents is None:
            raise ValueError("FluxKontextAdapter: the prompt embeddings carry no source image")
        device, dtype = latents.device, latents.dtype
        ids = torch.cat(
            [
                self.image_ids(height, width, device, dtype),
                self.source_ids(embeds.image_shapes, device, dtype),
            ]
        )
        tokens = torch.cat([latents, embeds.image_latents.to(device, dtype)], dim=1)
        out = self.transformer_call(transformer, tokens, sigma, embeds, ids, guidance_scale)
        return out[:, :n]


__all__ = ["FluxKontextAdapter", "FluxKontextSettings"]
