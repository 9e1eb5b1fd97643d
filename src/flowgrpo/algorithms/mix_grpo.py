"""MixGRPO (Li et al., arXiv 2507.21802; Tencent-Hunyuan/MixGRPO): mixed ODE-SDE rollouts whose
SDE window slides over the denoising steps as training goes, only the window trained.

The rollout of training step s is Euler (ODE) before the window, SDE inside it, and Euler after
it, or with ``flash`` (MixGRPO-Flash) DPM-Solver++ 2M on a compressed grid after it. The window
is ``sde_window_at(s)``: it moves by ``stride`` every ``shift_interval`` steps and rolls back to
the start. The loss is Flow-GRPO's on the window's steps. The math:
``flowgrpo.algo.mix_grpo``; docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flowgrpo.algo.mix_grpo import flash_schedule, sde_window_at
from flowgrpo.algorithms.base import RolloutPlan
from flowgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from flowgrpo.rollout import SDEWindow
from flowgrpo.settings import ConfigError, ge, gt, need, setting


@dataclass
class MixGRPOConfig(FlowGRPOConfig):
    """Flow-GRPO's loss settings plus the sliding window and the Flash solver."""

    window_size: int = setting(4, "SDE (trained) steps per rollout (the authors: 4).", check=ge(1))
    shift_interval: int = setting(
        25,
        "Training steps between two moves of the window (MixGRPO 25, Flash 20).",
        check=ge(1),
    )
    stride: int = setting(
        1, "Steps the window moves by (0 = it stays at the start: Flash*).", check=ge(0)
    )
    roll_back: bool = setting(
        True, "Back to the first step once the window passes the last trainable step."
    )
    flash: bool = setting(
        False, "MixGRPO-Flash: DPM-Solver++ 2M on a compressed grid after the window."
    )
    compress_ratio: float = setting(
        0.4,
        "Flash: the post-window steps kept, as a fraction (Flash 0.4, Flash* 0.2).",
        check=gt(0),
    )
    flash_shift: float = setting(
        3.0,
        "Flash: the time shift of the compressed grid (the authors' FLUX value, 3).",
        check=gt(0),
    )


def window_at(cfg: Any, step: int) -> tuple[int, int]:
    """The SDE window [start, end) of training step ``step`` (1-based) under ``cfg``."""
    s = cfg.mix_grpo
    return sde_window_at(
        step - 1,
        num_steps=cfg.sample.num_steps,
        window_size=s.window_size,
        shift_interval=s.shift_interval,
        stride=s.stride,
        roll_back=s.roll_back,
    )


def check_schedule(cfg: Any) -> None:
    """Every step's window (and Flash grid) of the run, before it starts: the window moves only
    every ``shift_interval`` steps and takes at most N - 1 positions before it repeats (or stays),
    so checking the first step of each of the first N moves covers steps 1..max_steps. With
    ``roll_back=false`` a window that reaches the end stays empty for the rest of the run:
    refused, since every later step would train nothing."""
    s, n, last = cfg.mix_grpo, cfg.sample.num_steps, cfg.trainer.max_steps
    nominal = torch.linspace(1.0, 0.0, n + 1, dtype=torch.float64)
    moves = min((last - 1) // s.shift_interval, n)
    for step in (m * s.shift_interval + 1 for m in range(moves + 1)):
        start, end = window_at(cfg, step)
        if end > start and s.flash:
            flash_schedule(nominal, end, compress_ratio=s.compress_ratio, shift=s.flash_shift)
        if end <= start and not s.roll_back and s.stride > 0:
            raise ConfigError(
                f"mix_grpo.roll_back=false: the SDE window reaches the end of the {n}-step "
                f"schedule at step {step}, so steps {step}..{last} would train nothing; set "
                "mix_grpo.roll_back=true, a larger mix_grpo.shift_interval, or "
                f"trainer.max_steps={step - 1}"
            )


class MixGRPO(FlowGRPO):
    name = "mix_grpo"

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """Its window ends before the last two steps; it slides its own window and trains all
        of it, so Flow-GRPO-Fast's window and ``timestep_fraction`` are refused, not ignored;
        every step's schedule is checked (``check_schedule``)."""
        super().check_config(cfg)
        s = cfg.sample
        need(s.num_steps >= 3, "sample.num_steps", ">= 3 with algorithm=mix_grpo", s.num_steps)
        need(
            s.window_size == 0,
            "sample.window_size",
            "0 with algorithm=mix_grpo (it slides its own window: mix_grpo.window_size)",
            s.window_size,
        )
        need(
            s.timestep_fraction == 1.0,
            "sample.timestep_fraction",
            "1 with algorithm=mix_grpo (it trains every step of its window)",
            s.timestep_fraction,
        )
        check_schedule(cfg)

    def window(self, step: int) -> tuple[int, int]:
        """The SDE window [start, end) of training step ``step`` (1-based)."""
        return window_at(self.cfg, step)

    def rollout_plan(self, step: int) -> RolloutPlan:
        plan = super().rollout_plan(step)
        start, end = self.window(step)
        plan.timestep_fraction = 1.0
        if end <= start:  # the authors' empty window: an ODE rollout, nothing to train
            plan.sde_window, plan.noise_level, plan.train = None, 0.0, False
            return plan
        plan.sde_window = SDEWindow(end - start, start, end)
        if self.settings.flash:
            m = self.cfg.model
            grid = plan.sigmas  # the fixed-shift grid (sample.time_shift), else the pipeline's
            if grid is None:
                grid = self.adapter.schedule(plan.num_steps, m.height, m.width).sigmas
            plan.sigmas = flash_schedule(
                grid,
                end,
                compress_ratio=self.settings.compress_ratio,
                shift=self.settings.flash_shift,
            ).float()
            plan.ode_solver = "dpm2"
        return plan


__all__ = ["MixGRPO", "MixGRPOConfig"]
