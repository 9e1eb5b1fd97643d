"""Pure tensor math of the RL algorithms (imports torch only): Flow-GRPO's SDE steps with
log-probs, advantages and losses; MixGRPO's window and ODE solver; GRPO-Guard's normalised
ratio; DiffusionNFT's forward-process loss."""

from flowgrpo.algo.advantages import (
    CombinedRewards,
    combine_rewards,
    group_advantages,
    reward_stats,
    zero_std_ratio,
)
from flowgrpo.algo.grpo_guard import grpo_guard_loss, normalized_log_ratio
from flowgrpo.algo.losses import flow_grpo_loss, kl_penalty_image
from flowgrpo.algo.mix_grpo import (
    DPMSolverStep,
    dpm_solver_2m_step,
    flash_schedule,
    sde_window_at,
)
from flowgrpo.algo.nft import (
    forward_noising,
    nft_loss,
    old_policy_decay,
    optimality_probability,
    update_old_policy_,
)
from flowgrpo.algo.sde import SDE_TYPES, SDEStepOutput, sde_step_with_logprob

__all__ = [
    "SDE_TYPES",
    "CombinedRewards",
    "DPMSolverStep",
    "SDEStepOutput",
    "combine_rewards",
    "dpm_solver_2m_step",
    "flash_schedule",
    "flow_grpo_loss",
    "forward_noising",
    "group_advantages",
    "grpo_guard_loss",
    "kl_penalty_image",
    "nft_loss",
    "normalized_log_ratio",
    "old_policy_decay",
    "optimality_probability",
    "reward_stats",
    "sde_step_with_logprob",
    "sde_window_at",
    "update_old_policy_",
    "zero_std_ratio",
]
