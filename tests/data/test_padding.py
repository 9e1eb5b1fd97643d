"""Packing, unpacking and re-padding prompt embeddings."""

import pytest
import torch

from flowgrpo.data.padding import PackedEmbeds, pack, pad_to_length, repad, unpack

LENGTHS = [3, 1, 5, 0]


def padded(lengths=LENGTHS, width=6, dim=4, dtype=torch.long):
    """Zero-padded embeds [B, width, dim] and left-aligned mask [B, width] of ``dtype``."""
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(len(lengths), width, dim, generator=g)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    embeds = embeds * mask[..., None]
    return embeds, mask.to(dtype)


@pytest.mark.parametrize("dtype", [torch.long, torch.bool, torch.float32, torch.int32])
def test_pack_unpack_round_trip(dtype):
    embeds, mask = padded(dtype=dtype)
    packed = pack(embeds, mask)
    assert isinstance(packed, PackedEmbeds)
    assert packed.values.shape == (sum(LENGTHS), 4)
    assert packed.offsets.tolist() == [0, 3, 4, 9, 9] and packed.offsets.dtype == torch.int64
    assert packed.lengths.tolist() == LENGTHS and len(packed) == 4
    assert torch.equal(packed.values[4:9], embeds[2, :5])

    e, m = unpack(packed)  # to the longest prompt (5)
    assert m.dtype == dtype
    assert torch.equal(e, embeds[:, :5]) and torch.equal(m, mask[:, :5])
    e, m = unpack(packed, pad_to=6)
    assert torch.equal(e, embeds) and torch.equal(m, mask)
    e, m = unpack(packed, pad_to=8)
    assert e.shape == (4, 8, 4) and m[:, 6:].sum() == 0 and e[:, 5:].abs().sum() == 0
    with pytest.raises(ValueError, match="shorter than the longest prompt"):
        unpack(packed, pad_to=4)


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


def test_pad_to_length():
    embeds, mask = padded()
    e, m = pad_to_length(embeds, mask, 9)
    assert e.shape == (4, 9, 4) and torch.equal(e[:, :6], embeds) and m[:, 6:].sum() == 0
    e, m = pad_to_length(embeds, mask, 5)
    assert torch.equal(e, embeds[:, :5]) and torch.equal(m, mask[:, :5])
    with pytest.raises(ValueError, match="shorter than the longest"):
        pad_to_length(embeds, mask, 4)


def test_bad_masks_raise():
    embeds, mask = padded()
    holes = mask.clone()
    holes[2, 1] = 0  # 1 0 1 1 1 0
    with pytest.raises(ValueError, match=r"not left-aligned .* row\(s\) \[2\]"):
        pack(embeds, holes)
    with pytest.raises(ValueError, match="not left-aligned"):
        repad(embeds, holes, [0])
    right_aligned = mask.flip(1)
    with pytest.raises(ValueError, match="not left-aligned"):
        pack(embeds, right_aligned)
    twos = mask * 2
    with pytest.raises(ValueError, match="only 0 and 1"):
        pack(embeds, twos)
    with pytest.raises(ValueError, match="only 0 and 1"):
        pack(embeds, mask.float() * 0.5)
    with pytest.raises(ValueError, match="does not match embeds"):
        pack(embeds, mask[:, :5])
    with pytest.raises(ValueError, match="does not match embeds"):
        pack(embeds, mask[:3])
    with pytest.raises(ValueError, match=r"must be \[B, L, D\]"):
        pack(embeds[0], mask)
    with pytest.raises(ValueError, match="offsets end at"):
        unpack(PackedEmbeds(torch.zeros(3, 4), torch.tensor([0, 2])))
