"""Flow-DPPO (arXiv 2606.11025, "Divergence Proximal Policy Optimization for Flow Matching
Models"): Flow-GRPO's rollout and ratio surrogate, with ratio clipping replaced by a trust region
on the exact divergence between the old and the current policy's Gaussian step.

Both policies' "sde" steps are Gaussians of the same std s = std_t·sqrt(−dt), so their KL is
closed-form: D = mean_d (μ_θ − μ_old)² / (2 s²) (mean over the latent's elements, as the
authors reduce it). The loss is the unclipped −A·ρ, dropped only where the step is outside the
trust region (D ≥ τ) AND still moving away from the old policy in the advantage's direction:

    drop = (D ≥ τ) ∧ [(ρ > 1 ∧ A > 0) ∨ (ρ < 1 ∧ A < 0)],   loss = mean_{b,k} −A·ρ·1[¬drop]

Corrective moves (A > 0, ρ < 1, and the reverse) always pass; within the trust region nothing is
clipped. The rollout records each trained step's Gaussian mean (μ_old).

Transcribed from the two public implementations, which agree on the math:
verl-omni ``FlowDPPOLoss`` (verl_omni/trainer/diffusion/diffusion_algos.py, added in 626ee18
PR #168, unchanged at a1139ba) and UniRL ``_flowdppo_kl_adv_loss``
(unirl/algorithms/flowdppo.py at 1a7b501). Where they differ, this file follows verl-omni:
s is the rollout step's own std (std_dev_t·sqrt_dt, the one its log-prob uses, with the
scheduler's sigma_max in place of sigma = 1), so D is the exact KL of the two transitions;
UniRL recomputes s from the sigmas with sigma clamped to 0.99, which differs only on a trained
first step (sigma = 1). Neither clamps the advantages (Flow-GRPO does) and neither has a
reference KL (``kl_beta`` here, default 0). docs/math.md states the math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowgrpo.algorithms.flow_grpo import FlowGRPO
from flowgrpo.functional.losses import kl_penalty_image
from flowgrpo.models.base import CFG_GRAD_MODES
from flowgrpo.rollout import Trajectory
from flowgrpo.settings import ge, gt, one_of, setting

# -- the math ----------------------------------------------------------------------------------


def flow_dppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std_dev_t: float | torch.Tensor,
    dt: float | torch.Tensor,
    advantages: torch.Tensor,
    *,
    kl_mask_threshold: float,
    add_kl_coefficient: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The divergence-masked policy loss of one micro-batch at one step (scalar, fp32).

    log_prob, old_log_prob, advantages [B]: the "sde" step's log-density of the rollout's next
    latent under the current and the rollout policy, and the advantages (not clamped, as the
    authors); mean, old_mean [B, ...]: the two Gaussians' means; std_dev_t, dt: float or [B],
    std_t as ``sde_step_with_logprob`` returns it (without sqrt(−dt)) and sigma_next − sigma.

    D [B] = mean_d (mean − old_mean)² / (2 s²), s = std_dev_t·sqrt(−dt) (s = 1 with
    ``add_kl_coefficient=False``: the authors' unnormalised option); a sample is dropped when
    D ≥ kl_mask_threshold and (ρ > 1, A > 0) or (ρ < 1, A < 0); loss = mean_b of −A·ρ over
    the kept ones (0 for the dropped, which still count in the mean).

    Metrics (detached): policy_loss, approx_kl (k1: mean(−log ρ)), approx_kl_k2
    (0.5·mean(log ρ²)), ratio_mean, kl_new_old_mean (mean D), kl_mask_fraction (D ≥ τ),
    pos_rm_fraction, neg_rm_fraction, masked_fraction, as the authors log them.
    """
    if kl_mask_threshold <= 0:
        raise ValueError(f"kl_mask_threshold must be > 0, got {kl_mask_threshold}")
    if log_prob.ndim != 1 or log_prob.shape != old_log_prob.shape:
        raise ValueError(
            "log_prob and old_log_prob must both be [B], got "
            f"{tuple(log_prob.shape)} and {tuple(old_log_prob.shape)}"
        )
    if advantages.shape != log_prob.shape:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} and log_prob {tuple(log_prob.shape)} differ"
        )
    batch = log_prob.shape[0]
    if mean.shape != old_mean.shape or mean.shape[0] != batch:
        raise ValueError(
            f"mean {tuple(mean.shape)} and old_mean {tuple(old_mean.shape)} must be [B={batch}, ...]"
        )
    compute = torch.promote_types(log_prob.dtype, torch.float32)
    if add_kl_coefficient:
        std = torch.as_tensor(std_dev_t, dtype=compute, device=log_prob.device).expand(batch)
        dt_ = torch.as_tensor(dt, dtype=compute, device=log_prob.device).expand(batch)
        if bool((dt_ >= 0).any()) or bool((std <= 0).any()):
            raise ValueError("the KL scale needs dt < 0 and std_dev_t > 0 (a stochastic step)")
        scale = std * torch.sqrt(-dt_)
    else:
        scale = torch.ones((), dtype=compute, device=log_prob.device)
    with torch.no_grad():  # the mask only: no gradient flows through D
        kl = kl_penalty_image(mean.detach(), old_mean.detach(), scale)

    log_ratio = log_prob.to(compute) - old_log_prob.to(compute)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(compute)
    unclipped = -adv * ratio
    high = kl >= kl_mask_threshold
    pos_rm = high & (ratio > 1.0) & (adv > 0)
    neg_rm = high & (ratio < 1.0) & (adv < 0)
    keep = ~(pos_rm | neg_rm)
    zero = torch.zeros((), dtype=compute, device=log_prob.device)
    loss = torch.where(keep, unclipped, zero).mean()

    with torch.no_grad():
        metrics = {
            "policy_loss": loss.detach(),
            "approx_kl": (-log_ratio).mean(),
            "approx_kl_k2": 0.5 * (log_ratio**2).mean(),
            "ratio_mean": ratio.mean(),
            "kl_new_old_mean": kl.mean(),
            "kl_mask_fraction": high.float().mean(),
            "pos_rm_fraction": pos_rm.float().mean(),
            "neg_rm_fraction": neg_rm.float().mean(),
            "masked_fraction": (~keep).float().mean(),
        }
    return loss, metrics


# -- the algorithm ---------------------------------------------------------------------------

#: what ``step_loss`` returns, in order
KEYS = (
    "loss",
    "policy_loss",
    "kl",
    "approx_kl",
    "approx_kl_k2",
    "ratio_mean",
    "kl_new_old_mean",
    "kl_mask_fraction",
    "pos_rm_fraction",
    "neg_rm_fraction",
    "masked_fraction",
)


@dataclass
class FlowDPPOConfig:
    """The Flow-DPPO objective: −A·ρ masked outside the KL trust region (+ an optional KL to
    the reference policy, which the authors do not use)."""

    kl_mask_threshold: float = setting(
        1e-5,
        "Trust-region size τ on the per-step KL between the old and the current Gaussian step "
        "(mean over latent elements); the authors' 1e-5 (verl-omni and UniRL).",
        check=gt(0),
    )
    add_kl_coefficient: bool = setting(
        True,
        "Divide the mean drift by the step's std (std_t·sqrt(-dt)): the exact KL; false = "
        "unnormalised squared drift / 2 (the authors' option, default true).",
    )
    kl_beta: float = setting(
        0.0,
        "Weight of KL(policy || reference) (reference = LoRA off / initial weights); 0 = none "
        "(the authors) and no reference forward.",
        check=ge(0),
    )
    cfg_grad: str = setting(
        "both",
        "How the guidance gradient flows: `both` branches (exact) or `cond_only` "
        "(unconditional branch under no_grad).",
        check=one_of(*CFG_GRAD_MODES),
    )
    skip_zero_advantage: bool = setting(
        False,
        "Drop samples whose advantage is exactly 0 before the update (they give no gradient; "
        "they only change the mean's count). The authors keep them.",
    )


class FlowDPPO(FlowGRPO):
    """Flow-GRPO's loop with the divergence-masked loss."""

    name = "flow_dppo"
    settings_class = FlowDPPOConfig

    uses_step_means = True  # the KL and the ratio are the 'sde' step's (the authors' only)

    @property
    def keys(self) -> tuple[str, ...]:
        return KEYS

    def step_loss(self, sub: Trajectory, adv: torch.Tensor, k: int) -> list[torch.Tensor]:
        """[loss, policy_loss, kl, approx_kl, approx_kl_k2, ratio_mean, kl_new_old_mean,
        kl_mask_fraction, pos_rm_fraction, neg_rm_fraction, masked_fraction] of trained step k
        (means over the micro-batch)."""
        s = self.settings
        out, ref_mean = self.policy_and_reference(sub, k)
        policy_loss, m = flow_dppo_loss(
            out.log_prob,
            sub.log_probs[:, k],
            out.prev_sample_mean,
            sub.means[:, k],
            out.std_dev_t,
            sub.sigmas_next[:, k] - sub.sigmas[:, k],
            adv,
            kl_mask_threshold=s.kl_mask_threshold,
            add_kl_coefficient=s.add_kl_coefficient,
        )
        loss = policy_loss
        if ref_mean is not None:
            kl = kl_penalty_image(out.prev_sample_mean, ref_mean, out.std_dev_t).mean()
            loss = loss + s.kl_beta * kl
        else:
            kl = torch.zeros((), device=policy_loss.device)
        return [loss, m["policy_loss"], kl, *(m[key] for key in KEYS[3:])]


__all__ = ["FlowDPPO", "FlowDPPOConfig", "flow_dppo_loss"]
