"""Pure tensor math of Flow-GRPO: SDE steps with log-probs, advantages, losses (imports torch only)."""

from flowgrpo.algo.advantages import (
    CombinedRewards,
    combine_rewards,
    group_advantages,
    reward_stats,
    zero_std_ratio,
)
from flowgrpo.algo.losses import flow_grpo_loss, kl_penalty_image
from flowgrpo.algo.sde import SDE_TYPES, SDEStepOutput, sde_step_with_logprob

__all__ = [
    "SDE_TYPES",
    "CombinedRewards",
    "SDEStepOutput",
    "combine_rewards",
    "flow_grpo_loss",
    "group_advantages",
    "kl_penalty_image",
    "reward_stats",
    "sde_step_with_logprob",
    "zero_std_ratio",
]
