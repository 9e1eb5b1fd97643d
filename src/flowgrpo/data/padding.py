"""Re-padding of prompt embeddings for micro-batches.

Text encoders give a batch as ``embeds [B, L, D]`` plus ``mask [B, L]`` (1 = real token,
left-aligned: 1...1 0...0), padded to the batch's longest prompt. ``repad`` trims a subset of
rows to that subset's own longest prompt (``PromptEmbeds.select``), so no forward pays for
padding it does not need. Masks keep their dtype (bool, int or float).
"""

from __future__ import annotations

import torch

Index = torch.Tensor | slice | list[int]


def mask_lengths(embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Validate ``embeds [B, L, D]`` / ``mask [B, L]`` and return lengths [B] (int64).

    Raises ValueError for shape mismatches, values other than 0/1, or masks that are not
    left-aligned (a 0 followed by a 1).
    """
    if embeds.dim() != 3:
        raise ValueError(f"prompt embeds must be [B, L, D], got shape {tuple(embeds.shape)}")
    if mask.dim() != 2 or tuple(mask.shape) != tuple(embeds.shape[:2]):
        raise ValueError(
            f"prompt mask shape {tuple(mask.shape)} does not match embeds [B, L] = "
            f"{tuple(embeds.shape[:2])}"
        )
    if mask.dtype != torch.bool:
        if torch.is_complex(mask) or not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("prompt mask must contain only 0 and 1")
    m = mask.to(torch.bool)
    if bool((~m[:, :-1] & m[:, 1:]).any()):
        rows = torch.nonzero((~m[:, :-1] & m[:, 1:]).any(dim=1)).flatten().tolist()
        raise ValueError(f"prompt mask is not left-aligned (1...1 0...0) in row(s) {rows}")
    return m.sum(dim=1, dtype=torch.int64)


def repad(
    embeds: torch.Tensor, mask: torch.Tensor, index: Index
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``index`` (LongTensor, list or slice) trimmed to that subset's longest prompt.

    Returns (embeds [b, l, D], mask [b, l]) as views/copies of the kept positions (values kept
    exactly, mask dtype kept).
    """
    lengths = mask_lengths(embeds, mask)
    if isinstance(index, list):
        index = torch.tensor(index, dtype=torch.int64, device=embeds.device)
    sub_lengths = lengths[index]
    keep = int(sub_lengths.max()) if sub_lengths.numel() else 0
    return embeds[index][:, :keep], mask[index][:, :keep]
