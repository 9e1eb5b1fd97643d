"""Qwen-Image-Edit (diffusers ``QwenImageEditPipeline``) and Edit-Plus
(``QwenImageEditPlusPipeline``, several source images): Qwen-Image with source images.

Mirrors the pipelines' ``__call__`` of diffusers 0.42.1; what differs from Qwen-Image
(``models/qwen_image.py``, whose schedule, noise, true CFG with the norm rescale and decoding
are the same):

- source images: Edit takes one per prompt, resized to ~1024² pixels at its aspect ratio
  (``calculate_dimensions(1024 * 1024, w / h)``: multiples of 32) with the pipeline's
  ``image_processor.resize``; that resized image is the VL encoder's view and, preprocessed to
  [-1, 1], the VAE's. Edit-Plus takes several: each is resized to ~384² for the VL encoder
  (``CONDITION_IMAGE_SIZE``) and preprocessed at ~1024² for the VAE (``VAE_IMAGE_SIZE``).
- prompts go through the edit chat template with the image(s) (Qwen2.5-VL's processor turns
  each ``<|image_pad|>`` into the image's vision tokens); the template's first 64 tokens are
  dropped; no ``max_sequence_length`` truncation (the pipelines apply none). Edit encodes a
  batch of prompts with one image each in one call, as the pipeline does with a list;
  Edit-Plus one prompt at a time (its pipeline takes batch 1 only).
- the source images' VAE latents ("argmax", normalised by the VAE's mean/std) are packed 2x2
  and concatenated after the noised tokens along the sequence; ``img_shapes`` lists the
  noised grid then each source's; the transformer's output is cut back to the noised tokens.
  The source tokens are never noised and never trained; they are encoded once per sample (both
  guidance branches share them) and recorded in ``PromptEmbeds.image_latents``, so the
  training pass recomputes the rollout's computation.
- the negative prompt is encoded with the same image(s), as the pipelines do.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from flowgrpo.models.base import PromptEmbeds, TokenCounts, param_dtype, planner_vae
from flowgrpo.models.qwen_image import QwenImageAdapter, load_vl_processor, vl_processor


def to_pil(image: torch.Tensor) -> Any:
    """[3, H, W] in [0, 1] -> an RGB PIL image (lossless for images read as 8-bit)."""
    from PIL import Image

    arr = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return Image.fromarray(np.ascontiguousarray(arr.permute(1, 2, 0).cpu().numpy()))


def pil_rows(images: list[list[torch.Tensor]]) -> list[list[Any]]:
    """Each prompt's sources as PIL images (``to_pil``), a tensor shared by several prompts (a
    group's samples share their decoded source) converted once: a 6000² source is 108 MB."""
    done: dict[int, Any] = {}
    for im in (im for r in images for im in r):
        if id(im) not in done:
            done[id(im)] = to_pil(im)
    return [[done[id(im)] for im in r] for r in images]


class QwenImageEditAdapter(QwenImageAdapter):
    """Adapter for ``diffusers.QwenImageEditPipeline``: one source image per prompt."""

    edits = True
    #: the pipelines' pixel areas of the VAE's and (Edit-Plus) the VL encoder's views
    vae_area = 1024 * 1024
    condition_area = vae_area  # Edit: the VL encoder sees the VAE's resized image
    #: (min_pixels, max_pixels) of the VL processor's resize as the planner assumes them:
    #: Qwen2.5-VL's published preprocessor_config values (at the pipelines' ~1024² and ~384²
    #: views neither bound applies: only the rounding to patch x merge pixels does)
    vl_pixels = (3136, 12845056)
    max_images: int | None = 1

    def __init__(self, pipe: Any):
        super().__init__(pipe, max_sequence_length=1024)

    @classmethod
    def load_components(cls, root: Any) -> dict[str, Any]:
        """The ``processor`` built from the folder's image processor and tokenizer files
        (``vl_processor``): loading it whole needs torchvision for its video part."""
        from transformers import Qwen2VLProcessor

        return load_vl_processor(root, Qwen2VLProcessor)

    @classmethod
    def token_counts(
        cls, configs: dict[str, Any], height: int, width: int, options: dict[str, Any]
    ) -> TokenCounts:
        """Qwen-Image's counts plus one source image's tokens, which lengthen both streams: its
        VAE latents packed 2x2 after the noised tokens (the source resized to
        ``calculate_dimensions(vae_area, w / h)``) and its vision tokens in the prompt
        embedding (the VL view, ``calculate_dimensions(condition_area, w / h)``, resized by
        the processor to multiples of patch x merge, one token per merge² patches). The
        source's aspect ratio is taken as the output's (the pipelines size their default
        output from the source); Edit-Plus is counted with one source image."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        counts = super().token_counts(configs, height, width, options)
        f, _ = planner_vae(configs.get("vae", {}))
        sw, sh = cls._dims_at(cls.vae_area, width / height)
        source = (sh // f // 2) * (sw // f // 2)
        vision = configs.get("text_encoder", {}).get("vision_config", {})
        patch, merge = int(vision.get("patch_size", 14)), int(vision.get("spatial_merge_size", 2))
        vw, vh = cls._dims_at(cls.condition_area, width / height)
        rh, rw = smart_resize(vh, vw, patch * merge, *cls.vl_pixels)
        text = counts.text + (rh // patch) * (rw // patch) // merge**2
        prompt = (text, counts.prompt[1])
        return TokenCounts(counts.image + source, text, counts.latent, prompt, counts.frames)

    @staticmethod
    def _dims_at(area: int, ratio: float) -> tuple[int, int]:
        """(width, height) of the pipeline's ``calculate_dimensions(area, ratio)`` (ratio w / h)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

        cw, ch, *_ = calculate_dimensions(area, ratio)
        return cw, ch

    @classmethod
    def _dims(cls, area: int, image: Any) -> tuple[int, int]:
        """(width, height) the pipeline resizes the PIL ``image`` to at ``area`` pixels."""
        w, h = image.size
        return cls._dims_at(area, w / h)

    def source_layout(self, row: list[torch.Tensor]) -> tuple[tuple[int, int], ...]:
        """(width, height) each source of ``row`` ([3, H, W]) resizes to for the VAE: rows of
        different layouts are encoded and run as separate batches (``DiffusionAdapter``)."""
        return tuple(self._dims_at(self.vae_area, im.shape[-1] / im.shape[-2]) for im in row)

    def _check_rows(self, images: list[list[torch.Tensor]]) -> None:
        if self.max_images is not None and any(len(r) > self.max_images for r in images):
            raise ValueError(
                f"{type(self).__name__} takes {self.max_images} source image per prompt, got "
                f"{max(len(r) for r in images)} (Qwen-Image-Edit-Plus takes several)"
            )

    # -- conditioning -------------------------------------------------------------------------
    def _sources(self, rows: list[list[Any]]) -> tuple[list[Any], torch.Tensor, tuple]:
        """Edit: (VL views, VAE input [B, 3, 1, H, W] in [-1, 1], img_shapes of the source)."""
        proc, f = self.pipe.image_processor, self.pipe.vae_scale_factor
        dims = {self._dims(self.vae_area, r[0]) for r in rows}
        if len(dims) > 1:
            raise ValueError(
                f"the source images of one batch must resize to one size, got {sorted(dims)} "
                "(give a batch's samples source images of one aspect ratio)"
            )
        cw, ch = dims.pop()
        views = [proc.resize(r[0], ch, cw) for r in rows]
        vae_in = proc.preprocess(views, ch, cw).unsqueeze(2)
        return views, vae_in, ((1, ch // f // 2, cw // f // 2),)

    def _image_latents(self, vae_in: torch.Tensor) -> torch.Tensor:
        """VAE latents of the source images, packed [B, S, 4C] (the pipeline's prepare_latents
        without the noise draw)."""
        pipe = self.pipe
        dtype = pipe.text_encoder.dtype  # the pipeline encodes in prompt_embeds' dtype
        device = next(pipe.vae.parameters()).device
        lat = pipe._encode_vae_image(vae_in.to(device=device, dtype=dtype), generator=None)
        b, c, _, h, w = lat.shape
        return pipe._pack_latents(lat, b, c, h, w)

    def _text(self, prompts: list[str], views: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        device = next(self.pipe.text_encoder.parameters()).device
        embeds, mask = self.pipe.encode_prompt(list(prompts), image=views, device=device)
        return embeds, mask

    @torch.no_grad()
    def encode_sources(self, images: list[list[torch.Tensor]]) -> tuple[list, torch.Tensor, tuple]:
        """(VL views, packed source latents [B, S, 4C], img_shapes) of each prompt's sources."""
        self._check_rows(images)
        rows = pil_rows(images)
        views, vae_in, shapes = self._sources(rows)
        return views, self._image_latents(vae_in), shapes

    @torch.no_grad()
    def encode_prompts(
        self,
        prompts: list[str],
        images: list[list[torch.Tensor]] | None = None,
        sources: tuple[list, torch.Tensor, tuple] | None = None,
    ) -> PromptEmbeds:
        """Qwen2.5-VL's view of image + prompt -> embeds [B, L, D], mask [B, L]; with the
        source images' packed VAE latents [B, S, 4C] and their ``img_shapes``."""
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        self.check_images(images, len(prompts))
        views, latents, shapes = sources if sources is not None else self.encode_sources(images)
        embeds, mask = self._text(list(prompts), views)
        if mask is None:  # the pipeline drops an all-ones mask; keep it so batches can be padded
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        dev = self.device
        return PromptEmbeds(embeds.to(dev), mask.to(dev), None, latents.to(dev), shapes)

    # -- latents and the model ----------------------------------------------------------------
    def prepare_latents(
        self,
        batch_size: int,
        height: int,
        width: int,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """Packed noise [B, (h/2)(w/2), 4C] drawn as the pipeline draws it (fp32)."""
        self._check_size(height, width)
        channels = self.transformer.config.in_channels // 4
        return self.pipe.prepare_latents(
            None, batch_size, channels, height, width, torch.float32, self.device, generator
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
        """One transformer call on [noised | source] tokens at sigma [B] -> the noised tokens'
        velocity [B, S, 4C]."""
        lh, lw = self._latent_hw(height, width)
        batch, n = latents.shape[0], latents.shape[1]
        if len(embeds) != batch:
            raise ValueError(f"{len(embeds)} prompt embeddings for a batch of {batch} latents")
        if embeds.image_latents is None:
            raise ValueError(f"{type(self).__name__}: the prompt embeddings carry no source image")
        config = getattr(transformer, "config", self.transformer.config)
        dtype = param_dtype(transformer)
        t = (sigma.float() * self.pipe.scheduler.config.num_train_timesteps).to(dtype)
        mask = embeds.mask
        if mask is not None and bool(mask.all()):
            mask = None
        guidance = None
        if config.guidance_embeds:
            guidance = torch.full([batch], guidance_scale, device=latents.device)
        hidden = torch.cat([latents.to(dtype), embeds.image_latents.to(latents.device, dtype)], 1)
        out = transformer(
            hidden_states=hidden,
            timestep=t / 1000,
            guidance=guidance,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=embeds.embeds.to(dtype),
            img_shapes=[[(1, lh // 2, lw // 2), *embeds.image_shapes]] * batch,
            return_dict=False,
        )[0]
        return out[:, :n]


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    """Adapter for ``diffusers.QwenImageEditPlusPipeline``: one or more source images per
    prompt (each sample's prompt is encoded alone, as the pipeline's batch of 1)."""

    max_images = None
    condition_area = 384 * 384

    def _sources(self, rows: list[list[Any]]) -> tuple[list[Any], Any, tuple]:
        """Edit-Plus: (each sample's VL views, each sample's VAE inputs [1, 3, 1, H, W] per
        source image, img_shapes of the sources)."""
        proc, f = self.pipe.image_processor, self.pipe.vae_scale_factor
        layouts = {tuple(self._dims(self.vae_area, im) for im in r) for r in rows}
        if len(layouts) > 1:
            raise ValueError(
                f"the source images of one batch must resize to one layout, got {sorted(layouts)}"
                " (give a batch's samples source images of the same count and aspect ratios)"
            )
        layout = layouts.pop()
        views = []
        for r in rows:
            sizes = [self._dims(self.condition_area, im) for im in r]
            views.append([proc.resize(im, h, w) for im, (w, h) in zip(r, sizes, strict=True)])
        vae_in = [
            [proc.preprocess(im, h, w).unsqueeze(2) for im, (w, h) in zip(r, layout, strict=True)]
            for r in rows
        ]
        return views, vae_in, tuple((1, h // f // 2, w // f // 2) for w, h in layout)

    def _image_latents(self, vae_in: Any) -> torch.Tensor:
        """Each source encoded alone per sample (batch 1, as the pipeline), packed and
        concatenated along the sequence: [B, S1 + S2 + ..., 4C]."""
        encode = super()._image_latents
        return torch.cat([torch.cat([encode(x) for x in sample], dim=1) for sample in vae_in])

    def _text(self, prompts: list[str], views: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        device = next(self.pipe.text_encoder.parameters()).device
        parts = []
        for prompt, view in zip(prompts, views, strict=True):
            e, m = self.pipe.encode_prompt([prompt], image=list(view), device=device)
            if m is None:
                m = torch.ones(e.shape[:2], dtype=torch.long, device=e.device)
            parts.append(PromptEmbeds(e, m))
        both = PromptEmbeds.cat(parts)
        return both.embeds, both.mask


__all__ = [
    "QwenImageEditAdapter",
    "QwenImageEditPlusAdapter",
    "pil_rows",
    "to_pil",
    "vl_processor",
]
