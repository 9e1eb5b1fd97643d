"""Rewards on videos [B, C, F, H, W] in [0, 1]: any image reward lifted to video (scored on every
frame or on N evenly spaced frames, averaged per video), and a temporal-consistency score.

A reward that scores whole videos itself says so with an attribute ``accepts_video = True``
(a function attribute or a class attribute); every other reward is an image reward and
``lift_to_video`` scores its frames. Images [B, C, H, W] pass through unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from flowgrpo.rewards.spec import check_frames


def takes_video(fn: Any) -> bool:
    """Whether ``fn`` scores whole videos itself (``accepts_video = True``)."""
    return bool(getattr(fn, "accepts_video", False))


def frame_indices(num_frames: int, frames: str | int = "all") -> list[int]:
    """The frames an image reward scores: all of them, or ``frames`` evenly spaced ones (the
    first and the last included; one frame = the middle one)."""
    if frames == "all" or int(frames) >= num_frames:
        return list(range(num_frames))
    n = int(frames)
    if n == 1:
        return [num_frames // 2]
    return sorted({round(i * (num_frames - 1) / (n - 1)) for i in range(n)})


def lift_to_video(fn: Any, frames: str | int = "all", name: str = "reward") -> Any:
    """``fn`` unchanged when it takes videos; otherwise a reward that passes images through and
    scores a video [B, C, F, H, W] as the mean of ``fn`` over its chosen frames (each frame
    gets its video's prompt and a copy of its metadata). A dict reward's entries are averaged
    entry by entry."""
    if takes_video(fn):
        return fn
    frames = check_frames(frames, f"reward {name!r} option frames")

    def per_frame(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> Any:
        if images.dim() != 5:
            return fn(images, prompts, metadata)
        b, c, f, h, w = images.shape
        idx = frame_indices(f, frames)
        n = len(idx)
        flat = images[:, :, idx].transpose(1, 2).reshape(b * n, c, h, w)
        raw = fn(
            flat,
            [p for p in prompts for _ in range(n)],
            [copy.deepcopy(m) for m in metadata for _ in range(n)],
        )

        def mean(values: Any, label: str) -> torch.Tensor:
            if isinstance(values, torch.Tensor):
                t = values.detach().to("cpu", torch.float32).flatten()
            else:
                t = torch.as_tensor([float(x) for x in values], dtype=torch.float32)
            if t.numel() != b * n:
                raise ValueError(
                    f"reward {label!r} returned {t.numel()} scores for {b * n} frames "
                    f"({b} videos x {n} frames; one score per frame)"
                )
            return t.view(b, n).mean(dim=1)  # non-finite scores are caught after the mean

        if isinstance(raw, Mapping):
            return {k: mean(v, f"{name}/{k}") for k, v in raw.items()}
        return mean(raw, name)

    per_frame.__name__ = getattr(fn, "__name__", name)
    per_frame.image_reward = fn  # type: ignore[attr-defined]
    return per_frame


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
