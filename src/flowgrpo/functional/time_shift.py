"""The fixed-shift sigma grid (``sample.time_shift``): training rollouts on one grid whatever
the resolution."""

from __future__ import annotations

import torch


def time_shift_grid(num_steps: int, shift: float) -> torch.Tensor:
    """The fixed-shift grid the MixGRPO authors sample on: sigma = s·t / (1 + (s − 1)·t) at
    t = linspace(1, 0, N + 1) (Tencent-Hunyuan/MixGRPO @ e5cdd6a: ``sd3_time_shift``,
    fastvideo/utils/sampling_utils.py:9-10, applied in fastvideo/train_grpo_flux.py:187-189;
    their scripts: shift 3, 25 steps), [N + 1] fp64 from 1 to 0. FLUX's pipeline instead shifts by a resolution-dependent mu
    (1.88 at 512²), so each window position would train different noise levels."""
    if num_steps < 1 or shift <= 0:
        raise ValueError(f"need num_steps >= 1 and shift > 0, got {num_steps}, {shift}")
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return shift * t / (1 + (shift - 1) * t)
