"""Rewards on videos [B, C, F, H, W] in [0, 1]: which frames an image reward scores, and a
temporal-consistency score.

A reward that scores whole videos itself says so with an attribute ``accepts_video = True``
(a function attribute or a class attribute); every other reward is an image reward and
``flowgrpo.rewards.base.lift_to_video`` scores its frames (``frame_indices``).
"""

from __future__ import annotations

import torch


def frame_indices(num_frames: int, frames: str | int = "all") -> list[int]:
    """The frames an image reward scores: all of them, or ``frames`` evenly spaced ones (the
    first and the last included; one frame = the middle one)."""
    if frames == "all" or int(frames) >= num_frames:
        return list(range(num_frames))
    n = int(frames)
    if n == 1:
        return [num_frames // 2]
    return sorted({round(i * (num_frames - 1) / (n - 1)) for i in range(n)})


def temporal_consistency(
    videos: torch.Tensor, prompts: list[str], metadata: list[dict]
) -> torch.Tensor:
    """1 - the mean absolute change between consecutive frames, per video: [B] in [0, 1], 1
    for a still video. A regulariser against flicker; a still video scores best, so weight it
    beside a content reward (``reward=ocr:1.0,temporal_consistency:0.1``)."""
    if videos.dim() != 5:
        raise ValueError(
            f"temporal_consistency scores videos [B, C, F, H, W], got {tuple(videos.shape)}"
        )
    if videos.shape[2] < 2:
        return torch.ones(videos.shape[0])
    change = (videos[:, :, 1:] - videos[:, :, :-1]).abs().mean(dim=(1, 2, 3, 4))
    return 1.0 - change


temporal_consistency.accepts_video = True  # type: ignore[attr-defined]
