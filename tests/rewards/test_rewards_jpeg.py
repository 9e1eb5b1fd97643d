"""JPEG (in)compressibility rewards."""

import io

import numpy as np
import torch
from PIL import Image

from flowgrpo.rewards import build_reward


def test_flat_image_is_more_compressible_than_noise():
    g = torch.Generator().manual_seed(0)
    images = torch.stack([torch.full((3, 64, 64), 0.4), torch.rand(3, 64, 64, generator=g)])
    comp = torch.as_tensor(build_reward("jpeg_compressibility")(images, ["a", "b"], [{}, {}]))
    inc = torch.as_tensor(build_reward("jpeg_incompressibility")(images, ["a", "b"], [{}, {}]))
    assert comp[0] > comp[1]
    assert comp[1] < -0.005  # 64x64 RGB noise at q95 is several kB
    torch.testing.assert_close(inc, -comp)


def test_score_is_size_in_kb_over_500():
    g = torch.Generator().manual_seed(1)
    images = torch.rand(1, 1, 32, 32, generator=g)  # grayscale path
    arr = (images[0, 0] * 255).round().to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(arr)).save(buf, format="JPEG", quality=95)
    expected = -len(buf.getvalue()) / 1000 / 500
    score = build_reward("jpeg_compressibility")(images, ["x"], [{}])
    assert abs(float(score[0]) - expected) < 1e-7
