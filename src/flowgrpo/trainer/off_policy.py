"""One-step-off-policy rollouts (``trainer.off_policy_steps=1``): the scheduling, apart from the
loop.

Let W_t be the weights after update t (W_0 the initial ones). On-policy, step t samples with
W_{t-1}. Off-policy, step t + 1's rollout is sampled during step t, before update t, i.e. with
W_{t-1} (the behaviour policy): step 1 samples on-policy (staleness 0), every later step trains
on samples one update old (staleness 1). The rollout records the behaviour policy's log-probs,
and the algorithms whose ratio is taken against them stay correct (``Algorithm.
off_policy_refusal`` says which do, and why).

Two schedules, the same math: by default the rollout of step t + 1 is done *sequentially*,
before update t, with the live weights; with ``trainer.off_policy_overlap`` (one process) it
runs in a thread beside update t, on a second copy of the model (``PolicyCopy``) holding the
pre-update weights. Which weights sample is what the algorithm's ``rollout_weights`` puts in
the model (the live weights, the EMA, DiffusionNFT's old policy, DPO's reference): their
trained params are copied at that moment (the CPU measurement: docs/algorithms.md).

Resume is exact without saving a trajectory: the params that sampled step t + 1 (inside
``rollout_weights``) are copied into the engine shadow ``off_policy_behaviour``, which every
checkpoint saves (sharded, like the EMA: one fp32 copy of the *trained* params, small with
LoRA; a full fine-tune pays a full sharded copy, as the EMA does). A run resumed after step t
samples step t + 1 with that copy swapped in (inside ``rollout_weights``, so DPO's reference
switch still applies): bit for bit the rollout the straight run made.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from flowgrpo.engine.ema import local

#: the engine shadow holding the behaviour policy's trained params (checkpointed)
SHADOW = "off_policy_behaviour"
#: ``sample(run, step)``: step's rollout and rewards with the weights in ``run``'s model ->
#: (trajectory, this rank's rewards, reward seconds)
Sample = Callable[[Any, int], tuple[Any, Any, float]]


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


class PolicyCopy:
    """A second copy of the model (built and loaded like the trained one, no reference, no
    optimizer state) that samples the next step in a thread while the update runs
    (``trainer.off_policy_overlap``); before each rollout it takes the behaviour policy's
    trained params. One process only: the copy's FSDP collectives would otherwise run beside
    the update's on the same process group."""

    def __init__(self, run: Any) -> None:
        from flowgrpo.engine.engine import DiffusersFSDPEngine
        from flowgrpo.settings import ConfigError
        from flowgrpo.trainer import setup

        cfg, dist = run.cfg, run.dist
        if dist.world_size > 1:
            raise ConfigError(
                f"config key 'trainer.off_policy_overlap' must be false with {dist.world_size} "
                "processes (the copy's collectives would run beside the update's); the "
                "sequential schedule is the same math"
            )
        self.adapter = setup.build_adapter_for(cfg, dist)
        declared = self.adapter.engine_declarations()
        self.engine = DiffusersFSDPEngine(self.adapter, cfg, dist, declared=declared)
        if self.engine.param_names != run.engine.param_names:
            raise RuntimeError("the policy copy's trained params differ from the model's")
        setup.prepare_prompt_cache(cfg, self.adapter, dist, [run.train_data.prompts])

    @torch.no_grad()
    def load(self, values: list[torch.Tensor]) -> None:
        """The copy's trained params <- ``values`` (the behaviour shadow's, same order)."""
        for p, v in zip(self.engine.params, values, strict=True):
            local(p).copy_(local(v))

    def view(self, run: Any) -> Any:
        """``run`` as the rollout sees it, sampling with the copy (its checkpoint as now)."""
        out = copy.copy(run)
        out.adapter = self.adapter
        return out


class OffPolicy:
    """The step's rollout, on- or one-step-off-policy. Build it before a checkpoint loads
    (its shadow must exist to be restored). ``sample(run, step)`` is the rollout and scoring
    of ``step`` with the weights in ``run``'s model; ``run.algorithm.rollout_weights()`` puts
    the weights that sample there. With a ``PolicyCopy`` the next step samples in a thread."""

    def __init__(self, engine: Any, steps: int, policy_copy: PolicyCopy | None = None) -> None:
        if steps not in (0, 1):
            raise ValueError(f"off_policy_steps must be 0 or 1, got {steps}")
        self.steps = steps
        self.behaviour = engine.shadow(SHADOW) if steps else None
        self.pending: Sampled | None = None
        self.copy = policy_copy
        self.worker: Future | None = None
        self._pool = ThreadPoolExecutor(1, "off-policy-rollout") if policy_copy else None

    def take(self, step: int, run: Any, sample: Sample) -> Sampled:
        """Step ``step``'s rollout: the one sampled during the previous step; else (step 1,
        on-policy, or the first step after a resume) sampled now, a resumed off-policy run
        with the checkpoint's behaviour policy."""
        self.join()
        if self.pending is not None:
            if self.pending.step != step:
                raise RuntimeError(
                    f"the pending rollout is step {self.pending.step}'s, not {step}'s"
                )
            out, self.pending = self.pending, None
            out.now = False
            return out
        if self.steps and step > 1:  # resumed: the checkpoint's behaviour policy samples
            with run.algorithm.rollout_weights(), self.behaviour.swapped():
                return self._sample(step, run, sample, staleness=1)
        with run.algorithm.rollout_weights():
            return self._sample(step, run, sample, staleness=0)

    def prefetch(self, step: int, last: int, run: Any, sample: Sample) -> Sampled | None:
        """Before update ``step``: sample step + 1 (none after the ``last`` step) and keep the
        params that sample it (the shadow; also at the last step, so that a run resumed
        from its checkpoint with more steps samples step + 1 as a longer straight run does).
        Returns what it sampled now (None: nothing, on-policy, at the last step, or started
        in the thread: ``join`` waits for it)."""
        if not self.steps:
            return None
        with run.algorithm.rollout_weights():
            self.behaviour.reset_()
            if step < last and self.copy is None:
                self.pending = self._sample(step + 1, run, sample, staleness=1)
                return self.pending
        if step < last:  # overlapped: the copy samples with the behaviour params
            self.copy.load(self.behaviour.shadow)
            view = self.copy.view(run)
            self.worker = self._pool.submit(self._sample, step + 1, view, sample, 1)
        return None

    def join(self) -> float:
        """Wait for the rollout sampling in the thread (its error is raised here); returns
        its wall seconds (0: none was running)."""
        if self.worker is None:
            return 0.0
        worker, self.worker = self.worker, None
        self.pending = worker.result()
        return self.pending.wall_s

    @staticmethod
    def _sample(step: int, run: Any, sample: Sample, staleness: int) -> Sampled:
        t = time.perf_counter()
        traj, rewards, reward_s = sample(run, step)
        return Sampled(step, traj, rewards, reward_s, time.perf_counter() - t, staleness)


__all__ = ["SHADOW", "OffPolicy", "PolicyCopy", "Sampled"]
