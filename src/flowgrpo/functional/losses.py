"""The clipped Flow-GRPO policy loss and the per-image KL penalty between Gaussian policies."""

from __future__ import annotations

import torch


def flow_grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    adv_clip_max: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-style clipped surrogate, all [B]:

    r = exp(log_prob - old_log_prob); A = clamp(advantages, -adv_clip_max, adv_clip_max);
    loss = mean_B max(-A r, -A clip(r, 1 - clip_range, 1 + clip_range)).
    Metrics (detached scalars): approx_kl = mean(-log r) (the k1 estimator of KL(old || new)),
    approx_kl_k2 = 0.5 mean((log r)^2) (the k2 estimator, what flow_grpo logs as approx_kl),
    clipfrac = fraction with |r - 1| > clip_range, ratio_mean.
    """
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    if not (log_prob.shape == old_log_prob.shape == advantages.shape):
        raise ValueError(
            "log_prob, old_log_prob and advantages must share one shape [B], got "
            f"{tuple(log_prob.shape)}, {tuple(old_log_prob.shape)}, {tuple(advantages.shape)}"
        )
    adv = advantages.float().clamp(-adv_clip_max, adv_clip_max)
    log_ratio = log_prob.float() - old_log_prob.float()
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        metrics = {
            "approx_kl": (-log_ratio).mean(),
            "approx_kl_k2": 0.5 * (log_ratio**2).mean(),
            "clipfrac": ((ratio - 1.0).abs() > clip_range).float().mean(),
            "ratio_mean": ratio.mean(),
        }
    return loss, metrics


def kl_penalty_image(
    mean: torch.Tensor, ref_mean: torch.Tensor, std_dev_t: torch.Tensor
) -> torch.Tensor:
    """KL between N(mean, s^2) and N(ref_mean, s^2) per image [B]: mean over non-batch dims of
    (mean - ref_mean)^2 / (2 std_dev_t^2). std_dev_t: float or [B]."""
    if mean.shape != ref_mean.shape:
        raise ValueError(f"mean {tuple(mean.shape)} and ref_mean {tuple(ref_mean.shape)} differ")
    std = torch.as_tensor(std_dev_t, dtype=torch.float32, device=mean.device)
    if std.ndim == 0:
        std = std.expand(mean.shape[0])
    std = std.reshape(-1, *([1] * (mean.ndim - 1)))
    sq = (mean.float() - ref_mean.float()) ** 2 / (2 * std**2)
    return sq.mean(dim=tuple(range(1, mean.ndim)))
