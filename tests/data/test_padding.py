"""Re-padding prompt embeddings to a subset's longest prompt, and the mask checks."""

import pytest
import torch

from flowgrpo.data.padding import mask_lengths, repad

LENGTHS = [3, 1, 5, 0]


def padded(lengths=LENGTHS, width=6, dim=4, dtype=torch.long):
    """Zero-padded embeds [B, width, dim] and left-aligned mask [B, width] of ``dtype``."""
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(len(lengths), width, dim, generator=g)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    embeds = embeds * mask[..., None]
    return embeds, mask.to(dtype)


@pytest.mark.parametrize("dtype", [torch.long, torch.bool, torch.float32, torch.int32])
def test_lengths_and_mask_dtype_of_any_mask(dtype):
    embeds, mask = padded(dtype=dtype)
    lengths = mask_lengths(embeds, mask)
    assert lengths.tolist() == LENGTHS and lengths.dtype == torch.int64
    e, m = repad(embeds, mask, [0, 2])  # the longest of the two: 5
    assert m.dtype == dtype and torch.equal(m, mask[[0, 2], :5])
    assert torch.equal(e, embeds[[0, 2], :5])


def test_repad_selects_rows_and_trims():
    embeds, mask = padded()
    e, m = repad(embeds, mask, torch.tensor([1, 3]))
    assert e.shape == (2, 1, 4) and m.tolist() == [[1], [0]]
    assert torch.equal(e[0], embeds[1, :1])
    e, m = repad(embeds, mask, [2, 0])
    assert e.shape == (2, 5, 4) and torch.equal(e, embeds[[2, 0], :5])
    e, m = repad(embeds, mask, slice(0, 2))
    assert e.shape == (2, 3, 4) and torch.equal(m, mask[:2, :3]) and m.dtype == torch.long
    e, m = repad(embeds, mask, torch.tensor([3]))  # an all-padding row
    assert e.shape == (1, 0, 4)


def test_bad_masks_raise():
    embeds, mask = padded()
    holes = mask.clone()
    holes[2, 1] = 0  # 1 0 1 1 1 0
    with pytest.raises(ValueError, match=r"not left-aligned .* row\(s\) \[2\]"):
        mask_lengths(embeds, holes)
    with pytest.raises(ValueError, match="not left-aligned"):
        repad(embeds, holes, [0])
    right_aligned = mask.flip(1)
    with pytest.raises(ValueError, match="not left-aligned"):
        mask_lengths(embeds, right_aligned)
    twos = mask * 2
    with pytest.raises(ValueError, match="only 0 and 1"):
        mask_lengths(embeds, twos)
    with pytest.raises(ValueError, match="only 0 and 1"):
        mask_lengths(embeds, mask.float() * 0.5)
    with pytest.raises(ValueError, match="does not match embeds"):
        mask_lengths(embeds, mask[:, :5])
    with pytest.raises(ValueError, match="does not match embeds"):
        mask_lengths(embeds, mask[:3])
    with pytest.raises(ValueError, match=r"must be \[B, L, D\]"):
        mask_lengths(embeds[0], mask)
