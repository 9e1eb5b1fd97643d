"""DiffusionNFT: negative-aware fine-tuning on the forward (noising) process.

Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process",
arXiv 2509.16117. Transcribed from the authors' code, NVlabs/DiffusionNFT @ 24af555,
``scripts/train_nft_sd3.py`` (line numbers below are that file's).

No log-probs and no SDE: the rollout is any ODE sampler run with the *old* policy; only the
final clean latent x0 and each sample's reward are kept. Training re-noises x0 at the rollout's
sigmas and contrasts an implicit positive and negative policy around the old one:

    r      = clamp(clamp(A, ±A_max) / A_max / 2 + 0.5, 0, 1)        optimality probability
    x_t    = (1 − t)·x0 + t·ε,   ε ~ N(0, I) fresh per (sample, t)
    v⁺     = β·v_θ + (1 − β)·sg(v_old),    v⁻ = (1 + β)·sg(v_old) − β·v_θ
    x̂0±    = x_t − t·v±
    w±     = sg(mean_d |x̂0± − x0|) clipped below at 1e-5            (computed in float64)
    L±     = mean_d (x̂0± − x0)² / w±
    loss   = A_max · mean_b [ (r·L⁺ + (1 − r)·L⁻) / β ]  +  β_kl · mean_b mean_d (v_θ − v_ref)²

After each epoch's optimizer steps the old policy moves toward the current one:
old ← d·old + (1 − d)·θ with d = ``old_policy_decay(optimizer_steps_so_far, schedule)``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# decay_type -> (flat, uprate, uphold), train_nft_sd3.py:169-189 (`return_decay`).
# 0: always on-policy; 1: geneval/pickscore/hpsv2/multi_reward; 2: ocr (config/nft.py).
OLD_POLICY_SCHEDULES: dict[int, tuple[int, float, float]] = {
    0: (0, 0.0, 0.0),
    1: (0, 0.001, 0.5),
    2: (75, 0.0075, 0.999),
}


def _per_sample(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """float or [B] -> [B, 1, ...] in ``like``'s dtype, broadcastable against ``like`` [B, ...]."""
    t = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    batch = like.shape[0]
    if t.ndim == 0:
        t = t.expand(batch)
    t = t.reshape(-1)
    if t.numel() != batch:
        raise ValueError(f"sigma has {t.numel()} entries, expected 1 or batch size {batch}")
    return t.view(batch, *([1] * (like.ndim - 1)))


def optimality_probability(advantages: torch.Tensor, adv_clip_max: float = 5.0) -> torch.Tensor:
    """r = clamp(clamp(A, -A_max, A_max) / A_max / 2 + 0.5, 0, 1), [B] -> [B] (fp32 or fp64).

    Maps the group advantage to the probability that the sample is "optimal": A = 0 gives 0.5,
    A >= A_max gives 1. train_nft_sd3.py:910-929 (adv_mode="all", the only mode the configs use).
    """
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    adv = advantages.to(torch.promote_types(advantages.dtype, torch.float32))
    adv = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    return torch.clamp((adv / adv_clip_max) / 2.0 + 0.5, 0.0, 1.0)


def forward_noising(
    x0: torch.Tensor, noise: torch.Tensor, sigma: float | torch.Tensor
) -> torch.Tensor:
    """x_t = (1 - sigma)·x0 + sigma·noise; x0, noise [B, ...], sigma float or [B].

    The rectified-flow forward process (train_nft_sd3.py:868-870); computed in fp32 (fp64 for
    fp64 inputs), as the authors draw fp32 noise.
    """
    if x0.shape != noise.shape:
        raise ValueError(f"x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} differ")
    compute = torch.promote_types(x0.dtype, torch.float32)
    x0, noise = x0.to(compute), noise.to(compute)
    t = _per_sample(sigma, x0)
    return (1 - t) * x0 + t * noise


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    sigma: float | torch.Tensor,
    r: torch.Tensor,
    *,
    beta: float,
    adv_clip_max: float = 5.0,
    kl_beta: float = 0.0,
    v_ref: torch.Tensor | None = None,
    weight_min: float = 1e-5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DiffusionNFT loss on one micro-batch at one noise level (train_nft_sd3.py:872-978).

    v_theta: current policy's velocity at x_t [B, ...] (the only input that gets a gradient);
    v_old: old policy's velocity [B, ...] (detached here, as the authors compute it under
    no_grad); x_t: ``forward_noising(x0, eps, sigma)``; x0: the rollout's clean latent;
    sigma: float or [B] (the authors' t = timestep / 1000); r: ``optimality_probability`` [B];
    beta: the NFT beta (``config.beta``: 1.0 for geneval/pickscore/hpsv2, 0.1 for ocr and
    multi_reward); adv_clip_max: the final scale (the authors multiply by
    ``config.train.adv_clip_max`` = 5). kl_beta (``config.train.beta``, 1e-4 in every config,
    always on) adds kl_beta * mean_b mean_d (v_theta - v_ref)^2 against the frozen base model's
    velocity v_ref (detached). The adaptive weights w± are detached and computed in float64,
    as the authors do; the returned loss is fp32 (fp64 for fp64 inputs).

    Returns (loss, metrics); metrics are detached scalars named as the authors log them.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0 (the loss divides by it), got {beta}")
    if not (v_theta.shape == v_old.shape == x_t.shape == x0.shape):
        raise ValueError(
            "v_theta, v_old, x_t and x0 must share one shape, got "
            f"{tuple(v_theta.shape)}, {tuple(v_old.shape)}, {tuple(x_t.shape)}, {tuple(x0.shape)}"
        )
    if r.shape != (v_theta.shape[0],):
        raise ValueError(f"r must be [B] = [{v_theta.shape[0]}], got {tuple(r.shape)}")
    if kl_beta > 0 and v_ref is None:
        raise ValueError("kl_beta > 0 needs v_ref (the reference policy's velocity)")
    if v_ref is not None and v_ref.shape != v_theta.shape:
        raise ValueError(f"v_ref {tuple(v_ref.shape)} and v_theta {tuple(v_theta.shape)} differ")

    compute = torch.promote_types(v_theta.dtype, torch.float32)
    v = v_theta.to(compute)
    v_old = v_old.detach().to(compute)
    x_t, x0 = x_t.to(compute), x0.to(compute)
    t = _per_sample(sigma, x0)
    r = r.detach().to(compute)
    dims = tuple(range(1, x0.ndim))

    # Implicit positive and negative policies around the old one (:934-937).
    v_pos = beta * v + (1 - beta) * v_old
    v_neg = (1.0 + beta) * v_old - beta * v
    x0_pos = x_t - t * v_pos
    x0_neg = x_t - t * v_neg

    # Adaptive weights: the detached mean absolute x0 error, in float64 (:939-957). Dividing an
    # fp32 tensor by them promotes the per-sample losses to float64, as in the authors' code.
    with torch.no_grad():
        w_pos = (x0_pos.double() - x0.double()).abs().mean(dim=dims, keepdim=True)
        w_neg = (x0_neg.double() - x0.double()).abs().mean(dim=dims, keepdim=True)
        w_pos, w_neg = w_pos.clip(min=weight_min), w_neg.clip(min=weight_min)
    loss_pos = ((x0_pos - x0) ** 2 / w_pos).mean(dim=dims)
    loss_neg = ((x0_neg - x0) ** 2 / w_neg).mean(dim=dims)

    per_sample = r * loss_pos / beta + (1.0 - r) * loss_neg / beta  # :959
    policy_loss = (per_sample * adv_clip_max).mean()  # :960
    loss = policy_loss
    if v_ref is not None:
        kl_div = ((v - v_ref.detach().to(compute)) ** 2).mean(dim=dims).mean()  # :966-970
        if kl_beta > 0:
            loss = loss + kl_beta * kl_div
    loss = loss.to(compute)

    with torch.no_grad():
        deviate = (v - v_old) ** 2
        metrics = {
            "policy_loss": policy_loss.to(compute),
            "unweighted_policy_loss": per_sample.mean().to(compute),
            "old_deviate": deviate.mean(),
            "old_deviate_max": deviate.max(),
            "x0_norm": (x0**2).mean(),
        }
        if v_ref is not None:
            ref = v_ref.detach().to(compute)
            metrics["kl_div"] = kl_div.detach()
            metrics["old_kl_div"] = ((v_old - ref) ** 2).mean(dim=dims).mean()
    return loss, metrics


def old_policy_decay(step: int, schedule: int = 1) -> float:
    """d in old <- d·old + (1 - d)·θ after ``step`` optimizer steps (train_nft_sd3.py:169-189).

    schedule is the authors' ``decay_type``: 0 -> d = 0 (on-policy); 1 (default, geneval,
    pickscore, hpsv2, multi_reward) -> min(0.001·step, 0.5); 2 (ocr) -> 0 for step < 75, then
    min(0.0075·(step - 75), 0.999). The authors apply it once per epoch, after that epoch's
    optimizer steps, with step = optimizer steps so far (:1034-1039).
    """
    if schedule not in OLD_POLICY_SCHEDULES:
        raise ValueError(
            f"unknown old-policy schedule {schedule!r}; expected one of {sorted(OLD_POLICY_SCHEDULES)}"
        )
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    flat, uprate, uphold = OLD_POLICY_SCHEDULES[schedule]
    if step < flat:
        return 0.0
    return min((step - flat) * uprate, uphold)


@torch.no_grad()
def update_old_policy_(
    old_params: Iterable[torch.Tensor], params: Iterable[torch.Tensor], decay: float
) -> None:
    """In place: old <- decay·old + (1 - decay)·new for each pair (train_nft_sd3.py:1036-1039)."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be in [0, 1], got {decay}")
    old_params, params = list(old_params), list(params)
    if len(old_params) != len(params):
        raise ValueError(f"got {len(old_params)} old tensors for {len(params)} current ones")
    for old, new in zip(old_params, params):
        old.copy_(old * decay + new.detach() * (1.0 - decay))
