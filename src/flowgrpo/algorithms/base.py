"""What every RL algorithm provides, and the update loop they share.

An algorithm is one module (``flow_grpo``, ``nft``, ...: the registry
``flowgrpo.algorithms.ALGORITHMS`` lists them) and one line in that registry: its settings (``settings_class``, the config section
of its name) and the rules it needs of the whole config (``check_config``), what its rollout
records (``rollout_plan``), which weights sample it (``rollout_weights``), its advantages from
the rewards' scores (``advantages``), its math, its loss on a micro-batch and its update over a
rollout (``update``). It drives the engine's primitives (``plan``, ``backward``,
``optimizer_step``, ``reference_transformer``, ``shadow``) and never touches FSDP; adapters know
nothing of it. The trainer's step reads: sample -> reward (scores) -> ``algorithm.advantages``
-> ``algorithm.update``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from flowgrpo.functional.advantages import CombinedRewards, combine_rewards
from flowgrpo.functional.time_shift import time_shift_grid
from flowgrpo.rollout import BranchSpec, SDEWindow, Trajectory, trained_step_count
from flowgrpo.settings import ge, setting


@dataclass
class UpdateConfig:
    """The policy update after each rollout: optimizer steps and the micro-batch size."""

    micro_batch_size: int = setting(4, "Samples per forward/backward in the update.", check=ge(1))
    num_minibatches: int = setting(
        2,
        "Optimizer steps per rollout (the global batch is split in this many parts).",
        check=ge(1),
    )


@dataclass
class RolloutPlan:
    """How a training rollout samples and what it records (the sample section's values unless
    the algorithm changes them). ``sigmas``: a custom grid [N + 1] (else the pipeline's);
    ``ode_solver``: "euler", or "dpm2" (DPM-Solver++ 2M) for the ODE steps after the SDE
    window; ``record_means``: keep each trained step's Gaussian mean (the old policy's);
    ``train``: False when this step has nothing to train (the update is skipped);
    ``num_frames``: frames per video (None: the adapter's default, or an image family);
    ``branching``: each group one tree (``sample.branching``), None for independent samples."""

    num_steps: int
    guidance_scale: float
    noise_level: float
    sde_type: str
    sde_window: SDEWindow | None
    timestep_fraction: float
    deterministic_last_step: bool
    sigmas: torch.Tensor | None = None
    ode_solver: str = "euler"
    record_means: bool = False
    num_frames: int | None = None
    branching: BranchSpec | None = None
    train: bool = True

    def sampler_kwargs(self) -> dict[str, Any]:
        """The plan as keyword arguments of ``sample_trajectories`` (every field but train)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "train"}


class Algorithm(ABC):
    """One RL algorithm over the shared adapters, sampler and engine."""

    #: the name in ``algorithm=<name>`` and the config section holding its settings
    name: ClassVar[str]
    #: the dataclass of its settings (the config section ``name``)
    settings_class: ClassVar[type]
    #: the engine shadows (fp32 copies of the trained parameters) it keeps besides the EMA,
    #: by name: the memory planner counts them
    shadows: ClassVar[tuple[str, ...]] = ()
    #: it trains on the SDE rollout's per-step log-probs, so it can take branching rollouts
    #: (``sample.branching``: one advantage per tree edge)
    supports_branching: ClassVar[bool] = False
    #: why its update would be wrong on a one-step-off-policy rollout
    #: (``trainer.off_policy_steps=1``: sampled by the weights before the previous update),
    #: or None when it is right as is (each algorithm says why in its docstring)
    off_policy_refusal: ClassVar[str | None] = "its update has not been checked off-policy"

    def __init__(self, cfg: Any, engine: Any, adapter: Any) -> None:
        self.cfg, self.engine, self.adapter = cfg, engine, adapter
        self.settings = getattr(cfg, self.name)

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """Refuse (one-line ConfigError) settings of the whole config that this algorithm would
        otherwise ignore or cannot run; called by ``Config.check`` before anything loads."""
        return None

    @classmethod
    def overlap_refusal(cls, cfg: Any) -> str | None:
        """Why its rollouts cannot sample on a copy of the model (``trainer.
        off_policy_overlap``: the copy gets the trained params that ``rollout_weights`` puts
        in the model), or None: they can (the live weights, the EMA, a shadow swapped in)."""
        return None

    @staticmethod
    def needs_reference(settings: Any) -> bool:
        """Whether the update reads a reference policy (a KL term): a full fine-tune then keeps
        a frozen copy of the initial weights."""
        return getattr(settings, "kl_beta", 0.0) > 0

    @classmethod
    def eval_guidance_scale(cls, cfg: Any) -> float:
        """The eval guidance when ``sample.eval_guidance_scale`` is null: the rollouts'."""
        return cfg.sample.guidance_scale

    def advantages(
        self,
        rewards: Mapping[str, torch.Tensor],
        weights: Mapping[str, float],
        group_ids: Sequence[Hashable] | torch.Tensor,
    ) -> CombinedRewards:
        """The global batch's scores {name: [N]} and their ``weights`` -> the weighted reward
        and the advantages [N] the update trains on: group-relative, combined as
        ``advantage.mode`` says, std per ``advantage.global_std`` (``combine_rewards``)."""
        a = self.cfg.advantage
        return combine_rewards(rewards, weights, group_ids, mode=a.mode, global_std=a.global_std)

    @classmethod
    def rollout_guidance_scale(cls, cfg: Any) -> float:
        """The guidance scale its training rollouts sample at (``rollout_plan``'s): the sample
        section's; the memory planner asks it whether a sample runs two CFG rows."""
        return cfg.sample.guidance_scale

    @classmethod
    def trained_steps(cls, cfg: Any) -> int:
        """K, the most steps of one sample a training rollout records for the update (what
        ``rollout_plan`` hands the sampler; ``rollout.trained_step_count``): the memory
        planner counts the trajectories' latents with it."""
        s = cfg.sample
        return trained_step_count(
            s.num_steps,
            window_size=s.window_size if s.window_size > 0 else None,
            timestep_fraction=s.timestep_fraction,
            deterministic_last_step=s.deterministic_last_step,
        )

    def rollout_plan(self, step: int) -> RolloutPlan:
        """The training rollout of ``step`` (1-based): the sample section as it is (on the
        fixed-shift grid with ``sample.time_shift``)."""
        s = self.cfg.sample
        window = SDEWindow(s.window_size, s.window_lo, s.window_hi) if s.window_size > 0 else None
        if window is not None and s.window_draw == "step":  # one start for the whole step
            window = window.drawn_once(s.stochastic_steps(), seed=self.cfg.seed, step=step)
        grid = None if s.time_shift is None else time_shift_grid(s.num_steps, s.time_shift)
        return RolloutPlan(
            num_steps=s.num_steps,
            guidance_scale=self.rollout_guidance_scale(self.cfg),
            noise_level=s.noise_level,
            sde_type=s.sde_type,
            sde_window=window,
            timestep_fraction=s.timestep_fraction,
            deterministic_last_step=s.deterministic_last_step,
            sigmas=None if grid is None else grid.float(),
            branching=s.branching.spec(),
        )

    def rollout_weights(self) -> contextlib.AbstractContextManager:
        """The weights that sample training rollouts: the EMA with
        ``sample.use_ema_for_rollout``, else the live ones."""
        if self.cfg.sample.use_ema_for_rollout and self.engine.ema is not None:
            return self.engine.ema_weights()
        return contextlib.nullcontext()

    @abstractmethod
    def update(
        self,
        trajectory: Trajectory,
        advantages: torch.Tensor,
        *,
        step: int,
        sample_seeds: Sequence[int],
    ) -> dict[str, float]:
        """Train on this rank's rollout (``advantages`` [B], the samples' noise seeds) and
        return global metrics."""

    @staticmethod
    def per_sample_inputs(
        trajectory: Trajectory, advantages: torch.Tensor, sample_seeds: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``update``'s advantages [B] (fp32, on the trajectory's device) and sample seeds [B]
        (long), one line when either count differs from the trajectory's samples."""
        adv = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)
        if adv.numel() != len(trajectory) or len(sample_seeds) != len(trajectory):
            raise ValueError(
                f"got {adv.numel()} advantages and {len(sample_seeds)} seeds for "
                f"{len(trajectory)} samples"
            )
        seeds = torch.as_tensor(list(sample_seeds), dtype=torch.long)
        return adv.to(trajectory.latents.device), seeds

    # -- the loop every algorithm here shares ---------------------------------------------------
    def update_loop(
        self,
        trajectory: Trajectory,
        rows: torch.Tensor,
        keys: Sequence[str],
        micro_loss: Callable[[Trajectory, torch.Tensor, float, int], list[torch.Tensor]],
        num_terms: int,
    ) -> tuple[list[dict[str, float]], int]:
        """``update.num_minibatches`` optimizer steps over this rank's ``rows``, each
        accumulating micro-batches x ``num_terms`` loss terms (the trained steps, or the NFT
        timesteps). ``micro_loss(sub, rows, scale, k)`` returns [loss, *metrics] (``keys``),
        each a mean over the micro-batch; ``scale`` is 0 for a padding micro-batch. Each
        sample's term weighs dp_size / (minibatch samples on all ranks x num_terms), so the
        update is the mean over the minibatch and equals one process on the global batch.
        Returns one row of metrics (global means) per optimizer step taken, and the number of
        samples trained on over all ranks."""
        u, engine = self.cfg.update, self.engine
        out, plan = [], engine.plan(rows, u.num_minibatches, u.micro_batch_size)
        for mb in plan:
            sample_weight = engine.dp_size / (mb.total * num_terms)
            sums = torch.zeros(len(keys), dtype=torch.float64, device=engine.dist.device)
            n_tasks, done = len(mb.micro) * num_terms, 0
            for micro in mb.micro:
                sub = trajectory.select(micro.rows)
                weight = len(micro.rows) * sample_weight * micro.scale
                for k in range(num_terms):
                    done += 1
                    terms = micro_loss(sub, micro.rows, micro.scale, k)
                    engine.backward(terms[0] * weight, last=done == n_tasks)
                    sums += weight * torch.stack(
                        [t.detach().double().to(sums.device) for t in terms]
                    )
            stats = engine.mean_over_ranks(sums)  # one host sync per optimizer step
            row = {k: float(v) for k, v in zip(keys, stats, strict=True)}
            row.update(engine.optimizer_step(bool(torch.isfinite(stats).all())))
            out.append(row)
        engine.finish_update()
        return out, sum(mb.total for mb in plan)

    def summarize(self, rows: list[dict[str, float]], keys: Sequence[str]) -> dict[str, float]:
        """Means over the optimizer steps taken (zeros when none was), ``optimizer_steps``."""
        if rows:
            out = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
        else:  # nothing was trained: no optimizer step ran
            lr = float(self.engine.optimizer.param_groups[0]["lr"])
            out = {**dict.fromkeys(keys, 0.0), "grad_norm": 0.0, "lr": lr, "skipped": 0.0}
        out["optimizer_steps"] = float(sum(1 - r["skipped"] for r in rows))
        return out


__all__ = ["Algorithm", "RolloutPlan", "UpdateConfig"]
