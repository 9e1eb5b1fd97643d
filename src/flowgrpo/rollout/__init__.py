"""Trajectory sampling with exact per-step log-probabilities, and its training-time twin."""

from flowgrpo.functional.tree import BranchSpec
from flowgrpo.rollout.sampler import (
    SDEWindow,
    Trajectory,
    policy_step,
    sample_trajectories,
    trained_step_count,
    trajectory_log_prob,
)

__all__ = [
    "BranchSpec",
    "SDEWindow",
    "Trajectory",
    "policy_step",
    "sample_trajectories",
    "trained_step_count",
    "trajectory_log_prob",
]
