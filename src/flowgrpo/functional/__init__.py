"""The math the algorithms share (imports torch only): Flow-GRPO's SDE steps with log-probs,
group-relative advantages, the clipped policy loss and KL, and the sampler's ODE math (the
DPM-Solver++ 2M step, the fixed-shift sigma grid) and the branching rollouts' tree (its
advantage estimators and pruning). Each algorithm's own math lives in its file
under ``flowgrpo.algorithms``."""

from flowgrpo.functional.advantages import (
    CombinedRewards,
    combine_rewards,
    group_advantages,
    group_pairs,
    preference_advantages,
    reward_stats,
    win_rates,
    zero_std_ratio,
)
from flowgrpo.functional.dpm_solver import DPMSolverStep, dpm_solver_2m_step
from flowgrpo.functional.losses import flow_grpo_loss, kl_penalty_image
from flowgrpo.functional.sde import SDE_TYPES, SDEStepOutput, sde_step_with_logprob
from flowgrpo.functional.time_shift import time_shift_grid
from flowgrpo.functional.tree import BranchSpec, train_mask, tree_advantages

__all__ = [
    "SDE_TYPES",
    "BranchSpec",
    "CombinedRewards",
    "DPMSolverStep",
    "SDEStepOutput",
    "combine_rewards",
    "dpm_solver_2m_step",
    "flow_grpo_loss",
    "group_advantages",
    "group_pairs",
    "kl_penalty_image",
    "preference_advantages",
    "reward_stats",
    "sde_step_with_logprob",
    "time_shift_grid",
    "train_mask",
    "tree_advantages",
    "win_rates",
    "zero_std_ratio",
]
