"""Packing and re-padding of prompt embeddings.

Text encoders give a batch as ``embeds [B, L, D]`` plus ``mask [B, L]`` (1 = real token,
left-aligned: 1...1 0...0), padded to the batch's longest prompt. For micro-batching we keep
them packed (``values [sum_len, D]`` + ``offsets [B + 1]``) or re-pad a subset to its own
longest prompt, so no forward pays for padding it does not need.

Padding positions are zero after ``unpack``; a round trip is exact when the input padding is
zero (as diffusers pipelines produce). Masks keep their dtype (bool, int or float).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

Index = torch.Tensor | slice | list[int]


class PackedEmbeds(NamedTuple):
    """values: [sum_len, D]; offsets: [B + 1] int64, sample b is values[offsets[b]:offsets[b+1]]."""

    values: torch.Tensor
    offsets: torch.Tensor
    mask_dtype: torch.dtype = torch.long

    @property
    def lengths(self) -> torch.Tensor:
        """[B] int64 number of real tokens per sample."""
        return self.offsets[1:] - self.offsets[:-1]

    def __len__(self) -> int:
        return self.offsets.numel() - 1


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


def pack(embeds: torch.Tensor, mask: torch.Tensor) -> PackedEmbeds:
    """Drop padding: ``embeds [B, L, D]``, ``mask [B, L]`` -> PackedEmbeds(values, offsets)."""
    lengths = mask_lengths(embeds, mask)
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    return PackedEmbeds(embeds[mask.to(torch.bool)], offsets, mask.dtype)


def unpack(packed: PackedEmbeds, pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-pad: -> (embeds [B, Lmax, D] zero-padded, mask [B, Lmax] of the packed mask dtype).

    Lmax is the longest sample, or ``pad_to`` (which must be at least that long).
    """
    values, offsets = packed.values, packed.offsets
    if values.dim() != 2 or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError("packed embeds need values [sum_len, D] and offsets [B + 1]")
    if int(offsets[-1]) != values.shape[0]:
        raise ValueError(f"offsets end at {int(offsets[-1])} but values has {values.shape[0]} rows")
    lengths = packed.lengths
    if bool((lengths < 0).any()):
        raise ValueError("offsets must be non-decreasing")
    longest = int(lengths.max()) if lengths.numel() else 0
    if pad_to is None:
        pad_to = longest
    elif pad_to < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt ({longest} tokens)")
    positions = torch.arange(pad_to, device=offsets.device)
    keep = positions[None, :] < lengths[:, None]  # [B, pad_to], left-aligned
    embeds = values.new_zeros(lengths.numel(), pad_to, values.shape[1])
    embeds[keep] = values
    return embeds, keep.to(packed.mask_dtype)


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


def pad_to_length(
    embeds: torch.Tensor, mask: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (zeros / mask 0) or trim padding so that L == ``length``."""
    lengths = mask_lengths(embeds, mask)
    longest = int(lengths.max()) if lengths.numel() else 0
    if length < longest:
        raise ValueError(f"length={length} is shorter than the longest prompt ({longest} tokens)")
    extra = length - embeds.shape[1]
    if extra <= 0:
        return embeds[:, :length], mask[:, :length]
    return (
        torch.nn.functional.pad(embeds, (0, 0, 0, extra)),
        torch.nn.functional.pad(mask, (0, extra)),
    )
