"""DPM-Solver++(2M) for flow-matching ODEs: the sampler's ``ode_solver="dpm2"`` steps.

MixGRPO-Flash samples its post-window steps with it (Li et al., arXiv 2507.21802;
Tencent-Hunyuan/MixGRPO ``fastvideo/utils/sampling_utils.py``) and DiffusionNFT its whole
rollout (NVlabs/DiffusionNFT ``solver.py``); it is the same solver as diffusers'
DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2,
prediction_type="flow_prediction", use_flow_sigmas=True).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


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
