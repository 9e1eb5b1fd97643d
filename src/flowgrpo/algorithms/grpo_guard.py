"""GRPO-Guard (Wang et al., arXiv 2510.22319): Flow-GRPO with regulated clipping.

Flow-GRPO's importance ratio drifts below 1 in expectation (its log-prob mean over dimensions
shifts with the step's noise scale), so clipping stops guarding against over-optimization. The
authors' fix (flow_grpo commit 2e2f712, scripts/train_sd3_GRPO_Guard.py): normalise the log
ratio with the step's own mean shift and scale, and divide each step's loss by |dt| so every
step weighs alike. The rollout records each trained step's Gaussian mean (the old policy's);
the rest is Flow-GRPO's loop. The math: ``flowgrpo.algo.grpo_guard``; docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowgrpo.algo.grpo_guard import grpo_guard_loss
from flowgrpo.algorithms.base import RolloutPlan
from flowgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from flowgrpo.rollout import Trajectory
from flowgrpo.settings import gt, need, one_of, setting

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
        check=one_of("batch", "sample"),
    )


class GRPOGuard(FlowGRPO):
    name = "grpo_guard"

    @classmethod
    def check_config(cls, cfg) -> None:  # noqa: D102 - its normalised ratio is the 'sde' step's
        super().check_config(cfg)
        s = cfg.sample
        need(s.sde_type == "sde", "sample.sde_type", "'sde' with algorithm=grpo_guard", s.sde_type)

    def rollout_plan(self, step: int) -> RolloutPlan:
        plan = super().rollout_plan(step)
        if plan.sde_type != "sde":
            raise ValueError(
                f"grpo_guard needs sample.sde_type=sde (its ratio is the 'sde' step's), "
                f"got {plan.sde_type!r}"
            )
        plan.record_means = True
        return plan

    def update(self, trajectory, advantages, *, step, sample_seeds):  # noqa: D102
        if trajectory.means is None:
            raise ValueError("grpo_guard trains on a rollout that recorded its step means")
        return super().update(trajectory, advantages, step=step, sample_seeds=sample_seeds)

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


__all__ = ["GRPOGuard", "GRPOGuardConfig"]
