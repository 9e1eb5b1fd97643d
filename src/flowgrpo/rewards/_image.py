"""Image conversions shared by rewards and the remote protocol (one quantisation everywhere)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[B, C, H, W] float in [0, 1] -> uint8 array [B, H, W, C] (round to nearest)."""
    x = (images.detach().float().cpu().clamp(0, 1) * 255.0).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).numpy()


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """[B, C, H, W] float in [0, 1] -> B PIL images (mode "L" for C=1, "RGB" for C=3)."""
    arr = to_uint8(images)
    if arr.shape[-1] == 1:
        return [Image.fromarray(np.ascontiguousarray(a[..., 0])) for a in arr]
    return [Image.fromarray(a) for a in arr]


def from_pil(pils: list[Image.Image]) -> torch.Tensor:
    """B PIL images of one size -> [B, C, H, W] float32 in [0, 1] (C=1 for "L", else 3)."""
    if not pils:
        raise ValueError("no images to stack")
    gray = all(p.mode == "L" for p in pils)
    sizes = sorted({p.size for p in pils})
    if len(sizes) != 1:
        shapes = sorted({(h, w) if gray else (h, w, 3) for w, h in sizes})
        raise ValueError(f"images in one batch must share a size, got {shapes}")
    (w, h), c = sizes[0], 1 if gray else 3
    x = np.empty((len(pils), h, w, c), dtype=np.uint8)  # filled one image at a time
    for i, p in enumerate(pils):
        x[i] = np.asarray(p.convert("L" if gray else "RGB"), dtype=np.uint8).reshape(h, w, c)
    return torch.from_numpy(x).permute(0, 3, 1, 2).float().div_(255.0)
