"""One-step-off-policy rollouts (``trainer.off_policy_steps=1``): the scheduling, apart from the
loop.

Let W_t be the weights after update t (W_0 the initial ones). On-policy, step t samples with
W_{t-1}. Off-policy, step t + 1's rollout is sampled during step t, before update t, i.e. with
W_{t-1} (the behaviour policy): step 1 samples on-policy (staleness 0), every later step trains
on samples one update old (staleness 1). The rollout records the behaviour policy's log-probs,
and the algorithms whose ratio is taken against them stay correct (``Algorithm.
off_policy_refusal`` says which do, and why).

The rollout of step t + 1 is done *sequentially*, before update t, with the live weights: the
same math as overlapping it with the update on a copy of the pre-update weights (the CPU
measurement in docs/algorithms.md: on 2 cores the overlap has nothing to gain). Which weights
sample is what the algorithm's ``rollout_weights`` puts in the model (the live weights, the
EMA, DiffusionNFT's old policy, DPO's reference).

Resume is exact without saving a trajectory: the params that sampled step t + 1 (inside
``rollout_weights``) are copied into the engine shadow ``off_policy_behaviour``, which every
checkpoint saves (sharded, like the EMA: one fp32 copy of the *trained* params, small with
LoRA; a full fine-tune pays a full sharded copy, as the EMA does). A run resumed after step t
samples step t + 1 with that copy swapped in (inside ``rollout_weights``, so DPO's reference
switch still applies): bit for bit the rollout the straight run made.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: the engine shadow holding the behaviour policy's trained params (checkpointed)
SHADOW = "off_policy_behaviour"


@dataclass
class Sampled:
    """One step's rollout and its scores: ``rollout_and_score``'s (trajectory, this rank's
    rewards, reward seconds), its wall seconds (reward included) and its staleness (how many
    updates the weights that sampled it lag the trained ones); ``now``: sampled in the step
    that trains on it (else during the previous step, whose times counted it)."""

    step: int
    trajectory: Any
    rewards: dict[str, Any] | None
    reward_s: float
    wall_s: float
    staleness: int
    now: bool = True


class OffPolicy:
    """The step's rollout, on- or one-step-off-policy. Build it before a checkpoint loads
    (its shadow must exist to be restored). ``sample(step)`` is the rollout and scoring of
    ``step`` with the weights in the model; ``rollout_weights()`` the algorithm's context."""

    def __init__(self, engine: Any, steps: int) -> None:
        if steps not in (0, 1):
            raise ValueError(f"off_policy_steps must be 0 or 1, got {steps}")
        self.steps = steps
        self.behaviour = engine.shadow(SHADOW) if steps else None
        self.pending: Sampled | None = None

    def take(
        self,
        step: int,
        sample: Callable[[int], tuple[Any, Any, float]],
        rollout_weights: Callable[[], Any],
    ) -> Sampled:
        """Step ``step``'s rollout: the one sampled during the previous step; else (step 1,
        on-policy, or the first step after a resume) sampled now, a resumed off-policy run
        with the checkpoint's behaviour policy."""
        if self.pending is not None:
            if self.pending.step != step:
                raise RuntimeError(
                    f"the pending rollout is step {self.pending.step}'s, not {step}'s"
                )
            out, self.pending = self.pending, None
            out.now = False
            return out
        if self.steps and step > 1:  # resumed: the checkpoint's behaviour policy samples
            with rollout_weights(), self.behaviour.swapped():
                return self._sample(step, sample, staleness=1)
        with rollout_weights():
            return self._sample(step, sample, staleness=0)

    def prefetch(
        self,
        step: int,
        last: int,
        sample: Callable[[int], tuple[Any, Any, float]],
        rollout_weights: Callable[[], Any],
    ) -> Sampled | None:
        """Before update ``step``: sample step + 1 (none after the ``last`` step) and keep the
        params that sampled it (the shadow; also at the last step, so that a run resumed
        from its checkpoint with more steps samples step + 1 as a longer straight run does).
        Returns what it sampled (None: nothing, on-policy or at the last step)."""
        if not self.steps:
            return None
        with rollout_weights():
            self.behaviour.reset_()
            if step < last:
                self.pending = self._sample(step + 1, sample, staleness=1)
        return self.pending

    @staticmethod
    def _sample(
        step: int, sample: Callable[[int], tuple[Any, Any, float]], staleness: int
    ) -> Sampled:
        t = time.perf_counter()
        traj, rewards, reward_s = sample(step)
        return Sampled(step, traj, rewards, reward_s, time.perf_counter() - t, staleness)


__all__ = ["SHADOW", "OffPolicy", "Sampled"]
