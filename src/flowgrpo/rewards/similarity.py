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
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

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
        from transformers import AutoConfig, CLIPConfig, CLIPVisionModelWithProjection

        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        self.source = source
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if isinstance(config, CLIPConfig):  # a full CLIPModel folder: its projection size is
            vision = config.vision_config  # the top-level projection_dim, not the vision
            vision.projection_dim = config.projection_dim  # config's default (512)
            config = vision
        self.model = CLIPVisionModelWithProjection.from_pretrained(
            path, config=config, local_files_only=True, dtype=_DTYPES[dtype]
        )
        self.model.to(self.device).eval().requires_grad_(False)
        image_size = int(self.model.config.image_size)
        self.resize, self.crop, self.mean, self.std = image_transform(
            Path(processor_path or path), image_size
        )

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] in [0, 1] -> pixel_values [B, 3, crop, crop] (normalised)."""
        return preprocess_images(images, self.resize, self.crop, self.mean, self.std)

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
                    pixels.append(self.preprocess(x.unsqueeze(0))[0])
            rows.append(row)
        sources = self.embed(torch.stack(pixels))
        return torch.stack(
            [(sources[row] @ results[b]).mean() for b, row in enumerate(rows)]
        ).float()
