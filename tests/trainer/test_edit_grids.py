"""Edit runs' grids (issue 26): each cell shows source | result side by side, twice as wide as
a text-to-image cell, the source's pixels in the left half (fast, no model)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from flowgrpo.trainer.figures import fit_image, fitted_sources, make_grid, save_grid


def _u8(x: torch.Tensor) -> torch.Tensor:
    """[0, 1] values that survive the grids' uint8 rounding exactly."""
    return (x * 255).round() / 255


def test_edit_cells_are_source_then_result_twice_as_wide():
    g = torch.Generator().manual_seed(0)
    results = _u8(torch.rand(3, 3, 16, 16, generator=g))
    sources = _u8(torch.rand(3, 3, 16, 16, generator=g))
    plain = make_grid(results, nrow=2)  # 64 px cells (x4), 2 px borders
    grid = make_grid(results, nrow=2, sources=sources)
    assert plain.shape == (2 * 66 + 2, 2 * 66 + 2, 3)
    assert grid.shape == (plain.shape[0], 2 * (2 * 64 + 2) + 2, 3)  # each cell 64 x 128
    up = lambda x: x.repeat_interleave(4, 1).repeat_interleave(4, 2)  # noqa: E731
    for i in range(3):
        r, c = divmod(i, 2)
        top, left = 2 + r * 66, 2 + c * 130
        src = grid[top : top + 64, left : left + 64]
        res = grid[top : top + 64, left + 64 : left + 128]
        assert np.array_equal(src, (up(sources[i]) * 255).round().byte().permute(1, 2, 0).numpy())
        assert np.array_equal(res, plain[top : top + 64, 2 + c * 66 : 2 + c * 66 + 64])
    assert (grid[2 + 66 :, 2 + 130 :] == 128).all()  # the missing 4th cell stays grey


def test_captions_span_the_wider_cells():
    results = torch.zeros(2, 3, 16, 16)
    grid = make_grid(results, nrow=2, captions=["a", "b"], notes=["0.1", "0.2"], sources=results)
    assert grid.shape[1] == 2 * 130 + 2 and grid.shape[0] > 66 + 2


def test_fit_image_keeps_the_aspect_and_leaves_a_same_size_image_alone():
    img = torch.rand(3, 24, 48)
    assert fit_image(img, 24, 48) is img
    fitted = fit_image(torch.ones(3, 8, 16), 16, 16)  # 2:1 into a square: a centred band
    assert fitted.shape == (3, 16, 16)
    assert (fitted[:, 4:12] == 1).all() and (fitted[:, :4] == 0).all()
    assert (fitted[:, 12:] == 0).all()
    rows = [[torch.ones(3, 16, 16), torch.zeros(3, 4, 4)], []]  # the first source; none: black
    both = fitted_sources(rows, 16, 16)
    assert both.shape == (2, 3, 16, 16) and (both[0] == 1).all() and (both[1] == 0).all()
    assert fitted_sources(None, 16, 16) is None


def test_save_grid_writes_the_pairs(tmp_path):
    results, sources = torch.zeros(1, 3, 64, 128), torch.ones(1, 3, 64, 128)
    path = save_grid(results, tmp_path / "g.png", 1, ["make it red"], ["0.5"], sources)
    with Image.open(path) as im:
        arr = np.asarray(im.convert("RGB"))
    assert arr.shape[1] == 2 * 128 + 4  # a 128 px square per half, 2 px borders
    cap = (arr.shape[0] - 128 - 4) // 2  # caption and note bands, equal height
    assert (arr[2 + cap + 32 : 2 + cap + 96, 2:130] == 255).all()  # the source, centred
    assert (arr[2 + cap + 32 : 2 + cap + 96, 130:258] == 0).all()  # the result
