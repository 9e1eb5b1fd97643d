"""JPEG (in)compressibility rewards: the size of each image saved as JPEG, quality 95."""

from __future__ import annotations

import io

import torch

from flowgrpo.rewards._image import to_pil


def jpeg_sizes_kb(images: torch.Tensor, quality: int = 95) -> list[float]:
    """Size in kB (1000 bytes) of each image [B, C, H, W] in [0, 1] saved as JPEG."""
    sizes = []
    for img in to_pil(images):
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return sizes


def jpeg_compressibility(
    images: torch.Tensor, prompts: list[str], metadata: list[dict], quality: int = 95
) -> torch.Tensor:
    """-(JPEG size in kB) / 500 per image [B]: higher for simpler images."""
    return torch.tensor([-s / 500.0 for s in jpeg_sizes_kb(images, quality)], dtype=torch.float32)


def jpeg_incompressibility(
    images: torch.Tensor, prompts: list[str], metadata: list[dict], quality: int = 95
) -> torch.Tensor:
    """(JPEG size in kB) / 500 per image [B]: the negative of jpeg_compressibility."""
    return torch.tensor([s / 500.0 for s in jpeg_sizes_kb(images, quality)], dtype=torch.float32)
