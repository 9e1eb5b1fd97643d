"""GRPO-Guard (Wang et al., arXiv 2510.22319): Flow-GRPO with regulated clipping.

Flow-GRPO's importance ratio drifts below 1 in expectation (its log-prob mean over dimensions
shifts with the step's noise scale), so clipping stops guarding against over-optimization. The
authors' fix: normalise the log ratio with the step's own mean shift and scale, and divide each
step's loss by |dt| so every step weighs alike. The rollout records each trained step's
Gaussian mean (the old policy's); the rest is Flow-GRPO's loop. docs/math.md states the
math.

Transcribed from the authors' code, which lives in the flow_grpo repository: commit 2e2f712
"GRPO-Guard" (by the paper's first author, merged in PR #175),
``scripts/train_sd3_GRPO_Guard.py:903-936`` with ``config.rationorm = True``.

Flow-GRPO's per-step ratio is exp(log p_θ − log p_old) for the "sde" Gaussian step
N(μ, s²·I), s = std_t·sqrt(−dt). With the rollout's sample x' = μ_old + s·ε and δ = μ_θ − μ_old:

    log p_θ − log p_old = mean_d(ε⊙δ)/s − mean_d(δ²)/(2s²)

The second term is never positive (the ratio's "left shift") and the first one scales as 1/s,
so the ratio's spread differs from step to step. GRPO-Guard adds the shift back and multiplies
by s, then divides the clipped loss by |dt|:

    log r̃ = (log p_θ − log p_old + bias) · s,    bias = mean(δ²) / (2 s²)
    loss  = mean_b max(−A·r̃, −A·clip(r̃, 1 − ε, 1 + ε)) / |dt|   (+ β·KL, not divided)

With a per-sample bias this is log r̃ = mean_d(ε⊙δ) exactly: linear in δ, zero mean under the
policy's own noise, and at θ = old exactly 0 (r̃ = 1). Its gradient in v per step is
−A·ε·(1 + std_t²(1 − σ)/(2σ))·dt/D; after the 1/|dt| it no longer depends on dt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from flowgrpo.functional.losses import kl_penalty_image
from flowgrpo.rollout import Trajectory
from flowgrpo.settings import gt, one_of, setting

# -- the math: the normalised ratio and the regulated-clipping loss ----------------------------

BIAS_REDUCTIONS = ("batch", "sample")


def _per_sample(value: float | torch.Tensor, batch: int, name: str, device) -> torch.Tensor:
    """float or [B] -> fp64 [B] (the scale s is formed in fp64, then cast)."""
    t = torch.as_tensor(value, dtype=torch.float64, device=device)
    if t.ndim == 0:
        t = t.expand(batch)
    t = t.reshape(-1)
    if t.numel() != batch:
        raise ValueError(f"{name} has {t.numel()} entries, expected 1 or batch size {batch}")
    return t


def normalized_log_ratio(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std_dev_t: float | torch.Tensor,
    dt: float | torch.Tensor,
    *,
    sde_type: str = "sde",
    bias_reduce: str = "sample",
) -> torch.Tensor:
    """log r̃ [B] = (log_prob − old_log_prob + bias) · s, s = std_dev_t · sqrt(−dt).

    log_prob, old_log_prob [B]: the "sde" step's log-density (mean over non-batch dims) of the
    rollout's next latent under the current and the rollout policy; mean, old_mean [B, ...]:
    the two Gaussians' means (``prev_sample_mean``; the rollout must record old_mean);
    std_dev_t: float or [B], the ``std_dev_t`` that ``sde_step_with_logprob`` returns (std_t,
    without sqrt(−dt)); dt: float or [B], sigma_next − sigma (< 0).

    bias = mean(δ²) / (2 s²), δ = mean − old_mean (not detached). ``bias_reduce="sample"`` (the
    default) takes mean_d(δ²) per sample: the form the authors intended (the first author's reply
    in flow_grpo issue #244), verl-omni's (``diffusion_algos.py``) and Flow-Factory's, and the one
    in which log r̃ = mean_d(ε⊙δ) exactly (zero mean for every sample). ``"batch"`` (legacy)
    reproduces the published script: ``.mean(dim=tuple(range(1, log_prob.ndim)))`` with a 1-D
    log_prob is ``dim=()``, which torch reads as "all dims", so its bias is ONE scalar, the mean
    of δ² over the micro-batch and all elements (train_sd3_GRPO_Guard.py:917 at 2e2f712); a
    sample's ratio then depends on the other samples of its micro-batch. Both agree at θ = old
    and in their gradient there (the bias is quadratic in δ).

    s: the authors use one scalar per micro-batch, mean_b(sqrt(−dt))·mean_b(std_dev_t) (all
    their samples share one step); here s is per sample, which is the same when the step is
    shared. Only ``sde_type="sde"`` is supported, as in the authors' code (their
    ``compute_log_prob`` never passes sde_type): the "cps" log-prob has no 1/(2·std²) factor
    and its std_dev_t already is the step std, so bias and scale would be wrong.
    """
    if sde_type != "sde":
        raise ValueError(
            f"GRPO-Guard's ratio normalisation needs sde_type='sde' (got {sde_type!r}): it "
            "assumes the 'sde' step's normalised Gaussian log-density with std "
            "std_dev_t*sqrt(-dt); the authors' code supports only 'sde'"
        )
    if bias_reduce not in BIAS_REDUCTIONS:
        raise ValueError(f"bias_reduce must be one of {BIAS_REDUCTIONS}, got {bias_reduce!r}")
    if log_prob.shape != old_log_prob.shape or log_prob.ndim != 1:
        raise ValueError(
            "log_prob and old_log_prob must both be [B], got "
            f"{tuple(log_prob.shape)} and {tuple(old_log_prob.shape)}"
        )
    batch = log_prob.shape[0]
    if mean.shape != old_mean.shape or mean.shape[0] != batch:
        raise ValueError(
            f"mean {tuple(mean.shape)} and old_mean {tuple(old_mean.shape)} must be [B={batch}, ...]"
        )
    std = _per_sample(std_dev_t, batch, "std_dev_t", log_prob.device)
    dt_ = _per_sample(dt, batch, "dt", log_prob.device)
    if bool((dt_ >= 0).any()):
        raise ValueError("dt = sigma_next - sigma must be < 0 (time runs from noise to data)")
    if bool((std <= 0).any()):
        raise ValueError("std_dev_t must be > 0 (noise_level = 0 is a deterministic step)")

    compute = torch.promote_types(log_prob.dtype, torch.float32)
    scale = (std * torch.sqrt(-dt_)).to(compute)  # s = std_t * sqrt(-dt), [B]
    delta_sq = (mean.to(compute) - old_mean.to(compute)) ** 2
    if bias_reduce == "batch":
        mean_sq = delta_sq.mean().expand(batch)  # the authors' dim=() reduction: a scalar
    else:
        mean_sq = delta_sq.mean(dim=tuple(range(1, delta_sq.ndim)))
    bias = mean_sq / (2 * scale**2)
    return (log_prob.to(compute) - old_log_prob.to(compute) + bias) * scale


def grpo_guard_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std_dev_t: float | torch.Tensor,
    dt: float | torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    adv_clip_max: float,
    sde_type: str = "sde",
    bias_reduce: str = "sample",
    kl_beta: float = 0.0,
    ref_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The regulated-clipping loss of one micro-batch at one step (train_sd3_GRPO_Guard.py:909-944).

    r̃ = exp(``normalized_log_ratio(...)``), A = clamp(advantages [B], ±adv_clip_max);
    loss = mean_b[ max(−A·r̃, −A·clip(r̃, 1 − clip_range, 1 + clip_range)) / |dt| ]
           + kl_beta · mean_b KL_b,
    KL_b = mean_d (mean − ref_mean)² / (2·std_dev_t²) (``kl_penalty_image``, not divided by
    |dt|; every published config has kl_beta = 0). The authors divide the batch mean by
    mean_b(sqrt(−dt))² (= |dt| for their shared step); here each sample by its own |dt|.
    The authors' clip ranges are 2e-6 (ocr, geneval) and 4e-6 (pickscore), not Flow-GRPO's 1e-4.

    Metrics (detached): clipfrac, clipfrac_gt_one, clipfrac_lt_one and ratio_mean on r̃, as
    the authors log them; approx_kl_k2 = 0.5·mean((log p_θ − log p_old)²), their "approx_kl",
    on the plain ratio; approx_kl (k1, plain ratio); log_ratio_mean (mean log r̃);
    policy_loss; kl_loss when ref_mean is given.
    """
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    if advantages.shape != log_prob.shape:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} and log_prob {tuple(log_prob.shape)} differ"
        )
    if kl_beta > 0 and ref_mean is None:
        raise ValueError("kl_beta > 0 needs ref_mean (the reference policy's step mean)")
    log_ratio = normalized_log_ratio(
        log_prob,
        old_log_prob,
        mean,
        old_mean,
        std_dev_t,
        dt,
        sde_type=sde_type,
        bias_reduce=bias_reduce,
    )
    compute = log_ratio.dtype
    abs_dt = -_per_sample(dt, log_prob.shape[0], "dt", log_prob.device).to(compute)
    adv = advantages.to(compute).clamp(-adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = (torch.maximum(unclipped, clipped) / abs_dt).mean()  # :929-932
    loss = policy_loss
    kl = None
    if ref_mean is not None:
        kl = kl_penalty_image(mean, ref_mean, std_dev_t).mean()  # :934-937
        if kl_beta > 0:
            loss = loss + kl_beta * kl

    with torch.no_grad():
        plain = log_prob.to(compute) - old_log_prob.to(compute)
        metrics = {
            "policy_loss": policy_loss.detach(),
            "clipfrac": ((ratio - 1.0).abs() > clip_range).float().mean(),
            "clipfrac_gt_one": (ratio - 1.0 > clip_range).float().mean(),
            "clipfrac_lt_one": (1.0 - ratio > clip_range).float().mean(),
            "ratio_mean": ratio.mean(),
            "log_ratio_mean": log_ratio.mean(),
            "approx_kl": (-plain).mean(),
            "approx_kl_k2": 0.5 * (plain**2).mean(),
        }
        if kl is not None:
            metrics["kl_loss"] = kl.detach()
    return loss, metrics


# -- the algorithm ---------------------------------------------------------------------------

KEYS = (
    "loss",
    "policy_loss",
    "kl",
    "approx_kl",
    "approx_kl_k2",
    "clipfrac",
    "ratio_mean",
    "log_ratio_mean",
)


@dataclass
class GRPOGuardConfig(FlowGRPOConfig):
    """Flow-GRPO's settings with the authors' clip range, and how the ratio's shift is
    averaged."""

    clip_range: float = setting(
        2e-6,
        "Clip epsilon of the normalised ratio (the authors: 2e-6 for OCR and GenEval, 4e-6 for "
        "PickScore).",
        check=gt(0),
    )
    bias_reduce: str = setting(
        "sample",
        "The normalised ratio's mean shift: per sample (`sample`, what the authors intended: "
        "flow_grpo issue #244) or one number per micro-batch (`batch`, legacy: their published "
        "script).",
        check=one_of(*BIAS_REDUCTIONS),
    )


class GRPOGuard(FlowGRPO):
    name = "grpo_guard"
    settings_class = GRPOGuardConfig

    uses_step_means = True  # its normalised ratio is the 'sde' step's

    @property
    def keys(self) -> tuple[str, ...]:
        return KEYS

    def step_loss(self, sub: Trajectory, adv: torch.Tensor, k: int) -> list[torch.Tensor]:
        """[loss, policy_loss, kl, approx_kl, approx_kl_k2, clipfrac, ratio_mean,
        log_ratio_mean] of trained step k (means over the micro-batch)."""
        s = self.settings
        out, ref_mean = self.policy_and_reference(sub, k)
        loss, m = grpo_guard_loss(
            out.log_prob,
            sub.log_probs[:, k],
            out.prev_sample_mean,
            sub.means[:, k],
            out.std_dev_t,
            sub.sigmas_next[:, k] - sub.sigmas[:, k],
            adv,
            clip_range=s.clip_range,
            adv_clip_max=s.adv_clip_max,
            bias_reduce=s.bias_reduce,
            kl_beta=s.kl_beta,
            ref_mean=ref_mean,
        )
        kl = m.get("kl_loss", torch.zeros((), device=loss.device))
        return [loss, m["policy_loss"], kl, *(m[key] for key in KEYS[3:])]


__all__ = ["GRPOGuard", "GRPOGuardConfig", "grpo_guard_loss", "normalized_log_ratio"]
