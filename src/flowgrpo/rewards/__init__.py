"""Rewards: a registry of built-ins (by name) and user functions (by import path), multi-reward
evaluation with validation, async scoring, and a remote client/server. Heavy modules (OCR,
CLIP) are imported only when their reward is built."""

from flowgrpo.rewards.base import (
    AsyncRewardScorer,
    MultiReward,
    RewardFn,
    RewardFuture,
    build_reward,
    is_pairwise,
    register_reward,
    registered_rewards,
    validate_images,
)
from flowgrpo.rewards.spec import RewardSpec, check_labels, parse_reward_specs

__all__ = [
    "AsyncRewardScorer",
    "MultiReward",
    "RewardFn",
    "RewardFuture",
    "RewardSpec",
    "build_reward",
    "check_labels",
    "is_pairwise",
    "parse_reward_specs",
    "register_reward",
    "registered_rewards",
    "validate_images",
]
