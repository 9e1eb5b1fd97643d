"""``image_similarity``: how much of its source image an edit keeps, as the cosine similarity
of CLIP image embeddings of the result and its source image(s) (editing runs only).

flow_grpo's counting_edit runs (Qwen-Image-Edit, FLUX.1 Kontext) add this term to keep edits
faithful: ``image_similarity_score`` (yifan123/flow_grpo@9745241 flow_grpo/rewards.py:61-78)
calls ``ClipScorer.image_similarity`` (flow_grpo/clip_scorer.py:55-68): the
``get_image_features`` of openai/clip-vit-large-patch14 for result and source, each
L2-normalised, their dot product. Here the same model is read from a local path (never the
network) as a ``CLIPVisionModelWithProjection`` (the vision tower and its projection, which is
what ``get_image_features`` runs; a full CLIPModel folder loads as is), images are prepared
as by the CLIP rewards (shortest side bicubic, centre crop, mean/std in torch) and scored in
batches on the run's device in the model's dtype.

Source images come from the sample's ``metadata["source_images"]`` ([3, H, W] in [0, 1]).
With several (Edit-Plus), ``source="mean"`` (the default) averages the similarities to each:
every source brings content the result should keep and none is privileged unless the task
says so; ``source=i`` compares with source i only (flow_grpo's dual-reference Edit-Plus run
scores the second input, i.e. ``source: 1``). With one source both are the same.

``preprocess="flow_grpo_scorer"`` prepares the pixels as flow_grpo's scorer does instead (the
counting_edit presets set it): ``ClipScorer._process`` (zhtmike/flow_grpo@9745241
flow_grpo/clip_scorer.py:22-28, 38-43) runs torchvision's ``T.Resize(224)`` (bilinear,
antialiased, the long side ``int(224 · long / short)``) and ``T.CenterCrop`` (offset
``round((size − crop) / 2)``) on the float tensor, and the training scripts give it the source
already resized to the output size with Pillow's default filter
(``ref_image.resize((resolution, resolution))``, scripts/train_qwenimage_edit.py:614,
train_flux_kontext.py:582): here the source is resized to the result's size that way.
The default ``"clip"`` is the CLIP image processor's form (bicubic, the file's source).
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from flowgrpo.rewards.clip import (
    _DTYPES,
    check_model_options,
    image_transform,
    preprocess_images,
)


class ImageSimilarity:
    """Reward = cos(CLIP image embedding of the result, of its source image(s)) per image [B]."""

    reward_name = "image_similarity"
    needs_source_images = True  # the config check refuses it for a run without source images

    def __init__(
        self,
        path: str | None = None,
        processor_path: str | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 32,
        source: str | int = "mean",
        preprocess: str = "clip",
    ) -> None:
        name = self.reward_name
        check_model_options(
            name,
            path,
            processor_path,
            dtype,
            "a local CLIP model directory (the counting_edit runs use "
            "openai/clip-vit-large-patch14)",
        )
        if source != "mean" and (isinstance(source, bool) or not isinstance(source, int)):
            raise ValueError(
                f"reward {name!r}: source must be 'mean' or a source index (0, 1, ...), "
                f"got {source!r}"
            )
        if preprocess not in ("clip", "flow_grpo_scorer"):
            raise ValueError(
                f"reward {name!r}: preprocess must be 'clip' or 'flow_grpo_scorer', got {preprocess!r}"
            )
        self.preprocess_mode = preprocess
        from transformers import AutoConfig, CLIPConfig, CLIPVisionModelWithProjection

        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        self.source = source
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if isinstance(config, CLIPConfig):  # a full CLIPModel folder: its projection size is
            vision = config.vision_config  # the top-level projection_dim, not the vision
            vision.projection_dim = config.projection_dim  # config's default (512)
            config = vision
        with _no_load_report():  # a CLIPModel folder's text tower is "unexpected" by design
            self.model, info = CLIPVisionModelWithProjection.from_pretrained(
                path,
                config=config,
                local_files_only=True,
                dtype=_DTYPES[dtype],
                output_loading_info=True,
            )
        _warn_unless_only_text_unused(name, path, info)
        self.model.to(self.device).eval().requires_grad_(False)
        image_size = int(self.model.config.image_size)
        self.resize, self.crop, self.mean, self.std = image_transform(
            Path(processor_path or path), image_size
        )

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] in [0, 1] -> pixel_values [B, 3, crop, crop] (normalised)."""
        if self.preprocess_mode == "flow_grpo_scorer":
            return flow_grpo_pixels(images, self.resize, self.crop, self.mean, self.std)
        return preprocess_images(images, self.resize, self.crop, self.mean, self.std)

    def prepare_source(self, source: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """A source [3, H, W] in [0, 1] -> pixel_values [3, crop, crop]; with ``flow_grpo_scorer``
        first resized to the result's ``size`` (h, w) as flow_grpo's scripts do (8-bit,
        Pillow's default filter)."""
        if self.preprocess_mode == "flow_grpo_scorer" and tuple(source.shape[-2:]) != size:
            from PIL import Image

            u8 = (source.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
            pil = Image.fromarray(u8).resize((size[1], size[0]))  # Pillow's default filter
            source = torch.frombuffer(bytearray(pil.tobytes()), dtype=torch.uint8)
            source = source.view(size[0], size[1], 3).permute(2, 0, 1).float() / 255
        return self.preprocess(source.unsqueeze(0))[0]

    @torch.no_grad()
    def embed(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, crop, crop] -> L2-normalised image embeddings [N, D] float32,
        ``batch_size`` at a time on the model's device and in its dtype."""
        dtype = next(self.model.parameters()).dtype
        out = []
        for i in range(0, pixels.shape[0], self.batch_size):
            chunk = pixels[i : i + self.batch_size].to(self.device, dtype)
            emb = self.model(pixel_values=chunk).image_embeds.float()
            out.append(emb / emb.norm(p=2, dim=-1, keepdim=True))
        return torch.cat(out).cpu()

    def _chosen_sources(self, metadata: list[dict]) -> list[list[torch.Tensor]]:
        """Each sample's source images to compare with (all, or the ``source``-th)."""
        chosen = []
        for i, m in enumerate(metadata):
            srcs = list(m.get("source_images") or [])
            if not srcs:
                raise ValueError(
                    f"reward {self.reward_name!r} compares each result with its source "
                    f"image(s), but sample {i} has none (metadata['source_images']): it "
                    "scores edits, not text-to-image runs"
                )
            if self.source != "mean":
                if not -len(srcs) <= int(self.source) < len(srcs):
                    raise ValueError(
                        f"reward {self.reward_name!r}: source={self.source} but sample {i} "
                        f"has {len(srcs)} source image(s)"
                    )
                srcs = [srcs[int(self.source)]]
            chosen.append(srcs)
        return chosen

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> torch.Tensor:
        chosen = self._chosen_sources(metadata)
        results = self.embed(self.preprocess(images))
        # A group's K samples share their sources (as copies): prepare and embed each
        # distinct source once, found by a hash of its values (cheaper than resizing it).
        index: dict[bytes, int] = {}
        pixels: list[torch.Tensor] = []
        rows: list[list[int]] = []
        for srcs in chosen:
            row = []
            for src in srcs:
                x = torch.as_tensor(src).detach().float().cpu().contiguous()
                key = hashlib.blake2b(x.numpy().tobytes(), digest_size=16)
                key.update(repr(tuple(x.shape)).encode())
                row.append(index.setdefault(key.digest(), len(pixels)))
                if row[-1] == len(pixels):
                    pixels.append(self.prepare_source(x, tuple(images.shape[-2:])))
            rows.append(row)
        sources = self.embed(torch.stack(pixels))
        return torch.stack(
            [(sources[row] @ results[b]).mean() for b, row in enumerate(rows)]
        ).float()


#: the parts of a full CLIPModel that the vision model leaves unused
_TEXT_PARTS = ("text_model.", "text_projection.", "logit_scale")


@contextmanager
def _no_load_report() -> Iterator[None]:
    """transformers' "LOAD REPORT" (a ~23-line table per rank) silenced for one load: loading
    the vision tower of a full CLIPModel folder leaves its text tower unused, as intended;
    ``_warn_unless_only_text_unused`` reports anything else in one line."""
    log = logging.getLogger("transformers.modeling_utils")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _warn_unless_only_text_unused(name: str, path: str, info: dict) -> None:
    """One warning line when the load left vision weights missing or mismatched, or used none
    of some checkpoint weights other than a CLIPModel's text tower."""
    missing = list(info.get("missing_keys") or [])
    mismatched = [
        str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or []
    ]
    unused = [k for k in info.get("unexpected_keys") or [] if not k.startswith(_TEXT_PARTS)]
    parts = [
        f"{what} {len(keys)} (e.g. {sorted(keys)[0]})"
        for what, keys in (("missing", missing), ("mismatched", mismatched), ("unused", unused))
        if keys
    ]
    if parts:
        warnings.warn(
            f"reward {name!r}: the CLIP vision model in {path} loaded with weights "
            f"{', '.join(parts)}: is it a CLIP model folder?",
            stacklevel=3,
        )


def flow_grpo_pixels(
    images: torch.Tensor, resize: int, crop: int, mean: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    """torchvision's ``T.Compose([T.Resize(resize), T.CenterCrop(crop), T.Normalize(mean,
    std)])`` on a float [B, C, H, W] tensor, in torch: shortest side to ``resize`` bilinear
    (antialiased, long side truncated), centre crop at the rounded offset, (x − mean) / std."""
    x = images.float()
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    h, w = x.shape[-2:]
    short, long = min(h, w), max(h, w)
    new_long = int(resize * long / short)
    size = (resize, new_long) if h <= w else (new_long, resize)
    if size != (h, w):
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
    top, left = int(round((size[0] - crop) / 2.0)), int(round((size[1] - crop) / 2.0))
    x = x[..., top : top + crop, left : left + crop]
    return (x - mean) / std
