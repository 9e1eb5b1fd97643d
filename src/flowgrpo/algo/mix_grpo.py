"""MixGRPO: a sliding SDE window over the denoising steps, and MixGRPO-Flash's ODE solver.

Li et al., "MixGRPO: Unlocking Flow-based GRPO Efficiency with Mixed ODE-SDE", arXiv
2507.21802. Transcribed from the authors' code, Tencent-Hunyuan/MixGRPO @ e5cdd6a (last
functional commit 33d8f56): ``fastvideo/utils/grpo_states.py`` (the window),
``fastvideo/utils/sampling_utils.py`` (the sampler) and ``fastvideo/train_grpo_flux.py``.

Sampling with N steps on the grid sigma_0 = 1 > ... > sigma_N = 0 and window [start, end):
steps i < start are Euler (x + dt·v), steps start <= i < end are Flow-GRPO SDE steps (the only
trained ones), steps after the window are Euler (MixGRPO) or, for MixGRPO-Flash, DPM-Solver++
2M on a compressed grid (``flash_schedule``), with the history of x̂0 = x − σ·v carried over
from the window's steps.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


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


def time_shift_grid(num_steps: int, shift: float) -> torch.Tensor:
    """The fixed-shift grid the MixGRPO authors sample on: sigma = s·t / (1 + (s − 1)·t) at
    t = linspace(1, 0, N + 1) (``sd3_time_shift(3, ...)``, sampling_utils.py:18-20, 25 steps),
    [N + 1] fp64 from 1 to 0. FLUX's pipeline instead shifts by a resolution-dependent mu
    (1.88 at 512²), so each window position would train different noise levels."""
    if num_steps < 1 or shift <= 0:
        raise ValueError(f"need num_steps >= 1 and shift > 0, got {num_steps}, {shift}")
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return shift * t / (1 + (shift - 1) * t)


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


class DPMSolverStep(NamedTuple):
    """prev_sample: x at sigma_next (input dtype); x0_pred: x̂0 = x − σ·v (fp32), the history
    entry to pass as ``prev_x0`` to the next step."""

    prev_sample: torch.Tensor
    x0_pred: torch.Tensor


def _lambda(sigma: float) -> float:
    """log-SNR λ = log((1 − σ)/σ) of flow matching (alpha = 1 − σ); −inf at σ = 1."""
    return -math.inf if sigma >= 1.0 else math.log(1.0 - sigma) - math.log(sigma)


def dpm_solver_2m_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: float,
    sigma_next: float,
    *,
    prev_x0: torch.Tensor | None = None,
    sigma_prev: float | None = None,
) -> DPMSolverStep:
    """One DPM-Solver++(2M) "midpoint" step of a flow-matching ODE, data prediction.

    model_output: velocity v [B, ...]; sample: x at ``sigma`` [B, ...]; sigma, sigma_next:
    floats (one grid for the batch, as the authors' sampler). With alpha = 1 − σ,
    λ = log(alpha/σ), h = λ(sigma_next) − λ(sigma), x̂0 = x − σ·v (sampling_utils.py:387-396):

    first order (no ``prev_x0``, or sigma_next == 0; equals the Euler step x + dt·v exactly):
        x' = (σ'/σ)·x − alpha'·(e^{−h} − 1)·x̂0
    second order (prev_x0 = x̂0 of the previous step, taken at ``sigma_prev``):
        r0 = (λ(σ) − λ(sigma_prev))/h, D1 = (x̂0 − prev_x0)/r0
        x' = (σ'/σ)·x − alpha'·(e^{−h} − 1)·x̂0 − ½·alpha'·(e^{−h} − 1)·D1
    (sampling_utils.py:398-447, 449-526; NVlabs/DiffusionNFT ``solver.py:207-350`` is the same
    solver, as is diffusers' DPMSolverMultistepScheduler(algorithm_type="dpmsolver++",
    solver_order=2, prediction_type="flow_prediction", use_flow_sigmas=True)).

    The authors pick first order by index (the first step, and the final one into σ = 0,
    ``lower_order_final``); here by the missing history and sigma_next == 0, which is the same on
    their grids (2M into σ = 0 would divide by r0 = 0). sigma_prev == 1 gives λ = −∞, so
    D1 = 0 (a first-order step), as their tensors' infinities do. Coefficients in fp64,
    tensors in fp32 (fp64 for fp64 inputs).
    """
    if model_output.shape != sample.shape:
        raise ValueError(
            f"model_output {tuple(model_output.shape)} and sample {tuple(sample.shape)} differ"
        )
    sigma, sigma_next = float(sigma), float(sigma_next)
    if not 0.0 <= sigma_next < sigma <= 1.0:
        raise ValueError(f"need 0 <= sigma_next < sigma <= 1, got {sigma_next}, {sigma}")
    if (prev_x0 is None) != (sigma_prev is None):
        raise ValueError("prev_x0 and sigma_prev go together (both or neither)")

    compute = torch.promote_types(sample.dtype, torch.float32)
    x = sample.to(compute)
    x0 = x - sigma * model_output.to(compute)
    alpha_next = 1.0 - sigma_next
    # e^{-h} = (σ'·alpha)/(alpha'·σ): no logarithm, exact at σ = 1 (alpha = 0) and σ' = 0.
    exp_neg_h = (sigma_next * (1.0 - sigma)) / (alpha_next * sigma)
    out = (sigma_next / sigma) * x - (alpha_next * (exp_neg_h - 1.0)) * x0

    if prev_x0 is not None and sigma_next > 0.0:
        if prev_x0.shape != sample.shape:
            raise ValueError(f"prev_x0 {tuple(prev_x0.shape)} and sample differ in shape")
        sigma_prev = float(sigma_prev)
        if not sigma < sigma_prev <= 1.0:
            raise ValueError(f"need sigma < sigma_prev <= 1, got {sigma}, {sigma_prev}")
        h = _lambda(sigma_next) - _lambda(sigma)
        h_0 = _lambda(sigma) - _lambda(sigma_prev)
        inv_r0 = h / h_0  # 0 when sigma_prev == 1 (h_0 = inf)
        d1 = inv_r0 * (x0 - prev_x0.to(compute))
        out = out - 0.5 * (alpha_next * (exp_neg_h - 1.0)) * d1
    return DPMSolverStep(out.to(sample.dtype), x0)
