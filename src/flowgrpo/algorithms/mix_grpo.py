"""MixGRPO (Li et al., arXiv 2507.21802; Tencent-Hunyuan/MixGRPO): mixed ODE-SDE rollouts whose
SDE window slides over the denoising steps as training goes, only the window trained.

The rollout of training step s is Euler (ODE) before the window, SDE inside it, and Euler after
it, or with ``flash`` (MixGRPO-Flash) DPM-Solver++ 2M (``flowgrpo.functional.dpm_solver``) on a
compressed grid after it, with the history of x̂0 = x − σ·v carried over from the window's
steps. The window is ``sde_window_at(s)``: it moves by ``stride`` every ``shift_interval`` steps
and rolls back to the start. The loss is Flow-GRPO's on the window's steps. docs/math.md
states the math.

Transcribed from the authors' code, Tencent-Hunyuan/MixGRPO @ e5cdd6a (last functional commit
33d8f56): ``fastvideo/utils/grpo_states.py`` (the window), ``fastvideo/utils/sampling_utils.py``
(the sampler) and ``fastvideo/train_grpo_flux.py``. Sampling with N steps on the grid
sigma_0 = 1 > ... > sigma_N = 0 and window [start, end): steps i < start are Euler (x + dt·v),
steps start <= i < end are Flow-GRPO SDE steps (the only trained ones), steps after the window
are Euler (MixGRPO) or, for MixGRPO-Flash, DPM-Solver++ 2M on ``flash_schedule``'s grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flowgrpo.algorithms.base import RolloutPlan
from flowgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from flowgrpo.rollout import SDEWindow
from flowgrpo.settings import ConfigError, ge, gt, need, setting

# -- the math: the sliding window and Flash's compressed grid ----------------------------------


def sde_window_at(
    train_step: int,
    *,
    num_steps: int,
    window_size: int,
    shift_interval: int,
    stride: int = 1,
    roll_back: bool = True,
) -> tuple[int, int]:
    """The SDE window [start, end) of step indices used by the rollout of ``train_step`` (0-based).

    The authors' ``GRPOTrainingStates`` with sample_strategy="progressive", prog_overlap=True
    (grpo_states.py:85-148; train_grpo_flux.py:915-947), in closed form. Let M = num_steps − 2
    (``max_timesteps``: the last step, into sigma = 0, and index M itself are never trained):
    the start moves by ``stride`` (``prog_overlap_step``) every ``shift_interval``
    (``iters_per_group``) training steps; once it would pass M it rolls back to 0
    (``roll_back=True``, as all scripts set) or stays at M (``roll_back=False``). The window is
    range(start, min(start + window_size, M)): it shrinks near the end and is EMPTY (start ==
    end == M) for ``shift_interval`` steps when start == M, during which the authors' loop
    still takes optimizer steps with no policy gradient. With prog_overlap=False the authors
    move by window_size: pass stride=window_size.

    Defaults (scripts/finetune/*.sh, FLUX, num_steps 25, window 4): MixGRPO shift_interval 25,
    stride 1; MixGRPO-Flash 20, 1; MixGRPO-Flash* 20, 0 (window frozen at [0, 4)).
    """
    if num_steps < 3:
        raise ValueError(
            f"num_steps must be >= 3 (the window ends before step N-2), got {num_steps}"
        )
    if window_size < 1 or shift_interval < 1 or stride < 0 or train_step < 0:
        raise ValueError(
            "need window_size >= 1, shift_interval >= 1, stride >= 0 and train_step >= 0, got "
            f"{window_size}, {shift_interval}, {stride}, {train_step}"
        )
    last = num_steps - 2  # the authors' max_timesteps
    moves = train_step // shift_interval
    if stride == 0:
        start = 0
    elif roll_back:
        positions = last // stride + 1  # starts 0, stride, ..., <= last; then back to 0
        start = stride * (moves % positions)
    else:
        start = min(stride * moves, last)
    return start, min(start + window_size, last)


def flash_schedule(
    sigmas: torch.Tensor,
    window_end: int,
    *,
    compress_ratio: float,
    shift: float,
) -> torch.Tensor:
    """MixGRPO-Flash's grid: sigmas[:window_end + 1] then a compressed post-window tail to 0.

    sigmas: the N + 1 sigmas of the rollout (1 ... 0); window_end: the SDE window's exclusive
    end (``sde_window_at(...)[1]``, >= 1). With L = window_end − 1 (the authors'
    ``last_false_index``) and n = int(max((N − L)·compress_ratio, 1)), the tail is
    shift(linspace(t_L+1, 0, n)), with shift(t) = s·t / (1 + (s − 1)·t) and t_L+1 the
    unshifted time of sigma_L+1 (sampling_utils.py:29-54): n − 1 DPM-Solver steps after the
    window instead of N − 1 − L. Returns [L + n + 1] fp64 sigmas (the tail's first entry is
    sigma_L+1 exactly).

    The authors take t_L+1 = linspace(1, 0, N + 1)[L + 1], i.e. they assume the grid is
    shift(linspace(1, 0, N + 1)) (their FLUX grid); here t_L+1 = shift⁻¹(sigma_L+1), which is
    the same on that grid and stays continuous on any shifted grid. A late window with a small
    ratio leaves n = 1 (e.g. the window ending at 7 of 10 at ratio 0.4): the authors' tail would
    then be the single point sigma_L+1 and their image would keep that noise; here the tail is
    then [sigma_L+1, 0], one (first-order, i.e. Euler) step to 0. An empty window (their code
    crashes on it) has no Flash tail: sample it with Euler.
    Defaults: compress_ratio 0.4 (MixGRPO-Flash), 0.2 (Flash*), shift 3 (FLUX, 25 steps).
    """
    sig = torch.as_tensor(sigmas, dtype=torch.float64).reshape(-1)
    n_steps = sig.numel() - 1
    if not 1 <= window_end <= n_steps - 1:
        raise ValueError(f"window_end must be in [1, {n_steps - 1}], got {window_end}")
    if compress_ratio <= 0 or shift <= 0:
        raise ValueError(f"compress_ratio and shift must be > 0, got {compress_ratio}, {shift}")
    last = window_end - 1
    n_post = int(max((n_steps - last) * compress_ratio, 1))  # sampling_utils.py:44
    n_post = max(n_post, 2)  # one point would stop at sigma_L+1 > 0: one step to 0 instead
    s_start = float(sig[last + 1])
    t_start = s_start / (shift - (shift - 1) * s_start)  # inverse of the shift
    t_post = torch.linspace(t_start, 0.0, n_post, dtype=torch.float64)
    post = shift * t_post / (1 + (shift - 1) * t_post)
    post[0] = s_start
    return torch.cat([sig[: last + 1], post])


# -- the algorithm ---------------------------------------------------------------------------


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
        if end > start:  # a tree's splits must fall inside every window it is sampled in
            where = f"mix_grpo's window [{start}, {end}) at step {step}"
            cfg.sample.branching.check_steps(end - start, where, cfg.sample.group_size)
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
    settings_class = MixGRPOConfig

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

    @classmethod
    def trained_steps(cls, cfg) -> int:
        """The largest SDE window of the run's steps (``window_at``; it moves every
        ``shift_interval`` steps, as ``check_schedule`` walks it)."""
        s, last = cfg.mix_grpo, cfg.trainer.max_steps
        moves = min((last - 1) // s.shift_interval, cfg.sample.num_steps)
        sizes = [
            end - start
            for start, end in (window_at(cfg, m * s.shift_interval + 1) for m in range(moves + 1))
        ]
        return max(1, *sizes)

    def rollout_plan(self, step: int) -> RolloutPlan:
        plan = super().rollout_plan(step)
        start, end = self.window(step)
        plan.timestep_fraction = 1.0
        if end <= start:  # the authors' empty window: an ODE rollout, nothing to train
            plan.sde_window, plan.noise_level, plan.train = None, 0.0, False
            plan.branching = None
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


__all__ = ["MixGRPO", "MixGRPOConfig", "flash_schedule", "sde_window_at"]
