"""Flow-GRPO (Liu et al., arXiv 2505.05470): the clipped policy-gradient loss on the SDE
rollout's recorded steps, with an optional KL to the reference policy.

Per micro-batch and trained step k: recompute log p_theta(x_{k+1} | x_k) through the rollout's
own ``policy_step`` (the guidance gradient through both branches unless ``cfg_grad`` says
``cond_only``), the ratio to the rollout's log-prob, the clipped surrogate, plus
kl_beta * KL(mean_theta, mean_ref). Samples whose advantage is exactly 0 are dropped first
(``skip_zero_advantage``), as flow_grpo does. docs/math.md states the math.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from flowgrpo.algorithms.base import Algorithm, RolloutPlan
from flowgrpo.functional.losses import flow_grpo_loss, kl_penalty_image
from flowgrpo.functional.sde import SDEStepOutput
from flowgrpo.functional.tree import train_mask, tree_advantages
from flowgrpo.models.base import CFG_GRAD_MODES
from flowgrpo.rollout import Trajectory, trajectory_log_prob
from flowgrpo.settings import ge, gt, need, one_of, setting

#: what ``micro_loss`` returns, in order
KEYS = ("loss", "policy_loss", "kl", "approx_kl", "approx_kl_k2", "clipfrac", "ratio_mean")


@dataclass
class FlowGRPOConfig:
    """The Flow-GRPO objective: clipped surrogate + kl_beta * KL(policy || reference)."""

    clip_range: float = setting(
        1e-4,
        "PPO ratio clip epsilon (log-probs are per-dimension means, hence tiny).",
        check=gt(0),
    )
    adv_clip_max: float = setting(5.0, "Advantages are clamped to +-this.", check=gt(0))
    kl_beta: float = setting(
        0.0,
        "Weight of KL(policy || reference) (reference = LoRA off / initial weights); 0 = no KL "
        "and no reference forward.",
        check=ge(0),
    )
    cfg_grad: str = setting(
        "both",
        "How the guidance gradient flows: `both` branches (exact) or `cond_only` "
        "(unconditional branch under no_grad: cheaper, biased; the original paper's form).",
        check=one_of(*CFG_GRAD_MODES),
    )
    skip_zero_advantage: bool = setting(
        True,
        "Drop samples whose advantage is exactly 0 (groups with equal rewards) before the "
        "update, as flow_grpo does; the loss is the mean over the kept samples.",
    )


class FlowGRPO(Algorithm):
    """The default algorithm."""

    name = "flow_grpo"
    settings_class = FlowGRPOConfig
    #: its loss needs each trained step's Gaussian mean, recorded by an 'sde' rollout (a
    #: subclass whose ratio or KL is the 'sde' step's sets it: the rule lives here once)
    uses_step_means: ClassVar[bool] = False
    supports_branching = True
    #: off-policy rollouts (``trainer.off_policy_steps=1``) are right as is: the ratio is taken
    #: against the log-probs the rollout recorded, i.e. the behaviour policy's, so it is the
    #: importance weight of the samples whoever drew them (the clip bounds it); the subclasses
    #: (mix_grpo, grpo_guard, flow_dppo) take their ratios against the same recorded log-probs,
    #: and the step means they record (``record_means``: Flow-DPPO's KL trust region) are the
    #: behaviour policy's too
    off_policy_refusal = None

    @classmethod
    def check_config(cls, cfg) -> None:
        """Its policy gradient is the ratio of SDE log-probs: a deterministic rollout
        (``sample.noise_level=0``) trains nothing and would fail in backward."""
        s = cfg.sample
        need(
            s.noise_level > 0,
            "sample.noise_level",
            f"> 0 with algorithm={cfg.algorithm} (its policy gradient needs stochastic "
            "steps: with 0 the rollout is deterministic and nothing trains)",
            s.noise_level,
        )
        if cls.uses_step_means:
            need(
                s.sde_type == "sde",
                "sample.sde_type",
                f"'sde' with algorithm={cfg.algorithm}",
                s.sde_type,
            )

    def rollout_plan(self, step: int) -> RolloutPlan:
        """The sample section's rollout; recording each trained step's mean when the loss
        uses them."""
        plan = super().rollout_plan(step)
        if self.uses_step_means:
            if plan.sde_type != "sde":
                raise ValueError(
                    f"{self.name} needs sample.sde_type=sde (its loss uses the 'sde' step's "
                    f"means), got {plan.sde_type!r}"
                )
            plan.record_means = True
        return plan

    @property
    def keys(self) -> tuple[str, ...]:
        """The names of what ``step_loss`` returns, in order."""
        return KEYS

    def kept_rows(self, advantages: torch.Tensor) -> torch.Tensor:
        """The local samples to train on: all, or those with a non-zero advantage."""
        if self.settings.skip_zero_advantage:
            return (advantages.cpu() != 0).nonzero().squeeze(1)
        return torch.arange(len(advantages))

    def check(self, trajectory: Trajectory) -> None:
        if self.uses_step_means and trajectory.means is None:
            raise ValueError(f"{self.name} trains on a rollout that recorded its step means")
        if self.settings.kl_beta > 0 and (
            trajectory.noise_level <= 0 or trajectory.sde_type == "ode"
        ):
            raise ValueError(
                f"{self.name}.kl_beta > 0 needs a stochastic trajectory (noise_level > 0, sde/cps)"
            )

    def update(
        self,
        trajectory: Trajectory,
        advantages: torch.Tensor,
        *,
        step: int,
        sample_seeds: Sequence[int],
    ) -> dict[str, float]:
        """Optimizer steps on this rank's rollout. Returns global means of the loss terms,
        grad_norm, lr, skipped; optimizer_steps; samples_trained / samples_dropped (global).
        A branching rollout (``trajectory.branching``) trains each tree edge once, with its
        own advantage (``tree_update``)."""
        batch = len(trajectory)
        adv = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)
        if adv.numel() != batch:
            raise ValueError(f"got {adv.numel()} advantages for a trajectory of {batch} samples")
        if batch < self.cfg.update.num_minibatches:
            raise ValueError(
                f"{batch} samples cannot fill {self.cfg.update.num_minibatches} minibatches"
            )
        self.check(trajectory)
        adv = adv.to(trajectory.latents.device)
        if trajectory.branching is not None:
            return self.tree_update(trajectory, adv)
        rows = self.kept_rows(adv)

        def micro_loss(sub, index, scale, k):
            return self.step_loss(sub, adv[index.to(adv.device)] * scale, k)

        steps, total = self.update_loop(
            trajectory, rows, self.keys, micro_loss, trajectory.num_train_steps
        )
        out = self.summarize(steps, self.keys)
        out["samples_trained"] = float(total)
        out["samples_dropped"] = float(batch * self.engine.dp_size - total)
        return out

    def tree_update(self, trajectory: Trajectory, leaf_adv: torch.Tensor) -> dict[str, float]:
        """The update on a branching rollout: the leaves' group advantages [B] become one
        advantage per edge (``sample.branching.estimator`` / ``fusion``, ``functional.tree``); each
        edge trains once (from its first row), less the pruned ones and, with
        ``skip_zero_advantage``, those whose advantage is 0 (every edge before a tree's first
        split under ``depth``). The edges, whatever their step, are packed into micro-batches
        as one-step samples (``Trajectory.cells``), so a tree's shared steps cost one forward
        each; each optimizer step's loss is the mean over its edges on all ranks. Adds
        ``tree_edges_trained`` (all ranks)."""
        spec, b = trajectory.branching, self.cfg.sample.branching
        batch, num_steps = len(trajectory), trajectory.num_train_steps
        edge_adv = tree_advantages(
            leaf_adv, trajectory.log_probs, spec, estimator=b.estimator, fusion=b.fusion
        )
        active = train_mask(
            edge_adv,
            spec,
            prune_steps=tuple(b.prune_steps),
            width=b.width_pruning,
            width_ratio=b.width_ratio,
        )
        if self.settings.skip_zero_advantage:
            active &= edge_adv != 0
        cells = active.nonzero()  # [C, 2]: (row, trained step), each edge once
        pad = cells if len(cells) else torch.zeros(1, 2, dtype=torch.long)  # plan's padding row
        flat = trajectory.cells(pad[:, 0], pad[:, 1])
        flat_adv = edge_adv[pad[:, 0], pad[:, 1]].to(trajectory.latents.device)

        def micro_loss(sub, index, scale, k):
            return self.step_loss(sub, flat_adv[index.to(flat_adv.device)] * scale, 0)

        rows = torch.arange(len(cells))
        steps, edges = self.update_loop(flat, rows, self.keys, micro_loss, 1)
        out = self.summarize(steps, self.keys)
        trees = active.reshape(-1, spec.leaves, num_steps).any(dim=(1, 2))
        kept = self.engine.mean_over_ranks(torch.tensor([float(trees.sum() * spec.leaves)]))
        out["samples_trained"] = float(kept[0]) * self.engine.dp_size
        out["samples_dropped"] = float(batch * self.engine.dp_size) - out["samples_trained"]
        out["tree_edges_trained"] = float(edges)
        return out

    def policy_and_reference(
        self, sub: Trajectory, k: int
    ) -> tuple[SDEStepOutput, torch.Tensor | None]:
        """Step k of the micro-batch ``sub`` recomputed under the trained weights (with grad;
        guidance per ``cfg_grad``), and the reference policy's step mean when there is a KL
        term (else None)."""
        ref_mean = None
        if self.settings.kl_beta > 0:
            with torch.no_grad(), self.engine.reference_transformer() as ref:
                ref_mean = trajectory_log_prob(self.adapter, ref, sub, k).prev_sample_mean
        out = trajectory_log_prob(
            self.adapter, self.engine.model, sub, k, cfg_grad=self.settings.cfg_grad
        )
        return out, ref_mean

    def step_loss(self, sub: Trajectory, adv: torch.Tensor, k: int) -> list[torch.Tensor]:
        """[loss, policy_loss, kl, approx_kl, approx_kl_k2, clipfrac, ratio_mean] of trained
        step k for the micro-batch ``sub`` (means over it)."""
        s = self.settings
        out, ref_mean = self.policy_and_reference(sub, k)
        policy_loss, m = flow_grpo_loss(
            out.log_prob,
            sub.log_probs[:, k],
            adv,
            clip_range=s.clip_range,
            adv_clip_max=s.adv_clip_max,
        )
        loss = policy_loss
        if ref_mean is not None:
            kl = kl_penalty_image(out.prev_sample_mean, ref_mean, out.std_dev_t).mean()
            loss = loss + s.kl_beta * kl
        else:
            kl = torch.zeros((), device=policy_loss.device)
        return [loss, policy_loss, kl, *(m[key] for key in KEYS[3:])]


__all__ = ["CFG_GRAD_MODES", "FlowGRPO", "FlowGRPOConfig"]
